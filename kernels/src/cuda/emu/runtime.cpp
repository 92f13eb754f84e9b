// The emulated device's block runner: the threads of one block as cooperative fibers on the
// calling OS thread, with __syncthreads() as a block barrier, warp collectives through
// per-warp slots, mma.sync.m16n8k16 with the PTX ISA's fragment layout, and faults in
// device memory turned into errors (emu/launch.rs spreads the blocks over rayon).
//
// Scheduling: the fibers run in passes. A pass resumes every ready fiber once, in the
// launch's order (forward, reverse, or a seeded shuffle); each runs until it reaches a
// barrier or a warp collective, or exits. Between passes, a barrier every live thread has
// reached opens, and so does a collective every lane of its mask has reached (threads that
// have exited count as arrived at __syncthreads, as on sm_70 and later). A pass after which
// nothing can run or open is a deadlock, reported with what each thread waits on.
//
// Because the fibers of one phase run one after another, a missing __syncthreads() or a read
// of a value another thread has not written yet changes the result with the order: running
// the same launch forward, reversed and shuffled shows such races.

#include "cuda_emu.h"

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <vector>

#if !defined(__x86_64__) || !defined(__linux__)
#error "the CUDA emulator runs on x86-64 Linux"
#endif

namespace tp_emu {

thread_local __attribute__((tls_model("initial-exec"))) dim3 block_idx;
thread_local __attribute__((tls_model("initial-exec"))) dim3 block_dim;
thread_local __attribute__((tls_model("initial-exec"))) dim3 grid_dim;
thread_local __attribute__((tls_model("initial-exec"))) const dim3* thread_idx;

}  // namespace tp_emu

// Saves the callee-saved registers and the FPU control words on the current stack, stores
// the stack pointer in *save_sp, and resumes the context whose stack pointer is load_sp.
extern "C" void tp_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl tp_emu_switch
    .hidden tp_emu_switch
    .type tp_emu_switch, @function
tp_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tp_emu_switch, .-tp_emu_switch
)");

namespace {

// What ended a block early (TpBlockError::kind).
enum ErrorKind : int { OK = 0, FAULT = 1, TRAP = 2, DEADLOCK = 3, COLLECTIVE = 4, STACK_OVERFLOW = 5, SHARED_OVERFLOW = 6 };

enum class State : unsigned char { Ready, AtBarrier, AtWarp, Exited };

// One queued cp.async (tp_emu::cp_async): performed by the wait that covers its group.
struct AsyncCopy {
    void* dst;
    const void* src;
    int bytes, src_bytes;
    unsigned long long group;
};

struct Fiber {
    void* sp;
    dim3 idx;
    State state;
    unsigned int lane, warp;
    unsigned int mask;        // the collective's mask while AtWarp
    unsigned long long seq;   // collectives this lane has completed
    char* stack_base;         // the mapping: a guard page, then the stack
    char* stack_top;
    std::vector<AsyncCopy> copies;  // cp.async copies not yet waited for, oldest first
    unsigned long long groups;      // cp.async groups committed
};

// One warp's exchange slots, double-buffered by the parity of the collective's sequence
// number: lanes of collective s write slots[s & 1] while slower lanes may still read
// slots[(s - 1) & 1].
struct WarpSlots {
    alignas(16) unsigned char slots[2][32][32];
};

}  // namespace

// The error a block reports to Rust (emu/ffi.rs mirrors it).
extern "C" struct TpBlockError {
    int kind;
    int is_write;
    unsigned long long address;
    dim3 thread;
    char message[512];
};

namespace {

constexpr size_t STACK_BYTES = 128 * 1024;
constexpr size_t GUARD_BYTES = 4096;

struct BlockRun {
    void (*kernel)(void**);
    void** args;
    void* dynamic_shared;
    std::vector<Fiber> fibers;
    std::vector<WarpSlots> warps;
    void* scheduler_sp;
    Fiber* current;
    TpBlockError* error;
};

thread_local __attribute__((tls_model("initial-exec"))) BlockRun* running;
thread_local std::vector<char*> stacks;  // base of each fiber stack; its guard page is first

// This OS thread's dynamic shared memory: `capacity` bytes that end at a guard page.
thread_local char* shared_base;
thread_local size_t shared_capacity;

size_t page_round(size_t bytes) { return (bytes + GUARD_BYTES - 1) / GUARD_BYTES * GUARD_BYTES; }

// `bytes` of dynamic shared memory ending at a guard page, poisoned with 0xff (the GPU
// leaves it uninitialised): an access past the end faults, a read before a write gives NaN.
char* dynamic_shared_memory(size_t bytes) {
    if (bytes == 0) return nullptr;
    if (page_round(bytes) > shared_capacity) {
        if (shared_base) munmap(shared_base, shared_capacity + GUARD_BYTES);
        shared_capacity = page_round(bytes);
        void* p = mmap(nullptr, shared_capacity + GUARD_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            shared_base = nullptr;
            shared_capacity = 0;
            return nullptr;
        }
        shared_base = static_cast<char*>(p);
        mprotect(shared_base + shared_capacity, GUARD_BYTES, PROT_NONE);
    }
    char* start = shared_base + shared_capacity - bytes;
    std::memset(start, 0xff, bytes);
    return start;
}

bool in_shared_guard(unsigned long long address) {
    const unsigned long long end = reinterpret_cast<unsigned long long>(shared_base) + shared_capacity;
    return shared_base && address >= end && address < end + GUARD_BYTES;
}

void fail(int kind, const char* format, ...) {
    BlockRun* run = running;
    if (run->error->kind != OK) return;
    run->error->kind = kind;
    if (run->current) run->error->thread = run->current->idx;
    va_list list;
    va_start(list, format);
    vsnprintf(run->error->message, sizeof run->error->message, format, list);
    va_end(list);
}

// Leaves the running fiber for good (its block has failed).
[[noreturn]] void abandon_fiber() {
    BlockRun* run = running;
    Fiber* f = run->current;
    f->state = State::Exited;
    tp_emu_switch(&f->sp, run->scheduler_sp);
    __builtin_unreachable();
}

// Parks the running fiber in `state` until the scheduler resumes it.
void park(State state) {
    BlockRun* run = running;
    Fiber* f = run->current;
    f->state = state;
    tp_emu_switch(&f->sp, run->scheduler_sp);
    if (run->error->kind != OK) abandon_fiber();
}

extern "C" void tp_emu_fiber_start() {
    BlockRun* run = running;
    run->kernel(run->args);
    abandon_fiber();
}

// Where a faulting fiber continues (on a fresh frame of its own stack) after the handler.
extern "C" void tp_emu_fault_landing() { abandon_fiber(); }

char* map_stack(size_t i) {
    while (stacks.size() <= i) {
        void* p = mmap(nullptr, STACK_BYTES + GUARD_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED) return nullptr;
        mprotect(p, GUARD_BYTES, PROT_NONE);
        stacks.push_back(static_cast<char*>(p));
    }
    return stacks[i];
}

// A fresh stack for fiber `f` whose first switch enters tp_emu_fiber_start.
void prepare(Fiber* f) {
    // Frame read by tp_emu_switch: control words, r15..rbp, return address; the word
    // above is the (never used) return address of tp_emu_fiber_start.
    unsigned long long* top = reinterpret_cast<unsigned long long*>(f->stack_top);
    unsigned long long* sp = top - 9;
    sp[0] = 0x1f80ull | (0x037full << 32);  // MXCSR at (%rsp), the x87 control word at 4(%rsp): defaults
    for (int i = 1; i <= 6; ++i) sp[i] = 0;
    sp[7] = reinterpret_cast<unsigned long long>(&tp_emu_fiber_start);
    sp[8] = 0;
    f->sp = sp;
}

// Address-ordered xorshift for the shuffled schedule.
unsigned long long next_random(unsigned long long* state) {
    unsigned long long x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

const char* state_name(State s) {
    switch (s) {
        case State::Ready: return "running";
        case State::AtBarrier: return "__syncthreads()";
        case State::AtWarp: return "a warp collective";
        default: return "exited";
    }
}

// Opens the collectives whose lanes have all arrived; false after reporting misuse.
bool open_collectives(BlockRun* run, bool* opened) {
    const size_t n = run->fibers.size();
    for (size_t w = 0; w < run->warps.size(); ++w) {
        const size_t first = w * 32, lanes = n - first < 32 ? n - first : 32;
        for (size_t l = 0; l < lanes; ++l) {
            Fiber& f = run->fibers[first + l];
            if (f.state != State::AtWarp) continue;
            bool complete = true;
            for (unsigned int j = 0; j < 32; ++j) {
                if (!((f.mask >> j) & 1u)) continue;
                if (j >= lanes) {
                    run->current = &f;
                    fail(COLLECTIVE, "warp collective mask 0x%08x names lane %u, which warp %zu does not have", f.mask, j, w);
                    return false;
                }
                Fiber& other = run->fibers[first + j];
                if (other.state == State::Exited) {
                    run->current = &f;
                    fail(COLLECTIVE, "warp collective (mask 0x%08x) waits for lane %u of warp %zu, which has exited", f.mask,
                         j, w);
                    return false;
                }
                if (other.state != State::AtWarp) {
                    complete = false;
                    continue;
                }
                if (other.mask != f.mask || other.seq != f.seq) {
                    run->current = &f;
                    fail(COLLECTIVE,
                         "divergent warp collectives in warp %zu: lane %zu (mask 0x%08x, collective #%llu) and lane %u "
                         "(mask 0x%08x, collective #%llu)",
                         w, l, f.mask, f.seq, j, other.mask, other.seq);
                    return false;
                }
            }
            if (!complete) continue;
            const unsigned int mask = f.mask;
            for (unsigned int j = 0; j < lanes; ++j) {
                if ((mask >> j) & 1u) run->fibers[first + j].state = State::Ready;
            }
            *opened = true;
        }
    }
    return true;
}

void report_deadlock(BlockRun* run) {
    size_t counts[4] = {0, 0, 0, 0};
    const Fiber* first_warp = nullptr;
    const Fiber* first_barrier = nullptr;
    for (const Fiber& f : run->fibers) {
        counts[(int)f.state]++;
        if (f.state == State::AtWarp && !first_warp) first_warp = &f;
        if (f.state == State::AtBarrier && !first_barrier) first_barrier = &f;
    }
    run->current = nullptr;
    fail(DEADLOCK,
         "deadlock: %zu threads wait at __syncthreads() (first: thread (%u,%u,%u)), %zu at warp collectives (first: "
         "thread (%u,%u,%u)), %zu have exited; a barrier or collective is reached by only part of the block or warp",
         counts[(int)State::AtBarrier], first_barrier ? first_barrier->idx.x : 0, first_barrier ? first_barrier->idx.y : 0,
         first_barrier ? first_barrier->idx.z : 0, counts[(int)State::AtWarp], first_warp ? first_warp->idx.x : 0,
         first_warp ? first_warp->idx.y : 0, first_warp ? first_warp->idx.z : 0, counts[(int)State::Exited]);
    (void)state_name;
}

struct sigaction previous_segv;
struct sigaction previous_bus;

bool in_stack_guard(const Fiber* f, unsigned long long address) {
    const unsigned long long guard = reinterpret_cast<unsigned long long>(f->stack_base);
    return address >= guard && address < guard + GUARD_BYTES;
}

void chain(const struct sigaction& previous, int sig, siginfo_t* info, void* context) {
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, context);
    } else if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
        signal(sig, SIG_DFL);  // the fault repeats on return and ends the process as before
    } else {
        previous.sa_handler(sig);
    }
}

// A fault inside a fiber becomes the block's error: the fiber continues in
// tp_emu_fault_landing, which leaves it; any other fault goes to the previous handler.
void on_fault(int sig, siginfo_t* info, void* context) {
    BlockRun* run = running;
    if (!run || !run->current) {
        chain(sig == SIGSEGV ? previous_segv : previous_bus, sig, info, context);
        return;
    }
    ucontext_t* uc = static_cast<ucontext_t*>(context);
    Fiber* f = run->current;
    const unsigned long long address = reinterpret_cast<unsigned long long>(info->si_addr);
    if (run->error->kind == OK) {
        run->error->kind = in_stack_guard(f, address) ? STACK_OVERFLOW : in_shared_guard(address) ? SHARED_OVERFLOW : FAULT;
        run->error->is_write = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
        run->error->address = address;
        run->error->thread = f->idx;
    }
    unsigned long long rsp = (reinterpret_cast<unsigned long long>(f->stack_top) - 256) & ~15ull;
    uc->uc_mcontext.gregs[REG_RSP] = (greg_t)(rsp - 8);
    uc->uc_mcontext.gregs[REG_RIP] = (greg_t)&tp_emu_fault_landing;
}

void install_fault_handler() {
    static bool installed = false;
    static int lock = 0;
    if (__atomic_load_n(&installed, __ATOMIC_ACQUIRE)) return;
    while (__atomic_exchange_n(&lock, 1, __ATOMIC_ACQUIRE)) {
    }
    if (!installed) {
        struct sigaction action;
        std::memset(&action, 0, sizeof action);
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        sigaction(SIGSEGV, &action, &previous_segv);
        sigaction(SIGBUS, &action, &previous_bus);
        __atomic_store_n(&installed, true, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&lock, 0, __ATOMIC_RELEASE);
}

}  // namespace

namespace tp_emu {

void syncthreads() { park(State::AtBarrier); }

// Writes this lane's value, waits for the collective to open; returns the slot array.
static const unsigned char (*exchange(unsigned int mask, const void* mine, unsigned int bytes))[32] {
    BlockRun* run = running;
    Fiber* f = run->current;
    if (!((mask >> f->lane) & 1u)) {
        fail(COLLECTIVE, "lane %u calls a warp collective whose mask 0x%08x leaves it out", f->lane, mask);
        abandon_fiber();
    }
    WarpSlots& w = run->warps[f->warp];
    std::memcpy(w.slots[f->seq & 1][f->lane], mine, bytes);
    f->mask = mask;
    park(State::AtWarp);
    const unsigned char(*slots)[32] = w.slots[f->seq & 1];
    f->seq++;
    return slots;
}

const void* warp_exchange(unsigned int mask, const void* mine, unsigned int bytes, int source) {
    const unsigned char(*slots)[32] = exchange(mask, mine, bytes);
    if (source < 0) return nullptr;
    if (source > 31 || !((mask >> source) & 1u)) {
        fail(COLLECTIVE, "shuffle reads lane %d, which is not in its mask 0x%08x", source, mask);
        abandon_fiber();
    }
    return slots[source];
}

// PTX ISA, "Matrix Fragments for mma.m16n8k16" (bf16), with g = lane / 4 and t = lane % 4:
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c/d0,1 = D[g][2t..2t+1], d2,3 = D[g+8][2t..2t+1].
// The lower-indexed element of a pair is the low 16 bits. Products of bf16 are exact in f32;
// they are summed in k order onto the accumulator (the tensor cores' order may differ).
void mma_m16n8k16_bf16(float* d, const unsigned int* a, const unsigned int* b) {
    struct Fragments {
        unsigned int a[4], b[2];
    } mine;
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, b, sizeof mine.b);
    const unsigned char(*slots)[32] = exchange(0xffffffffu, &mine, sizeof mine);
    auto lane_of = [&](unsigned int l) {
        Fragments f;
        std::memcpy(&f, slots[l], sizeof f);
        return f;
    };
    auto lo = [](unsigned int v) { return __uint_as_float((v & 0xffffu) << 16); };
    auto hi = [](unsigned int v) { return __uint_as_float(v & 0xffff0000u); };
    const unsigned int lane = running->current->lane, g = lane >> 2, t = lane & 3;
    float arow[2][16], bcol[2][16];  // A rows g and g+8; B columns 2t and 2t+1
    for (unsigned int tt = 0; tt < 4; ++tt) {
        Fragments f = lane_of(g * 4 + tt);
        arow[0][2 * tt] = lo(f.a[0]), arow[0][2 * tt + 1] = hi(f.a[0]);
        arow[1][2 * tt] = lo(f.a[1]), arow[1][2 * tt + 1] = hi(f.a[1]);
        arow[0][2 * tt + 8] = lo(f.a[2]), arow[0][2 * tt + 9] = hi(f.a[2]);
        arow[1][2 * tt + 8] = lo(f.a[3]), arow[1][2 * tt + 9] = hi(f.a[3]);
        for (unsigned int c = 0; c < 2; ++c) {
            Fragments fb = lane_of((2 * t + c) * 4 + tt);
            bcol[c][2 * tt] = lo(fb.b[0]), bcol[c][2 * tt + 1] = hi(fb.b[0]);
            bcol[c][2 * tt + 8] = lo(fb.b[1]), bcol[c][2 * tt + 9] = hi(fb.b[1]);
        }
    }
    for (int e = 0; e < 4; ++e) {
        const float* row = arow[e >> 1];
        const float* col = bcol[e & 1];
        float acc = d[e];
        for (int k = 0; k < 16; ++k) acc += row[k] * col[k];
        d[e] = acc;
    }
}

// Every lane's row address goes through the warp's slots; each lane then reads its values of
// the four matrices straight from (shared) memory: row l / 4, columns 2·(l % 4) and 2·(l % 4) + 1
// of each, or with `trans` rows 2·(l % 4) and 2·(l % 4) + 1 of column l / 4.
void ldmatrix_x4(unsigned int* d, const void* row, bool trans) {
    if (reinterpret_cast<unsigned long long>(row) & 15u) {
        fail(FAULT, "ldmatrix row address %p is not a multiple of 16 bytes", row);
        abandon_fiber();
    }
    const unsigned char(*slots)[32] = exchange(0xffffffffu, &row, sizeof row);
    auto row_of = [&](unsigned int l) {
        const unsigned short* r;
        std::memcpy(&r, slots[l], sizeof r);
        return r;
    };
    const unsigned int lane = running->current->lane, g = lane >> 2, t = lane & 3;
    for (unsigned int j = 0; j < 4; ++j) {
        unsigned int lo, hi;
        if (trans) {
            lo = row_of(8 * j + 2 * t)[g];
            hi = row_of(8 * j + 2 * t + 1)[g];
        } else {
            lo = row_of(8 * j + g)[2 * t];
            hi = row_of(8 * j + g)[2 * t + 1];
        }
        d[j] = lo | (hi << 16);
    }
}

void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    const unsigned long long misaligned =
        (reinterpret_cast<unsigned long long>(dst) | reinterpret_cast<unsigned long long>(src)) & (unsigned)(bytes - 1);
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes < 0 || src_bytes > bytes || misaligned) {
        fail(FAULT, "cp.async of %d bytes (%d read) between %p and %p: sizes 4, 8 or 16, addresses multiples of it",
             bytes, src_bytes, dst, src);
        abandon_fiber();
    }
    Fiber* f = running->current;
    f->copies.push_back(AsyncCopy{dst, src, bytes, src_bytes, f->groups});
}

void cp_async_commit() { running->current->groups++; }

void cp_async_wait(int n) {
    Fiber* f = running->current;
    size_t done = 0;
    for (; done < f->copies.size(); ++done) {
        const AsyncCopy& c = f->copies[done];
        if (c.group + (unsigned long long)n >= f->groups) break;  // among the n most recent, or uncommitted
        std::memcpy(c.dst, c.src, (size_t)c.src_bytes);
        std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
    }
    f->copies.erase(f->copies.begin(), f->copies.begin() + (long)done);
}

void trap() {
    fail(TRAP, "the kernel executed __trap()");
    abandon_fiber();
}

void* dynamic_shared() { return running->dynamic_shared; }

}  // namespace tp_emu

// Emulated device memory: `bytes` (a multiple of the page size) of zeros between two guard
// pages, so that an access just before or past the block faults. Null when the map fails.
extern "C" void* tp_emu_map(size_t bytes) {
    void* p = mmap(nullptr, bytes + 2 * GUARD_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    char* start = static_cast<char*>(p) + GUARD_BYTES;
    if (mprotect(start, bytes, PROT_READ | PROT_WRITE) != 0) {
        munmap(p, bytes + 2 * GUARD_BYTES);
        return nullptr;
    }
    return start;
}

// Returns a block of tp_emu_map to the system.
extern "C" void tp_emu_unmap(void* start, size_t bytes) { munmap(static_cast<char*>(start) - GUARD_BYTES, bytes + 2 * GUARD_BYTES); }

// The guard and page size of tp_emu_map.
extern "C" size_t tp_emu_page_bytes() { return GUARD_BYTES; }

// Runs block `block_index` of a launch of `kernel` (a generated trampoline that unpacks
// `args`) with `block` threads; `order` 0 forward, 1 reverse, 2 shuffled by `seed`.
// Returns 0, or the error kind with `error` filled in.
extern "C" int tp_emu_run_block(void (*kernel)(void**), void** args, dim3 grid, dim3 block, dim3 block_index,
                                size_t dynamic_shared_bytes, int order, unsigned long long seed, TpBlockError* error) {
    install_fault_handler();
    static thread_local BlockRun run;
    const size_t n = (size_t)block.x * block.y * block.z;
    std::memset(error, 0, sizeof *error);
    run.kernel = kernel;
    run.args = args;
    run.dynamic_shared = dynamic_shared_memory(dynamic_shared_bytes);
    if (dynamic_shared_bytes && !run.dynamic_shared) {
        snprintf(error->message, sizeof error->message, "cannot map %zu bytes of dynamic shared memory", dynamic_shared_bytes);
        return error->kind = FAULT;
    }
    run.error = error;
    run.current = nullptr;
    run.fibers.resize(n);
    run.warps.resize((n + 31) / 32);
    for (size_t i = 0; i < n; ++i) {
        char* base = map_stack(i);
        if (!base) {
            snprintf(error->message, sizeof error->message, "cannot map a stack for emulated thread %zu", i);
            return error->kind = FAULT;
        }
        Fiber& f = run.fibers[i];
        f.idx = dim3{(unsigned int)(i % block.x), (unsigned int)(i / block.x % block.y),
                     (unsigned int)(i / ((size_t)block.x * block.y))};
        f.state = State::Ready;
        f.lane = (unsigned int)(i & 31);
        f.warp = (unsigned int)(i >> 5);
        f.mask = 0;
        f.seq = 0;
        f.copies.clear();
        f.groups = 0;
        // Stack tops 132 KiB apart would all fall in one cache set; shifting each by a
        // different multiple of 64 bytes (up to 64 KiB) spreads them over the sets.
        f.stack_base = base;
        f.stack_top = base + GUARD_BYTES + STACK_BYTES - (i % 1024) * 64;
        prepare(&f);
    }
    tp_emu::block_idx = block_index;
    tp_emu::block_dim = block;
    tp_emu::grid_dim = grid;
    running = &run;
    std::vector<unsigned int> ready;
    ready.reserve(n);
    unsigned long long random = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    for (;;) {
        ready.clear();
        for (size_t i = 0; i < n; ++i) {
            if (run.fibers[i].state == State::Ready) ready.push_back((unsigned int)i);
        }
        if (order == 1) {
            for (size_t i = 0, j = ready.size(); i + 1 < j; ++i, --j) std::swap(ready[i], ready[j - 1]);
        } else if (order == 2) {
            for (size_t i = ready.size(); i > 1; --i) std::swap(ready[i - 1], ready[next_random(&random) % i]);
        }
        for (unsigned int i : ready) {
            Fiber& f = run.fibers[i];
            run.current = &f;
            tp_emu::thread_idx = &f.idx;
            tp_emu_switch(&run.scheduler_sp, f.sp);
            run.current = nullptr;
            if (error->kind != OK) break;
        }
        if (error->kind != OK) break;
        size_t live = 0, at_barrier = 0;
        for (const Fiber& f : run.fibers) {
            live += f.state != State::Exited;
            at_barrier += f.state == State::AtBarrier;
        }
        if (live == 0) break;
        bool opened = false;
        if (at_barrier == live) {
            for (Fiber& f : run.fibers) {
                if (f.state == State::AtBarrier) f.state = State::Ready;
            }
            opened = true;
        } else if (!open_collectives(&run, &opened)) {
            break;
        }
        if (!opened) {
            report_deadlock(&run);
            break;
        }
    }
    running = nullptr;
    tp_emu::thread_idx = nullptr;
    return error->kind;
}

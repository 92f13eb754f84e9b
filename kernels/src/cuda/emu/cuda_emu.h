// The CUDA dialect of kernels/src/cuda/kernels/*.cu, for the host C++ compiler.
//
// build.rs compiles each kernel family as one C++ translation unit: this header, then
// common.cuh and the family's .cu file (with `extern "C" __global__` turned into `static`),
// then a generated table of trampolines. The threads of a block run as cooperative fibers
// on one OS thread (runtime.cpp), so:
//   __shared__           -> a thread_local static: one copy per OS thread, i.e. per block
//   threadIdx            -> the running fiber's index; blockIdx/blockDim/gridDim per OS thread
//   __syncthreads()      -> a block barrier (the fiber yields to the scheduler)
//   __shfl_*_sync        -> a warp collective through per-warp slots
//   atomicAdd            -> a real atomic (blocks of one launch run on several OS threads)
//   __threadfence()      -> a sequentially consistent fence
//   cp.async             -> a copy queued per fiber, performed when a wait_group covers it
// Math functions are the host's <cmath> ones: results may differ from the GPU's by an ulp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>

struct dim3 {
    unsigned int x, y, z;
};

namespace tp_emu {

// Indices of the running block (per OS thread) and of the running fiber.
extern thread_local __attribute__((tls_model("initial-exec"))) dim3 block_idx;
extern thread_local __attribute__((tls_model("initial-exec"))) dim3 block_dim;
extern thread_local __attribute__((tls_model("initial-exec"))) dim3 grid_dim;
extern thread_local __attribute__((tls_model("initial-exec"))) const dim3* thread_idx;

// __syncthreads(): waits until every thread of the block that has not exited arrives.
void syncthreads();
// A warp collective: this lane's `bytes` (≤ 32) go into its slot; returns the slot of lane
// `source` once every lane of `mask` has arrived. Errors if `source` is not taking part.
const void* warp_exchange(unsigned int mask, const void* mine, unsigned int bytes, int source);
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the calling lane's fragments.
void mma_m16n8k16_bf16(float* d, const unsigned int* a, const unsigned int* b);
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: `row` is this lane's row address (lane l:
// row l % 8 of matrix l / 8, 16 bytes); d[j] gets this lane's two values of matrix j (common.cuh
// ldmatrix_x4). Errors on an address that is not a multiple of 16, as the GPU faults.
void ldmatrix_x4(unsigned int* d, const void* row, bool trans);
// cp.async of `bytes` (`src_bytes` of them read, the rest zeros) from device memory into
// shared memory, deferred: the calling fiber's copy waits in its queue, in the group that its
// next cp_async_commit closes, and is performed by the cp_async_wait that covers its group
// (until then the destination keeps its old contents, as it may on a GPU). Errors on an
// address that is not a multiple of `bytes`, as the GPU faults.
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
// cp.async.commit_group: the fiber's queued copies since the last commit form one group.
void cp_async_commit();
// cp.async.wait_group n: performs every queued copy of the fiber's groups but the n most
// recent (copies not yet committed stay queued).
void cp_async_wait(int n);
// __trap(): ends the launch with an error.
[[noreturn]] void trap();
// The launch's dynamic shared memory (`extern __shared__`), `bytes` as the launch gave.
void* dynamic_shared();

}  // namespace tp_emu

#define __global__
#define __device__ static
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local
#define __launch_bounds__(...)
#define __CUDA_EMULATOR__ 1

#define threadIdx (*tp_emu::thread_idx)
#define blockIdx (tp_emu::block_idx)
#define blockDim (tp_emu::block_dim)
#define gridDim (tp_emu::grid_dim)
#define warpSize 32

static inline void __syncthreads() { tp_emu::syncthreads(); }
static inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    int none = 0;
    tp_emu::warp_exchange(mask, &none, sizeof none, -1);
}
[[noreturn]] static inline void __trap() { tp_emu::trap(); }

template <typename T>
static inline T tp_shuffle(unsigned int mask, T v, int source) {
    static_assert(sizeof(T) <= 32, "a shuffled value fits a slot");
    T out;
    std::memcpy(&out, tp_emu::warp_exchange(mask, &v, sizeof v, source), sizeof out);
    return out;
}
static inline int tp_lane() { return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31; }
template <typename T>
static inline T __shfl_sync(unsigned int mask, T v, int src, int width = 32) {
    int lane = tp_lane();
    return tp_shuffle(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T>
static inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32) {
    int lane = tp_lane(), src = lane ^ lane_mask;
    return tp_shuffle(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename T>
static inline T __shfl_down_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    int lane = tp_lane(), src = lane + (int)delta;
    return tp_shuffle(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename T>
static inline T __shfl_up_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    int lane = tp_lane(), src = lane - (int)delta;
    return tp_shuffle(mask, v, src >= (lane & ~(width - 1)) ? src : lane);
}

// Bit casts.
static inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned int v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
static inline unsigned int __float_as_uint(float f) { unsigned int v; std::memcpy(&v, &f, 4); return v; }

// Atomics (blocks run concurrently on several OS threads). Relaxed, as CUDA's are: ordering
// comes from __threadfence(), a seq_cst fence, and a fence before one block's read-modify-write
// synchronizes with a fence after another block's read-modify-write that reads it or a later one
// (C++ [atomics.fences]; RMWs continue the release sequence), which is what the last-block
// pattern (common.cuh last_block_to_arrive) needs, on any host, as on a GPU.
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline float atomicAdd(float* p, float v) {
    unsigned int* bits = reinterpret_cast<unsigned int*>(p);
    unsigned int old = __atomic_load_n(bits, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(bits, &old, __float_as_uint(__uint_as_float(old) + v), true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
    return __uint_as_float(old);
}
static inline double atomicAdd(double* p, double v) {
    unsigned long long* bits = reinterpret_cast<unsigned long long*>(p);
    unsigned long long old = __atomic_load_n(bits, __ATOMIC_RELAXED);
    for (;;) {
        double sum;
        double cur;
        std::memcpy(&cur, &old, 8);
        sum = cur + v;
        unsigned long long next;
        std::memcpy(&next, &sum, 8);
        if (__atomic_compare_exchange_n(bits, &old, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return cur;
    }
}
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline unsigned int atomicExch(unsigned int* p, unsigned int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }

// The integer min/max overloads CUDA provides.
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
static inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }

// Single-precision intrinsics: the host's functions.
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }

// ---------------------------------------------------------------------------------------
// Used by the code build.rs appends to each family: one trampoline per kernel that reads
// the launch's argument list (each entry points at one argument's bytes), and the kernel's
// parameter kinds, which emu/launch.rs checks against the launcher's arguments.

#include <type_traits>
#include <utility>

// One kernel of the table (emu/ffi.rs mirrors it).
struct TpKernel {
    const char* name;
    void (*trampoline)(void**);
    const char* (*signature)();
    const char* params;
};

namespace tp_emu_gen {

// A parameter's type without const or reference: build.rs passes the list types by const
// reference, so that each thread reads the launch's argument bytes in place.
template <typename T>
using Bare = std::remove_cv_t<std::remove_reference_t<T>>;

template <typename... P, std::size_t... I>
void call(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<Bare<P>*>(args[I])...);
}

template <typename... P>
void invoke(void (*kernel)(P...), void** args) {
    call(kernel, args, std::index_sequence_for<P...>{});
}

// p pointer, i int, l long long, f float, d the 24-long-long dims struct, t the 64-long-long
// TensorList and T the 512-long-long TensorTable of common.cuh, ? anything else.
template <typename T>
constexpr char kind() {
    return std::is_pointer<T>::value                       ? 'p'
           : std::is_same<T, int>::value                   ? 'i'
           : std::is_same<T, long long>::value             ? 'l'
           : std::is_same<T, float>::value                 ? 'f'
           : (std::is_class<T>::value && sizeof(T) == 192) ? 'd'
           : (std::is_class<T>::value && sizeof(T) == 512) ? 't'
           : (std::is_class<T>::value && sizeof(T) == 4096) ? 'T'
                                                            : '?';
}

template <typename... P>
const char* signature(void (*)(P...)) {
    static const char kinds[] = {kind<Bare<P>>()..., '\0'};
    return kinds;
}

}  // namespace tp_emu_gen

//! A launch on the emulated device: the driver's limits, the argument list against the
//! kernel's parameters, the blocks over rayon (each block's threads as fibers, runtime.cpp),
//! then the canaries of every buffer the launch was given.

use std::ffi::c_void;

use cudarc::driver::LaunchConfig;
use rayon::prelude::*;

use super::ffi::{kind, tp_emu_run_block, Dim3, TpBlockError, TpKernel};
use super::memory::{check_canaries, containing, nearest, LiveBuffer};
use super::Emulator;
use crate::cuda::error::{CudaError, Result};
use crate::cuda::module::{Arg, KernelFamily};

/// Threads a block may have (every CUDA GPU since compute capability 2.0).
const MAX_THREADS: u32 = 1024;
/// Dynamic shared memory a launch may ask for without opting in (`cudaFuncSetAttribute`).
const MAX_DYNAMIC_SHARED: u32 = 48 * 1024;

/// The order in which the fibers of a barrier phase run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Thread 0 first.
    Forward,
    /// The last thread first.
    Reverse,
    /// A shuffle seeded by the launch's number and the block's index.
    Shuffled,
    /// Forward, reverse and shuffled in turn, one launch after another (the default).
    Rotate,
}

impl Schedule {
    /// Reads `TRANSPONDER_EMU_SCHEDULE` (`forward`, `reverse`, `shuffled`, `rotate`).
    pub(crate) fn from_env() -> Result<Schedule> {
        match std::env::var("TRANSPONDER_EMU_SCHEDULE").as_deref() {
            Err(_) | Ok("rotate") => Ok(Schedule::Rotate),
            Ok("forward") => Ok(Schedule::Forward),
            Ok("reverse") => Ok(Schedule::Reverse),
            Ok("shuffled") => Ok(Schedule::Shuffled),
            Ok(other) => Err(CudaError::Unavailable(format!(
                "TRANSPONDER_EMU_SCHEDULE={other:?}: expected forward, reverse, shuffled or rotate"
            ))),
        }
    }

    /// The runtime's order code for launch number `launch`.
    fn order(self, launch: u64) -> i32 {
        match self {
            Schedule::Forward => 0,
            Schedule::Reverse => 1,
            Schedule::Shuffled => 2,
            Schedule::Rotate => (launch % 3) as i32,
        }
    }
}

/// Kernel parameters a launch may pass in all (CUDA 12.1 and later, compute capability 7.0
/// and later; 4,096 bytes before).
const MAX_PARAMETER_BYTES: usize = 32_764;

/// The argument list as the trampolines read it: one pointer per argument, each to its value
/// in 8-byte words (aligned for every parameter type the kernels take).
struct ArgList {
    _storage: Vec<Vec<u64>>,
    pointers: Vec<*mut c_void>,
}

// SAFETY: the trampolines only read the arguments; the list outlives the launch.
unsafe impl Sync for ArgList {}

impl ArgList {
    /// The `void**` the trampolines take.
    fn argv(&self) -> *mut *mut c_void {
        self.pointers.as_ptr() as *mut *mut c_void
    }
}

/// An argument's value as 8-byte words: a number in the first word's low bytes (native
/// order), a struct word by word.
fn words(arg: &Arg) -> Vec<u64> {
    let low = |bytes: &[u8]| {
        let mut word = [0u8; 8];
        word[..bytes.len()].copy_from_slice(bytes);
        vec![u64::from_ne_bytes(word)]
    };
    match arg {
        Arg::Ptr(v) => vec![*v],
        Arg::I32(v) => low(&v.to_ne_bytes()),
        Arg::I64(v) => vec![*v as u64],
        Arg::F32(v) => low(&v.to_ne_bytes()),
        Arg::Dims(dims) => dims.iter().map(|&v| v as u64).collect(),
        Arg::Ptrs(ptrs) => ptrs.to_vec(),
        Arg::Lengths(lengths) => lengths.iter().map(|&v| v as u64).collect(),
        Arg::PtrTable(ptrs) => ptrs.to_vec(),
        Arg::LengthTable(lengths) => lengths.iter().map(|&v| v as u64).collect(),
    }
}

/// The bytes an argument takes in the kernel's parameter space.
fn parameter_bytes(arg: &Arg) -> usize {
    match arg {
        Arg::I32(_) | Arg::F32(_) => 4,
        Arg::Ptr(_) | Arg::I64(_) => 8,
        Arg::Dims(dims) => 8 * dims.len(),
        Arg::Ptrs(ptrs) => 8 * ptrs.len(),
        Arg::Lengths(lengths) => 8 * lengths.len(),
        Arg::PtrTable(ptrs) => 8 * ptrs.len(),
        Arg::LengthTable(lengths) => 8 * lengths.len(),
    }
}

fn pack(args: &[Arg]) -> ArgList {
    let mut storage: Vec<Vec<u64>> = args.iter().map(words).collect();
    let pointers = storage.iter_mut().map(|b| b.as_mut_ptr() as *mut c_void).collect();
    ArgList { _storage: storage, pointers }
}

fn arg_kind(arg: &Arg) -> char {
    match arg {
        Arg::Ptr(_) => 'p',
        Arg::I32(_) => 'i',
        Arg::I64(_) => 'l',
        Arg::F32(_) => 'f',
        Arg::Dims(_) => 'd',
        Arg::Ptrs(_) | Arg::Lengths(_) => 't',
        Arg::PtrTable(_) | Arg::LengthTable(_) => 'T',
    }
}

fn kind_name(kind: char) -> &'static str {
    match kind {
        'p' => "pointer",
        'i' => "int",
        'l' => "long long",
        'f' => "float",
        'd' => "dims struct",
        't' => "tensor list",
        'T' => "tensor table",
        _ => "unsupported type",
    }
}

/// An error of kernel `name` on the emulated device.
fn error(name: &str, message: impl Into<String>) -> CudaError {
    CudaError::Emulated { kernel: name.to_string(), message: message.into() }
}

/// Checks the launch against the driver's limits and the kernel's parameter kinds.
fn check(kernel: &TpKernel, cfg: &LaunchConfig, args: &[Arg]) -> Result<()> {
    let name = kernel.name();
    let (bx, by, bz) = cfg.block_dim;
    let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
    if threads == 0 || threads > u64::from(MAX_THREADS) || bx > 1024 || by > 1024 || bz > 64 {
        return Err(error(
            name,
            format!("block of {bx}×{by}×{bz} threads exceeds the limits (≤ 1024 threads, 1024×1024×64)"),
        ));
    }
    let (_, gy, gz) = cfg.grid_dim;
    if gy > 65535 || gz > 65535 || cfg.grid_dim.0 > i32::MAX as u32 {
        return Err(error(name, format!("grid {:?} exceeds the limits (2³¹−1 × 65535 × 65535)", cfg.grid_dim)));
    }
    if cfg.shared_mem_bytes > MAX_DYNAMIC_SHARED {
        return Err(error(
            name,
            format!(
                "{} bytes of dynamic shared memory exceed the {MAX_DYNAMIC_SHARED} a launch may ask for",
                cfg.shared_mem_bytes
            ),
        ));
    }
    // Each parameter at its own alignment (4 or 8 bytes), as the driver lays them out.
    let bytes = args.iter().fold(0usize, |end, arg| {
        let size = parameter_bytes(arg);
        end.next_multiple_of(size.min(8)) + size
    });
    if bytes > MAX_PARAMETER_BYTES {
        return Err(error(name, format!("{bytes} bytes of arguments exceed the {MAX_PARAMETER_BYTES} a launch takes")));
    }
    let want: Vec<char> = kernel.signature().chars().collect();
    let got: Vec<char> = args.iter().map(arg_kind).collect();
    if want != got {
        let params = kernel.params();
        let detail = if want.len() != got.len() {
            format!("takes {} arguments ({}), the launcher passed {}", want.len(), params.join(", "), got.len())
        } else {
            let i = want.iter().zip(&got).position(|(w, g)| w != g).unwrap_or(0);
            format!(
                "argument {i} ({}) is a {}, the launcher passed a {}",
                params.get(i).unwrap_or(&"?"),
                kind_name(want[i]),
                kind_name(got[i])
            )
        };
        return Err(error(name, detail));
    }
    Ok(())
}

/// Runs `name` of `family` with `cfg` and `args` on the emulated device.
pub(crate) fn launch(
    emulator: &Emulator,
    family: KernelFamily,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    let table_name = emulator.table_for(family);
    let kernel = super::ffi::kernel_table(&table_name)
        .and_then(|table| table.iter().find(|k| k.name() == name))
        .ok_or_else(|| error(name, format!("no kernel {name} in {table_name}")))?;
    check(kernel, &cfg, args)?;
    let (gx, gy, gz) = cfg.grid_dim;
    let blocks = u64::from(gx) * u64::from(gy) * u64::from(gz);
    if blocks == 0 {
        return Ok(());
    }
    let _stream = emulator.stream();
    let launch_number = emulator.next_launch();
    let order = emulator.schedule().order(launch_number);
    let list = &pack(args);
    let trampoline = kernel.trampoline();
    let grid = Dim3 { x: gx, y: gy, z: gz };
    let block = Dim3 { x: cfg.block_dim.0, y: cfg.block_dim.1, z: cfg.block_dim.2 };
    let failure = (0..blocks).into_par_iter().find_map_any(|i| {
        let index = Dim3 {
            x: (i % u64::from(gx)) as u32,
            y: (i / u64::from(gx) % u64::from(gy)) as u32,
            z: (i / (u64::from(gx) * u64::from(gy))) as u32,
        };
        let mut report = TpBlockError::new();
        // SAFETY: the argument list matches the kernel's parameters (checked above) and
        // lives until every block has run; the launcher checked the buffers' extents.
        let code = unsafe {
            tp_emu_run_block(
                trampoline,
                list.argv(),
                grid,
                block,
                index,
                cfg.shared_mem_bytes as usize,
                order,
                launch_number ^ (i << 20),
                &mut report,
            )
        };
        (code != 0).then_some((index, report))
    });
    if let Some((index, report)) = failure {
        return Err(error(name, describe(kernel, args, index, &report, cfg.shared_mem_bytes)));
    }
    check_launch_canaries(kernel, args)
}

/// The argument (index and name) of `args` that points into `buffer`.
fn argument_of(kernel: &TpKernel, args: &[Arg], buffer: &LiveBuffer) -> String {
    let params = kernel.params();
    args.iter()
        .enumerate()
        .find(|(_, arg)| arg.addresses().any(|p| p >= buffer.ptr && p <= buffer.ptr + buffer.bytes as u64))
        .map_or_else(
            || "a buffer no argument points into".to_string(),
            |(i, _)| format!("argument {i} `{}`", params.get(i).unwrap_or(&"?")),
        )
}

fn describe(kernel: &TpKernel, args: &[Arg], index: Dim3, report: &TpBlockError, shared: u32) -> String {
    let thread = report.thread;
    let at = format!("block ({},{},{}) thread ({},{},{})", index.x, index.y, index.z, thread.x, thread.y, thread.z);
    let access = if report.is_write != 0 { "write" } else { "read" };
    match report.kind {
        kind::FAULT if report.address < 4096 => {
            format!("{at}: {access} at address {:#x}, a null pointer (an optional buffer not given?)", report.address)
        }
        kind::FAULT => match nearest(report.address) {
            Some(buffer) => {
                let offset = (report.address as i64 - buffer.ptr as i64).div_euclid(buffer.elem_bytes as i64);
                let arg = argument_of(kernel, args, &buffer);
                format!("{at}: out-of-bounds {access} of element {offset} of {arg} ({})", buffer.describe())
            }
            None if report.message[0] != 0 => format!("{at}: {}", report.message()),
            None => format!("{at}: {access} at address {:#x}, which is in no device buffer", report.address),
        },
        kind::SHARED_OVERFLOW => {
            format!("{at}: {access} past the end of the launch's {shared} bytes of dynamic shared memory")
        }
        kind::STACK_OVERFLOW => format!("{at}: the thread's stack overflowed (128 KiB per emulated thread)"),
        kind::TRAP | kind::DEADLOCK | kind::COLLECTIVE => format!("{at}: {}", report.message()),
        other => format!("{at}: unknown failure {other}: {}", report.message()),
    }
}

/// Checks the poison around every buffer the launch was given.
fn check_launch_canaries(kernel: &TpKernel, args: &[Arg]) -> Result<()> {
    for ptr in args.iter().flat_map(Arg::addresses) {
        let Some(buffer) = containing(ptr) else { continue };
        if let Some(offset) = check_canaries(&buffer) {
            let element = offset.div_euclid(buffer.elem_bytes as i64);
            return Err(error(
                kernel.name(),
                format!(
                    "wrote outside {} ({}): byte {offset} from its start, element {element}",
                    argument_of(kernel, args, &buffer),
                    buffer.describe()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaDevice;

    fn config(threads: u32, shared: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (1, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: shared }
    }

    #[test]
    fn launches_outside_the_limits_or_with_wrong_arguments_are_errors_naming_the_kernel() {
        let dev = CudaDevice::emulated().unwrap();
        let x = dev.zeros::<f32>(8).unwrap();
        let y = dev.zeros::<f32>(8).unwrap();
        // axpy(alpha, src, dst, dst_bf16, n): no bf16 copy (a null pointer).
        let args = [Arg::F32(2.0), Arg::Ptr(y.device_ptr()), Arg::Ptr(x.device_ptr()), Arg::Ptr(0), Arg::I64(8)];
        let family = KernelFamily::Elementwise;
        let err = dev.launch(family, "axpy", config(2048, 0), &args).unwrap_err().to_string();
        assert!(err.contains("axpy") && err.contains("2048×1×1") && err.contains("(emulated)"), "{err}");
        let err = dev.launch(family, "axpy", config(32, 64 * 1024), &args).unwrap_err().to_string();
        assert!(err.contains("65536 bytes of dynamic shared memory"), "{err}");
        let wrong = [Arg::I32(2), args[1].clone(), args[2].clone(), args[3].clone(), args[4].clone()];
        let err = dev.launch(family, "axpy", config(32, 0), &wrong).unwrap_err().to_string();
        assert!(err.contains("argument 0 (alpha) is a float, the launcher passed a int"), "{err}");
        let err = dev.launch(family, "axpy", config(32, 0), &args[..4]).unwrap_err().to_string();
        assert!(err.contains("takes 5 arguments (alpha, src, dst, dst_bf16, n), the launcher passed 4"), "{err}");
        // Eight 4 KB tables and the five arguments: past the 32,764 bytes a launch takes.
        let table = crate::cuda::launch::length_table(std::iter::empty());
        let oversized: Vec<Arg> = args.iter().cloned().chain(std::iter::repeat_n(table, 8)).collect();
        let err = dev.launch(family, "axpy", config(32, 0), &oversized).unwrap_err().to_string();
        assert!(err.contains("32808 bytes of arguments exceed the 32764 a launch takes"), "{err}");
        let err = dev.launch(family, "no_such_kernel", config(32, 0), &args).unwrap_err().to_string();
        assert!(err.contains("no kernel no_such_kernel in elementwise.cu"), "{err}");
        // The correct launch runs: dst += 2·src with src = 0.
        dev.launch(family, "axpy", config(32, 0), &args).unwrap();
        assert_eq!(dev.download(&x).unwrap(), vec![0.0; 8]);
    }

    #[test]
    fn fresh_memory_is_poisoned_and_a_null_pointer_is_named() {
        let dev = CudaDevice::emulated().unwrap();
        let fresh = dev.alloc::<f32>(5).unwrap();
        assert!(dev.download(&fresh).unwrap().iter().all(|v| v.is_nan()), "fresh memory reads as NaN");
        let y = dev.zeros::<f32>(8).unwrap();
        let args = [Arg::F32(2.0), Arg::Ptr(0), Arg::Ptr(y.device_ptr()), Arg::Ptr(0), Arg::I64(8)];
        let err = dev.launch(KernelFamily::Elementwise, "axpy", config(32, 0), &args).unwrap_err().to_string();
        assert!(err.contains("read at address 0x0, a null pointer"), "{err}");
    }
}

//! Run-time compilation of the CUDA C kernel sources with NVRTC.
//!
//! Each kernel family is one `.cu` file under `kernels/src/cuda/kernels/`, embedded with
//! `include_str!` and compiled on first use for the device's compute capability: a CUBIN
//! for `sm_XY` (e.g. `sm_90` on an H100), or, when this NVRTC does not know that
//! architecture, PTX for `compute_XY` that the driver finishes.
//! `common.cuh` (reductions, bf16 conversion, the unary op table) is prepended to every
//! file, with a `#line` directive so NVRTC's messages name the family's own file and line.
//!
//! PTX is cached per process (per family and architecture), modules and functions per
//! device, so each family is compiled once however many devices or tests use it. A failed
//! compile returns [`CudaError::Compile`] with NVRTC's log.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::error::{CudaError, Result};
use super::launch::{LIST_LEN, TABLE_LEN};
use super::nvrtc::{compile, KernelImage, Output};

/// Helpers shared by every kernel file.
const COMMON: &str = include_str!("kernels/common.cuh");

/// Declares the kernel families from one table, `Variant => "stem"` with its doc: the enum,
/// [`KernelFamily::ALL`], the file name (`kernels/<stem>.cu`) and the embedded source all come
/// from the same line, so a new family is one line here plus its `.cu` file.
macro_rules! kernel_families {
    ($($(#[doc = $doc:literal])* $variant:ident => $stem:literal,)*) => {
        /// One `.cu` file of kernels.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum KernelFamily {
            $($(#[doc = $doc])* $variant,)*
        }

        impl KernelFamily {
            /// Every family, for precompiling.
            pub const ALL: [KernelFamily; [$($stem),*].len()] = [$(KernelFamily::$variant),*];

            /// The family's name: its file without `.cu` (for reports).
            pub fn name(self) -> &'static str {
                match self {
                    $(KernelFamily::$variant => $stem,)*
                }
            }

            /// The source file's name.
            pub fn file(self) -> &'static str {
                match self {
                    $(KernelFamily::$variant => concat!($stem, ".cu"),)*
                }
            }

            fn source(self) -> &'static str {
                match self {
                    $(KernelFamily::$variant => include_str!(concat!("kernels/", $stem, ".cu")),)*
                }
            }
        }
    };
}

kernel_families! {
    /// Unary and binary elementwise ops, axpy, fill, select, strided copy, dtype conversion.
    Elementwise => "elementwise",
    /// Axis sums, max/argmax, squared norm, column sums.
    Reduce => "reduce",
    /// Softmax, log-softmax and the fused cross-entropy.
    Softmax => "softmax",
    /// RMSNorm and LayerNorm.
    Norm => "norm",
    /// Rotary position embedding.
    Rope => "rope",
    /// Embedding gather and scatter-add.
    Embedding => "embedding",
    /// Flash-style causal attention, f32 products on the CUDA cores.
    Attention => "attention",
    /// Flash-style causal attention, bf16 products on the tensor cores.
    AttentionMma => "attention_mma",
    /// im2col / col2im and the convolution's bias.
    Conv => "conv",
    /// Batch normalisation.
    BatchNorm => "batch_norm",
    /// Fused optimizer updates (multi-tensor AdamW / Adam, SGD).
    Optim => "optim",
    /// The fused gated projection (tensor-core GEMM with the gate in its epilogue).
    FusedGate => "fused_gate",
    /// SwiGLU gating `silu(g) ⊙ u` and its backward.
    Swiglu => "swiglu",
    /// Max pooling and global average pooling.
    Pool => "pool",
}

impl KernelFamily {
    /// The full translation unit: `common.cuh`, then the family's file.
    pub fn translation_unit(self) -> String {
        format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{}", self.file(), self.source())
    }
}

/// One kernel argument, kept alive (in a slice) until the launch has read it.
#[derive(Clone, Debug)]
pub(crate) enum Arg {
    /// A device address (`T*` in the kernel).
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
    /// A `struct { long long v[24]; }` passed by value (shapes and strides).
    Dims([i64; 24]),
    /// Up to [`LIST_LEN`] device addresses in a `TensorList` (common.cuh) passed by value
    /// (the tensors of a multi-tensor launch); unused entries are 0.
    Ptrs([u64; LIST_LEN]),
    /// Up to [`LIST_LEN`] lengths or offsets in a `TensorList` passed by value.
    Lengths([i64; LIST_LEN]),
    /// Up to [`TABLE_LEN`] device addresses in a `TensorTable` (common.cuh) passed by value
    /// (4 KB: kernel parameters past 4 KB in all need CUDA 12.1); unused entries are 0.
    PtrTable(Box<[u64; TABLE_LEN]>),
    /// Up to [`TABLE_LEN`] lengths or offsets in a `TensorTable` passed by value.
    LengthTable(Box<[i64; TABLE_LEN]>),
}

impl Arg {
    /// The device addresses this argument passes (none for a number or a dims struct).
    pub(crate) fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
        let list: &[u64] = match self {
            Arg::Ptr(ptr) => std::slice::from_ref(ptr),
            Arg::Ptrs(ptrs) => ptrs,
            Arg::PtrTable(ptrs) => &ptrs[..],
            _ => &[],
        };
        list.iter().copied().filter(|&ptr| ptr != 0)
    }
}

/// Images per (family, compute capability), shared by every device of the process.
type ImageCache = Mutex<HashMap<(KernelFamily, (i32, i32)), Arc<KernelImage>>>;

fn image_cache() -> &'static ImageCache {
    static CACHE: OnceLock<ImageCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// NVRTC options for compute capability `(major, minor)`: `virtual_arch` picks `compute_XY`
/// (PTX) over `sm_XY` (CUBIN).
pub fn compile_options(capability: (i32, i32), virtual_arch: bool) -> Vec<String> {
    let prefix = if virtual_arch { "compute" } else { "sm" };
    vec![format!("--gpu-architecture={prefix}_{}{}", capability.0, capability.1), "--std=c++17".to_string()]
}

/// Compiles `family` for `capability` (cached per process): a CUBIN, or PTX when NVRTC
/// cannot produce machine code for that architecture.
pub fn compile_family(family: KernelFamily, capability: (i32, i32)) -> Result<Arc<KernelImage>> {
    let key = (family, capability);
    if let Some(image) = image_cache().lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(Arc::clone(image));
    }
    let source = family.translation_unit();
    let attempt = |virtual_arch: bool, output: Output| {
        // A missing NVRTC symbol panics inside cudarc's loader; report it as an error.
        catch_unwind(AssertUnwindSafe(|| {
            compile(&source, family.file(), &compile_options(capability, virtual_arch), output)
        }))
        .map_err(|panic| CudaError::Unavailable(format!("NVRTC could not be used: {}", panic_message(&panic))))
    };
    let image = match attempt(false, Output::Cubin)? {
        Ok(image) => image,
        Err(cubin_log) => match attempt(true, Output::Ptx)? {
            Ok(image) => image,
            Err(ptx_log) => {
                let version = super::nvrtc::version().map_or("unknown".to_string(), |(a, b)| format!("{a}.{b}"));
                let log = if ptx_log == cubin_log {
                    format!("NVRTC {version}: {cubin_log}")
                } else {
                    format!("NVRTC {version}, as CUBIN: {cubin_log}\nas PTX: {ptx_log}")
                };
                return Err(CudaError::Compile { file: family.file(), log });
            }
        },
    };
    let image = Arc::new(image);
    image_cache().lock().unwrap_or_else(|p| p.into_inner()).insert(key, Arc::clone(&image));
    Ok(image)
}

/// The text of a caught panic's payload.
pub(crate) fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Loaded modules and functions of one device.
pub(crate) struct KernelCache {
    capability: (i32, i32),
    modules: Mutex<HashMap<KernelFamily, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(KernelFamily, &'static str), CudaFunction>>,
}

impl KernelCache {
    /// An empty cache for a device of compute capability `capability`.
    pub(crate) fn new(capability: (i32, i32)) -> KernelCache {
        KernelCache { capability, modules: Mutex::new(HashMap::new()), functions: Mutex::new(HashMap::new()) }
    }

    /// The module of `family`, compiled and loaded on first use.
    pub(crate) fn module(&self, ctx: &Arc<CudaContext>, family: KernelFamily) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(module) = modules.get(&family) {
            return Ok(Arc::clone(module));
        }
        let image = match compile_family(family, self.capability)?.as_ref() {
            KernelImage::Cubin(bytes) => Ptx::from_binary(bytes.clone()),
            KernelImage::Ptx(text) => Ptx::from_src(text.as_str()),
        };
        let module = ctx
            .load_module(image)
            .map_err(|e| CudaError::driver(format!("loading the compiled {}", family.file()), e))?;
        modules.insert(family, Arc::clone(&module));
        Ok(module)
    }

    /// The kernel `name` of `family`.
    pub(crate) fn function(
        &self,
        ctx: &Arc<CudaContext>,
        family: KernelFamily,
        name: &'static str,
    ) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().unwrap_or_else(|p| p.into_inner()).get(&(family, name)) {
            return Ok(f.clone());
        }
        let module = self.module(ctx, family)?;
        let function = module
            .load_function(name)
            .map_err(|e| CudaError::driver(format!("kernel {name} of {}", family.file()), e))?;
        self.functions.lock().unwrap_or_else(|p| p.into_inner()).insert((family, name), function.clone());
        Ok(function)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_a_distinct_file_and_a_kernel() {
        let mut files: Vec<&str> = KernelFamily::ALL.iter().map(|f| f.file()).collect();
        files.sort_unstable();
        files.dedup();
        assert_eq!(files.len(), KernelFamily::ALL.len());
        for family in KernelFamily::ALL {
            let unit = family.translation_unit();
            assert!(unit.contains("extern \"C\" __global__"), "{} has no kernel", family.file());
            assert!(unit.contains(&format!("#line 1 \"{}\"", family.file())));
        }
        assert_eq!(compile_options((9, 0), false)[0], "--gpu-architecture=sm_90");
        assert_eq!(compile_options((8, 6), true)[0], "--gpu-architecture=compute_86");
    }
}

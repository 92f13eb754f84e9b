//! Where a command computes: the `--device cpu|cuda|cuda:N` flag, the check that the
//! device can be used (this build has CUDA support and the GPU opens), waiting for a GPU
//! to finish (for timings), and the `--bf16` matrix-product switch.

use anyhow::{bail, Result};
use tensor::Device;

/// Parses `cpu`, `cuda` (GPU 0) or `cuda:N`. Syntax only: whether the device can be used
/// is [`ensure_available`]'s question.
pub fn parse_device(text: &str) -> Result<Device, String> {
    let text = text.trim();
    match text.to_ascii_lowercase().as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        lower => lower
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("unknown device `{text}`; use cpu, cuda or cuda:N (N = GPU ordinal, 0 first)")),
    }
}

/// The CPU: the device of a run whose config was read from a file (configs do not save it).
pub(crate) fn cpu() -> Device {
    Device::Cpu
}

/// The flag's spelling of `device`: `cpu` or `cuda:N`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(n) => format!("cuda:{n}"),
    }
}

/// `device` for logs: `cpu`, `cuda:N`, or `cuda:0 (emulated)` on the emulated device.
pub fn device_label(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(ordinal) => gpu_label(ordinal),
    }
}

#[cfg(feature = "cuda")]
fn gpu_label(ordinal: usize) -> String {
    tensor::cuda::device(ordinal).map_or_else(|_| format!("cuda:{ordinal}"), |dev| dev.label())
}

#[cfg(not(feature = "cuda"))]
fn gpu_label(ordinal: usize) -> String {
    format!("cuda:{ordinal}")
}

/// How many GPUs this process can open (the emulated device counts as one).
#[cfg(feature = "cuda")]
pub fn gpu_count() -> usize {
    tensor::cuda::device_count()
}

/// How many GPUs this process can open: none, in a build without CUDA.
#[cfg(not(feature = "cuda"))]
pub fn gpu_count() -> usize {
    0
}

/// Errors, saying what to do, unless `device` can run this command: the CPU always can; a
/// GPU needs a build with the `cuda` feature and a GPU the driver can open.
pub fn ensure_available(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => open_gpu(ordinal),
    }
}

#[cfg(feature = "cuda")]
fn open_gpu(ordinal: usize) -> Result<()> {
    match tensor::cuda::device(ordinal) {
        Ok(_) => Ok(()),
        Err(e) => bail!("--device cuda:{ordinal}: no usable CUDA GPU ({e})"),
    }
}

#[cfg(not(feature = "cuda"))]
fn open_gpu(ordinal: usize) -> Result<()> {
    bail!(
        "--device cuda:{ordinal}: this transponder was built without CUDA support; \
         rebuild with --features cuda (cargo build --release --features cuda)"
    )
}

/// Waits until the work queued on `device` has finished (a no-op on the CPU, whose ops
/// return when done), so wall-clock timings cover the GPU's work.
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => synchronize_gpu(ordinal),
    }
}

#[cfg(feature = "cuda")]
fn synchronize_gpu(ordinal: usize) -> Result<()> {
    tensor::cuda::device(ordinal)?.synchronize()?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn synchronize_gpu(ordinal: usize) -> Result<()> {
    ensure_available(Device::Cuda(ordinal))
}

/// Checks the `--bf16` flag against the device: bf16 GEMM inputs exist on a GPU only.
pub fn check_bf16(device: Device, bf16: bool) -> Result<()> {
    if bf16 && device == Device::Cpu {
        bail!("--bf16 needs --device cuda: bf16 matrix products (f32 master weights) run on the GPU only");
    }
    Ok(())
}

/// bf16 matrix-product inputs (f32 accumulation, f32 master weights and optimizer state)
/// for as long as this guard lives; f32 products again when it drops, so a later run in
/// the same process (tests, `compare`) starts from the default.
pub struct MatmulPrecision {
    bf16: bool,
}

impl MatmulPrecision {
    /// Sets bf16 GEMM inputs when `bf16` (after [`check_bf16`]); f32 otherwise.
    pub fn set(device: Device, bf16: bool) -> Result<MatmulPrecision> {
        check_bf16(device, bf16)?;
        if bf16 {
            set_bf16_matmul(true)?;
        }
        Ok(MatmulPrecision { bf16 })
    }
}

impl Drop for MatmulPrecision {
    fn drop(&mut self) {
        if self.bf16 {
            // Switching back to f32 cannot fail once bf16 was set.
            let _ = set_bf16_matmul(false);
        }
    }
}

/// The process-wide GEMM precision switch of the tensor crate's CUDA backend.
#[cfg(feature = "cuda")]
fn set_bf16_matmul(enabled: bool) -> Result<()> {
    use tensor::cuda::{set_matmul_precision, MatmulPrecision};
    set_matmul_precision(if enabled { MatmulPrecision::Bf16 } else { MatmulPrecision::F32 });
    Ok(())
}

/// Without the `cuda` feature there is no GPU product to switch (`check_bf16` and the
/// device check reject `--bf16` before this is reached).
#[cfg(not(feature = "cuda"))]
fn set_bf16_matmul(enabled: bool) -> Result<()> {
    if enabled {
        bail!("--bf16 needs a build with --features cuda");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_flags_parse() {
        assert_eq!(parse_device("cpu"), Ok(Device::Cpu));
        assert_eq!(parse_device("CUDA"), Ok(Device::Cuda(0)));
        assert_eq!(parse_device("cuda:3"), Ok(Device::Cuda(3)));
        for bad in ["tpu", "cuda:", "cuda:-1", "cuda:x", ""] {
            let msg = parse_device(bad).unwrap_err();
            assert!(msg.contains("cpu, cuda or cuda:N"), "{bad}: {msg}");
        }
        assert_eq!(device_name(Device::Cuda(1)), "cuda:1");
        assert_eq!(parse_device(&device_name(Device::Cuda(2))), Ok(Device::Cuda(2)));
    }

    #[test]
    fn the_cpu_is_always_available_and_bf16_needs_a_gpu() {
        assert!(ensure_available(Device::Cpu).is_ok());
        assert!(synchronize(Device::Cpu).is_ok());
        let msg = check_bf16(Device::Cpu, true).unwrap_err().to_string();
        assert!(msg.contains("--device cuda"), "{msg}");
        assert!(MatmulPrecision::set(Device::Cpu, false).is_ok());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_gpu_without_the_cuda_feature_says_to_rebuild() {
        let msg = ensure_available(Device::Cuda(0)).unwrap_err().to_string();
        assert!(msg.contains("rebuild with --features cuda"), "{msg}");
    }
}

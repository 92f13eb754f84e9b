//! [`Slot`]: one optimizer buffer (a moment, a momentum buffer) kept on the device of the
//! parameter it belongs to. Host slots are plain vectors that the CPU kernels update in
//! place, exactly as before GPUs existed; a GPU slot is an f32 tensor on the parameter's
//! device. A slot follows its parameter: the step moves it (upload or download) when the
//! parameter has moved since, so optimizers can be built before `Module::to_device` and
//! state loaded from a checkpoint (host values) lands on the GPU at the next step.

use autograd::Result;
use tensor::Tensor;

/// One per-parameter optimizer buffer, on the host or on a GPU.
#[derive(Debug)]
pub(crate) enum Slot {
    /// Host values, updated in place by `kernels::cpu::optim`.
    Host(Vec<f32>),
    /// An f32 tensor (shaped like its parameter) on the parameter's GPU.
    #[cfg(feature = "cuda")]
    Device(Tensor),
}

impl Slot {
    /// `len` zeros on the host.
    pub(crate) fn zeros(len: usize) -> Slot {
        Slot::Host(vec![0.0; len])
    }

    /// The values on the host for in-place updates, downloading them first if they are on
    /// a GPU.
    pub(crate) fn host(&mut self) -> Result<&mut [f32]> {
        #[cfg(feature = "cuda")]
        if let Slot::Device(t) = self {
            *self = Slot::Host(t.to_host()?.to_vec());
        }
        match self {
            Slot::Host(values) => Ok(values),
            #[cfg(feature = "cuda")]
            Slot::Device(t) => Err(tensor::Error::UnsupportedDevice { op: "optimizer state", device: t.device() }),
        }
    }

    /// The state as a tensor of `shape`, for checkpoints: a copy of host values, or the GPU
    /// tensor itself (a cheap view; the next in-place step copies before writing while that
    /// view is alive, so it stays a snapshot).
    pub(crate) fn to_tensor(&self, shape: &[usize]) -> Tensor {
        match self {
            Slot::Host(values) => Tensor::from_vec(values.clone(), shape).expect("state matches its parameter"),
            #[cfg(feature = "cuda")]
            Slot::Device(t) => t.clone(),
        }
    }
}

#[cfg(feature = "cuda")]
impl Slot {
    /// The f32 device buffer of this slot on `param`'s GPU for in-place updates, moving
    /// the values there first if they are elsewhere (the host, or another GPU).
    pub(crate) fn device_buffer(
        &mut self,
        param: &Tensor,
        op: &'static str,
    ) -> Result<&mut kernels::cuda::DeviceBuffer<f32>> {
        let device = param.device();
        let moved = match self {
            Slot::Host(values) => Some(Tensor::from_vec(values.clone(), param.shape())?.to_device(device)?),
            Slot::Device(t) if t.device() != device => Some(t.to_device(device)?),
            Slot::Device(_) => None,
        };
        if let Some(t) = moved {
            *self = Slot::Device(t);
        }
        match self {
            Slot::Device(t) => Ok(t.cuda_f32_mut(op)?.1),
            Slot::Host(_) => Err(tensor::Error::UnsupportedDevice { op, device }),
        }
    }
}

//! Creating tensors: constants, ranges and seeded random initialisers.

use crate::{Device, Result, Rng, Tensor};

impl Tensor {
    /// A tensor of `shape` filled with `value`.
    pub fn full(shape: &[usize], value: f32) -> Tensor {
        let numel = shape.iter().product();
        Tensor::from_vec(vec![value; numel], shape).expect("full: length matches shape by construction")
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor::full(shape, 0.0)
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize]) -> Tensor {
        Tensor::full(shape, 1.0)
    }

    /// A rank-0 tensor holding `value`.
    pub fn scalar(value: f32) -> Tensor {
        Tensor::full(&[], value)
    }

    /// `[start, start + step, ...]` with `len` elements (PyTorch `arange(start, start+len·step, step)`).
    pub fn arange(start: f32, step: f32, len: usize) -> Tensor {
        let data = (0..len).map(|i| start + step * i as f32).collect();
        Tensor::from_vec(data, &[len]).expect("arange: length matches shape by construction")
    }

    /// Uniform samples in [low, high) drawn from `rng` in row-major order.
    pub fn rand_uniform(shape: &[usize], low: f32, high: f32, rng: &mut Rng) -> Tensor {
        let numel = shape.iter().product();
        let data = (0..numel).map(|_| rng.uniform_range(low, high)).collect();
        Tensor::from_vec(data, shape).expect("rand_uniform: length matches shape by construction")
    }

    /// Normal samples with `mean` and `std` drawn from `rng` in row-major order.
    pub fn rand_normal(shape: &[usize], mean: f32, std: f32, rng: &mut Rng) -> Tensor {
        let numel = shape.iter().product();
        let data = (0..numel).map(|_| mean + std * rng.normal()).collect();
        Tensor::from_vec(data, shape).expect("rand_normal: length matches shape by construction")
    }

    /// Kaiming-uniform init (PyTorch `nn.Linear`'s default, `a = √5`): U(−b, b) with
    /// b = 1/√fan_in. Used for the modulators' A and B (Transponder §1 init).
    pub fn kaiming_uniform(shape: &[usize], fan_in: usize, rng: &mut Rng) -> Tensor {
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        Tensor::rand_uniform(shape, -bound, bound, rng)
    }

    /// A tensor of `shape` filled with `value` on `device` (for constants and gradient
    /// seeds next to tensors on a GPU). On a GPU: one `fill` launch, or a memset for 0.0.
    pub fn full_on(shape: &[usize], value: f32, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Ok(Tensor::full(shape, value)),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let dev = crate::cuda::device(ordinal)?;
                let numel = shape.iter().product();
                let storage = if value.to_bits() == 0 {
                    crate::cuda::CudaStorage::zeros(&dev, numel)?
                } else {
                    let mut storage = crate::cuda::CudaStorage::alloc(&dev, numel)?;
                    kernels::cuda::elementwise::fill(&dev, value, storage.f32_buffer_mut("full_on")?)
                        .map_err(|e| crate::cuda::cuda_error("full_on", e))?;
                    storage
                };
                Tensor::from_storage(crate::Storage::Cuda(storage), shape)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                Err(crate::Error::UnsupportedDevice { op: "full_on (built without the cuda feature)", device })
            }
        }
    }

    /// A tensor of zeros of `shape` on `device`.
    pub fn zeros_on(shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::full_on(shape, 0.0, device)
    }

    /// A tensor of the same shape, on the same device, filled with `value`.
    pub fn full_like(&self, value: f32) -> Result<Tensor> {
        Tensor::full_on(&self.shape, value, self.device)
    }

    /// A tensor of the same shape, on the same device, filled with zeros.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros_on(&self.shape, self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_on_the_cpu() {
        let t = Tensor::full_on(&[2, 3], 1.5, Device::Cpu).unwrap();
        assert_eq!((t.shape(), t.device()), (&[2, 3][..], Device::Cpu));
        assert_eq!(t.to_vec(), vec![1.5; 6]);
        assert_eq!(Tensor::zeros_on(&[4], Device::Cpu).unwrap().to_vec(), vec![0.0; 4]);
        let like = t.full_like(-2.0).unwrap();
        assert_eq!((like.shape(), like.device(), like.to_vec()), (t.shape(), Device::Cpu, vec![-2.0; 6]));
        assert_eq!(t.zeros_like().unwrap().to_vec(), vec![0.0; 6]);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn gpu_tensors_need_the_cuda_feature() {
        let unsupported = |r: Result<Tensor>| matches!(r, Err(crate::Error::UnsupportedDevice { .. }));
        assert!(unsupported(Tensor::zeros_on(&[2], Device::Cuda(0))));
        assert!(unsupported(Tensor::full_on(&[2], 1.0, Device::Cuda(0))));
        assert!(unsupported(Tensor::ones(&[2]).to_device(Device::Cuda(0))));
    }
}

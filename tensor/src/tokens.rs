//! A batch of token ids (or class labels) on a device: the host data of a training step that
//! the embedding lookup, its backward and the LM head's loss read (`Tensor::embedding`,
//! `Tensor::embedding_backward`, `Tensor::linear_cross_entropy`).
//!
//! On a GPU the ids live in one device buffer, uploaded once per batch with one pinned copy,
//! and every op of the step reads them there: no op copies host data to the device, and no
//! launch's grid depends on the ids. A step can then be replayed as a CUDA graph once
//! [`Tokens::refill`] has overwritten the same buffer with the next batch (PyTorch's "static
//! inputs" of `torch.cuda.graphs`). The buffer, `4N + 2` `u32`s for `N` ids:
//!
//! ```text
//! [ids: N | rows: N | starts: N + 1 | positions: N | distinct: 1]
//!          └──── kernels::cpu::embedding::grouping_table(ids) ────┘
//! ```
//!
//! The grouping is the embedding backward's: the distinct ids ascending in `rows[..distinct]`,
//! id `rows[u]` at `positions[starts[u]..starts[u + 1]]`, positions increasing (zeros past
//! `distinct`). It is built on the host by a sort of `(id, position)` pairs, without knowing
//! the vocabulary (so targets holding an ignore index such as `u32::MAX` cost no more), and the
//! kernel drops ids ≥ V itself. Ids that no embedding reads (a step's targets, class labels)
//! go up alone ([`Tokens::labels`]: `N` `u32`s, no sort). On the CPU a `Tokens` holds the host
//! ids only: the CPU kernels group by themselves.
//!
//! Cloning is cheap (an `Arc`), so an autograd op keeps the batch's ids for its backward.

use std::fmt;
use std::sync::Arc;

use crate::{Device, Error, Result};

/// A batch of `u32` token ids (or class labels) on a device, shared by every op of a step
/// (see the module doc): build it once per batch with the model's device.
#[derive(Clone)]
pub struct Tokens {
    inner: Arc<Inner>,
}

/// What a [`Tokens`] holds.
struct Inner {
    /// The ids on the host (what the CPU kernels and the host checks read).
    ids: Vec<u32>,
    /// The largest id (`None` for no ids): range checks in O(1).
    max_id: Option<u32>,
    device: Device,
    /// The ids and their grouping on the GPU, for a CUDA device.
    #[cfg(feature = "cuda")]
    gpu: Option<cuda::DeviceTokens>,
}

impl Tokens {
    /// `ids` on `device`: on a GPU uploaded with their grouping in one copy (see the module
    /// doc). Errors when the GPU cannot be opened, or for more ids than a `u32` position holds.
    pub fn new(ids: &[u32], device: Device) -> Result<Tokens> {
        Tokens::build(ids, device, true)
    }

    /// Ids that no embedding reads (the targets of a loss, class labels) on `device`: on a GPU
    /// uploaded without the grouping, which only the embedding backward reads (a quarter of
    /// the bytes, and no sort on the host). Errors as [`Tokens::new`].
    pub fn labels(ids: &[u32], device: Device) -> Result<Tokens> {
        Tokens::build(ids, device, false)
    }

    /// [`Tokens::new`] (`grouped`) or [`Tokens::labels`].
    fn build(ids: &[u32], device: Device, grouped: bool) -> Result<Tokens> {
        #[cfg(feature = "cuda")]
        let gpu = match device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(cuda::DeviceTokens::upload(ids, ordinal, grouped)?),
        };
        #[cfg(not(feature = "cuda"))]
        let _ = grouped;
        #[cfg(not(feature = "cuda"))]
        if let Device::Cuda(_) = device {
            return Err(Error::UnsupportedDevice { op: "Tokens::new (built without the cuda feature)", device });
        }
        let inner = Inner {
            ids: ids.to_vec(),
            max_id: ids.iter().max().copied(),
            device,
            #[cfg(feature = "cuda")]
            gpu,
        };
        Ok(Tokens { inner: Arc::new(inner) })
    }

    /// Overwrites the ids with `ids` (the same length), on the host and in the *same* device
    /// buffer (the address a captured CUDA graph reads), queued after the work already queued
    /// that reads the old ones. The ids they already hold cost nothing (no upload: a graph
    /// step's first batch is the one its Tokens were made with). Errors for another length,
    /// and, for other ids, while any clone of these Tokens is alive (an op or a tape still
    /// holding them would see their ids change).
    pub fn refill(&mut self, ids: &[u32]) -> Result<()> {
        const OP: &str = "Tokens::refill";
        if ids.len() != self.len() {
            return Err(Error::InvalidShape {
                op: OP,
                shape: vec![ids.len()],
                reason: format!("{} ids given, the Tokens hold {}: a refill keeps the length", ids.len(), self.len()),
            });
        }
        if ids == self.host() {
            return Ok(());
        }
        let inner = Arc::get_mut(&mut self.inner).ok_or(Error::Shared { op: OP, what: "the token ids" })?;
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &mut inner.gpu {
            gpu.refill(ids)?;
        }
        inner.ids.copy_from_slice(ids);
        inner.max_id = ids.iter().max().copied();
        Ok(())
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.inner.ids.len()
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.inner.ids.is_empty()
    }

    /// The ids on the host.
    pub fn host(&self) -> &[u32] {
        &self.inner.ids
    }

    /// Where the ids live (and the ops that read them run).
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The largest id, `None` when there are none.
    pub fn max_id(&self) -> Option<u32> {
        self.inner.max_id
    }

    /// Errors with [`Error::IndexOutOfRange`] naming `op` and the first id ≥ `vocab`; O(1)
    /// when every id is below it.
    pub fn check_below(&self, op: &'static str, vocab: usize) -> Result<()> {
        if self.max_id().is_none_or(|max| (max as usize) < vocab) {
            return Ok(());
        }
        match self.host().iter().find(|&&id| id as usize >= vocab) {
            Some(&bad) => Err(Error::IndexOutOfRange { op, index: bad as usize, size: vocab }),
            None => Ok(()),
        }
    }

    /// Errors with [`Error::DeviceMismatch`] naming `op` unless the ids are on `device` (the
    /// device of the tensor an op reads them with).
    pub(crate) fn check_device(&self, op: &'static str, device: Device) -> Result<()> {
        if self.device() == device {
            Ok(())
        } else {
            Err(Error::DeviceMismatch { op, lhs: device, rhs: self.device() })
        }
    }
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("len", &self.len())
            .field("max_id", &self.max_id())
            .field("device", &self.device())
            .finish()
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The device half of [`Tokens`]: the one buffer of ids and grouping, and the CUDA op
    //! code's views of it.

    use std::sync::Arc;

    use kernels::cpu::embedding::{grouping_table, grouping_table_len};
    use kernels::cuda::{CudaDevice, DeviceBuffer, DeviceRun};

    use super::Tokens;
    use crate::cuda::cuda_error;
    use crate::{Error, Result};

    /// `[ids | grouping_table(ids)]` on one GPU, or the ids alone (`grouped` false).
    pub(super) struct DeviceTokens {
        dev: Arc<CudaDevice>,
        buffer: DeviceBuffer<u32>,
        grouped: bool,
    }

    /// The host image of the device buffer: the ids, then their grouping when `grouped`.
    fn staged(op: &'static str, ids: &[u32], grouped: bool) -> Result<Vec<u32>> {
        if u32::try_from(ids.len()).is_err() {
            return Err(Error::InvalidShape {
                op,
                shape: vec![ids.len()],
                reason: "more than 2³² − 1 ids cannot be grouped by u32 positions".into(),
            });
        }
        Ok(if grouped { [ids, &grouping_table(ids)].concat() } else { ids.to_vec() })
    }

    impl DeviceTokens {
        /// `ids`, and their grouping when `grouped`, on GPU `ordinal`, in one pinned copy.
        pub(super) fn upload(ids: &[u32], ordinal: usize, grouped: bool) -> Result<DeviceTokens> {
            const OP: &str = "Tokens::new";
            let dev = crate::cuda::device(ordinal)?;
            let buffer = dev.upload(&staged(OP, ids, grouped)?).map_err(|e| cuda_error(OP, e))?;
            Ok(DeviceTokens { dev, buffer, grouped })
        }

        /// Overwrites the buffer in place with `ids` (as many as before), and their grouping
        /// when it holds one.
        pub(super) fn refill(&mut self, ids: &[u32]) -> Result<()> {
            const OP: &str = "Tokens::refill";
            let staged = staged(OP, ids, self.grouped)?;
            self.dev.copy_to_device(&staged, &mut self.buffer).map_err(|e| cuda_error(OP, e))
        }
    }

    impl Tokens {
        /// The device buffer, or an error naming `op` for ids on the CPU.
        fn device_buffer(&self, op: &'static str) -> Result<&DeviceBuffer<u32>> {
            let gpu = self.inner.gpu.as_ref().ok_or(Error::UnsupportedDevice { op, device: self.device() })?;
            Ok(&gpu.buffer)
        }

        /// The `N` ids on the GPU (the gather's indices, the loss's targets).
        pub(crate) fn device_ids(&self, op: &'static str) -> Result<DeviceRun<'_, u32>> {
            Ok(DeviceRun::new(self.device_buffer(op)?, 0, self.len())?)
        }

        /// The ids' grouping on the GPU, `3N + 2` elements (what the embedding backward reads);
        /// an error naming `op` for [`Tokens::labels`], which have none.
        pub(crate) fn device_grouping(&self, op: &'static str) -> Result<DeviceRun<'_, u32>> {
            let n = self.len();
            let gpu = self.inner.gpu.as_ref().ok_or(Error::UnsupportedDevice { op, device: self.device() })?;
            if !gpu.grouped {
                return Err(Error::InvalidShape {
                    op,
                    shape: vec![n],
                    reason: "these ids were uploaded as labels, without the grouping an embedding's backward \
                             reads (make them with Tokens::new)"
                        .into(),
                });
            }
            Ok(DeviceRun::new(&gpu.buffer, n, grouping_table_len(n))?)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::Device;

        /// GPU 0, or `None` (saying so) without one, unless `TRANSPONDER_REQUIRE_CUDA` is set.
        fn gpu() -> Option<Device> {
            if crate::cuda::is_available() {
                return Some(Device::Cuda(0));
            }
            assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: no GPU");
            eprintln!("skipping: no CUDA device");
            None
        }

        /// The whole device buffer, downloaded.
        fn downloaded(tokens: &Tokens) -> Vec<u32> {
            let gpu = tokens.inner.gpu.as_ref().unwrap();
            gpu.dev.download(&gpu.buffer).unwrap()
        }

        #[test]
        fn the_buffer_holds_the_ids_and_their_grouping() {
            let Some(device) = gpu() else { return };
            let ids = [7, 3, 7, 7, 0, 3];
            let tokens = Tokens::new(&ids, device).unwrap();
            #[rustfmt::skip]
            let want = [
                7, 3, 7, 7, 0, 3, // ids
                0, 3, 7, 0, 0, 0, // rows: distinct ids ascending, zero padding
                0, 1, 3, 6, 0, 0, 0, // starts
                4, 1, 5, 0, 2, 3, // positions of 0, of 3, of 7: increasing within each
                3, // distinct
            ];
            assert_eq!(downloaded(&tokens), want);
            assert_eq!(tokens.device_ids("test").unwrap().len(), ids.len());
            assert_eq!(tokens.device_grouping("test").unwrap().len(), 3 * ids.len() + 2);
            // An empty batch: starts [0] and distinct 0.
            let empty = Tokens::new(&[], device).unwrap();
            assert_eq!(downloaded(&empty), [0, 0]);
            assert!(empty.is_empty() && empty.max_id().is_none());
        }

        #[test]
        fn refill_rewrites_the_same_buffer() {
            let Some(device) = gpu() else { return };
            let mut tokens = Tokens::new(&[1, 2, 2], device).unwrap();
            let address = tokens.device_ids("test").unwrap().device_ptr();
            tokens.refill(&[5, 5, 0]).unwrap();
            assert_eq!(tokens.device_ids("test").unwrap().device_ptr(), address, "refill moved the ids");
            assert_eq!(downloaded(&tokens), downloaded(&Tokens::new(&[5, 5, 0], device).unwrap()));
            assert_eq!((tokens.host(), tokens.max_id()), (&[5, 5, 0][..], Some(5)));
            let err = tokens.refill(&[1, 2]).unwrap_err();
            assert!(matches!(err, Error::InvalidShape { .. }), "{err}");
            let held = tokens.clone();
            let err = tokens.refill(&[1, 2, 3]).unwrap_err();
            assert!(matches!(err, Error::Shared { .. }), "{err}");
            drop(held);
            assert_eq!(downloaded(&tokens)[..3], [5, 5, 0], "a rejected refill writes nothing");
            tokens.refill(&[1, 2, 3]).unwrap();
            // The ids they hold: no copy to the device, and no error while a clone is alive.
            let Device::Cuda(ordinal) = device else { unreachable!("gpu() gives a CUDA device") };
            let dev = crate::cuda::device(ordinal).unwrap();
            let (held, before) = (tokens.clone(), dev.counters());
            tokens.refill(&[1, 2, 3]).unwrap();
            assert_eq!(dev.counters().since(&before).host_to_device_copies, 0, "an unchanged batch was uploaded");
            drop(held);
        }

        #[test]
        fn labels_go_up_without_the_grouping() {
            let Some(device) = gpu() else { return };
            let mut labels = Tokens::labels(&[7, 0, 7], device).unwrap();
            assert_eq!(downloaded(&labels), [7, 0, 7], "the ids alone");
            let err = labels.device_grouping("test").unwrap_err();
            assert!(matches!(err, Error::InvalidShape { op: "test", .. }), "{err}");
            labels.refill(&[1, 2, 3]).unwrap();
            assert_eq!(downloaded(&labels), [1, 2, 3], "a refill keeps them ungrouped");
        }

        #[test]
        fn cpu_tokens_have_no_device_buffer() {
            let tokens = Tokens::new(&[1], Device::Cpu).unwrap();
            assert!(matches!(tokens.device_ids("test"), Err(Error::UnsupportedDevice { op: "test", .. })));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ids_and_range_checks() {
        let tokens = Tokens::new(&[4, 0, 9, 2], Device::Cpu).unwrap();
        assert_eq!((tokens.len(), tokens.is_empty(), tokens.device()), (4, false, Device::Cpu));
        assert_eq!((tokens.host(), tokens.max_id()), (&[4, 0, 9, 2][..], Some(9)));
        tokens.check_below("op", 10).unwrap();
        let err = tokens.check_below("op", 4).unwrap_err();
        assert_eq!(err, Error::IndexOutOfRange { op: "op", index: 4, size: 4 }, "the first id out of range");
        let empty = Tokens::new(&[], Device::Cpu).unwrap();
        assert!(empty.is_empty() && empty.max_id().is_none());
        empty.check_below("op", 0).unwrap();
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn gpu_tokens_need_the_cuda_feature() {
        let err = Tokens::new(&[1], Device::Cuda(0)).unwrap_err();
        assert!(matches!(err, Error::UnsupportedDevice { device: Device::Cuda(0), .. }), "{err}");
    }

    #[test]
    fn refill_keeps_the_length_and_needs_the_only_holder() {
        let mut tokens = Tokens::new(&[1, 2, 3], Device::Cpu).unwrap();
        tokens.refill(&[7, 0, 7]).unwrap();
        assert_eq!((tokens.host(), tokens.max_id()), (&[7, 0, 7][..], Some(7)));
        let err = tokens.refill(&[1]).unwrap_err();
        assert!(err.to_string().contains("1 ids given, the Tokens hold 3"), "{err}");
        let held = tokens.clone();
        let err = tokens.refill(&[1, 2, 3]).unwrap_err();
        assert!(matches!(err, Error::Shared { op: "Tokens::refill", .. }), "{err}");
        assert_eq!(held.host(), [7, 0, 7], "a rejected refill changes nothing");
        drop(held);
        tokens.refill(&[1, 2, 3]).unwrap();
        assert_eq!(tokens.host(), [1, 2, 3]);
    }
}

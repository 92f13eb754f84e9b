//! Checkpoint tensor I/O in the safetensors format, independent of the engine's tensor type.
//!
//! Tensors travel as plain `f32` buffers with a shape and a name: the checkpoint code copies
//! weights and optimizer moments to the host, then calls [`save_tensors`]. Files are always
//! written as `F32`; [`load_tensors`] also reads `BF16` and `F16` files (e.g. Hugging Face
//! exports) and widens them to `f32`. PyTorch equivalent: `safetensors.torch.save_file` /
//! `load_file`.
//!
//! Every write is atomic ([`crate::atomic`], whose functions are re-exported here): a crash
//! or a kill at any point leaves either the previous file or the new one, never a torn mix.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, View};

pub use crate::atomic::{atomic_replace, atomic_write, temp_path_for};
use crate::atomic::{stage, Staged};
use crate::regular_file::open_regular;

/// A tensor read back from a file: its name, its shape and its values widened to `f32`
/// (row-major, `data.len()` is the product of `shape`).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// The tensor's key in the file, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl NamedTensor {
    /// A borrowed view of this tensor, in the form [`save_tensors`] takes.
    pub fn as_slice(&self) -> TensorSlice<'_> {
        TensorSlice { name: &self.name, shape: &self.shape, data: &self.data }
    }
}

/// A borrowed tensor to save: no copy of the caller's buffers is needed to describe it.
#[derive(Debug, Clone, Copy)]
pub struct TensorSlice<'a> {
    /// The tensor's key in the file.
    pub name: &'a str,
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: &'a [usize],
    /// Row-major values; the length must be the product of `shape`.
    pub data: &'a [f32],
}

/// What the safetensors serializer needs from one tensor; bytes are produced little-endian
/// as the format requires, one tensor at a time, so peak extra memory is the largest tensor.
struct F32View<'a> {
    shape: &'a [usize],
    data: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Owned(self.data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.data)
    }
}

/// Writes `tensors` as an `F32` safetensors file at `path`, atomically, with `metadata` as the
/// file's string-to-string `__metadata__` (step, RNG state, config hash, ...).
///
/// Errors when a tensor's data length disagrees with its shape, when two tensors share a name,
/// or when any file operation fails; the previous file at `path` is then left untouched.
pub fn save_tensors(path: &Path, tensors: &[TensorSlice<'_>], metadata: &BTreeMap<String, String>) -> Result<()> {
    stage_tensors(path, tensors, metadata)?.commit()
}

/// [`save_tensors`] up to the rename: the file is written and fsynced at its temp path, to be
/// committed together with the other files of a set ([`crate::atomic::commit_all`]).
pub fn stage_tensors(path: &Path, tensors: &[TensorSlice<'_>], metadata: &BTreeMap<String, String>) -> Result<Staged> {
    let mut seen = std::collections::BTreeSet::new();
    for t in tensors {
        let expected: usize = t.shape.iter().product();
        ensure!(
            expected == t.data.len(),
            "cannot save {}: tensor `{}` has shape {:?} ({} values) but {} values of data",
            path.display(),
            t.name,
            t.shape,
            expected,
            t.data.len()
        );
        ensure!(seen.insert(t.name), "cannot save {}: tensor name `{}` appears twice", path.display(), t.name);
    }
    let info: Option<HashMap<String, String>> =
        if metadata.is_empty() { None } else { Some(metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect()) };
    let views = tensors.iter().map(|t| (t.name, F32View { shape: t.shape, data: t.data }));
    stage(path, |tmp| {
        safetensors::serialize_to_file(views, info, tmp)
            .with_context(|| format!("serializing safetensors to {}", tmp.display()))
    })
}

/// Reads every tensor of the safetensors file at `path`, widened to `f32`, sorted by name,
/// together with the file's `__metadata__` (empty when it has none).
///
/// Accepts `F32`, `BF16` and `F16` tensors; any other dtype is an error naming the tensor.
/// The file is memory-mapped, so only the converted copies occupy memory.
pub fn load_tensors(path: &Path) -> Result<(Vec<NamedTensor>, BTreeMap<String, String>)> {
    let (file, size) = open_regular(path, "checkpoint")?;
    ensure!(size > 0, "checkpoint {} is empty (0 bytes): not a safetensors file", path.display());
    // SAFETY: the map is read-only and dropped before returning; checkpoints are replaced by
    // rename (never rewritten in place), so the mapped inode does not change under us.
    let map = unsafe { Mmap::map(&file) }.with_context(|| format!("memory-mapping checkpoint {}", path.display()))?;
    let (_, header) = SafeTensors::read_metadata(&map)
        .with_context(|| format!("{} is not a valid safetensors file (corrupt or truncated header)", path.display()))?;
    let metadata: BTreeMap<String, String> =
        header.metadata().as_ref().map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default();
    let file_tensors = SafeTensors::deserialize(&map)
        .with_context(|| format!("{} is not a valid safetensors file (corrupt or truncated)", path.display()))?;
    let mut tensors = Vec::with_capacity(file_tensors.len());
    for (name, view) in file_tensors.iter() {
        let data = widen_to_f32(view.dtype(), view.data())
            .with_context(|| format!("reading tensor `{name}` of {}", path.display()))?;
        tensors.push(NamedTensor { name: name.to_string(), shape: view.shape().to_vec(), data });
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((tensors, metadata))
}

/// Reads only the `__metadata__` of the safetensors file at `path` (empty when it has none):
/// the header, not the tensors, so it is cheap for any checkpoint size.
pub fn load_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
    let (file, size) = open_regular(path, "checkpoint")?;
    ensure!(size > 0, "checkpoint {} is empty (0 bytes): not a safetensors file", path.display());
    // SAFETY: as in `load_tensors`: read-only, dropped before returning, replaced only by rename.
    let map = unsafe { Mmap::map(&file) }.with_context(|| format!("memory-mapping checkpoint {}", path.display()))?;
    let (_, header) = SafeTensors::read_metadata(&map)
        .with_context(|| format!("{} is not a valid safetensors file (corrupt or truncated header)", path.display()))?;
    Ok(header.metadata().as_ref().map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default())
}

/// Converts little-endian `F32`, `BF16` or `F16` bytes to `f32` values.
fn widen_to_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let values = match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        other => bail!("unsupported dtype {other:?} (only F32, BF16 and F16 can be loaded)"),
    };
    Ok(values)
}

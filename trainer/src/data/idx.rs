//! MNIST and Fashion-MNIST in their IDX files, gzipped or plain, as 1×28×28 image datasets.
//!
//! A directory holds the four standard files, each either plain (memory-mapped) or with
//! `.gz` (decompressed into memory, no further than the header declares; 47 MB for the
//! 60,000 training images):
//!
//! - `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`: the training split;
//! - `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`: the official test split.
//!
//! IDX layout (big-endian): two zero bytes, an element type (`0x08`: unsigned byte), the
//! number of dimensions `d`, then `d` sizes as `u32`, then the elements row-major. Image
//! files are `[N, H, W]`, label files `[N]`. Every label must be below 10 — both datasets
//! have 10 classes — and every size, count and length must agree; errors say which file
//! is wrong and how (not IDX, truncated, mismatched counts, bad label), like the CIFAR
//! reader in [`super::images`].

use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use flate2::read::GzDecoder;
use memmap2::Mmap;

use super::images::{GreyPixels, ImageDataset, Split};

/// Classes of MNIST and of Fashion-MNIST (digits 0-9; ten kinds of clothing).
pub const IDX_CLASSES: usize = 10;
/// The IDX element type of unsigned bytes, the only one these datasets use.
const UNSIGNED_BYTE: u8 = 0x08;
/// The most gzip (deflate) expands its input: 1032 to 1.
const MAX_GZIP_RATIO: u64 = 1032;
/// The gzip magic number, how a compressed file is recognised.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// A file's bytes: mapped when plain, decompressed when gzipped.
enum FileBytes {
    Mapped(Mmap),
    Inflated(Vec<u8>),
}

impl FileBytes {
    fn bytes(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(map) => map,
            FileBytes::Inflated(bytes) => bytes,
        }
    }
}

/// A parsed IDX header: the sizes of each dimension and where the elements start.
struct Header {
    dims: Vec<usize>,
    len: usize,
}

/// Loads one split from `dir`: `train-*` for [`Split::Train`], `t10k-*` for
/// [`Split::Test`], each file plain or `.gz`.
pub fn load_idx_dir(dir: &Path, split: Split) -> Result<ImageDataset> {
    let prefix = match split {
        Split::Train => "train",
        Split::Test => "t10k",
    };
    let images = find(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels = find(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    load_idx(&images, &labels)
}

/// Loads an image file `[N, H, W]` and its label file `[N]` (each plain or gzipped) as
/// `N` one-channel images with pixels 0..=255 and 10 classes.
pub fn load_idx(images: &Path, labels: &Path) -> Result<ImageDataset> {
    let label_bytes = open(labels)?;
    let label_header = header(label_bytes.bytes(), labels, 1)?;
    let labels_u32: Vec<u32> = label_bytes.bytes()[label_header.len..].iter().map(|&b| u32::from(b)).collect();
    if let Some(i) = labels_u32.iter().position(|&l| l as usize >= IDX_CLASSES) {
        bail!(
            "IDX label file {} item {i}: label {} is not below {IDX_CLASSES} classes",
            labels.display(),
            labels_u32[i]
        );
    }

    let image_bytes = open(images)?;
    let image_header = header(image_bytes.bytes(), images, 3)?;
    let (count, height, width) = (image_header.dims[0], image_header.dims[1], image_header.dims[2]);
    ensure!(
        count == labels_u32.len(),
        "IDX image file {} holds {count} images but label file {} holds {} labels: files of different splits?",
        images.display(),
        labels.display(),
        labels_u32.len()
    );
    let pixels = match image_bytes {
        FileBytes::Mapped(map) => GreyPixels::Mapped { map, header_bytes: image_header.len },
        FileBytes::Inflated(mut bytes) => {
            bytes.drain(..image_header.len);
            GreyPixels::Owned(bytes)
        }
    };
    Ok(ImageDataset::greyscale(pixels, labels_u32, height, width, IDX_CLASSES))
}

/// `dir/name`, or `dir/name.gz` when only that exists.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let plain = dir.join(name);
    let gzipped = dir.join(format!("{name}.gz"));
    if plain.exists() {
        Ok(plain)
    } else if gzipped.exists() {
        Ok(gzipped)
    } else {
        bail!("no IDX file {name} or {name}.gz in {}", dir.display())
    }
}

/// The file's bytes: decompressed when they start with the gzip magic, else mapped.
fn open(path: &Path) -> Result<FileBytes> {
    let mut file = File::open(path).with_context(|| format!("opening IDX file {}", path.display()))?;
    let size = file.metadata().with_context(|| format!("reading the size of {}", path.display()))?.len();
    ensure!(size > 0, "IDX file {} is empty", path.display());
    let mut magic = [0u8; 2];
    if size >= 2 {
        file.read_exact(&mut magic).with_context(|| format!("reading {}", path.display()))?;
    }
    if magic == GZIP_MAGIC {
        file.rewind().with_context(|| format!("reading {}", path.display()))?;
        return inflate(GzDecoder::new(file), path, size).map(FileBytes::Inflated);
    }
    // SAFETY: read-only map of a dataset file that nothing writes while we train.
    let map = unsafe { Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))?;
    Ok(FileBytes::Mapped(map))
}

/// Decompresses an IDX file no further than its header declares (plus one byte, so that
/// [`header`] can report a longer body): a small `.gz` whose body inflates past its sizes
/// (300 KB to 364 MB) is refused without being held, and so is a header that declares more
/// than gzip can expand `compressed` bytes to.
fn inflate(mut gz: impl Read, path: &Path, compressed: u64) -> Result<Vec<u8>> {
    let context = || format!("decompressing {} (corrupt or truncated gzip?)", path.display());
    let mut bytes = vec![0u8; 4];
    gz.read_exact(&mut bytes).with_context(context)?;
    let mut sizes = vec![0u8; 4 * usize::from(bytes[3])];
    gz.read_exact(&mut sizes).with_context(context)?;
    bytes.extend_from_slice(&sizes);
    let declared = sizes
        .chunks_exact(4)
        .try_fold(1u64, |acc, b| acc.checked_mul(u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))));
    let most = compressed.saturating_mul(MAX_GZIP_RATIO);
    let Some(body) = declared.filter(|&n| n <= most) else {
        bail!(
            "IDX file {} declares sizes {sizes:?} bytes, more than its {compressed} gzip bytes can hold",
            path.display()
        );
    };
    gz.take(body + 1).read_to_end(&mut bytes).with_context(context)?;
    Ok(bytes)
}

/// Parses and checks the header of `bytes` (from `path`): unsigned bytes, `ndims`
/// dimensions, no zero size, and exactly as many element bytes as the sizes say.
fn header(bytes: &[u8], path: &Path, ndims: u8) -> Result<Header> {
    let (what, a_file) = if ndims == 1 { ("label", "a label file") } else { ("image", "an image file") };
    ensure!(
        bytes.len() >= 4 && bytes[0] == 0 && bytes[1] == 0,
        "{} is not an IDX file: it does not start with two zero bytes",
        path.display()
    );
    ensure!(
        bytes[2] == UNSIGNED_BYTE,
        "IDX file {} holds elements of type 0x{:02x}, expected 0x{UNSIGNED_BYTE:02x} (unsigned bytes)",
        path.display(),
        bytes[2]
    );
    ensure!(
        bytes[3] == ndims,
        "IDX file {} has {} dimensions, {a_file} has {ndims}: images and labels swapped?",
        path.display(),
        bytes[3]
    );
    let len = 4 + 4 * usize::from(ndims);
    ensure!(bytes.len() >= len, "IDX file {} ends inside its header: truncated?", path.display());
    let dims: Vec<usize> =
        bytes[4..len].chunks_exact(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize).collect();
    ensure!(dims.iter().all(|&d| d > 0), "IDX file {} has a zero size in {dims:?}: no {what}s", path.display());
    let expected = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let body = bytes.len() - len;
    ensure!(
        expected == Some(body),
        "IDX file {} has {body} bytes after its header, its sizes {dims:?} need {}: truncated, or not this file?",
        path.display(),
        expected.map_or("more than fit in memory".into(), |e| e.to_string())
    );
    Ok(Header { dims, len })
}

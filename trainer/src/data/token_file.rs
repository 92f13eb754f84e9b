//! Token files: the nanoGPT raw format and the two llm.c kinds, read by memory map.
//!
//! Formats (SPEC §8):
//! - nanoGPT raw: little-endian `u16` tokens, no header (`np.memmap(..., dtype=np.uint16)`).
//! - llm.c (`dev/data/data_common.py`): a header of 256 little-endian `i32` —
//!   `[0]` magic, `[1]` version, `[2]` token count, the rest zero — then the tokens.
//!   GPT-2 kind: magic 20240520, version 1, `u16` tokens; LLaMA-3 kind: magic 20240801,
//!   version 7, `u32` tokens.
//!
//! [`TokenFile::open`] detects llm.c files by their magic and treats anything else as raw
//! `u16`. A raw file whose first two tokens happen to spell an llm.c magic (tokens 53448, 308
//! or 53697, 308) would be misread; [`TokenFile::open_as`] forces the format.
//!
//! Files are never loaded whole: the map is paged in by the OS as windows are copied out.
//! Writers go through [`atomic_replace`], so a killed `prepare` never leaves a torn file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;

use crate::safetensors_io::atomic_replace;

/// Magic number of llm.c's GPT-2 kind (`u16` tokens).
pub const LLMC_GPT2_MAGIC: i32 = 20240520;
/// Header version of llm.c's GPT-2 kind.
pub const LLMC_GPT2_VERSION: i32 = 1;
/// Magic number of llm.c's LLaMA-3 kind (`u32` tokens).
pub const LLMC_LLAMA3_MAGIC: i32 = 20240801;
/// Header version of llm.c's LLaMA-3 kind.
pub const LLMC_LLAMA3_VERSION: i32 = 7;
/// Number of `i32` slots in an llm.c header.
pub const LLMC_HEADER_INTS: usize = 256;
/// Size in bytes of an llm.c header.
pub const LLMC_HEADER_BYTES: usize = LLMC_HEADER_INTS * std::mem::size_of::<i32>();
/// Vocabularies below this size are written as `u16` (GPT-2 kind), larger ones as `u32`.
pub const U16_VOCAB_LIMIT: usize = 1 << 16;

/// The on-disk layout of a token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenFormat {
    /// nanoGPT: little-endian `u16` tokens, no header.
    NanoGptRaw,
    /// llm.c GPT-2 kind: 1024-byte header (magic 20240520, version 1), `u16` tokens.
    LlmcGpt2,
    /// llm.c LLaMA-3 kind: 1024-byte header (magic 20240801, version 7), `u32` tokens.
    LlmcLlama3,
}

impl TokenFormat {
    /// Bytes per token: 2 or 4.
    pub fn token_bytes(self) -> usize {
        match self {
            TokenFormat::NanoGptRaw | TokenFormat::LlmcGpt2 => 2,
            TokenFormat::LlmcLlama3 => 4,
        }
    }

    /// Bytes before the first token: 0 or 1024.
    pub fn header_bytes(self) -> usize {
        match self {
            TokenFormat::NanoGptRaw => 0,
            TokenFormat::LlmcGpt2 | TokenFormat::LlmcLlama3 => LLMC_HEADER_BYTES,
        }
    }
}

/// A memory-mapped, validated token file.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    format: TokenFormat,
    len: usize,
    map: Mmap,
}

impl TokenFile {
    /// Opens `path`, choosing llm.c when the file starts with a known llm.c magic and nanoGPT
    /// raw otherwise. Errors name the file and what is wrong with it: missing, empty, an odd
    /// byte length for `u16`, a header shorter than 1024 bytes, an unknown version for a known
    /// magic, a token count disagreeing with the file's length, or no tokens at all.
    pub fn open(path: &Path) -> Result<TokenFile> {
        let map = map_file(path)?;
        let format = detect_format(&map);
        Self::from_map(path, map, format)
    }

    /// Opens `path` as `format`, without auto-detection (the same validation applies).
    pub fn open_as(path: &Path, format: TokenFormat) -> Result<TokenFile> {
        let map = map_file(path)?;
        Self::from_map(path, map, format)
    }

    fn from_map(path: &Path, map: Mmap, format: TokenFormat) -> Result<TokenFile> {
        let len =
            validate(&map, format).with_context(|| format!("invalid token file {} ({format:?})", path.display()))?;
        Ok(TokenFile { path: path.to_path_buf(), format, len, map })
    }

    /// The path the file was opened from (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's layout.
    pub fn format(&self) -> TokenFormat {
        self.format
    }

    /// Number of tokens (at least 1 for an opened file).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a file without tokens is refused by [`TokenFile::open`].
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token `i`, or `None` when `i >= len()`.
    pub fn get(&self, i: usize) -> Option<u32> {
        (i < self.len).then(|| self.token_at(i))
    }

    /// Copies tokens `start .. start + len` into `out[..len]`.
    ///
    /// Errors (naming the file) when the window runs past the end or `out` is too short.
    pub fn copy_window(&self, start: usize, len: usize, out: &mut [u32]) -> Result<()> {
        let end = start.checked_add(len).filter(|&end| end <= self.len);
        let Some(end) = end else {
            bail!(
                "token window {start}..{start}+{len} runs past the end of {} ({} tokens)",
                self.path.display(),
                self.len
            );
        };
        ensure!(
            out.len() >= len,
            "output buffer holds {} tokens but the window of {} needs {len}",
            out.len(),
            self.path.display()
        );
        let width = self.format.token_bytes();
        let offset = self.format.header_bytes();
        let bytes = &self.map[offset + start * width..offset + end * width];
        let out = &mut out[..len];
        match width {
            2 => {
                for (dst, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *dst = u32::from(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            _ => {
                for (dst, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *dst = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
        Ok(())
    }

    /// The largest token id in the file (a full scan; used to check a file against a vocab).
    pub fn max_token(&self) -> u32 {
        let offset = self.format.header_bytes();
        let bytes = &self.map[offset..offset + self.len * self.format.token_bytes()];
        match self.format.token_bytes() {
            2 => bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))).max(),
            _ => bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).max(),
        }
        .unwrap_or(0)
    }

    fn token_at(&self, i: usize) -> u32 {
        let width = self.format.token_bytes();
        let at = self.format.header_bytes() + i * width;
        let b = &self.map[at..at + width];
        match width {
            2 => u32::from(u16::from_le_bytes([b[0], b[1]])),
            _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

/// Errors when `file` holds a token id `>= vocab_size`, naming the file, the id and the vocab.
pub fn check_vocab(file: &TokenFile, vocab_size: usize) -> Result<()> {
    let max = file.max_token();
    ensure!(
        (max as usize) < vocab_size,
        "token file {} contains token id {max} but the vocabulary has only {vocab_size} \
         entries (ids 0..{vocab_size}); was it prepared with a different tokenizer?",
        file.path.display()
    );
    Ok(())
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).with_context(|| format!("opening token file {}", path.display()))?;
    let size = file.metadata().with_context(|| format!("reading the size of {}", path.display()))?.len();
    ensure!(size > 0, "token file {} is empty (0 bytes)", path.display());
    // SAFETY: the map is read-only; token files are written once by rename (atomic_replace)
    // and never modified in place while a trainer reads them.
    unsafe { Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))
}

fn header_int(bytes: &[u8], slot: usize) -> Option<i32> {
    let b = bytes.get(slot * 4..slot * 4 + 4)?;
    Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn detect_format(bytes: &[u8]) -> TokenFormat {
    match header_int(bytes, 0) {
        Some(LLMC_GPT2_MAGIC) => TokenFormat::LlmcGpt2,
        Some(LLMC_LLAMA3_MAGIC) => TokenFormat::LlmcLlama3,
        _ => TokenFormat::NanoGptRaw,
    }
}

/// Checks `bytes` against `format` and returns the token count.
fn validate(bytes: &[u8], format: TokenFormat) -> Result<usize> {
    let size = bytes.len();
    let count = match format {
        TokenFormat::NanoGptRaw => {
            ensure!(size.is_multiple_of(2), "odd length of {size} bytes: raw u16 tokens need an even number of bytes");
            size / 2
        }
        TokenFormat::LlmcGpt2 | TokenFormat::LlmcLlama3 => {
            ensure!(
                size >= LLMC_HEADER_BYTES,
                "only {size} bytes, too short for the {LLMC_HEADER_BYTES}-byte llm.c header"
            );
            let (magic, version) = match format {
                TokenFormat::LlmcGpt2 => (LLMC_GPT2_MAGIC, LLMC_GPT2_VERSION),
                _ => (LLMC_LLAMA3_MAGIC, LLMC_LLAMA3_VERSION),
            };
            let found_magic = header_int(bytes, 0).unwrap_or(0);
            ensure!(found_magic == magic, "bad magic {found_magic}, expected {magic}");
            let found_version = header_int(bytes, 1).unwrap_or(0);
            ensure!(found_version == version, "unknown version {found_version} for magic {magic} (expected {version})");
            let header_count = header_int(bytes, 2).unwrap_or(0);
            let width = format.token_bytes();
            let body = size - LLMC_HEADER_BYTES;
            ensure!(
                header_count >= 0 && body.is_multiple_of(width) && body / width == header_count as usize,
                "header says {header_count} tokens but the file holds {body} bytes after the \
                 header ({} tokens of {width} bytes{})",
                body / width,
                if body.is_multiple_of(width) { "" } else { " plus a partial token" }
            );
            header_count as usize
        }
    };
    ensure!(count > 0, "the file holds no tokens");
    Ok(count)
}

/// Writes `tokens` as an llm.c token file at `path`, atomically: the GPT-2 kind (`u16`) when
/// `vocab_size < 65,536`, the LLaMA-3 kind (`u32`) otherwise.
///
/// Errors when a token is `>= vocab_size` or the count does not fit the header's `i32`.
pub fn write_llmc(path: &Path, tokens: &[u32], vocab_size: usize) -> Result<()> {
    if let Some((i, &bad)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab_size) {
        bail!("cannot write {}: token {i} is {bad}, outside the vocabulary of {vocab_size}", path.display());
    }
    let count = i32::try_from(tokens.len()).with_context(|| {
        format!("cannot write {}: {} tokens do not fit llm.c's i32 header count", path.display(), tokens.len())
    })?;
    let (magic, version, wide) = if vocab_size < U16_VOCAB_LIMIT {
        (LLMC_GPT2_MAGIC, LLMC_GPT2_VERSION, false)
    } else {
        (LLMC_LLAMA3_MAGIC, LLMC_LLAMA3_VERSION, true)
    };
    let mut header = [0i32; LLMC_HEADER_INTS];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    atomic_replace(path, |tmp| {
        stream_to(tmp, |w| {
            for h in header {
                w.write_all(&h.to_le_bytes())?;
            }
            for &t in tokens {
                if wide {
                    w.write_all(&t.to_le_bytes())?;
                } else {
                    // Range-checked above: every token is < vocab_size < 65,536.
                    w.write_all(&(t as u16).to_le_bytes())?;
                }
            }
            Ok(())
        })
    })
}

/// Writes `tokens` as a nanoGPT raw file (little-endian `u16`, no header), atomically.
pub fn write_nanogpt_raw(path: &Path, tokens: &[u16]) -> Result<()> {
    atomic_replace(path, |tmp| {
        stream_to(tmp, |w| {
            for &t in tokens {
                w.write_all(&t.to_le_bytes())?;
            }
            Ok(())
        })
    })
}

fn stream_to(path: &Path, body: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>) -> Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::new(file);
    body(&mut w).and_then(|()| w.flush()).with_context(|| format!("writing {}", path.display()))
}

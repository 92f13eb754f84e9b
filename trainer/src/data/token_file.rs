//! Token files: the nanoGPT raw format and the two llm.c kinds, read by memory map.
//!
//! Formats (SPEC §8):
//! - nanoGPT raw: little-endian `u16` tokens, no header (`np.memmap(..., dtype=np.uint16)`).
//! - llm.c (`dev/data/data_common.py`): a header of 256 little-endian `i32` —
//!   `[0]` magic, `[1]` version, `[2]` token count, the rest zero — then the tokens.
//!   GPT-2 kind: magic 20240520, version 1, `u16` tokens; LLaMA-3 kind: magic 20240801,
//!   version 7, `u32` tokens.
//!
//! Detection ([`DataFormat::Auto`], what [`TokenFile::open`] does):
//! 1. a file starting with a known llm.c magic is llm.c (its version, count and length are then
//!    checked: a mismatch is an error, never a fallback to raw);
//! 2. a file that *carries an llm.c header* but whose magic/version pair is not a known one is
//!    an error naming the magic and the version (a corrupted or foreign llm.c file). A file
//!    carries an llm.c header when it is at least 1,024 bytes long, slots `[3..256]` are all
//!    zero, and slot `[2]` is a token count `n ≥ 1` that fits the length for 2- or 4-byte
//!    tokens: `1024 + 2n` or `1024 + 4n` bytes exactly;
//! 3. anything else is nanoGPT raw `u16`.
//!
//! Raw data is read as an llm.c header only by a coincidence of 1,016 specific bytes; a raw
//! file whose first two tokens spell an llm.c magic (tokens 53448, 308 or 53697, 308) is
//! misread, and [`DataFormat::NanoGpt`] (`--data-format nanogpt`) forces the raw reading.
//!
//! Files are never loaded whole: the map is paged in by the OS as windows are copied out.
//! Writers go through [`atomic_replace`], so a killed `prepare` never leaves a torn file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::atomic::atomic_replace;
use crate::config::choices::named_choice;

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

/// How to read a token file (`--data-format`): detect, or force one family.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// Detect llm.c by its header, raw `u16` otherwise (the module's rule).
    #[default]
    Auto,
    /// llm.c only: a file without a known magic and version is an error.
    Llmc,
    /// nanoGPT raw `u16`, whatever the first bytes say.
    #[serde(rename = "nanogpt")]
    NanoGpt,
}

impl DataFormat {
    /// Every choice with its flag spelling, in the order errors list them.
    pub const ALL: [(&'static str, DataFormat); 3] =
        [("auto", DataFormat::Auto), ("llmc", DataFormat::Llmc), ("nanogpt", DataFormat::NanoGpt)];
}

named_choice!(DataFormat, "data format");

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

impl std::fmt::Display for TokenFormat {
    /// The format as messages name it: "nanoGPT raw uint16", "llm.c GPT-2 kind", ...
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenFormat::NanoGptRaw => "nanoGPT raw uint16",
            TokenFormat::LlmcGpt2 => "llm.c GPT-2 kind, uint16",
            TokenFormat::LlmcLlama3 => "llm.c LLaMA-3 kind, uint32",
        })
    }
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
    /// Opens `path`, detecting its format by the module's rule ([`DataFormat::Auto`]).
    /// Errors name the file and what is wrong with it: missing, empty, an odd byte length for
    /// `u16`, an llm.c header with an unknown magic or version, a header shorter than 1024
    /// bytes, a token count disagreeing with the file's length, or no tokens at all.
    pub fn open(path: &Path) -> Result<TokenFile> {
        Self::open_with(path, DataFormat::Auto)
    }

    /// Opens `path` as `choice` says: detect, llm.c only, or raw `u16` only.
    pub fn open_with(path: &Path, choice: DataFormat) -> Result<TokenFile> {
        let map = map_file(path)?;
        let format = choose_format(&map, choice).with_context(|| format!("invalid token file {}", path.display()))?;
        Self::from_map(path, map, format)
    }

    /// Opens `path` as `format`, without auto-detection (the same validation applies).
    pub fn open_as(path: &Path, format: TokenFormat) -> Result<TokenFile> {
        let map = map_file(path)?;
        Self::from_map(path, map, format)
    }

    fn from_map(path: &Path, map: Mmap, format: TokenFormat) -> Result<TokenFile> {
        let len =
            validate(&map, format).with_context(|| format!("invalid token file {} ({format})", path.display()))?;
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

/// Errors when `file` holds a token id `>= vocab_size`, naming the file, how it was read,
/// the id and the vocabulary, with the likely causes.
pub fn check_vocab(file: &TokenFile, vocab_size: usize) -> Result<()> {
    let max = file.max_token();
    ensure!(
        (max as usize) < vocab_size,
        "token file {} (read as {}) contains token id {max} but the vocabulary has only \
         {vocab_size} entries (ids 0..{vocab_size}); was it prepared with a different tokenizer \
         (--tokenizer), or is it in another format (--data-format)?",
        file.path.display(),
        file.format
    );
    Ok(())
}

fn map_file(path: &Path) -> Result<Mmap> {
    let (file, size) = crate::regular_file::open_regular(path, "token file")?;
    ensure!(size > 0, "token file {} is empty (0 bytes)", path.display());
    // SAFETY: the map is read-only; token files are written once by rename (atomic_replace)
    // and never modified in place while a trainer reads them.
    unsafe { Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))
}

fn header_int(bytes: &[u8], slot: usize) -> Option<i32> {
    let b = bytes.get(slot * 4..slot * 4 + 4)?;
    Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// The layout to read `bytes` as, by `choice` and the module's detection rule.
fn choose_format(bytes: &[u8], choice: DataFormat) -> Result<TokenFormat> {
    let magic = header_int(bytes, 0);
    let known = match magic {
        Some(LLMC_GPT2_MAGIC) => Some(TokenFormat::LlmcGpt2),
        Some(LLMC_LLAMA3_MAGIC) => Some(TokenFormat::LlmcLlama3),
        _ => None,
    };
    let version = header_int(bytes, 1).unwrap_or(0);
    let magic = magic.unwrap_or(0);
    match (choice, known) {
        (DataFormat::NanoGpt, _) => Ok(TokenFormat::NanoGptRaw),
        (DataFormat::Auto | DataFormat::Llmc, Some(format)) => Ok(format),
        (DataFormat::Llmc, None) => bail!(
            "--data-format llmc: magic {magic} (version {version}) is not an llm.c magic \
             ({LLMC_GPT2_MAGIC} GPT-2 kind, {LLMC_LLAMA3_MAGIC} LLaMA-3 kind)"
        ),
        (DataFormat::Auto, None) if carries_llmc_header(bytes) => bail!(
            "the file carries an llm.c header (zero padding, a token count of {} that fits its \
             length) but magic {magic} with version {version} is no known llm.c kind \
             ({LLMC_GPT2_MAGIC}/{LLMC_GPT2_VERSION} GPT-2, {LLMC_LLAMA3_MAGIC}/{LLMC_LLAMA3_VERSION} \
             LLaMA-3): a corrupted or newer llm.c file? --data-format nanogpt reads it as raw uint16",
            header_int(bytes, 2).unwrap_or(0)
        ),
        (DataFormat::Auto, None) => Ok(TokenFormat::NanoGptRaw),
    }
}

/// The module's "carries an llm.c header" rule: ≥ 1024 bytes, slots `[3..256]` zero, and a
/// count `n ≥ 1` in slot `[2]` with a length of exactly `1024 + 2n` or `1024 + 4n` bytes.
fn carries_llmc_header(bytes: &[u8]) -> bool {
    let Some(header) = bytes.get(..LLMC_HEADER_BYTES) else {
        return false;
    };
    if header[3 * 4..].iter().any(|&b| b != 0) {
        return false;
    }
    let count = header_int(bytes, 2).unwrap_or(0);
    let body = (bytes.len() - LLMC_HEADER_BYTES) as u64;
    count > 0 && [2u64, 4].iter().any(|&width| count as u64 * width == body)
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

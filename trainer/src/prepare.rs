//! `prepare`: text files → `train.bin` + `val.bin` token files in llm.c format.
//!
//! The input files (UTF-8 text, plain or gzipped) are read in order, each tokenized on its own
//! and, when the tokenizer has an end-of-text token (GPT-2's 50256), preceded by it — llm.c's
//! `tinyshakespeare.py` convention, which marks document boundaries. [`ValSplit`] says which
//! tokens are held out: by default the concatenated stream is split by position, the first
//! `1 - f` of the tokens are `train.bin` and the last `f` are `val.bin` (nanoGPT's
//! `shakespeare_char/prepare.py` split); with [`ValSplit::EachFileTail`] the last `f` of
//! every file is held out, so validation covers every source of a mixed corpus. Either way
//! no validation token is in `train.bin`. Both files are replaced together, atomically: each
//! is written to its temp file ([`TokenSink`]) before either is renamed ([`commit_all`]).
//!
//! Inputs are streamed: read and decoded in 1 MiB pieces, encoded in ~1 MiB chunks cut only
//! where the cut provably does not change GPT-2's pre-tokenization (so chunked and whole-text
//! encodings are identical), the tokens written as they come, and the held-out tail moved to
//! `val.bin` through a fixed buffer. Peak memory is a few MiB whatever the inputs' size.
//!
//! The built-in corpus, tinyshakespeare, is compiled into the binary ([`TINYSHAKESPEARE`]),
//! so the default run needs no file from the repository.

use std::fs::{self, File};
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use flate2::read::GzDecoder;
use indicatif::{ProgressBar, ProgressStyle};

use crate::atomic::commit_all;
use crate::data::token_sink::TokenSink;
use crate::tokenizer::Tokenizer;

/// Inputs larger than this (in bytes, all files together) get a progress bar.
pub const PROGRESS_BAR_MIN_BYTES: u64 = 10 * 1000 * 1000;
/// Fewest tokens either split may have: one `T = 1` window needs 2.
pub const MIN_SPLIT_TOKENS: usize = 2;
/// Target size of one encoding chunk, in bytes.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Most text GPT-2 input may hold without a safe cut ([`next_cut`]) before it is refused.
pub const MAX_UNCUT_BYTES: usize = 64 << 20;
/// Name of the training split written into the output directory.
pub const TRAIN_FILE: &str = "train.bin";
/// Name of the validation split written into the output directory.
pub const VAL_FILE: &str = "val.bin";

/// Which tokens [`prepare_split`] holds out for validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValSplit {
    /// The last fraction of all files' tokens, concatenated in order.
    StreamTail,
    /// The last fraction of each file's tokens: validation then samples every file.
    EachFileTail,
}

/// The gzip magic number: inputs starting with it are decompressed.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// What [`prepare`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareReport {
    /// Path of `train.bin`.
    pub train_path: PathBuf,
    /// Path of `val.bin`.
    pub val_path: PathBuf,
    /// Tokens in `train.bin`.
    pub train_tokens: usize,
    /// Tokens in `val.bin`.
    pub val_tokens: usize,
    /// Bytes of text read from all inputs (after decompression).
    pub input_bytes: u64,
    /// Name of the tokenizer used (`byte`, `gpt2`).
    pub tokenizer: &'static str,
    /// Vocabulary size of the tokenizer (every token is below it).
    pub vocab_size: usize,
}

/// Share of a text corpus held out for validation when the trainer prepares it itself.
pub const DEFAULT_VAL_FRACTION: f64 = 0.1;

/// The built-in corpus: tinyshakespeare (Karpathy's char-rnn corpus, 1,115,394 bytes),
/// compiled into the binary so that `transponder train` works from any directory and after
/// `cargo install`.
pub const TINYSHAKESPEARE: &str = include_str!("../../data/tinyshakespeare.txt");

/// How messages name a corpus: the file's path, or the built-in one when `text` is `None`.
pub fn corpus_name(text: Option<&Path>) -> String {
    text.map_or_else(|| "the built-in tinyshakespeare".into(), |path| path.display().to_string())
}

/// The name of a corpus's token cache folder for `tokenizer`: `tinyshakespeare-<tokenizer>`
/// for the built-in corpus, `<file stem>-<tokenizer>-<FNV-1a of the file's bytes>` for a
/// file, so that another file of the same name (or the same file edited) is tokenized anew.
pub fn corpus_cache_name(text: Option<&Path>, tokenizer: &str) -> Result<String> {
    let Some(path) = text else {
        return Ok(format!("tinyshakespeare-{tokenizer}"));
    };
    let stem = path.file_stem().map_or_else(|| "corpus".into(), |stem| stem.to_string_lossy().into_owned());
    Ok(format!("{stem}-{tokenizer}-{:016x}", crate::fingerprint::file_fnv1a_64(path)?))
}

/// `out_dir/train.bin` and `out_dir/val.bin` for one text corpus (a file, or the built-in
/// tinyshakespeare when `text` is `None`), prepared with [`DEFAULT_VAL_FRACTION`] unless both
/// files already exist. Returns the token files and, when it prepared them just now, the report.
pub fn prepare_once(
    text: Option<&Path>,
    tokenizer: &Tokenizer,
    out_dir: &Path,
) -> Result<(PathBuf, PathBuf, Option<PrepareReport>)> {
    let (train, val) = (out_dir.join(TRAIN_FILE), out_dir.join(VAL_FILE));
    let report = if train.exists() && val.exists() {
        None
    } else if let Some(path) = text {
        Some(prepare(&[path.to_path_buf()], tokenizer, out_dir, DEFAULT_VAL_FRACTION)?)
    } else {
        Some(prepare_builtin(tokenizer, out_dir, DEFAULT_VAL_FRACTION)?)
    };
    Ok((train, val, report))
}

/// [`prepare`] for the built-in tinyshakespeare ([`TINYSHAKESPEARE`]).
pub fn prepare_builtin(tokenizer: &Tokenizer, out_dir: &Path, val_fraction: f64) -> Result<PrepareReport> {
    check_val_fraction(val_fraction)?;
    let builtin = Input { name: corpus_name(None), reader: Box::new(TINYSHAKESPEARE.as_bytes()), gzipped: false };
    let size = TINYSHAKESPEARE.len() as u64;
    tokenize_and_split(vec![builtin], size, tokenizer, out_dir, val_fraction, ValSplit::StreamTail)
}

/// Tokenizes `inputs` with `tokenizer` and writes `out_dir/train.bin` and `out_dir/val.bin`,
/// the last `val_fraction` of the tokens going to validation ([`ValSplit::StreamTail`]).
///
/// Errors on: no input files, a missing, corrupt gzip or non-UTF-8 file, input without any
/// text, `val_fraction` outside `(0, 1)`, or a split that leaves either side with fewer than
/// [`MIN_SPLIT_TOKENS`] tokens. `out_dir` is created when missing (and removed again when
/// the inputs fail).
pub fn prepare(inputs: &[PathBuf], tokenizer: &Tokenizer, out_dir: &Path, val_fraction: f64) -> Result<PrepareReport> {
    prepare_split(inputs, tokenizer, out_dir, val_fraction, ValSplit::StreamTail)
}

/// [`prepare`] with the held-out tokens chosen by `split`.
pub fn prepare_split(
    inputs: &[PathBuf],
    tokenizer: &Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    split: ValSplit,
) -> Result<PrepareReport> {
    ensure!(!inputs.is_empty(), "prepare needs at least one input text file");
    check_val_fraction(val_fraction)?;
    // Every input opens before anything is written.
    let opened: Vec<Input> = inputs.iter().map(|path| open_input(path)).collect::<Result<_>>()?;
    let size = inputs.iter().filter_map(|path| fs::metadata(path).ok()).map(|m| m.len()).sum();
    tokenize_and_split(opened, size, tokenizer, out_dir, val_fraction, split)
}

fn check_val_fraction(val_fraction: f64) -> Result<()> {
    ensure!(
        val_fraction.is_finite() && val_fraction > 0.0 && val_fraction < 1.0,
        "validation fraction must be strictly between 0 and 1, got {val_fraction}"
    );
    Ok(())
}

/// One input text: how messages name it, and its bytes (gzip undone as they are read).
struct Input {
    name: String,
    reader: Box<dyn Read>,
    gzipped: bool,
}

/// Opens the text file at `path`, decompressing as it is read when it starts with the gzip
/// magic. A device (`/dev/zero`, `/dev/urandom`) is refused: it never ends, and the streamed
/// token files would fill the disk. A pipe is read to its end.
fn open_input(path: &Path) -> Result<Input> {
    use std::os::unix::fs::FileTypeExt;
    let context = || format!("reading input text file {}", path.display());
    let kind = fs::metadata(path).with_context(context)?.file_type();
    ensure!(!kind.is_dir(), "{} is a directory, not an input text file", path.display());
    ensure!(
        !kind.is_char_device() && !kind.is_block_device(),
        "{} is a device, not an input text file (a device has no end to tokenize to)",
        path.display()
    );
    let mut file = File::open(path).with_context(context)?;
    let mut magic = Vec::with_capacity(2);
    (&mut file).take(2).read_to_end(&mut magic).with_context(context)?;
    file.rewind().with_context(context)?;
    let gzipped = magic == GZIP_MAGIC;
    let reader: Box<dyn Read> = if gzipped { Box::new(GzDecoder::new(file)) } else { Box::new(file) };
    Ok(Input { name: path.display().to_string(), reader, gzipped })
}

/// Streams every input through the tokenizer into `out_dir`'s two token files (an
/// end-of-text token before each text, when the tokenizer has one), holds out the validation
/// tokens as `split` says, and replaces both files together. Memory stays independent of the
/// inputs' size; `size_hint` (their bytes on disk) sizes the progress bar.
fn tokenize_and_split(
    inputs: Vec<Input>,
    size_hint: u64,
    tokenizer: &Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    split: ValSplit,
) -> Result<PrepareReport> {
    let created = !out_dir.exists();
    let names = inputs.iter().map(|i| i.name.clone()).collect::<Vec<_>>().join(", ");
    let report = write_split(inputs, &names, size_hint, tokenizer, out_dir, val_fraction, split);
    if report.is_err() && created {
        // Best effort: a refused run leaves no directory (the staged files are gone already).
        let _ = fs::remove_dir(out_dir);
    }
    report
}

fn write_split(
    inputs: Vec<Input>,
    names: &str,
    size_hint: u64,
    tokenizer: &Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    split: ValSplit,
) -> Result<PrepareReport> {
    fs::create_dir_all(out_dir).with_context(|| format!("creating output directory {}", out_dir.display()))?;
    let (train_path, val_path) = (out_dir.join(TRAIN_FILE), out_dir.join(VAL_FILE));
    let vocab_size = tokenizer.vocab_size();
    let (mut train, mut val) = (TokenSink::create(&train_path, vocab_size)?, TokenSink::create(&val_path, vocab_size)?);
    let bar = progress_bar(size_hint);
    let mut input_bytes = 0;
    for input in inputs {
        let before = train.len();
        let bytes = encode_stream(input, tokenizer, &mut train, |n| bar.inc(n as u64))?;
        input_bytes += bytes;
        let held_out = ((train.len() - before) as f64 * val_fraction).round() as u64;
        if split == ValSplit::EachFileTail && held_out > 0 {
            if let Some(eot) = tokenizer.eot_token() {
                val.push(&[eot])?;
            }
            train.move_tail_to(held_out, &mut val)?;
        }
    }
    bar.finish_and_clear();
    ensure!(input_bytes > 0, "the input files ({names}) are all empty: nothing to tokenize");
    if split == ValSplit::StreamTail {
        let held_out = (train.len() as f64 * val_fraction).round() as u64;
        train.move_tail_to(held_out, &mut val)?;
    }
    let (train_tokens, val_tokens) = (train.len() as usize, val.len() as usize);
    let total = train_tokens + val_tokens;
    if train_tokens < MIN_SPLIT_TOKENS || val_tokens < MIN_SPLIT_TOKENS {
        bail!(
            "{total} tokens split with validation fraction {val_fraction} leave {train_tokens} \
             for training and {val_tokens} for validation; each needs at least \
             {MIN_SPLIT_TOKENS} (more text or another fraction)"
        );
    }
    // Both files are on disk before either replaces its old one: a stopped prepare leaves the
    // previous pair, never a new train.bin beside an old val.bin.
    commit_all(vec![train.finish()?, val.finish()?])?;
    Ok(PrepareReport {
        train_path,
        val_path,
        train_tokens,
        val_tokens,
        input_bytes,
        tokenizer: tokenizer.name(),
        vocab_size,
    })
}

/// Reads `input` in pieces, checks its UTF-8, and appends its tokens to `sink`, each piece
/// encoded up to a safe cut ([`next_cut`], as [`encode_in_chunks`]), so the tokens equal the
/// whole text's encoding. Returns the text's length in bytes; calls `progress` with each
/// encoded piece's. Text with no safe cut in [`MAX_UNCUT_BYTES`] is an error for GPT-2 (the
/// byte tokenizer cuts anywhere).
fn encode_stream(
    mut input: Input,
    tokenizer: &Tokenizer,
    sink: &mut TokenSink,
    mut progress: impl FnMut(usize),
) -> Result<u64> {
    let name = input.name.clone();
    let read_error = || {
        if input.gzipped {
            format!("decompressing {name} (corrupt or truncated gzip?)")
        } else {
            format!("reading input text file {name}")
        }
    };
    let mut raw = vec![0u8; CHUNK_BYTES];
    let (mut pending, mut text) = (Vec::new(), String::new());
    let mut decoded = 0u64;
    loop {
        let n = input.reader.read(&mut raw).with_context(read_error)?;
        let at_end = n == 0;
        pending.extend_from_slice(&raw[..n]);
        let valid = match std::str::from_utf8(&pending) {
            Ok(all) => all.len(),
            Err(e) if e.error_len().is_none() && !at_end => e.valid_up_to(),
            Err(e) => {
                bail!("{name} is not valid UTF-8 (first bad byte at offset {})", decoded + e.valid_up_to() as u64)
            }
        };
        if decoded == 0 && valid > 0 {
            if let Some(eot) = tokenizer.eot_token() {
                sink.push(&[eot])?;
            }
        }
        text.push_str(std::str::from_utf8(&pending[..valid]).context("a checked UTF-8 prefix")?);
        pending.drain(..valid);
        decoded += valid as u64;
        while text.len() >= CHUNK_BYTES || (at_end && !text.is_empty()) {
            let mut cut = if at_end { text.len() } else { next_cut(&text, CHUNK_BYTES) };
            if cut == text.len() && !at_end {
                if *tokenizer == Tokenizer::Byte {
                    cut = (0..=CHUNK_BYTES).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
                } else if text.len() > MAX_UNCUT_BYTES {
                    bail!(
                        "{name}: {} MB of text without a line break between two words, where it could be \
                         tokenized in pieces",
                        text.len() / 1_000_000
                    );
                } else {
                    break;
                }
            }
            sink.push(&tokenizer.encode(&text[..cut])).with_context(|| format!("tokenizing {name}"))?;
            progress(cut);
            text.drain(..cut);
        }
        if at_end {
            return Ok(decoded);
        }
    }
}

/// Encodes `text` in pieces of about `chunk_bytes`, calling `progress` with each piece's byte
/// length; the result equals `tokenizer.encode(text)`.
///
/// Cuts fall only right after a `'\n'` that sits between two non-whitespace characters: no
/// GPT-2 pre-token crosses such a newline, and the newline is a one-character token whether
/// it ends a chunk or not. Text without such a place is encoded as one piece.
pub fn encode_in_chunks(
    tokenizer: &Tokenizer,
    text: &str,
    chunk_bytes: usize,
    mut progress: impl FnMut(usize),
) -> Vec<u32> {
    let mut tokens = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let end = next_cut(text, start.saturating_add(chunk_bytes.max(1)));
        tokens.extend(tokenizer.encode(&text[start..end]));
        progress(end - start);
        start = end;
    }
    tokens
}

/// The first safe cut at or after byte `from` (see [`encode_in_chunks`]), or the text's end.
fn next_cut(text: &str, from: usize) -> usize {
    let bytes = text.as_bytes();
    let mut i = from.max(2);
    while i < bytes.len() {
        if bytes[i - 1] == b'\n' {
            // `i` follows an ASCII byte, so it and `i - 1` are char boundaries.
            let before = text[..i - 1].chars().next_back();
            let after = text[i..].chars().next();
            let solid = |c: Option<char>| c.is_some_and(|c| !c.is_whitespace());
            if solid(before) && solid(after) {
                return i;
            }
        }
        i += 1;
    }
    text.len()
}

fn progress_bar(total_bytes: u64) -> ProgressBar {
    if total_bytes <= PROGRESS_BAR_MIN_BYTES {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total_bytes);
    if let Ok(style) =
        ProgressStyle::with_template("tokenizing {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})")
    {
        bar.set_style(style);
    }
    bar
}

//! Tokenizers, both offline: byte-level (vocab 256) and GPT-2 BPE (`r50k_base`, vocab 50,257).
//!
//! - `byte`: each UTF-8 byte is a token (`list(text.encode("utf-8"))` in Python). Decoding
//!   reassembles the bytes and replaces invalid UTF-8 with U+FFFD.
//! - `gpt2`: OpenAI's GPT-2 byte-level BPE as `tiktoken.get_encoding("gpt2")`, through
//!   `tiktoken-rs`, whose rank table is compiled into the binary (no download at run time).
//!   Encoding is "ordinary": the text `<|endoftext|>` is encoded as plain characters, never as
//!   the special token 50256, so data cannot inject it; [`Tokenizer::eot_token`] gives the id
//!   for callers that separate documents.
//!
//! The GPT-2 tables are built once per process (about 0.1 s) on the first `from_name("gpt2")`.

use std::sync::OnceLock;

use anyhow::{bail, Context, Result};
use tiktoken_rs::CoreBPE;

/// Vocabulary size of the byte-level tokenizer.
pub const BYTE_VOCAB_SIZE: usize = 256;
/// Vocabulary size of GPT-2's `r50k_base`: 50,000 merges + 256 bytes + `<|endoftext|>`.
pub const GPT2_VOCAB_SIZE: usize = 50_257;
/// GPT-2's `<|endoftext|>` id, the last of its vocabulary.
pub const GPT2_EOT_TOKEN: u32 = (GPT2_VOCAB_SIZE - 1) as u32;
/// The names [`Tokenizer::from_name`] accepts, in the order error messages list them.
pub const TOKENIZER_NAMES: [&str; 2] = ["byte", "gpt2"];

/// UTF-8 of U+FFFD, emitted for token ids outside the vocabulary when decoding.
const REPLACEMENT_UTF8: &[u8] = "\u{FFFD}".as_bytes();

static GPT2_BPE: OnceLock<CoreBPE> = OnceLock::new();

/// A handle on the process-wide GPT-2 BPE tables; only [`Tokenizer::from_name`] makes one,
/// so holding a [`Tokenizer::Gpt2`] proves the tables are built.
#[derive(Clone, Copy)]
pub struct Gpt2Bpe(&'static CoreBPE);

impl std::fmt::Debug for Gpt2Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpt2Bpe(r50k_base)")
    }
}

impl PartialEq for Gpt2Bpe {
    /// There is one table per process: all handles are equal.
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl Eq for Gpt2Bpe {}

/// A text tokenizer. Cheap to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tokenizer {
    /// One token per UTF-8 byte, vocab 256.
    Byte,
    /// GPT-2 BPE (`r50k_base`), vocab 50,257.
    Gpt2(Gpt2Bpe),
}

impl Tokenizer {
    /// The tokenizer called `name`: `"byte"` or `"gpt2"`. Errors list the valid names.
    pub fn from_name(name: &str) -> Result<Tokenizer> {
        match name {
            "byte" => Ok(Tokenizer::Byte),
            "gpt2" => Ok(Tokenizer::Gpt2(Gpt2Bpe(gpt2_tables()?))),
            other => bail!("unknown tokenizer `{other}`; valid names: {}", TOKENIZER_NAMES.join(", ")),
        }
    }

    /// The name [`Tokenizer::from_name`] takes for this tokenizer.
    pub fn name(&self) -> &'static str {
        match self {
            Tokenizer::Byte => TOKENIZER_NAMES[0],
            Tokenizer::Gpt2(_) => TOKENIZER_NAMES[1],
        }
    }

    /// Number of token ids: every id `encode` produces is below it.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => BYTE_VOCAB_SIZE,
            Tokenizer::Gpt2(_) => GPT2_VOCAB_SIZE,
        }
    }

    /// Errors unless this tokenizer's vocabulary is a model's `vocab_size` (ids past it would
    /// decode to U+FFFD, and a prompt's could not be embedded).
    pub fn ensure_vocab(&self, vocab_size: usize) -> Result<()> {
        if self.vocab_size() != vocab_size {
            bail!(
                "--tokenizer {} has {} tokens but the model's vocabulary has {vocab_size}: \
                 use the tokenizer it was trained with (the default)",
                self.name(),
                self.vocab_size()
            );
        }
        Ok(())
    }

    /// The end-of-text id that separates documents, if the tokenizer has one.
    pub fn eot_token(&self) -> Option<u32> {
        match self {
            Tokenizer::Byte => None,
            Tokenizer::Gpt2(_) => Some(GPT2_EOT_TOKEN),
        }
    }

    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Byte => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2(bpe) => bpe.0.encode_ordinary(text),
        }
    }

    /// Text of `tokens`. Lossy: byte sequences that are not valid UTF-8 (e.g. a multi-byte
    /// character cut in half) and ids outside the vocabulary become U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes = match self {
            Tokenizer::Byte => {
                let mut bytes = Vec::with_capacity(tokens.len());
                for &t in tokens {
                    match u8::try_from(t) {
                        Ok(b) => bytes.push(b),
                        Err(_) => bytes.extend_from_slice(REPLACEMENT_UTF8),
                    }
                }
                bytes
            }
            Tokenizer::Gpt2(bpe) => match bpe.0.decode_bytes(tokens) {
                Ok(bytes) => bytes,
                // Rare path: some id is unknown; decode one by one to keep the rest.
                Err(_) => tokens
                    .iter()
                    .flat_map(|&t| bpe.0.decode_bytes(&[t]).unwrap_or_else(|_| REPLACEMENT_UTF8.to_vec()))
                    .collect(),
            },
        };
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The tokenizer name a checkpoint's training config (JSON) was trained with: its
/// `tokenizer` field, or `byte` (the default) when the config does not name one.
pub fn trained_tokenizer(train_config: &str) -> String {
    serde_json::from_str::<serde_json::Value>(train_config)
        .ok()
        .and_then(|v| v.get("tokenizer")?.as_str().map(str::to_string))
        .unwrap_or_else(|| TOKENIZER_NAMES[0].into())
}

/// Builds the GPT-2 tables on first use and shares them afterwards.
fn gpt2_tables() -> Result<&'static CoreBPE> {
    if let Some(bpe) = GPT2_BPE.get() {
        return Ok(bpe);
    }
    let bpe = tiktoken_rs::r50k_base().context("building the GPT-2 (r50k_base) BPE tables")?;
    // A concurrent first call may have won the race; either table is identical.
    Ok(GPT2_BPE.get_or_init(|| bpe))
}

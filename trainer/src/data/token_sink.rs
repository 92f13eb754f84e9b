//! An llm.c token file written as a stream: tokens are appended to a staged temp file
//! ([`crate::atomic::Staged`]) whose header count is filled in at the end, and the last `n`
//! can be moved to another sink (a validation split) by copying them through a fixed
//! buffer, so writing a split costs memory independent of the number of tokens.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::token_file::{
    LLMC_GPT2_MAGIC, LLMC_GPT2_VERSION, LLMC_HEADER_BYTES, LLMC_HEADER_INTS, LLMC_LLAMA3_MAGIC, LLMC_LLAMA3_VERSION,
    U16_VOCAB_LIMIT,
};
use crate::atomic::Staged;

/// Tokens moved between sinks per read.
const MOVE_TOKENS: usize = 1 << 18;

/// A token file being written.
pub struct TokenSink {
    out: BufWriter<File>,
    staged: Staged,
    count: u64,
    vocab_size: usize,
    /// `u32` tokens (the LLaMA-3 kind) rather than `u16`.
    wide: bool,
}

impl TokenSink {
    /// Starts the token file that will replace `path`, for ids below `vocab_size`.
    pub fn create(path: &Path, vocab_size: usize) -> Result<TokenSink> {
        let staged = Staged::begin(path)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(staged.tmp_path())
            .with_context(|| format!("creating {}", staged.tmp_path().display()))?;
        let mut out = BufWriter::new(file);
        out.write_all(&[0u8; LLMC_HEADER_BYTES]).with_context(|| format!("writing {}", path.display()))?;
        Ok(TokenSink { out, staged, count: 0, vocab_size, wide: vocab_size >= U16_VOCAB_LIMIT })
    }

    /// Tokens written so far.
    pub fn len(&self) -> u64 {
        self.count
    }

    /// Whether no token was written yet.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Appends `tokens`; an id outside the vocabulary is an error.
    pub fn push(&mut self, tokens: &[u32]) -> Result<()> {
        for &t in tokens {
            if t as usize >= self.vocab_size {
                bail!("token {t} is outside the vocabulary of {}", self.vocab_size);
            }
            let written = if self.wide {
                self.out.write_all(&t.to_le_bytes())
            } else {
                self.out.write_all(&(t as u16).to_le_bytes())
            };
            written.with_context(|| format!("writing {}", self.staged.tmp_path().display()))?;
        }
        self.count += tokens.len() as u64;
        Ok(())
    }

    /// Moves the last `n` tokens (at most all) to the end of `other`, in order.
    pub fn move_tail_to(&mut self, n: u64, other: &mut TokenSink) -> Result<()> {
        let n = n.min(self.count);
        let width = self.width();
        let keep = self.count - n;
        let context = || format!("moving tokens out of {}", self.staged.tmp_path().display());
        self.out.flush().with_context(context)?;
        let file = self.out.get_mut();
        let mut bytes = vec![0u8; MOVE_TOKENS * width as usize];
        let mut tokens = Vec::with_capacity(MOVE_TOKENS);
        let mut moved = 0;
        while moved < n {
            let take = (n - moved).min(MOVE_TOKENS as u64);
            let chunk = &mut bytes[..(take * width) as usize];
            file.seek(SeekFrom::Start(LLMC_HEADER_BYTES as u64 + (keep + moved) * width)).with_context(context)?;
            file.read_exact(chunk).with_context(context)?;
            tokens.clear();
            tokens.extend(chunk.chunks_exact(width as usize).map(|b| match b {
                [a, b] => u32::from(u16::from_le_bytes([*a, *b])),
                b => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            }));
            other.push(&tokens)?;
            moved += take;
        }
        file.set_len(LLMC_HEADER_BYTES as u64 + keep * width).with_context(context)?;
        file.seek(SeekFrom::End(0)).with_context(context)?;
        self.count = keep;
        Ok(())
    }

    /// Writes the header with the final count and fsyncs the file; the returned [`Staged`]
    /// replaces the destination when committed.
    pub fn finish(mut self) -> Result<Staged> {
        let path = self.staged.tmp_path().to_path_buf();
        let count = i32::try_from(self.count).with_context(|| {
            format!("cannot write {}: {} tokens do not fit llm.c's i32 header count", path.display(), self.count)
        })?;
        let (magic, version) =
            if self.wide { (LLMC_LLAMA3_MAGIC, LLMC_LLAMA3_VERSION) } else { (LLMC_GPT2_MAGIC, LLMC_GPT2_VERSION) };
        let mut header = [0i32; LLMC_HEADER_INTS];
        (header[0], header[1], header[2]) = (magic, version, count);
        let bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        self.out.flush().with_context(|| format!("writing {}", path.display()))?;
        let file = self.out.get_mut();
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.write_all(&bytes))
            .and_then(|()| file.sync_all())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(self.staged)
    }

    fn width(&self) -> u64 {
        if self.wide {
            4
        } else {
            2
        }
    }
}

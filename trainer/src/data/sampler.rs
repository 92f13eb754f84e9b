//! Batches of next-token windows from a [`TokenFile`], and the seeded PRNG that draws them.
//!
//! Legend: `B` batch size, `T` sequence length. A batch is `B` windows of `T + 1` consecutive
//! tokens; row `b` gives `inputs[b*T .. (b+1)*T]` = window[0..T] and
//! `targets[b*T .. (b+1)*T]` = window[1..T+1] (nanoGPT's `get_batch`, llm.c's `DataLoader`).
//!
//! Two samplers:
//! - [`RandomSampler`]: every window starts uniformly at random in `0 ..= len - (T+1)`
//!   (nanoGPT's training sampler), driven by [`SplitMix64`].
//! - [`SequentialSampler`]: windows follow each other with a stride of `T` (each token is a
//!   target exactly once per pass), wrapping to the start when the next window would run past
//!   the end (llm.c's loader; used for evaluation).
//!
//! Both export their whole state as `u64`s, so a resumed run draws bit-for-bit the same batches
//! as an uninterrupted one.
//!
//! Data parallel ([`Shard`]): with `W` ranks, every rank's sampler draws the same global
//! stream, `W·B` windows per micro-batch, and keeps only its own `B` (rank `r` the `r`-th run
//! of `B`). The state therefore does not depend on `W`: after `n` micro-batches of `W·B`
//! windows it equals the state of one process that drew the same windows, so a checkpoint
//! resumes at any world size, and `W` ranks × `B` see the rows one process sees with batch
//! `B` and `W` micro-batches (llm.c's loader gives each rank a disjoint slice the same way).

use anyhow::{ensure, Context, Result};

use super::token_file::TokenFile;

/// SplitMix64 (Steele, Lea, Flood 2014; Vigna's reference `splitmix64.c`): a 64-bit state
/// advanced by the golden-ratio increment, then mixed. Passes BigCrush, is trivially
/// seedable (any `u64` is a good state) and its whole state is one `u64`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

/// 2^64 / φ, the Weyl-sequence increment of SplitMix64.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
/// Mixing multipliers of SplitMix64 (Stafford's "Mix13" variant).
const MIX_MUL_1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX_MUL_2: u64 = 0x94D0_49BB_1331_11EB;
/// `f32` has a 24-bit significand: the top 24 bits of a draw map exactly onto `[0, 1)`.
const F32_MANTISSA_BITS: u32 = 24;

impl SplitMix64 {
    /// A generator seeded with `seed` (any value, zero included).
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// The whole state, for checkpoints; [`SplitMix64::from_state`] restores it exactly.
    pub fn state(&self) -> u64 {
        self.state
    }

    /// A generator continuing exactly where the one that exported `state` stopped.
    pub fn from_state(state: u64) -> SplitMix64 {
        SplitMix64 { state }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(MIX_MUL_1);
        z = (z ^ (z >> 27)).wrapping_mul(MIX_MUL_2);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..n` without modulo bias (Lemire 2019, multiply-shift with
    /// rejection). Returns 0 when `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }

    /// A uniform `f32` in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        let bits = self.next_u64() >> (64 - F32_MANTISSA_BITS);
        bits as f32 / (1u64 << F32_MANTISSA_BITS) as f32
    }
}

/// One batch of `B` rows of `T` input tokens and their `T` next-token targets, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    /// `[B*T]` input token ids.
    pub inputs: Vec<u32>,
    /// `[B*T]` target ids: `targets[i]` is the token after `inputs[i]`.
    pub targets: Vec<u32>,
    /// `B`.
    pub batch_size: usize,
    /// `T`.
    pub seq_len: usize,
}

/// What the training loop needs from a sampler, whichever kind it is.
pub trait BatchSampler {
    /// Draws the next batch.
    fn next_batch(&mut self) -> Result<TokenBatch>;
    /// The sampler's whole state; [`BatchSampler::import_state`] resumes from it exactly.
    fn export_state(&self) -> Vec<u64>;
    /// Restores a state produced by [`BatchSampler::export_state`] of the same kind of
    /// sampler on the same file; errors on a state of the wrong length or out of range.
    fn import_state(&mut self, state: &[u64]) -> Result<()>;
}

/// Which rows of the global stream a rank keeps: run `rank` of `B` rows out of every `world · B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This process's rank, `0 .. world`.
    pub rank: usize,
    /// Number of ranks (1: a single process keeps every row).
    pub world: usize,
}

impl Shard {
    /// The whole stream: one process.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// Whether the `index`-th window drawn for a micro-batch of `batch_size` rows per rank is ours.
    fn keeps(&self, index: usize, batch_size: usize) -> bool {
        index / batch_size == self.rank
    }
}

/// Checks `B, T >= 1` and that `file` holds a window of `T + 1` tokens.
fn check_shape(file: &TokenFile, batch_size: usize, seq_len: usize) -> Result<()> {
    ensure!(
        batch_size >= 1 && seq_len >= 1,
        "batch size and sequence length must be at least 1 (got B = {batch_size}, T = {seq_len})"
    );
    ensure!(
        seq_len < file.len(),
        "token file {} has {} tokens, fewer than the {} (T + 1) one window needs",
        file.path().display(),
        file.len(),
        seq_len + 1
    );
    Ok(())
}

/// Splits a `T + 1` window into its input and target rows.
fn push_window(window: &[u32], batch: &mut TokenBatch) {
    let t = batch.seq_len;
    batch.inputs.extend_from_slice(&window[..t]);
    batch.targets.extend_from_slice(&window[1..=t]);
}

fn empty_batch(batch_size: usize, seq_len: usize) -> TokenBatch {
    TokenBatch {
        inputs: Vec::with_capacity(batch_size * seq_len),
        targets: Vec::with_capacity(batch_size * seq_len),
        batch_size,
        seq_len,
    }
}

/// Draws windows at uniformly random offsets (with replacement), seeded.
#[derive(Debug)]
pub struct RandomSampler {
    file: TokenFile,
    batch_size: usize,
    seq_len: usize,
    rng: SplitMix64,
    shard: Shard,
}

impl RandomSampler {
    /// A sampler of `batch_size` windows of `seq_len + 1` tokens over `file`, seeded with
    /// `seed`. Errors when the file is shorter than `seq_len + 1` tokens.
    pub fn new(file: TokenFile, batch_size: usize, seq_len: usize, seed: u64) -> Result<Self> {
        check_shape(&file, batch_size, seq_len)?;
        Ok(RandomSampler { file, batch_size, seq_len, rng: SplitMix64::new(seed), shard: Shard::WHOLE })
    }

    /// The same sampler keeping only `shard`'s rows of each `world · B` drawn.
    pub fn sharded(self, shard: Shard) -> Self {
        RandomSampler { shard, ..self }
    }

    /// The file windows are drawn from.
    pub fn file(&self) -> &TokenFile {
        &self.file
    }
}

impl BatchSampler for RandomSampler {
    fn next_batch(&mut self) -> Result<TokenBatch> {
        let (b, t) = (self.batch_size, self.seq_len);
        let mut batch = empty_batch(b, t);
        let mut window = vec![0u32; t + 1];
        // Number of valid start offsets: 0 ..= len - (T+1).
        let starts = (self.file.len() - t) as u64;
        // Every rank draws every start (rejection sampling makes the draws per window vary).
        for index in 0..b * self.shard.world {
            let start = self.rng.below(starts) as usize;
            if self.shard.keeps(index, b) {
                self.file.copy_window(start, t + 1, &mut window)?;
                push_window(&window, &mut batch);
            }
        }
        Ok(batch)
    }

    /// `[rng state]`.
    fn export_state(&self) -> Vec<u64> {
        vec![self.rng.state()]
    }

    fn import_state(&mut self, state: &[u64]) -> Result<()> {
        ensure!(state.len() == 1, "random sampler state must be 1 value (the PRNG state), got {}", state.len());
        self.rng = SplitMix64::from_state(state[0]);
        Ok(())
    }
}

/// Walks the file in order with a stride of `T`, wrapping to the start.
#[derive(Debug)]
pub struct SequentialSampler {
    file: TokenFile,
    batch_size: usize,
    seq_len: usize,
    position: usize,
    shard: Shard,
}

impl SequentialSampler {
    /// A sampler of `batch_size` consecutive windows of `seq_len + 1` tokens, starting at the
    /// file's first token. Errors when the file is shorter than `seq_len + 1` tokens.
    pub fn new(file: TokenFile, batch_size: usize, seq_len: usize) -> Result<Self> {
        check_shape(&file, batch_size, seq_len)?;
        Ok(SequentialSampler { file, batch_size, seq_len, position: 0, shard: Shard::WHOLE })
    }

    /// The same sampler keeping only `shard`'s rows of each `world · B` read.
    pub fn sharded(self, shard: Shard) -> Self {
        SequentialSampler { shard, ..self }
    }

    /// The file windows are read from.
    pub fn file(&self) -> &TokenFile {
        &self.file
    }

    /// Where the next window starts.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Goes back to the first token (e.g. before each evaluation pass).
    pub fn reset(&mut self) {
        self.position = 0;
    }

    /// Number of full batches in one pass over the file before it wraps.
    pub fn batches_per_pass(&self) -> usize {
        let windows = (self.file.len() - 1) / self.seq_len;
        windows / self.batch_size
    }
}

impl BatchSampler for SequentialSampler {
    fn next_batch(&mut self) -> Result<TokenBatch> {
        let (b, t) = (self.batch_size, self.seq_len);
        let mut batch = empty_batch(b, t);
        let mut window = vec![0u32; t + 1];
        for index in 0..b * self.shard.world {
            if self.position + t + 1 > self.file.len() {
                self.position = 0;
            }
            if self.shard.keeps(index, b) {
                self.file.copy_window(self.position, t + 1, &mut window).context("sequential sampler")?;
                push_window(&window, &mut batch);
            }
            self.position += t;
        }
        Ok(batch)
    }

    /// `[position]`.
    fn export_state(&self) -> Vec<u64> {
        vec![self.position as u64]
    }

    fn import_state(&mut self, state: &[u64]) -> Result<()> {
        ensure!(state.len() == 1, "sequential sampler state must be 1 value (the position), got {}", state.len());
        let position = usize::try_from(state[0]).ok().filter(|&p| p < self.file.len());
        let Some(position) = position else {
            anyhow::bail!(
                "sequential sampler position {} is past the end of {} ({} tokens)",
                state[0],
                self.file.path().display(),
                self.file.len()
            );
        };
        self.position = position;
        Ok(())
    }
}

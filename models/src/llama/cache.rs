//! [`DecodeCache`]: what a LLaMA model keeps between decoding steps so that each new token
//! costs one position's forward pass instead of the whole prefix's (Hugging Face's
//! `past_key_values`).
//!
//! Per block and per sequence: the attention's rotated keys and values ([`KvCache`]) and,
//! for a `ccl` model in `causal-mean` mode, the context manager's running sum
//! ([`RunningMean`]). Every other part of a block (norms, projections and their gates, the
//! per-token layers, the residual rules, LAuReL-PA's mix of earlier activations) reads only
//! the position it computes, so it needs no state.

use nn::attention::KvCache;
use nn::ccl::RunningMean;

use super::Llama;
use crate::{Error, Result};

/// One block's decoding state for every sequence of a batch.
#[derive(Default)]
pub struct BlockCache {
    /// Keys and values, one entry per sequence.
    pub attention: Vec<KvCache>,
    /// CCL causal-mean running sums, one entry per sequence (unused by other variants).
    pub context_means: Vec<RunningMean>,
}

/// A model's decoding state for a batch of sequences, each at its own position.
pub struct DecodeCache {
    /// One entry per decoder block.
    pub blocks: Vec<BlockCache>,
    batch: usize,
}

impl DecodeCache {
    /// An empty cache for `batch` sequences of `model`.
    pub fn new(model: &Llama, batch: usize) -> DecodeCache {
        let block = || BlockCache {
            attention: (0..batch).map(|_| KvCache::default()).collect(),
            context_means: vec![RunningMean::default(); batch],
        };
        DecodeCache { blocks: (0..model.layers.len()).map(|_| block()).collect(), batch }
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Positions already processed for each sequence.
    pub fn lengths(&self) -> Vec<usize> {
        match self.blocks.first() {
            Some(block) => block.attention.iter().map(KvCache::len).collect(),
            None => vec![0; self.batch],
        }
    }

    /// One batch cache from single-sequence caches of the same model, in order (prompts of
    /// different lengths are each run through the model alone, then decoded together).
    pub fn stack(caches: Vec<DecodeCache>) -> Result<DecodeCache> {
        let depth = caches.first().map_or(0, |c| c.blocks.len());
        if let Some(bad) = caches.iter().find(|c| c.blocks.len() != depth) {
            return Err(Error::Config(format!(
                "cannot stack decode caches of {depth} and {} blocks",
                bad.blocks.len()
            )));
        }
        let mut blocks: Vec<BlockCache> = (0..depth).map(|_| BlockCache::default()).collect();
        let mut batch = 0;
        for cache in caches {
            batch += cache.batch;
            for (into, from) in blocks.iter_mut().zip(cache.blocks) {
                into.attention.extend(from.attention);
                into.context_means.extend(from.context_means);
            }
        }
        Ok(DecodeCache { blocks, batch })
    }
}

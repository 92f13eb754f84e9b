//! Validation loss: the mean loss of a model over the first sequential windows of a token
//! file, checked like training data (format, vocabulary, one window) when it is opened.

use std::path::Path;

use anyhow::{bail, Result};
use autograd::no_grad;
use models::llama::Llama;
use nn::Module;
use tensor::Tokens;

use crate::data::sampler::{BatchSampler, SequentialSampler};
use crate::data::token_file::{check_vocab, DataFormat, TokenFile};

/// Opens the token file at `path` for evaluation in batches of `batch_size` windows of
/// `seq_len + 1` tokens. Errors name the file: an unreadable or corrupt file (read as
/// `format` says), a token id outside `vocab_size`, or fewer than `seq_len + 1` tokens.
pub fn open_eval_data(
    path: &Path,
    format: DataFormat,
    vocab_size: usize,
    batch_size: usize,
    seq_len: usize,
) -> Result<SequentialSampler> {
    let file = TokenFile::open_with(path, format)?;
    check_vocab(&file, vocab_size)?;
    SequentialSampler::new(file, batch_size, seq_len)
}

/// Mean loss of `model` over the first `batches` batches of `data` (fewer when one pass over
/// the file holds fewer, at least one), on the model's device. A NaN or infinite loss is an
/// error: the model's outputs are not finite.
pub fn evaluate(model: &Llama, data: &mut SequentialSampler, batches: usize) -> Result<f32> {
    let loss = mean_loss(model, data, batches)?;
    if !loss.is_finite() {
        bail!(
            "the loss on {} is {loss}: the model's outputs are not finite (a diverged checkpoint?)",
            data.file().path().display()
        );
    }
    Ok(loss)
}

/// [`evaluate`] without the finiteness check (the training loop reports a divergence itself).
pub(super) fn mean_loss(model: &Llama, data: &mut SequentialSampler, batches: usize) -> Result<f32> {
    data.reset();
    let batches = batches.min(data.batches_per_pass()).max(1);
    let device = model.device();
    let mut total = 0.0f64;
    for _ in 0..batches {
        let batch = data.next_batch()?;
        let (inputs, targets) = (Tokens::new(&batch.inputs, device)?, Tokens::labels(&batch.targets, device)?);
        let loss = no_grad(|| model.loss(&inputs, &targets, batch.batch_size, batch.seq_len))?;
        total += f64::from(loss.value().to_host()?.item()?);
    }
    Ok((total / batches as f64) as f32)
}

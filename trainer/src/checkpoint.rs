//! Checkpoints: one safetensors file holding the weights, the optimizer state (prefixed
//! `optimizer.`), and in its metadata the step, the sampler state and both configs as
//! JSON. One file means one atomic rename: a killed write leaves the previous checkpoint.
//! A checkpoint holding a non-finite value is never written ([`NonFiniteValue`]): a diverged
//! run keeps its last good file.
//! Tensors on a GPU (parameters, optimizer state) are downloaded to be written; loaded
//! weights are uploaded to the device their parameter is on.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use nn::optim::Optimizer;
use nn::Module;
use tensor::Tensor;

use crate::config::TrainConfig;
use crate::safetensors_io::{load_metadata, load_tensors, save_tensors, NamedTensor, TensorSlice};

const FORMAT: &str = "transponder-checkpoint-v1";
const OPTIMIZER_PREFIX: &str = "optimizer.";

/// Everything read back from a checkpoint file.
pub struct Checkpoint {
    /// Optimizer steps completed.
    pub step: usize,
    /// The sampler's exported state, so data resumes at the same position.
    pub sampler_state: Vec<u64>,
    /// The training config as JSON.
    pub train_config: String,
    /// The model config as JSON.
    pub model_config: String,
    /// The model's parameters by name.
    pub weights: Vec<NamedTensor>,
    /// The optimizer's state tensors (moments, momentum buffers) by name.
    pub optimizer_state: Vec<(String, Tensor)>,
}

/// What [`save`] writes besides the tensors.
pub struct CheckpointMeta<'a> {
    /// Optimizer steps completed.
    pub step: usize,
    /// The sampler's exported state, so data resumes at the same position.
    pub sampler_state: &'a [u64],
    /// The training config as JSON.
    pub train_config: &'a str,
    /// The model config as JSON.
    pub model_config: &'a str,
}

/// Why [`save`] refused to write: a parameter or optimizer value is NaN or infinite. The
/// file at the path is left as it was.
#[derive(Debug, thiserror::Error)]
#[error("{tensor} holds {value} (element {index}): the checkpoint is not written")]
pub struct NonFiniteValue {
    /// The tensor's name in the file (optimizer state prefixed `optimizer.`).
    pub tensor: String,
    /// The first non-finite value found.
    pub value: f32,
    /// Its row-major index in the tensor.
    pub index: usize,
}

/// Writes model weights, optimizer state and `meta` to `path` atomically. Refuses, with a
/// [`NonFiniteValue`] error and without touching `path`, when any value is NaN or infinite.
pub fn save(path: &Path, model: &dyn Module, optimizer: &dyn Optimizer, meta: &CheckpointMeta) -> Result<()> {
    let mut owned: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for p in model.named_parameters() {
        let value = p.var.value().to_host().with_context(|| format!("downloading '{}'", p.name))?;
        owned.push((p.name, value.shape().to_vec(), value.to_vec()));
    }
    for (name, t) in optimizer.state() {
        let t = t.to_host().with_context(|| format!("downloading optimizer state '{name}'"))?;
        owned.push((format!("{OPTIMIZER_PREFIX}{name}"), t.shape().to_vec(), t.to_vec()));
    }
    for (name, _, data) in &owned {
        if let Some(index) = data.iter().position(|v| !v.is_finite()) {
            return Err(NonFiniteValue { tensor: name.clone(), value: data[index], index }.into());
        }
    }
    let slices: Vec<TensorSlice> = owned.iter().map(|(name, shape, data)| TensorSlice { name, shape, data }).collect();
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), FORMAT.to_string());
    metadata.insert("step".to_string(), meta.step.to_string());
    metadata.insert("sampler_state".to_string(), serde_json::to_string(meta.sampler_state)?);
    metadata.insert("train_config".to_string(), meta.train_config.to_string());
    metadata.insert("model_config".to_string(), meta.model_config.to_string());
    save_tensors(path, &slices, &metadata).with_context(|| format!("saving checkpoint {}", path.display()))
}

/// Which command wrote a checkpoint (both write the same format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointKind {
    /// A language model, from `train`.
    Language,
    /// A ResNet image classifier, from `train-image`.
    Image,
}

impl CheckpointKind {
    /// The kind whose training config (JSON) is `train_config`: an image run's names a
    /// `dataset`, a language run's does not.
    pub fn of(train_config: &str) -> CheckpointKind {
        let config: Option<serde_json::Value> = serde_json::from_str(train_config).ok();
        if config.is_some_and(|c| c.get("dataset").is_some()) {
            CheckpointKind::Image
        } else {
            CheckpointKind::Language
        }
    }

    fn describe(self) -> &'static str {
        match self {
            CheckpointKind::Language => "a language-model checkpoint (train)",
            CheckpointKind::Image => "an image-classification checkpoint (train-image)",
        }
    }
}

/// Errors unless the checkpoint at `path`, saved with the training config `train_config`,
/// is of the `expected` kind, naming both.
pub fn ensure_kind(path: &Path, train_config: &str, expected: CheckpointKind) -> Result<()> {
    let kind = CheckpointKind::of(train_config);
    if kind != expected {
        bail!("{} is {}; this command needs {}", path.display(), kind.describe(), expected.describe());
    }
    Ok(())
}

/// The training config saved in the checkpoint at `path`, read from its header only (what
/// `--resume` starts from).
pub fn load_train_config(path: &Path) -> Result<TrainConfig> {
    let json = load_config_json(path, CheckpointKind::Language)?;
    serde_json::from_str(&json).with_context(|| format!("checkpoint {}: its 'train_config' metadata", path.display()))
}

/// The training config (JSON) saved in the checkpoint at `path`, read from its header only,
/// after checking that the checkpoint is of `kind`.
pub fn load_config_json(path: &Path, kind: CheckpointKind) -> Result<String> {
    let metadata = load_metadata(path).with_context(|| format!("loading checkpoint {}", path.display()))?;
    check_format(path, &metadata)?;
    let json = metadata
        .get("train_config")
        .with_context(|| format!("checkpoint {} has no 'train_config' metadata", path.display()))?;
    ensure_kind(path, json, kind)?;
    Ok(json.clone())
}

fn check_format(path: &Path, metadata: &BTreeMap<String, String>) -> Result<()> {
    match metadata.get("format") {
        Some(format) if format == FORMAT => Ok(()),
        Some(other) => bail!("{} is a '{other}' file, not a {FORMAT} checkpoint", path.display()),
        None => bail!("checkpoint {} has no 'format' metadata: not a {FORMAT} file", path.display()),
    }
}

/// Reads a checkpoint written by [`save`]. Errors name the file and what is wrong: not
/// safetensors, not a transponder checkpoint, a missing or malformed metadata field, or a
/// tensor whose data does not fit its shape.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let (tensors, metadata) = load_tensors(path).with_context(|| format!("loading checkpoint {}", path.display()))?;
    let field = |key: &str| -> Result<&String> {
        metadata.get(key).with_context(|| format!("checkpoint {} has no '{key}' metadata", path.display()))
    };
    check_format(path, &metadata)?;
    let step =
        field("step")?.parse().with_context(|| format!("checkpoint {}: 'step' is not a number", path.display()))?;
    let sampler_state = serde_json::from_str(field("sampler_state")?)
        .with_context(|| format!("checkpoint {}: 'sampler_state' is not a list of integers", path.display()))?;
    let mut weights = Vec::new();
    let mut optimizer_state = Vec::new();
    for t in tensors {
        match t.name.strip_prefix(OPTIMIZER_PREFIX) {
            Some(name) => {
                let tensor = Tensor::from_vec(t.data, &t.shape)
                    .with_context(|| format!("checkpoint {}: optimizer state '{name}'", path.display()))?;
                optimizer_state.push((name.to_string(), tensor));
            }
            None => weights.push(t),
        }
    }
    Ok(Checkpoint {
        step,
        sampler_state,
        train_config: field("train_config")?.clone(),
        model_config: field("model_config")?.clone(),
        weights,
        optimizer_state,
    })
}

/// Errors unless every value of `weights`, read from the checkpoint at `path`, is finite: a
/// model with a NaN or infinite weight (a diverged run, a damaged file) computes nothing
/// meaningful, so no command samples, exports or analyses it.
pub fn ensure_finite_weights(path: &Path, weights: &[NamedTensor]) -> Result<()> {
    for t in weights {
        if let Some(index) = t.data.iter().position(|v| !v.is_finite()) {
            bail!(
                "checkpoint {}: tensor '{}' holds {} (element {index}): its weights are not finite \
                 (a diverged or damaged model)",
                path.display(),
                t.name,
                t.data[index]
            );
        }
    }
    Ok(())
}

/// Copies `weights` into the model's parameters by name, each onto the device its parameter
/// is on; every parameter must be present with the same shape, and every tensor must be a
/// parameter (an extra one means the metadata describes another model, e.g. another variant).
pub fn load_weights(model: &dyn Module, weights: &[NamedTensor]) -> Result<()> {
    let by_name: BTreeMap<&str, &NamedTensor> = weights.iter().map(|t| (t.name.as_str(), t)).collect();
    let parameters = model.named_parameters();
    let names: std::collections::BTreeSet<&str> = parameters.iter().map(|p| p.name.as_str()).collect();
    if let Some(extra) = weights.iter().find(|t| !names.contains(t.name.as_str())) {
        bail!(
            "tensor '{}' of the checkpoint is not part of the model its config describes \
             (metadata of another variant or option?)",
            extra.name
        );
    }
    for p in &parameters {
        let t = by_name.get(p.name.as_str()).with_context(|| format!("checkpoint has no tensor '{}'", p.name))?;
        if t.shape != p.var.shape() {
            bail!("tensor '{}' has shape {:?} in the checkpoint but {:?} in the model", p.name, t.shape, p.var.shape());
        }
        let device = p.var.value_ref().device();
        p.var.set_value(Tensor::from_vec(t.data.clone(), &t.shape)?.to_device(device)?)?;
    }
    Ok(())
}

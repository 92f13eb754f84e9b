//! Property tests of the three readers of untrusted files — token files, checkpoints and
//! config files — fed arbitrary bytes and valid files mutated (bit flips, truncation at every
//! length, counts, offsets and shapes off by one, fields set to odd values): each call returns
//! `Ok` or an `Err` with a message, never panics, and an `Ok` token file never reads past its
//! end. Case counts are in each `ProptestConfig` (and in the issue-19 note).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use models::llama::Llama;
use nn::layers::Linear;
use nn::optim::{Adam, AdamConfig, Optimizer, Sgd};
use nn::Module;
use proptest::prelude::*;
use serde_json::Value;
use tensor::{Rng, Tensor};
use trainer::checkpoint::{self, CheckpointMeta};
use trainer::config::TrainConfig;
use trainer::data::token_file::{write_llmc, write_nanogpt_raw, LLMC_GPT2_MAGIC, LLMC_HEADER_BYTES, LLMC_LLAMA3_MAGIC};
use trainer::data::{DataFormat, TokenFile};
use trainer::train::model_config;

const FORMATS: [DataFormat; 3] = [DataFormat::Auto, DataFormat::Llmc, DataFormat::NanoGpt];

/// A path in a per-process scratch directory; each test uses its own name.
fn scratch_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-robustness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Writes `bytes` as a new file at `path`. Removing the old file first matters: overwriting
/// one in place makes ext4 flush it to disk (`auto_da_alloc`), 25× slower here.
fn put(path: &Path, bytes: &[u8]) {
    let _ = std::fs::remove_file(path);
    std::fs::write(path, bytes).unwrap();
}

/// Fails unless an error has a message (the `Display` of every context level is non-empty).
fn assert_clear<T>(result: &anyhow::Result<T>) {
    if let Err(error) = result {
        assert!(error.chain().all(|cause| !cause.to_string().trim().is_empty()), "an empty error message");
    }
}

// ---------------------------------------------------------------- token files

/// Opens `bytes` as a token file every way; an opened file must be exactly as long as its
/// format says and readable to its last token, and nothing past it.
fn check_token_file(path: &Path, bytes: &[u8]) {
    put(path, bytes);
    for format in FORMATS {
        let opened = TokenFile::open_with(path, format);
        assert_clear(&opened);
        let Ok(file) = opened else { continue };
        let kind = file.format();
        assert_eq!(kind.header_bytes() + file.len() * kind.token_bytes(), bytes.len(), "{kind}");
        let mut all = vec![0u32; file.len()];
        file.copy_window(0, file.len(), &mut all).unwrap();
        assert_eq!(file.get(file.len() - 1), all.last().copied());
        assert_eq!(file.get(file.len()), None);
        assert!(file.copy_window(1, file.len(), &mut all).is_err());
        assert_eq!(file.max_token(), all.iter().copied().max().unwrap());
    }
}

/// The bytes the writers produce for `tokens`: llm.c GPT-2 kind (0), LLaMA-3 kind (1) or
/// nanoGPT raw (2). Built in memory (the writers fsync, too slow for thousands of cases);
/// `writers_and_the_test_serializer_agree` checks they are the same bytes.
fn token_file_bytes(kind: usize, tokens: &[u32]) -> Vec<u8> {
    let (magic, version, width) = match kind {
        0 => (LLMC_GPT2_MAGIC, 1, 2),
        1 => (LLMC_LLAMA3_MAGIC, 7, 4),
        _ => return tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect(),
    };
    let mut bytes = vec![0u8; LLMC_HEADER_BYTES];
    set_header_int(&mut bytes, 0, magic);
    set_header_int(&mut bytes, 1, version);
    set_header_int(&mut bytes, 2, tokens.len() as i32);
    for &t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes()[..width]);
    }
    bytes
}

/// A valid token file of either llm.c kind or nanoGPT raw, as bytes.
fn valid_token_file() -> impl Strategy<Value = Vec<u8>> {
    (0..3usize, prop::collection::vec(0u32..60_000, 1..40)).prop_map(|(kind, tokens)| token_file_bytes(kind, &tokens))
}

#[test]
fn writers_and_the_test_serializer_agree() {
    let path = scratch_file("writer.bin");
    let tokens = [5u32, 59_999, 0, 17];
    write_llmc(&path, &tokens, 60_000).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), token_file_bytes(0, &tokens));
    write_llmc(&path, &tokens, 100_000).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), token_file_bytes(1, &tokens));
    write_nanogpt_raw(&path, &[5, 59_999, 0, 17]).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), token_file_bytes(2, &tokens));
}

/// Sets header slot `slot` (`i32`, little-endian) of an llm.c file to `value`, if it has one.
fn set_header_int(bytes: &mut [u8], slot: usize, value: i32) {
    if let Some(b) = bytes.get_mut(slot * 4..slot * 4 + 4) {
        b.copy_from_slice(&value.to_le_bytes());
    }
}

fn header_int(bytes: &[u8], slot: usize) -> i32 {
    bytes.get(slot * 4..slot * 4 + 4).map_or(0, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn token_files_of_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..1200)) {
        check_token_file(&scratch_file("arbitrary.bin"), &bytes);
    }

    #[test]
    fn token_files_with_an_llmc_header_over_arbitrary_bytes(
        slots in prop::collection::vec(any::<i32>(), 3),
        body in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut bytes = vec![0u8; LLMC_HEADER_BYTES];
        for (slot, &value) in slots.iter().enumerate() {
            set_header_int(&mut bytes, slot, value);
        }
        bytes.extend(body);
        check_token_file(&scratch_file("header.bin"), &bytes);
    }

    #[test]
    fn token_files_with_flipped_bits(bytes in valid_token_file(), flips in prop::collection::vec(any::<prop::sample::Index>(), 1..4), bits in prop::collection::vec(0..8u8, 3)) {
        let mut bytes = bytes;
        for (flip, bit) in flips.iter().zip(bits.iter().cycle()) {
            let at = flip.index(bytes.len());
            bytes[at] ^= 1 << bit;
        }
        check_token_file(&scratch_file("flipped.bin"), &bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn token_files_with_counts_off_by_one(bytes in valid_token_file(), delta in prop::sample::select(vec![-1i32, 1, i32::MIN, i32::MAX])) {
        let mut bytes = bytes;
        let count = header_int(&bytes, 2);
        set_header_int(&mut bytes, 2, count.wrapping_add(delta));
        check_token_file(&scratch_file("count.bin"), &bytes);
        // The body one token or one byte shorter or longer than the header says.
        for cut in [1usize, 2, 4] {
            if bytes.len() > cut {
                check_token_file(&scratch_file("count.bin"), &bytes[..bytes.len() - cut]);
            }
        }
        bytes.extend_from_slice(&[7, 0, 0, 0]);
        check_token_file(&scratch_file("count.bin"), &bytes);
    }
}

#[test]
fn token_files_truncated_at_every_length() {
    let path = scratch_file("source.bin");
    let truncated = scratch_file("truncated.bin");
    let tokens: Vec<u32> = (0..20).map(|i| i * 3001).collect();
    for vocab in [60_000, 100_000] {
        write_llmc(&path, &tokens, vocab).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        for len in 0..=bytes.len() {
            check_token_file(&truncated, &bytes[..len]);
        }
    }
}

// ---------------------------------------------------------------- checkpoints

/// A real checkpoint (two tensors, Adam state after one step, every metadata field) as
/// bytes, made once.
fn valid_checkpoint() -> Vec<u8> {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(write_valid_checkpoint).clone()
}

fn write_valid_checkpoint() -> Vec<u8> {
    let layer = Linear::new(3, 2, true, &mut Rng::new(0));
    for p in layer.named_parameters() {
        let numel = p.var.value().numel();
        p.var.set_grad(Some(Tensor::from_vec(vec![0.5; numel], &p.var.shape()).unwrap()));
    }
    let mut adam = Adam::new(layer.named_parameters(), AdamConfig::default());
    adam.step(0.01).unwrap();
    let train_config = serde_json::to_string(&TrainConfig::default()).unwrap();
    let meta = CheckpointMeta { step: 12, sampler_state: &[42], train_config: &train_config, model_config: "{}" };
    let path = scratch_file("valid.safetensors");
    checkpoint::save(&path, &layer, &adam, &meta).unwrap();
    std::fs::read(&path).unwrap()
}

/// Loads `bytes` as a checkpoint, whole and header only; both must return, never panic.
fn check_checkpoint(bytes: &[u8]) {
    let path = scratch_file(&format!("checkpoint-{:?}.safetensors", std::thread::current().id()));
    put(&path, bytes);
    let loaded = checkpoint::load(&path);
    assert_clear(&loaded);
    if let Ok(saved) = loaded {
        for t in &saved.weights {
            assert_eq!(t.data.len(), t.shape.iter().product::<usize>(), "{}", t.name);
        }
    }
    assert_clear(&checkpoint::load_train_config(&path));
}

/// The checkpoint's JSON header and the tensor bytes after it.
fn split_checkpoint(bytes: &[u8]) -> (serde_json::Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn join_checkpoint(header: &serde_json::Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(header).unwrap();
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    bytes.extend_from_slice(data);
    bytes
}

/// Odd JSON values for metadata and config fields.
fn odd_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop::sample::select(vec![0.0, -1.0, 0.5, 1e30, -1e-30, f64::MAX]).prop_map(Value::from),
        prop::sample::select(vec!["", "-1", "abc", "[1,2]", "{}", "1e999", "18446744073709551616"])
            .prop_map(Value::from),
        Just(serde_json::json!([1, -2, "x"])),
        Just(serde_json::json!({"nested": [null]})),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn checkpoints_of_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..600), header_len in 0u64..700) {
        check_checkpoint(&bytes);
        // Arbitrary bytes behind a plausible header length.
        let mut framed = header_len.to_le_bytes().to_vec();
        framed.extend(bytes);
        check_checkpoint(&framed);
    }

    #[test]
    fn checkpoints_with_flipped_bits(flips in prop::collection::vec((any::<prop::sample::Index>(), 0..8u8), 1..4)) {
        let mut bytes = valid_checkpoint();
        for (at, bit) in flips {
            let at = at.index(bytes.len());
            bytes[at] ^= 1 << bit;
        }
        check_checkpoint(&bytes);
    }

    #[test]
    fn checkpoints_with_offsets_shapes_and_lengths_off_by_one(
        tensor in any::<prop::sample::Index>(),
        which in 0..4usize,
        delta in prop::sample::select(vec![-1i64, 1, i64::MAX]),
    ) {
        let (mut header, data) = split_checkpoint(&valid_checkpoint());
        let names: Vec<String> = header.keys().filter(|k| *k != "__metadata__").cloned().collect();
        let name = &names[tensor.index(names.len())];
        let entry = header[name].as_object_mut().unwrap();
        let bump = |v: &Value| Value::from(v.as_i64().unwrap().saturating_add(delta));
        match which {
            0 => { let o = &mut entry["data_offsets"][0]; *o = bump(o); }
            1 => { let o = &mut entry["data_offsets"][1]; *o = bump(o); }
            // A scalar (Adam's step count) gains a dimension instead.
            2 => match entry["shape"].as_array_mut().unwrap() {
                dims if dims.is_empty() => dims.push(Value::from(2)),
                dims => dims[0] = bump(&dims[0]),
            },
            _ => { entry["dtype"] = Value::from("F16"); }
        }
        check_checkpoint(&join_checkpoint(&header, &data));
        // The header length field off by one, and the data one byte short or long.
        let mut bytes = valid_checkpoint();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        bytes[..8].copy_from_slice(&n.wrapping_add(delta as u64).to_le_bytes());
        check_checkpoint(&bytes);
        let mut short = valid_checkpoint();
        short.pop();
        check_checkpoint(&short);
        let mut long = valid_checkpoint();
        long.push(0);
        check_checkpoint(&long);
    }

    #[test]
    fn checkpoints_with_odd_metadata(field in prop::sample::select(vec!["format", "step", "sampler_state", "train_config", "model_config"]), value in odd_value(), drop in any::<bool>()) {
        let (mut header, data) = split_checkpoint(&valid_checkpoint());
        let metadata = header["__metadata__"].as_object_mut().unwrap();
        if drop {
            metadata.remove(field);
        } else {
            // Metadata values are strings in safetensors; a non-string makes the header invalid.
            metadata.insert(field.to_string(), value.as_str().map_or(value.clone(), Value::from));
        }
        check_checkpoint(&join_checkpoint(&header, &data));
    }
}

/// A real llama-tiny checkpoint (narrowed to width 32, a Transponder, one layer's worth of
/// every tensor kind) as bytes, made once: the base of the crafted-metadata cases.
fn llama_checkpoint() -> Vec<u8> {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES
        .get_or_init(|| {
            let train = TrainConfig { d_model: 32, ..TrainConfig::default() };
            let config = model_config(&train, 256).unwrap();
            let model = Llama::new(&config, 0).unwrap();
            let sgd = Sgd::new(model.named_parameters(), 0.0, 0.0, false);
            let (train_json, model_json) =
                (serde_json::to_string(&train).unwrap(), serde_json::to_string(&config).unwrap());
            let meta =
                CheckpointMeta { step: 1, sampler_state: &[1], train_config: &train_json, model_config: &model_json };
            let path = scratch_file("llama.safetensors");
            checkpoint::save(&path, &model, &sgd, &meta).unwrap();
            std::fs::read(&path).unwrap()
        })
        .clone()
}

/// Size fields of a model config and the variants a crafted one may name.
const SIZE_FIELDS: [&str; 12] = [
    "d_model",
    "ffn_hidden",
    "n_layers",
    "n_heads",
    "vocab_size",
    "seq_len",
    "rank",
    "comt_hidden",
    "laurel_rank",
    "per_token_rank",
    "d_basis",
    "d_ctx",
];
const SOME_VARIANTS: [&str; 8] =
    ["pre-ln", "transponder", "ccl", "comt", "per-token", "token-scale", "laurel-lr", "dyt"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Crafted model metadata (sizes from 0 to 2^64 - 1, another variant) over real tensors:
    /// loading the model is `Ok` or a clear `Err`, never an abort on a huge allocation.
    #[test]
    fn checkpoints_with_crafted_model_metadata(
        sizes in prop::collection::vec((prop::sample::select(SIZE_FIELDS.to_vec()),
            prop::sample::select(vec![0u64, 1, 2, 3, 8, 31, 32, 33, 64, 86, 255, 256, 257, 1 << 20, 1 << 40, u64::MAX])), 0..3),
        variant in prop::option::of(prop::sample::select(SOME_VARIANTS.to_vec())),
    ) {
        let (mut header, data) = split_checkpoint(&llama_checkpoint());
        let metadata = header["__metadata__"].as_object_mut().unwrap();
        let mut config: Value = serde_json::from_str(metadata["model_config"].as_str().unwrap()).unwrap();
        for (field, value) in sizes {
            config[field] = Value::from(value);
        }
        if let Some(variant) = variant {
            config["variant"] = Value::from(variant);
        }
        metadata.insert("model_config".into(), Value::from(config.to_string()));
        let path = scratch_file(&format!("crafted-{:?}.safetensors", std::thread::current().id()));
        put(&path, &join_checkpoint(&header, &data));
        assert_clear(&trainer::generate::load_model(&path));
    }
}

#[test]
fn checkpoints_truncated_at_every_length() {
    let bytes = valid_checkpoint();
    assert!(checkpoint::load(&{
        let path = scratch_file("whole.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        path
    })
    .is_ok());
    for len in 0..bytes.len() {
        check_checkpoint(&bytes[..len]);
    }
}

// ---------------------------------------------------------------- config files

/// Loads `bytes` as a config file and, when it parses, validates it and derives the model
/// config from it, as `train` would before building anything.
fn check_config(bytes: &[u8]) {
    let path = scratch_file(&format!("config-{:?}.json", std::thread::current().id()));
    put(&path, bytes);
    let loaded = TrainConfig::from_file(&path);
    assert_clear(&loaded);
    if let Ok(config) = loaded {
        assert_clear(&config.validate());
        assert_clear(&model_config(&config, 256));
    }
}

fn valid_config() -> serde_json::Map<String, Value> {
    match serde_json::to_value(TrainConfig::default()).unwrap() {
        Value::Object(fields) => fields,
        _ => unreachable!("a config is an object"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn configs_of_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        check_config(&bytes);
    }

    #[test]
    fn configs_with_flipped_bits(flips in prop::collection::vec((any::<prop::sample::Index>(), 0..8u8), 1..4)) {
        let mut bytes = serde_json::to_vec_pretty(&valid_config()).unwrap();
        for (at, bit) in flips {
            let at = at.index(bytes.len());
            bytes[at] ^= 1 << bit;
        }
        check_config(&bytes);
    }

    #[test]
    fn configs_with_odd_fields(edits in prop::collection::vec((any::<prop::sample::Index>(), odd_value()), 1..4), extreme in any::<bool>()) {
        let mut config = valid_config();
        let keys: Vec<String> = config.keys().cloned().collect();
        for (key, value) in edits {
            let key = &keys[key.index(keys.len())];
            // Numbers at the edges of their types, or values of the wrong type.
            let value = match (&config[key], extreme) {
                (Value::Number(_), true) => Value::from(u64::MAX),
                _ => value,
            };
            config.insert(key.clone(), value);
        }
        check_config(&serde_json::to_vec(&config).unwrap());
    }
}

#[test]
fn configs_truncated_at_every_length() {
    let bytes = serde_json::to_vec(&valid_config()).unwrap();
    let mut parsed = 0;
    for len in 0..=bytes.len() {
        check_config(&bytes[..len]);
        parsed += usize::from(serde_json::from_slice::<Value>(&bytes[..len]).is_ok());
    }
    assert_eq!(parsed, 1, "only the whole file is valid JSON");
    // And a config with every key kept is the default.
    let path = scratch_file("whole.json");
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(TrainConfig::from_file(&path).unwrap(), TrainConfig::default());
}

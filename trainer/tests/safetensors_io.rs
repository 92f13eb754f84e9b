//! Checkpoint tensor I/O: f32 round trips with metadata, BF16/F16 widening, clear errors on
//! missing or corrupt files, and atomicity (a failed, stray or killed write never damages the
//! previous checkpoint).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use trainer::safetensors_io::{
    atomic_replace, atomic_write, load_tensors, save_tensors, temp_path_for, NamedTensor, TensorSlice,
};

fn tensor(name: &str, shape: &[usize], seed: f32) -> NamedTensor {
    let n: usize = shape.iter().product();
    NamedTensor {
        name: name.to_string(),
        shape: shape.to_vec(),
        data: (0..n).map(|i| seed + i as f32 * 0.25 - 3.0).collect(),
    }
}

fn save(path: &Path, tensors: &[NamedTensor], meta: &BTreeMap<String, String>) {
    let slices: Vec<TensorSlice<'_>> = tensors.iter().map(NamedTensor::as_slice).collect();
    save_tensors(path, &slices, meta).unwrap();
}

fn meta(step: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("step".to_string(), step.to_string()), ("rng".to_string(), "12345678901234567890".to_string())])
}

fn err_text<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.unwrap_err())
}

#[test]
fn f32_round_trip_keeps_values_shapes_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let mut tensors = vec![
        tensor("model.layers.0.mlp.up_proj.weight", &[4, 3], 1.0),
        tensor("alpha", &[], 1.0),
        tensor("model.embed_tokens.weight", &[5, 2], -7.5),
        tensor("empty", &[0, 3], 0.0),
    ];
    tensors[0].data[0] = f32::MIN_POSITIVE;
    tensors[0].data[1] = -0.0;
    save(&path, &tensors, &meta("42"));
    let (loaded, loaded_meta) = load_tensors(&path).unwrap();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(loaded, tensors);
    assert_eq!(loaded_meta, meta("42"));
    assert!(!temp_path_for(&path).unwrap().exists());
}

#[test]
fn empty_metadata_loads_as_empty_map() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    save(&path, &[tensor("w", &[2], 0.5)], &BTreeMap::new());
    let (loaded, m) = load_tensors(&path).unwrap();
    assert!(m.is_empty());
    assert_eq!(loaded.len(), 1);
}

#[test]
fn bf16_and_f16_tensors_are_widened_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("half.safetensors");
    let values = [1.0f32, -2.5, 0.099975586, 65504.0];
    let bf: Vec<u8> = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
    let hf: Vec<u8> = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let views = vec![
        ("b", TensorView::new(Dtype::BF16, vec![2, 2], &bf).unwrap()),
        ("h", TensorView::new(Dtype::F16, vec![4], &hf).unwrap()),
    ];
    fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let (loaded, _) = load_tensors(&path).unwrap();
    let expect_bf: Vec<f32> = values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    let expect_hf: Vec<f32> = values.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
    assert_eq!(loaded[0].name, "b");
    assert_eq!(loaded[0].shape, vec![2, 2]);
    assert_eq!(loaded[0].data, expect_bf);
    assert_eq!(loaded[1].data, expect_hf);
}

#[test]
fn unsupported_dtype_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("int.safetensors");
    let bytes = 7i64.to_le_bytes();
    let views = vec![("counter", TensorView::new(Dtype::I64, vec![1], &bytes).unwrap())];
    fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let msg = err_text(load_tensors(&path));
    assert!(msg.contains("counter") && msg.contains("I64"), "{msg}");
}

#[test]
fn missing_empty_garbage_and_truncated_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.safetensors");
    let msg = err_text(load_tensors(&missing));
    assert!(msg.contains("nope.safetensors"), "{msg}");

    let empty = dir.path().join("empty.safetensors");
    fs::write(&empty, b"").unwrap();
    assert!(err_text(load_tensors(&empty)).contains("empty"));

    let garbage = dir.path().join("garbage.safetensors");
    fs::write(&garbage, b"this is not a checkpoint at all").unwrap();
    let msg = err_text(load_tensors(&garbage));
    assert!(msg.contains("garbage.safetensors") && msg.contains("not a valid"), "{msg}");

    let good = dir.path().join("good.safetensors");
    save(&good, &[tensor("w", &[64], 1.0)], &meta("1"));
    let bytes = fs::read(&good).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    fs::write(&truncated, &bytes[..bytes.len() - 10]).unwrap();
    let msg = err_text(load_tensors(&truncated));
    assert!(msg.contains("truncated.safetensors"), "{msg}");
}

#[test]
fn invalid_tensors_are_refused_and_leave_the_previous_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    save(&path, &[tensor("w", &[3], 1.0)], &meta("1"));

    let data = [1.0f32, 2.0];
    let bad_shape = [TensorSlice { name: "w", shape: &[3], data: &data }];
    let msg = err_text(save_tensors(&path, &bad_shape, &meta("2")));
    assert!(msg.contains("shape [3]") && msg.contains("ckpt.safetensors"), "{msg}");

    let t = tensor("w", &[2], 0.0);
    let duplicate = [t.as_slice(), t.as_slice()];
    assert!(err_text(save_tensors(&path, &duplicate, &meta("2"))).contains("twice"));

    let (loaded, m) = load_tensors(&path).unwrap();
    assert_eq!(loaded, vec![tensor("w", &[3], 1.0)]);
    assert_eq!(m["step"], "1");
}

#[test]
fn stray_tmp_from_a_killed_writer_is_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    save(&path, &[tensor("w", &[3], 1.0)], &meta("1"));
    let tmp = temp_path_for(&path).unwrap();
    assert_eq!(tmp, dir.path().join(format!("ckpt.safetensors.{}.tmp", std::process::id())));
    fs::write(&tmp, b"half a checkpoint").unwrap();

    let (loaded, _) = load_tensors(&path).unwrap();
    assert_eq!(loaded, vec![tensor("w", &[3], 1.0)]);

    save(&path, &[tensor("w", &[3], 2.0)], &meta("2"));
    let (loaded, m) = load_tensors(&path).unwrap();
    assert_eq!(loaded, vec![tensor("w", &[3], 2.0)]);
    assert_eq!(m["step"], "2");
    assert!(!tmp.exists());
}

#[test]
fn a_writer_that_dies_before_the_rename_leaves_the_previous_file_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    save(&path, &[tensor("w", &[8], 1.0)], &meta("1"));

    let result = std::panic::catch_unwind(|| {
        atomic_replace(&path, |tmp| {
            fs::write(tmp, b"partial bytes of a new checkpoint")?;
            panic!("simulated kill between write and rename");
        })
    });
    assert!(result.is_err());
    let (loaded, m) = load_tensors(&path).unwrap();
    assert_eq!(loaded, vec![tensor("w", &[8], 1.0)]);
    assert_eq!(m["step"], "1");

    let failed = atomic_replace(&path, |tmp| {
        fs::write(tmp, b"partial")?;
        anyhow::bail!("disk full")
    });
    let msg = err_text(failed);
    assert!(msg.contains("disk full") && msg.contains("left unchanged"), "{msg}");
    assert!(!temp_path_for(&path).unwrap().exists());
    assert_eq!(load_tensors(&path).unwrap().0, vec![tensor("w", &[8], 1.0)]);
}

#[test]
fn atomic_write_creates_and_replaces_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    atomic_write(&path, br#"{"d": 128}"#).unwrap();
    assert_eq!(fs::read(&path).unwrap(), br#"{"d": 128}"#);
    atomic_write(&path, br#"{"d": 256}"#).unwrap();
    assert_eq!(fs::read(&path).unwrap(), br#"{"d": 256}"#);
    assert!(!temp_path_for(&path).unwrap().exists());

    let no_dir = dir.path().join("missing-dir").join("config.json");
    let msg = err_text(atomic_write(&no_dir, b"{}"));
    assert!(msg.contains("missing-dir"), "{msg}");
}

//! End-to-end image training on the built-in digits with a narrow ResNet-18: a couple of
//! epochs reach clearly-better-than-chance accuracy, a resumed run repeats the straight
//! run's losses bit for bit (running statistics included), the gradient-flow report names
//! every parameter, and a non-finite loss stops the run keeping the last good checkpoint.

use std::path::{Path, PathBuf};

use trainer::checkpoint;
use trainer::train::{CHECKPOINT_FILE, METRICS_FILE};
use trainer::train_image::{train_image, ImageTrainConfig, GRAD_NORMS_FILE};

/// A fresh directory under the system temp dir for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-image-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A narrow ResNet-18 on the repository's digits.
fn digits_config(out_dir: &Path, modulator: &str, epochs: usize) -> ImageTrainConfig {
    ImageTrainConfig {
        modulator: modulator.into(),
        base_width: 8,
        data_dir: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data")),
        batch_size: 64,
        epochs,
        lr: 0.05,
        out_dir: out_dir.to_path_buf(),
        ..ImageTrainConfig::default()
    }
}

/// `(step, loss bits, val accuracy)` of every row of a metrics file.
fn rows(run_dir: &Path) -> Vec<(u64, u32, Option<f64>)> {
    std::fs::read_to_string(run_dir.join(METRICS_FILE))
        .unwrap()
        .lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let loss = (row["loss"].as_f64().unwrap() as f32).to_bits();
            (row["step"].as_u64().unwrap(), loss, row["val_accuracy"].as_f64())
        })
        .collect()
}

#[test]
fn digits_train_well_above_chance_with_each_modulator() {
    for modulator in ["none", "pixel", "sliding-window"] {
        let dir = scratch(&format!("accuracy-{modulator}"));
        let report = train_image(&digits_config(&dir, modulator, 2), false).unwrap();
        println!(
            "{modulator:>14}: accuracy per epoch {:?}, {:.2}s per epoch, {} parameters ({} in modulators)",
            report.eval_accuracy, report.seconds_per_epoch, report.parameters, report.modulator_parameters
        );
        assert_eq!(report.eval_accuracy.len(), 2);
        // Chance is 10%.
        assert!(report.final_accuracy() > 0.5, "{modulator}: accuracy {}", report.final_accuracy());
        assert!(report.final_loss < report.first_loss, "{modulator}: loss did not fall");
        assert_eq!(report.modulator_parameters > 0, modulator != "none");

        let grad_rows: Vec<serde_json::Value> = std::fs::read_to_string(dir.join(GRAD_NORMS_FILE))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(grad_rows.len(), 2);
        let norms = grad_rows[1]["grad_norms"].as_object().unwrap();
        assert_eq!(norms.len(), report_parameter_tensors(&dir));
        assert!(norms.values().all(|v| v.as_f64().unwrap().is_finite()));
        assert!(norms.contains_key("layer1.0.conv1.weight") && norms.contains_key("fc.weight"));
    }
}

/// Parameter tensors in a run's checkpoint (everything but optimizer state and buffers).
fn report_parameter_tensors(dir: &Path) -> usize {
    let saved = checkpoint::load(&dir.join(CHECKPOINT_FILE)).unwrap();
    saved.weights.iter().filter(|t| !t.name.ends_with("running_mean") && !t.name.ends_with("running_var")).count()
}

#[test]
fn resume_continues_bit_identically_with_running_stats() {
    // A constant rate: a decaying schedule spans `epochs`, which the split run changes.
    let config =
        |dir: &Path, epochs| ImageTrainConfig { schedule: "constant".into(), ..digits_config(dir, "pixel", epochs) };
    let straight_dir = scratch("straight");
    train_image(&config(&straight_dir, 2), false).unwrap();
    let reference = rows(&straight_dir);

    let split_dir = scratch("split");
    train_image(&config(&split_dir, 1), false).unwrap();
    let saved = checkpoint::load(&split_dir.join(CHECKPOINT_FILE)).unwrap();
    assert!(saved.weights.iter().any(|t| t.name == "layer1.0.bn1.running_mean"), "running stats must be saved");
    assert!(saved.weights.iter().any(|t| t.name == "bn1.running_var"));
    let report = train_image(&config(&split_dir, 2), true).unwrap();
    assert_eq!(report.eval_accuracy.len(), 1, "the resumed run trains only the second epoch");
    assert_eq!(rows(&split_dir), reference, "a resumed run must repeat the same losses and accuracies");
}

#[test]
fn non_finite_loss_stops_and_keeps_the_checkpoint() {
    let dir = scratch("nan");
    train_image(&digits_config(&dir, "none", 1), false).unwrap();
    let before = std::fs::read(dir.join(CHECKPOINT_FILE)).unwrap();
    let exploding = ImageTrainConfig { lr: 1e30, schedule: "constant".into(), ..digits_config(&dir, "none", 2) };
    let err = train_image(&exploding, true).unwrap_err().to_string();
    assert!(err.contains("stopping") && err.contains("checkpoint"), "{err}");
    assert_eq!(std::fs::read(dir.join(CHECKPOINT_FILE)).unwrap(), before, "the last good checkpoint must be kept");
}

//! `transponder analyze` on tiny checkpoints trained for a few steps: each analysis writes
//! files of the expected shape with sane values (effective rank within [1, its bound],
//! histogram counts summing to the number of gate values, gates in range), the cost model
//! matches a hand count, the throughput table orders its models, and the CLI wiring works.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use trainer::analyze::{analyze_checkpoint, cost, AnalyzeArgs};
use trainer::config::TrainConfig;
use trainer::data::token_file::write_llmc;
use trainer::train::{train, CHECKPOINT_FILE};

/// Tokens analysed per test (short: the spectra cost O(T²·k·d_out)).
const TOKENS: usize = 24;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-analyze-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const TEXT: &str = "to be or not to be, that is the question. whether tis nobler in the mind to suffer. ";

/// Byte-level token files of a repetitive text.
fn token_files(dir: &Path) -> (PathBuf, PathBuf) {
    let tokens: Vec<u32> = TEXT.repeat(30).bytes().map(u32::from).collect();
    let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
    write_llmc(&train, &tokens, 256).unwrap();
    write_llmc(&val, &tokens[..600], 256).unwrap();
    (train, val)
}

/// Trains llama-tiny `variant` for 3 steps; returns the checkpoint and the val token file.
fn tiny_checkpoint(dir: &Path, variant: &str, change: impl FnOnce(&mut TrainConfig)) -> (PathBuf, PathBuf) {
    let (train_data, val_data) = token_files(dir);
    let mut config = TrainConfig {
        model: "llama-tiny".into(),
        variant: variant.into(),
        train_data: Some(train_data),
        val_data: Some(val_data.clone()),
        batch_size: 2,
        seq_len: TOKENS,
        steps: 3,
        lr: 3e-3,
        warmup: 1,
        eval_every: 0,
        eval_batches: 1,
        save_every: 0,
        log_every: 3,
        out_dir: dir.join("run"),
        ..TrainConfig::default()
    };
    change(&mut config);
    train(&config, false).unwrap();
    (config.out_dir.join(CHECKPOINT_FILE), val_data)
}

fn args(checkpoint: &Path, tokens: &Path, out: &Path) -> AnalyzeArgs {
    AnalyzeArgs {
        checkpoint: Some(checkpoint.to_path_buf()),
        tokens: Some(tokens.to_path_buf()),
        out: out.to_path_buf(),
        tokens_max: TOKENS,
        ..AnalyzeArgs::default()
    }
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn json(dir: &Path, name: &str) -> Value {
    serde_json::from_str(&read(dir, name)).unwrap()
}

fn assert_svg(dir: &Path, name: &str) {
    let svg = read(dir, name);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{name} is not an SVG document");
}

#[test]
fn transponder_modulator_values() {
    let dir = scratch("transponder");
    let (checkpoint, tokens) = tiny_checkpoint(&dir, "transponder", |_| {});
    let out = dir.join("analysis");
    let report = analyze_checkpoint(&args(&checkpoint, &tokens, &out)).unwrap();
    assert!(report.files.len() >= 8, "{:?}", report.files);

    // Figure 2: 7 projections × 4 layers × T tokens, scalar gates in (0, 2).
    let csv = read(&out, "modulator_scalar.csv");
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 7 * 4 * TOKENS);
    for row in &rows {
        let value: f64 = row.rsplit(',').next().unwrap().parse().unwrap();
        assert!(value > 0.0 && value < 2.0, "{row}");
        assert!(row.contains(",scalar,"), "channel × scalar has a scalar gate: {row}");
    }
    let stats = json(&out, "modulator_stats.json");
    assert_eq!(stats.as_object().unwrap().len(), 7);
    assert_eq!(stats["down_proj"].as_array().unwrap().len(), 4);
    assert_svg(&out, "modulator_scalar.svg");

    // Figure 3: down_proj's channel gate, T rows × (2 + 128) columns per layer.
    for layer in 0..4 {
        let csv = read(&out, &format!("modulator_channel_down_proj_layer{layer}_modulator_channel.csv"));
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 1 + TOKENS);
        assert_eq!(lines[0].split(',').count(), 2 + 128);
        let last = lines[TOKENS].rsplit(',').next().unwrap().parse::<f64>().unwrap();
        assert!(last > 0.0 && last < 2.0);
    }
    assert_svg(&out, "modulator_channel_down_proj.svg");
    let summary = json(&out, "summary.json");
    assert_eq!(summary["tokens"], TOKENS);
    assert!(summary["next_token_loss"].as_f64().unwrap().is_finite());
    assert_eq!(summary["cost"]["parameters"], report.summary["cost"]["parameters"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn comt_scalar_gates() {
    let dir = scratch("comt");
    let (checkpoint, tokens) = tiny_checkpoint(&dir, "comt", |_| {});
    let out = dir.join("analysis");
    analyze_checkpoint(&args(&checkpoint, &tokens, &out)).unwrap();
    let csv = read(&out, "modulator_scalar.csv");
    assert_eq!(csv.lines().count() - 1, 7 * 4 * TOKENS);
    // CoMT gates are plain σ: inside (0, 1).
    assert!(csv.lines().skip(1).all(|r| (0.0..1.0).contains(&r.rsplit(',').next().unwrap().parse::<f64>().unwrap())));
    // No channel gate: no Figure 3.
    assert!(!out.join("modulator_channel_down_proj.svg").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ccl_rank_gates_and_top_tokens() {
    let dir = scratch("ccl");
    let (checkpoint, tokens) = tiny_checkpoint(&dir, "ccl", |c| c.ccl_mode = "causal-mean".into());
    let out = dir.join("analysis");
    let text = dir.join("input.txt");
    std::fs::write(&text, TEXT).unwrap();
    let args = AnalyzeArgs { text: Some(text), tokens: None, top_tokens: 3, ..args(&checkpoint, &tokens, &out) };
    analyze_checkpoint(&args).unwrap();
    let (k, hidden, d) = (64usize, 344usize, 128usize);

    // Figure 5: 4 layers × (gate, up, down), T singular values each.
    let ranks = json(&out, "ccl_rank.json");
    let ranks = ranks.as_array().unwrap();
    assert_eq!(ranks.len(), 12);
    for r in ranks {
        let (erank, bound) = (r["effective_rank"].as_f64().unwrap(), r["rank_bound"].as_u64().unwrap() as f64);
        assert!(erank >= 1.0 - 1e-9 && erank <= bound + 1e-9, "{r}");
        assert_eq!(bound as usize, TOKENS.min(k * r["out_features"].as_u64().unwrap() as usize));
        let centred = r["effective_rank_centred"].as_f64().unwrap();
        assert!(centred >= 1.0 - 1e-9 && centred <= bound, "{r}");
    }
    let spectrum = read(&out, "ccl_spectrum.csv");
    assert_eq!(spectrum.lines().count() - 1, 12 * TOKENS);
    for row in spectrum.lines().skip(1) {
        let normalised: f64 = row.rsplit(',').next().unwrap().parse().unwrap();
        assert!((0.0..=1.0 + 1e-12).contains(&normalised), "{row}");
    }

    // Figure 6: counts sum to the number of gate values; shares in [0, 1].
    let gates_per_token = 4 * (3 * k + hidden + hidden + d);
    let gates = json(&out, "ccl_gates.json");
    assert_eq!(gates["all"]["count"], gates_per_token * TOKENS);
    let histogram: Vec<u64> =
        gates["all"]["histogram"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
    assert_eq!(histogram.len(), 20);
    assert_eq!(histogram.iter().sum::<u64>() as usize, gates_per_token * TOKENS);
    let csv = read(&out, "ccl_gate_histogram.csv");
    let total: u64 = csv.lines().skip(1).map(|r| r.rsplit(',').next().unwrap().parse::<u64>().unwrap()).sum();
    assert_eq!(total as usize, gates_per_token * TOKENS);
    for key in ["share_in_0_1_to_0_9", "mean_binary_entropy_bits", "histogram_entropy_normalised", "mean"] {
        let v = gates["all"][key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&v), "{key} = {v}");
    }
    assert_eq!(gates["basis"]["count"], 4 * 3 * k * TOKENS);

    // Table 3: k gates per layer, each with ≤ 3 tokens in descending order.
    let top = json(&out, "ccl_top_tokens.json");
    let top = top.as_array().unwrap();
    assert_eq!(top.len(), 12);
    for layer in top {
        let gates = layer["gates"].as_array().unwrap();
        assert_eq!(gates.len(), k);
        for g in gates {
            let means: Vec<f64> = g["top"].as_array().unwrap().iter().map(|t| t["mean"].as_f64().unwrap()).collect();
            assert!(!means.is_empty() && means.len() <= 3);
            assert!(means.windows(2).all(|w| w[0] >= w[1]));
            assert!(means.iter().all(|m| (0.0..1.0).contains(m)));
        }
    }
    for name in ["ccl_spectrum.svg", "ccl_gate_histogram.svg"] {
        assert_svg(&out, name);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ccl_ablations_bound_the_rank() {
    let dir = scratch("ccl-ablations");
    for (ablation, bound) in [("static", 1), ("no-out-gate", TOKENS.min(8))] {
        let run = dir.join(ablation);
        std::fs::create_dir_all(&run).unwrap();
        let (checkpoint, tokens) = tiny_checkpoint(&run, "ccl", |c| {
            c.ccl_ablation = ablation.into();
            c.d_basis = 8;
        });
        let out = run.join("analysis");
        analyze_checkpoint(&args(&checkpoint, &tokens, &out)).unwrap();
        let ranks = json(&out, "ccl_rank.json");
        for r in ranks.as_array().unwrap() {
            assert_eq!(r["rank_bound"], bound, "{ablation}: {r}");
            let erank = r["effective_rank"].as_f64().unwrap();
            if ablation == "static" {
                // One operator repeated T times: exactly rank one.
                assert!((erank - 1.0).abs() < 1e-3, "{erank}");
            } else {
                assert!(erank >= 1.0 - 1e-9 && erank <= bound as f64 + 1e-9, "{erank}");
            }
        }
        let gates = json(&out, "ccl_gates.json");
        let expected = if ablation == "static" { 0 } else { 4 * 3 * 8 * TOKENS };
        assert_eq!(gates["all"]["count"], expected, "{ablation}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cost_matches_a_hand_count_and_throughput_orders_the_models() {
    let config =
        models::llama::LlamaConfig { vocab_size: 256, ..models::llama::LlamaConfig::preset("llama-tiny").unwrap() };
    let model = models::llama::Llama::new(&config, 0).unwrap();
    let c = cost::model_cost(&model, 64);
    let (d, f, l, v) = (128u64, 344u64, 4u64, 256u64);
    assert_eq!(c.matmul_flops_per_token, 2 * (l * (4 * d * d + 3 * d * f) + v * d));
    assert_eq!(c.attention_flops_per_token, l * 4 * 64 * d);
    assert_eq!(c.embedding_parameters as u64, v * d);

    let args = AnalyzeArgs { batch: 2, seq: 8, repeats: 1, ..AnalyzeArgs::default() };
    let rows = cost::throughput(&args).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["Base-64", "CCL-64", "Base-512"]);
    assert!(rows.iter().all(|r| r.inference_tokens_per_second > 0.0 && r.training_tokens_per_second > 0.0));
    assert!(rows[0].parameters < rows[1].parameters && rows[1].parameters < rows[2].parameters);
    assert!(rows[1].mflops_per_token < rows[2].mflops_per_token);
    assert_eq!((rows[0].d_model, rows[0].ffn_hidden, rows[2].ffn_hidden), (64, 172, 1376));
}

#[test]
fn cli_trains_per_token_variants_and_analyzes() {
    let dir = scratch("cli");
    let (train_data, val_data) = token_files(&dir);
    let exe = env!("CARGO_BIN_EXE_transponder");
    let run = |args: &[&str]| {
        let output = Command::new(exe).args(args).output().unwrap();
        assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let common = |variant: &str, out: &Path| -> Vec<String> {
        let mut a: Vec<String> =
            ["train", "--variant", variant, "--steps", "2", "--batch-size", "2", "--seq-len", "16"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        for (flag, path) in
            [("--train-data", &train_data), ("--val-data", &val_data), ("--out-dir", &out.to_path_buf())]
        {
            a.push(flag.into());
            a.push(path.display().to_string());
        }
        a
    };
    for variant in ["per-token", "token-scale"] {
        let out = dir.join(variant);
        let mut a = common(variant, &out);
        a.push("--lazy-tables".into());
        let stdout = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(stdout.contains("row-sparse (lazy"), "{stdout}");
        assert!(out.join(CHECKPOINT_FILE).exists());
    }
    let out = dir.join("ccl");
    let mut a = common("ccl", &out);
    a.extend(
        ["--d-model", "64", "--d-basis", "16", "--ccl-mode", "causal-mean", "--ccl-ablation", "no-basis-gate"]
            .map(String::from),
    );
    run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let analysis = dir.join("analysis");
    let stdout = run(&[
        "analyze",
        "--checkpoint",
        &out.join(CHECKPOINT_FILE).display().to_string(),
        "--tokens",
        &val_data.display().to_string(),
        "--out",
        &analysis.display().to_string(),
        "--tokens-max",
        "16",
    ]);
    assert!(stdout.contains("effective_rank_mean"), "{stdout}");
    let summary: Value = serde_json::from_str(&read(&analysis, "summary.json")).unwrap();
    assert_eq!(summary["d_model"], 64);
    // A CCL option on another variant is an error that names the options.
    let mut a = common("pre-ln", &dir.join("bad"));
    a.extend(["--d-basis", "32"].map(String::from));
    let bad = Command::new(exe).args(&a).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("d_basis"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_sequence_stops_at_the_context_length_and_the_projection_is_checked() {
    let dir = scratch("context");
    let (checkpoint, tokens) = tiny_checkpoint(&dir, "transponder", |c| c.seq_len = 16);
    let out = dir.join("analysis");
    let long = AnalyzeArgs { tokens_max: 20_000, ..args(&checkpoint, &tokens, &out) };
    let report = analyze_checkpoint(&long).unwrap();
    assert_eq!(report.summary["tokens"], 16, "the analysis must stop at the model's context length");
    let unknown = AnalyzeArgs { projection: "down".into(), ..args(&checkpoint, &tokens, &out) };
    let Err(error) = analyze_checkpoint(&unknown) else { panic!("an unknown --projection was accepted") };
    let msg = format!("{error:#}");
    assert!(msg.contains("'down'") && msg.contains("down_proj") && msg.contains("q_proj"), "{msg}");
}

//! `transponder compare` end to end on tiny settings: a grid's table, CSVs and curves come
//! out with the expected rows and finite numbers, a rerun skips finished runs and resumes
//! interrupted ones, diverged runs are recorded, names are checked, and the table's
//! arithmetic (mean, standard error, Δ%) matches hand-computed values.

use std::path::{Path, PathBuf};

use serde_json::json;
use trainer::compare::grids::{self, Grid, Row, Task};
use trainer::compare::run::{RunResult, RESULT_FILE};
use trainer::compare::stats::{delta_percent, mean, paired, standard_error};
use trainer::compare::table::{paired_markdown, summarize, thousands, wall_time_line};
use trainer::compare::{compare, CompareOptions, RUNS_CSV, TABLE_CSV, TABLE_MD, VAL_CURVES_SVG};
use trainer::config::TrainConfig;
use trainer::data::token_file::write_llmc;
use trainer::train::CHECKPOINT_FILE;
use trainer::train_image::ImageTrainConfig;

/// A fresh directory under the system temp dir for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-compare-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Tiny shared settings: byte-level token files of a repetitive text, 4 steps of 2 × 16.
fn tiny_options(dir: &Path, grid: Option<&str>, variants: &[&str], seeds: usize) -> CompareOptions {
    let text = "to be or not to be, that is the question. ".repeat(40);
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
    write_llmc(&train, &tokens, 256).unwrap();
    write_llmc(&val, &tokens[..400], 256).unwrap();
    let base = TrainConfig {
        model: "llama-tiny".into(),
        train_data: Some(train),
        val_data: Some(val),
        batch_size: 2,
        seq_len: 16,
        steps: 4,
        warmup: 1,
        eval_every: 2,
        eval_batches: 2,
        save_every: 2,
        log_every: 2,
        seed: 7,
        ..TrainConfig::default()
    };
    CompareOptions {
        grid: grid.map(str::to_string),
        variants: variants.iter().map(|v| v.to_string()).collect(),
        rows: Vec::new(),
        seeds,
        base,
        image_base: ImageTrainConfig::default(),
        out_dir: dir.join("out"),
        command: "transponder compare (test)".into(),
    }
}

/// Parses a CSV without quoted fields into rows of fields (header included).
fn csv_rows(path: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| l.split(',').map(str::to_string).collect()).collect()
}

#[test]
fn a_named_grid_runs_end_to_end_and_a_rerun_skips_or_resumes() {
    let dir = scratch("rank");
    let options = CompareOptions { rows: vec!["transponder-r2".into()], ..tiny_options(&dir, Some("rank"), &[], 2) };
    let outcome = compare(&options).unwrap();
    assert_eq!((outcome.started, outcome.resumed, outcome.skipped), (4, 0, 0));
    let labels: Vec<&str> = outcome.summaries.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["pre-ln", "transponder-r2"]);
    for s in &outcome.summaries {
        assert!(s.metric_mean.is_finite() && s.metric_mean > 1.0, "{s:?}");
        assert!(s.metric_se.unwrap().is_finite() && s.throughput_mean > 0.0, "{s:?}");
    }
    assert!(outcome.summaries[0].delta_percent.is_none());
    let transponder = &outcome.summaries[1];
    assert!(transponder.delta_percent.unwrap().is_finite());
    assert!(transponder.parameters > outcome.summaries[0].parameters);

    let grid_dir = options.out_dir.join("rank");
    let markdown = std::fs::read_to_string(grid_dir.join(TABLE_MD)).unwrap();
    assert_eq!(markdown, outcome.markdown);
    for expected in ["| pre-ln |", "| transponder-r2 |", "transponder compare (test)", "Seeds: 7, 8", "rank=2"] {
        assert!(markdown.contains(expected), "{expected} missing from\n{markdown}");
    }
    let table = csv_rows(&grid_dir.join(TABLE_CSV));
    assert_eq!(table.len(), 3, "header + 2 rows");
    let mean_col = table[0].iter().position(|h| h == "val_ppl_mean").unwrap();
    assert!(table[1..].iter().all(|r| r[mean_col].parse::<f64>().unwrap().is_finite()));
    assert_eq!(csv_rows(&grid_dir.join(RUNS_CSV)).len(), 5, "header + 2 rows × 2 seeds");
    let svg = std::fs::read_to_string(grid_dir.join(VAL_CURVES_SVG)).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() >= 2, "{svg}");

    // A rerun reads every result.json and leaves them untouched.
    let result = grid_dir.join("transponder-r2").join("seed8").join(RESULT_FILE);
    let written = std::fs::metadata(&result).unwrap().modified().unwrap();
    let again = compare(&options).unwrap();
    assert_eq!((again.started, again.resumed, again.skipped), (0, 0, 4));
    assert_eq!(std::fs::metadata(&result).unwrap().modified().unwrap(), written);
    for (read, trained) in again.results.iter().zip(&outcome.results) {
        assert_eq!((&read.row, read.seed, read.parameters), (&trained.row, trained.seed, trained.parameters));
        assert!((read.val_ppl.unwrap() - trained.val_ppl.unwrap()).abs() < 1e-9 * trained.val_ppl.unwrap());
    }

    // A run with a checkpoint but no result is resumed (and repeats its result exactly).
    let run_dir = grid_dir.join("pre-ln").join("seed7");
    assert!(run_dir.join(CHECKPOINT_FILE).exists());
    std::fs::remove_file(run_dir.join(RESULT_FILE)).unwrap();
    let resumed = compare(&options).unwrap();
    assert_eq!((resumed.started, resumed.resumed, resumed.skipped), (0, 1, 3));
    assert_eq!(resumed.results[0].val_loss, outcome.results[0].val_loss);
    assert!(resumed.results[0].throughput.unwrap() > 0.0, "a resumed run's throughput comes from its metrics");

    // Changed shared settings are refused instead of mixed into the table.
    let changed = CompareOptions { base: TrainConfig { steps: 5, ..options.base.clone() }, ..options.clone() };
    let err = format!("{:#}", compare(&changed).unwrap_err());
    assert!(err.contains("steps: 4 -> 5"), "{err}");
}

#[test]
fn a_custom_list_records_diverged_runs() {
    let dir = scratch("custom");
    let mut options = tiny_options(&dir, None, &["pre-ln", "layer-scalar"], 1);
    options.base.lr = 1e30;
    options.base.grad_clip = 0.0;
    options.base.schedule = trainer::config::ScheduleKind::Constant;
    let outcome = compare(&options).unwrap();
    assert_eq!(outcome.grid.name, "custom");
    assert!(outcome.results.iter().all(|r| r.diverged_at_step.is_some() && r.val_loss.is_none()));
    assert!(outcome.markdown.contains("| layer-scalar | diverged |"), "{}", outcome.markdown);
    assert!(options.out_dir.join("custom").join(VAL_CURVES_SVG).exists());
}

#[test]
fn the_resnet_grid_reports_accuracy() {
    let dir = scratch("resnet");
    let mut options = tiny_options(&dir, Some("resnet"), &[], 1);
    options.rows = vec!["pixel".into()];
    options.image_base = ImageTrainConfig {
        base_width: 4,
        epochs: 1,
        data_dir: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data")),
        ..ImageTrainConfig::default()
    };
    let outcome = compare(&options).unwrap();
    let labels: Vec<&str> = outcome.summaries.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["none", "pixel"]);
    for s in &outcome.summaries {
        assert!(s.metric_mean > 10.0 && s.metric_mean <= 100.0, "accuracy in percent: {s:?}");
        assert!(s.metric_se.is_none(), "one seed has no standard error");
    }
    assert!(outcome.summaries[1].parameter_increase_percent.unwrap() > 0.0);
    assert!(outcome.markdown.contains("top-1 accuracy") && outcome.markdown.contains("images/s"));
}

#[test]
fn names_are_checked_and_listed() {
    let dir = scratch("names");
    let err = format!("{:#}", compare(&tiny_options(&dir, Some("nope"), &[], 1)).unwrap_err());
    for name in grids::GRID_NAMES {
        assert!(err.contains(name), "{name} missing from: {err}");
    }
    let options = CompareOptions { rows: vec!["transponder-r3".into()], ..tiny_options(&dir, Some("rank"), &[], 1) };
    let err = format!("{:#}", compare(&options).unwrap_err());
    assert!(err.contains("transponder-r3") && err.contains("transponder-r32"), "{err}");
    let err = format!("{:#}", compare(&tiny_options(&dir, None, &["pre-ln", "transpondr"], 1)).unwrap_err());
    assert!(err.contains("transpondr") && err.contains("layer-channel-scalar"), "{err}");
    assert!(!dir.join("out").join("custom").join("transpondr").exists(), "nothing runs before every row validates");
    for name in grids::GRID_NAMES {
        let grid = grids::grid(name).unwrap();
        assert!(grid.baseline < grid.rows.len() && grid.rows.len() >= 3, "{name}");
    }
    assert_eq!(grids::grid("ccl").unwrap().rows[0].label, "base-64");
    assert_eq!(grids::grid("post-ln").unwrap().rows[0].label, "post-ln");
}

#[test]
fn every_named_language_row_is_a_valid_config() {
    use trainer::train::model_config;
    for name in grids::GRID_NAMES {
        let grid = grids::grid(name).unwrap();
        for row in &grid.rows {
            match grid.task {
                Task::Language => {
                    let config = row.apply(&TrainConfig::default()).unwrap();
                    model_config(&config, 256).unwrap_or_else(|e| panic!("{name}/{}: {e:#}", row.label));
                }
                Task::Image => row.apply(&ImageTrainConfig::default()).unwrap().validate().unwrap(),
            }
        }
    }
}

/// A result with only the fields the table reads.
fn result(row: &str, seed: u64, ppl: Option<f64>, parameters: usize, throughput: f64) -> RunResult {
    RunResult {
        row: row.into(),
        seed,
        val_loss: ppl.map(f64::ln),
        val_ppl: ppl,
        accuracy: None,
        parameters,
        throughput: Some(throughput),
        seconds: 1.0,
        steps: 10,
        diverged_at_step: if ppl.is_none() { Some(3) } else { None },
        config: json!({}),
    }
}

#[test]
fn table_arithmetic_matches_hand_computed_values() {
    assert_eq!(mean(&[10.0, 12.0, 14.0]), 12.0);
    // Sample std of {10, 12, 14} is 2, so SE = 2 / √3.
    assert!((standard_error(&[10.0, 12.0, 14.0]).unwrap() - 2.0 / 3f64.sqrt()).abs() < 1e-12);
    assert!((standard_error(&[1.0, 2.0]).unwrap() - 0.5).abs() < 1e-12);
    assert_eq!(standard_error(&[5.0]), None);
    assert!((delta_percent(12.0, 15.0) - -20.0).abs() < 1e-12);
    assert!((delta_percent(16.5, 15.0) - 10.0).abs() < 1e-12);
    assert!(mean(&[]).is_nan());
    assert_eq!(thousands(1_234_567), "1,234,567");
    assert_eq!(thousands(999), "999");

    let row = |label: &str| Row { label: label.into(), overrides: Default::default() };
    let grid = Grid {
        name: "t".into(),
        source: "test".into(),
        task: Task::Language,
        rows: vec![row("base"), row("new"), row("broken")],
        baseline: 0,
        note: String::new(),
    };
    let results = [
        result("base", 1, Some(15.0), 1000, 100.0),
        result("base", 2, Some(15.0), 1000, 300.0),
        result("new", 1, Some(10.0), 1010, 90.0),
        result("new", 2, Some(14.0), 1010, 110.0),
        result("broken", 1, None, 1000, 50.0),
        result("broken", 2, Some(30.0), 1000, 50.0),
    ];
    let s = summarize(&grid, &results);
    assert_eq!((s[0].metric_mean, s[0].metric_se, s[0].delta_percent), (15.0, Some(0.0), None));
    assert_eq!(s[0].throughput_mean, 200.0);
    assert_eq!(s[1].metric_mean, 12.0);
    assert!((s[1].metric_se.unwrap() - 2.0).abs() < 1e-12, "std of {{10, 14}} is 2√2, / √2 = 2");
    assert!((s[1].delta_percent.unwrap() - -20.0).abs() < 1e-12);
    assert!((s[1].parameter_increase_percent.unwrap() - 1.0).abs() < 1e-12);
    assert_eq!((s[2].runs, s[2].diverged, s[2].metric_mean, s[2].metric_se), (2, 1, 30.0, None));
    assert!((s[2].delta_percent.unwrap() - 100.0).abs() < 1e-12);
}

#[test]
fn rows_are_paired_with_the_baseline_by_seed() {
    let p = paired(&[-1.0, -3.0, 1.0]);
    assert_eq!((p.n, p.mean, p.below_zero), (3, -1.0, 2));
    // Sample std of {-1, -3, 1} is 2, so SE = 2 / √3 and the mean is √3 / 2 SE below zero.
    assert!((p.se.unwrap() - 2.0 / 3f64.sqrt()).abs() < 1e-12);
    assert!((p.standard_errors().unwrap() + 3f64.sqrt() / 2.0).abs() < 1e-12);
    assert_eq!(paired(&[2.0]).standard_errors(), None);

    let row = |label: &str| Row { label: label.into(), overrides: Default::default() };
    let grid = Grid {
        name: "t".into(),
        source: "test".into(),
        task: Task::Language,
        rows: vec![row("base"), row("new"), row("alone")],
        baseline: 0,
        note: String::new(),
    };
    let results = [
        result("base", 1, Some(15.0), 1000, 1.0),
        result("base", 2, Some(16.0), 1000, 1.0),
        result("base", 3, None, 1000, 1.0),
        result("new", 1, Some(14.0), 1000, 1.0),
        result("new", 2, Some(13.0), 1000, 1.0),
        result("new", 3, Some(9.0), 1000, 1.0),
        result("alone", 7, Some(9.0), 1000, 1.0),
    ];
    // Seed 3's baseline diverged: two pairs, differences -1 and -3.
    let md = paired_markdown(&grid, &results);
    assert!(md.contains("| new | 2 | -2.000 ± 1.000 | -2.0 | 2 of 2 |"), "{md}");
    assert!(!md.contains("alone"), "a row without a paired seed has no line: {md}");
    assert_eq!(paired_markdown(&grid, &results[..3]), "");
    assert!(wall_time_line(&results).contains("7 runs"));
}

#[test]
fn a_rerun_with_the_out_dir_spelled_otherwise_reuses_the_finished_runs() {
    let dir = scratch("spelling");
    let flags = "compare --variants pre-ln --seeds 1 --steps 2 --batch-size 2 --seq-len 16 --warmup 1 \
                 --eval-every 1 --eval-batches 1 --save-every 1 --out-dir";
    let absolute = dir.join("out").display().to_string();
    for (out, started) in [("out", 1), (absolute.as_str(), 0), ("./out/", 0)] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_transponder"))
            .current_dir(&dir)
            .args(flags.split_whitespace())
            .arg(out)
            .output()
            .unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "--out-dir {out}: {stderr}");
        let expected = format!("1 runs: {started} started, 0 resumed, {} finished earlier", 1 - started);
        assert!(stdout.contains(&expected), "--out-dir {out}: {stdout}");
    }
}

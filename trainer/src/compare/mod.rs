//! `transponder compare`: trains every row of a named grid (a paper's table, see [`grids`])
//! or of a custom list of variants under identical data, seeds, steps and schedule, then
//! writes the paper-style table.
//!
//! Layout under `--out-dir`:
//!
//! ```text
//! data/<text>-<tokenizer>-<hash>/             the corpus ({train,val}.bin), prepared once, shared by every run
//! <grid>/<row>/seed<seed>/                    one training run (checkpoint, config, metrics) + result.json
//! <grid>/table.md, table.csv                  the table (mean ± SE over seeds, Δ%, params, throughput)
//! <grid>/runs.csv                             the raw per-seed values
//! <grid>/val_curves.svg                       validation loss vs step per row, mean over seeds
//! ```
//!
//! Rerunning the same command skips finished runs, resumes interrupted ones from their
//! checkpoint and starts the rest ([`run`]), so a grid can be stopped and continued.

pub mod cli;
pub mod grids;
pub mod plot;
pub mod run;
pub mod stats;
pub mod table;

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

use crate::config::TrainConfig;
use crate::dir_lock::DirLock;
use crate::prepare::{corpus_cache_name, corpus_name, prepare_once};
use crate::tokenizer::Tokenizer;
use crate::train::METRICS_FILE;
use crate::train_image::ImageTrainConfig;
use grids::{Grid, Task};
use run::{PlannedRun, RunConfig, RunResult, RunStatus, RESULT_FILE};
use table::Summary;

/// The table in Markdown, inside the grid's directory.
pub const TABLE_MD: &str = "table.md";
/// The table in CSV.
pub const TABLE_CSV: &str = "table.csv";
/// The per-seed values in CSV.
pub const RUNS_CSV: &str = "runs.csv";
/// The validation curves.
pub const VAL_CURVES_SVG: &str = "val_curves.svg";

/// What to compare and under which shared settings.
#[derive(Clone, Debug)]
pub struct CompareOptions {
    /// A named grid ([`grids::GRID_NAMES`]); unused when `variants` is set.
    pub grid: Option<String>,
    /// A custom list of LLaMA variants, the first the baseline (the grid is then `custom`).
    pub variants: Vec<String>,
    /// Only these rows of the grid (the baseline row is always kept); empty: all rows.
    pub rows: Vec<String>,
    /// Seeds per row: `base.seed`, `base.seed + 1`, ...
    pub seeds: usize,
    /// The shared language-model settings every row overrides a few fields of.
    pub base: TrainConfig,
    /// The shared image settings (the `resnet` grid); its seed is `base.seed`.
    pub image_base: ImageTrainConfig,
    /// The root of every grid's directory.
    pub out_dir: PathBuf,
    /// The command line, quoted in the Markdown.
    pub command: String,
}

/// What a comparison did and produced.
#[derive(Debug)]
pub struct CompareOutcome {
    /// The grid that ran (after `--rows` filtering).
    pub grid: Grid,
    /// `<out_dir>/<grid>`, holding the table files.
    pub dir: PathBuf,
    /// Every run's result, in row then seed order.
    pub results: Vec<RunResult>,
    /// One summary per row, in table order.
    pub summaries: Vec<Summary>,
    /// The contents of `table.md`.
    pub markdown: String,
    /// Runs trained from scratch.
    pub started: usize,
    /// Runs continued from their checkpoint.
    pub resumed: usize,
    /// Finished runs read back from their `result.json`.
    pub skipped: usize,
}

/// The grid the options name (named, custom, then filtered to `rows`).
pub fn resolve_grid(options: &CompareOptions) -> Result<Grid> {
    let grid = match (&options.grid, options.variants.is_empty()) {
        (_, false) => grids::custom(&options.variants)?,
        (Some(name), true) => grids::grid(name)?,
        (None, true) => bail!("name a grid (--grid; valid: {}) or list --variants", grids::GRID_NAMES.join(", ")),
    };
    grids::select_rows(grid, &options.rows)
}

/// `base` with token files set: the given ones, or `text` prepared once into
/// `<out_dir>/data/<text stem>-<tokenizer>-<content hash>/` ([`corpus_cache_name`]), shared by every run of every grid.
fn shared_data(base: &TrainConfig, out_dir: &Path) -> Result<TrainConfig> {
    let mut base = base.clone();
    if base.train_data.is_some() {
        ensure!(base.val_data.is_some(), "compare needs --val-data with --train-data: rows are ranked on it");
        return Ok(base);
    }
    let text = base.text.as_deref();
    let data_dir = out_dir.join("data").join(corpus_cache_name(text, &base.tokenizer)?);
    let tokenizer = Tokenizer::from_name(&base.tokenizer)?;
    let (train, val, _) = prepare_once(text, &tokenizer, &data_dir)
        .with_context(|| format!("preparing {} for the comparison", corpus_name(text)))?;
    (base.train_data, base.val_data) = (Some(train), Some(val));
    Ok(base)
}

/// Every run of the grid: each row at each seed, in its own directory.
fn plan(
    grid: &Grid,
    dir: &Path,
    base: &TrainConfig,
    image_base: &ImageTrainConfig,
    seeds: usize,
) -> Result<Vec<PlannedRun>> {
    let mut runs = Vec::with_capacity(grid.rows.len() * seeds);
    for row in &grid.rows {
        for seed in (0..seeds as u64).map(|k| base.seed + k) {
            let out_dir = dir.join(&row.label).join(format!("seed{seed}"));
            let config = match grid.task {
                // The device is not part of a saved config, so it does not survive `apply`.
                Task::Language => {
                    RunConfig::Language(TrainConfig { seed, out_dir, device: base.device, ..row.apply(base)? })
                }
                Task::Image => RunConfig::Image(ImageTrainConfig {
                    seed,
                    out_dir,
                    device: image_base.device,
                    ..row.apply(image_base)?
                }),
            };
            runs.push(PlannedRun { row: row.label.clone(), seed, config });
        }
    }
    Ok(runs)
}

/// The lines above the table: what was compared, how, and the command that did it; `image`
/// is the baseline row's config of an image grid.
fn preamble(
    grid: &Grid,
    options: &CompareOptions,
    base: &TrainConfig,
    image: &ImageTrainConfig,
    seeds: &[u64],
) -> String {
    let mut lines = vec![format!("# `{}`: {}", grid.name, grid.source), String::new()];
    if !grid.note.is_empty() {
        lines.extend([grid.note.clone(), String::new()]);
    }
    lines.push(format!("- Command: `{}`", options.command));
    match grid.task {
        Task::Language => {
            let data = |p: &Option<PathBuf>| p.as_ref().map_or("—".into(), |p| p.display().to_string());
            lines.push(format!(
                "- Model `{}`; {} steps of batch {} × seq {} (grad accum {}); {} lr {} with {} schedule (warmup {}); \
                 validation every {} steps on {} batches",
                base.model,
                base.steps,
                base.batch_size,
                base.seq_len,
                base.grad_accum,
                base.optimizer,
                base.lr,
                base.schedule,
                base.warmup,
                base.eval_every,
                base.eval_batches
            ));
            lines.push(format!(
                "- Data: {} / {} ({} tokenizer)",
                data(&base.train_data),
                data(&base.val_data),
                base.tokenizer
            ));
        }
        Task::Image => {
            let c = image;
            let subset = match c.train_images {
                0 => "all training images".to_string(),
                n => format!("the first {n} training images"),
            };
            lines.push(format!(
                "- Model `{}` (width {}, {} stem) on `{}`; {} epochs of batch {}; SGD lr {} ({} schedule), momentum {}, \
                 weight decay {}, augmentation {}; {subset}; accuracy on the evaluation split after the last epoch",
                c.model,
                c.base_width,
                c.stem,
                c.dataset,
                c.epochs,
                c.batch_size,
                c.lr,
                c.schedule,
                c.momentum,
                c.weight_decay,
                if c.augmentation().is_some() { "crop + flip" } else { "off" }
            ));
        }
    }
    let seed_list: Vec<String> = seeds.iter().map(u64::to_string).collect();
    lines.push(format!("- Seeds: {} (n = {} per row)", seed_list.join(", "), seeds.len()));
    lines.push(format!(
        "- Mean ± standard error over seeds (SE = sample std / √n; — for n = 1); Δ% and params ↑ against `{}`",
        grid.rows[grid.baseline].label
    ));
    lines.join("\n")
}

/// A one-line account of a run's result.
fn describe(task: Task, result: &RunResult) -> String {
    if let Some(step) = result.diverged_at_step {
        return format!("diverged at step {step}");
    }
    match (task, table::metric(task, result)) {
        (Task::Language, Some(ppl)) => format!("val ppl {ppl:.3}"),
        (Task::Image, Some(accuracy)) => format!("accuracy {accuracy:.2}%"),
        _ => "no validation result".into(),
    }
}

/// Runs (or resumes, or skips) every run of the grid, then writes the table, the CSVs and
/// the curves into `<out_dir>/<grid>/`.
pub fn compare(options: &CompareOptions) -> Result<CompareOutcome> {
    let grid = resolve_grid(options)?;
    ensure!(options.seeds >= 1, "--seeds must be at least 1");
    let _lock = DirLock::acquire(&options.out_dir)?;
    let dir = options.out_dir.join(&grid.name);
    let base = match grid.task {
        Task::Language => shared_data(&options.base, &options.out_dir)?,
        Task::Image => options.base.clone(),
    };
    let image_base = ImageTrainConfig { seed: base.seed, ..options.image_base.clone() };
    let planned = plan(&grid, &dir, &base, &image_base, options.seeds)?;
    for run in &planned {
        run.config.validate().with_context(|| format!("row `{}` of grid `{}`", run.row, grid.name))?;
    }

    let (mut started, mut resumed, mut skipped) = (0, 0, 0);
    let mut results = Vec::with_capacity(planned.len());
    for (i, run) in planned.iter().enumerate() {
        let tag = format!("[{}/{}] {} seed {}", i + 1, planned.len(), run.row, run.seed);
        let out_dir = run.config.out_dir();
        if !out_dir.join(RESULT_FILE).exists() {
            crate::say!("{tag}: training in {}", out_dir.display());
        }
        let (result, status) = run::execute(run)?;
        match status {
            RunStatus::Skipped => skipped += 1,
            RunStatus::Resumed => resumed += 1,
            RunStatus::Started => started += 1,
        }
        let how = if status == RunStatus::Skipped { "finished earlier" } else { "done" };
        crate::say!("{tag}: {how}, {} ({:.1} s)", describe(grid.task, &result), result.seconds);
        results.push(result);
    }

    let summaries = table::summarize(&grid, &results);
    let seeds: Vec<u64> = (0..options.seeds as u64).map(|k| base.seed + k).collect();
    let baseline_image = match grid.task {
        Task::Image => grid.rows[grid.baseline].apply(&image_base)?,
        Task::Language => image_base.clone(),
    };
    let preamble =
        format!("{}\n{}", preamble(&grid, options, &base, &baseline_image, &seeds), table::wall_time_line(&results));
    let markdown = table::markdown(&preamble, grid.task, &summaries) + &table::paired_markdown(&grid, &results);
    let curves: Vec<plot::RowCurves> = grid
        .rows
        .iter()
        .map(|row| {
            let runs: Vec<&PlannedRun> = planned.iter().filter(|p| p.row == row.label).collect();
            let finished: Vec<&PlannedRun> = runs
                .iter()
                .zip(results.iter().filter(|r| r.row == row.label))
                .filter(|(_, r)| r.diverged_at_step.is_none())
                .map(|(p, _)| *p)
                .collect();
            // Diverged seeds are left out of the mean curve unless every seed diverged.
            let shown = if finished.is_empty() { runs } else { finished };
            let files: Vec<PathBuf> = shown.iter().map(|p| p.config.out_dir().join(METRICS_FILE)).collect();
            plot::row_curves(&row.label, &files.iter().map(PathBuf::as_path).collect::<Vec<_>>())
        })
        .collect();
    let title = format!("{}: {}", grid.name, grid.source);
    let svg = plot::val_curves_svg(&title, grid.task, &curves, grid.baseline);

    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, contents) in [
        (TABLE_MD, markdown.clone()),
        (TABLE_CSV, table::table_csv(grid.task, &summaries)),
        (RUNS_CSV, table::runs_csv(&results)),
        (VAL_CURVES_SVG, svg),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(CompareOutcome { grid, dir, results, summaries, markdown, started, resumed, skipped })
}

//! The named comparison grids: which rows a paper's table has, each row a label (also its
//! directory name) and the config fields it sets on the shared base config. Every row of a
//! grid trains on the same data, schedule, steps and seeds; only these fields differ.
//!
//! | grid | paper table | rows (baseline first) |
//! |---|---|---|
//! | `transponder-variants` | Transponder Table 1 | pre-ln, path-scalar, path-channel, layer-scalar, layer-channel, layer-channel-scalar |
//! | `baselines` | Transponder Table 2 | pre-ln, post-ln, deepnorm, mix-ln, ln-scaling, rezero, laurel-rw/lr/pa, sdpa-gate, all-gate, dyt, transponder |
//! | `post-ln` | Transponder Table 3 | post-ln, transponder-post-ln, pre-ln (reference) |
//! | `contextual-ablation` | Transponder Table 4 (+ SPEC §1 φ) | pre-ln, transponder, non-contextual, fixed-alpha, transponder-phi-silu, transponder-phi-relu |
//! | `coverage` | Transponder Table 5 | pre-ln, transponder-{all, attn, mlp, only-first, only-last, only-qk, no-up-gate} |
//! | `rank` | Transponder Table 6 | pre-ln, transponder-r{2, 4, 8, 16, 32} |
//! | `ccl` | CCL Tables 1 and 4 | base-64, ccl-64, ccl-64-static, ccl-64-no-out-gate, ccl-64-no-basis-gate, base-512 |
//! | `resnet` | CoMT Table 1 | none, pixel, sliding-window |
//! | `per-token` | per-token note (`004`) | pre-ln, per-token, token-scale |
//! | `headline` | Transponder's headline claim | pre-ln, transponder, post-ln, sdpa-gate |
//! | `fashion-resnet18` | CoMT Table 1 on Fashion-MNIST | none, pixel, sliding-window (ResNet-18) |
//! | `fashion-resnet50` | CoMT Table 1 on Fashion-MNIST | none, pixel, sliding-window (ResNet-50) |

use anyhow::{bail, ensure, Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// What a grid trains and measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// LLaMA language models (`train`): validation perplexity, lower is better.
    Language,
    /// ResNet image classifiers (`train_image`): top-1 accuracy, higher is better.
    Image,
}

/// One row of a grid: its label and the config fields it overrides.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The table's row name and the run directory's name.
    pub label: String,
    /// Config keys (as in `config.json`) and their values, set on top of the base config.
    pub overrides: Map<String, Value>,
}

/// A comparison: rows trained under identical settings, one of them the Δ% baseline.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    /// The grid's name (`custom` for a `--variants` list); its directory under `--out-dir`.
    pub name: String,
    /// The paper table it reproduces.
    pub source: String,
    /// Language or image runs: what is trained and which metric the table reports.
    pub task: Task,
    /// The rows, in table order.
    pub rows: Vec<Row>,
    /// Index in `rows` of the row Δ% and the parameter increase are measured against.
    pub baseline: usize,
    /// A remark printed under the table's title (deviations from the paper's setup).
    pub note: String,
}

/// The valid grid names, in the order `--list` shows them.
pub const GRID_NAMES: [&str; 12] = [
    "transponder-variants",
    "baselines",
    "post-ln",
    "contextual-ablation",
    "coverage",
    "rank",
    "ccl",
    "resnet",
    "per-token",
    "headline",
    "fashion-resnet18",
    "fashion-resnet50",
];

/// The Table 2 rows after the baseline, in the paper's order followed by SPEC §5's extra baselines.
const BASELINES: [&str; 12] = [
    "post-ln",
    "deepnorm",
    "mix-ln",
    "ln-scaling",
    "rezero",
    "laurel-rw",
    "laurel-lr",
    "laurel-pa",
    "sdpa-gate",
    "all-gate",
    "dyt",
    "transponder",
];

/// Table 5's coverages, in SPEC §1's order.
const COVERAGES: [&str; 7] = ["all", "attn", "mlp", "only-first", "only-last", "only-qk", "no-up-gate"];

/// Table 6's hidden sizes r.
const RANKS: [usize; 5] = [2, 4, 8, 16, 32];

/// A row from a label and a JSON object of overrides.
fn row(label: &str, overrides: Value) -> Row {
    let overrides = match overrides {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    Row { label: label.to_string(), overrides }
}

/// A row that only sets the variant, labelled by it.
fn variant_row(variant: &str) -> Row {
    row(variant, json!({ "variant": variant }))
}

/// A language grid whose baseline is its first row.
fn language(name: &str, source: &str, rows: Vec<Row>, note: &str) -> Grid {
    Grid { name: name.into(), source: source.into(), task: Task::Language, rows, baseline: 0, note: note.into() }
}

/// The named grid; an unknown name is an error listing the valid ones.
pub fn grid(name: &str) -> Result<Grid> {
    let pre_ln = || variant_row("pre-ln");
    let transponder = |label: &str, extra: Value| {
        let mut r = row(label, extra);
        r.overrides.insert("variant".into(), json!("transponder"));
        r
    };
    Ok(match name {
        "transponder-variants" => {
            let names = ["path-scalar", "path-channel", "layer-scalar", "layer-channel", "layer-channel-scalar"];
            let rows = std::iter::once(pre_ln()).chain(names.map(variant_row)).collect();
            language(name, "Transponder Table 1", rows, "")
        }
        "baselines" => {
            let rows = std::iter::once(pre_ln()).chain(BASELINES.map(variant_row)).collect();
            language(name, "Transponder Table 2", rows, "")
        }
        "post-ln" => {
            let rows =
                vec![variant_row("post-ln"), transponder("transponder-post-ln", json!({ "post_ln": true })), pre_ln()];
            language(name, "Transponder Table 3", rows, "Baseline: post-ln (LLaMA w. Post-LN); pre-ln for reference.")
        }
        "contextual-ablation" => {
            let rows = vec![
                pre_ln(),
                variant_row("transponder"),
                variant_row("non-contextual"),
                variant_row("fixed-alpha"),
                transponder("transponder-phi-silu", json!({ "phi": "silu" })),
                transponder("transponder-phi-relu", json!({ "phi": "relu" })),
            ];
            let note = "non-contextual = w/o contextual control, fixed-alpha = w/o learnable sigmoid; the φ rows \
                        are SPEC §1's nonlinearity choices (the paper's default is sigmoid).";
            language(name, "Transponder Table 4", rows, note)
        }
        "coverage" => {
            let covered = COVERAGES.map(|c| transponder(&format!("transponder-{c}"), json!({ "coverage": c })));
            let rows = std::iter::once(pre_ln()).chain(covered).collect();
            language(name, "Transponder Table 5", rows, "")
        }
        "rank" => {
            let ranks = RANKS.map(|r| transponder(&format!("transponder-r{r}"), json!({ "rank": r })));
            let rows = std::iter::once(pre_ln()).chain(ranks).collect();
            language(name, "Transponder Table 6", rows, "")
        }
        "ccl" => ccl_grid(),
        "resnet" => Grid {
            name: name.into(),
            source: "CoMT Table 1".into(),
            task: Task::Image,
            rows: ["none", "pixel", "sliding-window"].map(|m| row(m, json!({ "modulator": m }))).to_vec(),
            baseline: 0,
            note: "Built-in UCI digits instead of CIFAR; train-image's default narrow ResNet-18.".into(),
        },
        "headline" => {
            let rows = ["pre-ln", "transponder", "post-ln", "sdpa-gate"].map(variant_row).to_vec();
            let note = "The papers' headline (Transponder below pre-ln at equal steps) with the two strongest \
                        tiny-scale baselines; meant for a real corpus (--train-data / --val-data), see RESULTS.md.";
            language(name, "Transponder headline (Tables 1-2)", rows, note)
        }
        "fashion-resnet18" => fashion_grid(name, "resnet18"),
        "fashion-resnet50" => fashion_grid(name, "resnet50"),
        "per-token" => {
            let rows = ["pre-ln", "per-token", "token-scale"].map(variant_row).to_vec();
            language(name, "per-token transform note (004)", rows, "")
        }
        _ => bail!("unknown grid `{name}`; valid grids: {}", GRID_NAMES.join(", ")),
    })
}

/// CCL Tables 1 and 4: dense Base-64, CCL-64 and its ablations, and the wide dense Base-512,
/// all at the base preset's depth and heads. Base-512 is ~16× Base-64's FLOPs: measured
/// ~1,200 tokens/s at batch 8 × 128 on two CPU cores at llama-tiny depth, about 3 minutes a
/// run at the defaults (the other rows take seconds), which is still practical.
fn ccl_grid() -> Grid {
    let ccl = |label: &str, ablation: &str| {
        row(label, json!({ "variant": "ccl", "d_model": 64, "d_basis": 64, "ccl_ablation": ablation }))
    };
    let rows = vec![
        row("base-64", json!({ "variant": "pre-ln", "d_model": 64 })),
        ccl("ccl-64", "none"),
        ccl("ccl-64-static", "static"),
        ccl("ccl-64-no-out-gate", "no-out-gate"),
        ccl("ccl-64-no-basis-gate", "no-basis-gate"),
        row("base-512", json!({ "variant": "pre-ln", "d_model": 512 })),
    ];
    let note = "Baseline: base-64 (dense, width 64). Widths are set with d_model on the base preset (its depth \
                and heads; FFN scaled with the width); base-512 is the paper's wide dense baseline.";
    language("ccl", "CCL Tables 1 and 4", rows, note)
}

/// CoMT Table 1's modulators on Fashion-MNIST (`--data-dir` holding its IDX files) for one
/// ResNet depth; the paper's claim is that the gains grow with depth, so the grid comes in
/// a ResNet-18 and a ResNet-50 version with the same rows.
fn fashion_grid(name: &str, model: &str) -> Grid {
    let rows = ["none", "pixel", "sliding-window"]
        .map(|m| row(m, json!({ "model": model, "modulator": m, "dataset": "fashion-mnist" })))
        .to_vec();
    Grid {
        name: name.into(),
        source: "CoMT Table 1 (Fashion-MNIST instead of CIFAR)".into(),
        task: Task::Image,
        rows,
        baseline: 0,
        note: format!("{model} on Fashion-MNIST (28×28 grey, 10 classes), top-1 on the official 10,000 test images."),
    }
}

/// A grid of LLaMA variants by name (`--variants a,b,c`), the first the baseline.
pub fn custom(variants: &[String]) -> Result<Grid> {
    ensure!(!variants.is_empty(), "--variants needs at least one variant name");
    let mut rows: Vec<Row> = Vec::with_capacity(variants.len());
    for name in variants {
        let name = name.trim();
        ensure!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "variant name `{name}` is not a plain name (letters, digits, '-', '_')"
        );
        ensure!(rows.iter().all(|r| r.label != name), "variant `{name}` is listed twice in --variants");
        rows.push(variant_row(name));
    }
    Ok(language("custom", "custom list of variants", rows, ""))
}

/// Keeps only the rows labelled in `labels` (in the grid's order) plus the baseline row; an
/// unknown label is an error listing the grid's rows.
pub fn select_rows(grid: Grid, labels: &[String]) -> Result<Grid> {
    if labels.is_empty() {
        return Ok(grid);
    }
    for label in labels {
        ensure!(
            grid.rows.iter().any(|r| &r.label == label),
            "grid `{}` has no row `{label}`; its rows: {}",
            grid.name,
            grid.rows.iter().map(|r| r.label.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    let baseline_label = grid.rows[grid.baseline].label.clone();
    let rows: Vec<Row> =
        grid.rows.into_iter().filter(|r| r.label == baseline_label || labels.contains(&r.label)).collect();
    let baseline = rows.iter().position(|r| r.label == baseline_label).unwrap_or(0);
    Ok(Grid { rows, baseline, ..grid })
}

impl Row {
    /// `base` with this row's overrides set (through its JSON form, so a key the config does
    /// not have is an error naming it).
    pub fn apply<T: Serialize + DeserializeOwned>(&self, base: &T) -> Result<T> {
        let mut value = serde_json::to_value(base).context("serialising the base config")?;
        let object = value.as_object_mut().context("the base config is not a JSON object")?;
        for (key, v) in &self.overrides {
            object.insert(key.clone(), v.clone());
        }
        serde_json::from_value(value).with_context(|| format!("applying row `{}`'s overrides", self.label))
    }

    /// The overrides as `key=value, ...` (strings unquoted), for the table's notes.
    pub fn describe(&self) -> String {
        let field = |(k, v): (&String, &Value)| match v {
            Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        };
        self.overrides.iter().map(field).collect::<Vec<_>>().join(", ")
    }
}

/// Every grid with its rows, for `--list`.
pub fn listing() -> Result<String> {
    let mut out = String::new();
    for name in GRID_NAMES {
        let g = grid(name)?;
        let rows: Vec<&str> = g.rows.iter().map(|r| r.label.as_str()).collect();
        out.push_str(&format!("{name:<22} {} (baseline {}): {}\n", g.source, rows[g.baseline], rows.join(", ")));
    }
    Ok(out)
}

//! `val_curves.svg`: validation loss against step, one line per row (the mean over its
//! seeds), plus top-1 accuracy against step for image grids; drawn with the analyses'
//! hand-written SVG helpers ([`crate::analyze::svg`]).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::grids::Task;
use crate::analyze::svg::{colour, legend, line_panel, Rect, Series, Svg};

/// One row's curves, averaged over its seeds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowCurves {
    /// The row's label (the legend's name).
    pub label: String,
    /// `(step, mean validation loss)`.
    pub loss: Vec<(f64, f64)>,
    /// `(step, mean top-1 accuracy in percent)` (image runs).
    pub accuracy: Vec<(f64, f64)>,
}

/// `(step, value)` of every row of a metrics file that logged `key`; when a step is logged
/// twice (a resumed run repeats the steps after its last checkpoint) the later row wins.
/// A missing file gives no points and unreadable lines (a write cut off by a kill) are skipped.
pub fn read_curve(metrics: &Path, key: &str) -> Vec<(usize, f64)> {
    let text = std::fs::read_to_string(metrics).unwrap_or_default();
    let mut points = BTreeMap::new();
    for line in text.lines() {
        let Ok(row) = serde_json::from_str::<Value>(line) else { continue };
        if let (Some(step), Some(value)) = (row["step"].as_u64(), row[key].as_f64()) {
            points.insert(step as usize, value);
        }
    }
    points.into_iter().collect()
}

/// The mean over `curves` at every step any of them has (each step averages the curves
/// that have it, so a shorter curve does not hide the others).
pub fn mean_curve(curves: &[Vec<(usize, f64)>]) -> Vec<(f64, f64)> {
    let mut sums: BTreeMap<usize, (f64, usize)> = BTreeMap::new();
    for (step, value) in curves.iter().flatten().filter(|(_, v)| v.is_finite()) {
        let entry = sums.entry(*step).or_default();
        entry.0 += value;
        entry.1 += 1;
    }
    sums.into_iter().map(|(step, (sum, n))| (step as f64, sum / n as f64)).collect()
}

/// A row's mean curves from the metrics files of its runs.
pub fn row_curves(label: &str, metrics_files: &[&Path]) -> RowCurves {
    let read = |key: &str| metrics_files.iter().map(|path| read_curve(path, key)).collect::<Vec<_>>();
    let accuracy = mean_curve(&read("val_accuracy")).into_iter().map(|(s, a)| (s, 100.0 * a)).collect();
    RowCurves { label: label.to_string(), loss: mean_curve(&read("val_loss")), accuracy }
}

/// Which of a row's curves a panel draws.
#[derive(Clone, Copy)]
enum Curve {
    Loss,
    Accuracy,
}

impl RowCurves {
    fn points(&self, curve: Curve) -> &[(f64, f64)] {
        match curve {
            Curve::Loss => &self.loss,
            Curve::Accuracy => &self.accuracy,
        }
    }
}

/// The SVG document: one panel per metric, a legend to the right; the baseline row
/// (`baseline` index) is drawn thicker.
pub fn val_curves_svg(title: &str, task: Task, rows: &[RowCurves], baseline: usize) -> String {
    const PANEL_W: f64 = 640.0;
    const PANEL_H: f64 = 380.0;
    let panels = match task {
        Task::Language => vec![("validation loss", "val loss", Curve::Loss)],
        Task::Image => {
            vec![("evaluation loss", "eval loss", Curve::Loss), ("top-1 accuracy", "accuracy %", Curve::Accuracy)]
        }
    };
    let legend_height = 30.0 + 14.0 * rows.len() as f64;
    let height = (PANEL_H * panels.len() as f64 + 30.0).max(legend_height);
    let mut svg = Svg::new(PANEL_W + 240.0, height);
    svg.text((PANEL_W / 2.0, 18.0), title, 14.0, "middle", 0.0);
    let series_of = |curve: Curve| -> Vec<Series> {
        rows.iter()
            .enumerate()
            .map(|(i, r)| Series {
                label: r.label.clone(),
                points: r.points(curve).to_vec(),
                colour: colour(i).to_string(),
                width: if i == baseline { 2.5 } else { 1.5 },
            })
            .collect()
    };
    for (p, (name, ylabel, curve)) in panels.into_iter().enumerate() {
        let area = Rect { x: 0.0, y: 30.0 + PANEL_H * p as f64, w: PANEL_W, h: PANEL_H };
        let panel_title = format!("{name} (mean over seeds)");
        line_panel(&mut svg, area, &panel_title, ("step", ylabel), &series_of(curve), false, false);
    }
    legend(&mut svg, (PANEL_W + 16.0, 60.0), &series_of(Curve::Loss));
    svg.finish()
}

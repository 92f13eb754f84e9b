//! Modulator values per token (Transponder §5, Figures 2-3; also CoMT and the other gated
//! variants).
//!
//! - Figure 2: the scalar gate of every projection (and path) in every layer, per token.
//!   Where a projection has no scalar gate (`layer-channel`, dense gates) the mean of its
//!   channel gate stands in, marked `channel-mean` in the CSV.
//! - Figure 3: the channel gate of one projection (`--projection`, `down_proj` by default)
//!   over tokens × channels, one heatmap per layer on a shared colour scale.
//!
//! Gates that do not read their input (`non-contextual`) are one row broadcast over tokens.

use std::collections::BTreeMap;
use std::fmt::Write;

use anyhow::Result;
use models::llama::GateTrace;
use serde_json::json;

use super::svg::{colour, colour_bar, heatmap_panel, legend, line_panel, Rect, Series, Svg};
use super::{csv_field, Output, Sequence};

/// Projections in block order, then the path-level gates.
/// The projections (and paths) a gate can sit on, in block order: the valid `--projection`s.
pub const ORDER: [&str; 9] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn", "mlp"];

/// Token curves drawn per Figure 2 panel (evenly spaced over the sequence), besides the mean.
const CURVES: usize = 10;

/// Figure 2's data: `(block order, projection) → layer → (source, value per token)`.
type ScalarSeries = BTreeMap<(usize, String), BTreeMap<usize, (String, Vec<f64>)>>;

/// One gate of one projection in one layer, as `[T][m]`.
struct GateValues {
    layer: usize,
    projection: String,
    gate: String,
    rows: Vec<Vec<f64>>,
}

/// `[T, m]` (or a broadcast `[m]`) as T rows.
fn rows_of(trace: &GateTrace, tokens: usize) -> Vec<Vec<f64>> {
    let values: Vec<f64> = trace.value.to_vec().into_iter().map(f64::from).collect();
    let shape = trace.value.shape();
    if shape.len() == 1 {
        return vec![values; tokens];
    }
    let width = values.len() / tokens.max(1);
    values.chunks(width.max(1)).map(<[f64]>::to_vec).collect()
}

fn parse(trace: &GateTrace, tokens: usize) -> Option<GateValues> {
    let (module, gate) = trace.local_name().rsplit_once('.')?;
    let projection = module.rsplit('.').next()?.to_string();
    Some(GateValues { layer: trace.layer?, projection, gate: gate.to_string(), rows: rows_of(trace, tokens) })
}

fn mean(values: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = values.into_iter().fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    sum / n.max(1) as f64
}

fn std(values: &[f64]) -> f64 {
    let m = mean(values.iter().copied());
    mean(values.iter().map(|v| (v - m).powi(2))).sqrt()
}

fn order_of(projection: &str) -> usize {
    ORDER.iter().position(|p| *p == projection).unwrap_or(ORDER.len())
}

/// Writes Figures 2-3 and their data; returns the JSON summary.
pub fn write(
    out: &mut Output,
    traces: &[&GateTrace],
    sequence: &Sequence,
    n_layers: usize,
    channel_projection: &str,
) -> Result<serde_json::Value> {
    let tokens = sequence.ids.len();
    let gates: Vec<GateValues> = traces.iter().filter_map(|t| parse(t, tokens)).collect();

    // Figure 2: one scalar series per (projection, layer).
    let mut scalar = ScalarSeries::new();
    for g in &gates {
        let is_scalar = g.rows.first().is_some_and(|r| r.len() == 1);
        let entry = scalar.entry((order_of(&g.projection), g.projection.clone())).or_default();
        let better = is_scalar || !entry.contains_key(&g.layer);
        if better {
            let (source, values) = if is_scalar {
                ("scalar", g.rows.iter().map(|r| r[0]).collect())
            } else {
                ("channel-mean", g.rows.iter().map(|r| mean(r.iter().copied())).collect())
            };
            entry.insert(g.layer, (source.to_string(), values));
        }
    }
    let mut csv = String::from("layer,projection,source,token_index,token,value\n");
    let mut stats = serde_json::Map::new();
    let mut token_std = Vec::new();
    for ((_, projection), layers) in &scalar {
        let mut per_layer = Vec::new();
        for (layer, (source, values)) in layers {
            for (t, v) in values.iter().enumerate() {
                let _ = writeln!(csv, "{layer},{projection},{source},{t},{},{v:.6}", csv_field(&sequence.labels[t]));
            }
            let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            token_std.push(std(values));
            per_layer.push(json!({
                "layer": layer, "source": source, "mean": mean(values.iter().copied()),
                "std_over_tokens": std(values), "min": lo, "max": hi,
            }));
        }
        stats.insert(projection.clone(), json!(per_layer));
    }
    out.write("modulator_scalar.csv", csv)?;
    out.json("modulator_stats.json", &serde_json::Value::Object(stats.clone()))?;
    out.write("modulator_scalar.svg", figure_2(&scalar, sequence, n_layers))?;

    // Figure 3: the channel gate of one projection, per layer.
    let channel: Vec<&GateValues> = gates
        .iter()
        .filter(|g| g.projection == channel_projection && g.rows.first().is_some_and(|r| r.len() > 1))
        .collect();
    let mut channel_files = Vec::new();
    for g in &channel {
        let mut csv = String::from("token_index,token");
        for c in 0..g.rows[0].len() {
            let _ = write!(csv, ",c{c}");
        }
        csv.push('\n');
        for (t, row) in g.rows.iter().enumerate() {
            let _ = write!(csv, "{t},{}", csv_field(&sequence.labels[t]));
            for v in row {
                let _ = write!(csv, ",{v:.6}");
            }
            csv.push('\n');
        }
        let name = format!("modulator_channel_{channel_projection}_layer{}_{}.csv", g.layer, g.gate);
        out.write(&name, csv)?;
        channel_files.push(name);
    }
    if !channel.is_empty() {
        out.write(&format!("modulator_channel_{channel_projection}.svg"), figure_3(&channel, channel_projection))?;
    }
    let all_scalars: Vec<f64> = scalar.values().flat_map(|l| l.values().flat_map(|(_, v)| v.iter().copied())).collect();
    Ok(json!({
        "projections": scalar.keys().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
        "stats": stats,
        "channel_projection": channel_projection,
        "channel_files": channel_files,
        "highlights": {
            "scalar_mean": mean(all_scalars.iter().copied()),
            "scalar_min": all_scalars.iter().copied().fold(f64::INFINITY, f64::min),
            "scalar_max": all_scalars.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            "mean_std_over_tokens": mean(token_std.iter().copied()),
        },
    }))
}

/// One panel per projection: value against layer, a curve per sampled token and the mean.
fn figure_2(scalar: &ScalarSeries, sequence: &Sequence, n_layers: usize) -> String {
    let (cols, panel_w, panel_h) = (4usize, 330.0, 250.0);
    // One cell more than the panels, for the legend.
    let rows = (scalar.len() + 1).div_ceil(cols).max(1);
    let mut svg = Svg::new(cols as f64 * panel_w, rows as f64 * panel_h + 30.0);
    svg.text(
        (cols as f64 * panel_w / 2.0, 20.0),
        &format!("Scalar modulator value per token across {n_layers} layers (Transponder Fig. 2)"),
        14.0,
        "middle",
        0.0,
    );
    let tokens = sequence.ids.len();
    let picks: Vec<usize> = (0..CURVES.min(tokens)).map(|i| i * tokens / CURVES.min(tokens)).collect();
    let mut legend_series = Vec::new();
    for (i, ((_, projection), layers)) in scalar.iter().enumerate() {
        let area =
            Rect { x: (i % cols) as f64 * panel_w, y: 30.0 + (i / cols) as f64 * panel_h, w: panel_w, h: panel_h };
        let mut series: Vec<Series> = picks
            .iter()
            .enumerate()
            .map(|(k, &t)| Series {
                label: format!("t{t} {}", sequence.labels[t]),
                points: layers.iter().map(|(&l, (_, v))| (l as f64, v[t])).collect(),
                colour: colour(k).to_string(),
                width: 1.2,
            })
            .collect();
        series.push(Series {
            label: "mean".into(),
            points: layers.iter().map(|(&l, (_, v))| (l as f64, mean(v.iter().copied()))).collect(),
            colour: "#000".into(),
            width: 2.5,
        });
        let source = layers.values().next().map_or("", |(s, _)| s.as_str());
        line_panel(&mut svg, area, &format!("{projection} ({source})"), ("layer", "gate"), &series, false, false);
        if i == 0 {
            legend_series = series;
        }
    }
    let cell = scalar.len();
    let at = ((cell % cols) as f64 * panel_w + 60.0, 30.0 + (cell / cols) as f64 * panel_h + 40.0);
    svg.text((at.0, at.1 - 18.0), "tokens (position, text):", 11.0, "start", 0.0);
    legend(&mut svg, at, &legend_series);
    svg.finish()
}

/// Block-averages `rows` down to at most `max_rows × max_cols` cells (display only).
fn downsample(rows: &[Vec<f64>], max_rows: usize, max_cols: usize) -> Vec<Vec<f64>> {
    let (r, c) = (rows.len(), rows.first().map_or(0, Vec::len));
    let (out_r, out_c) = (r.min(max_rows).max(1), c.min(max_cols).max(1));
    (0..out_r)
        .map(|i| {
            let rs = i * r / out_r..((i + 1) * r / out_r).max(i * r / out_r + 1);
            (0..out_c)
                .map(|j| {
                    let cs = j * c / out_c..((j + 1) * c / out_c).max(j * c / out_c + 1);
                    mean(rs.clone().flat_map(|a| cs.clone().map(move |b| (a, b))).map(|(a, b)| rows[a][b]))
                })
                .collect()
        })
        .collect()
}

/// One heatmap per layer (tokens down, channels across), shared colour scale.
fn figure_3(channel: &[&GateValues], projection: &str) -> String {
    // One pixel per cell up to 512 × 512 per layer; beyond that, block averages.
    let side = 512;
    let cols = channel.len().min(4);
    let (panel_w, panel_h) = (300.0, 280.0);
    let rows = channel.len().div_ceil(cols);
    let mut svg = Svg::new(cols as f64 * panel_w + 70.0, rows as f64 * panel_h + 30.0);
    let all = channel.iter().flat_map(|g| g.rows.iter().flatten().copied());
    let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    svg.text(
        ((cols as f64 * panel_w) / 2.0, 20.0),
        &format!("Channel modulator of {projection}: tokens × channels per layer (Transponder Fig. 3)"),
        14.0,
        "middle",
        0.0,
    );
    for (i, g) in channel.iter().enumerate() {
        let area =
            Rect { x: (i % cols) as f64 * panel_w, y: 30.0 + (i / cols) as f64 * panel_h, w: panel_w, h: panel_h };
        let cells = downsample(&g.rows, side, side);
        let extent = (g.rows[0].len() as f64, g.rows.len() as f64);
        let title = format!("layer {} {}", g.layer, g.gate);
        heatmap_panel(&mut svg, area, &title, ("channel", "token"), &cells, (lo, hi), extent);
    }
    colour_bar(&mut svg, Rect { x: cols as f64 * panel_w + 10.0, y: 60.0, w: 16.0, h: 200.0 }, (lo, hi));
    svg.finish()
}

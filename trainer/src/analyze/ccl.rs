//! CCL analyses (paper `001` §4.4-4.6, SPEC §3): effective rank of the token-specific
//! operators (Figure 5), gate utilisation (Figure 6), top tokens per basis gate (Table 3).
//!
//! Effective rank. For a CCL layer and tokens t = 1..T, `W(t) = W_basis·diag(g_b(t))·
//! W_mix·diag(g_o(t))` (`d_in × d_out`, eq. 5, LayerNorm not folded in, as SPEC writes it).
//! The T operators, vectorised, form `M: [T, d_in·d_out]`; its singular values are the
//! square roots of the eigenvalues of the Gram matrix `G[s, t] = ⟨W(s), W(t)⟩_F` (Jacobi in
//! f64, [`super::linalg`]). `G` is built without forming `W(t)`: with `RᵀR = W_basisᵀW_basis`
//! (R = W_basis itself when d_in ≤ k, else `Λ^½·Vᵀ` from its eigen-decomposition), the
//! `k × d_out` matrices `R·diag(g_b)·W_mix·diag(g_o)` have the same inner products. The
//! effective rank is `exp(H(σ/Σσ))`. It is bounded by T and by the dimension of the space
//! the operators live in: `k·d_out` (both gates), `k` (no output gate), `d_out` (no basis
//! gate), 1 (`static`), and `d_in·d_out`. The mean operator dominates the first singular
//! value, so the effective rank of the centred stack `{W(t) − W̄}` is reported beside it.
//!
//! Gates. Every `g_b` and `g_o` value of every CCL layer over the sequence: a 20-bin
//! histogram on [0, 1] (counts sum to the number of gate values), the mean binary entropy
//! `−g·log₂g − (1−g)·log₂(1−g)` in bits (1 for a gate at ½, 0 for a saturated one), the
//! entropy of the histogram normalised by log(20), and the share strictly inside (0.1, 0.9)
//! (the paper's "active decision range").
//!
//! Top tokens. For each basis gate, the mean of `g_b` per token id over its occurrences in
//! the sequence; the tokens with the highest means, and the gate's selectivity (top mean
//! minus the gate's mean over all positions).

use std::collections::HashMap;
use std::fmt::Write;

use anyhow::{bail, Result};
use models::llama::{GateTrace, Llama};
use nn::ccl::ContextConditionedLinear;
use serde_json::json;

use super::linalg::{effective_rank, gram, numerical_rank, singular_values_from_gram, symmetric_eigen};
use super::svg::{colour, histogram_panel, line_panel, Rect, Series, Svg};
use super::{csv_field, Output, Sequence};

/// Histogram bins on [0, 1].
pub const BINS: usize = 20;

/// One CCL layer's weights and its gates over the sequence: `[T][k]` and `[T][d_out]`
/// (None = fixed at 1). Plain data, so spectra can be computed on several threads.
struct LayerGates {
    layer: usize,
    projection: &'static str,
    /// `basis.weight: [k, d_in]`.
    basis_weight: Vec<f64>,
    /// `mix.weight: [d_out, k]`.
    mix_weight: Vec<f64>,
    k: usize,
    d_in: usize,
    d_out: usize,
    basis: Option<Vec<Vec<f64>>>,
    out: Option<Vec<Vec<f64>>>,
}

impl LayerGates {
    fn new(layer: usize, projection: &'static str, ccl: &ContextConditionedLinear) -> LayerGates {
        let f64s = |v: Vec<f32>| v.into_iter().map(f64::from).collect();
        LayerGates {
            layer,
            projection,
            basis_weight: f64s(ccl.basis.weight.value().to_vec()),
            mix_weight: f64s(ccl.mix.weight.value().to_vec()),
            k: ccl.d_basis(),
            d_in: ccl.in_features(),
            d_out: ccl.out_features(),
            basis: None,
            out: None,
        }
    }
}

/// `Σ aᵢ·bᵢ` with four independent accumulators (so the compiler can vectorise it).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (a4, b4) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = a4.remainder().iter().zip(b4.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a4.zip(b4) {
        for l in 0..4 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// A row-major matrix as rows of f64.
fn rows(values: Vec<f32>, width: usize) -> Vec<Vec<f64>> {
    values.chunks(width.max(1)).map(|r| r.iter().map(|&v| v as f64).collect()).collect()
}

/// The singular spectrum of `{W(t)}` over the sequence, and its rank bound.
pub struct Spectrum {
    /// The singular values of the stacked operators `M: [T, d_in·d_out]`, largest first.
    pub singular_values: Vec<f64>,
    /// The spectrum of `{W(t) − mean_s W(s)}`: how the operators vary around their mean.
    pub centred_singular_values: Vec<f64>,
    /// The largest rank the stack can have: `min(T, dim of the operators' space, d_in·d_out)`.
    pub rank_bound: usize,
}

/// `H·G·H` with `H = I − 11ᵀ/n`: the Gram matrix of the rows minus their mean.
fn centre_gram(g: &[f64], n: usize) -> Vec<f64> {
    let row_mean: Vec<f64> = g.chunks(n.max(1)).map(|r| r.iter().sum::<f64>() / n as f64).collect();
    let grand = row_mean.iter().sum::<f64>() / n.max(1) as f64;
    (0..n * n).map(|ij| g[ij] - row_mean[ij / n] - row_mean[ij % n] + grand).collect()
}

/// Spectrum of the operators of one layer (see the module doc for the construction).
fn spectrum(g: &LayerGates, tokens: usize) -> Spectrum {
    let (k, d_in, d_out) = (g.k, g.d_in, g.d_out);
    let basis = &g.basis_weight;
    // r: [rdim][k] with rᵀr = W_basisᵀ·W_basis.
    let r: Vec<Vec<f64>> = if d_in <= k {
        (0..d_in).map(|a| (0..k).map(|i| basis[i * d_in + a]).collect()).collect()
    } else {
        let p: Vec<f64> = (0..k * k)
            .map(|ij| dot(&basis[(ij / k) * d_in..(ij / k + 1) * d_in], &basis[(ij % k) * d_in..(ij % k + 1) * d_in]))
            .collect();
        let e = symmetric_eigen(&p, k);
        e.values.iter().zip(&e.vectors).map(|(l, v)| v.iter().map(|x| x * l.max(0.0).sqrt()).collect()).collect()
    };
    let operators: Vec<Vec<f64>> = (0..tokens)
        .map(|t| {
            let mut c = Vec::with_capacity(r.len() * d_out);
            for r_a in &r {
                // Row a of R·diag(g_b)·W_mix·diag(g_o); mix_weight row o is column o of W_mix.
                let scaled: Vec<f64> = match &g.basis {
                    Some(b) => r_a.iter().zip(&b[t]).map(|(x, y)| x * y).collect(),
                    None => r_a.clone(),
                };
                for (o, column) in g.mix_weight.chunks_exact(k).enumerate() {
                    c.push(dot(&scaled, column) * g.out.as_ref().map_or(1.0, |go| go[t][o]));
                }
            }
            c
        })
        .collect();
    let space = match (g.basis.is_some(), g.out.is_some()) {
        (true, true) => k * d_out,
        (true, false) => k,
        (false, true) => d_out,
        (false, false) => 1,
    };
    let g = gram(&operators);
    Spectrum {
        singular_values: singular_values_from_gram(&g, tokens),
        centred_singular_values: singular_values_from_gram(&centre_gram(&g, tokens), tokens),
        rank_bound: tokens.min(space).min(d_in * d_out),
    }
}

/// Gate statistics over a set of values in [0, 1].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GateStats {
    /// How many gate values were pooled.
    pub count: usize,
    /// Counts in 20 equal bins on [0, 1] (they sum to `count`).
    pub histogram: Vec<usize>,
    /// The mean gate value.
    pub mean: f64,
    /// Mean of `−g·log₂g − (1−g)·log₂(1−g)`: 1 bit for a gate at ½, 0 for a saturated one.
    pub mean_binary_entropy_bits: f64,
    /// Entropy of the histogram divided by log(20): 1 for gates spread evenly over [0, 1].
    pub histogram_entropy_normalised: f64,
    /// Share strictly inside (0.1, 0.9), the paper's "active decision range".
    pub share_in_0_1_to_0_9: f64,
    /// Share at or below 0.1 (gates that are nearly closed).
    pub share_below_0_1: f64,
    /// Share at or above 0.9 (gates that are nearly open).
    pub share_above_0_9: f64,
}

/// Histogram and summary statistics of `values` (each in [0, 1]).
pub fn gate_stats(values: &[f64]) -> GateStats {
    let mut histogram = vec![0usize; BINS];
    let (mut sum, mut entropy, mut mid, mut low, mut high) = (0.0, 0.0, 0usize, 0usize, 0usize);
    for &g in values {
        histogram[((g * BINS as f64) as usize).min(BINS - 1)] += 1;
        sum += g;
        let h = |p: f64| if p > 0.0 { -p * p.log2() } else { 0.0 };
        entropy += h(g) + h(1.0 - g);
        mid += usize::from(g > 0.1 && g < 0.9);
        low += usize::from(g <= 0.1);
        high += usize::from(g >= 0.9);
    }
    let n = values.len().max(1) as f64;
    let histogram_entropy =
        histogram.iter().map(|&c| c as f64 / n).filter(|&q| q > 0.0).map(|q| -q * q.ln()).sum::<f64>()
            / (BINS as f64).ln();
    GateStats {
        count: values.len(),
        histogram,
        mean: sum / n,
        mean_binary_entropy_bits: entropy / n,
        histogram_entropy_normalised: histogram_entropy,
        share_in_0_1_to_0_9: mid as f64 / n,
        share_below_0_1: low as f64 / n,
        share_above_0_9: high as f64 / n,
    }
}

/// The CCL layers of the model with their traced gates.
fn collect(model: &Llama, traces: &[&GateTrace], tokens: usize) -> Result<Vec<LayerGates>> {
    let mut layers = Vec::new();
    for (l, block) in model.layers.iter().enumerate() {
        let Some(ffn) = block.mlp.as_ccl() else { bail!("layer {l} has no CCL FFN") };
        for (projection, ccl) in ffn.layers() {
            let name = format!("mlp.{projection}");
            let find = |kind: &str, width: usize| {
                traces
                    .iter()
                    .find(|t| t.layer == Some(l) && t.kind == kind && t.local_name() == name)
                    .map(|t| rows(t.value.to_vec(), width))
                    .filter(|r| r.len() == tokens)
            };
            let mut gates = LayerGates::new(l, projection, ccl);
            gates.basis = find("gate_basis", ccl.d_basis());
            gates.out = find("gate_out", ccl.out_features());
            layers.push(gates);
        }
    }
    Ok(layers)
}

/// Writes Figures 5-6 and Table 3 with their data; returns the JSON summary.
pub fn write(
    out: &mut Output,
    model: &Llama,
    traces: &[&GateTrace],
    sequence: &Sequence,
    top_tokens: usize,
) -> Result<serde_json::Value> {
    let tokens = sequence.ids.len();
    let layers = collect(model, traces, tokens)?;

    // Figure 5: spectra and effective ranks.
    let mut spectrum_csv = String::from("layer,projection,index,singular_value,normalised\n");
    let mut ranks = Vec::new();
    let mut spectra = Vec::new();
    for (g, s) in layers.iter().zip(spectra_in_parallel(&layers, tokens)) {
        let top = s.singular_values.first().copied().unwrap_or(0.0).max(f64::MIN_POSITIVE);
        for (i, v) in s.singular_values.iter().enumerate() {
            let _ = writeln!(spectrum_csv, "{},{},{i},{v:.9e},{:.9e}", g.layer, g.projection, v / top);
        }
        let erank = effective_rank(&s.singular_values);
        ranks.push(json!({
            "layer": g.layer, "projection": g.projection, "tokens": tokens,
            "effective_rank": erank, "numerical_rank": numerical_rank(&s.singular_values),
            "effective_rank_centred": effective_rank(&s.centred_singular_values),
            "rank_bound": s.rank_bound, "d_basis": g.k, "in_features": g.d_in, "out_features": g.d_out,
            "top_singular_values": s.singular_values.iter().take(8).collect::<Vec<_>>(),
        }));
        spectra.push((g.layer, g.projection, erank, s));
    }
    out.write("ccl_spectrum.csv", spectrum_csv)?;
    out.json("ccl_rank.json", &json!(ranks))?;
    out.write("ccl_spectrum.svg", figure_5(&spectra, tokens))?;

    // Figure 6: gate utilisation.
    let flat = |m: &Option<Vec<Vec<f64>>>| m.iter().flat_map(|m| m.iter().flatten().copied()).collect::<Vec<_>>();
    let basis_values: Vec<f64> = layers.iter().flat_map(|g| flat(&g.basis)).collect();
    let out_values: Vec<f64> = layers.iter().flat_map(|g| flat(&g.out)).collect();
    let (basis, output) = (gate_stats(&basis_values), gate_stats(&out_values));
    let all = gate_stats(&[basis_values, out_values].concat());
    let mut hist_csv = String::from("bin_low,bin_high,basis,out,all\n");
    for b in 0..BINS {
        let (lo, hi) = (b as f64 / BINS as f64, (b + 1) as f64 / BINS as f64);
        let _ =
            writeln!(hist_csv, "{lo:.2},{hi:.2},{},{},{}", basis.histogram[b], output.histogram[b], all.histogram[b]);
    }
    out.write("ccl_gate_histogram.csv", hist_csv)?;
    let per_layer: Vec<serde_json::Value> = layers
        .iter()
        .map(|g| {
            let stats = |m: &Option<Vec<Vec<f64>>>| {
                m.as_ref().map(|m| gate_stats(&m.iter().flatten().copied().collect::<Vec<_>>()))
            };
            json!({ "layer": g.layer, "projection": g.projection, "basis": stats(&g.basis), "out": stats(&g.out) })
        })
        .collect();
    out.json("ccl_gates.json", &json!({ "all": all, "basis": basis, "out": output, "per_layer": per_layer }))?;
    out.write("ccl_gate_histogram.svg", figure_6(&basis, &output))?;

    // Table 3: top tokens per basis gate.
    let (top_csv, top_json) = top_tokens_table(&layers, sequence, top_tokens);
    out.write("ccl_top_tokens.csv", top_csv)?;
    out.json("ccl_top_tokens.json", &top_json)?;

    let eranks: Vec<f64> = spectra.iter().map(|s| s.2).collect();
    Ok(json!({
        "ranks": ranks,
        "gates": { "all": all, "basis": basis, "out": output },
        "highlights": {
            "effective_rank_mean": eranks.iter().sum::<f64>() / eranks.len().max(1) as f64,
            "effective_rank_max": eranks.iter().copied().fold(0.0, f64::max),
            "gate_count": all.count,
            "gate_mean_binary_entropy_bits": all.mean_binary_entropy_bits,
            "gate_share_in_0_1_to_0_9": all.share_in_0_1_to_0_9,
        },
    }))
}

/// [`spectrum`] of every layer, spread over the available cores.
fn spectra_in_parallel(layers: &[LayerGates], tokens: usize) -> Vec<Spectrum> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(layers.len()).max(1);
    let chunk = layers.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = layers
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(|g| spectrum(g, tokens)).collect::<Vec<_>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("spectrum thread panicked")).collect()
    })
}

/// Table 3: per basis gate, the tokens with the highest mean activation.
fn top_tokens_table(layers: &[LayerGates], sequence: &Sequence, top: usize) -> (String, serde_json::Value) {
    let mut csv = String::from("layer,projection,gate,selectivity,rank,token_id,token,mean,count\n");
    let mut json_layers = Vec::new();
    for g in layers {
        let Some(basis) = &g.basis else { continue };
        let mut gates = Vec::new();
        for j in 0..g.k {
            let mut per_token: HashMap<u32, (f64, usize)> = HashMap::new();
            for (t, &id) in sequence.ids.iter().enumerate() {
                let e = per_token.entry(id).or_default();
                e.0 += basis[t][j];
                e.1 += 1;
            }
            let mut ranked: Vec<(u32, f64, usize)> =
                per_token.into_iter().map(|(id, (s, n))| (id, s / n as f64, n)).collect();
            ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            ranked.truncate(top);
            let overall = basis.iter().map(|r| r[j]).sum::<f64>() / basis.len().max(1) as f64;
            let selectivity = ranked.first().map_or(0.0, |r| r.1) - overall;
            gates.push((j, selectivity, overall, ranked));
        }
        gates.sort_by(|a, b| b.1.total_cmp(&a.1));
        let label_of = |id: u32| {
            let t = sequence.ids.iter().position(|&x| x == id).unwrap_or(0);
            sequence.labels[t].clone()
        };
        let mut listed = Vec::new();
        for (j, selectivity, overall, ranked) in &gates {
            for (rank, (id, mean, count)) in ranked.iter().enumerate() {
                let _ = writeln!(
                    csv,
                    "{},{},{j},{selectivity:.6},{},{id},{},{mean:.6},{count}",
                    g.layer,
                    g.projection,
                    rank + 1,
                    csv_field(&label_of(*id))
                );
            }
            let tokens: Vec<serde_json::Value> = ranked
                .iter()
                .map(|(id, mean, count)| json!({ "token": label_of(*id), "id": id, "mean": mean, "count": count }))
                .collect();
            listed.push(json!({ "gate": j, "selectivity": selectivity, "gate_mean": overall, "top": tokens }));
        }
        json_layers.push(json!({ "layer": g.layer, "projection": g.projection, "gates": listed }));
    }
    (csv, json!(json_layers))
}

/// Normalised singular values (log scale) per layer, and effective rank against depth.
fn figure_5(spectra: &[(usize, &'static str, f64, Spectrum)], tokens: usize) -> String {
    let mut svg = Svg::new(1000.0, 420.0);
    svg.text((500.0, 20.0), &format!("CCL operators over {tokens} tokens (CCL Fig. 5)"), 14.0, "middle", 0.0);
    let series: Vec<Series> = spectra
        .iter()
        .enumerate()
        .map(|(i, (layer, projection, _, s))| {
            let top = s.singular_values.first().copied().unwrap_or(1.0).max(f64::MIN_POSITIVE);
            Series {
                label: format!("L{layer} {projection}"),
                points: s.singular_values.iter().enumerate().map(|(j, v)| ((j + 1) as f64, v / top)).collect(),
                colour: colour(i).to_string(),
                width: 1.4,
            }
        })
        .collect();
    let left = Rect { x: 0.0, y: 30.0, w: 560.0, h: 390.0 };
    line_panel(&mut svg, left, "singular values σᵢ/σ₁", ("index i", "σᵢ / σ₁"), &series, true, true);
    let projections = ["gate_proj", "up_proj", "down_proj"];
    let ranks: Vec<Series> = projections
        .iter()
        .enumerate()
        .map(|(i, p)| Series {
            label: p.to_string(),
            points: spectra.iter().filter(|s| s.1 == *p).map(|s| (s.0 as f64, s.2)).collect(),
            colour: colour(i).to_string(),
            width: 2.0,
        })
        .collect();
    let right = Rect { x: 570.0, y: 30.0, w: 430.0, h: 390.0 };
    line_panel(&mut svg, right, "effective rank exp(H(σ/Σσ))", ("layer", "effective rank"), &ranks, false, true);
    svg.finish()
}

/// Histogram of basis and output gate values.
fn figure_6(basis: &GateStats, output: &GateStats) -> String {
    let mut svg = Svg::new(640.0, 400.0);
    let edges: Vec<f64> = (0..=BINS).map(|b| b as f64 / BINS as f64).collect();
    let share = |s: &GateStats| s.histogram.iter().map(|&c| c as f64 / s.count.max(1) as f64).collect::<Vec<_>>();
    let title = format!(
        "CCL gate values (Fig. 6): {:.0}% in (0.1, 0.9), mean binary entropy {:.2} bits",
        100.0 * gate_stats_share(basis, output),
        (basis.mean_binary_entropy_bits * basis.count as f64 + output.mean_binary_entropy_bits * output.count as f64)
            / (basis.count + output.count).max(1) as f64
    );
    let groups = [("basis gates g_b", share(basis)), ("output gates g_o", share(output))];
    histogram_panel(
        &mut svg,
        Rect { x: 0.0, y: 0.0, w: 640.0, h: 400.0 },
        &title,
        ("gate value", "share of gates"),
        &edges,
        &groups,
    );
    svg.finish()
}

/// The share of all gate values in (0.1, 0.9), from the two groups.
fn gate_stats_share(basis: &GateStats, output: &GateStats) -> f64 {
    (basis.share_in_0_1_to_0_9 * basis.count as f64 + output.share_in_0_1_to_0_9 * output.count as f64)
        / (basis.count + output.count).max(1) as f64
}

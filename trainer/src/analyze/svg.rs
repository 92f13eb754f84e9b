//! Hand-written SVG plots for the analyses: line panels (linear or log y), heatmaps and
//! histograms, laid out on one canvas. No fonts or system libraries: text is left to the
//! viewer. Heatmaps are embedded as one RGB PNG each (a data URI, one pixel per cell, drawn
//! unsmoothed), which keeps a 128 × 128 map to kilobytes instead of 16k `<rect>`s.

use std::fmt::Write as _;
use std::io::Write as _;

/// A categorical palette (Tableau 10), cycled.
const PALETTE: [&str; 10] =
    ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

/// The `i`-th palette colour.
pub fn colour(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// Viridis-like colour map: `t ∈ [0, 1]` → `#rrggbb` (five anchors, linear in between).
pub fn viridis(t: f64) -> String {
    const ANCHORS: [(f64, f64, f64); 5] =
        [(68.0, 1.0, 84.0), (59.0, 82.0, 139.0), (33.0, 145.0, 140.0), (94.0, 201.0, 98.0), (253.0, 231.0, 37.0)];
    let x = if t.is_finite() { t.clamp(0.0, 1.0) } else { 0.0 } * (ANCHORS.len() - 1) as f64;
    let i = (x.floor() as usize).min(ANCHORS.len() - 2);
    let f = x - i as f64;
    let (a, b) = (ANCHORS[i], ANCHORS[i + 1]);
    let mix = |p: f64, q: f64| (p + (q - p) * f).round() as u8;
    format!("#{:02x}{:02x}{:02x}", mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// Escapes text for an SVG text node or attribute.
fn escape(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '&' => "&amp;".to_string(),
            '<' => "&lt;".to_string(),
            '>' => "&gt;".to_string(),
            '"' => "&quot;".to_string(),
            c if c.is_control() => " ".to_string(),
            c => c.to_string(),
        })
        .collect()
}

/// A rectangle on the canvas, in pixels.
#[derive(Clone, Copy, Debug)]
pub struct Rect {
    /// Left edge.
    pub x: f64,
    /// Top edge (SVG's y grows downwards).
    pub y: f64,
    /// Width.
    pub w: f64,
    /// Height.
    pub h: f64,
}

/// One curve of a line panel.
pub struct Series {
    /// The legend's name for the curve.
    pub label: String,
    /// `(x, y)` in data units, in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Any SVG colour.
    pub colour: String,
    /// Stroke width in pixels.
    pub width: f64,
}

/// An SVG document being drawn.
pub struct Svg {
    width: f64,
    height: f64,
    body: String,
}

impl Svg {
    /// A white canvas.
    pub fn new(width: f64, height: f64) -> Svg {
        let mut svg = Svg { width, height, body: String::new() };
        svg.rect(Rect { x: 0.0, y: 0.0, w: width, h: height }, "white", None);
        svg
    }

    /// The document.
    pub fn finish(self) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
             font-family=\"DejaVu Sans, Arial, sans-serif\">\n{}</svg>\n",
            self.body,
            w = self.width,
            h = self.height
        )
    }

    /// A rectangle filled with `fill`, outlined with `stroke` when given.
    pub fn rect(&mut self, r: Rect, fill: &str, stroke: Option<&str>) {
        let stroke = stroke.map(|s| format!(" stroke=\"{s}\"")).unwrap_or_default();
        let _ = writeln!(
            self.body,
            "<rect x=\"{:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{:.2}\" fill=\"{fill}\"{stroke}/>",
            r.x, r.y, r.w, r.h
        );
    }

    /// A straight line from `from` to `to`, in pixels.
    pub fn line(&mut self, from: (f64, f64), to: (f64, f64), stroke: &str, width: f64) {
        let _ = writeln!(
            self.body,
            "<line x1=\"{:.2}\" y1=\"{:.2}\" x2=\"{:.2}\" y2=\"{:.2}\" stroke=\"{stroke}\" stroke-width=\"{width}\"/>",
            from.0, from.1, to.0, to.1
        );
    }

    /// An open curve through `points` (pixels), slightly transparent so overlapping curves stay visible.
    pub fn polyline(&mut self, points: &[(f64, f64)], stroke: &str, width: f64) {
        let coords: Vec<String> = points.iter().map(|(x, y)| format!("{x:.2},{y:.2}")).collect();
        let _ = writeln!(
            self.body,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{stroke}\" stroke-width=\"{width}\" \
             stroke-opacity=\"0.85\"/>",
            coords.join(" ")
        );
    }

    /// Text at `(x, y)`; `anchor` is `start`, `middle` or `end`; `rotate` in degrees.
    pub fn text(&mut self, (x, y): (f64, f64), text: &str, size: f64, anchor: &str, rotate: f64) {
        let transform =
            if rotate != 0.0 { format!(" transform=\"rotate({rotate} {x:.2} {y:.2})\"") } else { String::new() };
        let _ = writeln!(
            self.body,
            "<text x=\"{x:.2}\" y=\"{y:.2}\" font-size=\"{size}\" text-anchor=\"{anchor}\"{transform}>{}</text>",
            escape(text)
        );
    }
}

/// "Nice" tick values covering `[low, high]` (steps 1, 2 or 5 × 10ⁿ), about `count` of them.
pub fn ticks(low: f64, high: f64, count: usize) -> Vec<f64> {
    if !(low.is_finite() && high.is_finite()) || high <= low {
        return vec![low];
    }
    let raw = (high - low) / count.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude);
    let first = (low / step).ceil() as i64;
    let last = (high / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// Formats a tick label compactly.
fn label(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1e4 || v.abs() < 1e-2 {
        format!("{v:.0e}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Axis ranges of a panel and the mapping into its plot box.
pub struct Frame {
    /// The plot box on the canvas, in pixels.
    pub plot: Rect,
    /// The x range `(low, high)` mapped onto the box's width.
    pub x: (f64, f64),
    /// The y range `(low, high)` mapped onto the box's height.
    pub y: (f64, f64),
    /// Whether y is drawn on a log₁₀ scale.
    pub log_y: bool,
}

impl Frame {
    fn map_y(&self, v: f64) -> f64 {
        let (lo, hi, v) = if self.log_y {
            (self.y.0.log10(), self.y.1.log10(), v.max(self.y.0).log10())
        } else {
            (self.y.0, self.y.1, v)
        };
        // A reversed range (hi < lo) draws the axis top-down, as a heatmap's rows.
        let span = if hi != lo { hi - lo } else { 1.0 };
        self.plot.y + self.plot.h * (1.0 - (v - lo) / span)
    }

    fn map_x(&self, v: f64) -> f64 {
        let span = if self.x.1 != self.x.0 { self.x.1 - self.x.0 } else { 1.0 };
        self.plot.x + self.plot.w * (v - self.x.0) / span
    }

    /// A data point in pixels.
    pub fn point(&self, (x, y): (f64, f64)) -> (f64, f64) {
        (self.map_x(x), self.map_y(y))
    }
}

/// Draws a panel's frame, ticks, grid, title and axis labels inside `area`; returns the
/// mapping for its data.
pub fn axes(
    svg: &mut Svg,
    area: Rect,
    title: &str,
    (xlabel, ylabel): (&str, &str),
    x: (f64, f64),
    y: (f64, f64),
    log_y: bool,
) -> Frame {
    let plot = Rect { x: area.x + 52.0, y: area.y + 24.0, w: (area.w - 62.0).max(10.0), h: (area.h - 62.0).max(10.0) };
    let frame = Frame { plot, x, y, log_y };
    svg.rect(plot, "white", Some("#444"));
    svg.text((plot.x + plot.w / 2.0, area.y + 16.0), title, 12.0, "middle", 0.0);
    for t in ticks(x.0.min(x.1), x.0.max(x.1), 6) {
        let px = frame.map_x(t);
        svg.line((px, plot.y + plot.h), (px, plot.y + plot.h + 4.0), "#444", 1.0);
        svg.text((px, plot.y + plot.h + 15.0), &label(t), 10.0, "middle", 0.0);
    }
    let y_ticks: Vec<f64> = if log_y {
        let (lo, hi) = (y.0.log10().floor() as i32, y.1.log10().ceil() as i32);
        (lo..=hi).map(|e| 10f64.powi(e)).filter(|v| *v >= y.0 * 0.999 && *v <= y.1 * 1.001).collect()
    } else {
        ticks(y.0.min(y.1), y.0.max(y.1), 5)
    };
    for t in y_ticks {
        let py = frame.map_y(t);
        svg.line((plot.x - 4.0, py), (plot.x, py), "#444", 1.0);
        svg.line((plot.x, py), (plot.x + plot.w, py), "#e6e6e6", 0.6);
        svg.text((plot.x - 6.0, py + 3.5), &label(t), 10.0, "end", 0.0);
    }
    svg.text((plot.x + plot.w / 2.0, area.y + area.h - 6.0), xlabel, 11.0, "middle", 0.0);
    svg.text((area.x + 12.0, plot.y + plot.h / 2.0), ylabel, 11.0, "middle", -90.0);
    frame
}

/// The range of `values` widened by 5% (a flat series gets ±0.5).
pub fn padded_range(values: impl IntoIterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .into_iter()
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 {
        return (lo - 0.5, hi + 0.5);
    }
    let pad = 0.05 * (hi - lo);
    (lo - pad, hi + pad)
}

/// A line panel; a legend is drawn when `legend` and there are at most 12 labelled series.
pub fn line_panel(
    svg: &mut Svg,
    area: Rect,
    title: &str,
    labels: (&str, &str),
    series: &[Series],
    log_y: bool,
    legend: bool,
) {
    let xs = padded_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let ys = if log_y {
        let positive: Vec<f64> =
            series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).filter(|v| *v > 0.0).collect();
        let lo = positive.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = positive.iter().copied().fold(0.0, f64::max);
        if lo.is_finite() && hi > 0.0 {
            (lo * 0.8, hi * 1.25)
        } else {
            (1e-3, 1.0)
        }
    } else {
        padded_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)))
    };
    let frame = axes(svg, area, title, labels, xs, ys, log_y);
    for s in series {
        let points: Vec<(f64, f64)> =
            s.points.iter().filter(|p| !log_y || p.1 > 0.0).map(|&p| frame.point(p)).collect();
        svg.polyline(&points, &s.colour, s.width);
    }
    let labelled: Vec<&Series> = series.iter().filter(|s| !s.label.is_empty()).collect();
    if legend && !labelled.is_empty() && labelled.len() <= 12 {
        let (x, mut y) = (frame.plot.x + frame.plot.w - 120.0, frame.plot.y + 12.0);
        for s in labelled {
            svg.line((x, y - 4.0), (x + 16.0, y - 4.0), &s.colour, 2.0);
            svg.text((x + 20.0, y), &s.label, 9.0, "start", 0.0);
            y += 12.0;
        }
    }
}

/// A heatmap of `rows × cols` cells (row 0 at the top) on the colour scale `[vmin, vmax]`;
/// the axes run over `extent = (x, y)` data units (the cells may be block averages).
/// The cells are one embedded PNG.
pub fn heatmap_panel(
    svg: &mut Svg,
    area: Rect,
    title: &str,
    labels: (&str, &str),
    values: &[Vec<f64>],
    (vmin, vmax): (f64, f64),
    extent: (f64, f64),
) {
    let (rows, cols) = (values.len(), values.first().map_or(0, Vec::len));
    let frame = axes(svg, area, title, labels, (0.0, extent.0), (extent.1, 0.0), false);
    let span = if vmax > vmin { vmax - vmin } else { 1.0 };
    let mut rgb = Vec::with_capacity(rows * cols * 3);
    for &v in values.iter().flatten() {
        let hex = viridis((v - vmin) / span);
        rgb.extend((0..3).map(|i| u8::from_str_radix(&hex[1 + 2 * i..3 + 2 * i], 16).unwrap_or(0)));
    }
    let png = png_rgb(cols, rows, &rgb);
    let plot = frame.plot;
    let _ = writeln!(
        svg.body,
        "<image x=\"{:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{:.2}\" preserveAspectRatio=\"none\" \
         style=\"image-rendering:pixelated\" href=\"data:image/png;base64,{}\"/>",
        plot.x,
        plot.y,
        plot.w,
        plot.h,
        base64(&png)
    );
    svg.rect(plot, "none", Some("#444"));
}

/// A minimal PNG (8-bit RGB, no interlace, filter 0 on every row) of `width × height`.
pub fn png_rgb(width: usize, height: usize, rgb: &[u8]) -> Vec<u8> {
    fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend((data.len() as u32).to_be_bytes());
        let mut crc = flate2::Crc::new();
        crc.update(kind);
        crc.update(data);
        out.extend(kind);
        out.extend(data);
        out.extend(crc.sum().to_be_bytes());
    }
    let mut header = Vec::with_capacity(13);
    header.extend((width as u32).to_be_bytes());
    header.extend((height as u32).to_be_bytes());
    header.extend([8, 2, 0, 0, 0]); // depth 8, colour type RGB, deflate, filter 0, no interlace
    let mut raw = Vec::with_capacity(height * (1 + 3 * width));
    for row in rgb.chunks(3 * width.max(1)).take(height) {
        raw.push(0);
        raw.extend(row);
    }
    let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    let data = encoder.write_all(&raw).and_then(|_| encoder.finish()).unwrap_or_default();
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    chunk(&mut out, b"IHDR", &header);
    chunk(&mut out, b"IDAT", &data);
    chunk(&mut out, b"IEND", &[]);
    out
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b = [group[0], *group.get(1).unwrap_or(&0), *group.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..4 {
            if i <= group.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A legend box: one line sample and label per series, from `(x, y)` downwards.
pub fn legend(svg: &mut Svg, (x, y): (f64, f64), series: &[Series]) {
    for (i, s) in series.iter().enumerate() {
        let row = y + 14.0 * i as f64;
        svg.line((x, row - 4.0), (x + 18.0, row - 4.0), &s.colour, s.width.max(1.5));
        svg.text((x + 24.0, row), &s.label, 11.0, "start", 0.0);
    }
}

/// A vertical colour bar for `[vmin, vmax]` in `area`.
pub fn colour_bar(svg: &mut Svg, area: Rect, (vmin, vmax): (f64, f64)) {
    const STEPS: usize = 64;
    let h = area.h / STEPS as f64;
    for i in 0..STEPS {
        let t = 1.0 - (i as f64 + 0.5) / STEPS as f64;
        svg.rect(Rect { x: area.x, y: area.y + i as f64 * h, w: area.w, h: h + 0.3 }, &viridis(t), None);
    }
    svg.rect(area, "none", Some("#444"));
    svg.text((area.x + area.w + 4.0, area.y + 8.0), &label(vmax), 10.0, "start", 0.0);
    svg.text((area.x + area.w + 4.0, area.y + area.h), &label(vmin), 10.0, "start", 0.0);
}

/// Bars of `counts` over consecutive bins `edges[i]..edges[i + 1]`, one colour per group
/// (groups drawn side by side within a bin), with a legend.
pub fn histogram_panel(
    svg: &mut Svg,
    area: Rect,
    title: &str,
    labels: (&str, &str),
    edges: &[f64],
    groups: &[(&str, Vec<f64>)],
) {
    let top = groups.iter().flat_map(|(_, c)| c.iter().copied()).fold(0.0, f64::max);
    let x = (edges.first().copied().unwrap_or(0.0), edges.last().copied().unwrap_or(1.0));
    let frame = axes(svg, area, title, labels, x, (0.0, top.max(1e-12) * 1.08), false);
    let n = groups.len().max(1) as f64;
    for (g, (name, counts)) in groups.iter().enumerate() {
        for (i, &c) in counts.iter().enumerate() {
            let (x0, x1) = (frame.point((edges[i], 0.0)).0, frame.point((edges[i + 1], 0.0)).0);
            let w = (x1 - x0) / n;
            let (_, y) = frame.point((0.0, c));
            let bar = Rect { x: x0 + g as f64 * w, y, w: (w - 0.5).max(0.5), h: frame.plot.y + frame.plot.h - y };
            svg.rect(bar, colour(g), None);
        }
        let (lx, ly) = (frame.plot.x + 10.0, frame.plot.y + 14.0 + 13.0 * g as f64);
        svg.rect(Rect { x: lx, y: ly - 8.0, w: 10.0, h: 8.0 }, colour(g), None);
        svg.text((lx + 14.0, ly), name, 10.0, "start", 0.0);
    }
}

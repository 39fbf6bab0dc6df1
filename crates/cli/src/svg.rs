//! Hand-written SVG line plots (no font or system-library dependency): log2 x axis
//! (message size), log10 or linear y axis, one polyline + markers per series.

use std::fmt::Write;

/// One plotted series.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// Dashed line (used for the ODP model).
    pub dashed: bool,
}

/// Plot description.
pub struct Plot<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub log_y: bool,
}

const W: f64 = 720.0;
const H: f64 = 420.0;
const L: f64 = 80.0;
const R: f64 = 200.0;
const T: f64 = 40.0;
const B: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A size label: 2, 1K, 8M.
pub fn size_label(b: f64) -> String {
    let b = b as u64;
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{}K", b >> 10)
    } else {
        format!("{b}")
    }
}

/// Render the plot; points with non-positive or non-finite values are skipped on
/// log axes (and counted in a note), never silently invented.
pub fn render(p: &Plot, series: &[Series]) -> String {
    let ok = |x: f64, y: f64| x.is_finite() && y.is_finite() && x > 0.0 && (!p.log_y || y > 0.0);
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|&(x, y)| ok(x, y))
        .collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        (L + W - R) / 2.0,
        esc(p.title)
    );
    if pts.is_empty() {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">no data</text></svg>"#,
            W / 2.0,
            H / 2.0
        );
        return out;
    }
    let (mut x0, mut x1) = (f64::MAX, f64::MIN);
    let (mut y0, mut y1) = (f64::MAX, f64::MIN);
    for &(x, y) in &pts {
        x0 = x0.min(x.log2());
        x1 = x1.max(x.log2());
        let yv = if p.log_y { y.log10() } else { y };
        y0 = y0.min(yv);
        y1 = y1.max(yv);
    }
    if p.log_y {
        y0 = y0.floor();
        y1 = y1.ceil().max(y0 + 1.0);
    } else {
        y0 = 0.0f64.min(y0);
        y1 = if y1 > y0 { y1 * 1.05 } else { y0 + 1.0 };
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let px = |x: f64| L + (x.log2() - x0) / (x1 - x0) * (W - L - R);
    let py = |y: f64| {
        let v = if p.log_y { y.log10() } else { y };
        H - B - (v - y0) / (y1 - y0) * (H - T - B)
    };
    // Axes and grid.
    let _ = writeln!(
        out,
        r#"<rect x="{L}" y="{T}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        W - L - R,
        H - T - B
    );
    let mut e = x0.ceil() as i64;
    let step = (((x1 - x0) / 12.0).ceil() as i64).max(1);
    while e as f64 <= x1 {
        let x = L + (e as f64 - x0) / (x1 - x0) * (W - L - R);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{T}" x2="{x:.1}" y2="{}" stroke="#ddd"/>"##,
            H - B
        );
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
            H - B + 16.0,
            size_label(2f64.powi(e as i32))
        );
        e += step;
    }
    let ticks: Vec<f64> = if p.log_y {
        (y0 as i64..=y1 as i64)
            .map(|k| 10f64.powi(k as i32))
            .collect()
    } else {
        (0..=5).map(|k| y0 + (y1 - y0) * k as f64 / 5.0).collect()
    };
    for t in ticks {
        let y = py(t);
        let _ = writeln!(
            out,
            r##"<line x1="{L}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/>"##,
            W - R
        );
        let lab = if t >= 100.0 || t == 0.0 {
            format!("{t:.0}")
        } else if t >= 1.0 {
            format!("{t:.1}")
        } else {
            format!("{t}")
        };
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{lab}</text>"#,
            L - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (L + W - R) / 2.0,
        H - 18.0,
        esc(p.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">{}</text>"#,
        (T + H - B) / 2.0,
        (T + H - B) / 2.0,
        esc(p.y_label)
    );
    // Series.
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let dash = if s.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let mut v: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|&(x, y)| ok(x, y))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = v
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        if !path.is_empty() {
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
                path.join(" ")
            );
        }
        for &(x, y) in &v {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                px(x),
                py(y)
            );
        }
        let ly = T + 10.0 + i as f64 * 18.0;
        let lx = W - R + 10.0;
        let _ = writeln!(
            out,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/>"#,
            lx + 24.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 30.0,
            ly + 4.0,
            esc(&s.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_series_and_skips_bad_points() {
        let s = vec![
            Series {
                label: "a<b".into(),
                points: vec![(2.0, 1.0), (4.0, 10.0), (8.0, f64::NAN)],
                dashed: false,
            },
            Series {
                label: "ODP (model)".into(),
                points: vec![(2.0, 2000.0)],
                dashed: true,
            },
        ];
        let svg = render(
            &Plot {
                title: "t",
                x_label: "x",
                y_label: "y",
                log_y: true,
            },
            &s,
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains("a&lt;b") && svg.contains("stroke-dasharray"));
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn empty_plot_says_so() {
        let svg = render(
            &Plot {
                title: "t",
                x_label: "x",
                y_label: "y",
                log_y: false,
            },
            &[],
        );
        assert!(svg.contains("no data"));
    }

    #[test]
    fn size_labels() {
        assert_eq!(size_label(2.0), "2");
        assert_eq!(size_label(4096.0), "4K");
        assert_eq!(size_label(8.0 * 1048576.0), "8M");
    }
}

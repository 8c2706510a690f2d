//! The Pareto picture: pass@1 against the large model's token share (every variant, and the
//! request-level curves), and pass@1 against wall time relative to the large model alone.
//! Written as SVG with `plotters`.

use std::path::Path;

use plotters::prelude::*;

use crate::report::VariantSummary;
use crate::run::Role;
use crate::stats::RequestLevel;
use crate::EvalError;

fn colour(role: Role) -> RGBColor {
    match role {
        Role::Small => RGBColor(31, 119, 180),
        Role::Large => RGBColor(214, 39, 40),
        Role::Routed => RGBColor(44, 160, 44),
        Role::Random => RGBColor(148, 103, 189),
    }
}

fn plot_err(e: impl std::fmt::Display) -> EvalError {
    EvalError::Other(format!("drawing the plot: {e}"))
}

/// `routed threshold=0.05` -> `t=0.05`, `random p=0.1` -> `rnd 0.1`: labels that fit.
fn short_label(variant: &str) -> String {
    if let Some(rest) = variant.strip_prefix("routed ") {
        rest.replace("threshold=", "t=")
    } else if let Some(rest) = variant.strip_prefix("random p=") {
        format!("rnd {rest}")
    } else {
        variant.to_string()
    }
}

/// Write `path` (SVG, two panels).
pub fn pareto_svg(
    path: &Path,
    rows: &[VariantSummary],
    rl: Option<&RequestLevel>,
    title: &str,
) -> Result<(), EvalError> {
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (left, right) = root.split_horizontally(600);
    let max_pass = rows
        .iter()
        .map(|r| r.pass_at_1)
        .chain(
            rl.into_iter()
                .flat_map(|r| r.oracle.iter().map(|p| p.pass_at_1)),
        )
        .fold(0.0f64, f64::max);
    let y_max = ((max_pass * 100.0 / 10.0).ceil() * 10.0 + 2.0).clamp(10.0, 102.0);
    let y_min = rows
        .iter()
        .map(|r| r.pass_at_1 * 100.0)
        .fold(y_max, f64::min);
    let y_min = ((y_min - 10.0) / 10.0).floor().max(0.0) * 10.0;

    // Panel 1: pass@1 vs LLM share.
    let mut chart = ChartBuilder::on(&left)
        .caption(
            format!("{title}: pass@1 vs LLM token share"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..100f64, y_min..y_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("tokens written by the large model (%)")
        .y_desc("pass@1 (%)")
        .draw()
        .map_err(plot_err)?;
    if let Some(rl) = rl {
        let curves: [(&str, Option<&Vec<crate::stats::CurvePoint>>, RGBColor); 3] = [
            (
                "request-level: oracle",
                Some(&rl.oracle),
                RGBColor(120, 120, 120),
            ),
            (
                "request-level: difficulty",
                rl.difficulty.as_ref(),
                RGBColor(255, 127, 14),
            ),
            (
                "request-level: random",
                Some(&rl.random),
                RGBColor(180, 180, 180),
            ),
        ];
        for (label, pts, c) in curves {
            let Some(pts) = pts else { continue };
            let line: Vec<(f64, f64)> = pts
                .iter()
                .map(|p| (100.0 * p.llm_share, 100.0 * p.pass_at_1))
                .collect();
            chart
                .draw_series(LineSeries::new(line, c.stroke_width(2)))
                .map_err(plot_err)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
    }
    for role in [Role::Small, Role::Large, Role::Routed, Role::Random] {
        let pts: Vec<(f64, f64, &str)> = rows
            .iter()
            .filter(|r| r.role == role)
            .filter_map(|r| {
                Some((
                    100.0 * r.llm_share?,
                    100.0 * r.pass_at_1,
                    r.variant.as_str(),
                ))
            })
            .collect();
        if pts.is_empty() {
            continue;
        }
        let c = colour(role);
        let label = match role {
            Role::Small => "small alone",
            Role::Large => "large alone",
            Role::Routed => "token-level (server's method)",
            Role::Random => "token-level random",
        };
        chart
            .draw_series(
                pts.iter()
                    .map(|&(x, y, _)| Circle::new((x, y), 5, c.filled())),
            )
            .map_err(plot_err)?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, c.filled()));
        if role == Role::Routed {
            let mut line: Vec<(f64, f64)> = pts.iter().map(|&(x, y, _)| (x, y)).collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(line, c.stroke_width(1)))
                .map_err(plot_err)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;

    // Panel 2: pass@1 vs wall time relative to the large model.
    let max_t = rows
        .iter()
        .filter_map(|r| r.time_vs_large)
        .fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(&right)
        .caption(format!("{title}: pass@1 vs time"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..(max_t * 1.1), y_min..y_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("wall time relative to the large model alone")
        .y_desc("pass@1 (%)")
        .draw()
        .map_err(plot_err)?;
    for r in rows {
        let Some(t) = r.time_vs_large else { continue };
        let c = colour(r.role);
        chart
            .draw_series(std::iter::once(Circle::new(
                (t, 100.0 * r.pass_at_1),
                5,
                c.filled(),
            )))
            .map_err(plot_err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                short_label(&r.variant),
                (t, 100.0 * r.pass_at_1),
                ("sans-serif", 11),
            )))
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

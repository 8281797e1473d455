//! One SVG of several runs against concurrency: throughput, TTFT p50 and
//! p99, TPOT p50. Concurrency is on a log2 axis and latencies on a log10
//! axis, so a slow run does not flatten the others: both are drawn as
//! logarithms on linear axes whose labels are written back as values,
//! which puts the concurrency ticks exactly on 1, 2, 4, 8...

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::metric::Metric;
use crate::report::BenchResult;

const PANELS: [Metric; 4] = [
    Metric::OutputTokS,
    Metric::TtftP50,
    Metric::TtftP99,
    Metric::TpotP50,
];

type Series = (String, Vec<(f64, f64)>);

pub fn svg(results: &[BenchResult], title: &str, path: &Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let root = SVGBackend::new(path, (1280, 860)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let root = root.titled(title, ("sans-serif", 26)).map_err(plot_err)?;
    for (area, metric) in root.split_evenly((2, 2)).iter().zip(PANELS) {
        panel(area, metric, &series(results, metric))?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

/// Each run's (concurrency, value) points; latencies as log10.
fn series(results: &[BenchResult], metric: Metric) -> Vec<Series> {
    results
        .iter()
        .map(|r| {
            let points = r
                .levels
                .iter()
                .filter_map(|l| {
                    let v = metric.of(l)?;
                    let y = if log_axis(metric) {
                        v.max(1e-3).log10()
                    } else {
                        v
                    };
                    Some(((l.concurrency as f64).log2(), y))
                })
                .collect();
            (r.label.clone(), points)
        })
        .collect()
}

fn log_axis(metric: Metric) -> bool {
    !metric.higher_is_better()
}

fn panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    metric: Metric,
    series: &[Series],
) -> Result<()> {
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (0f64, 0f64, f64::MAX, f64::MIN);
    for &(x, y) in points {
        x_min = x_min.min(x);
        x_max = x_max.max(x);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    if y_min > y_max {
        (y_min, y_max) = (0.0, 1.0);
    }
    let (y_lo, y_hi) = if log_axis(metric) {
        (y_min.floor().min(y_max - 0.5), y_max + 0.1)
    } else {
        (0.0, (y_max * 1.1).max(1e-6))
    };
    let mut chart = ChartBuilder::on(area)
        .caption(metric.title(), ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(x_min - 0.3..x_max + 0.3, y_lo..y_hi)
        .map_err(plot_err)?;
    let log = log_axis(metric);
    chart
        .configure_mesh()
        .x_desc("concurrency")
        .label_style(("sans-serif", 15))
        .x_labels((x_max - x_min) as usize + 1)
        .x_label_formatter(&|x| {
            // Only whole powers of two are levels.
            if (x - x.round()).abs() < 1e-6 {
                format!("{:.0}", 2f64.powf(x.round()))
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| {
            let v = if log { 10f64.powf(*y) } else { *y };
            if v >= 10.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.2}")
            }
        })
        .draw()
        .map_err(plot_err)?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(plot_err)?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(plot_err)?;
    }
    chart
        .configure_series_labels()
        .position(if metric.higher_is_better() {
            SeriesLabelPosition::UpperLeft
        } else {
            SeriesLabelPosition::LowerRight
        })
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e:?}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::tests::result;

    #[test]
    fn draws_every_run_into_one_svg() {
        let dir = std::env::temp_dir().join(format!("bench-plot-{}", std::process::id()));
        let path = dir.join("plot.svg");
        let results = vec![
            result("ours", &[(1, 20.0), (2, 38.0), (4, 70.0)]),
            result("peer", &[(1, 15.0), (2, 25.0), (4, 40.0)]),
        ];
        svg(&results, "test", &path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("<svg") && text.contains("ours") && text.contains("peer"));
        assert!(text.contains("Output tok/s") && text.contains("TPOT p50"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}

//! Results as markdown and as an SVG bar chart (engine, baseline and peer per scenario, drawn
//! with `plotters`).

use std::fmt::Write as _;
use std::time::Duration;

use crate::BoxError;
use crate::drain::RunResult;
use crate::scenario::{Db, Scenario};
use crate::target::Side;
use crate::target::{LatencyResult, PublishResult};
use crate::timed::{Op, count_f64};

/// The ratio engine/baseline below which a scenario is flagged.
pub const TARGET_RATIO: f64 = 0.95;

/// One scenario's outcome: the run of each side reported (the median of its repetitions) and
/// every repetition's rate.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioReport {
    /// The scenario.
    pub scenario: Scenario,
    /// Which loop the engine is compared with: the hand-written loop, or (FIFO tables) the
    /// strategy loop.
    pub baseline_side: Side,
    /// The engine's median run.
    pub engine: RunResult,
    /// The baseline's median run.
    pub baseline: RunResult,
    /// The peer crate's median run, where it ran.
    pub peer: Option<RunResult>,
    /// The engine's rate in each repetition, msg/s.
    pub engine_rates: Vec<f64>,
    /// The baseline's rate in each repetition, msg/s.
    pub baseline_rates: Vec<f64>,
    /// The peer's rate in each repetition, msg/s.
    pub peer_rates: Vec<f64>,
}

impl ScenarioReport {
    /// Builds the report from each side's runs (one per repetition), keeping each side's median
    /// run by rate.
    pub fn from_runs(
        scenario: Scenario,
        baseline_side: Side,
        engine: &[RunResult],
        baseline: &[RunResult],
        peer: &[RunResult],
    ) -> Self {
        Self {
            scenario,
            baseline_side,
            engine: median_run(engine),
            baseline: median_run(baseline),
            peer: (!peer.is_empty()).then(|| median_run(peer)),
            engine_rates: engine.iter().map(RunResult::rate).collect(),
            baseline_rates: baseline.iter().map(RunResult::rate).collect(),
            peer_rates: peer.iter().map(RunResult::rate).collect(),
        }
    }

    /// Engine msg/s over baseline msg/s (0 when the baseline timed nothing).
    pub fn ratio(&self) -> f64 {
        ratio(self.engine.rate(), self.baseline.rate())
    }

    /// Engine msg/s over the peer's msg/s, where the peer ran.
    pub fn peer_ratio(&self) -> Option<f64> {
        self.peer.map(|p| ratio(self.engine.rate(), p.rate()))
    }

    /// How far the repetitions of each side spread: (max - min) / median, the largest of the
    /// sides, so a reader can tell a ratio from noise.
    pub fn spread(&self) -> f64 {
        [&self.engine_rates, &self.baseline_rates, &self.peer_rates]
            .into_iter()
            .filter(|r| r.len() > 1)
            .map(|rates| {
                let mut sorted = rates.clone();
                sorted.sort_by(f64::total_cmp);
                let median = sorted[(sorted.len() - 1) / 2];
                ratio(sorted[sorted.len() - 1] - sorted[0], median)
            })
            .fold(0.0, f64::max)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b <= 0.0 { 0.0 } else { a / b }
}

/// The run with the median rate (the lower middle one of an even count).
pub fn median_run(runs: &[RunResult]) -> RunResult {
    let mut sorted: Vec<RunResult> = runs.to_vec();
    sorted.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    sorted
        .get(sorted.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or_default()
}

/// The value at `permille` (500: the median, 990: p99) of sorted samples, nearest rank.
pub fn quantile(sorted: &[Duration], permille: u64) -> Option<Duration> {
    let n = u64::try_from(sorted.len()).ok()?;
    if n == 0 {
        return None;
    }
    let rank = (permille.min(1000) * n).div_ceil(1000).max(1);
    sorted.get(usize::try_from(rank - 1).ok()?).copied()
}

/// Everything one invocation measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// `quick` or `full`.
    pub profile: String,
    /// Lines about the run (machine, rows, repetitions, load).
    pub notes: Vec<String>,
    /// Claim + ack throughput.
    pub scenarios: Vec<ScenarioReport>,
    /// Publish throughput per database.
    pub publish: Vec<(Db, PublishResult)>,
    /// Latency per database and wake-up.
    pub latency: Vec<(Db, LatencyResult)>,
    /// How long the whole invocation took.
    pub took: Duration,
}

/// A rate for tables: no decimals from 100 up, one below.
pub fn fmt_rate(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn fmt_ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn fifo_cell(s: &Scenario) -> String {
    s.fifo_groups.map_or("-".into(), |g| g.to_string())
}

/// The throughput table: one row per scenario, the engine's, the baseline's and the peer's
/// msg/s and the engine's ratios to them.
pub fn throughput_table(scenarios: &[ScenarioReport]) -> String {
    let mut out = String::from(
        "| database | mode | workers | batch | FIFO groups | sqlx-broker msg/s | baseline | baseline msg/s | broker/baseline | ruststream-sqlx msg/s | broker/ruststream | spread | |\n\
         |---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in scenarios {
        let s = &r.scenario;
        let ratio = r.ratio();
        let ratio_cell = if ratio < TARGET_RATIO {
            format!("**{ratio:.2}**")
        } else {
            format!("{ratio:.2}")
        };
        let mut flags = Vec::new();
        if ratio < TARGET_RATIO {
            flags.push("below 0.95".to_owned());
        }
        for (run, who) in [(Some(&r.engine), "broker"), (Some(&r.baseline), "baseline")]
            .into_iter()
            .chain([(r.peer.as_ref(), "peer")])
        {
            if run.is_some_and(|r| r.capped) {
                flags.push(format!("{who} capped"));
            }
        }
        let spread = if r.engine_rates.len() > 1 {
            format!("{:.0} %", r.spread() * 100.0)
        } else {
            "-".into()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.db.label(),
            s.mode,
            s.workers,
            s.batch,
            fifo_cell(s),
            fmt_rate(r.engine.rate()),
            r.baseline_side.label(),
            fmt_rate(r.baseline.rate()),
            ratio_cell,
            r.peer.map_or("-".into(), |p| fmt_rate(p.rate())),
            r.peer_ratio().map_or("-".into(), |p| format!("{p:.2}")),
            spread,
            flags.join(", "),
        );
    }
    out
}

/// The diagnostics table: for each side, the strategy calls of its timed stretch.
pub fn diagnostics_table(scenarios: &[ScenarioReport]) -> String {
    let mut out = String::from(
        "| scenario | side | msg/s | client CPU µs/row | claims | rows/claim | claim ms | settle ms | try_lock/take/unlock ms | statement ms/row | statements in flight | in work | max stall ms |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in scenarios {
        for (side, run) in [
            ("sqlx-broker", &r.engine),
            (r.baseline_side.label(), &r.baseline),
        ] {
            let _ = writeln!(
                out,
                "| {} | {side} | {} | {} |{}",
                r.scenario.id(),
                fmt_rate(run.rate()),
                run.cpu_us_per_row()
                    .map_or("-".into(), |c| format!("{c:.0}")),
                diag_cells(run)
            );
        }
    }
    out
}

fn diag_cells(run: &RunResult) -> String {
    let Some(st) = run.stats else {
        return " - | - | - | - | - | - | - | - | - |".into();
    };
    // Advisory claims read candidates; the other modes' claims hand out rows.
    let claim = if st.op(Op::Candidates).calls > 0 {
        st.op(Op::Candidates)
    } else {
        st.op(Op::Claim)
    };
    let rows_per_claim = if st.op(Op::Candidates).calls > 0 {
        // Rows taken per candidate read.
        if claim.calls == 0 {
            0.0
        } else {
            count_f64(st.op(Op::Take).rows) / count_f64(claim.calls)
        }
    } else {
        claim.rows_per_call()
    };
    let locks = if st.op(Op::TryLock).calls > 0 {
        format!(
            "{:.2}/{:.2}/{:.2}",
            st.op(Op::TryLock).mean_ms(),
            st.op(Op::Take).mean_ms(),
            st.op(Op::Unlock).mean_ms()
        )
    } else {
        "-".into()
    };
    let elapsed_ms = run.elapsed.as_secs_f64() * 1e3;
    let per_row = if run.timed_rows == 0 {
        0.0
    } else {
        st.total_ms() / count_f64(run.timed_rows)
    };
    let in_flight = if elapsed_ms > 0.0 {
        st.total_ms() / elapsed_ms
    } else {
        0.0
    };
    format!(
        " {} | {:.1} | {:.2} | {:.2} | {} | {:.3} | {:.2} | {} | {} |",
        claim.calls,
        rows_per_claim,
        claim.mean_ms(),
        st.op(Op::Settle).mean_ms(),
        locks,
        per_row,
        in_flight,
        run.mean_in_work.map_or("-".into(), |w| format!("{w:.2}")),
        fmt_ms(run.max_stall),
    )
}

/// The whole report as markdown.
pub fn markdown(report: &Report) -> String {
    let mut out = format!("# sqlx-broker benchmarks ({})\n\n", report.profile);
    for n in &report.notes {
        let _ = writeln!(out, "- {n}");
    }
    let _ = writeln!(out, "- took {:.1} s\n", report.took.as_secs_f64());
    if !report.scenarios.is_empty() {
        out.push_str(
            "## Claim + ack throughput: sqlx-broker vs a hand-written sqlx loop and ruststream-sqlx\n\n\
             sqlx-broker is a subscription with an instant-ack handler (`concurrency` = workers, \
             `batch_size` = batch). The baseline of a plain table is a hand-written sqlx loop \
             per mode (N tokio tasks, the leanest correct statements, no code or SQL shared with \
             the backends; see `benches/src/handwritten.rs`); FIFO tables, which have no \
             hand-written loop, are compared with the strategy loop (tasks calling the backend's \
             own strategy methods, the engine's statements without its scheduling). \
             ruststream-sqlx 0.7 runs PostgreSQL row lock and lease with the same workers. Each \
             side drains a table of its own; the clock runs after a warm-up tenth. *spread*: \
             (max - min) / median of the repetitions of the noisiest side. Ratios below 0.95 \
             are bold.\n\n",
        );
        out.push_str(&throughput_table(&report.scenarios));
        let below: Vec<&ScenarioReport> = report
            .scenarios
            .iter()
            .filter(|r| r.ratio() < TARGET_RATIO)
            .collect();
        let _ = writeln!(
            out,
            "\n{} of {} scenarios are below {TARGET_RATIO}.\n",
            below.len(),
            report.scenarios.len()
        );
        out.push_str(
            "## Where the time goes\n\n\
             Strategy calls made during each side's timed stretch. *client CPU*: CPU time of \
             the bench process per acked row while the side's clock ran (user and system, \
             every thread; on SQLite it includes the database's own work). *claims*: claim statements \
             (advisory: candidate reads; rows/claim is then rows taken per read). *statement \
             ms/row*: time in all statements per acked row. *statements in flight*: time in \
             statements over wall time. Only the engine and the strategy loop run through the timed \
             strategy wrapper; the hand-written loop shows \"-\". *in work*: the \
             engine's mean deliveries in work. *max stall*: the longest gap between two acks.\n\n",
        );
        out.push_str(&diagnostics_table(&report.scenarios));
        out.push('\n');
    }
    if !report.publish.is_empty() {
        out.push_str(
            "## Publish throughput\n\n| database | single insert msg/s | batch insert msg/s | batch |\n|---|---:|---:|---:|\n",
        );
        for (db, p) in &report.publish {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                db.label(),
                fmt_rate(p.single),
                fmt_rate(p.batched),
                p.batch
            );
        }
        out.push('\n');
    }
    if !report.latency.is_empty() {
        out.push_str(
            "## Latency from publish to handler start\n\n| database | wake-up | samples | median ms | p99 ms | max ms | lost |\n|---|---|---:|---:|---:|---:|---:|\n",
        );
        for (db, l) in &report.latency {
            let q = |p| l.quantile(p).map_or("-".into(), fmt_ms);
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                db.label(),
                l.wake.label(),
                l.samples.len(),
                q(500),
                q(990),
                q(1000),
                l.lost
            );
        }
        out.push('\n');
    }
    out
}

/// One side's bars: its legend, its colour, and its rate in a scenario (if it ran).
type ChartSide = (
    &'static str,
    plotters::style::RGBColor,
    fn(&ScenarioReport) -> Option<f64>,
);

/// A horizontal bar chart: per scenario a bar for sqlx-broker, its baseline and (where it ran)
/// the peer, in msg/s, drawn with `plotters`.
pub fn svg(title: &str, scenarios: &[ScenarioReport]) -> Result<String, BoxError> {
    use plotters::prelude::*;
    let rows = scenarios.len().max(1);
    let height = u32::try_from(rows * 34 + 90).unwrap_or(u32::MAX);
    let max = scenarios
        .iter()
        .flat_map(|r| {
            [
                r.engine.rate(),
                r.baseline.rate(),
                r.peer.map_or(0.0, |p| p.rate()),
            ]
        })
        .fold(1.0_f64, f64::max)
        * 1.05;
    let labels: Vec<String> = scenarios.iter().map(|r| r.scenario.label()).collect();
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (980, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let n = i32::try_from(rows).unwrap_or(i32::MAX);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(260)
            .build_cartesian_2d(0.0..max, (0..n).into_segmented())?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("msg/s")
            .y_labels(rows)
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => usize::try_from(*i)
                    .ok()
                    .and_then(|i| labels.get(i))
                    .cloned()
                    .unwrap_or_default(),
                SegmentValue::Last => String::new(),
            })
            .draw()?;
        let sides: [ChartSide; 3] = [
            ("sqlx-broker", RGBColor(59, 111, 182), |r| {
                Some(r.engine.rate())
            }),
            (
                "baseline (hand-written; FIFO: strategy loop)",
                RGBColor(160, 160, 160),
                |r| Some(r.baseline.rate()),
            ),
            ("ruststream-sqlx", RGBColor(230, 145, 56), |r| {
                r.peer.map(|p| p.rate())
            }),
        ];
        for (k, (name, color, value)) in sides.into_iter().enumerate() {
            let bars = scenarios.iter().enumerate().filter_map(move |(i, r)| {
                let v = value(r)?;
                let i = i32::try_from(i).ok()?;
                // Three thin bars stacked inside the scenario's band.
                let off = i32::try_from(k).ok()?;
                let mut bar = Rectangle::new(
                    [
                        (0.0, SegmentValue::Exact(i)),
                        (v, SegmentValue::Exact(i + 1)),
                    ],
                    color.filled(),
                );
                bar.set_margin(
                    2 + 9 * u32::try_from(off).ok()?,
                    2 + 9 * u32::try_from(2 - off).ok()?,
                    0,
                    0,
                );
                Some(bar)
            });
            chart.draw_series(bars)?.label(name).legend(move |(x, y)| {
                Rectangle::new([(x, y - 4), (x + 12, y + 4)], color.filled())
            });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_core::ClaimMode;

    fn run(rows: u64, millis: u64) -> RunResult {
        RunResult {
            timed_rows: rows,
            elapsed: Duration::from_millis(millis),
            ..RunResult::default()
        }
    }

    fn report(engine: RunResult, raw: RunResult) -> ScenarioReport {
        ScenarioReport::from_runs(
            Scenario {
                db: Db::Postgres,
                mode: ClaimMode::Lease,
                workers: 4,
                batch: 16,
                fifo_groups: None,
            },
            Side::HandWritten,
            &[engine],
            &[raw],
            &[],
        )
    }

    #[test]
    fn a_ratio_below_the_target_is_bold_and_flagged() {
        let table = throughput_table(&[report(run(500, 1000), run(1000, 1000))]);
        let row = table.lines().nth(2).expect("a data row");
        assert_eq!(
            row,
            "| PostgreSQL | lease | 4 | 16 | - | 500 | hand-written | 1000 | **0.50** | - | - | - | below 0.95 |"
        );
    }

    #[test]
    fn a_ratio_at_the_target_is_plain() {
        let table = throughput_table(&[report(run(990, 1000), run(1000, 1000))]);
        assert!(
            table.contains("| 990 | hand-written | 1000 | 0.99 | - | - | - |  |"),
            "{table}"
        );
    }

    #[test]
    fn the_median_run_is_the_middle_rate() {
        let runs = [run(300, 1000), run(100, 1000), run(200, 1000)];
        assert_eq!(median_run(&runs).timed_rows, 200);
        assert_eq!(median_run(&runs[..2]).timed_rows, 100);
        assert_eq!(median_run(&[]), RunResult::default());
    }

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&samples, 500), Some(Duration::from_millis(50)));
        assert_eq!(quantile(&samples, 990), Some(Duration::from_millis(99)));
        assert_eq!(quantile(&samples, 1000), Some(Duration::from_millis(100)));
        assert_eq!(quantile(&samples[..1], 0), Some(Duration::from_millis(1)));
        assert_eq!(quantile(&[], 500), None);
    }

    #[test]
    fn the_chart_is_an_svg_with_a_bar_per_side() {
        let svg = svg("title", &[report(run(500, 1000), run(1000, 1000))]).unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("title"));
        assert!(svg.contains("sqlx-broker"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}

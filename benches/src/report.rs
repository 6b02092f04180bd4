//! Results as markdown and as an SVG bar chart (engine vs raw per scenario), written by hand so
//! the crate needs no plotting dependency.

use std::fmt::Write as _;
use std::time::Duration;

use crate::drain::RunResult;
use crate::scenario::{Db, Scenario, mode_key};
use crate::target::{LatencyResult, PublishResult};
use crate::timed::{Op, count_f64};

/// The ratio engine/raw below which a scenario is flagged.
pub const TARGET_RATIO: f64 = 0.95;

/// One scenario's outcome: the run of each side reported (the median of its repetitions) and
/// every repetition's rate.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioReport {
    /// The scenario.
    pub scenario: Scenario,
    /// The engine's median run.
    pub engine: RunResult,
    /// The raw loop's median run.
    pub raw: RunResult,
    /// The engine's rate in each repetition, msg/s.
    pub engine_rates: Vec<f64>,
    /// The raw loop's rate in each repetition, msg/s.
    pub raw_rates: Vec<f64>,
}

impl ScenarioReport {
    /// Builds the report from each side's runs (one per repetition), keeping each side's median
    /// run by rate.
    pub fn from_runs(scenario: Scenario, engine: &[RunResult], raw: &[RunResult]) -> Self {
        Self {
            scenario,
            engine: median_run(engine),
            raw: median_run(raw),
            engine_rates: engine.iter().map(RunResult::rate).collect(),
            raw_rates: raw.iter().map(RunResult::rate).collect(),
        }
    }

    /// Engine msg/s over raw msg/s (0 when the raw loop timed nothing).
    pub fn ratio(&self) -> f64 {
        let raw = self.raw.rate();
        if raw <= 0.0 {
            return 0.0;
        }
        self.engine.rate() / raw
    }
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

/// The throughput table: one row per scenario, engine and raw msg/s and their ratio.
pub fn throughput_table(scenarios: &[ScenarioReport]) -> String {
    let mut out = String::from(
        "| database | mode | workers | batch | FIFO groups | engine msg/s | raw msg/s | engine/raw | |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---|\n",
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
        if r.engine.capped {
            flags.push("engine capped".to_owned());
        }
        if r.raw.capped {
            flags.push("raw capped".to_owned());
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.db.label(),
            s.mode,
            s.workers,
            s.batch,
            fifo_cell(s),
            fmt_rate(r.engine.rate()),
            fmt_rate(r.raw.rate()),
            ratio_cell,
            flags.join(", "),
        );
    }
    out
}

/// The diagnostics table: for each side, the strategy calls of its timed stretch.
pub fn diagnostics_table(scenarios: &[ScenarioReport]) -> String {
    let mut out = String::from(
        "| scenario | side | msg/s | claims | rows/claim | claim ms | settle ms | try_lock/take/unlock ms | statement ms/row | statements in flight | in work | max stall ms |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in scenarios {
        for (side, run) in [("engine", &r.engine), ("raw", &r.raw)] {
            let _ = writeln!(
                out,
                "| {} | {side} | {} |{}",
                r.scenario.id(),
                fmt_rate(run.rate()),
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
            "## Claim + ack throughput: engine vs raw loop\n\n\
             The engine is a subscription with an instant-ack handler (`concurrency` = workers, \
             `batch_size` = batch); the raw loop is N tokio tasks running the same strategy \
             statements (claim up to the batch, then settle each row). Each side drains a table \
             of its own; the clock runs after a warm-up tenth. Ratios below 0.95 are bold.\n\n",
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
             Strategy calls made during each side's timed stretch. *claims*: claim statements \
             (advisory: candidate reads; rows/claim is then rows taken per read). *statement \
             ms/row*: time in all statements per acked row. *statements in flight*: time in \
             statements over wall time (the raw loop keeps one per worker busy). *in work*: the \
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

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG bar chart: per scenario an engine bar and a raw bar, scaled per database (each
/// database's fastest run spans the plot), with the ratio at the right.
pub fn svg(title: &str, scenarios: &[ScenarioReport]) -> String {
    const LABEL_W: f64 = 230.0;
    const PLOT_W: f64 = 520.0;
    const RATIO_W: f64 = 70.0;
    const BAR_H: f64 = 9.0;
    const ROW_H: f64 = 26.0;
    const HEADER_H: f64 = 24.0;
    const TOP: f64 = 56.0;
    let width = LABEL_W + PLOT_W + RATIO_W + 20.0;
    let mut body = String::new();
    let mut y = TOP;
    for db in Db::ALL {
        let rows: Vec<&ScenarioReport> = scenarios.iter().filter(|r| r.scenario.db == db).collect();
        if rows.is_empty() {
            continue;
        }
        let max = rows
            .iter()
            .map(|r| r.engine.rate().max(r.raw.rate()))
            .fold(0.0_f64, f64::max)
            .max(1e-9);
        let _ = writeln!(
            body,
            r#"<text x="10" y="{:.1}" font-weight="bold">{} (bars scaled to {} msg/s)</text>"#,
            y + 16.0,
            db.label(),
            fmt_rate(max)
        );
        y += HEADER_H;
        for r in rows {
            let label = format!(
                "{} {}w b{}{}",
                mode_key(r.scenario.mode),
                r.scenario.workers,
                r.scenario.batch,
                r.scenario
                    .fifo_groups
                    .map_or(String::new(), |g| format!(" fifo{g}"))
            );
            let _ = writeln!(
                body,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                LABEL_W - 8.0,
                y + BAR_H + 4.0,
                xml_escape(&label)
            );
            for (i, (rate, class)) in [(r.engine.rate(), "engine"), (r.raw.rate(), "raw")]
                .into_iter()
                .enumerate()
            {
                let by = y + if i == 0 { 0.0 } else { BAR_H + 1.0 };
                let w = (rate / max * PLOT_W).max(0.5);
                let _ = writeln!(
                    body,
                    r#"<rect class="{class}" x="{LABEL_W:.1}" y="{by:.1}" width="{w:.1}" height="{BAR_H:.1}"/><text class="value" x="{:.1}" y="{:.1}">{}</text>"#,
                    LABEL_W + w + 3.0,
                    by + BAR_H - 1.0,
                    fmt_rate(rate)
                );
            }
            let ratio = r.ratio();
            let _ = writeln!(
                body,
                r#"<text class="{}" x="{:.1}" y="{:.1}" text-anchor="end">{ratio:.2}</text>"#,
                if ratio < TARGET_RATIO { "low" } else { "ok" },
                LABEL_W + PLOT_W + RATIO_W,
                y + BAR_H + 4.0
            );
            y += ROW_H;
        }
    }
    let height = y + 10.0;
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="11">
<style>.engine{{fill:#3b6fb6}}.raw{{fill:#a0a0a0}}.value{{font-size:9px;fill:#333}}.low{{fill:#c0392b;font-weight:bold}}.ok{{fill:#1e7b34}}</style>
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="20" font-size="14" font-weight="bold">{}</text>
<rect class="engine" x="10" y="32" width="12" height="9"/><text x="26" y="40">engine msg/s</text>
<rect class="raw" x="110" y="32" width="12" height="9"/><text x="126" y="40">raw loop msg/s</text>
<text x="{:.1}" y="40" text-anchor="end">engine/raw</text>
{body}</svg>
"##,
        xml_escape(title),
        LABEL_W + PLOT_W + RATIO_W
    )
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
            &[engine],
            &[raw],
        )
    }

    #[test]
    fn a_ratio_below_the_target_is_bold_and_flagged() {
        let table = throughput_table(&[report(run(500, 1000), run(1000, 1000))]);
        let row = table.lines().nth(2).expect("a data row");
        assert_eq!(
            row,
            "| PostgreSQL | lease | 4 | 16 | - | 500 | 1000 | **0.50** | below 0.95 |"
        );
    }

    #[test]
    fn a_ratio_at_the_target_is_plain() {
        let table = throughput_table(&[report(run(990, 1000), run(1000, 1000))]);
        assert!(table.contains("| 990 | 1000 | 0.99 |  |"), "{table}");
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
    fn the_chart_scales_bars_to_the_fastest_run_of_each_database() {
        let svg = svg("t <&>", &[report(run(500, 1000), run(1000, 1000))]);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("t &lt;&amp;&gt;"));
        // The raw bar spans the plot; the engine bar is half of it.
        assert!(
            svg.contains(r#"class="raw" x="230.0" y="90.0" width="520.0""#),
            "{svg}"
        );
        assert!(
            svg.contains(r#"class="engine" x="230.0" y="80.0" width="260.0""#),
            "{svg}"
        );
        assert!(svg.contains(r#"class="low""#));
    }
}

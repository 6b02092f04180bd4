//! One invocation of the bench binary: connect, run what the options select, and collect a
//! [`Report`].

use std::time::Instant;

use crate::BoxError;
use crate::cli::Options;
use crate::drain::{RunLimits, RunResult};
use crate::report::{Report, ScenarioReport, fmt_rate};
use crate::scenario::Db;
use crate::target::{Side, Target, Urls};

/// Connects to every selected database first, so an unreachable one fails the run before
/// anything is measured. The error names the database, its URL and how to leave it out.
pub async fn connect_all(dbs: &[Db], urls: &Urls) -> Result<Vec<Target>, BoxError> {
    let mut targets = Vec::new();
    for &db in dbs {
        match Target::connect(db, urls).await {
            Ok(t) => targets.push(t),
            Err(e) => {
                for t in targets {
                    t.close().await;
                }
                let others: Vec<&str> = dbs.iter().filter(|d| **d != db).map(|d| d.key()).collect();
                let leave_out = if others.is_empty() {
                    "--db sqlite".to_owned()
                } else {
                    format!("--db {}", others.join(","))
                };
                let (url, env) = match db {
                    Db::Postgres => (urls.postgres.as_str(), "SQLX_BROKER_PG_URL"),
                    Db::MariaDb => (urls.mysql.as_str(), "SQLX_BROKER_MYSQL_URL"),
                    Db::Sqlite => ("a temporary file", "TMPDIR"),
                };
                return Err(format!(
                    "{} is unreachable at {url}: {e}\n  start it, point {env} at it, or leave it out with {leave_out}",
                    db.label()
                )
                .into());
            }
        }
    }
    Ok(targets)
}

/// The system's 1-minute load average, where the platform tells (Linux).
fn load_average() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next().map(str::to_owned)
}

/// The CPU model and memory, where the platform tells (Linux).
fn machine() -> Option<String> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let model = cpu
        .lines()
        .find_map(|l| l.strip_prefix("model name"))?
        .trim_start_matches([' ', '\t', ':'])
        .to_owned();
    let mem = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = mem
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(format!(
        "{model}, {} GiB",
        (kib + 512 * 1024) / (1024 * 1024)
    ))
}

/// Runs what `options` select; `log` gets a line per finished measurement.
pub async fn run(options: &Options, log: impl Fn(&str)) -> Result<Report, BoxError> {
    let started = Instant::now();
    let profile = &options.profile;
    let urls = Urls::from_env();
    let load_start = load_average();
    let targets = connect_all(&options.filter.used_dbs(), &urls).await?;
    let mut report = Report {
        profile: profile.name.to_owned(),
        ..Report::default()
    };
    let mut servers = Vec::new();
    for target in &targets {
        match target.server().await {
            Ok(s) => servers.push(s),
            Err(e) => servers.push(format!(
                "{}: settings unreadable ({e})",
                target.db().label()
            )),
        }
    }
    let result = async {
        for target in &targets {
            let db = target.db();
            if options.parts.claims {
                let scenarios: Vec<_> = options
                    .filter
                    .scenarios()
                    .into_iter()
                    .filter(|s| s.db == db)
                    .collect();
                for (i, scenario) in scenarios.iter().enumerate() {
                    let scenario_started = Instant::now();
                    let limits = RunLimits::new(profile.rows, scenario, profile.cap);
                    let (mut engine, mut raw): (Vec<RunResult>, Vec<RunResult>) = (vec![], vec![]);
                    for rep in 0..profile.reps {
                        // Alternate which side goes first, so neither always meets a warmer
                        // server.
                        let order = if (i + rep) % 2 == 0 {
                            [Side::Engine, Side::Raw]
                        } else {
                            [Side::Raw, Side::Engine]
                        };
                        for side in order {
                            let r = target.run_side(scenario, side, limits).await?;
                            match side {
                                Side::Engine => engine.push(r),
                                Side::Raw => raw.push(r),
                            }
                        }
                    }
                    let r = ScenarioReport::from_runs(*scenario, &engine, &raw);
                    log(&format!(
                        "{:<30} engine {:>7} msg/s  raw {:>7} msg/s  ratio {:.2}  ({:.1} s){}",
                        scenario.id(),
                        fmt_rate(r.engine.rate()),
                        fmt_rate(r.raw.rate()),
                        r.ratio(),
                        scenario_started.elapsed().as_secs_f64(),
                        if r.engine.capped || r.raw.capped {
                            "  capped"
                        } else {
                            ""
                        }
                    ));
                    report.scenarios.push(r);
                }
            }
            if options.parts.publish {
                let part_started = Instant::now();
                let p = target
                    .publish(
                        profile.publish_single,
                        profile.publish_batched,
                        profile.publish_batch,
                    )
                    .await?;
                log(&format!(
                    "{:<30} single {:>7} msg/s  batch {:>7} msg/s  ({:.1} s)",
                    format!("{}/publish", db.key()),
                    fmt_rate(p.single),
                    fmt_rate(p.batched),
                    part_started.elapsed().as_secs_f64()
                ));
                report.publish.push((db, p));
            }
            if options.parts.latency {
                let part_started = Instant::now();
                for l in target
                    .latency(profile.wake_samples, profile.poll_samples)
                    .await?
                {
                    log(&format!(
                        "{:<30} median {:>6.1} ms  p99 {:>6.1} ms  lost {}",
                        format!("{}/latency/{}", db.key(), l.wake.label()),
                        l.quantile(500).unwrap_or_default().as_secs_f64() * 1e3,
                        l.quantile(990).unwrap_or_default().as_secs_f64() * 1e3,
                        l.lost
                    ));
                    report.latency.push((db, l));
                }
                log(&format!(
                    "{:<30} ({:.1} s)",
                    format!("{}/latency", db.key()),
                    part_started.elapsed().as_secs_f64()
                ));
            }
        }
        Ok::<_, BoxError>(())
    }
    .await;
    for t in targets {
        t.close().await;
    }
    result?;
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    report.notes = vec![
        format!(
            "machine: {cores} cores ({}); 1-minute load average {} at start, {} at end (other builds and tests may have been running)",
            machine().unwrap_or_else(|| "?".into()),
            load_start.unwrap_or_else(|| "?".into()),
            load_average().unwrap_or_else(|| "?".into())
        ),
        format!(
            "{} rows per run (a tenth, at least one batch per worker, is warm-up), {} repetition(s) per side (median reported), time cap {:.1} s per run",
            profile.rows,
            profile.reps,
            profile.cap.as_secs_f64()
        ),
        format!("servers (same machine, loopback): {}", servers.join("; ")),
        "pools: the backends' `connect` defaults (PostgreSQL and MariaDB 16 connections, SQLite 8), shared by both sides".into(),
        "tables: a text payload and a due-time column, plus `locked_until` (lease), a key column with the template `k-{k}` over 1024 keys (advisory), or a group column with `fifo(true)` (FIFO, rows spread round-robin over the groups); acks delete rows".into(),
    ];
    report.took = started.elapsed();
    Ok(report)
}

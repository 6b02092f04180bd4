//! One invocation of the bench binary: connect, run what the options select, and collect a
//! [`Report`].

use std::time::Instant;

use crate::BoxError;
use crate::cli::Options;
use crate::drain::{RunLimits, RunResult};
use crate::report::{self, Report, ScenarioReport, fmt_rate};
use crate::scenario::Db;
use crate::target::{Side, Target, Urls};
use crate::{host, peer};

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

/// Runs what `options` select; `log` gets a line per finished measurement.
pub async fn run(options: &Options, log: impl Fn(&str)) -> Result<Report, BoxError> {
    let started = Instant::now();
    let profile = &options.profile;
    let urls = match &options.url {
        Some(url) => {
            let (urls, db) = Urls::from_env().with_url(url)?;
            if options.filter.used_dbs() != [db] {
                return Err(format!(
                    "--url is a {} URL: --db must be {} alone with it",
                    db.label(),
                    db.key()
                )
                .into());
            }
            urls
        }
        None => Urls::from_env(),
    };
    let load_start = host::load_average_1m();
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
                    let baseline_side = if scenario.fifo_groups.is_some() {
                        Side::StrategyLoop
                    } else {
                        Side::HandWritten
                    };
                    let mut sides = vec![Side::Engine, baseline_side];
                    if options.peer && peer::covers(scenario) {
                        sides.push(Side::Peer);
                    }
                    if options.strategy_loop && baseline_side != Side::StrategyLoop {
                        sides.push(Side::StrategyLoop);
                    }
                    let mut runs: Vec<Vec<RunResult>> = vec![Vec::new(); sides.len()];
                    for rep in 0..profile.reps {
                        // Rotate which side goes first, so none always meets a warmer server.
                        for k in 0..sides.len() {
                            let at = (k + i + rep) % sides.len();
                            let r = target.run_side(scenario, sides[at], limits).await?;
                            runs[at].push(r);
                        }
                    }
                    let r = ScenarioReport::from_runs(
                        *scenario,
                        baseline_side,
                        &runs[0],
                        &runs[1],
                        sides
                            .iter()
                            .position(|s| *s == Side::Peer)
                            .map_or(&[][..], |p| &runs[p]),
                    );
                    let mut line = format!(
                        "{:<30} broker {:>7}  {} {:>7}  ratio {:.2}",
                        scenario.id(),
                        fmt_rate(r.engine.rate()),
                        baseline_side.label(),
                        fmt_rate(r.baseline.rate()),
                        r.ratio(),
                    );
                    if let (Some(p), Some(pr)) = (r.peer, r.peer_ratio()) {
                        line.push_str(&format!(
                            "  ruststream-sqlx {:>7}  ratio {pr:.2}",
                            fmt_rate(p.rate())
                        ));
                    }
                    if let Some(k) = sides.iter().position(|s| *s == Side::StrategyLoop)
                        && baseline_side != Side::StrategyLoop
                    {
                        let s = report::median_run(&runs[k]);
                        line.push_str(&format!("  strategy loop {:>7}", fmt_rate(s.rate())));
                    }
                    line.push_str(&format!(
                        "  ({:.1} s){}",
                        scenario_started.elapsed().as_secs_f64(),
                        if r.engine.capped || r.baseline.capped {
                            "  capped"
                        } else {
                            ""
                        }
                    ));
                    log(&line);
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
            host::machine().unwrap_or_else(|| "?".into()),
            load_start.unwrap_or_else(|| "?".into()),
            host::load_average_1m().unwrap_or_else(|| "?".into())
        ),
        format!(
            "{} rows per run (a tenth, at least one batch per worker, is warm-up), {} repetition(s) per side (median reported), time cap {:.1} s per run",
            profile.rows,
            profile.reps,
            profile.cap.as_secs_f64()
        ),
        if options.url.is_some() {
            format!("server (--url): {}", servers.join("; "))
        } else {
            format!("servers (same machine, loopback): {}", servers.join("; "))
        },
        "pools: the backends' `connect` defaults (PostgreSQL and MariaDB 16 connections, SQLite 8), shared by sqlx-broker and the hand-written loop (each hand-written worker holds one connection for its run); ruststream-sqlx gets a pool of 16 of its own".into(),
        "tables: a text payload and a due-time column, plus `locked_until` (lease), a key column with the template `k-{k}` over 1024 keys (advisory), or a group column with `fifo(true)` (FIFO, rows spread round-robin over the groups); acks delete rows".into(),
    ];
    report.took = started.elapsed();
    Ok(report)
}

/// Drops the tables this process made on the server at `--url` (`sxb_bench_<pid>_..`, in the
/// URL's current schema or database), after a failed or interrupted run; returns how many.
/// Every run drops its own table as it ends; this is for one cut short.
///
/// # Errors
/// The server cannot be reached, or a drop is refused.
pub async fn sweep(url: &str) -> Result<usize, BoxError> {
    use sqlx::{AssertSqlSafe, Connection};
    let pattern = format!("sxb\\_bench\\_{}\\_%", std::process::id());
    let mut dropped = 0;
    match Db::of_url(url) {
        Some(Db::Postgres) => {
            let mut conn = sqlx::PgConnection::connect(url).await?;
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT table_name::text FROM information_schema.tables \
                 WHERE table_schema = current_schema() AND table_name LIKE $1",
            )
            .bind(&pattern)
            .fetch_all(&mut conn)
            .await?;
            for n in names {
                let sql = format!(
                    "DROP TABLE IF EXISTS \"{}\" CASCADE",
                    n.replace('"', "\"\"")
                );
                sqlx::query(AssertSqlSafe(sql)).execute(&mut conn).await?;
                dropped += 1;
            }
        }
        Some(Db::MariaDb) => {
            let mut conn = sqlx::MySqlConnection::connect(url).await?;
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE ?",
            )
            .bind(&pattern)
            .fetch_all(&mut conn)
            .await?;
            for n in names {
                let sql = format!("DROP TABLE IF EXISTS `{}`", n.replace('`', "``"));
                sqlx::query(AssertSqlSafe(sql)).execute(&mut conn).await?;
                dropped += 1;
            }
        }
        // SQLite's file is removed by `Target::close`, or by this.
        Some(Db::Sqlite) => {
            if let Ok((urls, _)) = Urls::from_env().with_url(url) {
                let file = urls
                    .sqlite_dir
                    .unwrap_or_else(std::env::temp_dir)
                    .join(format!("sqlx-broker-bench-{}.db", std::process::id()));
                if file.exists() {
                    host::remove_sqlite_files(&file);
                    dropped += 1;
                }
            }
        }
        None => {}
    }
    Ok(dropped)
}

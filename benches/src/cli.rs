//! The bench binary's command line.

use std::path::PathBuf;
use std::time::Duration;

use broker_core::ClaimMode;
use clap::Parser;

use crate::scenario::{Db, Filter, parse_mode};

/// Sizes of one kind of run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// `quick` or `full`.
    pub name: &'static str,
    /// Rows per claim run.
    pub rows: u64,
    /// Repetitions per scenario and side.
    pub reps: usize,
    /// Time cap per claim run.
    pub cap: Duration,
    /// Rows published one per statement.
    pub publish_single: usize,
    /// Rows published in batches.
    pub publish_batched: usize,
    /// Rows per publish batch.
    pub publish_batch: usize,
    /// Latency samples with wake-ups.
    pub wake_samples: usize,
    /// Latency samples with polling only.
    pub poll_samples: usize,
}

impl Profile {
    /// The short run.
    pub fn quick() -> Self {
        Self {
            name: "quick",
            rows: 300,
            reps: 1,
            cap: Duration::from_millis(1500),
            publish_single: 200,
            publish_batched: 2000,
            publish_batch: 100,
            wake_samples: 40,
            poll_samples: 12,
        }
    }

    /// The long run.
    pub fn full() -> Self {
        Self {
            name: "full",
            rows: 1500,
            reps: 3,
            cap: Duration::from_secs(15),
            publish_single: 3000,
            publish_batched: 30_000,
            publish_batch: 100,
            wake_samples: 500,
            poll_samples: 100,
        }
    }
}

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parts {
    /// Claim + ack throughput, engine vs raw.
    pub claims: bool,
    /// Publish throughput.
    pub publish: bool,
    /// Publish-to-handler latency.
    pub latency: bool,
}

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Sizes.
    pub profile: Profile,
    /// Which scenarios.
    pub filter: Filter,
    /// Whether the filter differs from the default (results then go to `<profile>-partial.*`).
    pub filtered: bool,
    /// What to measure.
    pub parts: Parts,
    /// Whether ruststream-sqlx runs beside the scenarios it covers.
    pub peer: bool,
    /// Whether plain tables also run the strategy loop (the engine's statements without its
    /// scheduling) besides the hand-written loop.
    pub strategy_loop: bool,
    /// Where to write results; `None` prints only.
    pub out: Option<PathBuf>,
    /// The user's server (`--url`), in place of the one of its database's variable.
    pub url: Option<String>,
}

/// Claim + ack throughput of sqlx-broker against a hand-written sqlx loop per mode (and
/// ruststream-sqlx on PostgreSQL row lock and lease), for every mode on every database, plus
/// publish throughput and publish-to-handler latency. Prints a markdown table and writes
/// benches/results/<quick|full>.md and .svg (<profile>-partial.* when filtered).
///
/// PostgreSQL and MariaDB are found at SQLX_BROKER_PG_URL (default
/// postgres://postgres@127.0.0.1:5432/test) and SQLX_BROKER_MYSQL_URL (default
/// mysql://root@127.0.0.1:3306/test); a selected database that is unreachable fails the run,
/// leave it out with --db.
#[derive(Debug, Parser)]
#[command(name = "benches")]
pub struct Args {
    /// A short run (about two minutes on 2 cores).
    #[arg(long, conflicts_with = "full")]
    pub quick: bool,
    /// The long default run (1,500 rows, 3 repetitions, median reported; about 15 minutes).
    #[arg(long)]
    pub full: bool,
    /// Databases.
    #[arg(long, value_delimiter = ',', value_parser = parse_db)]
    pub db: Option<Vec<Db>>,
    /// Claim modes: rowlock, lease, advisory.
    #[arg(long, value_delimiter = ',', value_parser = parse_claim_mode)]
    pub mode: Option<Vec<ClaimMode>>,
    /// Worker counts of plain tables (default 1,4,8).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: Option<Vec<u16>>,
    /// Batch sizes of plain tables (default 1,16).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..))]
    pub batch: Option<Vec<u16>>,
    /// FIFO group counts, or "none" (default 1,64).
    #[arg(long, value_parser = parse_groups)]
    pub fifo_groups: Option<FifoGroups>,
    /// Workers of FIFO runs (default 4).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub fifo_workers: Option<u16>,
    /// Extra worker counts of plain advisory tables at batch 1 (default 200; "none" for none;
    /// given --workers and not this, none).
    #[arg(long, value_parser = parse_groups)]
    pub advisory_crowd: Option<FifoGroups>,
    /// Run FIFO tables only.
    #[arg(long)]
    pub no_plain: bool,
    /// What to measure: claims, publish, latency (default all).
    #[arg(long, value_delimiter = ',', value_parser = ["claims", "publish", "latency"])]
    pub parts: Option<Vec<String>>,
    /// Rows per run.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub rows: Option<u64>,
    /// Repetitions per scenario and side.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub reps: Option<u16>,
    /// Time cap per run, in seconds (fractions allowed).
    #[arg(long, value_parser = parse_seconds)]
    pub cap: Option<Duration>,
    /// Leave ruststream-sqlx out.
    #[arg(long)]
    pub no_peer: bool,
    /// Also run the strategy loop on plain tables (the engine's own statements from plain
    /// tasks: what the engine's scheduling costs, apart from its statements).
    #[arg(long)]
    pub strategy_loop: bool,
    /// Where to write results.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    pub out: PathBuf,
    /// Print only.
    #[arg(long)]
    pub no_write: bool,
    /// Your own server (or SQLite file's folder): runs the claim comparison there alone, in
    /// tables of this run's own (`sxb_bench_<pid>_..`) that it drops, and prints without
    /// writing results. Implies --db of its database, --parts claims and --no-peer unless
    /// given; see docs/performance.md.
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
}

/// FIFO group counts from the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FifoGroups(pub Vec<usize>);

/// The servers' URLs as the bench binaries other than the runner take them (`--pg-url`,
/// `--mysql-url`, or the environment the conformance suite reads); flattened into each one's
/// arguments so the flags and their defaults are written once.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerUrls {
    /// PostgreSQL.
    #[arg(
        long,
        env = "SQLX_BROKER_PG_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub pg_url: String,
    /// MariaDB or MySQL.
    #[arg(
        long,
        env = "SQLX_BROKER_MYSQL_URL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    pub mysql_url: String,
}

/// A database's name on the command line (`--db`).
pub fn parse_db(s: &str) -> Result<Db, String> {
    Db::parse(s).ok_or_else(|| format!("\"{s}\" is not one of sqlite, postgres, mariadb"))
}

/// A claim mode's name on the command line (`--mode`).
pub fn parse_claim_mode(s: &str) -> Result<ClaimMode, String> {
    parse_mode(s).ok_or_else(|| format!("\"{s}\" is not one of rowlock, lease, advisory"))
}

fn parse_groups(s: &str) -> Result<FifoGroups, String> {
    if s == "none" {
        return Ok(FifoGroups(Vec::new()));
    }
    s.split(',')
        .map(|g| {
            g.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("\"{g}\" is not a positive number of groups (or use none)"))
        })
        .collect::<Result<_, _>>()
        .map(FifoGroups)
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("\"{s}\" is not a positive number of seconds"))
}

impl From<Args> for Options {
    fn from(mut a: Args) -> Options {
        let mut filter = Filter::default();
        if let Some(url) = &a.url {
            // On a user's server: the claim comparison there alone, printed, nothing else.
            if let Some(db) = Db::of_url(url) {
                a.db.get_or_insert_with(|| vec![db]);
            }
            a.parts.get_or_insert_with(|| vec!["claims".to_owned()]);
            a.no_peer = true;
            a.no_write = true;
            // Three rounds per side, so the spread over rounds means something.
            a.reps.get_or_insert(3);
        }
        if let Some(dbs) = a.db {
            filter.dbs = dbs;
        }
        if let Some(modes) = a.mode {
            filter.modes = modes;
        }
        if let Some(w) = a.workers {
            filter.workers = w.into_iter().map(usize::from).collect();
            filter.advisory_crowd.clear();
        }
        if let Some(FifoGroups(w)) = a.advisory_crowd {
            filter.advisory_crowd = w;
        }
        if let Some(b) = a.batch {
            filter.batches = b.into_iter().map(usize::from).collect();
        }
        if let Some(FifoGroups(g)) = a.fifo_groups {
            filter.fifo_groups = g;
        }
        if let Some(w) = a.fifo_workers {
            filter.fifo_workers = usize::from(w);
        }
        filter.plain = !a.no_plain;
        let parts = match &a.parts {
            None => Parts {
                claims: true,
                publish: true,
                latency: true,
            },
            Some(names) => Parts {
                claims: names.iter().any(|n| n == "claims"),
                publish: names.iter().any(|n| n == "publish"),
                latency: names.iter().any(|n| n == "latency"),
            },
        };
        let mut profile = if a.quick {
            Profile::quick()
        } else {
            Profile::full()
        };
        if let Some(r) = a.rows {
            profile.rows = r;
        }
        if let Some(r) = a.reps {
            profile.reps = usize::from(r);
        }
        if let Some(c) = a.cap {
            profile.cap = c;
        }
        let filtered = filter != Filter::default() || a.parts.is_some();
        Options {
            profile,
            filter,
            filtered,
            parts,
            peer: !a.no_peer,
            strategy_loop: a.strategy_loop,
            out: (!a.no_write).then_some(a.out),
            url: a.url,
        }
    }
}

impl Options {
    /// Parses the arguments after the program name (clap's errors and help as `Err`).
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Options, clap::Error> {
        let args = std::iter::once("benches".to_owned()).chain(args);
        Ok(Args::try_parse_from(args)?.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::parse(args.iter().map(|s| (*s).to_owned()))
    }

    #[test]
    fn filters_narrow_the_matrix_and_mark_the_run_partial() {
        let o = parse(&["--quick", "--db", "sqlite", "--mode=lease"]).unwrap();
        assert_eq!(o.profile.name, "quick");
        assert!(o.filtered);
        let all = o.filter.scenarios();
        assert!(
            all.iter()
                .all(|s| s.db == Db::Sqlite && s.mode == ClaimMode::Lease)
        );
        assert_eq!(all.len(), 6 + 2);
        assert!(!parse(&[]).unwrap().filtered);
    }

    #[test]
    fn a_url_runs_the_claim_comparison_on_that_server_alone() {
        let o = parse(&["--quick", "--url", "postgres://app@db.example.com/app"]).unwrap();
        assert_eq!(o.filter.used_dbs(), [Db::Postgres]);
        assert!(o.parts.claims && !o.parts.publish && !o.parts.latency);
        assert!(!o.peer);
        assert_eq!(o.out, None, "nothing written to benches/results");
        assert_eq!(o.profile.reps, 3, "rounds enough for a spread");
        let o = parse(&["--quick", "--url", "mysql://app@db/app", "--reps", "5"]).unwrap();
        assert_eq!(o.filter.used_dbs(), [Db::MariaDb]);
        assert_eq!(o.profile.reps, 5);
        let (urls, db) = crate::target::Urls::from_env()
            .with_url("sqlite:///srv/app/jobs.db")
            .unwrap();
        assert_eq!(db, Db::Sqlite);
        assert_eq!(urls.sqlite_dir, Some(PathBuf::from("/srv/app")));
        let err = crate::target::Urls::from_env()
            .with_url("oracle://scott:tiger@db/x")
            .unwrap_err();
        assert!(
            err.contains("postgres://") && !err.contains("tiger"),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_name_is_an_error() {
        assert!(
            parse(&["--db", "oracle"])
                .unwrap_err()
                .to_string()
                .contains("oracle")
        );
        assert!(parse(&["--bogus"]).is_err());
        assert!(parse(&["--rows"]).is_err());
        assert!(parse(&["--rows", "0"]).is_err());
    }
}

//! The bench binary's command line.

use std::path::PathBuf;
use std::time::Duration;

use crate::scenario::{Db, Filter, parse_mode};

/// The command line's help.
pub const USAGE: &str = "\
usage: cargo run -p benches --release -- [options]

Claim + ack throughput of the engine vs a raw loop over the same statements, for every mode on
every database, plus publish throughput and publish-to-handler latency. Prints a markdown table
and writes benches/results/<quick|full>.md and .svg (<profile>-partial.* when filtered).

options:
  --quick               a short run (about a minute and a half on 2 cores)
  --full                the long default run (3,000 rows, 3 repetitions, median reported;
                        about 25 minutes on 2 cores)
  --db LIST             databases: sqlite,postgres,mariadb (default: all)
  --mode LIST           claim modes: rowlock,lease,advisory (default: all)
  --workers LIST        worker counts of plain tables (default: 1,4,8)
  --batch LIST          batch sizes of plain tables (default: 1,16)
  --fifo-groups LIST    FIFO group counts, or none (default: 1,64)
  --fifo-workers N      workers of FIFO runs (default: 4)
  --no-plain            run FIFO tables only
  --parts LIST          claims,publish,latency (default: all)
  --rows N              rows per run
  --reps N              repetitions per scenario and side
  --cap SECS            time cap per run (fractions allowed)
  --out DIR             where to write results (default: benches/results)
  --no-write            print only
  -h, --help            this help

environment:
  SQLX_BROKER_PG_URL     default postgres://postgres@127.0.0.1:5432/test
  SQLX_BROKER_MYSQL_URL  default mysql://root@127.0.0.1:3306/test

A database that is selected but unreachable fails the run; leave it out with --db.";

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
            rows: 3000,
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
    /// Where to write results; `None` prints only.
    pub out: Option<PathBuf>,
    /// Print the help.
    pub help: bool,
}

fn list<T>(value: &str, what: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    value
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| parse(s).ok_or_else(|| format!("{what}: \"{s}\" is not one I know")))
        .collect()
}

fn number(s: &str) -> Option<usize> {
    s.trim().parse().ok().filter(|&n| n > 0)
}

impl Options {
    /// Parses the arguments after the program name.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Options, String> {
        let mut args = args.into_iter();
        let mut quick = false;
        let mut filter = Filter::default();
        let mut parts = Parts {
            claims: true,
            publish: true,
            latency: true,
        };
        let (mut rows, mut reps, mut cap) = (None, None, None);
        let mut out = Some(PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/results"
        )));
        let mut help = false;
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
                _ => (arg.clone(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag.as_str() {
                "--quick" => quick = true,
                "--full" => quick = false,
                "--db" => filter.dbs = list(&value()?, "--db", Db::parse)?,
                "--mode" => filter.modes = list(&value()?, "--mode", parse_mode)?,
                "--workers" => filter.workers = list(&value()?, "--workers", number)?,
                "--batch" => filter.batches = list(&value()?, "--batch", number)?,
                "--fifo-groups" => {
                    let v = value()?;
                    filter.fifo_groups = if v == "none" {
                        Vec::new()
                    } else {
                        list(&v, "--fifo-groups", number)?
                    };
                }
                "--fifo-workers" => {
                    filter.fifo_workers =
                        number(&value()?).ok_or("--fifo-workers needs a positive number")?;
                }
                "--no-plain" => filter.plain = false,
                "--parts" => {
                    let v = value()?;
                    let names = list(&v, "--parts", |s| {
                        ["claims", "publish", "latency"]
                            .contains(&s.trim())
                            .then(|| s.trim().to_owned())
                    })?;
                    parts = Parts {
                        claims: names.iter().any(|n| n == "claims"),
                        publish: names.iter().any(|n| n == "publish"),
                        latency: names.iter().any(|n| n == "latency"),
                    };
                }
                "--rows" => {
                    let n = number(&value()?).ok_or("--rows needs a positive number")?;
                    rows = Some(u64::try_from(n).map_err(|e| e.to_string())?);
                }
                "--reps" => reps = Some(number(&value()?).ok_or("--reps needs a positive number")?),
                "--cap" => {
                    let secs = value()?
                        .trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|s| s.is_finite() && *s > 0.0)
                        .ok_or("--cap needs a positive number of seconds")?;
                    cap = Some(Duration::from_secs_f64(secs));
                }
                "--out" => out = Some(PathBuf::from(value()?)),
                "--no-write" => out = None,
                "-h" | "--help" => help = true,
                other => return Err(format!("unknown option {other}")),
            }
        }
        if filter.dbs.is_empty() {
            return Err("--db selects no database".into());
        }
        let mut profile = if quick {
            Profile::quick()
        } else {
            Profile::full()
        };
        if let Some(r) = rows {
            profile.rows = r;
        }
        if let Some(r) = reps {
            profile.reps = r;
        }
        if let Some(c) = cap {
            profile.cap = c;
        }
        let all = Parts {
            claims: true,
            publish: true,
            latency: true,
        };
        let filtered = filter != Filter::default() || parts != all;
        Ok(Options {
            profile,
            filter,
            filtered,
            parts,
            out,
            help,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_core::ClaimMode;

    fn parse(args: &[&str]) -> Result<Options, String> {
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
    fn an_unknown_name_is_an_error() {
        assert!(parse(&["--db", "oracle"]).unwrap_err().contains("oracle"));
        assert!(parse(&["--bogus"]).is_err());
        assert!(parse(&["--rows"]).unwrap_err().contains("needs a value"));
    }
}

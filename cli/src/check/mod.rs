//! `sqlx-broker check`: the conformance suite against the user's own server.
//!
//! The cases are the ones the backends' tests run: [`broker_testkit::conformance_suite!`]
//! stamps them here for test databases of the check's own ([`pg::CheckPg`],
//! [`mysql::CheckMySql`], [`sqlite::CheckSqlite`]) and enters each in
//! [`broker_testkit::registry`], which this runner reads. Outside a test build no `#[test]` is
//! stamped, so the binary holds the cases and nothing else of the test harness.
//!
//! Before any case runs, the check makes a scratch place of its own (a schema on PostgreSQL, a
//! database on MariaDB/MySQL, a folder of files beside the SQLite file; where the user may not
//! make one, tables of this run's own names next to theirs) or refuses, saying what to grant.
//! The cases run one at a time, each under the suite's time limit; the scratch place is dropped
//! at the end, after a failed or panicking case too, and on Ctrl-C. The disruptive tests
//! (server restarts, settings changes) are not in the suite and never run here.

mod mysql;
mod pg;
mod sqlite;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use broker_testkit::registry::{Case, CaseFailed, cases_of};

/// The suite, stamped once per database for the check (see the module docs).
#[cfg(not(test))]
mod suites {
    pub(crate) mod pg {
        broker_testkit::conformance_suite!(crate::check::pg::CheckPg);
    }
    pub(crate) mod mysql {
        broker_testkit::conformance_suite!(crate::check::mysql::CheckMySql);
    }
    pub(crate) mod sqlite {
        broker_testkit::conformance_suite!(crate::check::sqlite::CheckSqlite; modes: [lease, advisory]; server_connections: no);
    }
}

/// The flags of `check`.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckArgs {
    /// Leave out the long cases (stress runs with killed workers, killed connections, schedules
    /// of many brokers), which take most of the time.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Run only the cases whose test path contains this text (repeat the flag for more).
    #[arg(long = "case", value_name = "TEXT")]
    pub(crate) cases: Vec<String>,
    /// List the cases that would run, and run nothing.
    #[arg(long)]
    pub(crate) list: bool,
    /// Keep the scratch schema, database or folder at the end (to look at what a failed case
    /// left); the report says how to drop it. Ctrl-C still drops it.
    #[arg(long)]
    pub(crate) keep: bool,
}

/// The broker's own tables that every queue of a database shares: the pause table, the cancel
/// requests and the schedules' tables (broker-core's `SCHEDULES_TABLE` and `TICKS_TABLE`, which
/// it does not export).
pub(crate) const SHARED_TABLES: [&str; 4] = [
    broker_core::driver::CONTROL_TABLE,
    broker_core::driver::CANCEL_TABLE,
    "sqlx_broker_schedules",
    "sqlx_broker_ticks",
];

/// Where a run works.
#[derive(Debug, Clone)]
pub(crate) enum Place {
    /// A schema of its own on PostgreSQL.
    PgSchema(String),
    /// Tables of this run's names in the role's current schema, those of its names that were
    /// there before it started left alone.
    PgPrefix { schema: String, before: Vec<String> },
    /// A database of its own on MariaDB/MySQL.
    MyDatabase(String),
    /// Tables of this run's names in the URL's database.
    MyPrefix {
        database: String,
        before: Vec<String>,
    },
    /// A folder of its own beside the SQLite file.
    SqliteFolder(PathBuf),
}

/// The run's scratch place, and how to reach it.
#[derive(Debug, Clone)]
pub(crate) struct Scratch {
    /// The server, its version and the user, as the report names them.
    pub(crate) server: String,
    /// The URL the cases connect to (the scratch place's).
    pub(crate) url: String,
    /// The user's URL, for setting up and cleaning.
    pub(crate) admin_url: String,
    pub(crate) place: Place,
}

impl Scratch {
    fn describe(&self) -> String {
        match &self.place {
            Place::PgSchema(s) => format!("schema {s} (created for this run, dropped at the end)"),
            Place::PgPrefix { schema, .. } => format!(
                "tables named sb_..._{}_.. in schema {schema} (no right to create a schema; each dropped at the end)",
                std::process::id()
            ),
            Place::MyDatabase(d) => {
                format!("database {d} (created for this run, dropped at the end)")
            }
            Place::MyPrefix { database, .. } => format!(
                "tables named sb_..._{}_.. in database {database} (no right to create a database; each dropped at the end)",
                std::process::id()
            ),
            Place::SqliteFolder(d) => format!(
                "folder {} (a database file per case, removed at the end)",
                d.display()
            ),
        }
    }

    /// Drops what the run made; says what it dropped.
    fn clean(&self) -> Result<String, String> {
        if let Place::SqliteFolder(_) = self.place {
            return sqlite::clean(self);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async {
            match self.place {
                Place::PgSchema(_) | Place::PgPrefix { .. } => pg::clean(self).await,
                _ => mysql::clean(self).await,
            }
        })
    }
}

static SCRATCH_URL: OnceLock<String> = OnceLock::new();

/// The URL the cases' test databases connect to.
pub(crate) fn scratch_url() -> String {
    SCRATCH_URL
        .get()
        .cloned()
        .expect("the scratch place is made before any case runs")
}

/// The name of this run's scratch schema, database or folder: `sqlx_broker_check_<pid>_<time>`.
pub(crate) fn scratch_name() -> String {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        format!("sqlx_broker_check_{}_{secs:x}", std::process::id())
    })
    .clone()
}

/// A `LIKE` pattern for the names the cases of this process give their tables
/// (`broker_testkit::unique_name`: `sb_<what>_<pid>_..`).
pub(crate) fn own_pattern() -> String {
    format!("sb\\_%\\_{}\\_%", std::process::id())
}

/// `name` in double quotes, as PostgreSQL and SQLite quote identifiers.
pub(crate) fn quote_double(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Which backend a URL is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Pg,
    MySql,
    Sqlite,
}

impl Kind {
    fn of(url: &str) -> Option<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Self::Pg)
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            Some(Self::MySql)
        } else if url.starts_with("sqlite:") {
            Some(Self::Sqlite)
        } else {
            None
        }
    }

    fn cases(self) -> Vec<&'static Case> {
        match self {
            Self::Pg => cases_of::<pg::CheckPg>(),
            Self::MySql => cases_of::<mysql::CheckMySql>(),
            Self::Sqlite => cases_of::<sqlite::CheckSqlite>(),
        }
    }

    fn modes(self) -> &'static [&'static str] {
        match self {
            Self::Sqlite => &["lease", "advisory"],
            _ => &["row_lock", "lease", "advisory"],
        }
    }
}

/// In a child process a case started (the kill and schedule cases re-run this program with
/// the case's path and a variable set): runs that case, which plays the child's part, and
/// returns its exit status. `None` when this process is not such a child.
pub(crate) fn run_child() -> Option<ExitCode> {
    let is_child = [
        broker_testkit::cases::CHILD_ENV,
        broker_testkit::cases::PERIODIC_CHILD_ENV,
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some());
    if !is_child {
        return None;
    }
    let wanted = std::env::args().nth(1)?;
    let case = [Kind::Pg, Kind::MySql, Kind::Sqlite]
        .into_iter()
        .flat_map(Kind::cases)
        .find(|c| c.path.split_once("::").map(|(_, rest)| rest) == Some(wanted.as_str()))?;
    Some(match case.run_to_end() {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    })
}

/// One case's verdict.
#[derive(Debug, serde::Serialize)]
struct Verdict {
    path: &'static str,
    name: &'static str,
    group: &'static str,
    mode: Option<&'static str>,
    /// "held", "not held" or "not run".
    verdict: &'static str,
    seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "the case panicked".to_owned())
}

/// A readable name for a group of cases (the file of `cases/` they are in).
fn group_title(group: &str) -> String {
    let title = match group {
        "admin" => "operations: stats, cancel, run now, pause, listing",
        "attempts" => "attempt counting",
        "backlog" => "claims past a large backlog",
        "bad_input" => "awkward names and values",
        "concurrency" => "concurrent workers and brokers",
        "ddl" => "the DDL helper",
        "description" => "table descriptions and modes",
        "faults" => "killed workers and connections",
        "fencing" => "fencing of stale deliveries",
        "fifo" => "FIFO groups",
        "first_hour" => "first-hour errors and health",
        "hardening" => "bad input and failing statements",
        "head" => "claims from the table's head",
        "held" => "what a broker holds and gives back",
        "last_error" => "last_error reads",
        "lifecycle" => "shutdown, close, wake-ups",
        "literals" => "string literals in statements",
        "outage" => "a server that goes away",
        "periodic" => "periodic schedules",
        "restart" => "settlements across killed connections",
        "row_type" => "row types against columns",
        "settle" => "outcomes: ack, retry, dead letters",
        "stress" => "stress with random outcomes and kills",
        "unique" => "unique jobs",
        other => return other.replace('_', " "),
    };
    title.to_owned()
}

/// The message a failed case left, cut to its first lines.
fn short(message: &str) -> String {
    let lines: Vec<&str> = message.lines().take(3).collect();
    let mut s = lines.join(" / ");
    if s.chars().count() > 400 {
        s = s.chars().take(400).collect::<String>() + "..";
    }
    s
}

/// Silences panic messages while the cases run (some cases make handlers panic on purpose); a
/// case's own failure is reported from its panic's payload.
fn quiet_panics() {
    static ONCE: Mutex<bool> = Mutex::new(false);
    let mut done = ONCE.lock().unwrap();
    if !*done {
        std::panic::set_hook(Box::new(|_| {}));
        *done = true;
    }
}

/// Drops the scratch place once, whoever asks first: the end of the run, a Ctrl-C, or a panic
/// in the runner.
struct Cleaner {
    scratch: Scratch,
    done: Mutex<Option<Result<String, String>>>,
}

impl Cleaner {
    fn clean(&self) -> Result<String, String> {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        if done.is_none() {
            *done = Some(self.scratch.clean());
        }
        done.clone().expect("set above")
    }
}

/// Runs `check` for `url`: prepares, runs the cases, cleans up, prints the report.
pub(crate) fn run(url: &str, args: &CheckArgs, json: bool) -> Result<ExitCode, String> {
    let shown = broker_core::redact_passwords(url);
    let kind = Kind::of(url).ok_or_else(|| {
        format!("{shown}: the URL must start with postgres://, mysql:// or sqlite:")
    })?;
    let selected: Vec<&'static Case> = kind
        .cases()
        .into_iter()
        .filter(|c| !(args.quick && c.is_long()))
        .filter(|c| args.cases.is_empty() || args.cases.iter().any(|t| c.path.contains(t.as_str())))
        .collect();
    if args.list {
        for c in &selected {
            println!("{}", display_path(c));
        }
        return Ok(ExitCode::SUCCESS);
    }
    if selected.is_empty() {
        return Err("no case matches the --case filters".to_owned());
    }
    // Rights first, before any case: a refusal changes nothing.
    let scratch = match kind {
        Kind::Sqlite => sqlite::prepare(url)?,
        _ => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                match kind {
                    Kind::Pg => pg::prepare(url).await,
                    _ => mysql::prepare(url).await,
                }
            })
            .map_err(|e| format!("{shown}: {e}"))?
        }
    };
    let _ = SCRATCH_URL.set(scratch.url.clone());
    let cleaner: &'static Cleaner = Box::leak(Box::new(Cleaner {
        scratch,
        done: Mutex::new(None),
    }));
    // Ctrl-C: drop the scratch place and leave.
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        if rt.block_on(tokio::signal::ctrl_c()).is_ok() {
            eprintln!("\ninterrupted: cleaning up");
            match cleaner.clean() {
                Ok(done) => eprintln!("{done}"),
                Err(e) => eprintln!("error: cleaning up: {e}"),
            }
            std::process::exit(130);
        }
    });
    eprintln!(
        "sqlx-broker check: {} cases on {}\n  in {}",
        selected.len(),
        cleaner.scratch.server,
        cleaner.scratch.describe()
    );
    quiet_panics();
    let started = Instant::now();
    let verdicts = std::panic::catch_unwind(|| run_cases(&selected));
    let cleaned = if args.keep {
        Err(format!(
            "kept as asked (--keep): {}",
            cleaner.scratch.describe()
        ))
    } else {
        cleaner.clean()
    };
    let verdicts = match verdicts {
        Ok(v) => v,
        Err(p) => return Err(format!("the check stopped: {}", panic_text(&*p))),
    };
    let report = Report {
        server: cleaner.scratch.server.clone(),
        scratch: cleaner.scratch.describe(),
        cleaned: cleaned.clone(),
        quick: args.quick,
        seconds: started.elapsed().as_secs_f64(),
        modes: kind.modes(),
        verdicts,
    };
    if json {
        println!("{}", report.json());
    } else {
        print!("{}", report.table());
    }
    let all_held = report.verdicts.iter().all(|v| v.verdict == "held");
    Ok(if all_held && cleaned.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A case's path as the user sees it: from its mode or group module on.
fn display_path(c: &Case) -> String {
    let parts: Vec<&str> = c.path.split("::").collect();
    // sqlx_broker::check::suites::<db>::<rest>
    parts
        .get(4..)
        .map_or_else(|| c.path.to_owned(), |rest| rest.join("::"))
}

fn run_cases(cases: &[&'static Case]) -> Vec<Verdict> {
    let total = cases.len();
    let mut out = Vec::with_capacity(total);
    for (i, case) in cases.iter().enumerate() {
        let start = Instant::now();
        let result = case.run_to_end();
        let seconds = start.elapsed().as_secs_f64();
        let (verdict, message) = match result {
            Ok(()) => ("held", None),
            Err(CaseFailed::Panicked(p)) => ("not held", Some(panic_text(&*p))),
            Err(CaseFailed::Other(m)) => ("not held", Some(m)),
        };
        eprintln!(
            "[{:>3}/{total}] {:<8} {} ({seconds:.1} s)",
            i + 1,
            if verdict == "held" {
                "held"
            } else {
                "NOT HELD"
            },
            display_path(case)
        );
        out.push(Verdict {
            path: case.path,
            name: case.name(),
            group: (case.group)(),
            mode: case.mode(),
            verdict,
            seconds,
            message: message.map(|m| short(&m)),
        });
        // Pools close in tasks of their own; give the server a moment between cases.
        std::thread::sleep(Duration::from_millis(50));
    }
    out
}

struct Report {
    server: String,
    scratch: String,
    cleaned: Result<String, String>,
    quick: bool,
    seconds: f64,
    modes: &'static [&'static str],
    verdicts: Vec<Verdict>,
}

fn mode_title(mode: &str) -> &'static str {
    match mode {
        "row_lock" => "row lock",
        "lease" => "lease",
        "advisory" => "advisory lock",
        _ => "about no one mode",
    }
}

impl Report {
    /// (held, run) per group and per mode column ("" for cases of no one mode).
    fn cells(&self) -> BTreeMap<&'static str, BTreeMap<&'static str, (usize, usize)>> {
        let mut cells: BTreeMap<&str, BTreeMap<&str, (usize, usize)>> = BTreeMap::new();
        for v in &self.verdicts {
            let cell = cells
                .entry(v.group)
                .or_default()
                .entry(v.mode.unwrap_or(""))
                .or_default();
            cell.1 += 1;
            if v.verdict == "held" {
                cell.0 += 1;
            }
        }
        cells
    }

    fn columns(&self) -> Vec<&'static str> {
        let mut cols: Vec<&'static str> = self.modes.to_vec();
        cols.push("");
        cols
    }

    fn table(&self) -> String {
        use std::fmt::Write as _;
        let cells = self.cells();
        let cols = self.columns();
        let mut rows: Vec<Vec<String>> = Vec::new();
        let mut header = vec!["guarantee".to_owned()];
        header.extend(cols.iter().map(|m| mode_title(m).to_owned()));
        rows.push(header);
        let mut totals: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for (group, by_mode) in &cells {
            let mut row = vec![group_title(group)];
            for m in &cols {
                row.push(match by_mode.get(m) {
                    Some(&(held, run)) => {
                        let t = totals.entry(m).or_default();
                        t.0 += held;
                        t.1 += run;
                        verdict_cell(held, run)
                    }
                    None => "-".to_owned(),
                });
            }
            rows.push(row);
        }
        let mut all = vec!["every case".to_owned()];
        all.extend(cols.iter().map(|m| match totals.get(m) {
            Some(&(h, r)) => verdict_cell(h, r),
            None => "-".to_owned(),
        }));
        rows.push(all);
        let widths: Vec<usize> = (0..rows[0].len())
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        let mut out = String::new();
        let _ = writeln!(out, "\nsqlx-broker check on {}", self.server);
        let _ = writeln!(out, "in {}", self.scratch);
        for (i, row) in rows.iter().enumerate() {
            let cells: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(s, w)| format!("{s:<w$}"))
                .collect();
            let _ = writeln!(out, "| {} |", cells.join(" | "));
            if i == 0 {
                let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
                let _ = writeln!(out, "|-{}-|", rule.join("-|-"));
            }
        }
        let failed: Vec<&Verdict> = self
            .verdicts
            .iter()
            .filter(|v| v.verdict != "held")
            .collect();
        let held = self.verdicts.len() - failed.len();
        let _ = writeln!(
            out,
            "\n{held} of {} cases held{} in {:.0} s.",
            self.verdicts.len(),
            if self.quick {
                " (--quick: the long cases were left out)"
            } else {
                ""
            },
            self.seconds
        );
        if !failed.is_empty() {
            let _ = writeln!(out, "\nNot held on this server:");
            for v in failed {
                let _ = writeln!(
                    out,
                    "  {} ({}, {}):\n    {}",
                    v.name,
                    mode_title(v.mode.unwrap_or("")),
                    group_title(v.group),
                    crate::output::terminal_text(v.message.as_deref().unwrap_or(""))
                );
            }
        }
        match &self.cleaned {
            Ok(done) => {
                let _ = writeln!(out, "\nCleaned up: {done}.");
            }
            Err(e) => {
                let _ = writeln!(out, "\nNOT CLEANED UP: {e}; drop it by hand.");
            }
        }
        out
    }

    fn json(&self) -> String {
        let cells = self.cells();
        let groups: Vec<serde_json::Value> = cells
            .iter()
            .map(|(group, by_mode)| {
                let modes: serde_json::Map<String, serde_json::Value> = by_mode
                    .iter()
                    .map(|(m, (held, run))| {
                        (
                            if m.is_empty() { "none" } else { m }.to_owned(),
                            serde_json::json!({ "held": held == run, "cases": run, "cases_held": held }),
                        )
                    })
                    .collect();
                serde_json::json!({ "group": group, "title": group_title(group), "modes": modes })
            })
            .collect();
        let value = serde_json::json!({
            "server": self.server,
            "scratch": self.scratch,
            "cleaned_up": self.cleaned.is_ok(),
            "clean_up": match &self.cleaned { Ok(s) | Err(s) => s },
            "quick": self.quick,
            "seconds": self.seconds,
            "held": self.verdicts.iter().all(|v| v.verdict == "held"),
            "groups": groups,
            "cases": self.verdicts,
        });
        crate::output::json_safe(value.to_string())
    }
}

fn verdict_cell(held: usize, run: usize) -> String {
    if held == run {
        format!("held ({run})")
    } else {
        format!("NOT HELD ({} of {run} failed)", run - held)
    }
}

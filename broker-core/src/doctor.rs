//! The doctor: checks a deployment (server, pooler, settings, clock, table, pool) against what a
//! table's claim mode needs, and says for each check what was found and what to change.
//!
//! [`Broker::doctor`](crate::Broker::doctor) runs the backend's checks (each backend knows its
//! server's settings) and the ones every backend shares (the mode is offered, the table prepares,
//! the pool serves the planned concurrency, the host's clock agrees with the database's).

use std::fmt;
use std::time::Duration;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Status {
    /// Nothing to change.
    Pass,
    /// Works, but slower or less safe than it could be; the fix says how.
    Warn,
    /// The table's mode will not work as documented here; the fix says what to change.
    Fail,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        })
    }
}

/// One check: what it looked at, what it found, and what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Check {
    /// What was checked (e.g. "server version", "pooler").
    pub name: String,
    /// How it came out.
    pub status: Status,
    /// What was found.
    pub found: String,
    /// What to change (empty when nothing needs to).
    pub fix: String,
}

impl Check {
    /// A passing check.
    pub fn pass(name: impl Into<String>, found: impl Into<String>) -> Self {
        Self::new(name, Status::Pass, found, "")
    }

    /// A warning, with what to change.
    pub fn warn(name: impl Into<String>, found: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::new(name, Status::Warn, found, fix)
    }

    /// A failure, with what to change.
    pub fn fail(name: impl Into<String>, found: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::new(name, Status::Fail, found, fix)
    }

    /// A check from its parts.
    pub fn new(
        name: impl Into<String>,
        status: Status,
        found: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            status,
            found: found.into(),
            fix: fix.into(),
        }
    }
}

/// What the deployment plans to run, so the doctor can check the pool and the lease against it.
#[derive(Debug, Clone)]
#[must_use]
pub struct DoctorOptions {
    pub(crate) concurrency: usize,
    pub(crate) subscriptions: usize,
    pub(crate) kinds: Option<Vec<String>>,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        Self {
            concurrency: 1,
            subscriptions: 1,
            kinds: None,
        }
    }
}

impl DoctorOptions {
    /// One subscription with a concurrency of 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// The concurrency each subscription of the table runs with.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// How many subscriptions of the table share this broker's pool.
    pub fn subscriptions(mut self, n: usize) -> Self {
        self.subscriptions = n;
        self
    }

    /// The kinds this deployment's workers know, together (on a table with a
    /// [kind column](crate::TableBuilder::kind)): the doctor warns naming each kind with
    /// unfinished rows that none of them knows, since no subscription ever claims those rows.
    /// Without it the doctor lists the kinds it finds.
    pub fn kinds<I, S>(mut self, kinds: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.kinds = Some(kinds.into_iter().map(Into::into).collect());
        self
    }

    /// The kinds given to [`kinds`](Self::kinds), if any.
    pub fn known_kinds(&self) -> Option<&[String]> {
        self.kinds.as_deref()
    }
}

/// The name of the doctor's check of a kinds table's kinds ([`kinds_check`]).
pub const KINDS_CHECK: &str = "job kinds";

/// The doctor's check of the kinds in a table with a kind column, from its counts by kind:
/// with the kinds the workers know (`known`), a warning naming each kind with unfinished rows
/// that none of them knows and how many rows (no claim takes them: they wait for a worker of
/// their kind), a pass otherwise; without `known`, a pass listing the kinds found.
pub fn kinds_check(kinds: &[crate::admin::KindStats], known: Option<&[String]>) -> Check {
    let name = |k: &crate::admin::KindStats| {
        k.kind
            .as_ref()
            // Quoted with its escapes: a kind comes from rows, which any software may write.
            .map_or_else(|| "(no kind)".to_owned(), |k| format!("{k:?}"))
    };
    let unfinished = |k: &crate::admin::KindStats| {
        let n = k.unfinished();
        let exact = k.due.exact && k.scheduled.exact && k.in_work.exact;
        if exact {
            n.to_string()
        } else {
            format!("~{n}")
        }
    };
    let Some(known) = known else {
        let found: Vec<String> = kinds
            .iter()
            .map(|k| format!("{} ({} unfinished)", name(k), unfinished(k)))
            .collect();
        return Check::pass(
            KINDS_CHECK,
            if found.is_empty() {
                "no rows of any kind".to_owned()
            } else {
                format!("kinds in the table: {}", found.join(", "))
            },
        );
    };
    let unknown: Vec<String> = kinds
        .iter()
        .filter(|k| k.unfinished() > 0)
        .filter(|k| !k.kind.as_ref().is_some_and(|k| known.contains(k)))
        .map(|k| format!("{} ({} unfinished rows)", name(k), unfinished(k)))
        .collect();
    if unknown.is_empty() {
        Check::pass(
            KINDS_CHECK,
            format!(
                "every kind with unfinished rows is one the workers know ({})",
                known.join(", ")
            ),
        )
    } else {
        Check::warn(
            KINDS_CHECK,
            format!(
                "no worker knows {}: no subscription claims these rows, so they wait",
                unknown.join(", ")
            ),
            "register a worker for each of these kinds (Workers::register) in a running process, or cancel the rows; if they are known, list them in the doctor's kinds",
        )
    }
}

/// Everything the doctor found, in the order it checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DoctorReport {
    /// The checks.
    pub checks: Vec<Check>,
}

impl DoctorReport {
    /// The worst status of any check ([`Status::Pass`] for no checks).
    pub fn worst(&self) -> Status {
        self.checks
            .iter()
            .map(|c| c.status)
            .max()
            .unwrap_or(Status::Pass)
    }

    /// The check named `name`, if it ran.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

impl fmt::Display for DoctorReport {
    /// One line per check (`[pass] name: found`), with the fix on the next line where there is
    /// one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.checks {
            writeln!(f, "[{}] {}: {}", c.status, c.name, c.found)?;
            if !c.fix.is_empty() {
                writeln!(f, "       fix: {}", c.fix)?;
            }
        }
        Ok(())
    }
}

/// The clock check every server backend shares: the database's clock read between two host
/// readings, compared with their midpoint (the round trip bounds the error).
///
/// A lease table compares expiries that hosts compute from their own clocks, so two hosts whose
/// clocks differ by more than a lease can both hold one row: the doctor measures this host
/// against the database's clock, which stands in for the other hosts'.
pub fn clock_check(
    host_before_ms: i64,
    db_ms: i64,
    host_after_ms: i64,
    lease_seconds: Option<u32>,
) -> Check {
    let name = "clock";
    let midpoint = host_before_ms + (host_after_ms - host_before_ms) / 2;
    let skew = db_ms - midpoint;
    let round_trip = host_after_ms - host_before_ms;
    let found = format!(
        "the database's clock is {} ms {} this host's (round trip {round_trip} ms)",
        skew.abs(),
        if skew >= 0 { "ahead of" } else { "behind" }
    );
    let fix = "synchronise the hosts' clocks with the database's (NTP, chrony)";
    match lease_seconds {
        Some(lease) if skew.unsigned_abs() >= u64::from(lease) * 500 => Check::fail(
            name,
            format!(
                "{found}; that is half the {lease} s lease or more, so two hosts can hold one row at once"
            ),
            fix,
        ),
        _ if skew.unsigned_abs() > 1000 => Check::warn(
            name,
            format!("{found}; due times and leases use the host's clock"),
            fix,
        ),
        _ => Check::pass(name, found),
    }
}

/// The pool check every backend shares. In row lock and advisory modes each delivery in work
/// holds a pool connection, and the engine keeps every subscription's concurrency within three
/// quarters of the pool (the rest serves claims, settlements and publishes), so the pool needs
/// a third more connections than the deliveries in work. In lease mode claims hold a
/// connection briefly. Wake-ups from other processes use no pool connection (PostgreSQL listens
/// on one connection of its own per backend).
pub fn pool_check(
    max_connections: u32,
    holds_connection_per_delivery: bool,
    options: &DoctorOptions,
) -> Check {
    let name = "pool size";
    let subs = options.subscriptions.max(1);
    let needed = if holds_connection_per_delivery {
        (subs * options.concurrency * 4).div_ceil(3)
    } else {
        subs * (options.concurrency.div_ceil(16).max(1) + 1)
    };
    let needed = u32::try_from(needed).unwrap_or(u32::MAX);
    let found = format!(
        "{max_connections} connections for {subs} subscription(s) at concurrency {}",
        options.concurrency
    );
    if max_connections >= needed {
        Check::pass(name, found)
    } else if holds_connection_per_delivery {
        Check::fail(
            name,
            format!(
                "{found}; this mode holds a connection per delivery in work, and needs about {needed}"
            ),
            format!("raise max_connections to {needed} or more, or lower the concurrency"),
        )
    } else {
        Check::warn(
            name,
            format!(
                "{found}; claims, settlements and publishes wait for connections beyond about {needed}"
            ),
            format!("raise max_connections to {needed}"),
        )
    }
}

/// How long a check that waits for the server (a notification, say) waits at most.
pub const WAIT: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kinds_check_names_kinds_no_worker_knows() {
        let mut a = crate::admin::KindStats::new(Some("a".into()));
        a.due = crate::Count::exact(2);
        let mut b = crate::admin::KindStats::new(Some("b".into()));
        b.scheduled = crate::Count::exact(3);
        let mut gone = crate::admin::KindStats::new(Some("gone".into()));
        gone.dead = Some(crate::Count::exact(4));
        let kinds = [a, b, gone];
        let known = ["a".to_owned()];
        let c = kinds_check(&kinds, Some(&known));
        assert_eq!(c.status, Status::Warn);
        assert!(c.found.contains("\"b\" (3 unfinished rows)"), "{}", c.found);
        // Dead letters alone are no rows waiting for a worker.
        assert!(!c.found.contains("gone"), "{}", c.found);
        let both = ["a".to_owned(), "b".to_owned()];
        assert_eq!(kinds_check(&kinds, Some(&both)).status, Status::Pass);
        let listed = kinds_check(&kinds, None);
        assert_eq!(listed.status, Status::Pass);
        assert!(
            listed.found.contains("\"gone\" (0 unfinished)"),
            "{}",
            listed.found
        );
    }

    #[test]
    fn a_clock_half_a_lease_off_fails_and_a_second_off_warns() {
        let lease = Some(30);
        assert_eq!(clock_check(1_000, 1_005, 1_010, lease).status, Status::Pass);
        assert_eq!(clock_check(1_000, 3_005, 1_010, lease).status, Status::Warn);
        let off = clock_check(100_000, 85_005, 100_010, lease);
        assert_eq!(off.status, Status::Fail);
        assert!(off.found.contains("behind"), "{}", off.found);
        assert_eq!(
            clock_check(100_000, 85_005, 100_010, None).status,
            Status::Warn
        );
    }

    #[test]
    fn a_pool_smaller_than_the_held_connections_fails() {
        let opts = DoctorOptions::new().concurrency(16);
        // The engine runs at most three quarters of the pool: 16 workers need 22 connections.
        assert_eq!(pool_check(18, true, &opts).status, Status::Fail);
        assert_eq!(pool_check(22, true, &opts).status, Status::Pass);
        assert_eq!(pool_check(4, false, &opts).status, Status::Pass);
        assert_eq!(pool_check(1, false, &opts).status, Status::Warn);
    }

    #[test]
    fn the_report_prints_each_fix_under_its_check() {
        let report = DoctorReport {
            checks: vec![
                Check::pass("server version", "PostgreSQL 15.2"),
                Check::fail("pooler", "transaction mode", "connect directly"),
            ],
        };
        assert_eq!(report.worst(), Status::Fail);
        let text = report.to_string();
        assert!(
            text.contains("[pass] server version: PostgreSQL 15.2"),
            "{text}"
        );
        assert!(
            text.contains("[FAIL] pooler: transaction mode\n       fix: connect directly"),
            "{text}"
        );
    }
}

/// What a backend found of the unique key index of a table (see [`unique_index_check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UniqueIndex {
    /// A unique index over the key alone, limited to unfinished rows where the table has
    /// columns that finish a row.
    Found,
    /// A unique index over the key that also covers finished rows: a finished row keeps its key.
    CoversFinishedRows(String),
    /// No unique index over the key.
    Missing,
}

/// The doctor's check of a table's unique key index, from what the backend `found` (or why it
/// could not read it) and the statement that makes the index; `None` for a table without a
/// unique key column.
pub fn unique_index_check(
    table: &crate::TableDescription,
    found: std::result::Result<UniqueIndex, String>,
    fix: &str,
) -> Option<Check> {
    let column = table.unique_key()?;
    const NAME: &str = "unique key index";
    Some(match found {
        Ok(UniqueIndex::Found) => Check::pass(
            NAME,
            format!("a unique index over \"{column}\" of the unfinished rows"),
        ),
        Ok(UniqueIndex::CoversFinishedRows(index)) => Check::fail(
            NAME,
            format!(
                "index \"{index}\" covers finished rows too, so a finished row keeps its key and a new job with it is taken for a duplicate"
            ),
            format!("replace it with: {fix}"),
        ),
        Ok(UniqueIndex::Missing) => Check::fail(
            NAME,
            format!("no unique index over \"{column}\": jobs with one key would each insert a row"),
            format!("create it: {fix}"),
        ),
        Err(e) => Check::warn(
            NAME,
            format!("cannot read the indexes: {e}"),
            "check it by hand",
        ),
    })
}

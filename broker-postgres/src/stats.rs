//! Table statistics that a burst left behind. The planner estimates how many rows a table holds
//! from `pg_class.reltuples`, which a vacuum or an analyze sets to the live rows it counted. A
//! queue that an autovacuum finds nearly drained (a few rows in work) records a handful, and
//! when a burst then fills the table the planner still believes it holds a handful of rows,
//! until the next analyze (up to `autovacuum_naptime`, a minute by default). On those numbers
//! reading the claim index until a claim's rows are found looks dearer than reading the whole
//! table and sorting it, and every claim does the latter: 40-48 ms a claim on 93,000 rows in the
//! steady bench, against well under a millisecond. No claim statement can avoid it: the plan
//! follows the estimate whatever the statement's shape.
//!
//! So when a claim that found rows took [`SLOW`] or longer, the backend compares (at most once
//! every [`INTERVAL_MS`]) the table's recorded row count with the live rows its statistics count
//! since (`pg_stat_user_tables.n_live_tup`, kept from every insert and delete as sessions report
//! them, within a second or so), and analyzes the table when the recorded count is under a
//! tenth of the live one (and the table holds at least [`MIN_LIVE`] rows). The check is one
//! catalog read; the analyze samples the table, skips it when another vacuum or analyze holds it
//! (PostgreSQL 12 and newer), and corrects the estimate for every statement. Only slow claims
//! lead to a check: at thousands of rows a second the live count runs seconds behind the
//! deletes, a few thousand rows above the true backlog, and checks after every claim analyzed
//! a table whose plans were fine every few seconds (and each such analyze of a nearly drained
//! table records a handful of rows again). A role that may not analyze the table (neither its
//! owner's nor the database owner's member) is noticed at the first check, which then logs once
//! and stops checking.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use broker_core::driver::clock;
use sqlx::{PgPool, Row};

use crate::sql::ident;
use crate::version;

/// How often at most a queue's statistics are checked, in milliseconds.
pub(crate) const INTERVAL_MS: i64 = 1_000;

/// A claim that took this long or longer leads to a check. Claims that read the index take
/// about a millisecond; one that reads and sorts 20,000 rows takes 5-8 ms on this machine.
pub(crate) const SLOW: Duration = Duration::from_millis(5);

/// Below this many live rows the planner's choice costs too little to matter (reading and
/// sorting 10,000 rows takes 2-3 ms), and the live count's lag behind a busy queue's deletes
/// stays under it up to a few thousand rows a second.
pub(crate) const MIN_LIVE: i64 = 10_000;

/// The recorded row count, the live rows, and whether this role may analyze the table whose
/// quoted name is the string literal `table`. Sent in the simple protocol (one message, no
/// statement to prepare), which passes through a transaction-mode pooler.
pub(crate) fn check_sql(table: &str) -> String {
    format!(
        "SELECT c.reltuples::float8, COALESCE(s.n_live_tup, 0)::int8, \
         pg_has_role(c.relowner, 'USAGE') OR pg_has_role((SELECT d.datdba FROM pg_database AS d \
         WHERE d.datname = current_database()), 'USAGE') \
         FROM pg_class AS c LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid \
         WHERE c.oid = to_regclass({table})"
    )
}

/// The statistics watch of one queue table (see the module docs).
#[derive(Debug)]
pub(crate) struct StatsWatch {
    pool: PgPool,
    /// The table, quoted.
    table: String,
    /// Whether `ANALYZE` takes `SKIP_LOCKED` (PostgreSQL 12).
    skip_locked: bool,
    /// When the next check may run, unix ms.
    next_ms: AtomicI64,
    /// Set for good when the check finds this role may not analyze the table, or the watch
    /// was switched off.
    off: AtomicBool,
}

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Checked {
    /// The statistics hold: nothing was done.
    Current,
    /// The table was analyzed.
    Analyzed,
    /// This role may not analyze the table; the watch is off.
    NotAllowed,
}

/// Whether statistics recording `recorded` rows of a table whose live rows are `live` are stale
/// enough to analyze. A table never analyzed or vacuumed (`reltuples` of -1) is estimated from
/// its size instead, so it is left alone.
pub(crate) fn stale(recorded: f64, live: i64) -> bool {
    live >= MIN_LIVE && recorded >= 0.0 && recorded * 10.0 < live as f64
}

impl StatsWatch {
    pub(crate) fn new(pool: PgPool, table: &str, server_version: u32) -> Self {
        Self {
            pool,
            table: ident(table),
            skip_locked: server_version >= version::CHAIN,
            next_ms: AtomicI64::new(0),
            off: AtomicBool::new(false),
        }
    }

    /// A watch that never checks.
    pub(crate) fn switched_off(self) -> Self {
        self.off.store(true, Ordering::Relaxed);
        self
    }

    /// Called after a claim that found `rows` rows in `took`: when the claim was slow, runs a
    /// check in a task of its own (at most one per [`INTERVAL_MS`]), so no claim waits for it.
    pub(crate) fn claimed(self: &Arc<Self>, rows: usize, took: Duration) {
        if rows == 0 || took < SLOW || self.off.load(Ordering::Relaxed) {
            return;
        }
        let now = clock::now_ms();
        let next = self.next_ms.load(Ordering::Relaxed);
        if now < next
            || self
                .next_ms
                .compare_exchange(
                    next,
                    now + INTERVAL_MS,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        let watch = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(e) = watch.check().await {
                tracing::debug!(table = %watch.table, error = %e, "statistics check failed");
            }
        });
    }

    /// Reads the table's recorded and live row counts and analyzes it when the record is stale.
    pub(crate) async fn check(&self) -> Result<Checked, sqlx::Error> {
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(check_sql(&crate::sql::literal(
            &self.table,
        ))))
        .fetch_one(&self.pool)
        .await?;
        let (recorded, live, allowed): (f64, i64, bool) =
            (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
        if !allowed {
            if !self.off.swap(true, Ordering::Relaxed) {
                tracing::info!(
                    table = %self.table,
                    "this role may not ANALYZE the queue table, so statistics a burst left stale \
                     wait for autovacuum's analyze (claims may read the whole table meanwhile); \
                     run the broker as the table's owner to let it analyze"
                );
            }
            return Ok(Checked::NotAllowed);
        }
        if !stale(recorded, live) {
            return Ok(Checked::Current);
        }
        let options = if self.skip_locked {
            "(SKIP_LOCKED) "
        } else {
            ""
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ANALYZE {options}{}",
            self.table
        )))
        .execute(&self.pool)
        .await?;
        tracing::debug!(
            table = %self.table,
            recorded,
            live,
            "analyzed a queue table whose statistics recorded under a tenth of its live rows"
        );
        Ok(Checked::Analyzed)
    }
}

#[cfg(test)]
mod tests {
    use super::stale;

    #[test]
    fn statistics_are_stale_under_a_tenth_of_the_live_rows() {
        assert!(stale(19.0, 93_000));
        assert!(stale(0.0, 10_000));
        assert!(!stale(99.0, 9_990), "too few rows to matter");
        assert!(!stale(1_000.0, 10_000), "a tenth is not under a tenth");
        assert!(
            !stale(-1.0, 50_000),
            "never analyzed: estimated from its size"
        );
        assert!(!stale(80_000.0, 93_000));
    }
}

//! The claim window: how row lock and lease claims find their rows on MySQL and MariaDB without
//! a locking read through the claim index.
//!
//! The claim index leads with the due time (see [`crate::schema`]), so a claim reads it, not the
//! primary key. On InnoDB a *locking* read through a secondary index is dear when rows are
//! claimed and deleted at its front: every entry it passes, the delete-marked ones that purge
//! has not removed yet included, is checked for a lock held by another transaction, and for a
//! secondary entry that check looks the row up in the clustered index. A consistent read under
//! READ COMMITTED pays a similar lookup to decide what it sees. Measured on MariaDB 10.11 (3,000
//! rows, 8 workers, an instant ack): the locking claim through `(due_at, id)` drained at about
//! 60% of the same claim through the primary key.
//!
//! A READ UNCOMMITTED read passes delete-marked entries without either lookup. So a claim:
//!
//! 1. reads the ids of the first [`WINDOW`] claimable rows in claim order, in an autocommit
//!    statement at READ UNCOMMITTED (`SET TRANSACTION` and the `SELECT` in one round trip, the
//!    setting spent by that statement alone);
//! 2. opens its transaction as before and locks rows among those ids through the primary key
//!    (`FORCE INDEX (PRIMARY) .. WHERE id IN (..) AND <claimable> ORDER BY id .. FOR UPDATE SKIP
//!    LOCKED`). The locking read sees the latest committed rows and checks every condition of a
//!    claimable row again, so a dirty read can make a claim miss a row (taken next time), never
//!    take a wrong one. Through the primary key a rejected row is not left locked either.
//!
//! The take reads in id order, so it takes ids only from the window's first run of rising ids,
//! whose id order is the claim order. When that run holds nothing it can lock while the window
//! may have more (the run was cut, or the window was full: rows in work under row lock, which a
//! dirty read still sees), the claim ends its transaction and reads the next window from where
//! the run ended, up to [`PAGES`] windows. An empty window ends the claim without opening a
//! transaction.
//!
//! There is no fallback to a locking read through the claim index: such a read locks the index
//! entry of every row it passes before it finds the row itself locked, and a row taken through
//! the primary key has no lock on its index entry, so the passing claim would keep that entry
//! locked and the delivery holding the row could not delete it (its ack waited for the other
//! delivery to end: a lock wait timeout under row lock, where both stay open).

use broker_core::{Result, SqlxBrokerError, TableDescription};
use sqlx::mysql::MySqlRow;
use sqlx::{MySqlConnection, Row};

use crate::sql::{Args, P, Sql, Statements, Stmt, ident};

/// How many ids a claim window reads.
pub(crate) const WINDOW: usize = 32;

/// How many windows one claim reads at most before it gives up until its next poll or wake-up
/// (a claim reads on only past rows it could not lock, that is rows in work under row lock).
pub(crate) const PAGES: usize = 8;

/// The read setting of the window's statement, spent by that statement alone.
const DIRTY: &str = "SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED; ";

/// The two statements of one table's claim window.
#[derive(Debug)]
pub(crate) struct Window {
    /// The ids of the first claimable rows in claim order.
    read: Stmt,
    /// The locking take among a run of them, in id order.
    take: Stmt,
}

/// The ids a window read found.
#[derive(Debug)]
pub(crate) struct Candidates {
    ids: Vec<i64>,
    run: usize,
}

impl Candidates {
    /// Nothing claimable was seen.
    pub(crate) fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The ids the take may lock: the first run of rising ids.
    pub(crate) fn run(&self) -> &[i64] {
        &self.ids[..self.run]
    }

    /// Whether rows the take did not try may still be claimable: the run was cut short, or the
    /// window was full.
    pub(crate) fn more(&self) -> bool {
        self.run < self.ids.len() || self.ids.len() >= WINDOW
    }

    /// Where the next window starts, this one having started at `skip`: after the run.
    pub(crate) fn next_skip(&self, skip: i64) -> i64 {
        skip + i64::try_from(self.run).unwrap_or(i64::MAX)
    }
}

impl Window {
    pub(crate) fn new(table: &TableDescription, s: &Statements) -> Self {
        let read = Sql::new(format!(
            "SELECT CAST({} AS SIGNED) FROM {} WHERE ",
            s.id, s.table
        ))
        .append(&s.claimable)
        .push(&format!(" ORDER BY {} LIMIT {WINDOW} OFFSET ", s.order))
        .param(P::Skip)
        .stmt("claim window");
        let mut take = Sql::new(format!(
            "SELECT {} FROM {} FORCE INDEX (PRIMARY) WHERE {} IN (",
            s.select_list(false),
            s.table,
            s.id
        ));
        for i in 0..WINDOW {
            if i > 0 {
                take = take.push(", ");
            }
            take = take.param(P::Candidate(i));
        }
        // -- needs SKIP LOCKED: MySQL 8.0.1, MariaDB 10.6
        let take = take
            .push(") AND ")
            .append(&s.claimable)
            .push(&format!(
                " ORDER BY {}.{} LIMIT ",
                s.table,
                ident(table.id())
            ))
            .param(P::Limit)
            .push(" FOR UPDATE SKIP LOCKED")
            .stmt("claim take");
        Self { read, take }
    }

    /// The statements, by name, for prepare's check.
    pub(crate) fn statements(&self) -> [&Stmt; 2] {
        [&self.read, &self.take]
    }

    /// Reads the window of `table`, outside any transaction. On an error the caller must not
    /// give the connection back to the pool (leave its [`Conn`](crate::backend::Conn) armed):
    /// the READ UNCOMMITTED setting may still be pending on it.
    pub(crate) async fn read(
        &self,
        conn: &mut MySqlConnection,
        table: &str,
        now_ms: i64,
        skip: i64,
    ) -> Result<Candidates> {
        self.read_ids(conn, now_ms, skip)
            .await
            .map_err(|e| SqlxBrokerError::statement(table, self.read.name, e))
    }

    async fn read_ids(
        &self,
        conn: &mut MySqlConnection,
        now_ms: i64,
        skip: i64,
    ) -> Result<Candidates, sqlx::Error> {
        let args = Args {
            now_ms,
            skip,
            ..Args::default()
        };
        let sql = format!("{DIRTY}{}", self.read.inline(&args));
        let rows: Vec<MySqlRow> = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_all(conn)
            .await?;
        let ids = rows
            .iter()
            .map(|r| r.try_get::<i64, _>(0))
            .collect::<Result<Vec<_>, _>>()?;
        let run = rising_run(&ids);
        Ok(Candidates { ids, run })
    }

    /// The take of up to `limit` rows among `run` (at most [`WINDOW`] ids).
    pub(crate) fn take<'q>(
        &self,
        run: &'q [i64],
        limit: usize,
        now_ms: i64,
    ) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
        debug_assert!(!run.is_empty() && run.len() <= WINDOW);
        self.take.bind(&Args {
            now_ms,
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            candidates: run,
            ..Args::default()
        })
    }
}

/// The length of the first run of rising ids.
fn rising_run(ids: &[i64]) -> usize {
    match ids.windows(2).position(|w| w[1] <= w[0]) {
        Some(i) => i + 1,
        None => ids.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_ends_where_ids_stop_rising() {
        assert_eq!(rising_run(&[]), 0);
        assert_eq!(rising_run(&[7]), 1);
        assert_eq!(rising_run(&[1, 2, 5, 9]), 4);
        assert_eq!(rising_run(&[4, 9, 2, 3]), 2);
        assert_eq!(rising_run(&[9, 4]), 1);
    }

    #[test]
    fn the_read_writes_its_time_in_and_the_take_binds_every_id() {
        let t = TableDescription::builder("jobs")
            .due_at("due_at")
            .build()
            .unwrap();
        let w = Window::new(&t, &Statements::new(&t));
        let read = w.read.inline(&Args {
            now_ms: 1_500,
            skip: 64,
            ..Args::default()
        });
        assert!(!read.contains('?'), "{read}");
        assert!(read.contains("1500000"), "{read}");
        assert!(
            read.ends_with(&format!("LIMIT {WINDOW} OFFSET 64")),
            "{read}"
        );
        let take = w.take.sql();
        assert_eq!(take.matches('?').count(), WINDOW + 2, "{take}");
        assert!(take.contains("FORCE INDEX (PRIMARY)"), "{take}");
        assert!(take.ends_with("FOR UPDATE SKIP LOCKED"), "{take}");
    }
}

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
//! On a FIFO table the window is not a range of the claim index: rows without a group come
//! from it (the claim index leads with the group column there, so they are one range), and the
//! grouped rows come group by group. The read walks up to [`WINDOW`] groups through the group
//! index (a loose index scan: `GROUP BY` the group with `MIN(id)`), from just after the group
//! the last claim took ([`GroupCursor`]), and gives each group's head (its first unfinished row)
//! where the head is claimable. A group's backlog then costs one probe however many rows it
//! holds, and the groups take turns. The take locks among the ids in id order (any order
//! across groups is fair), checks the head condition and the guard as before; the next window
//! starts after the last group walked, and from the first group once the walk reached the
//! last.
//!
//! There is no fallback to a locking read through the claim index: such a read locks the index
//! entry of every row it passes before it finds the row itself locked, and a row taken through
//! the primary key has no lock on its index entry, so the passing claim would keep that entry
//! locked and the delivery holding the row could not delete it (its ack waited for the other
//! delivery to end: a lock wait timeout under row lock, where both stay open).

use broker_core::driver::GroupCursor;
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
    /// The ids of the first claimable rows in claim order (FIFO: the walk of the groups).
    read: Stmt,
    /// The locking take among a run of them, in id order.
    take: Stmt,
    /// FIFO tables: where the next claim starts its walk of the groups.
    cursor: Option<GroupCursor>,
}

/// Where a window read starts: past `skip` rows of the claim order, or (FIFO) after the group
/// `after` (from the first group when `None`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Page {
    skip: i64,
    after: Option<String>,
}

/// The ids a window read found.
#[derive(Debug)]
pub(crate) struct Candidates {
    ids: Vec<i64>,
    run: usize,
    /// FIFO: the groups walked, in walking order, and whether the walk stopped at [`WINDOW`]
    /// groups (or the rows without a group filled a window) rather than at the last group.
    walked: Vec<String>,
    full: bool,
    /// FIFO: the walk started after a group and reached the last one without filling, so the
    /// groups from the first up to its start are still unread: the next window reads them.
    /// Without it a claim whose walk started at the last group came back empty with heads
    /// claimable before it, and a subscription slept until its poll.
    wrap: bool,
    /// Taken from [`Spare`] ids rather than read: a take that finds nothing among them says
    /// nothing of the table, so the claim reads a window instead of ending.
    spare: bool,
}

/// How long the rest of a window may serve later claims (see [`Spare`]): as long as the
/// advisory strategy keeps its candidates.
pub(crate) const SPARE_FOR: std::time::Duration = std::time::Duration::from_millis(200);

/// How many times a claim whose spare ids were all taken tries the next ones, in the same
/// transaction (a take each), before it reads a window. Reading one at once would take the
/// lowest free id in it, which is the next spare id another claim was about to lock: that claim
/// would find nothing and read a window in turn, and so on.
pub(crate) const SPARE_TRIES: usize = 3;

/// The rest of the last window read, for the next claims (tables without FIFO groups): the
/// ids after the rows its claim took, in claim order. Under row lock a settlement that keeps its
/// connection then commits and begins without reading a window; a lease claim begins and takes
/// without one. At batch size 1 a window of [`WINDOW`] ids was otherwise read, and its
/// `SET TRANSACTION` statements parsed, for every row. Ids older than
/// [`SPARE_FOR`] are not used, so a row that became claimable ahead of them (a retry, a row
/// given back, a higher priority) waits at most that long; the take checks every condition of
/// a claimable row again, so a spare id can make a claim miss a row, never take a wrong one.
#[derive(Debug, Default)]
pub(crate) struct Spare(std::sync::Mutex<Option<Kept>>);

/// What [`Spare`] holds.
#[derive(Debug)]
struct Kept {
    /// The ids not handed out yet, in claim order.
    ids: Vec<i64>,
    /// When the window they came from was read.
    at: std::time::Instant,
    /// The highest id handed out or taken since the ids were kept fresh. Workers that found
    /// nothing kept read windows at the same time, and each window holds the ids the others
    /// took or were handed; kept again, those would go to a second claim, which finds them
    /// locked or leased and ends its transaction with nothing.
    handed: i64,
}

impl Spare {
    /// Keeps the ids of `window`'s run after `taken` (and after every id handed out while
    /// the kept ids are fresh), replacing what was kept.
    pub(crate) fn keep_after(&self, window: &Candidates, taken: i64) {
        if window.spare {
            return;
        }
        let mut kept = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let handed = match kept.as_ref() {
            Some(k) if k.at.elapsed() < SPARE_FOR => k.handed.max(taken),
            _ => taken,
        };
        let ids = window
            .run()
            .iter()
            .copied()
            .filter(|id| *id > handed)
            .collect();
        *kept = Some(Kept {
            ids,
            at: std::time::Instant::now(),
            handed,
        });
    }

    /// The `want` lowest ids kept, as a window of their own, for a claim of up to `want` rows;
    /// `None` when fewer are kept or they are older than [`SPARE_FOR`]. Each claim gets ids of
    /// its own, so workers claiming at once lock different rows; one that finds its ids taken
    /// (by a claim that read a window at the same time) reads a window.
    pub(crate) fn share(&self, want: usize) -> Option<Candidates> {
        let mut kept = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let k = kept.as_mut()?;
        if k.at.elapsed() >= SPARE_FOR {
            *kept = None;
            return None;
        }
        if k.ids.is_empty() || k.ids.len() < want {
            return None;
        }
        let mine: Vec<i64> = k.ids.drain(..want).collect();
        k.handed = k.handed.max(mine.last().copied().unwrap_or(i64::MIN));
        Some(Candidates::of(mine, true))
    }

    /// Forgets what was kept.
    pub(crate) fn clear(&self) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

impl Candidates {
    /// Ids in claim order, from a window read (tables without FIFO groups) or `spare`.
    fn of(ids: Vec<i64>, spare: bool) -> Self {
        let run = rising_run(&ids);
        Self {
            ids,
            run,
            walked: Vec::new(),
            full: false,
            wrap: false,
            spare,
        }
    }

    /// Whether these are [`Spare`] ids rather than a window read.
    pub(crate) fn is_spare(&self) -> bool {
        self.spare
    }

    /// Nothing claimable was seen.
    pub(crate) fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The ids the take may lock: the first run of rising ids.
    pub(crate) fn run(&self) -> &[i64] {
        &self.ids[..self.run]
    }

    /// Whether rows the take did not try may still be claimable: the run was cut short, or the
    /// window (FIFO: the walk) was full.
    pub(crate) fn more(&self) -> bool {
        self.full || self.wrap || self.run < self.ids.len() || self.ids.len() >= WINDOW
    }

    /// Where the next window starts, this one having started at `page`: after the run, or
    /// (FIFO) after the last group walked, from the first group once the walk reached the last.
    pub(crate) fn next_page(&self, page: &Page) -> Page {
        Page {
            skip: page.skip + i64::try_from(self.run).unwrap_or(i64::MAX),
            after: self.walked.last().filter(|_| self.full).cloned(),
        }
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
            s.claimed_columns(false),
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
        match table.group().filter(|_| table.fifo()) {
            Some(group) => Self {
                read: walk(table, s, group),
                take,
                cursor: Some(GroupCursor::default()),
            },
            None => Self {
                read,
                take,
                cursor: None,
            },
        }
    }

    /// The statements, by name, for prepare's check.
    pub(crate) fn statements(&self) -> [&Stmt; 2] {
        [&self.read, &self.take]
    }

    /// Where a claim's first window starts.
    pub(crate) fn first_page(&self) -> Page {
        Page {
            skip: 0,
            after: self.cursor.as_ref().and_then(GroupCursor::get),
        }
    }

    /// After a claim whose last window was `window` and that took `rows` (FIFO): the next claim
    /// starts after the last group taken in walking order, or, when nothing was taken, where
    /// this walk stopped (from the first group if it reached the last).
    pub(crate) fn claimed<'r>(
        &self,
        window: &Candidates,
        rows: impl IntoIterator<Item = &'r MySqlRow>,
    ) {
        let Some(cursor) = &self.cursor else {
            return;
        };
        let took: Vec<String> = rows
            .into_iter()
            .filter_map(|r| r.try_get::<Option<String>, _>(crate::sql::GROUP_ALIAS).ok())
            .flatten()
            .collect();
        let last_taken = window
            .walked
            .iter()
            .rev()
            .find(|g| took.contains(g))
            .cloned();
        cursor.set(match last_taken {
            Some(g) => Some(g),
            None => window.walked.last().filter(|_| window.full).cloned(),
        });
    }

    /// Commits the transaction open on `conn`, reads the first window of the next claim (as
    /// [`read`](Self::read) does, at READ UNCOMMITTED in a statement of its own) and begins
    /// that claim's transaction with `begin`, in one round trip. Tables without FIFO groups
    /// only (a walk's cursor moves with each claim).
    ///
    /// `Err`: the commit failed, and nothing after it ran. `Ok(Err)`: the commit landed and a
    /// later statement failed; the connection must not go back to the pool (the READ
    /// UNCOMMITTED setting may still be pending on it, and no transaction may be open).
    pub(crate) async fn commit_and_read(
        &self,
        conn: &mut MySqlConnection,
        now_ms: i64,
        begin: &str,
    ) -> Result<Result<Candidates, sqlx::Error>, sqlx::Error> {
        debug_assert!(self.cursor.is_none(), "FIFO windows walk with a cursor");
        let args = Args {
            now_ms,
            ..Args::default()
        };
        let then = format!("{DIRTY}{}; {begin}", self.read.inline(&args));
        Ok(commit_then(conn, &then)
            .await?
            .map(|ids| Candidates::of(ids, false)))
    }

    /// Reads the window of `table`, outside any transaction. On an error the caller must not
    /// give the connection back to the pool (leave its [`Conn`](crate::backend::Conn) armed):
    /// the READ UNCOMMITTED setting may still be pending on it.
    pub(crate) async fn read(
        &self,
        conn: &mut MySqlConnection,
        table: &str,
        now_ms: i64,
        page: &Page,
    ) -> Result<Candidates> {
        self.read_then(conn, table, now_ms, page, None).await
    }

    /// Reads the window as [`read`](Self::read) does, then runs `then` (a transaction's begin)
    /// in the same round trip. On an error the caller must not give the connection back to the
    /// pool: the READ UNCOMMITTED setting may still be pending on it, or a transaction open.
    pub(crate) async fn read_then(
        &self,
        conn: &mut MySqlConnection,
        table: &str,
        now_ms: i64,
        page: &Page,
        then: Option<&str>,
    ) -> Result<Candidates> {
        self.read_ids(conn, now_ms, page, then)
            .await
            .map_err(|e| SqlxBrokerError::statement(table, self.read.name, e))
    }

    /// Whether the window walks FIFO groups (with a cursor that moves with each claim).
    pub(crate) fn walks(&self) -> bool {
        self.cursor.is_some()
    }

    async fn read_ids(
        &self,
        conn: &mut MySqlConnection,
        now_ms: i64,
        page: &Page,
        then: Option<&str>,
    ) -> Result<Candidates, sqlx::Error> {
        let args = Args {
            now_ms,
            skip: page.skip,
            group: page.after.as_deref(),
            ..Args::default()
        };
        let sql = match then {
            Some(then) => format!("{DIRTY}{}; {then}", self.read.inline(&args)),
            None => format!("{DIRTY}{}", self.read.inline(&args)),
        };
        // The statements after the read return no rows.
        let rows: Vec<MySqlRow> = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_all(conn)
            .await?;
        if self.cursor.is_none() {
            let ids = rows
                .iter()
                .map(|r| r.try_get::<i64, _>(0))
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(Candidates::of(ids, false));
        }
        // (id or NULL, group or NULL): rows without a group first, then one row per group
        // walked, with its head's id where the head is claimable.
        let (mut ids, mut walked, mut ungrouped) = (Vec::new(), Vec::new(), 0);
        for r in &rows {
            let id: Option<i64> = r.try_get(0)?;
            let group: Option<String> = r.try_get(1)?;
            match group {
                Some(g) => walked.push(g),
                None => ungrouped += 1,
            }
            ids.extend(id);
        }
        // The take binds at most WINDOW ids (rows without a group and heads may come to twice
        // that): the lowest go now, the rest come again in a later window or claim.
        ids.sort_unstable();
        let cut = ids.len() > WINDOW;
        ids.truncate(WINDOW);
        let run = ids.len();
        let full = cut || walked.len() >= WINDOW || ungrouped >= WINDOW;
        Ok(Candidates {
            ids,
            run,
            walked,
            full,
            wrap: page.after.is_some() && !full,
            spare: false,
        })
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

/// Commits the transaction open on `conn` and runs `then` in the same round trip, reading the
/// ids its statements return (none for a begin alone).
///
/// `Err`: the commit failed, and nothing after it ran. `Ok(Err)`: the commit landed and a later
/// statement failed; the connection must not go back to the pool (a READ UNCOMMITTED setting
/// may still be pending on it, and no transaction may be open).
pub(crate) async fn commit_then(
    conn: &mut MySqlConnection,
    then: &str,
) -> Result<Result<Vec<i64>, sqlx::Error>, sqlx::Error> {
    use futures_util::TryStreamExt;
    let sql = format!("COMMIT; {then}");
    let mut results = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).fetch_many(conn);
    // The first result is the commit's.
    match results.try_next().await? {
        Some(sqlx::Either::Left(_)) => {}
        _ => return Err(sqlx::Error::Protocol("no result for COMMIT".into())),
    }
    let mut ids = Vec::new();
    loop {
        match results.try_next().await {
            Ok(Some(sqlx::Either::Right(row))) => match row.try_get::<i64, _>(0) {
                Ok(id) => ids.push(id),
                Err(e) => return Ok(Err(e)),
            },
            Ok(Some(sqlx::Either::Left(_))) => {}
            Ok(None) => return Ok(Ok(ids)),
            Err(e) => return Ok(Err(e)),
        }
    }
}

/// The window read of a FIFO table (see the module docs): `(id, NULL)` for up to [`WINDOW`]
/// claimable rows without a group in claim order, then `(head id or NULL, group)` for each of
/// up to [`WINDOW`] groups from the page's start, in group order. The groups and their heads
/// come from one `GROUP BY` with `MIN(id)` over the group index, which both servers read as a
/// loose index scan (one probe per group); a recursive CTE stepping with a correlated
/// `group > w.g` read the index from its start on every step on MariaDB 10.11 (30 ms for 32
/// groups). `STRAIGHT_JOIN` reads the groups first, in their order, then each head by its key.
fn walk(t: &TableDescription, s: &Statements, group: &str) -> Stmt {
    let (tbl, id, g) = (&s.table, &s.id, ident(group));
    let unfinished: String = t
        .unfinished_columns()
        .into_iter()
        .map(|c| format!(" AND n.{} IS NULL", ident(c)))
        .collect();
    Sql::new(format!(
        "SELECT CAST(u.id AS SIGNED), CAST(NULL AS CHAR) FROM (SELECT {id} AS id FROM {tbl} \
         WHERE {tbl}.{g} IS NULL AND "
    ))
    .append(&s.claimable)
    .push(&format!(
        " ORDER BY {order} LIMIT {WINDOW}) AS u UNION ALL SELECT CASE WHEN ",
        order = s.order
    ))
    .append(&s.claimable_row)
    .push(&format!(
        " THEN CAST({id} AS SIGNED) END, CAST(w.g AS CHAR) FROM (SELECT n.{g} AS g, \
         MIN(n.{idc}) AS head FROM {tbl} AS n WHERE (n.{g} > ",
        idc = ident(t.id()),
    ))
    .param(P::After)
    .push(&format!(" OR n.{g} >= "))
    .param(P::First)
    .push(&format!(
        "){unfinished} GROUP BY n.{g} ORDER BY n.{g} LIMIT {WINDOW}) AS w \
         STRAIGHT_JOIN {tbl} ON {id} = w.head"
    ))
    .stmt("claim window")
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

    fn window(ids: Vec<i64>) -> Candidates {
        Candidates::of(ids, false)
    }

    #[test]
    fn spare_ids_are_the_runs_rest_handed_out_once_while_fresh() {
        let spare = Spare::default();
        spare.keep_after(&window((1..=6).collect()), 3);
        let first = spare.share(1).expect("kept");
        assert!(first.is_spare());
        assert_eq!(first.run(), &[4]);
        assert_eq!(spare.share(2).expect("kept").run(), &[5, 6]);
        assert!(spare.share(1).is_none(), "all handed out");
        // The rest of spare ids is never kept again: only a window read is.
        spare.keep_after(&first, 4);
        assert!(spare.share(1).is_none());
        spare.keep_after(&window(vec![20, 21, 5]), 20);
        assert_eq!(
            spare.share(1).expect("kept").run(),
            &[21],
            "only the rising run"
        );
        spare.keep_after(&window(vec![30, 31]), 30);
        std::thread::sleep(SPARE_FOR + std::time::Duration::from_millis(50));
        assert!(spare.share(1).is_none(), "too old to use");
        spare.keep_after(&window(vec![40, 41]), 40);
        spare.clear();
        assert!(spare.share(1).is_none());
        // A window read at the same time as the last holds the ids handed out or taken since:
        // they are not kept again.
        spare.keep_after(&window((70..=80).collect()), 70);
        assert_eq!(spare.share(3).expect("kept").run(), &[71, 72, 73]);
        spare.keep_after(&window((70..=80).collect()), 71);
        assert_eq!(spare.share(1).expect("kept").run(), &[74]);
        spare.keep_after(&window((70..=80).collect()), 77);
        assert_eq!(spare.share(1).expect("kept").run(), &[78]);
        // A claim of many rows gets as many ids as it wants, and none when fewer are kept.
        spare.clear();
        spare.keep_after(&window((50..=60).collect()), 50);
        assert!(spare.share(11).is_none(), "only 10 kept");
        assert_eq!(
            spare.share(6).expect("kept").run(),
            &[51, 52, 53, 54, 55, 56]
        );
    }

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

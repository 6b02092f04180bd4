//! Lease mode on MySQL and MariaDB. Neither server has `UPDATE .. RETURNING`, so a claim is a
//! locking read (`FOR UPDATE SKIP LOCKED`) of due rows, then one `UPDATE .. WHERE id IN (..)`
//! that writes the expiry and counts the attempt, in one READ COMMITTED transaction committed at
//! once. The locking read takes its rows among the ids of a window read just before, without
//! locks, outside the transaction (see [`crate::window`]); on tables without FIFO groups the
//! transaction's begin goes in the window read's round trip (so a claim costs the loop's round
//! trips: begin and read, take, update, commit; a claim that finds the rest of a recent window
//! kept, see [`crate::window::Spare`], begins and takes among those ids without reading one),
//! and the claim runs its transaction with plain `COMMIT`/`ROLLBACK` statements, closing its
//! connection on an error. The rows come back as the locking
//! read saw them, so their attempt is the one before the claim. Renewals and settlements are fenced on the token: `locked_until` and `attempt` must
//! still be what this claim wrote.
//!
//! Those plain statements leave sqlx unaware of the transaction, and a Galera node can end it
//! with no error (issue #34, see `sql::IN_TRANSACTION`). So on MariaDB the claim's update writes
//! only inside its transaction (`@@in_transaction = 1` in its `WHERE`), and nothing runs between
//! the update and the commit: a claim whose rows were written hands them out once the commit
//! succeeds, and one whose transaction had ended wrote nothing, rolls back (nothing) and claims
//! again. MySQL has no such variable, and is not a Galera node here.
//!
//! Expiries are whole seconds, bound as seconds and written with `TIMESTAMPADD(SECOND, ..)`, so a
//! `DATETIME` or `TIMESTAMP` column without fractions stores them exactly and the fence compares
//! equal.

use std::sync::Arc;

use broker_core::driver::retry::LEASE_MARGIN_MS;
use broker_core::driver::{
    ClaimedRow, Fence, LeaseStrategy, LeaseToken, Position, Settle, WarmConnections,
};
use broker_core::{Result, SqlxBrokerError, TableDescription};
use sqlx::{MySql, MySqlConnection, MySqlPool, Row};

use crate::backend::{Conn, claimed};
use crate::fifo::{self, Guard};
use crate::sql::{
    Args, IN_TRANSACTION, P, SettleStatements, Sql, Statements, Stmt, begin_sql, ident, retrying,
    run_settle, settle_named, settle_retrying, whole_seconds,
};
use crate::window::{Candidates, PAGES, SPARE_TRIES, Spare, Window};

/// The lease strategy of one MySQL / MariaDB table.
#[derive(Debug)]
pub struct MySqlLease {
    pool: MySqlPool,
    table: Arc<TableDescription>,
    begin: Arc<str>,
    /// The claim: a window of ids read without locks, rows among them locked through the
    /// primary key (see [`crate::window`]).
    window: Window,
    /// The claim's update up to `IN (`; the ids' placeholders follow (see [`Self::update`]).
    update_head: Sql,
    /// The update with one id, for the startup check.
    update_one: Stmt,
    guard: Option<Stmt>,
    renew: Stmt,
    settle: SettleStatements,
    /// MariaDB, acked rows deleted: the ack of many rows (`DELETE .. RETURNING`) as its three
    /// parts, `None` where rows are acked one at a time (MySQL has no `RETURNING`; no
    /// `UPDATE .. RETURNING` on MariaDB for tables that keep acked rows).
    ack_many: Option<AckMany>,
    /// Connections kept from one claim or ack to the next.
    warm: WarmConnections<sqlx::pool::PoolConnection<MySql>>,
    /// The rest of the last window, for the next claims (tables without FIFO groups; see
    /// [`Spare`]).
    spare: Spare,
}

/// The ack of many rows on MariaDB: `{head}{ids}) AND ({fences}) ORDER BY id LIMIT n{tail}`.
#[derive(Debug)]
struct AckMany {
    /// `DELETE .. WHERE id IN (`.
    head: String,
    /// One row's fence, `(id = ? AND locked_until = .. AND attempt = ?)`.
    fence: String,
    /// The id column, for `ORDER BY`.
    id: String,
    /// `RETURNING` the id.
    tail: String,
    /// The statement for two rows, for prepare's check.
    two: Stmt,
}

impl AckMany {
    fn new(s: &Statements, lu: &str) -> Self {
        let head = format!("DELETE FROM {} WHERE {} IN (", s.table, s.id);
        let fence = format!(
            "({} = ? AND {lu} = TIMESTAMPADD(SECOND, ?, {}) AND {} = ?)",
            s.id,
            crate::sql::EPOCH0,
            s.attempt
        );
        let tail = format!(" RETURNING CAST({} AS SIGNED)", s.id);
        let mut out = Self {
            head,
            fence,
            id: s.id.clone(),
            tail,
            two: Sql::new(String::new()).stmt("ack many"),
        };
        out.two = Sql::new(out.sql(2)).stmt("ack many");
        out
    }

    /// The statement for `n` rows: the ids find the rows through the primary key, each row's
    /// fence (its id, expiry and attempt) keeps out a row that no longer holds its token.
    /// Parameters: the `n` ids, then each row's id, expiry (whole seconds) and attempt.
    ///
    /// `ORDER BY id LIMIT n` keeps the read on the primary key. Without it, where the rows
    /// acked are most of a small table (a queue that is nearly drained), MariaDB 10.11 plans a
    /// full scan, which waits for a row lock that another transaction holds on any row of the
    /// table, one this statement does not ack included (seen in
    /// `an_ack_stuck_behind_a_row_lock_does_not_hold_up_the_others`); through the primary key
    /// it reads only the rows it names.
    fn sql(&self, n: usize) -> String {
        format!(
            "{}{}) AND ({}) ORDER BY {} LIMIT {n}{}",
            self.head,
            vec!["?"; n].join(", "),
            vec![self.fence.as_str(); n].join(" OR "),
            self.id,
            self.tail
        )
    }
}

impl MySqlLease {
    /// `mariadb`: the server is MariaDB, which has `DELETE .. RETURNING` for acks of many rows.
    pub(crate) fn new(
        pool: MySqlPool,
        table: Arc<TableDescription>,
        locked_until: &str,
        group_index: Option<&str>,
        mariadb: bool,
    ) -> Self {
        let s = Statements::new(&table);
        let lu = format!("{}.{}", s.table, ident(locked_until));
        // The update re-checks that each row is still claimable, on the row as it is now: the
        // locking read took it from what this node had applied, and on a Galera cluster a claim
        // on another node may have leased the row since (its write reaches this node after the
        // read, and the read's lock does not stop it). A row that fails the check is another
        // claim's; the claim then takes nothing and reads again.
        //
        // MariaDB: the update also changes nothing unless the claim's transaction is still
        // open (`@@in_transaction`, read once per statement). A Galera node that aborts the
        // transaction for a replicated write (a brute-force abort) while the FIFO guard's
        // locking read runs can end that read with an empty result and no error, and without
        // the check the update then ran on its own, committed at once: the rows' attempts
        // spent and their leases set by a claim that, seeing fewer rows than it locked, rolled
        // back nothing and handed none out (issue #34).
        let open = if mariadb { IN_TRANSACTION } else { "" };
        let update = Sql::new(format!("UPDATE {} SET {lu} = ", s.table))
            .time_s(P::Expires)
            .push(&format!(", {a} = {a} + 1 WHERE {open}", a = s.attempt))
            .append(&s.claimable_row)
            .push(&format!(" AND {} IN (", s.id));
        let update_one = update
            .clone()
            .param(P::Candidate(0))
            .push(")")
            .stmt("claim update");
        let update_head = update;
        let fence = Sql::new(format!(" AND {lu} = "))
            .time_s(P::TokenExpires)
            .push(&format!(" AND {} = ", s.attempt))
            .param(P::TokenAttempt);
        // The row may hold the new expiry already: a renewal run again after a lost reply finds
        // its own first try landed (sqlx asks for found rows, so that counts as one row).
        let renew = Sql::new(format!("UPDATE {} SET {lu} = ", s.table))
            .time_s(P::Expires)
            .push(&format!(" WHERE {} = ", s.id))
            .param(P::Id)
            .push(&format!(" AND {lu} IN ("))
            .time_s(P::TokenExpires)
            .push(", ")
            .time_s(P::Expires)
            .push(&format!(") AND {} = ", s.attempt))
            .param(P::TokenAttempt)
            .stmt("renew");
        // The dead-letter move, a transaction of its own, takes the same care (see
        // `IN_TRANSACTION`).
        let settle = s.settle(&table, &fence, false, open);
        let ack_many = (mariadb && table.processed_at().is_none()).then(|| AckMany::new(&s, &lu));
        Self {
            warm: WarmConnections::for_pool(&pool),
            pool,
            begin: begin_sql(&table),
            window: Window::new(&table, &s),
            update_head,
            update_one,
            guard: fifo::guard(&table, group_index),
            renew,
            settle,
            ack_many,
            spare: Spare::default(),
            table,
        }
    }

    /// Every statement the strategy runs, by name, so prepare can check each one against the
    /// table.
    pub(crate) fn statements(&self) -> Vec<(&'static str, &str)> {
        let mut out = vec![&self.update_one, &self.renew];
        out.extend(self.ack_many.as_ref().map(|a| &a.two));
        out.extend(self.window.statements());
        out.extend(&self.guard);
        out.extend(settle_named(&self.settle));
        out.into_iter().map(Stmt::named).collect()
    }

    fn err(&self, name: &'static str) -> impl Fn(sqlx::Error) -> SqlxBrokerError + '_ {
        move |e| SqlxBrokerError::statement(self.table.name(), name, e)
    }

    /// A kept connection (see `warm`), else one from the pool.
    async fn conn(&self) -> Result<Conn> {
        Conn::from_warm(&self.warm, &self.pool, self.table.name()).await
    }

    /// Keeps `conn` for the next statement when `out` went well (see [`Conn::done_into`]).
    fn done<T>(&self, conn: Conn, out: &Result<T>) {
        conn.done_into(&self.warm, out.is_ok());
    }

    async fn claim_once(
        &self,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
    ) -> Result<Vec<ClaimedRow<MySql>>> {
        let mut conn = self.conn().await?;
        let mut page = self.window.first_page();
        // Tables without FIFO groups begin the claim's transaction in the window read's round
        // trip: one round trip fewer per claim where the window has rows, one more (the
        // rollback) where it has none. A FIFO walk reads on past empty windows, so it begins
        // only once it has candidates.
        let begin = (!self.window.walks()).then_some(&*self.begin);
        // The same tables try the rest of a recent window first (see `Spare`).
        let mut spare = begin.and_then(|_| self.spare.share(limit));
        for _ in 0..PAGES {
            let (window, begun) = match spare.take() {
                Some(window) => (window, false),
                None => {
                    // An error leaves `conn` armed, so it is closed (see `Window::read_then`).
                    let window = self
                        .window
                        .read_then(&mut conn, self.table.name(), now_ms, &page, begin)
                        .await?;
                    if window.is_empty() {
                        if begin.is_some() {
                            sqlx::raw_sql("ROLLBACK")
                                .execute(&mut *conn)
                                .await
                                .map_err(self.err("rollback"))?;
                        }
                        self.window.claimed(&window, []);
                        if window.more() {
                            // FIFO: the groups walked had no claimable head; walk on.
                            page = window.next_page(&page);
                            continue;
                        }
                        break;
                    }
                    (window, begin.is_some())
                }
            };
            let out = self
                .claim_on(&mut conn, &window, limit, now_ms, expires_ms, begun)
                .await;
            let out = match out {
                Err(e) => {
                    // The transaction may be open: dropping the armed guard closes the
                    // connection, which rolls it back.
                    drop(conn);
                    self.warm.release();
                    return Err(e);
                }
                // Another claim leased a row since the read (rolled back): read the page again,
                // which now sees that row leased.
                Ok(None) => continue,
                Ok(Some(rows)) => Ok(rows),
            };
            if let Ok(rows) = &out {
                self.window.claimed(&window, rows.iter().map(|r| &r.row));
            }
            if matches!(&out, Ok(rows) if rows.is_empty() && window.is_spare()) {
                // Spare ids that others took since: read a window instead.
                continue;
            }
            if matches!(&out, Ok(rows) if rows.is_empty() && window.more()) {
                page = window.next_page(&page);
                continue;
            }
            if begin.is_some()
                && let Ok(rows) = &out
                && let Some(last) = rows.iter().map(|r| r.id).max()
            {
                self.spare.keep_after(&window, last);
            }
            // A claim that found fewer rows than it asked for: the table looks drained, and
            // kept connections go back to the pool (so do those of acks until a claim fills).
            let full = matches!(&out, Ok(rows) if rows.len() == limit);
            self.done(conn, &out);
            self.warm.claimed(full);
            return out;
        }
        conn.finish();
        self.warm.claimed(false);
        Ok(Vec::new())
    }

    async fn claim_on(
        &self,
        conn: &mut MySqlConnection,
        window: &Candidates,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
        begun: bool,
    ) -> Result<Option<Vec<ClaimedRow<MySql>>>> {
        let name = self.table.name();
        // The transaction runs outside sqlx's bookkeeping (the window read may have begun it):
        // on an error the caller closes the connection, which rolls it back.
        let tx = conn;
        if !begun {
            sqlx::raw_sql(sqlx::AssertSqlSafe(self.begin.clone()))
                .execute(&mut *tx)
                .await
                .map_err(self.err("begin"))?;
        }
        let mut rows = self
            .window
            .take(window.run(), limit, now_ms)
            .fetch_all(&mut *tx)
            .await
            .map_err(self.err("claim take"))?;
        let mut tries = 0;
        while rows.is_empty() && window.is_spare() && tries < SPARE_TRIES {
            // Spare ids that a claim reading a window took: the next ones, same transaction.
            let Some(next) = self.spare.share(limit) else {
                break;
            };
            rows = self
                .window
                .take(next.run(), limit, now_ms)
                .fetch_all(&mut *tx)
                .await
                .map_err(self.err("claim take"))?;
            tries += 1;
        }
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let row = claimed(&self.table, row, None)?;
            if let Some(guard) = &self.guard
                && fifo::check(tx, guard, name, &row.row, row.id).await? == Guard::Behind
            {
                // A NOWAIT that met a lock may have ended the transaction on MariaDB (with
                // innodb_rollback_on_timeout); give the whole claim up rather than guess.
                tracing::debug!(
                    table = name,
                    id = row.id,
                    "fifo guard: not the group's head now"
                );
                rollback(tx).await.map_err(self.err("rollback"))?;
                return Ok(Some(Vec::new()));
            }
            out.push(row);
        }
        if out.is_empty() {
            rollback(tx).await.map_err(self.err("rollback"))?;
            return Ok(Some(out));
        }
        let ids: Vec<i64> = out.iter().map(|r| r.id).collect();
        let update = self.update(ids.len());
        let args = Args {
            now_ms,
            expires_ms,
            candidates: &ids,
            ..Args::default()
        };
        let done = update
            .bind(&args)
            .execute(&mut *tx)
            .await
            .map_err(self.err("claim update"))?;
        if done.rows_affected() != out.len() as u64 {
            // A row the locking read took is no longer claimable as it is now: another claim
            // leased it (on a Galera cluster, a claim on another node whose write arrived after
            // the read). Claim nothing rather than hand out a row another delivery holds. On
            // MariaDB, also the update of a transaction the server had ended: it changed
            // nothing (see `IN_TRANSACTION`).
            tracing::debug!(
                table = name,
                locked = out.len(),
                updated = done.rows_affected(),
                "claim update: a row was claimed elsewhere since the read; claiming again"
            );
            rollback(tx).await.map_err(self.err("rollback"))?;
            return Ok(None);
        }
        sqlx::raw_sql("COMMIT")
            .execute(&mut *tx)
            .await
            .map_err(self.err("commit"))?;
        Ok(Some(out))
    }

    /// The claim's update for `n` ids: the expiry, the claimable check's times, then the ids
    /// (bound from [`Args::candidates`]).
    fn update(&self, n: usize) -> Stmt {
        let mut sql = self.update_head.clone();
        for i in 0..n {
            if i > 0 {
                sql = sql.push(", ");
            }
            sql = sql.param(P::Candidate(i));
        }
        sql.push(")").stmt("claim update")
    }

    async fn renew_once(&self, id: i64, token: LeaseToken, expires_ms: i64) -> Result<bool> {
        let args = Args {
            id,
            expires_ms,
            token: Some(token),
            ..Args::default()
        };
        let mut conn = Conn::acquire(&self.pool, self.table.name()).await?;
        let done = self.renew.bind(&args).execute(&mut *conn).await;
        conn.finish();
        Ok(done.map_err(self.err("renew"))?.rows_affected() == 1)
    }

    async fn settle_once(&self, token: LeaseToken, settle: Settle) -> Result<bool> {
        let mut conn = self.conn().await?;
        let out = run_settle(
            &self.settle,
            &mut conn,
            self.table.name(),
            settle,
            Fence::Lease(token),
            false,
        )
        .await;
        self.done(conn, &out);
        out
    }
}

impl LeaseStrategy for MySqlLease {
    type Db = MySql;

    // Reads from the start: InnoDB's purge removes the entries of acked rows as it runs.
    async fn claim(
        &self,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
        _from: Option<Position>,
    ) -> Result<Vec<ClaimedRow<MySql>>> {
        retrying(|| async {
            let out = self.claim_once(limit, now_ms, expires_ms).await;
            if out.is_err() {
                // The server may have dropped every kept connection; the retry takes tested
                // ones.
                self.warm.release();
            }
            out
        })
        .await
    }

    async fn renew(&self, id: i64, token: LeaseToken, expires_ms: i64) -> Result<bool> {
        let deadline = token.expires_ms - LEASE_MARGIN_MS;
        settle_retrying(deadline, || self.renew_once(id, token, expires_ms)).await
    }

    async fn settle(&self, token: LeaseToken, settle: Settle) -> Result<bool> {
        // Every settlement is fenced on the token, so running one again after a deadlock or a
        // lost connection changes nothing twice.
        let deadline = token.expires_ms - LEASE_MARGIN_MS;
        settle_retrying(deadline, || self.settle_once(token, settle)).await
    }

    /// MariaDB: one `DELETE .. RETURNING`, one try; one row goes as the per-row ack. MySQL, and
    /// tables that keep acked rows: one row at a time (`None`).
    async fn ack_many(&self, acks: &[(i64, LeaseToken)], now_ms: i64) -> Result<Option<Vec<i64>>> {
        let Some(many) = &self.ack_many else {
            return Ok(None);
        };
        if let [(id, token)] = acks {
            let settle = Settle::lease_ack(*id, *token, now_ms);
            let acked = self.settle_once(*token, settle).await?;
            return Ok(Some(acked.then_some(*id).into_iter().collect()));
        }
        let sql = many.sql(acks.len());
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (id, _) in acks {
            q = q.bind(*id);
        }
        for (id, token) in acks {
            q = q
                .bind(*id)
                .bind(whole_seconds(token.expires_ms))
                .bind(token.attempt);
        }
        let mut conn = self.conn().await?;
        let rows = q.fetch_all(&mut *conn).await.map_err(self.err("ack many"));
        self.done(conn, &rows);
        let rows = rows?;
        rows.iter()
            .map(|r| r.try_get::<i64, _>(0).map_err(self.err("ack many")))
            .collect::<Result<Vec<i64>>>()
            .map(Some)
    }

    fn release_kept(&self) {
        self.warm.release();
    }

    fn kept(&self) -> usize {
        self.warm.len()
    }
}

/// Rolls back the claim's transaction (begun outside sqlx's bookkeeping, see `claim_on`).
async fn rollback(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("ROLLBACK").execute(conn).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_core::ColumnType;

    /// A pool on the server of `SQLX_BROKER_MYSQL_URL` and a table name of its own starting
    /// with `prefix`; `None` when the server is MySQL, which has no `@@in_transaction` (these
    /// statements carry the condition on MariaDB only). An unreachable server fails the case.
    async fn mariadb_and_a_table_name(prefix: &str) -> Option<(MySqlPool, String)> {
        let url = std::env::var("SQLX_BROKER_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let pool = MySqlPool::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("MariaDB/MySQL at {url} is unreachable: {e}"));
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&pool)
            .await
            .unwrap();
        if !version.to_ascii_lowercase().contains("mariadb") {
            return None;
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        Some((pool, format!("{prefix}_{}_{nanos}", std::process::id())))
    }

    /// Issue #34: on MariaDB the claim's update writes only inside the claim's transaction, so
    /// a transaction the server ended before it (a Galera brute-force abort that no statement
    /// reported) leaves the rows as they were. Against the server of `SQLX_BROKER_MYSQL_URL`;
    /// MySQL has no `@@in_transaction`, and its update has no such condition.
    #[tokio::test]
    async fn on_mariadb_the_claim_update_changes_nothing_outside_its_transaction() {
        let Some((pool, name)) = mariadb_and_a_table_name("sb_in_tx").await else {
            return;
        };
        let table = TableDescription::builder(&name)
            .payload("payload", ColumnType::Text)
            .locked_until("locked_until")
            .build()
            .unwrap();
        let broker = broker_core::Broker::new(crate::MySqlBackend::new(pool.clone()));
        broker.create_tables(&table).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO `{name}` (payload) VALUES ('one')"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT CAST(id AS SIGNED) FROM `{name}`"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        let attempt = || {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT CAST(attempt AS SIGNED) FROM `{name}`"
            )))
            .fetch_one(&pool)
        };
        let before = attempt().await.unwrap();
        let lease = MySqlLease::new(
            pool.clone(),
            Arc::new(table.clone()),
            "locked_until",
            None,
            true,
        );
        let now_ms = broker_core::driver::clock::now_ms();
        let ids = [id];
        let args = Args {
            now_ms,
            expires_ms: now_ms + 30_000,
            candidates: &ids,
            ..Args::default()
        };
        let mut conn = pool.acquire().await.unwrap();
        // On its own (autocommit), as after a transaction the server ended unreported.
        let alone = lease
            .update(1)
            .bind(&args)
            .execute(&mut *conn)
            .await
            .unwrap();
        assert_eq!(
            alone.rows_affected(),
            0,
            "the update wrote outside a transaction"
        );
        assert_eq!(
            attempt().await.unwrap(),
            before,
            "the row's attempt was spent"
        );
        // In the claim's transaction it writes the row.
        sqlx::raw_sql(sqlx::AssertSqlSafe(lease.begin.clone()))
            .execute(&mut *conn)
            .await
            .unwrap();
        let inside = lease
            .update(1)
            .bind(&args)
            .execute(&mut *conn)
            .await
            .unwrap();
        assert_eq!(inside.rows_affected(), 1, "the update in the transaction");
        rollback(&mut conn).await.unwrap();
        assert_eq!(attempt().await.unwrap(), before);
        drop(conn);
        broker.drop_tables(&table).await.unwrap();
        broker.close().await;
    }

    /// Issue #34: on MariaDB the lease dead-letter move (lock, copy, delete, in a transaction
    /// of its own) copies and deletes only inside that transaction: run on a connection whose
    /// transaction is over (autocommit, as after a Galera abort that no statement reported),
    /// it moves nothing and says the row no longer held its fence. In a transaction it moves
    /// the row.
    #[tokio::test]
    async fn on_mariadb_a_dead_letter_move_changes_nothing_outside_its_transaction() {
        use broker_core::DeadLetter;
        use broker_core::driver::{Action, Fence, LeaseToken, Settle};

        let Some((pool, name)) = mariadb_and_a_table_name("sb_dead_tx").await else {
            return;
        };
        let dead = format!("{name}_dead");
        let table = TableDescription::builder(&name)
            .payload("payload", ColumnType::Text)
            .locked_until("locked_until")
            .max_attempts(3)
            .dead_letter(DeadLetter::Table(dead.clone()))
            .build()
            .unwrap();
        let broker = broker_core::Broker::new(crate::MySqlBackend::new(pool.clone()));
        broker.create_tables(&table).await.unwrap();
        // A row leased until a whole second an hour ahead, at attempt 2: the token a claim
        // would have written.
        let expires_s = broker_core::driver::clock::now_ms() / 1000 + 3600;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO `{name}` (payload, attempt, locked_until) VALUES ('one', 2, \
             TIMESTAMPADD(SECOND, {expires_s}, {}))",
            crate::sql::EPOCH0
        )))
        .execute(&pool)
        .await
        .unwrap();
        let id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT CAST(id AS SIGNED) FROM `{name}`"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        let count = |t: String| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM `{t}`"
                )))
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        };
        let lease = MySqlLease::new(
            pool.clone(),
            Arc::new(table.clone()),
            "locked_until",
            None,
            true,
        );
        let settle = Settle {
            id,
            action: Action::DeadLetter,
            now_ms: broker_core::driver::clock::now_ms(),
            attempt: 2,
        };
        let fence = Fence::Lease(LeaseToken {
            expires_ms: expires_s * 1000,
            attempt: 2,
        });
        let mut conn = pool.acquire().await.unwrap();
        // `in_tx`: the move runs its statements on the connection as if it were inside its
        // transaction, which is over: autocommit.
        let moved = run_settle(&lease.settle, &mut conn, &name, settle, fence, true)
            .await
            .unwrap();
        assert!(
            !moved,
            "the move ran outside a transaction and said it moved the row"
        );
        assert_eq!(
            (count(name.clone()).await, count(dead.clone()).await),
            (1, 0),
            "the copy or the delete ran on its own"
        );
        let moved = run_settle(&lease.settle, &mut conn, &name, settle, fence, false)
            .await
            .unwrap();
        assert!(moved, "the move in a transaction of its own");
        assert_eq!(
            (count(name.clone()).await, count(dead.clone()).await),
            (0, 1)
        );
        drop(conn);
        broker.drop_tables(&table).await.unwrap();
        broker.close().await;
    }
}

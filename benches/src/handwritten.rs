//! The hand-written baseline: what a competent engineer writes directly on sqlx to drain a job
//! table in each claim mode, with the leanest correct statements, sharing no statement text and
//! no code with the backends (nothing here calls a broker strategy or renders broker SQL). The
//! engine is measured against this loop, so a statement the engine adds on its hot path (a
//! savepoint, an extra read) shows up as a ratio below 1.
//!
//! Every worker holds one connection of its own for the whole run (a loop needs no pool
//! between its statements), reads `id, attempt, payload` and decodes the payload as text, and
//! honours the table's due-time column as the engine must. Per mode and database:
//!
//! | mode | PostgreSQL | MariaDB | SQLite |
//! |---|---|---|---|
//! | row lock | `BEGIN`; select `.. ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED`; `DELETE` by id; `COMMIT` | the same, the session at READ COMMITTED | not offered |
//! | lease | one `UPDATE .. WHERE id IN (SELECT .. FOR UPDATE SKIP LOCKED) RETURNING` per batch; one `DELETE .. WHERE id AND attempt` per row | per batch: begin, locking read, one `UPDATE .. WHERE id IN (..)`, commit; one fenced `DELETE` per row | one `UPDATE .. WHERE id IN (SELECT ..) RETURNING` per batch; one fenced `DELETE` per row |
//! | advisory | a candidate read per batch; per row `pg_try_advisory_lock`, take (`UPDATE .. RETURNING`), `DELETE`, `pg_advisory_unlock` | a candidate read per batch; per row `GET_LOCK(.., 0)`, take (`UPDATE` then read), `DELETE`, `RELEASE_LOCK` | a candidate read per batch; per row an in-process key set, take (`UPDATE .. RETURNING`), `DELETE` |
//!
//! The lease fence is the attempt the claim wrote: every claim changes it, so a delete that
//! names it removes the row only while this worker's claim is the latest.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, Connection, MySqlPool, PgPool, SqlitePool};

use crate::BoxError;
use crate::drain::{LoopShared, RunLimits, RunResult, run_loop};
use crate::scenario::Scenario;

/// A statement's text, cheap to hand to sqlx on every call.
type Sql = Arc<str>;

fn sql(s: String) -> Sql {
    s.into()
}

/// A statement for one call.
fn q(s: &Sql) -> AssertSqlSafe<Sql> {
    AssertSqlSafe(s.clone())
}

/// How many candidates an advisory worker reads per round.
fn candidate_limit(batch: usize) -> i64 {
    i64::try_from(batch.saturating_mul(4).max(16)).unwrap_or(i64::MAX)
}

fn limit(batch: usize) -> i64 {
    i64::try_from(batch).unwrap_or(i64::MAX)
}

/// Whether the server rolled the statement's transaction back as a deadlock victim (SQLSTATE
/// 40001: MySQL/MariaDB error 1213): a hand-written loop runs it again, as any correct loop on
/// InnoDB must (claims that lock with `SKIP LOCKED` and deletes of claimed rows can still meet
/// in a deadlock; seen once in CI on MariaDB lease at 8 workers, batch 16).
fn deadlocked(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("40001"))
}

/// Lease length the hand-written lease loops write (they finish long before it runs out).
const LEASE_SECONDS: i64 = 30;

/// Drains `table` on PostgreSQL with the hand-written loop of `scenario.mode`.
pub async fn postgres(
    pool: &PgPool,
    table: &str,
    scenario: &Scenario,
    limits: RunLimits,
) -> Result<RunResult, BoxError> {
    use broker_core::ClaimMode;
    let t = format!("\"{table}\"");
    let due = "(due_at IS NULL OR due_at <= now())";
    let batch = scenario.batch;
    match scenario.mode {
        ClaimMode::RowLock => {
            let select = sql(format!(
                "SELECT id, attempt, payload FROM {t} WHERE {due} ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
            ));
            let delete = sql(format!("DELETE FROM {t} WHERE id = $1"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let (pool, select, delete) = (pool.clone(), select.clone(), delete.clone());
                async move {
                    let mut conn = pool.acquire().await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let mut tx = conn.begin().await?;
                        let row: Option<(i64, i32, String)> =
                            sqlx::query_as(q(&select)).fetch_optional(&mut *tx).await?;
                        let Some((id, _, _payload)) = row else {
                            tx.rollback().await?;
                            sh.idle(idle).await;
                            continue;
                        };
                        sqlx::query(q(&delete)).bind(id).execute(&mut *tx).await?;
                        tx.commit().await?;
                        sh.acked_one();
                    }
                    Ok(())
                }
            })
            .await
        }
        ClaimMode::Lease => {
            let claim = sql(format!(
                "UPDATE {t} SET locked_until = now() + make_interval(secs => {LEASE_SECONDS}), \
                 attempt = attempt + 1 \
                 WHERE id IN (SELECT id FROM {t} \
                   WHERE (locked_until IS NULL OR locked_until < now()) AND {due} \
                   ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) \
                 RETURNING id, attempt, payload"
            ));
            let delete = sql(format!("DELETE FROM {t} WHERE id = $1 AND attempt = $2"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let (pool, claim, delete) = (pool.clone(), claim.clone(), delete.clone());
                async move {
                    let mut conn = pool.acquire().await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let rows: Vec<(i64, i32, String)> = sqlx::query_as(q(&claim))
                            .bind(limit(batch))
                            .fetch_all(&mut *conn)
                            .await?;
                        if rows.is_empty() {
                            sh.idle(idle).await;
                            continue;
                        }
                        for (id, attempt, _payload) in rows {
                            let done = sqlx::query(q(&delete))
                                .bind(id)
                                .bind(attempt)
                                .execute(&mut *conn)
                                .await?;
                            sh.fenced(id, done.rows_affected())?;
                        }
                    }
                    Ok(())
                }
            })
            .await
        }
        ClaimMode::Advisory => {
            let candidates = sql(format!(
                "SELECT id, k FROM {t} WHERE {due} ORDER BY id LIMIT $1"
            ));
            let take = sql(format!(
                "UPDATE {t} SET attempt = attempt + 1 WHERE id = $1 AND {due} \
                 RETURNING attempt, payload"
            ));
            let delete = sql(format!("DELETE FROM {t} WHERE id = $1"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let pool = pool.clone();
                let (candidates, take, delete) = (candidates.clone(), take.clone(), delete.clone());
                async move {
                    let mut conn = pool.acquire().await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let rows: Vec<(i64, String)> = sqlx::query_as(q(&candidates))
                            .bind(candidate_limit(batch))
                            .fetch_all(&mut *conn)
                            .await?;
                        let mut done = 0;
                        for (id, k) in rows {
                            if done >= batch || sh.finished() {
                                break;
                            }
                            let key = format!("k-{k}");
                            if !sh.reserve(&key) {
                                continue;
                            }
                            let r = async {
                                let locked: bool =
                                    sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
                                        .bind(&key)
                                        .fetch_one(&mut *conn)
                                        .await?;
                                if !locked {
                                    return Ok::<_, BoxError>(false);
                                }
                                let row: Option<(i32, String)> = sqlx::query_as(q(&take))
                                    .bind(id)
                                    .fetch_optional(&mut *conn)
                                    .await?;
                                if row.is_some() {
                                    sqlx::query(q(&delete)).bind(id).execute(&mut *conn).await?;
                                }
                                let _: bool =
                                    sqlx::query_scalar("SELECT pg_advisory_unlock(hashtext($1))")
                                        .bind(&key)
                                        .fetch_one(&mut *conn)
                                        .await?;
                                Ok(row.is_some())
                            }
                            .await;
                            sh.release(&key);
                            if r? {
                                done += 1;
                                sh.acked_one();
                            }
                        }
                        if done == 0 {
                            sh.idle(idle).await;
                        }
                    }
                    Ok(())
                }
            })
            .await
        }
        other => Err(format!("no hand-written loop for {other:?}").into()),
    }
}

/// Drains `table` on MySQL / MariaDB with the hand-written loop of `scenario.mode`.
pub async fn mysql(
    pool: &MySqlPool,
    table: &str,
    scenario: &Scenario,
    limits: RunLimits,
) -> Result<RunResult, BoxError> {
    use broker_core::ClaimMode;
    let t = format!("`{table}`");
    let due = "(due_at IS NULL OR due_at <= UTC_TIMESTAMP(6))";
    let batch = scenario.batch;
    match scenario.mode {
        ClaimMode::RowLock => {
            let select = sql(format!(
                "SELECT id, attempt, payload FROM {t} WHERE {due} ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
            ));
            let delete = sql(format!("DELETE FROM {t} WHERE id = ?"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let (pool, select, delete) = (pool.clone(), select.clone(), delete.clone());
                async move {
                    // The session's isolation level changes, so the connection leaves the pool
                    // and closes when the worker ends.
                    let mut conn = pool.acquire().await?.detach();
                    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .execute(&mut conn)
                        .await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let mut tx = conn.begin().await?;
                        let row: Option<(i64, i32, String)> =
                            sqlx::query_as(q(&select)).fetch_optional(&mut *tx).await?;
                        let Some((id, _, _payload)) = row else {
                            tx.rollback().await?;
                            sh.idle(idle).await;
                            continue;
                        };
                        sqlx::query(q(&delete)).bind(id).execute(&mut *tx).await?;
                        tx.commit().await?;
                        sh.acked_one();
                    }
                    conn.close().await?;
                    Ok(())
                }
            })
            .await
        }
        ClaimMode::Lease => {
            let select = sql(format!(
                "SELECT id, attempt, payload FROM {t} \
                 WHERE (locked_until IS NULL OR locked_until < UTC_TIMESTAMP(6)) AND {due} \
                 ORDER BY id LIMIT {n} FOR UPDATE SKIP LOCKED",
                // In the text, not bound: with `LIMIT ?` MariaDB plans the read without the
                // limit, sorts every due row and locks them all (13 ms a claim at 3,000 rows).
                n = limit(batch)
            ));
            let delete = sql(format!("DELETE FROM {t} WHERE id = ? AND attempt = ?"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let (pool, select, delete) = (pool.clone(), select.clone(), delete.clone());
                let t = t.clone();
                async move {
                    let mut conn = pool.acquire().await?.detach();
                    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .execute(&mut conn)
                        .await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let claimed = async {
                            let mut tx = conn.begin().await?;
                            let rows: Vec<(i64, i32, String)> =
                                sqlx::query_as(q(&select)).fetch_all(&mut *tx).await?;
                            if rows.is_empty() {
                                tx.rollback().await?;
                                return Ok(rows);
                            }
                            // One text per row count (at most the batch size), so each is
                            // prepared once and then served from the connection's statement
                            // cache.
                            let marks = vec!["?"; rows.len()].join(",");
                            let mut update = sqlx::query(AssertSqlSafe(format!(
                                "UPDATE {t} SET locked_until = UTC_TIMESTAMP(6) + INTERVAL {LEASE_SECONDS} SECOND, \
                                 attempt = attempt + 1 WHERE id IN ({marks})"
                            )));
                            for r in &rows {
                                update = update.bind(r.0);
                            }
                            update.execute(&mut *tx).await?;
                            tx.commit().await?;
                            Ok::<_, sqlx::Error>(rows)
                        }
                        .await;
                        let rows = match claimed {
                            Ok(rows) => rows,
                            // Rolled back: nothing was claimed; claim again.
                            Err(e) if deadlocked(&e) => continue,
                            Err(e) => return Err(e.into()),
                        };
                        if rows.is_empty() {
                            sh.idle(idle).await;
                            continue;
                        }
                        for (id, attempt, _payload) in rows {
                            // Fenced on the claim's attempt, so running it again is safe.
                            let done = loop {
                                match sqlx::query(q(&delete))
                                    .bind(id)
                                    .bind(attempt + 1)
                                    .execute(&mut conn)
                                    .await
                                {
                                    Err(e) if deadlocked(&e) => continue,
                                    other => break other?,
                                }
                            };
                            sh.fenced(id, done.rows_affected())?;
                        }
                    }
                    conn.close().await?;
                    Ok(())
                }
            })
            .await
        }
        ClaimMode::Advisory => {
            let candidates = sql(format!(
                "SELECT id, k FROM {t} WHERE {due} ORDER BY id LIMIT ?"
            ));
            let take = sql(format!(
                "UPDATE {t} SET attempt = attempt + 1 WHERE id = ? AND {due}"
            ));
            let read = sql(format!("SELECT attempt, payload FROM {t} WHERE id = ?"));
            let delete = sql(format!("DELETE FROM {t} WHERE id = ?"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let pool = pool.clone();
                let (candidates, take, read, delete) = (
                    candidates.clone(),
                    take.clone(),
                    read.clone(),
                    delete.clone(),
                );
                async move {
                    let mut conn = pool.acquire().await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let rows: Vec<(i64, String)> = sqlx::query_as(q(&candidates))
                            .bind(candidate_limit(batch))
                            .fetch_all(&mut *conn)
                            .await?;
                        let mut done = 0;
                        for (id, k) in rows {
                            if done >= batch || sh.finished() {
                                break;
                            }
                            let key = format!("k-{k}");
                            if !sh.reserve(&key) {
                                continue;
                            }
                            let r = async {
                                let locked: Option<i64> =
                                    sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
                                        .bind(&key)
                                        .fetch_one(&mut *conn)
                                        .await?;
                                if locked != Some(1) {
                                    return Ok::<_, BoxError>(false);
                                }
                                let mut taken = false;
                                for tries in 1.. {
                                    match sqlx::query(q(&take)).bind(id).execute(&mut *conn).await {
                                        Ok(done) => {
                                            taken = done.rows_affected() == 1;
                                            break;
                                        }
                                        Err(e) if tries < 5 && mysql_deadlock(&e) => continue,
                                        Err(e) => return Err(e.into()),
                                    }
                                }
                                if taken {
                                    let _row: (i32, String) = sqlx::query_as(q(&read))
                                        .bind(id)
                                        .fetch_one(&mut *conn)
                                        .await?;
                                    for tries in 1.. {
                                        match sqlx::query(q(&delete))
                                            .bind(id)
                                            .execute(&mut *conn)
                                            .await
                                        {
                                            Ok(_) => break,
                                            Err(e) if tries < 5 && mysql_deadlock(&e) => continue,
                                            Err(e) => return Err(e.into()),
                                        }
                                    }
                                }
                                let _: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
                                    .bind(&key)
                                    .fetch_one(&mut *conn)
                                    .await?;
                                Ok(taken)
                            }
                            .await;
                            sh.release(&key);
                            if r? {
                                done += 1;
                                sh.acked_one();
                            }
                        }
                        if done == 0 {
                            sh.idle(idle).await;
                        }
                    }
                    Ok(())
                }
            })
            .await
        }
        other => Err(format!("no hand-written loop for {other:?}").into()),
    }
}

/// Whether InnoDB chose this statement as a deadlock's victim (1213): it rolled back, so an
/// autocommit statement simply runs again, as any MySQL client loop must allow for.
fn mysql_deadlock(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(|m| m.number()) == Some(1213))
}

/// Drains `table` on SQLite with the hand-written loop of `scenario.mode` (row lock is not
/// offered there). The limits are written in as literals: the batch is fixed for the run, and a
/// bound whole `LIMIT` makes SQLite 3.51 prepare the statement again on every execution (see
/// the lease claim in `broker-sqlite`), which would slow this baseline for no reason a careful
/// engineer keeps.
pub async fn sqlite(
    pool: &SqlitePool,
    table: &str,
    scenario: &Scenario,
    limits: RunLimits,
) -> Result<RunResult, BoxError> {
    use broker_core::ClaimMode;
    let t = format!("\"{table}\"");
    let due = "(due_at IS NULL OR due_at <= ?1)";
    let batch = scenario.batch;
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    };
    match scenario.mode {
        ClaimMode::RowLock => Err("SQLite has no row lock mode".into()),
        ClaimMode::Lease => {
            let claim = sql(format!(
                "UPDATE {t} SET locked_until = ?2, attempt = attempt + 1 \
                 WHERE id IN (SELECT id FROM {t} \
                   WHERE (locked_until IS NULL OR locked_until < ?1) AND {due} \
                   ORDER BY id LIMIT {n}) \
                 RETURNING id, attempt, payload",
                n = limit(batch)
            ));
            let delete = sql(format!("DELETE FROM {t} WHERE id = ? AND attempt = ?"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let (pool, claim, delete) = (pool.clone(), claim.clone(), delete.clone());
                async move {
                    let mut conn = pool.acquire().await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let now = now_ms();
                        let rows: Vec<(i64, i64, String)> = sqlx::query_as(q(&claim))
                            .bind(now)
                            .bind(now + LEASE_SECONDS * 1000)
                            .fetch_all(&mut *conn)
                            .await?;
                        if rows.is_empty() {
                            sh.idle(idle).await;
                            continue;
                        }
                        for (id, attempt, _payload) in rows {
                            let done = sqlx::query(q(&delete))
                                .bind(id)
                                .bind(attempt)
                                .execute(&mut *conn)
                                .await?;
                            sh.fenced(id, done.rows_affected())?;
                        }
                    }
                    Ok(())
                }
            })
            .await
        }
        ClaimMode::Advisory => {
            let candidates = sql(format!(
                "SELECT id, k FROM {t} WHERE {due} ORDER BY id LIMIT {n}",
                n = candidate_limit(batch)
            ));
            let take = sql(format!(
                "UPDATE {t} SET attempt = attempt + 1 WHERE id = ?2 AND {due} \
                 RETURNING attempt, payload"
            ));
            let delete = sql(format!("DELETE FROM {t} WHERE id = ?"));
            run_loop(scenario, limits, move |sh: Arc<LoopShared>| {
                let pool = pool.clone();
                let (candidates, take, delete) = (candidates.clone(), take.clone(), delete.clone());
                async move {
                    let mut conn = pool.acquire().await?;
                    while !sh.finished() {
                        let idle = sh.idle_signal();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        let rows: Vec<(i64, String)> = sqlx::query_as(q(&candidates))
                            .bind(now_ms())
                            .fetch_all(&mut *conn)
                            .await?;
                        let mut done = 0;
                        for (id, k) in rows {
                            if done >= batch || sh.finished() {
                                break;
                            }
                            // One process on the file: the in-process key set is the lock.
                            let key = format!("k-{k}");
                            if !sh.reserve(&key) {
                                continue;
                            }
                            let r = async {
                                let row: Option<(i64, String)> = sqlx::query_as(q(&take))
                                    .bind(now_ms())
                                    .bind(id)
                                    .fetch_optional(&mut *conn)
                                    .await?;
                                if row.is_some() {
                                    sqlx::query(q(&delete)).bind(id).execute(&mut *conn).await?;
                                }
                                Ok::<_, BoxError>(row.is_some())
                            }
                            .await;
                            sh.release(&key);
                            if r? {
                                done += 1;
                                sh.acked_one();
                            }
                        }
                        if done == 0 {
                            sh.idle(idle).await;
                        }
                    }
                    Ok(())
                }
            })
            .await
        }
        other => Err(format!("no hand-written loop for {other:?}").into()),
    }
}

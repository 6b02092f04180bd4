//! The schedule tables: registered schedules and the ticks published (see
//! [`broker_core::Schedule`]).

use broker_core::driver::{SCHEDULES_TABLE, ScheduleRow, TICKS_TABLE};
use broker_core::{Result, SqlxBrokerError};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::sql::on_pool;

/// The DDL of the schedule tables, shared by every queue of the database.
pub(crate) fn ddl() -> [String; 2] {
    [
        format!(
            "CREATE TABLE IF NOT EXISTS {SCHEDULES_TABLE} (name TEXT PRIMARY KEY, queue TEXT NOT NULL, \
             expression TEXT NOT NULL, time_zone TEXT NOT NULL, last_tick_ms BIGINT)"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {TICKS_TABLE} (schedule TEXT NOT NULL, tick_ms BIGINT NOT NULL, \
             PRIMARY KEY (schedule, tick_ms))"
        ),
    ]
}

fn err(e: sqlx::Error) -> SqlxBrokerError {
    SqlxBrokerError::statement("", "schedule", e)
}

type Row = (String, String, String, String, Option<i64>);

fn row((name, queue, expression, time_zone, last): Row) -> ScheduleRow {
    ScheduleRow::new(name, queue, expression, time_zone, last)
}

pub(crate) async fn register(
    pool: &PgPool,
    prepared: bool,
    s: &ScheduleRow,
) -> Result<ScheduleRow> {
    // One statement: insert unless the name exists, then read what is stored (the insert's row
    // or the existing one; the CTE's row is invisible to the outer read, hence the UNION).
    let q = sqlx::query_as::<_, Row>(AssertSqlSafe(format!(
        "WITH ins AS (INSERT INTO {SCHEDULES_TABLE} (name, queue, expression, time_zone) \
         VALUES ($1::text, $2::text, $3::text, $4::text) ON CONFLICT DO NOTHING \
         RETURNING name, queue, expression, time_zone, last_tick_ms) \
         SELECT * FROM ins UNION ALL \
         SELECT name, queue, expression, time_zone, last_tick_ms FROM {SCHEDULES_TABLE} \
         WHERE name = $1::text AND NOT EXISTS (SELECT 1 FROM ins)"
    )))
    .persistent(prepared)
    .bind(s.name.clone())
    .bind(s.queue.clone())
    .bind(s.expression.clone())
    .bind(s.time_zone.clone());
    let found = on_pool(pool, prepared, |c| Box::pin(q.fetch_optional(c)))
        .await
        .map_err(err)?;
    match found {
        Some(found) => Ok(row(found)),
        // A concurrent registration committed after this statement's snapshot: read again.
        None => {
            let q = sqlx::query_as::<_, Row>(AssertSqlSafe(format!(
                "SELECT name, queue, expression, time_zone, last_tick_ms FROM {SCHEDULES_TABLE} WHERE name = $1::text"
            )))
            .persistent(prepared)
            .bind(s.name.clone());
            on_pool(pool, prepared, |c| Box::pin(q.fetch_one(c)))
                .await
                .map(row)
                .map_err(err)
        }
    }
}

pub(crate) async fn record_tick(
    conn: &mut PgConnection,
    prepared: bool,
    name: &str,
    tick_ms: i64,
    prune_before_ms: i64,
) -> Result<bool> {
    // The primary key decides: an insert of a tick another transaction is recording waits for
    // it, then inserts nothing if it committed.
    let done = sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {TICKS_TABLE} (schedule, tick_ms) VALUES ($1::text, $2::int8) ON CONFLICT DO NOTHING"
    )))
    .persistent(prepared)
    .bind(name)
    .bind(tick_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {SCHEDULES_TABLE} SET last_tick_ms = GREATEST(COALESCE(last_tick_ms, $2::int8), $2::int8) \
         WHERE name = $1::text"
    )))
    .persistent(prepared)
    .bind(name)
    .bind(tick_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {TICKS_TABLE} WHERE schedule = $1::text AND tick_ms < $2::int8"
    )))
    .persistent(prepared)
    .bind(name)
    .bind(prune_before_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    Ok(true)
}

pub(crate) async fn list(pool: &PgPool, prepared: bool) -> Result<Vec<ScheduleRow>> {
    let q = sqlx::query_scalar::<_, bool>(AssertSqlSafe(format!(
        "SELECT to_regclass('{SCHEDULES_TABLE}') IS NOT NULL"
    )))
    .persistent(prepared);
    if !on_pool(pool, prepared, |c| Box::pin(q.fetch_one(c)))
        .await
        .map_err(err)?
    {
        return Ok(Vec::new());
    }
    let q = sqlx::query_as::<_, Row>(AssertSqlSafe(format!(
        "SELECT name, queue, expression, time_zone, last_tick_ms FROM {SCHEDULES_TABLE} ORDER BY name"
    )))
    .persistent(prepared);
    let rows = on_pool(pool, prepared, |c| Box::pin(q.fetch_all(c)))
        .await
        .map_err(err)?;
    Ok(rows.into_iter().map(row).collect())
}

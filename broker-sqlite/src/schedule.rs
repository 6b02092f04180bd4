//! The schedule tables: registered schedules and the ticks published (see
//! [`broker_core::Schedule`]).

use broker_core::driver::{SCHEDULES_TABLE, ScheduleRow, TICKS_TABLE};
use broker_core::{Result, SqlxBrokerError};
use sqlx::{SqliteConnection, SqlitePool};

/// The DDL of the schedule tables, shared by every queue of the database.
pub(crate) fn ddl() -> [String; 2] {
    [
        format!(
            "CREATE TABLE IF NOT EXISTS {SCHEDULES_TABLE} (name TEXT PRIMARY KEY, queue TEXT NOT NULL, \
             expression TEXT NOT NULL, time_zone TEXT NOT NULL, last_tick_ms INTEGER)"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {TICKS_TABLE} (schedule TEXT NOT NULL, tick_ms INTEGER NOT NULL, \
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

pub(crate) async fn register(pool: &SqlitePool, s: &ScheduleRow) -> Result<ScheduleRow> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {SCHEDULES_TABLE} (name, queue, expression, time_zone) VALUES (?1, ?2, ?3, ?4) \
         ON CONFLICT DO NOTHING"
    )))
    .bind(&s.name)
    .bind(&s.queue)
    .bind(&s.expression)
    .bind(&s.time_zone)
    .execute(pool)
    .await
    .map_err(err)?;
    let found: Row = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT name, queue, expression, time_zone, last_tick_ms FROM {SCHEDULES_TABLE} WHERE name = ?1"
    )))
    .bind(&s.name)
    .fetch_one(pool)
    .await
    .map_err(err)?;
    Ok(row(found))
}

pub(crate) async fn record_tick(
    conn: &mut SqliteConnection,
    name: &str,
    tick_ms: i64,
    prune_before_ms: i64,
) -> Result<bool> {
    // The primary key decides: a tick another transaction recorded inserts nothing.
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {TICKS_TABLE} (schedule, tick_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING"
    )))
    .bind(name)
    .bind(tick_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {SCHEDULES_TABLE} SET last_tick_ms = max(coalesce(last_tick_ms, ?2), ?2) WHERE name = ?1"
    )))
    .bind(name)
    .bind(tick_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {TICKS_TABLE} WHERE schedule = ?1 AND tick_ms < ?2"
    )))
    .bind(name)
    .bind(prune_before_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    Ok(true)
}

pub(crate) async fn list(pool: &SqlitePool) -> Result<Vec<ScheduleRow>> {
    let found: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1")
            .bind(SCHEDULES_TABLE)
            .fetch_one(pool)
            .await
            .map_err(err)?;
    if found == 0 {
        return Ok(Vec::new());
    }
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT name, queue, expression, time_zone, last_tick_ms FROM {SCHEDULES_TABLE} ORDER BY name"
    )))
    .fetch_all(pool)
    .await
    .map_err(err)?;
    Ok(rows.into_iter().map(row).collect())
}

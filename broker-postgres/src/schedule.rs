//! The schedule tables: registered schedules and the ticks published (see
//! [`broker_core::Schedule`]); the core runs these statements
//! ([`ScheduleStatements`]).

use std::sync::LazyLock;

use broker_core::driver::{SCHEDULES_TABLE, ScheduleStatements, TICKS_TABLE, TickParam};
use sqlx::Postgres;
use sqlx::postgres::PgQueryResult;

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

const COLUMNS: &str = "name, queue, expression, time_zone, last_tick_ms";

/// The schedule statements, built once.
pub(crate) static STATEMENTS: LazyLock<ScheduleStatements<Postgres>> = LazyLock::new(|| {
    ScheduleStatements {
        // One statement: insert unless the name exists, then read what is stored (the insert's
        // row or the existing one; the CTE's row is invisible to the outer read, hence the
        // UNION).
        register: format!(
            "WITH ins AS (INSERT INTO {SCHEDULES_TABLE} (name, queue, expression, time_zone) \
             VALUES ($1::text, $2::text, $3::text, $4::text) ON CONFLICT DO NOTHING \
             RETURNING {COLUMNS}) \
             SELECT * FROM ins UNION ALL \
             SELECT {COLUMNS} FROM {SCHEDULES_TABLE} \
             WHERE name = $1::text AND NOT EXISTS (SELECT 1 FROM ins)"
        ),
        read: format!("SELECT {COLUMNS} FROM {SCHEDULES_TABLE} WHERE name = $1::text"),
        record_tick: format!(
            "INSERT INTO {TICKS_TABLE} (schedule, tick_ms) VALUES ($1::text, $2::int8) ON CONFLICT DO NOTHING"
        ),
        raise_last_tick: format!(
            "UPDATE {SCHEDULES_TABLE} SET last_tick_ms = GREATEST(COALESCE(last_tick_ms, $2::int8), $2::int8) \
             WHERE name = $1::text"
        ),
        raise_params: &[TickParam::Name, TickParam::Tick],
        prune_ticks: format!(
            "DELETE FROM {TICKS_TABLE} WHERE schedule = $1::text AND tick_ms < $2::int8"
        ),
        // count() of a NULL is 0: the table is not on the search path.
        exists: "SELECT count(to_regclass($1::text))".to_owned(),
        list: format!("SELECT {COLUMNS} FROM {SCHEDULES_TABLE} ORDER BY name"),
        rows_affected: PgQueryResult::rows_affected,
    }
});

//! The schedule tables: registered schedules and the ticks published (see
//! [`broker_core::Schedule`]); the core runs these statements
//! ([`ScheduleStatements`]).

use std::sync::LazyLock;

use broker_core::driver::{SCHEDULES_TABLE, ScheduleStatements, TICKS_TABLE, TickParam};
use sqlx::Sqlite;
use sqlx::sqlite::SqliteQueryResult;

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

const COLUMNS: &str = "name, queue, expression, time_zone, last_tick_ms";

/// The schedule statements, built once.
pub(crate) static STATEMENTS: LazyLock<ScheduleStatements<Sqlite>> = LazyLock::new(|| {
    ScheduleStatements {
        // Returns no row: the core reads the stored one.
        register: format!(
            "INSERT INTO {SCHEDULES_TABLE} (name, queue, expression, time_zone) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT DO NOTHING"
        ),
        read: format!("SELECT {COLUMNS} FROM {SCHEDULES_TABLE} WHERE name = ?1"),
        record_tick: format!(
            "INSERT INTO {TICKS_TABLE} (schedule, tick_ms) VALUES (?1, ?2) ON CONFLICT DO NOTHING"
        ),
        raise_last_tick: format!(
            "UPDATE {SCHEDULES_TABLE} SET last_tick_ms = max(coalesce(last_tick_ms, ?2), ?2) WHERE name = ?1"
        ),
        raise_params: &[TickParam::Name, TickParam::Tick],
        prune_ticks: format!("DELETE FROM {TICKS_TABLE} WHERE schedule = ?1 AND tick_ms < ?2"),
        exists: "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1".to_owned(),
        list: format!("SELECT {COLUMNS} FROM {SCHEDULES_TABLE} ORDER BY name"),
        rows_affected: SqliteQueryResult::rows_affected,
    }
});

//! The schedule tables: registered schedules and the ticks published (see
//! [`broker_core::Schedule`]); the core runs these statements
//! ([`ScheduleStatements`]).

use std::sync::LazyLock;

use broker_core::driver::{SCHEDULES_TABLE, ScheduleStatements, TICKS_TABLE, TickParam};
use sqlx::MySql;
use sqlx::mysql::MySqlQueryResult;

/// The DDL of the schedule tables, shared by every queue of the database. Names compare as
/// bytes (`utf8mb4_bin`), as the core compares them.
pub(crate) fn ddl() -> [String; 2] {
    [
        format!(
            "CREATE TABLE IF NOT EXISTS {SCHEDULES_TABLE} (name VARCHAR(200) CHARACTER SET utf8mb4 \
             COLLATE utf8mb4_bin NOT NULL PRIMARY KEY, queue VARCHAR(255) NOT NULL, \
             expression VARCHAR(255) NOT NULL, time_zone VARCHAR(64) NOT NULL, last_tick_ms BIGINT NULL) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {TICKS_TABLE} (schedule VARCHAR(200) CHARACTER SET utf8mb4 \
             COLLATE utf8mb4_bin NOT NULL, tick_ms BIGINT NOT NULL, PRIMARY KEY (schedule, tick_ms)) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        ),
    ]
}

const COLUMNS: &str = "CAST(name AS CHAR), CAST(queue AS CHAR), CAST(expression AS CHAR), \
                       CAST(time_zone AS CHAR), last_tick_ms";

/// The schedule statements, built once.
pub(crate) static STATEMENTS: LazyLock<ScheduleStatements<MySql>> = LazyLock::new(|| {
    ScheduleStatements {
        // INSERT IGNORE is safe here: the core bounds every value below its column's length, so
        // the only error it turns into a warning is the duplicate name. It returns no row: the
        // core reads the stored one.
        register: format!(
            "INSERT IGNORE INTO {SCHEDULES_TABLE} (name, queue, expression, time_zone) VALUES (?, ?, ?, ?)"
        ),
        read: format!("SELECT {COLUMNS} FROM {SCHEDULES_TABLE} WHERE name = ?"),
        // The insert of a tick another transaction is recording waits for its lock.
        record_tick: format!("INSERT IGNORE INTO {TICKS_TABLE} (schedule, tick_ms) VALUES (?, ?)"),
        raise_last_tick: format!(
            "UPDATE {SCHEDULES_TABLE} SET last_tick_ms = GREATEST(COALESCE(last_tick_ms, ?), ?) WHERE name = ?"
        ),
        raise_params: &[TickParam::Tick, TickParam::Tick, TickParam::Name],
        prune_ticks: format!("DELETE FROM {TICKS_TABLE} WHERE schedule = ? AND tick_ms < ?"),
        exists: "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?"
            .to_owned(),
        list: format!("SELECT {COLUMNS} FROM {SCHEDULES_TABLE} ORDER BY name"),
        rows_affected: MySqlQueryResult::rows_affected,
    }
});

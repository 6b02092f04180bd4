//! FIFO groups on MySQL and MariaDB: a row is claimable only while it is the first unfinished row
//! of its group, and a locking read of the group's earlier unfinished rows guards the claim.
//!
//! Two checks, because each covers what the other cannot:
//!
//! - **The head condition** (`NOT EXISTS` an earlier unfinished row of the group) sits in every
//!   claim's `WHERE`. Inside `SELECT .. FOR UPDATE SKIP LOCKED` the subquery is a consistent
//!   (non-locking) read on both servers, so a head that another delivery holds locked is still
//!   *seen*: it is skipped as a candidate, and the rows behind it are not heads. Without that,
//!   `SKIP LOCKED` would hide the in-work head and hand out the second row.
//! - **The guard** runs in the claim's transaction for each claimed row with a group, after the
//!   row is locked: `SELECT .. FROM t WHERE group = ? AND id < ? AND unfinished .. FOR UPDATE
//!   NOWAIT`. A locking read sees the latest committed rows, not the statement's snapshot, and
//!   waits for none: it catches an earlier row the snapshot missed (a publish that took a lower
//!   id but committed later, or a row another broker is claiming right now). When it finds one,
//!   or finds one locked, the row is not taken this time; a later claim takes it in order.
//!   `NOWAIT` rather than waiting, because in row lock mode the group's head stays locked for as
//!   long as its handler runs.
//!
//! The guard reads the group through an index that starts with the group column (the DDL helper
//! creates `sqlx_broker_group`); startup refuses a FIFO table without one, because a scan without
//! it would lock rows of other groups and give up whenever any of them is in work.
//!
//! In advisory mode the head is held by its key lock, not a row lock: the take re-reads the row
//! under `FOR UPDATE NOWAIT` with the head condition, runs the guard, and counts the attempt, in
//! one transaction. (MySQL refuses a subquery on the table an `UPDATE` changes, error 1093, so the
//! take cannot be one `UPDATE .. WHERE NOT EXISTS (..)` as it is on SQLite.)

use broker_core::{Result, SqlxBrokerError, TableDescription};
use sqlx::{MySqlConnection, Row};

use crate::sql::error_number;
use crate::sql::{Args, GROUP_ALIAS, P, Sql, Stmt, ident};

/// The alias of the table inside the head subquery and the guard; unusual, so no user table
/// shadows it.
const HEAD: &str = "sqlx_broker_head";

/// The name of the group index the DDL helper creates.
pub(crate) const GROUP_INDEX: &str = "sqlx_broker_group";

/// The condition that a row of the claim's table is the head of its group, for FIFO tables.
/// Rows without a group are not ordered.
pub(crate) fn head_condition(t: &TableDescription) -> Option<String> {
    if !t.fifo() {
        return None;
    }
    let group = ident(t.group()?);
    let table = ident(t.name());
    let id = ident(t.id());
    let mut unfinished = String::new();
    for c in t.unfinished_columns() {
        unfinished.push_str(&format!(" AND {HEAD}.{} IS NULL", ident(c)));
    }
    Some(format!(
        "NOT EXISTS (SELECT 1 FROM {table} AS {HEAD} WHERE {HEAD}.{group} = {table}.{group} \
         AND {HEAD}.{id} < {table}.{id}{unfinished})"
    ))
}

/// The guard statement of a FIFO table (parameters: the group, the claimed row's id), reading
/// through `index` (see [`crate::schema::group_index`]). `FORCE INDEX`: on a small table the
/// optimizer would rather read the primary key range `id < ?`, locking (and, with `NOWAIT`,
/// failing on) rows of every group.
pub(crate) fn guard(t: &TableDescription, index: Option<&str>) -> Option<Stmt> {
    if !t.fifo() {
        return None;
    }
    let group = ident(t.group()?);
    let table = ident(t.name());
    let id = ident(t.id());
    let mut unfinished = String::new();
    for c in t.unfinished_columns() {
        unfinished.push_str(&format!(" AND {HEAD}.{} IS NULL", ident(c)));
    }
    // -- needs NOWAIT: MySQL 8.0.1, MariaDB 10.3
    Some(
        Sql::new(format!(
            "SELECT CAST({HEAD}.{id} AS SIGNED) FROM {table} AS {HEAD} FORCE INDEX ({}) \
             WHERE {HEAD}.{group} = ",
            ident(index?)
        ))
        .param(P::Group)
        .push(&format!(" AND {HEAD}.{id} < "))
        .param(P::Id)
        .push(&format!("{unfinished} LIMIT 1 FOR UPDATE NOWAIT"))
        .stmt("fifo guard"),
    )
}

/// What the guard found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Guard {
    /// No earlier unfinished row: the row is its group's head.
    Clear,
    /// An earlier unfinished row exists, or is locked: leave the row for a later claim.
    Behind,
}

/// Runs the guard for a claimed row (inside the claim's transaction). A row without a group
/// passes.
pub(crate) async fn check(
    conn: &mut MySqlConnection,
    guard: &Stmt,
    table: &str,
    row: &sqlx::mysql::MySqlRow,
    id: i64,
) -> Result<Guard> {
    let group: Option<String> = row
        .try_get(GROUP_ALIAS)
        .map_err(|e| SqlxBrokerError::statement(table, "claim", e))?;
    let Some(group) = group else {
        return Ok(Guard::Clear);
    };
    let args = Args {
        id,
        group: Some(&group),
        ..Args::default()
    };
    match guard.bind(&args).fetch_optional(conn).await {
        Ok(None) => Ok(Guard::Clear),
        Ok(Some(_)) => Ok(Guard::Behind),
        Err(e) if is_busy(&e) => Ok(Guard::Behind),
        Err(e) => Err(SqlxBrokerError::statement(table, guard.name, e)),
    }
}

/// Whether a `NOWAIT` read found its row locked (MySQL reports 3572; MariaDB reports a lock wait
/// timeout, 1205).
pub(crate) fn is_busy(e: &sqlx::Error) -> bool {
    matches!(error_number(e), Some(3572 | 1205))
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker_core::{ColumnType, DeadLetter};

    #[test]
    fn the_head_condition_and_guard_read_only_unfinished_rows_of_the_group() {
        let t = TableDescription::builder("jobs")
            .payload("payload", ColumnType::Text)
            .group("grp")
            .fifo(true)
            .processed_at("done")
            .max_attempts(3)
            .dead_letter(DeadLetter::Column("dead".into()))
            .build()
            .unwrap();
        let head = head_condition(&t).unwrap();
        assert!(
            head.contains("sqlx_broker_head.`grp` = `jobs`.`grp`"),
            "{head}"
        );
        assert!(head.contains("sqlx_broker_head.`done` IS NULL"), "{head}");
        assert!(head.contains("sqlx_broker_head.`dead` IS NULL"), "{head}");
        let guard = guard(&t, Some("sqlx_broker_group")).unwrap();
        assert!(
            guard.sql().ends_with("FOR UPDATE NOWAIT"),
            "{}",
            guard.sql()
        );
        let plain = TableDescription::builder("jobs")
            .group("grp")
            .build()
            .unwrap();
        assert!(head_condition(&plain).is_none() && super::guard(&plain, Some("i")).is_none());
        assert!(
            guard.sql().contains("FORCE INDEX (`sqlx_broker_group`)"),
            "{}",
            guard.sql()
        );
    }
}

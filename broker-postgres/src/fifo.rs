//! FIFO groups on PostgreSQL: a row is claimable only while it is the first unfinished row of its
//! group, and a claim takes a row only under its group's guard, a transaction-level advisory
//! lock on the hash of table and group (`pg_try_advisory_xact_lock`, try-variant: a claim skips a
//! guarded group, never waits for it).
//!
//! The head condition alone keeps a group in order while its head is in work (the head is still
//! unfinished, so the next row is no head). The guard makes that hold across brokers at the
//! moment of the claim too, and in row lock mode it lasts as long as the delivery's transaction:
//! while a head is in work its whole group is skipped before any row of it is even looked at.
//! Rows without a group are not ordered and take no guard.

use broker_core::{DeadLetter, TableDescription};

use crate::sql::{Statements, ident};

/// The condition that the row `q` is the head of its group, for FIFO tables.
pub(crate) fn head_condition(t: &TableDescription) -> Option<String> {
    if !t.fifo() {
        return None;
    }
    let group = ident(t.group()?);
    let table = ident(t.name());
    let id = ident(t.id());
    let mut unfinished = String::new();
    if let Some(c) = t.processed_at() {
        unfinished.push_str(&format!(" AND h.{} IS NULL", ident(c)));
    }
    if let Some(DeadLetter::Column(c)) = t.dead_letter() {
        unfinished.push_str(&format!(" AND h.{} IS NULL", ident(c)));
    }
    Some(format!(
        "NOT EXISTS (SELECT 1 FROM {table} AS h WHERE h.{group} = q.{group} AND h.{id} < q.{id}{unfinished})"
    ))
}

/// The guard key of a table's groups: bound as the prefix of `hashtextextended(prefix || group)`.
pub(crate) fn guard_prefix(t: &TableDescription) -> String {
    format!("{}:", t.name())
}

/// A CTE `sqlx_broker_cand (id)`: claimable rows `q` (with `extra` conditions) in claim order,
/// at most `window` of them, then those whose group guard this transaction takes, at most
/// `take`. `prefix` is the parameter holding [`guard_prefix`].
///
/// The inner select is fenced with `OFFSET 0` and the guard sits in the outer `WHERE` with its
/// own `LIMIT`: the planner cannot push the lock into the scan of every due row (which would
/// guard every group it passes), and the guard is tried row by row in claim order only until
/// `take` rows hold one. A CTE with a volatile function is evaluated once, never inlined.
pub(crate) fn candidates(
    s: &Statements,
    group: &str,
    extra: &str,
    window: &str,
    take: &str,
    prefix: &str,
) -> String {
    format!(
        "sqlx_broker_cand AS (SELECT c.id FROM \
         (SELECT q.{id} AS id, q.{g} AS g FROM {t} AS q WHERE {claimable}{extra} ORDER BY {order} LIMIT {window} OFFSET 0) AS c \
         WHERE c.g IS NULL OR pg_try_advisory_xact_lock(hashtextextended({prefix}::text || c.g::text, 0)) \
         LIMIT {take})",
        id = s.id,
        g = ident(group),
        t = s.table,
        claimable = s.claimable,
        order = s.order,
    )
}

/// How many rows a FIFO claim looks at to find `limit` heads whose groups are free.
pub(crate) fn window(limit: usize) -> i64 {
    i64::try_from(limit.saturating_mul(4).max(64)).unwrap_or(i64::MAX)
}

//! FIFO groups on SQLite: a row is claimable only while it is the first unfinished row of its
//! group. No guard lock is needed: SQLite has one writer at a time, so two claims never interleave
//! between reading the head and taking it.

use broker_core::{DeadLetter, TableDescription};

use crate::sql::ident;

/// The condition that a row (`t` in the claim) is the head of its group, for FIFO tables. Rows
/// without a group are not ordered.
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
        "NOT EXISTS (SELECT 1 FROM {table} AS h WHERE h.{group} = {table}.{group} AND h.{id} < {table}.{id}{unfinished})"
    ))
}

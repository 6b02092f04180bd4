//! FIFO groups on SQLite: a row is claimable only while it is the first unfinished row of its
//! group. No guard lock is needed: SQLite has one writer at a time, so two claims never interleave
//! between reading the head and taking it.

use broker_core::TableDescription;

use crate::sql::{Statements, ident};

/// `AND` conditions that the row `alias` is unfinished (not processed, not dead); empty when
/// every row in the table is.
fn unfinished(t: &TableDescription, alias: &str) -> String {
    t.unfinished_columns()
        .into_iter()
        .map(|c| format!(" AND {alias}.{} IS NULL", ident(c)))
        .collect()
}

/// The condition that a row (`t` in the claim) is the head of its group, for FIFO tables. Rows
/// without a group are not ordered.
pub(crate) fn head_condition(t: &TableDescription) -> Option<String> {
    if !t.fifo() {
        return None;
    }
    let group = ident(t.group()?);
    let table = ident(t.name());
    let id = ident(t.id());
    let unfinished = unfinished(t, "h");
    Some(format!(
        "NOT EXISTS (SELECT 1 FROM {table} AS h WHERE h.{group} = {table}.{group} AND h.{id} < {table}.{id}{unfinished})"
    ))
}

/// The ids a FIFO claim takes, at most `take` (a parameter or literal), as a subquery: rows
/// without a group first, in the claim order (through the claim index over them), then the
/// heads of groups that are due and free, visiting the groups from just after `cursor` (a
/// parameter: the group the last claim took, NULL at first) to the last and then from the first
/// up to `cursor` ([`GroupCursor`](broker_core::driver::GroupCursor)).
///
/// The walk is a loose index scan: each step is one probe of the group index for the next
/// group, and each group costs one more probe for its head (its first unfinished row), which is
/// taken only if it is claimable. So a group's backlog costs one probe however many rows it
/// holds. The walk must run as a co-routine that the outer `LIMIT` stops: SQLite 3.51 (the one
/// sqlx bundles) materialized it (every group first, 15 ms on 10,000 groups) inside the claim's
/// `IN (..)` unless told `NOT MATERIALIZED` (SQLite 3.35, as `RETURNING`), and any join on it
/// materializes it too, which is why the head is a scalar subquery that yields its id only when
/// the head is claimable.
pub(crate) fn head_candidates(
    s: &Statements,
    t: &TableDescription,
    group: &str,
    take: &str,
    cursor: &str,
) -> String {
    let (tbl, id, g) = (&s.table, &s.id, ident(group));
    let unf_n = unfinished(t, "n");
    let next = |after: &str| {
        format!(
            "(SELECT n.{g} FROM {tbl} AS n WHERE n.{g} > {after}{unf_n} ORDER BY n.{g} LIMIT 1)"
        )
    };
    let first = format!(
        "(SELECT n.{g} FROM {tbl} AS n WHERE n.{g} IS NOT NULL{unf_n} ORDER BY n.{g} LIMIT 1)"
    );
    format!(
        "WITH RECURSIVE sqlx_broker_walk (g, wrapped) AS NOT MATERIALIZED (\
         SELECT {first_after}, 0 \
         UNION ALL SELECT CASE WHEN w.g IS NULL THEN {first} ELSE {step} END, \
         CASE WHEN w.g IS NULL THEN 1 ELSE w.wrapped END FROM sqlx_broker_walk AS w \
         WHERE (w.g IS NOT NULL OR w.wrapped = 0) AND (w.wrapped = 0 OR {cursor} IS NULL OR w.g < {cursor})) \
         SELECT {id} FROM (SELECT {id} FROM {tbl} WHERE {g} IS NULL AND {claimable} ORDER BY {order} LIMIT {take}) \
         UNION ALL SELECT sqlx_broker_head FROM (SELECT (SELECT CASE WHEN {claimable} THEN h.{id} END \
         FROM {tbl} AS h WHERE h.{g} = w.g{unf_h} ORDER BY h.{id} LIMIT 1) AS sqlx_broker_head \
         FROM sqlx_broker_walk AS w WHERE w.g IS NOT NULL AND (w.wrapped = 0 OR {cursor} IS NULL OR w.g <= {cursor})) \
         WHERE sqlx_broker_head IS NOT NULL LIMIT {take}",
        first_after = next(cursor),
        step = next("w.g"),
        claimable = s.claimable_row,
        order = s.order,
        unf_h = unfinished(t, "h"),
    )
}

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
//!
//! A statement reads the table through the snapshot it took when it began, and the guard is
//! taken later, inside it. A publish holds its groups' guards (shared) from before its rows take
//! their ids until it commits, in the caller's transaction or in one of its own (see
//! `backend::hold_group_guards`); if it commits between the
//! claim's snapshot and the claim's guard, the guard is free but the snapshot misses the rows it
//! added, one of which may have the group's lowest id (ids are drawn before commit), and the
//! claim would take a later row as the head (issue #35). So the lease claim and the advisory
//! take run in a READ COMMITTED transaction and, once their guards are held, read the heads
//! again in a statement of their own ([`claim_checked`]): its fresh snapshot sees every commit
//! made before the guard was taken. Row lock claims need no second read: their deliveries keep
//! the guard until they settle, so a row committed late waits for the row in work whichever it
//! is.

use std::sync::Arc;

use broker_core::TableDescription;
use broker_core::driver::alias;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Postgres, Row};

use crate::sql::{Statements, ident};

/// `AND` conditions that the row `alias` is unfinished (not processed, not dead); empty when
/// every row in the table is.
fn unfinished(t: &TableDescription, alias: &str) -> String {
    t.unfinished_columns()
        .into_iter()
        .map(|c| format!(" AND {alias}.{} IS NULL", ident(c)))
        .collect()
}

/// The condition that the row `q` is the head of its group, for FIFO tables.
pub(crate) fn head_condition(t: &TableDescription) -> Option<String> {
    if !t.fifo() {
        return None;
    }
    let group = ident(t.group()?);
    let table = ident(t.name());
    let id = ident(t.id());
    let unfinished = unfinished(t, "h");
    Some(format!(
        "NOT EXISTS (SELECT 1 FROM {table} AS h WHERE h.{group} = q.{group} AND h.{id} < q.{id}{unfinished})"
    ))
}

/// The second read of a FIFO claim ([`claim_checked`]): of the rows whose ids are bound as `$1`
/// (`int8[]`), those that are no longer the head of their group. Rows without a group are heads.
pub(crate) fn no_longer_heads(t: &TableDescription) -> Option<String> {
    let head = head_condition(t)?;
    Some(format!(
        "SELECT q.{id}::int8 FROM {table} AS q WHERE q.{id} = ANY($1::int8[]) AND NOT {head}",
        id = ident(t.id()),
        table = ident(t.name()),
    ))
}

/// How a FIFO claim's transaction begins: READ COMMITTED whatever the server's default, so the
/// second read takes a snapshot of its own.
const BEGIN_READ_COMMITTED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Runs a FIFO `claim` (which takes its groups' guards, locks and changes its rows) in a READ
/// COMMITTED transaction on `conn`, then [`no_longer_heads`] (`recheck`) on the rows it claimed.
/// When every row is still a head, commits and returns them; otherwise rolls back (the rows, the
/// counted attempts and the guards go back as they were) and returns `None`: a later row was
/// judged the head through a snapshot taken before a row with a lower id committed, and a claim
/// that runs again sees that row.
pub(crate) async fn claim_checked(
    conn: &mut PgConnection,
    claim: sqlx::query::Query<'static, Postgres, PgArguments>,
    recheck: &Arc<str>,
    prepared: bool,
) -> Result<Option<Vec<PgRow>>, sqlx::Error> {
    let mut tx = conn.begin_with(BEGIN_READ_COMMITTED).await?;
    let rows = claim.fetch_all(&mut *tx).await?;
    if !rows.is_empty() {
        let ids = rows
            .iter()
            .map(|row| row.try_get::<i64, _>(alias::ID))
            .collect::<Result<Vec<_>, _>>()?;
        let behind: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(recheck.clone()))
            .persistent(prepared)
            .bind(ids)
            .fetch_all(&mut *tx)
            .await?;
        if !behind.is_empty() {
            tracing::debug!(
                ?behind,
                "fifo: a row with a lower id committed before the guard; the claim runs again"
            );
            tx.rollback().await?;
            return Ok(None);
        }
    }
    tx.commit().await?;
    Ok(Some(rows))
}

/// The guard key of a table's groups: bound as the prefix of `hashtextextended(prefix || group)`.
pub(crate) fn guard_prefix(t: &TableDescription) -> String {
    format!("{}:", t.name())
}

/// The CTEs of a FIFO claim, ending in `sqlx_broker_cand (id)`: at most `take` rows that the
/// claim may take, each either without a group or the head of its group with the group's guard
/// now held by this transaction. `$1` is the host's now, `cursor` the parameter holding the
/// group the subscription's last claim took (text, NULL at first), `prefix` the one holding
/// [`guard_prefix`]. The statement must begin `WITH RECURSIVE`.
///
/// The claim visits groups, not rows: a loose index scan over the group index (each step one
/// probe for the next group after the one before) from just after `cursor` to the end and then
/// from the start up to `cursor`, and for each group one probe for its head (its first
/// unfinished row), which is taken if it is due, free and its guard is free. So a group's
/// backlog costs one probe however many rows it holds, and the groups take turns: the next
/// claim starts where this one stopped. PostgreSQL evaluates the recursion only as far as the
/// outer `LIMIT` pulls it (every step stays lazy: no sort, no aggregate above it), so a claim
/// visits the groups in work or not due near the cursor and stops at the `take`-th head it
/// gets; the guard is tried only on heads that are due and free (fenced with `OFFSET 0`).
/// Rows without a group come first, in the claim order, through the claim index over them.
pub(crate) fn head_candidates(
    s: &Statements,
    t: &TableDescription,
    group: &str,
    take: &str,
    cursor: &str,
    prefix: &str,
) -> String {
    let (tbl, id, g) = (&s.table, &s.id, ident(group));
    let next = |after: &str| {
        format!(
            "(SELECT n.{g} FROM {tbl} AS n WHERE n.{g} > {after}{unf} ORDER BY n.{g} LIMIT 1)",
            unf = unfinished(t, "n")
        )
    };
    let first = format!(
        "(SELECT n.{g} FROM {tbl} AS n WHERE n.{g} IS NOT NULL{unf} ORDER BY n.{g} LIMIT 1)",
        unf = unfinished(t, "n")
    );
    format!(
        "sqlx_broker_after (g) AS (SELECT {first_after} \
         UNION ALL SELECT {step_after} FROM sqlx_broker_after AS a WHERE a.g IS NOT NULL), \
         sqlx_broker_upto (g) AS (SELECT {first} \
         UNION ALL SELECT {step_upto} FROM sqlx_broker_upto AS u \
         WHERE u.g IS NOT NULL AND ({cursor}::text IS NULL OR u.g < {cursor}::text)), \
         sqlx_broker_cand AS (SELECT c.id FROM (\
         (SELECT q.{id} AS id, NULL::text AS g FROM {tbl} AS q WHERE q.{g} IS NULL AND {claimable} \
         ORDER BY {order} LIMIT {take}) \
         UNION ALL \
         (SELECT h.id, h.g FROM (SELECT g FROM sqlx_broker_after WHERE g IS NOT NULL \
         UNION ALL SELECT g FROM sqlx_broker_upto \
         WHERE g IS NOT NULL AND ({cursor}::text IS NULL OR g <= {cursor}::text)) AS s \
         CROSS JOIN LATERAL (SELECT q.{id} AS id, q.{g}::text AS g, ({claimable}) AS ok FROM {tbl} AS q \
         WHERE q.{g} = s.g{unf_q} ORDER BY q.{id} LIMIT 1) AS h WHERE h.ok) \
         OFFSET 0) AS c \
         WHERE c.g IS NULL OR pg_try_advisory_xact_lock(hashtextextended({prefix}::text || c.g, 0)) \
         LIMIT {take})",
        first_after = next(&format!("{cursor}::text")),
        step_after = next("a.g"),
        step_upto = next("u.g"),
        claimable = s.claimable_row,
        order = s.order,
        unf_q = unfinished(t, "q"),
    )
}

/// A CTE `sqlx_broker_cand (id)`: claimable rows `q` (with `extra` conditions) in claim order,
/// at most `window` of them, then those whose group guard this transaction takes, at most
/// `take`. `prefix` is the parameter holding [`guard_prefix`]. The advisory take uses it with
/// `extra` naming the one row it takes; the claims of the other modes visit groups instead
/// ([`head_candidates`]).
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

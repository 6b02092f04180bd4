//! Fencing: every statement a lease or advisory delivery settles or renews with must take effect
//! only while the row is still that delivery's. Each case makes a stale holder, lets it try one
//! statement, and checks that the statement was refused and the row did not change.
//!
//! A stale holder is made as each mode loses a row in production:
//! - lease: the lease (1 s) runs out and another claim takes the row (attempt 2);
//! - advisory: the row is taken again under another key while the first delivery still holds
//!   its own (the row's key column is changed behind the broker's back). Only the fence on the
//!   attempt, not the key lock, then keeps the first delivery's settlement out; the same holds
//!   for a settlement still on its way after its key was freed.

use std::time::{Duration, SystemTime};

use broker_core::driver::{Action, LeaseStrategy, LeaseToken, Prepared, Settle};
use broker_core::{
    Backend, ClaimMode, ColumnType, DeadLetter, Delivery, Queue, RowState, SqlxBrokerError,
    TableDescription, driver::clock,
};

use super::claim_one;
use crate::{Fixture, TestDb, claim_within, report, unique_name, wait_until};

/// What the stale holder tries.
#[derive(Debug, Clone, Copy)]
enum Attempted {
    Ack,
    Retry,
    RetryAfter,
    DeadLetter,
    Snooze,
    Renew,
}

/// Which statement of the table's settlement the stale holder runs into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Ack deletes; retries write the due time.
    Plain,
    /// Ack sets `processed_at`.
    Processed,
    /// No due-time column: a retry writes nothing but the lease.
    NoDueColumn,
    /// Dead letters move to a table.
    DeadTable,
    /// Dead letters set a column.
    DeadMark,
    /// The table counts snoozes.
    Snoozes,
}

/// A row held by a stale delivery and, since, by a fresh one.
struct Stale<D: TestDb> {
    fx: Fixture<D>,
    queue: Queue<D::B, D::Job>,
    stale: Delivery<D::B, D::Job>,
    fresh: Delivery<D::B, D::Job>,
    id: i64,
}

async fn stale_holder<D: TestDb>(mode: ClaimMode, shape: Shape) -> Stale<D> {
    let fx = Fixture::<D>::build(mode, |name| {
        let b = TableDescription::builder(name).payload("payload", ColumnType::Text);
        let b = match shape {
            Shape::NoDueColumn => b,
            _ => b.due_at("due_at"),
        };
        let b = match shape {
            Shape::Processed => b.processed_at("done_at"),
            Shape::DeadTable => b.dead_letter(DeadLetter::Table(unique_name("dead"))),
            Shape::DeadMark => b.dead_letter(DeadLetter::Column("dead_at".into())),
            Shape::Snoozes => b.snoozes("snoozes"),
            Shape::Plain | Shape::NoDueColumn => b,
        };
        match mode {
            ClaimMode::Lease => b.locked_until("locked_until").lease_seconds(1),
            ClaimMode::Advisory => b.column("k", ColumnType::Text).advisory_lock("key-{k}"),
            ClaimMode::RowLock => unreachable!("row lock holds its rows in a transaction"),
            other => panic!("the suite has no case for claim mode {other:?}"),
        }
    })
    .await;
    let queue = fx.queue().await;
    // A due time in the past, so a retry that lands (it clears the due time) changes the row.
    let job = fx.job(0);
    let job = if shape == Shape::NoDueColumn {
        job
    } else {
        job.run_at(SystemTime::now() - Duration::from_secs(3600))
    };
    let id = queue.publish(job).await.expect("publish");
    let stale = claim_one::<D>(&queue).await;
    assert_eq!((stale.id(), stale.attempt()), (id, 1));
    let fresh = match mode {
        ClaimMode::Lease => {
            claim_within(
                &queue,
                Duration::from_secs(10),
                "the row again once the stale lease ran out",
            )
            .await
        }
        _ => {
            let sql = format!(
                "UPDATE {} SET k = 'k0-moved' WHERE {} = {id}",
                fx.table.name(),
                fx.table.id()
            );
            assert_eq!(D::execute(&fx.broker, &sql).await, 1, "{sql}");
            let fresh = claim_one::<D>(&queue).await;
            assert_eq!(fresh.key(), Some("key-k0-moved"));
            fresh
        }
    };
    assert_eq!(
        (fresh.id(), fresh.attempt()),
        (id, 2),
        "the fresh claim took the row"
    );
    Stale {
        fx,
        queue,
        stale,
        fresh,
        id,
    }
}

/// The stale holder tries `attempted` on a table of `shape`: refused, nothing changed; the
/// fresh holder then acks.
async fn stale_holder_is_fenced<D: TestDb>(mode: ClaimMode, shape: Shape, attempted: Attempted) {
    let Stale {
        fx,
        queue,
        mut stale,
        fresh,
        id,
    } = stale_holder::<D>(mode, shape).await;
    if let Attempted::Renew = attempted {
        // A renewal writes an expiry at a whole second: wait until the stale holder's would
        // differ from the fresh one's, or an unfenced renewal would leave the row as it was.
        let held = fresh.lease_expires_ms().expect("a lease delivery");
        wait_until(
            "a renewal to write a new expiry",
            Duration::from_secs(5),
            || async move { clock::lease_expiry_ms(clock::now_ms(), 1) != held },
        )
        .await;
    }
    let before: RowState = queue
        .row_state(id)
        .await
        .unwrap()
        .expect("the row is there");
    let result = match attempted {
        Attempted::Ack => stale.ack().await,
        Attempted::Retry => stale.retry().await,
        Attempted::RetryAfter => stale.retry_after(Duration::from_secs(60)).await,
        Attempted::DeadLetter => stale.dead_letter().await,
        Attempted::Snooze => stale.snooze(Duration::from_secs(60)).await,
        Attempted::Renew => {
            let r = stale.renew().await;
            drop(stale);
            r
        }
    };
    let err = result.expect_err("a stale holder's statement must be refused");
    match mode {
        ClaimMode::Lease => assert!(
            matches!(err, SqlxBrokerError::LeaseLost { id: lost, .. } if lost == id),
            "{err:?}"
        ),
        _ => assert!(
            matches!(err, SqlxBrokerError::ClaimLost { id: lost, .. } if lost == id),
            "{err:?}"
        ),
    }
    assert!(err.to_string().contains(fx.table.name()), "{err}");
    if mode == ClaimMode::Lease {
        // A dropped stale lease is released in a clean-up task, fenced as well: let it run.
        fx.broker.flush_cleanups().await;
    }
    assert_eq!(
        queue.row_state(id).await.unwrap().as_ref(),
        Some(&before),
        "the stale {attempted:?} changed the row"
    );
    if mode == ClaimMode::Lease {
        // A refused settlement counts as a lost lease; a refused renewal counts nothing, and
        // the stale delivery dropped after it counts as released.
        let m = queue.metrics();
        if let Attempted::Renew = attempted {
            assert_eq!((m.lease_lost, m.released), (0, 1), "{m:?}");
        } else {
            assert_eq!((m.lease_lost, m.released), (1, 0), "{m:?}");
        }
    } else {
        // The refused settlement frees the stale delivery's key.
        wait_until("the stale key to be freed", Duration::from_secs(10), || {
            let broker = &fx.broker;
            async move { !D::key_is_held(broker, "key-k0").await }
        })
        .await;
    }
    fresh.ack().await.expect("the fresh holder settles");
    let after = queue.row_state(id).await.unwrap();
    match shape {
        Shape::Processed => assert!(after.expect("a processed row stays").processed),
        _ => assert_eq!(after, None, "the fresh ack deleted the row"),
    }
    fx.cleanup().await;
}

/// A stale holder's snooze (issue #48) is refused: the due time, the attempt and the snooze
/// counter stay as the fresh claim left them.
pub async fn a_stale_holder_cannot_snooze<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::Snoozes, Attempted::Snooze).await;
}

/// A stale holder's ack (a delete) is refused and leaves the row alone.
pub async fn a_stale_holder_cannot_ack_by_delete<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::Plain, Attempted::Ack).await;
}

/// A stale holder's ack (setting `processed_at`) is refused and leaves the row alone.
pub async fn a_stale_holder_cannot_mark_processed<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::Processed, Attempted::Ack).await;
}

/// A stale holder's retry (clearing the due time) is refused and leaves the row alone.
pub async fn a_stale_holder_cannot_retry<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::Plain, Attempted::Retry).await;
}

/// On a table without a due-time column a retry writes nothing but the lease; a stale one is
/// still refused.
pub async fn a_stale_holder_cannot_retry_without_a_due_column<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::NoDueColumn, Attempted::Retry).await;
}

/// A stale holder's delayed retry is refused and does not move the due time.
pub async fn a_stale_holder_cannot_retry_after_a_delay<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::Plain, Attempted::RetryAfter).await;
}

/// A stale holder's dead letter to a table is refused: the row is neither moved nor copied.
pub async fn a_stale_holder_cannot_move_to_the_dead_letter_table<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::DeadTable, Attempted::DeadLetter).await;
}

/// A stale holder's dead-letter mark is refused and leaves the row alone.
pub async fn a_stale_holder_cannot_mark_dead<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::DeadMark, Attempted::DeadLetter).await;
}

/// A stale lease holder cannot renew: the fresh holder's expiry stays in the row.
pub async fn a_stale_holder_cannot_renew<D: TestDb>(mode: ClaimMode) {
    stale_holder_is_fenced::<D>(mode, Shape::Plain, Attempted::Renew).await;
}

/// Rows in the batch of [`acks_that_finish_together_are_each_fenced_on_their_own_token`].
const BATCH: usize = 8;

/// Lease acks that finish close together (where the backend acks them in one statement, as
/// one batch): eight fresh deliveries and one stale one (its row was claimed again behind the
/// broker's back) ack at once. The eight rows are acked, the stale ack is refused as a lost
/// lease and its row does not change, and, where the backend batches, the batch acked rows.
/// With slow deletes the first ack runs alone and the others wait for the next statements; the
/// engine does not promise the stale ack a place in a shared statement (it often runs alone),
/// so [`a_stale_ack_in_a_shared_ack_statement_is_refused_alone`] checks the shared statement's
/// per-row fence.
pub async fn acks_that_finish_together_are_each_fenced_on_their_own_token<D: TestDb>(
    mode: ClaimMode,
) {
    assert_eq!(mode, ClaimMode::Lease, "a case of lease mode");
    let fx = Fixture::<D>::new(mode, |b| b.lease_seconds(30)).await;
    let queue = fx.queue().await;
    fx.publish(&queue, BATCH + 1).await;
    let slowed = D::slow_down_deletes(&fx.broker, fx.table.name()).await;
    let mut fresh = Vec::new();
    for _ in 0..BATCH {
        fresh.push(claim_one::<D>(&queue).await);
    }
    let stale = claim_one::<D>(&queue).await;
    let stale_id = stale.id();
    // Another claim counted an attempt: the stale delivery's token no longer matches.
    let sql = format!(
        "UPDATE {t} SET {a} = {a} + 1 WHERE {id} = {stale_id}",
        t = D::quote(fx.table.name()),
        a = D::quote(fx.table.attempt()),
        id = D::quote(fx.table.id()),
    );
    assert_eq!(D::execute(&fx.broker, &sql).await, 1, "{sql}");
    let before = queue.row_state(stale_id).await.unwrap();
    let fresh_ids: Vec<i64> = fresh.iter().map(Delivery::id).collect();
    let mut acks = tokio::task::JoinSet::new();
    for d in fresh {
        acks.spawn(async move { (d.id(), d.ack().await) });
    }
    // The first ack is on the wire (slowed) before the stale one joins the queue.
    tokio::time::sleep(Duration::from_millis(5)).await;
    acks.spawn(async move { (stale_id, stale.ack().await) });
    while let Some(joined) = acks.join_next().await {
        let (id, result) = joined.expect("an ack task");
        if id == stale_id {
            let err = result.expect_err("the stale ack must be refused");
            assert!(
                matches!(err, SqlxBrokerError::LeaseLost { id: lost, .. } if lost == id),
                "{err:?}"
            );
        } else {
            result.unwrap_or_else(|e| panic!("row {id}: a fresh ack failed: {e:?}"));
        }
    }
    for id in &fresh_ids {
        assert_eq!(queue.row_state(*id).await.unwrap(), None, "row {id} acked");
    }
    assert_eq!(
        queue.row_state(stale_id).await.unwrap(),
        before,
        "the stale ack changed its row"
    );
    let m = queue.metrics();
    assert_eq!((m.acked, m.lease_lost), (BATCH as u64, 1), "{m:?}");
    if D::BATCHED_ACKS && slowed {
        assert!(
            m.batched_acks >= 2,
            "acks that finished together were not batched: {m:?}"
        );
    }
    report(&format!(
        "{} lease acks finishing together: {BATCH} acked ({} in batches), the stale one refused",
        fx.broker.backend().capabilities().database,
        m.batched_acks
    ));
    fx.cleanup().await;
}

/// A stale ack inside a shared ack statement (`LeaseStrategy::ack_many` over several rows) is
/// refused on its own token while the fresh acks beside it land. Driven through the backend's
/// lease strategy, so the statement surely holds all three acks: the first row is claimed with
/// a 1 s lease, which runs out, and another claim takes the row (attempt 2); the two other
/// rows hold fresh leases. One statement then acks the two fresh rows and the stale one between
/// them: it must ack the fresh rows only and leave the row the other claim holds as it was, on
/// a table whose ack deletes and on one whose ack sets `processed_at`. A backend that acks one
/// row at a time (`ack_many` returns `None`: MySQL, and MariaDB tables that keep acked rows)
/// has no shared statement to fence.
pub async fn a_stale_ack_in_a_shared_ack_statement_is_refused_alone<D: TestDb>(mode: ClaimMode) {
    assert_eq!(mode, ClaimMode::Lease, "a case of lease mode");
    for processed in [false, true] {
        let fx = Fixture::<D>::new(mode, |b| {
            let b = b.lease_seconds(30);
            if processed {
                b.processed_at("done_at")
            } else {
                b
            }
        })
        .await;
        let queue = fx.queue().await;
        let ids = fx.publish(&queue, 3).await;
        let table = std::sync::Arc::new(fx.table.clone());
        let Prepared::Lease(lease) = fx.broker.backend().prepare(&table).await.expect("prepare")
        else {
            panic!("a lease table prepares its lease strategy")
        };
        // The stale delivery: the first row (claim order is id order) with a 1 s lease.
        let now = clock::now_ms();
        let short = clock::lease_expiry_ms(now, 1);
        let rows = lease.claim(1, now, short, None).await.expect("claim");
        assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[0]]);
        let stale = LeaseToken {
            expires_ms: short,
            attempt: rows[0].attempt + 1,
        };
        // The two fresh deliveries, with a minute's lease.
        let long = clock::lease_expiry_ms(now, 60);
        let rows = lease.claim(2, now, long, None).await.expect("claim");
        let mut fresh: Vec<(i64, LeaseToken)> = rows
            .iter()
            .map(|r| {
                (
                    r.id,
                    LeaseToken {
                        expires_ms: long,
                        attempt: r.attempt + 1,
                    },
                )
            })
            .collect();
        fresh.sort_unstable_by_key(|(id, _)| *id);
        assert_eq!(
            fresh.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            ids[1..].to_vec()
        );
        // The stale lease runs out and another claim takes the row.
        let other = claim_within(
            &queue,
            Duration::from_secs(10),
            "the first row again once its 1 s lease ran out",
        )
        .await;
        assert_eq!(
            (other.id(), other.attempt()),
            (ids[0], 2),
            "the other claim took the stale delivery's row"
        );
        let before = queue.row_state(ids[0]).await.unwrap();
        let acks = [fresh[0], (ids[0], stale), fresh[1]];
        let acked = lease
            .ack_many(&acks, clock::now_ms())
            .await
            .expect("the shared ack statement runs");
        let database = fx.broker.backend().capabilities().database;
        let Some(mut acked) = acked else {
            report(&format!(
                "{database} lease acks one row at a time (processed_at: {processed}): no shared ack statement to fence"
            ));
            drop(other);
            fx.cleanup().await;
            continue;
        };
        acked.sort_unstable();
        assert_eq!(
            acked,
            ids[1..].to_vec(),
            "the shared ack statement must ack the two fresh rows and not the stale one (processed_at: {processed})"
        );
        assert_eq!(
            queue.row_state(ids[0]).await.unwrap(),
            before,
            "the stale ack in the shared statement changed the row another claim holds (processed_at: {processed})"
        );
        for id in &ids[1..] {
            let state = queue.row_state(*id).await.unwrap();
            if processed {
                assert!(state.expect("a processed row stays").processed, "row {id}");
            } else {
                assert_eq!(state, None, "row {id} acked");
            }
        }
        other.ack().await.expect("the other claim acks its row");
        report(&format!(
            "{database} a stale ack in a shared ack statement of 3 (processed_at: {processed}): refused, the 2 fresh acked"
        ));
        fx.cleanup().await;
    }
}

/// A lease renewal whose reply was lost runs again from the token it started with (the
/// engine's retry after a lost connection): when the first try had landed, the second must
/// still find the row holding this delivery's lease, not report it lost. Driven through the
/// backend's lease strategy, which is where the retry runs: claim, renew, renew again with the
/// same token and expiry, then ack on the renewed token.
pub async fn a_renewal_run_again_after_it_landed_keeps_the_lease<D: TestDb>(mode: ClaimMode) {
    assert_eq!(mode, ClaimMode::Lease, "a case of lease mode");
    let fx = Fixture::<D>::new(mode, |b| b.lease_seconds(30)).await;
    let queue = fx.queue().await;
    let id = fx.publish(&queue, 1).await[0];
    let table = std::sync::Arc::new(fx.table.clone());
    let Prepared::Lease(lease) = fx.broker.backend().prepare(&table).await.expect("prepare") else {
        panic!("a lease table prepares its lease strategy")
    };
    let now = clock::now_ms();
    let expires_ms = clock::lease_expiry_ms(now, 30);
    let rows = lease.claim(1, now, expires_ms, None).await.expect("claim");
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), vec![id]);
    let token = LeaseToken {
        expires_ms,
        attempt: rows[0].attempt + 1,
    };
    let later = expires_ms + 10_000;
    assert!(
        lease.renew(id, token, later).await.expect("renew"),
        "the renewal lands"
    );
    assert!(
        lease.renew(id, token, later).await.expect("renew again"),
        "a renewal run again after it landed found the lease lost"
    );
    let renewed = LeaseToken {
        expires_ms: later,
        attempt: token.attempt,
    };
    let ack = Settle {
        id,
        action: Action::Ack,
        now_ms: clock::now_ms(),
        attempt: renewed.attempt,
    };
    assert!(
        lease.settle(renewed, ack).await.expect("ack"),
        "the ack on the renewed token lands"
    );
    assert_eq!(queue.row_state(id).await.unwrap(), None, "row {id} acked");
    fx.cleanup().await;
}

/// Lease acks share statements, one at a time per queue; an ack whose statement waits (here for
/// a row lock that another transaction holds on its row, as a user's transaction might) must
/// not hold up the acks of other rows: they run in a second statement beside it and finish
/// while the lock is still held. The stuck ack finishes once the lock goes.
pub async fn an_ack_stuck_behind_a_row_lock_does_not_hold_up_the_others<D: TestDb>(
    mode: ClaimMode,
) {
    assert_eq!(mode, ClaimMode::Lease, "a case of lease mode");
    let fx = Fixture::<D>::new(mode, |b| b.lease_seconds(60)).await;
    let queue = fx.queue().await;
    let ids = fx.publish(&queue, 6).await;
    let mut claimed = Vec::new();
    for _ in 0..ids.len() {
        claimed.push(claim_one::<D>(&queue).await);
    }
    let stuck = claimed.remove(0);
    let stuck_id = stuck.id();
    let sql = format!(
        "SELECT {id} FROM {t} WHERE {id} = {stuck_id} FOR UPDATE",
        t = D::quote(fx.table.name()),
        id = D::quote(fx.table.id()),
    );
    let lock = D::hold_row_lock(&fx.broker, &sql)
        .await
        .expect("a server database has row locks");
    let stuck_ack = tokio::spawn(async move { stuck.ack().await });
    // The stuck ack's statement is on the wire, waiting for the lock.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!stuck_ack.is_finished(), "the ack waits for the row lock");
    let mut acks = tokio::task::JoinSet::new();
    for d in claimed {
        acks.spawn(async move { (d.id(), d.ack().await) });
    }
    let others = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(joined) = acks.join_next().await {
            let (id, result) = joined.expect("an ack task");
            result.unwrap_or_else(|e| panic!("row {id}: ack failed: {e:?}"));
        }
    })
    .await;
    assert!(
        others.is_ok(),
        "the other rows' acks waited behind the one stuck on a row lock"
    );
    assert!(
        !stuck_ack.is_finished(),
        "the stuck ack finished while the lock was held"
    );
    drop(lock);
    tokio::time::timeout(Duration::from_secs(10), stuck_ack)
        .await
        .expect("the stuck ack finishes once the lock goes")
        .expect("the ack task")
        .expect("the stuck ack");
    for id in &ids {
        assert_eq!(queue.row_state(*id).await.unwrap(), None, "row {id} acked");
    }
    assert_eq!(queue.metrics().acked, ids.len() as u64);
    fx.cleanup().await;
}

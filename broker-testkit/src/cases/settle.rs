//! Outcomes: ack, retries, scheduled rows, dead letters, priorities, leases.

use std::time::Duration;

use broker_core::{
    ClaimMode, ColumnType, DeadLetter, Delivery, NewJob, Outcome, Queue, SubscribeOptions,
    driver::clock,
};

use super::claim_one;
use crate::{Fixture, JobText, TestDb, unique_name, wait_until};

/// Ack deletes the row when the table has no `processed_at`.
pub async fn ack_deletes_the_row<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    claim_one::<D>(&q).await.ack().await.unwrap();
    assert!(q.row_state(id).await.unwrap().is_none());
    assert!(q.claim(1).await.unwrap().is_empty());
    assert_eq!(q.metrics().acked, 1);
    fx.cleanup().await;
}

/// Ack sets `processed_at` when the table has it; the row stays and is never claimed again.
pub async fn ack_marks_processed_at<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b.processed_at("done_at")).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    claim_one::<D>(&q).await.ack().await.unwrap();
    let state = q.row_state(id).await.unwrap().expect("the row stays");
    assert!(state.processed);
    assert!(q.claim(1).await.unwrap().is_empty());
    fx.cleanup().await;
}

/// Claims every row of `ids` once, each within 10 s; every claim that hands out a row must come
/// at or after the row's due time as the database holds it (read before the claims): a state and
/// ordering check on the host clock the claims compare with, not an elapsed time.
async fn claim_each_once_due<D: TestDb>(
    q: &Queue<D::B, D::Job>,
    ids: &[i64],
) -> Vec<Delivery<D::B, D::Job>> {
    let mut due = Vec::new();
    for id in ids {
        let state = q.row_state(*id).await.unwrap().expect("the row is queued");
        due.push((*id, state.due_ms));
    }
    let mut got: Vec<Delivery<D::B, D::Job>> = Vec::new();
    while got.len() < ids.len() {
        let d = claim_one::<D>(q).await;
        let claimed_by = clock::now_ms();
        let (_, row_due) = due
            .iter()
            .find(|(id, _)| *id == d.id())
            .unwrap_or_else(|| panic!("row {} was not expected", d.id()));
        if let Some(row_due) = row_due {
            assert!(
                claimed_by >= *row_due,
                "row {} was claimed before its due time ({claimed_by} < {row_due})",
                d.id()
            );
        }
        assert!(
            got.iter().all(|g| g.id() != d.id()),
            "row {} was claimed twice",
            d.id()
        );
        got.push(d);
    }
    got
}

/// A delayed retry hides the row until its due time (written into the row), then it is claimed
/// again at the next attempt.
pub async fn retry_after_hides_the_row_until_due<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let settled_at = clock::now_ms();
    claim_one::<D>(&q)
        .await
        .retry_after(Duration::from_millis(1500))
        .await
        .unwrap();
    let due = q.row_state(id).await.unwrap().unwrap().due_ms;
    assert!(
        due.is_some_and(|due| due >= settled_at + 1500),
        "the retry wrote its due time: {due:?} after {settled_at}"
    );
    let again = claim_each_once_due::<D>(&q, &[id]).await;
    assert_eq!(again[0].attempt(), 2);
    for d in again {
        d.ack().await.unwrap();
    }
    fx.cleanup().await;
}

/// A row published with a future due time is not claimed before it; an unscheduled row is.
pub async fn scheduled_rows_are_not_claimed_early<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let published_at = clock::now_ms();
    let later = q
        .publish(fx.job(0).run_after(Duration::from_millis(1200)))
        .await
        .unwrap();
    let now = q.publish(fx.job(1)).await.unwrap();
    let due = q.row_state(later).await.unwrap().unwrap().due_ms;
    assert!(
        due.is_some_and(|due| due >= published_at + 1200),
        "the schedule is in the row: {due:?}"
    );
    let got = claim_each_once_due::<D>(&q, &[later, now]).await;
    for d in got {
        assert_eq!(d.attempt(), 1);
        d.ack().await.unwrap();
    }
    fx.cleanup().await;
}

async fn dead_letter_case<D: TestDb>(mode: ClaimMode, target: DeadLetter) {
    let fx = Fixture::<D>::new(mode, |b| b.max_attempts(3).dead_letter(target)).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    for attempt in 1..=3 {
        let d = claim_one::<D>(&q).await;
        assert_eq!(d.attempt(), attempt);
        d.retry().await.unwrap();
    }
    assert!(
        q.claim(1).await.unwrap().is_empty(),
        "a dead-lettered row is not claimed"
    );
    let state = q
        .row_state(id)
        .await
        .unwrap()
        .expect("the dead-lettered row is kept");
    assert!(state.dead, "{state:?}");
    assert_eq!(state.attempt, 4, "three attempts counted");
    assert_eq!(q.metrics().retried, 2);
    assert_eq!(q.metrics().dead_lettered, 1);
    // An explicit dead letter works on the first attempt too.
    let id2 = q.publish(fx.job(1)).await.unwrap();
    claim_one::<D>(&q).await.dead_letter().await.unwrap();
    assert!(q.row_state(id2).await.unwrap().unwrap().dead);
    fx.cleanup().await;
}

/// After `max_attempts` failed deliveries the row moves to the dead-letter table.
pub async fn exhausted_rows_move_to_the_dead_letter_table<D: TestDb>(mode: ClaimMode) {
    dead_letter_case::<D>(mode, DeadLetter::Table(unique_name("dead"))).await;
}

/// After `max_attempts` failed deliveries the row gets the dead-letter mark and stays.
pub async fn exhausted_rows_get_the_dead_letter_mark<D: TestDb>(mode: ClaimMode) {
    dead_letter_case::<D>(mode, DeadLetter::Column("dead_at".into())).await;
}

/// Higher priority is claimed first; equal priorities in publish order.
pub async fn higher_priority_runs_first<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b.priority("prio")).await;
    let q = fx.queue().await;
    let jobs = vec![
        fx.job(0).priority(1),
        fx.job(1).priority(5),
        fx.job(2),
        fx.job(3).priority(5),
    ];
    q.publish_batch(&jobs).await.unwrap();
    let mut order = Vec::new();
    for _ in 0..4 {
        let d = claim_one::<D>(&q).await;
        order.push(d.payload().text().to_owned());
        d.ack().await.unwrap();
    }
    assert_eq!(order, ["job-1", "job-3", "job-0", "job-2"]);
    fx.cleanup().await;
}

/// Renewal every half lease keeps a handler that runs three leases long: nobody else claims the
/// row meanwhile, and its ack lands.
pub async fn renewal_keeps_a_handler_that_runs_three_leases<D: TestDb>() {
    let mut fx = Fixture::<D>::new(ClaimMode::Lease, |b| b.lease_seconds(1)).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let id = fx.publish(&q, 1).await[0];
    let sub = q
        .subscribe(SubscribeOptions::new(), |_job| async move {
            tokio::time::sleep(Duration::from_millis(3200)).await;
            Outcome::Ack
        })
        .expect("subscribe");
    wait_until("the long handler in work", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().in_work == 1 }
    })
    .await;
    // Until the handler acks, no other claim gets the row, and the expiry in the row moves on:
    // the handler outlives its first lease only through renewal.
    let first = q.row_state(id).await.unwrap().unwrap().locked_until_ms;
    let mut last = first;
    let mut polls = 0;
    while q.metrics().acked == 0 {
        assert!(
            other.claim(1).await.unwrap().is_empty(),
            "the renewed lease holds the row"
        );
        if let Some(state) = q.row_state(id).await.unwrap() {
            last = last.max(state.locked_until_ms);
        }
        polls += 1;
        assert!(polls < 300, "the 3.2 s handler acked within 300 polls");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (first, last) = (first.unwrap(), last.unwrap());
    assert!(
        last >= first + 2000,
        "renewal moved the expiry across the handler's three leases: {first} -> {last}"
    );
    assert_eq!(sub.shutdown().await.dropped, 0);
    assert_eq!(q.metrics().lease_lost, 0);
    assert!(q.row_state(id).await.unwrap().is_none());
    fx.cleanup().await;
}

/// A lease claim for a batch larger than the free slots holds the surplus for later: those rows
/// wait for the one slot longer than their lease, and renewal keeps them from other claims.
pub async fn prefetched_rows_keep_their_leases_while_they_wait<D: TestDb>() {
    let mut fx = Fixture::<D>::new(ClaimMode::Lease, |b| b.lease_seconds(1)).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let ids = fx.publish(&q, 3).await;
    let sub = q
        .subscribe(
            SubscribeOptions::new().concurrency(1).batch_size(3),
            |_job| async move {
                tokio::time::sleep(Duration::from_millis(1100)).await;
                Outcome::Ack
            },
        )
        .expect("subscribe");
    wait_until("the first handler in work", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().in_work == 1 }
    })
    .await;
    assert_eq!(q.metrics().claimed, 3, "one claim took the whole batch");
    // The last row waits two handlers (2.2 s) for its slot, past its 1 s lease.
    let mut polls = 0;
    while q.metrics().acked < 3 {
        assert!(
            other.claim(1).await.unwrap().is_empty(),
            "a waiting row's renewed lease holds it"
        );
        polls += 1;
        assert!(polls < 200, "three 1.1 s handlers finish within 200 polls");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sub.shutdown().await.dropped, 0);
    let m = q.metrics();
    assert_eq!((m.acked, m.lease_lost, m.claimed), (3, 0, 3));
    for id in ids {
        assert!(q.row_state(id).await.unwrap().is_none());
    }
    fx.cleanup().await;
}

/// A plain table beside the case's, for the handler's own writes.
pub(crate) async fn side_table<D: TestDb>(
    fx: &Fixture<D>,
) -> (broker_core::TableDescription, Queue<D::B, D::Job>) {
    let side = broker_core::TableDescription::builder(unique_name("side"))
        .payload("payload", ColumnType::Text)
        .build()
        .unwrap();
    fx.broker.create_tables(&side).await.unwrap();
    let side_q = fx.broker.queue::<D::Job>(side.clone()).await.unwrap();
    (side, side_q)
}

/// In row lock mode the handler writes through the delivery's transaction: the writes commit
/// with the ack and roll back with a retry.
pub async fn row_lock_handler_writes_commit_with_the_ack_only<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::RowLock, |b| b).await;
    let q = fx.queue().await;
    let (side, side_q) = side_table(&fx).await;
    fx.publish(&q, 1).await;

    let mut d = claim_one::<D>(&q).await;
    let tx = d
        .transaction()
        .await
        .unwrap()
        .expect("row lock deliveries carry their transaction");
    let rolled_back = side_q
        .publish_in(
            &mut **tx,
            &[NewJob::new(D::Text::from("rolled back".to_owned()))],
        )
        .await
        .unwrap()[0];
    d.retry().await.unwrap();
    assert!(
        side_q.row_state(rolled_back).await.unwrap().is_none(),
        "a retry rolls the write back"
    );

    let mut d = claim_one::<D>(&q).await;
    assert_eq!(d.attempt(), 2, "the retry still counted its attempt");
    let tx = d.transaction().await.unwrap().unwrap();
    let kept = side_q
        .publish_in(&mut **tx, &[NewJob::new(D::Text::from("kept".to_owned()))])
        .await
        .unwrap()[0];
    d.ack().await.unwrap();
    assert!(
        side_q.row_state(kept).await.unwrap().is_some(),
        "the ack commits the write"
    );
    fx.broker.drop_tables(&side).await.unwrap();
    fx.cleanup().await;
}

/// A subscribed row lock handler writes through the transaction it is lent: the writes of the
/// attempt it retries roll back, those of the attempt it acks commit with the ack.
pub async fn a_subscribed_handler_writes_through_its_transaction<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::RowLock, |b| b).await;
    let q = fx.queue().await;
    let (side, side_q) = side_table(&fx).await;
    let ids = fx.publish(&q, 2).await;
    // (attempt, side row written in it)
    let written = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(i64, i64)>::new()));
    let sub = {
        let side_q = side_q.clone();
        let written = written.clone();
        q.subscribe_with_transaction(
            SubscribeOptions::new()
                .concurrency(2)
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |job, tx| {
                let side_q = side_q.clone();
                let written = written.clone();
                async move {
                    let mut tx = tx.get().await?;
                    let text = format!("row {} attempt {}", job.id(), job.attempt());
                    let side_id = side_q
                        .publish_in(&mut **tx, &[NewJob::new(D::Text::from(text))])
                        .await?[0];
                    written.lock().unwrap().push((job.attempt(), side_id));
                    let outcome = if job.attempt() == 1 {
                        Outcome::Retry
                    } else {
                        Outcome::Ack
                    };
                    Ok::<_, broker_core::BoxError>(outcome)
                }
            },
        )
        .expect("subscribe")
    };
    wait_until("both rows acked", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.metrics().acked == 2 }
    })
    .await;
    assert_eq!(sub.shutdown().await.dropped, 0);
    for id in ids {
        assert!(q.row_state(id).await.unwrap().is_none());
    }
    let written = written.lock().unwrap().clone();
    assert_eq!(
        written.len(),
        4,
        "two attempts of each row wrote: {written:?}"
    );
    for (attempt, side_id) in written {
        let kept = side_q.row_state(side_id).await.unwrap().is_some();
        assert_eq!(
            kept,
            attempt == 2,
            "side row {side_id} of attempt {attempt}: a retry rolls back, an ack commits"
        );
    }
    fx.broker.drop_tables(&side).await.unwrap();
    fx.cleanup().await;
}

/// Lending a transaction needs row lock mode: a lease or advisory table refuses
/// `subscribe_with_transaction` at once, saying to use `subscribe`.
pub async fn subscribe_with_transaction_outside_row_lock_is_refused<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let err = q
        .subscribe_with_transaction(SubscribeOptions::new(), |_job, _tx| async { Outcome::Ack })
        .expect_err("no transaction to lend");
    let text = err.to_string();
    assert!(
        text.contains("use subscribe") && text.contains(fx.table.name()),
        "{text}"
    );
    fx.cleanup().await;
}

/// Connections of `broker`'s pool that are out of it now.
pub(crate) fn pool_in_use<B: broker_core::Backend>(broker: &broker_core::Broker<B>) -> usize {
    let pool = broker.pool();
    usize::try_from(pool.size())
        .unwrap_or(usize::MAX)
        .saturating_sub(pool.num_idle())
}

/// Subscribes four workers whose handler works for `work` and acks, waits (bounded) until
/// `runs` rows ran, and stops the subscription: a stop while the table is still busy.
pub(crate) async fn stop_after_runs<D: TestDb>(
    q: &broker_core::Queue<D::B, D::Job>,
    work: Duration,
    runs: usize,
) {
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sub = {
        let ran = ran.clone();
        q.subscribe(SubscribeOptions::new().concurrency(4), move |_job| {
            let ran = ran.clone();
            async move {
                ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(work).await;
                Outcome::Ack
            }
        })
        .expect("subscribe")
    };
    wait_until(&format!("{runs} rows ran"), Duration::from_secs(30), || {
        let n = ran.load(std::sync::atomic::Ordering::SeqCst);
        async move { n >= runs }
    })
    .await;
    sub.shutdown().await;
}

/// A busy row lock subscription claims its next row on the connection its last delivery
/// committed on, with no trip through the pool (whose test of a returning connection costs a
/// round trip each way); once the table is drained it gives those connections back to the pool
/// while it still runs (rows that settle after the claim that found the table drained too), and
/// none stays out after it stops. Where the backend cannot tell sessions apart
/// (`TestDb::session_id` is `None`, e.g. behind a transaction-mode pooler) only the giving back
/// is checked.
pub async fn a_busy_subscription_claims_on_its_last_connection_and_gives_it_back_when_idle<
    D: TestDb,
>() {
    let fx = Fixture::<D>::new(ClaimMode::RowLock, |b| b).await;
    let q = fx.queue().await;
    // One worker: each claim starts once the last row settled, so every row runs on one
    // connection. Four: when the table drains, three rows are still in work and settle after
    // the claim that found nothing.
    for (workers, rows) in [(1, 30), (4, 40)] {
        let sessions = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Option<i64>>::new()));
        let sub = {
            let sessions = sessions.clone();
            q.subscribe_with_transaction(
                // No poll while the test waits: a claim that finds the table drained gives the
                // connections back, not the next poll.
                SubscribeOptions::new()
                    .concurrency(workers)
                    .poll_interval(Duration::from_secs(60)),
                move |_job, tx| {
                    let sessions = sessions.clone();
                    async move {
                        let mut tx = tx.get().await?;
                        let session = D::session_id(&mut **tx).await;
                        sessions.lock().unwrap().push(session);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        Ok::<_, broker_core::BoxError>(Outcome::Ack)
                    }
                },
            )
            .expect("subscribe")
        };
        // What an idle subscription holds on an empty table (a wake-up listener, where the
        // backend has one, which connects a moment after the start): the fewest connections
        // out over a tenth of a second, a fifth of a second after the start.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut idle = usize::MAX;
        for _ in 0..5 {
            idle = idle.min(pool_in_use(&fx.broker));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ids = fx.publish(&q, rows).await;
        crate::wait_until_rows_gone::<D>(&q, &ids, Duration::from_secs(30)).await;
        let seen = sessions.lock().unwrap().clone();
        assert_eq!(seen.len(), ids.len(), "one run per row");
        if workers == 1 && seen.iter().all(Option::is_some) {
            let mut distinct: Vec<i64> = seen.iter().flatten().copied().collect();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                1,
                "every row ran on the connection the last one committed on: sessions {seen:?}"
            );
        }
        wait_until(
            &format!(
                "the drained subscription ({workers} workers) gives its connections back to the pool"
            ),
            Duration::from_secs(3),
            || {
                let in_use = pool_in_use(&fx.broker);
                async move { in_use <= idle }
            },
        )
        .await;
        sub.shutdown().await;
        let leaks = D::leaks(&fx.broker).await;
        assert!(leaks.is_empty(), "after shutdown: {leaks:?}");
    }
    // Stopped while busy: the rows that settle as it stops keep nothing out of the pool.
    let ids = fx.publish(&q, 200).await;
    stop_after_runs::<D>(&q, Duration::from_millis(5), 20).await;
    assert!(
        q.row_state(ids[ids.len() - 1]).await.unwrap().is_some(),
        "rows were left when it stopped"
    );
    let leaks = D::leaks(&fx.broker).await;
    assert!(
        leaks.is_empty(),
        "after a busy subscription stopped: {leaks:?}"
    );
    fx.cleanup().await;
}

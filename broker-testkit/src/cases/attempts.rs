//! Attempts as SPEC section 2 counts them, in every mode.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use broker_core::{BoxError, ClaimMode, DeadLetter, NewJob, Outcome, SubscribeOptions};

use super::claim_one;
use crate::{Fixture, JobText, TestDb, unique_name, wait_until};

/// The first delivery reads 1 in every mode.
pub async fn first_delivery_reads_attempt_one<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 3).await;
    let deliveries = q.claim(3).await.unwrap();
    assert_eq!(deliveries.len(), 3);
    for d in deliveries {
        assert_eq!(d.attempt(), 1, "row {}", d.id());
        let i = ids
            .iter()
            .position(|id| *id == d.id())
            .expect("a published id");
        assert_eq!(d.payload().text(), format!("job-{i}"));
        d.ack().await.unwrap();
    }
    fx.cleanup().await;
}

/// Each retry counts one attempt: deliveries read 1, 2, 3; the column reads 4 after the third
/// retry. Row lock counts at settlement (the column does not move at the claim); lease and
/// advisory count at the claim.
pub async fn attempts_count_across_retries<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    for expected in 1..=3 {
        let d = claim_one::<D>(&q).await;
        assert_eq!(d.attempt(), expected);
        let column = q.row_state(id).await.unwrap().unwrap().attempt;
        let counted_at_claim = if mode == ClaimMode::RowLock { 0 } else { 1 };
        assert_eq!(column, expected + counted_at_claim, "column while in work");
        d.retry().await.unwrap();
    }
    assert_eq!(q.row_state(id).await.unwrap().unwrap().attempt, 4);
    fx.cleanup().await;
}

/// A dropped delivery: row lock rolls back and uses no attempt; lease releases and advisory
/// unlocks, each with the attempt used. The row is due again at once in every mode.
pub async fn a_dropped_delivery_counts_as_its_mode_says<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    fx.publish(&q, 1).await;
    let d = claim_one::<D>(&q).await;
    assert_eq!(d.attempt(), 1);
    drop(d);
    fx.broker.flush_cleanups().await;
    let again = claim_one::<D>(&q).await;
    let expected = if mode == ClaimMode::RowLock { 1 } else { 2 };
    assert_eq!(again.attempt(), expected);
    again.ack().await.unwrap();
    fx.cleanup().await;
}

type Seen = Arc<Mutex<Vec<(i64, i64)>>>;

async fn failing_first_attempt<D: TestDb>(mode: ClaimMode, panic: bool) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |job| {
                let record = record.clone();
                async move {
                    record.lock().unwrap().push((job.id(), job.attempt()));
                    if job.attempt() == 1 {
                        if panic {
                            panic!("the handler panics on its first attempt");
                        }
                        return Err("the handler fails on its first attempt".into());
                    }
                    Ok::<_, BoxError>(Outcome::Ack)
                }
            },
        )
        .expect("subscribe");
    wait_until(
        "the retried row to be acked",
        Duration::from_secs(10),
        || {
            let q = q.clone();
            async move { q.metrics().acked == 1 }
        },
    )
    .await;
    let m = sub.metrics();
    sub.shutdown().await;
    assert_eq!(*seen.lock().unwrap(), vec![(id, 1), (id, 2)]);
    if panic {
        assert_eq!(m.panics, 1);
    } else {
        assert_eq!(m.handler_errors, 1);
    }
    assert_eq!(m.retried, 1);
    assert!(
        q.row_state(id).await.unwrap().is_none(),
        "the acked row is deleted"
    );
    fx.cleanup().await;
}

/// A panicking handler becomes a retry; the worker survives and the row is acked next time.
pub async fn a_handler_panic_is_a_retry<D: TestDb>(mode: ClaimMode) {
    failing_first_attempt::<D>(mode, true).await;
}

/// A handler error becomes a retry; the row is acked next time.
pub async fn a_handler_error_is_a_retry<D: TestDb>(mode: ClaimMode) {
    failing_first_attempt::<D>(mode, false).await;
}

/// A row whose payload does not decode is put back with its attempt counted, and dead-lettered
/// when its attempts are spent: never handed out broken, never lost.
pub async fn a_row_that_does_not_decode_is_retried_not_lost<D: TestDb>(mode: ClaimMode) {
    let dead = unique_name("dead");
    let dead_table = dead.clone();
    let fx = Fixture::<D>::new(mode, move |b| {
        b.max_attempts(2).dead_letter(DeadLetter::Table(dead_table))
    })
    .await;
    let q = fx.queue().await;
    let mut job = NewJob::new(D::Text::from(crate::fixture::UNDECODABLE.to_owned()));
    if mode == ClaimMode::Advisory {
        job = job.column("k", "null-payload");
    }
    let id = q.publish(job).await.unwrap();
    // The first claim puts the row back (a retry), the second dead-letters it: each counted as
    // what it did.
    for (claim, expected) in [(1, (1, 1, 0)), (2, (2, 1, 1))] {
        let got = q.claim(1).await.unwrap();
        assert!(
            got.is_empty(),
            "a row that does not decode is not handed out"
        );
        fx.broker.flush_cleanups().await;
        let m = q.metrics();
        assert_eq!(
            (m.decode_errors, m.retried, m.dead_lettered),
            expected,
            "after claim {claim}: {m:?}"
        );
    }
    let state = q.row_state(id).await.unwrap().expect("the row is kept");
    assert!(state.dead, "spent attempts dead-letter the row: {state:?}");
    fx.cleanup().await;
}

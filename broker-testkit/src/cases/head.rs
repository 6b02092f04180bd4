//! Issue #32: claims start reading at the table's head, past the acked rows at the front of the
//! claim order, and never lose a row that comes back before it (see `broker-core/src/head.rs`).
//! Where a backend reads from the start anyway (it has no dead entries to skip), these cases
//! hold trivially.

use std::time::Duration;

use broker_core::{ClaimMode, Queue};

use super::claim_one;
use crate::{Fixture, TestDb};

/// Claims and acks one row at a time for a little over a second, so that the head moves past
/// the rows claimed first (it trails the claims by a second). Returns the ids acked.
async fn move_the_head<D: TestDb>(q: &Queue<D::B, D::Job>) -> Vec<i64> {
    let mut acked = Vec::new();
    for _ in 0..14 {
        let d = claim_one::<D>(q).await;
        acked.push(d.id());
        d.ack().await.expect("ack");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    acked
}

/// Waits until advisory candidates an earlier read left for the next claims are too old to be
/// used (they are kept for 200 ms), so the next claim reads the table again.
async fn forget_candidates() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// A row this process gives back after the head moved past it is the next claim's first row:
/// the head moves back to it at once instead of leaving it to the next read from the start.
/// First by a retry due at once (every mode); then, where a dropped delivery gives its row back
/// in a clean-up task that [`flush_cleanups`](broker_core::Broker::flush_cleanups) waits for
/// (lease, advisory), by dropping the delivery. A dropped row lock delivery's rollback reaches
/// the server with its connection's next use, so the row may still be locked at the next claim.
pub async fn a_row_given_back_behind_the_head_is_the_next_claims_first<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 60).await;
    let first = claim_one::<D>(&q).await;
    assert_eq!(first.id(), ids[0]);
    let acked = move_the_head::<D>(&q).await;
    assert!(acked.iter().all(|id| *id > ids[0]));
    first.retry().await.expect("retry");
    forget_candidates().await;
    let again = claim_one::<D>(&q).await;
    assert_eq!(
        again.id(),
        ids[0],
        "the row retried comes first in the claim order; the next claim took {} instead",
        again.id()
    );
    if mode == ClaimMode::RowLock {
        again.ack().await.expect("ack");
    } else {
        move_the_head::<D>(&q).await;
        drop(again);
        fx.broker.flush_cleanups().await;
        forget_candidates().await;
        let next = claim_one::<D>(&q).await;
        assert_eq!(
            next.id(),
            ids[0],
            "the row of a dropped delivery comes first in the claim order; the next claim took {} instead",
            next.id()
        );
        next.ack().await.expect("ack");
    }
    fx.cleanup().await;
}

/// Advisory mode: a row passed over because another delivery holds its key stays ahead of the
/// head while it waits, however long the other keys' rows keep the claims busy: once its key is
/// free, the next claim takes it.
pub async fn a_row_passed_over_for_its_held_key_is_claimed_once_the_key_is_free<D: TestDb>(
    mode: ClaimMode,
) {
    use broker_core::NewJob;
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let job = |i: usize, k: &str| NewJob::new(D::Text::from(format!("job-{i}"))).column("k", k);
    let mut jobs = vec![job(0, "busy"), job(1, "busy")];
    jobs.extend((2..60).map(|i| job(i, &format!("k{i}"))));
    let ids = q.publish_batch(&jobs).await.expect("publish");
    let holder = claim_one::<D>(&q).await;
    assert_eq!(holder.id(), ids[0]);
    let acked = move_the_head::<D>(&q).await;
    assert!(
        !acked.contains(&ids[1]),
        "the second row of the held key ran while its key was held"
    );
    holder.ack().await.expect("ack");
    forget_candidates().await;
    let next = claim_one::<D>(&q).await;
    assert_eq!(
        next.id(),
        ids[1],
        "the row that waited for its key comes first once the key is free; the next claim took {} instead",
        next.id()
    );
    next.ack().await.expect("ack");
    fx.cleanup().await;
}

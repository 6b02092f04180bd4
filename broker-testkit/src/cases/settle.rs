//! Outcomes: ack, retries, scheduled rows, dead letters, priorities, leases.

use std::time::{Duration, Instant};

use broker_core::{
    ClaimMode, ColumnType, DeadLetter, NewJob, Outcome, SqlxBrokerError, SubscribeOptions,
};

use super::claim_one;
use crate::{Fixture, JobText, TestDb, unique_name, wait_until};

/// Ack deletes the row when the table has no `processed_at`.
pub async fn ack_deletes_the_row<D: TestDb>(mode: ClaimMode) {
    let Some(fx) = Fixture::<D>::new(mode, |b| b).await else {
        return;
    };
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
    let Some(fx) = Fixture::<D>::new(mode, |b| b.processed_at("done_at")).await else {
        return;
    };
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    claim_one::<D>(&q).await.ack().await.unwrap();
    let state = q.row_state(id).await.unwrap().expect("the row stays");
    assert!(state.processed);
    assert!(q.claim(1).await.unwrap().is_empty());
    fx.cleanup().await;
}

/// A delayed retry hides the row until its due time, then it is claimed again.
pub async fn retry_after_hides_the_row_until_due<D: TestDb>(mode: ClaimMode) {
    let Some(fx) = Fixture::<D>::new(mode, |b| b).await else {
        return;
    };
    let q = fx.queue().await;
    fx.publish(&q, 1).await;
    let start = Instant::now();
    claim_one::<D>(&q)
        .await
        .retry_after(Duration::from_millis(1500))
        .await
        .unwrap();
    assert!(q.claim(1).await.unwrap().is_empty(), "not due yet");
    let again = claim_one::<D>(&q).await;
    assert!(
        start.elapsed() >= Duration::from_millis(1400),
        "claimed after {:?}",
        start.elapsed()
    );
    assert_eq!(again.attempt(), 2);
    again.ack().await.unwrap();
    fx.cleanup().await;
}

/// A row published with a future due time is not claimed before it.
pub async fn scheduled_rows_are_not_claimed_early<D: TestDb>(mode: ClaimMode) {
    let Some(fx) = Fixture::<D>::new(mode, |b| b).await else {
        return;
    };
    let q = fx.queue().await;
    let start = Instant::now();
    q.publish(fx.job(0).run_after(Duration::from_millis(1200)))
        .await
        .unwrap();
    q.publish(fx.job(1)).await.unwrap();
    let now = claim_one::<D>(&q).await;
    assert_eq!(
        now.payload().text(),
        "job-1",
        "only the unscheduled row is due"
    );
    now.ack().await.unwrap();
    assert!(q.claim(1).await.unwrap().is_empty());
    let later = claim_one::<D>(&q).await;
    assert_eq!(later.payload().text(), "job-0");
    assert!(start.elapsed() >= Duration::from_millis(1100));
    assert_eq!(later.attempt(), 1);
    later.ack().await.unwrap();
    fx.cleanup().await;
}

async fn dead_letter_case<D: TestDb>(mode: ClaimMode, target: DeadLetter) {
    let Some(fx) = Fixture::<D>::new(mode, |b| b.max_attempts(3).dead_letter(target)).await else {
        return;
    };
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
    let Some(fx) = Fixture::<D>::new(mode, |b| b.priority("prio")).await else {
        return;
    };
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

/// A lease that ran out and was claimed again cannot be settled by its old holder: the
/// settlement returns `LeaseLost` and changes nothing; the new holder settles.
pub async fn a_stale_lease_holder_cannot_settle<D: TestDb>() {
    let Some(fx) = Fixture::<D>::new(ClaimMode::Lease, |b| b.lease_seconds(1)).await else {
        return;
    };
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let stale = claim_one::<D>(&q).await;
    let fresh = claim_one::<D>(&q).await; // waits for the lease to run out
    assert_eq!(fresh.id(), id);
    assert_eq!(fresh.attempt(), 2);
    let before = q.row_state(id).await.unwrap().unwrap();
    let err = stale.ack().await.unwrap_err();
    assert!(
        matches!(err, SqlxBrokerError::LeaseLost { id: lost, .. } if lost == id),
        "{err:?}"
    );
    assert!(err.to_string().contains(fx.table.name()));
    assert_eq!(
        q.row_state(id).await.unwrap().unwrap(),
        before,
        "nothing changed"
    );
    assert_eq!(q.metrics().lease_lost, 1);
    fresh.ack().await.unwrap();
    assert!(q.row_state(id).await.unwrap().is_none());
    fx.cleanup().await;
}

/// Renewal every half lease keeps a handler that runs three leases long: nobody else claims the
/// row meanwhile, and its ack lands.
pub async fn renewal_keeps_a_handler_that_runs_three_leases<D: TestDb>() {
    let Some(mut fx) = Fixture::<D>::new(ClaimMode::Lease, |b| b.lease_seconds(1)).await else {
        return;
    };
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let id = fx.publish(&q, 1).await[0];
    let sub = q.subscribe(SubscribeOptions::new(), |_job| {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(3200)).await;
            Ok(Outcome::Ack)
        })
    });
    wait_until("the long handler in work", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().in_work == 1 }
    })
    .await;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(2800) {
        assert!(
            other.claim(1).await.unwrap().is_empty(),
            "the renewed lease holds the row"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_until("the long handler's ack", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().acked == 1 }
    })
    .await;
    assert_eq!(sub.shutdown().await.dropped, 0);
    assert_eq!(q.metrics().lease_lost, 0);
    assert!(q.row_state(id).await.unwrap().is_none());
    fx.cleanup().await;
}

/// A lease claim for a batch larger than the free slots holds the surplus for later: those rows
/// wait for the one slot longer than their lease, and renewal keeps them from other claims.
pub async fn prefetched_rows_keep_their_leases_while_they_wait<D: TestDb>() {
    let Some(mut fx) = Fixture::<D>::new(ClaimMode::Lease, |b| b.lease_seconds(1)).await else {
        return;
    };
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let ids = fx.publish(&q, 3).await;
    let sub = q.subscribe(
        SubscribeOptions::new().concurrency(1).batch_size(3),
        |_job| {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(1100)).await;
                Ok(Outcome::Ack)
            })
        },
    );
    wait_until("the first handler in work", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().in_work == 1 }
    })
    .await;
    assert_eq!(q.metrics().claimed, 3, "one claim took the whole batch");
    // The last row waits two handlers (2.2 s) for its slot, past its 1 s lease.
    let start = Instant::now();
    while q.metrics().acked < 3 {
        assert!(
            other.claim(1).await.unwrap().is_empty(),
            "a waiting row's renewed lease holds it"
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "three 1.1 s handlers finish well within 20 s"
        );
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

/// In row lock mode the handler writes through the delivery's transaction: the writes commit
/// with the ack and roll back with a retry.
pub async fn row_lock_handler_writes_commit_with_the_ack_only<D: TestDb>() {
    let Some(fx) = Fixture::<D>::new(ClaimMode::RowLock, |b| b).await else {
        return;
    };
    let q = fx.queue().await;
    let side = broker_core::TableDescription::builder(unique_name("side"))
        .payload("payload", ColumnType::Text)
        .build()
        .unwrap();
    fx.broker.create_tables(&side).await.unwrap();
    let side_q = fx.broker.queue::<D::Job>(side.clone()).await.unwrap();
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

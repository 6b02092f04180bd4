//! Snooze (issue #48): a row put back for later without spending an attempt, counted in the
//! table's snooze counter, and dead-lettered past a subscription's `max_snoozes`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_core::{
    BoxError, ClaimMode, ColumnType, DeadLetter, JobState, Outcome, Page, SqlxBrokerError,
    SubscribeOptions, TableDescription,
};

use super::claim_one;
use crate::{Fixture, TestDb, claim_within, unique_name, wait_until};

/// How many times each case snoozes a row before it goes on.
const SNOOZES: i64 = 3;

/// A row snoozed three times (at no delay) then failed twice shows the attempts a row never
/// snoozed shows: 1, 1, 1, 1, 2, 3, and it is not dead-lettered by `max_attempts(3)` before
/// its third real attempt. The attempt column after each snooze is what it was before the
/// snoozed delivery's claim, the counter counts each snooze, and `snoozed` counts them.
pub async fn a_snooze_spends_no_attempt<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| {
        b.snoozes("snoozes")
            .max_attempts(3)
            .dead_letter(DeadLetter::Table(unique_name("dead")))
    })
    .await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let column_before = q.row_state(id).await.unwrap().unwrap().attempt;
    let mut seen = Vec::new();
    for n in 0..SNOOZES {
        let d = claim_within(&q, Duration::from_secs(10), "the snoozed row again").await;
        assert_eq!(d.id(), id);
        assert_eq!(d.snoozes(), Some(n), "the counter before snooze {}", n + 1);
        seen.push(d.attempt());
        d.snooze(Duration::ZERO).await.expect("snooze");
        assert_eq!(
            q.row_state(id).await.unwrap().unwrap().attempt,
            column_before,
            "the attempt column after snooze {} is as before the claim",
            n + 1
        );
    }
    for _ in 0..2 {
        let d = claim_within(&q, Duration::from_secs(10), "the retried row").await;
        seen.push(d.attempt());
        d.retry().await.expect("retry");
    }
    let last = claim_within(&q, Duration::from_secs(10), "the row's third attempt").await;
    assert_eq!(last.snoozes(), Some(SNOOZES));
    seen.push(last.attempt());
    last.ack().await.expect("ack");
    assert_eq!(
        seen,
        [1, 1, 1, 1, 2, 3],
        "snoozes spend no attempt: the attempts after them are a never-snoozed row's"
    );
    let m = q.metrics();
    assert_eq!(
        (m.snoozed, m.retried, m.acked, m.dead_lettered),
        (3, 2, 1, 0),
        "{m:?}"
    );
    crate::assert_counters_add_up(&q);
    fx.cleanup().await;
}

/// A snoozed row is not claimed before its delay (5 s, long enough that a slow machine still
/// looks before it passes) and is claimed after it, reading the same attempt as the delivery
/// that snoozed it.
pub async fn a_snoozed_row_waits_for_its_delay<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let d = claim_one::<D>(&q).await;
    let delay = Duration::from_secs(5);
    let snoozed_at = Instant::now();
    let before_ms = broker_core::driver::clock::now_ms();
    d.snooze(delay).await.expect("snooze");
    let due = q
        .row_state(id)
        .await
        .unwrap()
        .unwrap()
        .due_ms
        .expect("a due time");
    assert!(
        due >= before_ms + 5_000 - 1,
        "due {due} is the delay after {before_ms}"
    );
    assert!(
        q.claim(1).await.unwrap().is_empty(),
        "the snoozed row is not claimed before its delay"
    );
    let again = claim_within(
        &q,
        Duration::from_secs(30),
        "the snoozed row after its delay",
    )
    .await;
    // The claim compares the due time with the host's clock, so the delay has passed on it;
    // 100 ms allow for the database's rounding of the written time.
    assert!(
        snoozed_at.elapsed() + Duration::from_millis(100) >= delay,
        "claimed after {:?}, before the delay of {delay:?}",
        snoozed_at.elapsed()
    );
    assert_eq!((again.id(), again.attempt()), (id, 1));
    again.ack().await.unwrap();
    fx.cleanup().await;
}

/// A subscription with `max_snoozes(2)` whose handler always snoozes: two snoozes, then the
/// third dead-letters the row (to a dead-letter table, and as a mark), with "snoozed 2 times"
/// in its `last_error`; the handler ran three times, each at attempt 1.
pub async fn snoozes_past_max_snoozes_end_in_the_dead_letters<D: TestDb>(mode: ClaimMode) {
    for dead in [
        DeadLetter::Table(unique_name("dead")),
        DeadLetter::Column("dead_at".into()),
    ] {
        let fx = Fixture::<D>::new(mode, |b| {
            b.snoozes("snoozes")
                .last_error("last_error")
                .dead_letter(dead)
        })
        .await;
        let q = fx.queue().await;
        let id = fx.publish(&q, 1).await[0];
        let seen: Arc<Mutex<Vec<i64>>> = Arc::default();
        let record = seen.clone();
        let sub = q
            .subscribe(
                SubscribeOptions::new()
                    .poll_interval(Duration::from_millis(50))
                    .max_snoozes(2),
                move |job| {
                    let record = record.clone();
                    async move {
                        record.lock().unwrap().push(job.attempt());
                        Ok::<_, BoxError>(Outcome::Snooze(Duration::from_millis(20)))
                    }
                },
            )
            .expect("subscribe");
        wait_until(
            "the row snoozed past the cap to be dead-lettered",
            Duration::from_secs(30),
            || {
                let q = q.clone();
                async move { q.metrics().dead_lettered == 1 }
            },
        )
        .await;
        sub.shutdown().await;
        assert_eq!(*seen.lock().unwrap(), [1, 1, 1], "attempts seen");
        let m = q.metrics();
        assert_eq!((m.snoozed, m.dead_lettered), (2, 1), "{m:?}");
        assert!(q.row_state(id).await.unwrap().unwrap().dead);
        let dead = q
            .jobs(JobState::Dead, Page::first(10))
            .await
            .expect("list the dead letters");
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0].id, id);
        let error = dead[0].last_error.as_deref().unwrap_or_default();
        assert!(
            error.starts_with("snoozed 2 times"),
            "last_error says why: {error:?}"
        );
        crate::assert_counters_add_up(&q);
        fx.cleanup().await;
    }
}

/// With several brokers on a FIFO table, a head snoozed by one broker keeps its group waiting
/// (as a delayed retry does): the other broker gets the other group's row, nothing of the
/// snoozed head's group until the head is due again, then the head (at the same attempt), then
/// the rest of its group.
pub async fn a_snoozed_fifo_head_keeps_its_group_waiting_across_brokers<D: TestDb>(
    mode: ClaimMode,
) {
    let mut fx = Fixture::<D>::new(mode, |b| b.group("grp").fifo(true)).await;
    let q = fx.queue().await;
    let other = fx.other_queue().await;
    let jobs: Vec<_> = ["g", "g", "h"]
        .iter()
        .enumerate()
        .map(|(i, g)| fx.job(i).group(*g))
        .collect();
    let ids = q.publish_batch(&jobs).await.expect("publish");
    let head = claim_one::<D>(&q).await;
    assert_eq!(head.id(), ids[0]);
    // Long enough that the other group's row is claimed before it passes, on a slow machine too.
    head.snooze(Duration::from_secs(5)).await.expect("snooze");
    // Everything delivered from here on, in order, by either broker, each acked at once.
    let mut order = Vec::new();
    let mut turn = 0;
    while order.len() < 3 {
        let from = if turn % 2 == 0 { &other } else { &q };
        turn += 1;
        let got = from.claim(1).await.expect("claim");
        for d in got {
            order.push((d.id(), d.attempt()));
            d.ack().await.unwrap();
        }
        assert!(turn < 2_000, "the rows never all came: {order:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let group_g: Vec<_> = order.iter().filter(|(id, _)| *id != ids[2]).collect();
    assert_eq!(
        group_g,
        [&(ids[0], 1), &(ids[1], 1)],
        "g's second row comes only after its snoozed head, which spent no attempt (order {order:?})"
    );
    assert!(order.contains(&(ids[2], 1)), "group h ran: {order:?}");
    assert_eq!(
        order.first().map(|o| o.0),
        Some(ids[2]),
        "h runs while g's head sleeps: {order:?}"
    );
    fx.cleanup().await;
}

/// What a table cannot snooze with is refused with what to add: `max_snoozes` without a snooze
/// counter column, or without a dead-letter target, at subscribe; a snooze by hand on a table
/// without a due-time column, at the settlement (the row is released, nothing changes). A
/// subscription there cannot know in advance: its handler's snooze becomes a retry at once.
pub async fn what_a_table_cannot_snooze_with_is_refused_with_what_to_add<D: TestDb>() {
    let ok = |_job| async { Ok::<_, BoxError>(Outcome::Ack) };
    // No counter column.
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| {
        b.dead_letter(DeadLetter::Column("dead_at".into()))
    })
    .await;
    let q = fx.queue().await;
    let err = q
        .subscribe(SubscribeOptions::new().max_snoozes(3), ok)
        .expect_err("max_snoozes without a counter column is refused");
    let text = err.to_string();
    assert!(
        matches!(
            err,
            SqlxBrokerError::InvalidOption {
                option: "max_snoozes",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(text.contains(".snoozes("), "says what to add: {text}");
    assert!(text.contains(fx.table.name()), "names the table: {text}");
    fx.cleanup().await;

    // No dead-letter target.
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b.snoozes("snoozes")).await;
    let q = fx.queue().await;
    let text = q
        .subscribe(SubscribeOptions::new().max_snoozes(3), ok)
        .expect_err("max_snoozes without a dead-letter target is refused")
        .to_string();
    assert!(text.contains(".dead_letter("), "says what to add: {text}");
    // Without a cap the same table subscribes.
    let sub = q.subscribe(SubscribeOptions::new(), ok).expect("subscribe");
    sub.shutdown().await;
    fx.cleanup().await;

    // No due-time column: a snooze by hand is refused and changes nothing.
    let fx = Fixture::<D>::build(ClaimMode::Lease, |name| {
        TableDescription::builder(name)
            .payload("payload", ColumnType::Text)
            .locked_until("locked_until")
    })
    .await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let d = claim_one::<D>(&q).await;
    let err = d
        .snooze(Duration::from_secs(60))
        .await
        .expect_err("a snooze without a due-time column is refused");
    assert!(err.to_string().contains(".due_at("), "{err}");
    fx.broker.flush_cleanups().await;
    let again = claim_within(&q, Duration::from_secs(10), "the released row").await;
    assert_eq!(again.id(), id);
    again.ack().await.unwrap();

    // A subscription on that table whose handler snoozes: retried at once, the attempt spent
    // (so max_attempts still bounds a handler that always snoozes).
    let id = fx.publish(&q, 1).await[0];
    let seen: Arc<Mutex<Vec<i64>>> = Arc::default();
    let record = seen.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
            move |job| {
                let record = record.clone();
                async move {
                    record.lock().unwrap().push(job.attempt());
                    Ok::<_, BoxError>(if job.attempt() == 1 {
                        Outcome::Snooze(Duration::from_secs(60))
                    } else {
                        Outcome::Ack
                    })
                }
            },
        )
        .expect("subscribe");
    wait_until("the row to be acked", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.metrics().acked == 2 }
    })
    .await;
    sub.shutdown().await;
    assert_eq!(*seen.lock().unwrap(), [1, 2], "row {id}: retried at once");
    let m = q.metrics();
    assert_eq!((m.snoozed, m.retried), (0, 1), "{m:?}");
    fx.cleanup().await;
}

//! Issue #29: operating a queue. Counts by state, job control fenced like settlements, pauses
//! seen across brokers, and bad input refused without changing anything.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use broker_core::{
    ClaimMode, DeadLetter, DeadLetters, JobState, Outcome, Page, SqlxBrokerError, SubscribeOptions,
    TableBuilder,
};

use super::claim_one;
use crate::{Fixture, TestDb, wait_until};

/// A table that keeps every row somewhere: acks set `processed_at`, dead letters get a mark
/// (or move to a table), and the handler's error is kept.
fn keeping(b: TableBuilder, dead: DeadLetter) -> TableBuilder {
    b.processed_at("done_at")
        .last_error("last_error")
        .max_attempts(2)
        .dead_letter(dead)
}

fn marked(b: TableBuilder) -> TableBuilder {
    keeping(b, DeadLetter::Column("dead_at".into()))
}

/// While four workers drain the table with random outcomes (and, where the database has server
/// connections, their connections are killed), every reading of `stats()` from another broker
/// counts each row exactly once: due, scheduled, in work, dead and finished add up to the rows
/// published, all the time.
pub async fn stats_count_every_row_once_while_workers_drain<D: TestDb>(mode: ClaimMode) {
    const ROWS: usize = 300;
    const LATER: usize = 30;
    // A claim whose commit went through while a kill cut its connection leaves its rows leased
    // by no delivery: in work, rightly, until the lease runs out. A short lease lets the drain
    // end within the loop's readings (a 30 s lease outlived them on MariaDB, where a lease claim
    // commits apart from its update).
    let mut fx = Fixture::<D>::new(mode, |b| match mode {
        ClaimMode::Lease => marked(b).lease_seconds(2),
        _ => marked(b),
    })
    .await;
    let q = fx.queue().await;
    let watcher = fx.other_queue().await;
    let jobs: Vec<_> = (0..ROWS)
        .map(|i| match i < LATER {
            true => fx.job(i).run_after(Duration::from_secs(3600)),
            false => fx.job(i),
        })
        .collect();
    q.publish_batch(&jobs).await.expect("publish");
    let n = Arc::new(AtomicUsize::new(0));
    let sub = {
        let n = n.clone();
        q.subscribe(
            SubscribeOptions::new()
                .concurrency(4)
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |_job| {
                let i = n.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    match i % 5 {
                        0 => Err::<Outcome, _>(std::io::Error::other("failed on purpose")),
                        1 => Ok(Outcome::Retry),
                        _ => Ok(Outcome::Ack),
                    }
                }
            },
        )
        .expect("subscribe")
    };
    let mut readings = 0;
    let mut kills = 0;
    let mut saw_in_work = false;
    for round in 0..2000 {
        let s = watcher.stats().await.expect("stats");
        let total = s.due.rows
            + s.scheduled.rows
            + s.in_work.rows
            + s.dead.expect("a dead-letter target").rows
            + s.finished.expect("processed_at").rows;
        assert_eq!(
            total, ROWS as u64,
            "reading {readings}: {s:?} does not add up to the {ROWS} rows"
        );
        assert!(s.due.exact && s.scheduled.exact && s.in_work.exact);
        assert!(s.scheduled.rows >= LATER as u64, "{s:?}");
        saw_in_work |= s.in_work.rows > 0;
        readings += 1;
        if s.due.rows == 0 && s.in_work.rows == 0 {
            break;
        }
        if round % 25 == 10 && kills < 3 && D::kill_connections(&fx.broker).await.is_some() {
            kills += 1;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sub.shutdown().await;
    let s = watcher.stats().await.expect("stats");
    assert_eq!(s.due.rows + s.in_work.rows, 0, "the drain ended: {s:?}");
    assert_eq!(s.scheduled.rows, LATER as u64, "{s:?}");
    assert!(readings > 5, "only {readings} readings");
    assert!(saw_in_work, "no reading saw a row in work");
    fx.cleanup().await;
}

/// Run-now is refused for a row in work (and changes nothing); cancel of a row in work is
/// signalled to its holder instead (here a manual delivery, whose ack still wins: no engine
/// watches its signal); both are applied to a row no delivery holds, and an operation on a
/// row that is gone says so.
pub async fn cancel_and_run_now_are_refused_for_a_row_in_work_and_applied_otherwise<D: TestDb>(
    mode: ClaimMode,
) {
    let fx = Fixture::<D>::new(mode, marked).await;
    let q = fx.queue().await;
    let ids = fx.publish(&q, 3).await;
    let later = q
        .publish(fx.job(10).run_after(Duration::from_secs(3600)))
        .await
        .expect("publish");
    let held = claim_one::<D>(&q).await;
    assert_eq!(held.id(), ids[0]);
    let err = q.run_now(ids[0]).await.unwrap_err();
    match &err {
        SqlxBrokerError::RowInWork { id, .. } => assert_eq!(*id, ids[0]),
        other => panic!("run now of a row in work: expected RowInWork, got {other:?}"),
    }
    assert!(err.to_string().contains(&ids[0].to_string()), "{err}");
    assert_eq!(
        q.cancel(ids[0]).await.expect("cancel a row in work"),
        broker_core::Cancelled::Signalled
    );
    assert!(
        q.row_state(ids[0]).await.unwrap().is_some(),
        "the holder, not the cancel, deletes a row in work"
    );
    // The delivery is undisturbed: it settles.
    held.ack().await.expect("the delivery in work still acks");
    // A row in no delivery is cancelled: gone, and a second cancel says so.
    assert_eq!(
        q.cancel(ids[1]).await.expect("cancel a due row"),
        broker_core::Cancelled::Removed
    );
    assert!(
        q.row_state(ids[1]).await.unwrap().is_none(),
        "the cancelled row is gone"
    );
    assert!(matches!(
        q.cancel(ids[1]).await.unwrap_err(),
        SqlxBrokerError::RowNotFound { .. }
    ));
    // A finished row is not a row to cancel.
    assert!(matches!(
        q.cancel(ids[0]).await.unwrap_err(),
        SqlxBrokerError::RowNotFound { .. }
    ));
    // A scheduled row runs now.
    assert!(q.claim(5).await.unwrap().iter().all(|d| d.id() != later));
    q.run_now(later).await.expect("run a scheduled row now");
    let mut got = Vec::new();
    for _ in 0..2 {
        let d = claim_one::<D>(&q).await;
        got.push(d.id());
        d.ack().await.unwrap();
    }
    assert!(
        got.contains(&later),
        "the scheduled row was claimed after run_now: {got:?}"
    );
    // A missing row, for each operation.
    for err in [
        q.cancel(987_654_321).await.unwrap_err(),
        q.run_now(987_654_321).await.unwrap_err(),
    ] {
        assert!(
            matches!(
                err,
                SqlxBrokerError::RowNotFound {
                    id: 987_654_321,
                    ..
                }
            ),
            "{err:?}"
        );
    }
    fx.cleanup().await;
}

/// A dead letter (marked or moved to a table) requeued runs again reading attempt 1; requeueing
/// again finds nothing to do; the handler's last error is shown with the dead letters.
pub async fn a_requeued_dead_letter_runs_again_reading_attempt_one<D: TestDb>(mode: ClaimMode) {
    for dead in [
        DeadLetter::Column("dead_at".into()),
        DeadLetter::Table(String::new()),
    ] {
        let fx = Fixture::<D>::new(mode, |b| {
            let target = match &dead {
                DeadLetter::Table(_) => {
                    let name = format!("{}_dead", b.clone().build().unwrap().name());
                    DeadLetter::Table(name)
                }
                other => other.clone(),
            };
            keeping(b, target)
        })
        .await;
        let q = fx.queue().await;
        let ids = fx.publish(&q, 2).await;
        let sub = q
            .subscribe(
                SubscribeOptions::new()
                    .concurrency(2)
                    .poll_interval(Duration::from_millis(50))
                    .error_backoff(Duration::ZERO, Duration::ZERO),
                |_job| async { Err::<Outcome, _>(std::io::Error::other("boom <b>bold</b>")) },
            )
            .expect("subscribe");
        wait_until("both rows dead", Duration::from_secs(20), || {
            let q = q.clone();
            async move { q.metrics().dead_lettered == 2 }
        })
        .await;
        sub.shutdown().await;
        let dead = q.dead_letters(Page::first(10)).await.expect("dead letters");
        assert_eq!(dead.iter().map(|d| d.id).collect::<Vec<_>>(), ids);
        for d in &dead {
            assert_eq!(d.state, JobState::Dead);
            assert_eq!(d.attempt, 3, "two failed attempts counted");
            assert!(
                d.last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("boom <b>bold</b>")),
                "{d:?}"
            );
            assert_eq!(
                d.payload.as_deref().map(|p| p.starts_with("job-")),
                Some(true)
            );
        }
        assert_eq!(
            q.requeue_dead(DeadLetters::Ids(vec![ids[0]]))
                .await
                .unwrap(),
            1
        );
        let again = claim_one::<D>(&q).await;
        assert_eq!((again.id(), again.attempt()), (ids[0], 1));
        again.ack().await.unwrap();
        // By error text, then all: the rest; a second run finds nothing.
        assert_eq!(
            q.requeue_dead(DeadLetters::ErrorContains("boom".into()))
                .await
                .unwrap(),
            1
        );
        assert_eq!(q.requeue_dead(DeadLetters::All).await.unwrap(), 0);
        let second = claim_one::<D>(&q).await;
        assert_eq!((second.id(), second.attempt()), (ids[1], 1));
        second.ack().await.unwrap();
        let s = q.stats().await.unwrap();
        assert_eq!(s.dead.map(|c| c.rows), Some(0));
        assert_eq!(s.finished.map(|c| c.rows), Some(2));
        fx.cleanup().await;
    }
}

/// A pause made through another broker stops this broker's claims within its poll interval,
/// publishes are still accepted, and a resume restarts the claims; a pause in the same process
/// stops them at once. `stats()` shows the pause.
pub async fn a_pause_from_another_broker_stops_claims_and_a_resume_restarts_them<D: TestDb>() {
    let mut fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    let operator = fx.other_queue().await;
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(2)
                .poll_interval(Duration::from_millis(100)),
            |_job| async { Outcome::Ack },
        )
        .expect("subscribe");
    fx.publish(&q, 3).await;
    wait_until("the first rows acked", Duration::from_secs(10), || {
        let q = q.clone();
        async move { q.metrics().acked == 3 }
    })
    .await;
    operator.pause("the operator").await.expect("pause");
    let shown = operator
        .stats()
        .await
        .unwrap()
        .paused
        .expect("stats show the pause");
    assert_eq!(shown.by, "the operator");
    // The subscription reads the pause at its next poll; its health says so.
    wait_until("health to show the pause", Duration::from_secs(10), || {
        let paused = sub.health().paused;
        async move { paused }
    })
    .await;
    assert!(sub.health().is_healthy(), "a pause is not a fault");
    let before = q.metrics().claimed;
    fx.publish(&q, 5).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        q.metrics().claimed,
        before,
        "a paused queue's subscription claimed rows"
    );
    operator.resume().await.expect("resume");
    wait_until("health to show the resume", Duration::from_secs(10), || {
        let paused = sub.health().paused;
        async move { !paused }
    })
    .await;
    wait_until(
        "the rows published while paused acked",
        Duration::from_secs(10),
        || {
            let q = q.clone();
            async move { q.metrics().acked == 8 }
        },
    )
    .await;
    // In this process a pause takes effect at once: no wait before the publish.
    q.pause("this process").await.expect("pause here");
    let before = q.metrics().claimed;
    fx.publish(&q, 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        q.metrics().claimed,
        before,
        "claims right after a local pause"
    );
    q.resume().await.expect("resume here");
    wait_until(
        "the rows acked after the resume",
        Duration::from_secs(10),
        || {
            let q = q.clone();
            async move { q.metrics().acked == 10 }
        },
    )
    .await;
    sub.shutdown().await;
    assert!(operator.stats().await.unwrap().paused.is_none());
    fx.cleanup().await;
}

/// Bad input to the operations is refused with an error that says what to change, and changes
/// nothing: unknown ids among known ones, empty filters, pausing a paused queue, resuming a
/// running one, dead letters of a table without a dead-letter target, pages out of range.
pub async fn bad_operations_are_refused_and_change_nothing<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, marked).await;
    let q = fx.queue().await;
    let id = fx.publish(&q, 1).await[0];
    let d = claim_one::<D>(&q).await;
    d.dead_letter().await.expect("dead-letter");
    let refused = |e: SqlxBrokerError, needle: &str| {
        let msg = e.to_string();
        assert!(
            matches!(e, SqlxBrokerError::Refused { .. }),
            "expected Refused, got {msg}"
        );
        assert!(msg.contains(needle), "{msg}");
    };
    refused(
        q.requeue_dead(DeadLetters::Ids(vec![])).await.unwrap_err(),
        "empty",
    );
    refused(
        q.requeue_dead(DeadLetters::ErrorContains(String::new()))
            .await
            .unwrap_err(),
        "empty",
    );
    refused(
        q.jobs(JobState::Due, Page::first(0)).await.unwrap_err(),
        "1 to",
    );
    refused(q.resume().await.unwrap_err(), "not paused");
    q.pause("first").await.unwrap();
    refused(q.pause("second").await.unwrap_err(), "paused already");
    assert_eq!(q.paused().await.unwrap().unwrap().by, "first");
    q.resume().await.unwrap();
    // A known dead letter with an unknown id: nothing moves.
    let err = q
        .requeue_dead(DeadLetters::Ids(vec![id, 987_654_321]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SqlxBrokerError::RowNotFound {
                id: 987_654_321,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("dead letters"), "{err}");
    let s = q.stats().await.unwrap();
    assert_eq!(
        s.dead.map(|c| c.rows),
        Some(1),
        "nothing was requeued: {s:?}"
    );
    let err = q
        .discard_dead(DeadLetters::Ids(vec![987_654_321]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SqlxBrokerError::RowNotFound { .. }),
        "{err:?}"
    );
    assert_eq!(q.discard_dead(DeadLetters::Ids(vec![id])).await.unwrap(), 1);
    assert_eq!(q.stats().await.unwrap().dead.map(|c| c.rows), Some(0));
    fx.cleanup().await;
    // A table without a dead-letter target has no dead letters; one whose acks delete has no
    // finished rows.
    let fx = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    refused(
        q.requeue_dead(DeadLetters::All).await.unwrap_err(),
        "dead-letter target",
    );
    refused(
        q.dead_letters(Page::first(10)).await.unwrap_err(),
        "dead-letter target",
    );
    refused(
        q.purge_finished(Duration::from_secs(1)).await.unwrap_err(),
        "acks delete",
    );
    let s = q.stats().await.unwrap();
    assert_eq!((s.dead, s.finished), (None, None));
    fx.cleanup().await;
}

/// Listings page through rows by state; purging removes finished rows older than asked.
pub async fn rows_are_listed_by_state_a_page_at_a_time_and_old_finished_rows_purged<D: TestDb>() {
    let fx = Fixture::<D>::new(ClaimMode::Lease, marked).await;
    let q = fx.queue().await;
    let due = fx.publish(&q, 5).await;
    let later: Vec<i64> = q
        .publish_batch(
            &(10..13)
                .map(|i| fx.job(i).run_after(Duration::from_secs(3600)))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    let first = q.jobs(JobState::Due, Page::first(2)).await.unwrap();
    assert_eq!(first.iter().map(|j| j.id).collect::<Vec<_>>(), due[..2]);
    let next = q
        .jobs(JobState::Due, Page::after(first[1].id, 10))
        .await
        .unwrap();
    assert_eq!(next.iter().map(|j| j.id).collect::<Vec<_>>(), due[2..]);
    let scheduled = q.jobs(JobState::Scheduled, Page::first(10)).await.unwrap();
    assert_eq!(scheduled.iter().map(|j| j.id).collect::<Vec<_>>(), later);
    assert!(scheduled.iter().all(|j| j.due_ms.is_some()));
    let held = claim_one::<D>(&q).await;
    let in_work = q.jobs(JobState::InWork, Page::first(10)).await.unwrap();
    assert_eq!(
        in_work.iter().map(|j| j.id).collect::<Vec<_>>(),
        [held.id()]
    );
    held.ack().await.unwrap();
    let finished = q.jobs(JobState::Finished, Page::first(10)).await.unwrap();
    assert_eq!(finished.len(), 1);
    assert!(finished[0].finished_ms.is_some());
    assert_eq!(
        q.purge_finished(Duration::from_secs(3600)).await.unwrap(),
        0
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(q.purge_finished(Duration::ZERO).await.unwrap(), 1);
    assert_eq!(q.stats().await.unwrap().finished.map(|c| c.rows), Some(0));
    fx.cleanup().await;
}

/// A `last_error` column that is not a text column is refused at startup, with an error naming
/// the table and the column (an integer column would fail the first handler error instead).
pub async fn a_last_error_column_that_is_not_text_is_a_schema_error_naming_it<D: TestDb>() {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let name = crate::unique_name("errtype");
    let ddl = broker_core::TableDescription::builder(name.as_str())
        .payload("payload", broker_core::ColumnType::Text)
        .column("last_error", broker_core::ColumnType::BigInt)
        .locked_until("locked_until")
        .build()
        .unwrap();
    broker.create_tables(&ddl).await.unwrap();
    let wrong = broker_core::TableDescription::builder(name.as_str())
        .payload("payload", broker_core::ColumnType::Text)
        .locked_until("locked_until")
        .last_error("last_error")
        .build()
        .unwrap();
    let err = broker.queue::<D::Job>(wrong).await.unwrap_err();
    assert!(matches!(err, SqlxBrokerError::Schema { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(&name)
            && msg.contains("\"last_error\"")
            && msg.to_lowercase().contains("text"),
        "{msg}"
    );
    broker.drop_tables(&ddl).await.unwrap();
    broker.close().await;
    D::drop_database(&url).await;
}

/// A key still held while none of its rows is due (a delivery's row just put back for later,
/// before its key is unlocked; here the delivery's row is deleted under it) is no row in work:
/// its scheduled row counts as scheduled, once.
pub async fn a_held_key_with_only_scheduled_rows_counts_each_row_once<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let job =
        |text: &str| broker_core::NewJob::new(D::Text::from(text.to_owned())).column("k", "same");
    let first = q.publish(job("first")).await.expect("publish");
    q.publish(job("later").run_after(Duration::from_secs(3600)))
        .await
        .expect("publish");
    let held = claim_one::<D>(&q).await;
    assert_eq!(held.id(), first);
    D::execute(
        &fx.broker,
        &format!(
            "DELETE FROM {} WHERE {} = {first}",
            D::quote(fx.table.name()),
            D::quote(fx.table.id())
        ),
    )
    .await;
    let s = q.stats().await.expect("stats");
    assert_eq!(
        (s.due.rows, s.scheduled.rows, s.in_work.rows),
        (0, 1, 0),
        "one scheduled row, under a key still held: {s:?}"
    );
    drop(held);
    fx.cleanup().await;
}

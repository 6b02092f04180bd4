//! Unique jobs: a key that no two unfinished rows share, enforced by the database's unique index
//! over unfinished rows; a duplicate returns the existing row's id, alone, in a batch and inside
//! the caller's transaction, and a finished row frees its key.

use std::sync::Arc;

use broker_core::{
    ClaimMode, DeadLetter, JobState, NewJob, Outcome, Page, Published, Queue, SqlxBrokerError,
    Status, TableBuilder,
};

use super::claim_one;
use crate::{Fixture, TestDb};

/// The description of the unique cases: the mode's, with a unique key column `ukey`, acks
/// that keep the row (`processed_at`) and dead letters marked in place, so finished rows stay
/// in the table and only the partial index lets their keys go.
pub(crate) fn keyed(b: TableBuilder) -> TableBuilder {
    b.unique_key("ukey")
        .processed_at("processed_at")
        .max_attempts(1)
        .dead_letter(DeadLetter::Column("dead_at".into()))
}

fn job<D: TestDb>(mode: ClaimMode, payload: &str, key: Option<&str>) -> NewJob<D::Text> {
    let mut job = NewJob::new(D::Text::from(payload.to_owned()));
    if mode == ClaimMode::Advisory {
        job = job.column("k", payload.to_owned());
    }
    match key {
        Some(k) => job.unique_key(k),
        None => job,
    }
}

/// The unfinished rows of a queue (due, scheduled or in work), by id.
async fn unfinished<D: TestDb>(q: &Queue<D::B, D::Job>) -> Vec<(i64, String)> {
    let mut out = Vec::new();
    for state in [JobState::Due, JobState::Scheduled, JobState::InWork] {
        let page = q
            .jobs(state, Page::first(Page::MAX))
            .await
            .expect("list rows");
        out.extend(
            page.into_iter()
                .map(|j| (j.id, j.payload.unwrap_or_default())),
        );
    }
    out.sort_unstable();
    out
}

/// A duplicate of an unfinished row's key returns that row's id and says so: alone, in a
/// batch (against the table and against an earlier job of the batch), and inside the caller's
/// transaction, which goes on and commits what else it wrote.
pub async fn a_duplicate_key_returns_the_existing_row_alone_in_a_batch_and_in_a_transaction<
    D: TestDb,
>(
    mode: ClaimMode,
) {
    let f = Fixture::<D>::new(mode, keyed).await;
    let q = f.queue().await;
    let first = q
        .publish_unique(job::<D>(mode, "a", Some("k1")))
        .await
        .expect("publish k1");
    assert!(!first.duplicate, "the first job of a key inserts");
    let again = q
        .publish_unique(job::<D>(mode, "a-again", Some("k1")))
        .await
        .expect("publish k1 again");
    assert_eq!(
        again,
        Published {
            id: first.id,
            duplicate: true
        },
        "a duplicate gets the existing row's id"
    );
    // `publish` returns the existing id too, without an error.
    assert_eq!(
        q.publish(job::<D>(mode, "a-plain", Some("k1")))
            .await
            .expect("plain publish of a duplicate"),
        first.id
    );

    let batch = q
        .publish_unique_batch(&[
            job::<D>(mode, "b", Some("k2")),
            job::<D>(mode, "none", None),
            job::<D>(mode, "a-batch", Some("k1")),
            job::<D>(mode, "b-again", Some("k2")),
        ])
        .await
        .expect("publish a batch");
    assert!(!batch[0].duplicate && !batch[1].duplicate, "{batch:?}");
    assert_eq!(
        batch[2],
        Published {
            id: first.id,
            duplicate: true
        }
    );
    assert_eq!(
        batch[3],
        Published {
            id: batch[0].id,
            duplicate: true
        },
        "a key twice in one batch makes one row"
    );

    let mut tx = f.broker.pool().begin().await.expect("begin");
    let inside = q
        .publish_unique_in(
            &mut tx,
            &[
                job::<D>(mode, "a-tx", Some("k1")),
                job::<D>(mode, "c", Some("k3")),
            ],
        )
        .await
        .expect("publish inside a transaction");
    assert_eq!(
        inside[0],
        Published {
            id: first.id,
            duplicate: true
        }
    );
    assert!(!inside[1].duplicate);
    // The duplicate did not abort the transaction: it goes on and commits.
    let after = q
        .publish_in(&mut tx, &[job::<D>(mode, "d", None)])
        .await
        .expect("a publish after a duplicate in the same transaction");
    tx.commit().await.expect("commit");

    let rows = unfinished::<D>(&q).await;
    let payloads: Vec<&str> = rows.iter().map(|(_, p)| p.as_str()).collect();
    assert_eq!(
        payloads,
        ["a", "b", "none", "c", "d"],
        "one row per key, plus the rows without one"
    );
    assert_eq!(rows[4].0, after[0]);
    f.cleanup().await;
}

/// Eight brokers publish one key at the same moment, several rounds: each round makes exactly
/// one row, every publisher gets its id, and exactly one of them was not a duplicate.
pub async fn eight_brokers_publishing_one_key_at_once_make_one_row<D: TestDb>(mode: ClaimMode) {
    let mut f = Fixture::<D>::new(mode, keyed).await;
    let mut queues = vec![f.queue().await];
    for _ in 1..8 {
        queues.push(f.other_queue().await);
    }
    for round in 0..5 {
        let key = format!("round-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(queues.len()));
        let tasks: Vec<_> = queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let (q, barrier, key) = (q.clone(), barrier.clone(), key.clone());
                let job = job::<D>(mode, &format!("{key}-{i}"), Some(&key));
                tokio::spawn(async move {
                    barrier.wait().await;
                    q.publish_unique(job).await
                })
            })
            .collect();
        let mut done = Vec::new();
        for t in tasks {
            done.push(t.await.expect("join").expect("publish"));
        }
        let fresh: Vec<_> = done.iter().filter(|p| !p.duplicate).collect();
        assert_eq!(fresh.len(), 1, "round {round}: one insert, got {done:?}");
        assert!(
            done.iter().all(|p| p.id == fresh[0].id),
            "round {round}: every publisher gets the one row's id: {done:?}"
        );
    }
    let rows = unfinished::<D>(&queues[0]).await;
    assert_eq!(rows.len(), 5, "one row per round: {rows:?}");
    f.cleanup().await;
}

/// An ack frees the key (a row kept with `processed_at` is finished), so does a dead letter
/// (marked in place); requeueing a dead letter whose key an unfinished row has taken meanwhile
/// is refused by the index and changes nothing.
pub async fn a_finished_row_frees_its_key<D: TestDb>(mode: ClaimMode) {
    let f = Fixture::<D>::new(mode, keyed).await;
    let q = f.queue().await;
    let first = q
        .publish_unique(job::<D>(mode, "first", Some("k")))
        .await
        .expect("publish");
    let d = claim_one::<D>(&q).await;
    // In work, the key is still taken.
    assert!(
        q.publish_unique(job::<D>(mode, "while-in-work", Some("k")))
            .await
            .expect("publish while in work")
            .duplicate
    );
    d.settle(Outcome::Ack).await.expect("ack");
    let second = q
        .publish_unique(job::<D>(mode, "second", Some("k")))
        .await
        .expect("publish after the ack");
    assert!(!second.duplicate, "the ack freed the key");
    assert_ne!(second.id, first.id);

    let d = claim_one::<D>(&q).await;
    assert_eq!(d.id(), second.id);
    d.settle(Outcome::Retry)
        .await
        .expect("fail the last attempt");
    assert_eq!(
        q.dead_letters(Page::first(10))
            .await
            .expect("dead letters")
            .len(),
        1,
        "max_attempts 1 dead-letters the row"
    );
    let third = q
        .publish_unique(job::<D>(mode, "third", Some("k")))
        .await
        .expect("publish after the dead letter");
    assert!(!third.duplicate, "a dead letter frees its key");

    let err = q
        .requeue_dead(broker_core::DeadLetters::All)
        .await
        .expect_err("a requeue onto a taken key is refused");
    assert!(
        matches!(
            err,
            SqlxBrokerError::Statement { .. } | SqlxBrokerError::Invariant { .. }
        ),
        "{err}"
    );
    assert_eq!(
        q.dead_letters(Page::first(10))
            .await
            .expect("dead letters")
            .len(),
        1,
        "the refused requeue changed nothing"
    );
    f.cleanup().await;
}

/// A key too long for the index, an empty key, and a key on a table without the column are
/// refused before any statement, naming what to change; a unique key column that is not text
/// is refused at startup.
pub async fn bad_unique_keys_are_refused_with_what_to_change<D: TestDb>() {
    let f = Fixture::<D>::new(ClaimMode::Lease, keyed).await;
    let q = f.queue().await;
    let long = "x".repeat(broker_core::MAX_UNIQUE_KEY_CHARS + 1);
    for key in [long.as_str(), ""] {
        let err = q
            .publish(job::<D>(ClaimMode::Lease, "p", Some(key)))
            .await
            .expect_err("a bad key is refused");
        let msg = err.to_string();
        assert!(msg.contains("unique key") && msg.contains("255"), "{msg}");
    }
    let at_limit = "y".repeat(broker_core::MAX_UNIQUE_KEY_CHARS);
    q.publish(job::<D>(ClaimMode::Lease, "p", Some(&at_limit)))
        .await
        .expect("a key of the longest length is kept");
    let plain = Fixture::<D>::new(ClaimMode::Lease, |b| b).await;
    let err = plain
        .queue()
        .await
        .publish(job::<D>(ClaimMode::Lease, "p", Some("k")))
        .await
        .expect_err("no unique key column");
    assert!(err.to_string().contains(".unique_key("), "{err}");
    plain.cleanup().await;

    // A unique key column that is not text is a schema error at startup, naming it.
    let name = crate::unique_name("uqtype");
    let made = broker_core::TableDescription::builder(name.as_str())
        .payload("payload", broker_core::ColumnType::Text)
        .column("ukey", broker_core::ColumnType::BigInt)
        .locked_until("locked_until")
        .build()
        .unwrap();
    f.broker.create_tables(&made).await.unwrap();
    let wrong = broker_core::TableDescription::builder(name.as_str())
        .payload("payload", broker_core::ColumnType::Text)
        .locked_until("locked_until")
        .unique_key("ukey")
        .build()
        .unwrap();
    let err = f.broker.queue::<D::Job>(wrong).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, SqlxBrokerError::Schema { .. })
            && msg.contains("\"ukey\"")
            && msg.contains("unique_key")
            && msg.to_lowercase().contains("text"),
        "{msg}"
    );
    f.broker.drop_tables(&made).await.unwrap();
    f.cleanup().await;
}

/// Without the unique index the database enforces nothing: the doctor fails the table, naming
/// the statement that makes the index, and two publishes of one key make two rows (what the
/// index prevents).
pub async fn the_doctor_fails_a_table_without_its_unique_index<D: TestDb>() {
    let f = Fixture::<D>::new(ClaimMode::Lease, keyed).await;
    let q = f.queue().await;
    let options = broker_core::DoctorOptions::new();
    let report = f.broker.doctor(&f.table, &options).await;
    let check = report
        .check("unique key index")
        .expect("a unique key check");
    assert_eq!(check.status, Status::Pass, "{report}");

    for sql in D::drop_unique_index(f.table.name()) {
        D::execute(&f.broker, &sql).await;
    }
    let report = f.broker.doctor(&f.table, &options).await;
    let check = report
        .check("unique key index")
        .expect("a unique key check");
    assert_eq!(check.status, Status::Fail, "{report}");
    assert!(check.fix.contains("UNIQUE INDEX"), "{report}");
    let a = q
        .publish_unique(job::<D>(ClaimMode::Lease, "a", Some("k")))
        .await
        .expect("publish");
    let b = q
        .publish_unique(job::<D>(ClaimMode::Lease, "b", Some("k")))
        .await
        .expect("publish");
    assert!(
        !a.duplicate && !b.duplicate && a.id != b.id,
        "without the index nothing stops a second row"
    );
    f.cleanup().await;
}

/// Publishes of one key per publisher in the case below.
const PUBLISHES_EACH: usize = 500;

/// Eight publishers of one key (four on each of two brokers) while a worker acks each row as
/// it comes: every publish returns a row, new or a duplicate, and none fails. (On MariaDB two
/// inserts whose duplicate-key check waited on the row an ack was finishing both take a lock
/// on its index entry and then wait on each other; InnoDB undoes one as a deadlock. A
/// duplicate is not an error, so the broker runs that publish again.)
pub async fn eight_publishers_of_one_key_beside_an_acking_worker_never_fail<D: TestDb>(
    mode: ClaimMode,
) {
    let mut f = Fixture::<D>::new(mode, keyed).await;
    let first = f.queue().await;
    let second = f.other_queue().await;
    let worker = first
        .subscribe(
            broker_core::SubscribeOptions::new()
                .poll_interval(std::time::Duration::from_millis(50)),
            |_job| async { Outcome::Ack },
        )
        .expect("subscribe");
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let q = if i % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            let payload = format!("from-{i}");
            tokio::spawn(async move {
                let mut failed = Vec::new();
                let mut fresh = 0;
                for _ in 0..PUBLISHES_EACH {
                    let job = job::<D>(mode, &payload, Some("one-key"));
                    match q.publish_unique(job).await {
                        Ok(p) => fresh += usize::from(!p.duplicate),
                        Err(e) => failed.push(e.to_string()),
                    }
                }
                (fresh, failed)
            })
        })
        .collect();
    let (mut fresh, mut failed) = (0, Vec::new());
    for t in tasks {
        let (n, errors) = t.await.expect("join");
        fresh += n;
        failed.extend(errors);
    }
    let _ = worker.shutdown().await;
    assert!(
        failed.is_empty(),
        "{} of {} publishes failed, the first: {:?}",
        failed.len(),
        8 * PUBLISHES_EACH,
        failed.first()
    );
    assert!(fresh >= 1, "at least the first publish inserts");
    let live = unfinished::<D>(&first).await;
    assert!(
        live.len() <= 1,
        "one key, at most one unfinished row: {live:?}"
    );
    f.cleanup().await;
}

//! Issue #48: job kinds in the operator's view. Counts broken down by kind (each row counted
//! once, in its kind, while subscriptions drain), the kind of each listed row, dead letters of
//! a kind requeued, and the doctor naming kinds no worker knows.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use broker_core::doctor::KINDS_CHECK;
use broker_core::{
    ClaimMode, ColumnType, DeadLetter, DeadLetters, DoctorOptions, Job, JobKind, JobState, KindRow,
    KindStats, Outcome, Page, Queue, QueueStats, Status, SubscribeOptions, TableBuilder,
    TableDescription, Workers,
};
use sqlx::types::Json;
use sqlx::{Database, Encode, FromRow, Type};

use crate::{DbOf, Fixture, TestDb, wait_until};

/// A kind the case's workers run: fails (while `FAIL` says so) every sixth job.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct OpsAlpha {
    /// The job's number.
    pub n: usize,
}
impl JobKind for OpsAlpha {
    const KIND: &'static str = "alpha";
}

/// A kind the case's workers run and ack.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct OpsBeta {
    /// The job's number.
    pub n: usize,
}
impl JobKind for OpsBeta {
    const KIND: &'static str = "beta";
}

/// A kind no worker of the case registers: its rows stay due.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct OpsGamma {
    /// The job's number.
    pub n: usize,
}
impl JobKind for OpsGamma {
    const KIND: &'static str = "gamma";
}

/// A kinds table for `mode`: JSON arguments, a due time, acked rows kept, two attempts, dead
/// letters in a table (a mark in lease mode, so both kinds of target are counted by kind).
fn kinds_table(name: &str, mode: ClaimMode) -> TableBuilder {
    let b = TableDescription::builder(name)
        .payload("args", ColumnType::Json)
        .kind("kind")
        .due_at("due_at")
        .processed_at("done_at")
        .max_attempts(2);
    let b = match mode {
        ClaimMode::Lease => b
            .locked_until("locked_until")
            .dead_letter(DeadLetter::Column("dead_at".into())),
        _ => b.dead_letter(DeadLetter::Table(format!("{name}_dead"))),
    };
    match mode {
        ClaimMode::Advisory => b.column("k", ColumnType::Text).advisory_lock("key-{k}"),
        _ => b,
    }
}

/// Publishes job `n` of kind `K` (its own advisory key in advisory mode, due in an hour when
/// `later`).
async fn publish_kind<D: TestDb, K: JobKind>(
    q: &Queue<D::B, KindRow>,
    args: K,
    n: usize,
    later: bool,
) where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    Json<K>: for<'q> Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let mut job = q.new_kind_job(args).expect("a job of a kind");
    if q.table().mode() == ClaimMode::Advisory {
        job = job.column("k", format!("{}-{n}", K::KIND));
    }
    if later {
        job = job.run_after(Duration::from_secs(3600));
    }
    q.publish(job).await.expect("publish a job of a kind");
}

/// Every count of one kind, added up.
fn rows_of(k: &KindStats) -> u64 {
    k.due.rows
        + k.scheduled.rows
        + k.in_work.rows
        + k.dead.map_or(0, |c| c.rows)
        + k.finished.map_or(0, |c| c.rows)
}

fn kind<'s>(s: &'s QueueStats, name: &str) -> Option<&'s KindStats> {
    s.kinds.iter().find(|k| k.kind.as_deref() == Some(name))
}

/// While two subscriptions (two brokers) of the kinds alpha and beta drain a table that also
/// holds rows of a kind no worker knows, every reading of `stats()` from a third broker counts
/// each row once and in its kind: each kind's states add up to the rows published of it, the
/// totals are the kinds' sums, and the unknown kind's rows stay due. Then the dead letters of
/// one kind show in its counts, are listed with their kind, and `requeue_dead` puts them back
/// to run again.
pub async fn counts_by_kind_add_up_while_subscriptions_drain<D: TestDb>(mode: ClaimMode)
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    Json<OpsAlpha>: for<'q> Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    Json<OpsBeta>: for<'q> Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    Json<OpsGamma>: for<'q> Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    const ALPHA: usize = 60;
    const ALPHA_LATER: usize = 10;
    const BETA: usize = 40;
    const GAMMA: usize = 20;
    const TOTAL: u64 = (ALPHA + ALPHA_LATER + BETA + GAMMA) as u64;
    let mut fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q: Queue<D::B, KindRow> = fx
        .broker
        .queue(fx.table.clone())
        .await
        .expect("the kinds queue");
    for n in 0..ALPHA {
        publish_kind::<D, _>(&q, OpsAlpha { n }, n, false).await;
    }
    for n in ALPHA..ALPHA + ALPHA_LATER {
        publish_kind::<D, _>(&q, OpsAlpha { n }, n, true).await;
    }
    for n in 0..BETA {
        publish_kind::<D, _>(&q, OpsBeta { n }, n, false).await;
    }
    for n in 0..GAMMA {
        publish_kind::<D, _>(&q, OpsGamma { n }, n, false).await;
    }
    let fail = Arc::new(AtomicBool::new(true));
    let workers = |fail: Arc<AtomicBool>| {
        Workers::new()
            .register(move |job: Job<OpsAlpha>| {
                let fail = fail.load(Ordering::SeqCst) && job.payload().n.is_multiple_of(6);
                async move {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    if fail {
                        Err::<Outcome, _>(std::io::Error::other("alpha failed on purpose"))
                    } else {
                        Ok(Outcome::Ack)
                    }
                }
            })
            .register(|_job: Job<OpsBeta>| async {
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok::<_, std::io::Error>(Outcome::Ack)
            })
    };
    let options = || {
        SubscribeOptions::new()
            .concurrency(3)
            .poll_interval(Duration::from_millis(50))
            .error_backoff(Duration::ZERO, Duration::ZERO)
    };
    let other = D::connect(&fx.url).await;
    let q2: Queue<D::B, KindRow> = other.queue(fx.table.clone()).await.expect("queue");
    let watcher_broker = D::connect(&fx.url).await;
    let watcher: Queue<D::B, KindRow> =
        watcher_broker.queue(fx.table.clone()).await.expect("queue");
    let subs = [
        q.work(options(), workers(fail.clone()))
            .await
            .expect("work"),
        q2.work(options(), workers(fail.clone()))
            .await
            .expect("work"),
    ];
    let published = [
        ("alpha", (ALPHA + ALPHA_LATER) as u64),
        ("beta", BETA as u64),
        ("gamma", GAMMA as u64),
    ];
    let mut readings = 0;
    let mut saw_in_work = false;
    let check = |s: &QueueStats, readings: usize| {
        let names: Vec<_> = s.kinds.iter().map(|k| k.kind.as_deref()).collect();
        assert_eq!(
            names,
            [Some("alpha"), Some("beta"), Some("gamma")],
            "reading {readings}: {s:?}"
        );
        for (name, n) in published {
            let k = kind(s, name).expect("the kind is counted");
            assert_eq!(
                rows_of(k),
                n,
                "reading {readings}: kind {name} does not add up to its {n} rows: {s:?}"
            );
            assert!(k.due.exact && k.scheduled.exact && k.in_work.exact, "{s:?}");
        }
        let total = s.due.rows
            + s.scheduled.rows
            + s.in_work.rows
            + s.dead.expect("a dead-letter target").rows
            + s.finished.expect("processed_at").rows;
        assert_eq!(total, TOTAL, "reading {readings}: {s:?}");
        assert!(s.due.exact && s.scheduled.exact && s.in_work.exact, "{s:?}");
        let sum = |f: fn(&KindStats) -> u64| s.kinds.iter().map(f).sum::<u64>();
        assert_eq!(sum(|k| k.due.rows), s.due.rows, "{s:?}");
        assert_eq!(sum(|k| k.scheduled.rows), s.scheduled.rows, "{s:?}");
        assert_eq!(sum(|k| k.in_work.rows), s.in_work.rows, "{s:?}");
        assert_eq!(sum(|k| k.dead.map_or(0, |c| c.rows)), s.dead.unwrap().rows);
        let gamma = kind(s, "gamma").unwrap();
        assert_eq!(gamma.due.rows, GAMMA as u64, "no worker knows gamma: {s:?}");
        assert_eq!(
            kind(s, "alpha").unwrap().scheduled.rows,
            ALPHA_LATER as u64,
            "{s:?}"
        );
    };
    for _ in 0..3000 {
        let s = watcher.stats().await.expect("stats");
        check(&s, readings);
        readings += 1;
        saw_in_work |= s.in_work.rows > 0;
        let busy = |name| kind(&s, name).is_some_and(|k| k.due.rows + k.in_work.rows > 0);
        if !busy("alpha") && !busy("beta") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = watcher.stats().await.expect("stats");
    check(&s, readings);
    let alpha = kind(&s, "alpha").unwrap().clone();
    let beta = kind(&s, "beta").unwrap().clone();
    let failing = (0..ALPHA).filter(|n| n.is_multiple_of(6)).count() as u64;
    assert_eq!(alpha.due.rows + alpha.in_work.rows, 0, "drained: {s:?}");
    assert_eq!(
        alpha.dead.unwrap().rows,
        failing,
        "alpha's dead letters: {s:?}"
    );
    assert_eq!(beta.finished.unwrap().rows, BETA as u64, "{s:?}");
    assert_eq!(beta.dead.unwrap().rows, 0, "{s:?}");
    assert!(readings > 3, "only {readings} readings");
    assert!(saw_in_work, "no reading saw a row in work");

    // Listings carry the kind: the dead letters are alpha's, the due rows gamma's.
    let dead = watcher
        .jobs(JobState::Dead, Page::first(100))
        .await
        .unwrap();
    assert_eq!(dead.len() as u64, failing);
    assert!(
        dead.iter().all(|j| j.kind.as_deref() == Some("alpha")),
        "{dead:?}"
    );
    let due = watcher.jobs(JobState::Due, Page::first(100)).await.unwrap();
    assert_eq!(due.len(), GAMMA);
    assert!(
        due.iter().all(|j| j.kind.as_deref() == Some("gamma")),
        "{due:?}"
    );
    // Listings of one kind.
    let of = |state, kind: &'static str| watcher.jobs_of_kind(state, kind, Page::first(100));
    assert_eq!(of(JobState::Due, "gamma").await.unwrap().len(), GAMMA);
    assert!(of(JobState::Due, "alpha").await.unwrap().is_empty());
    assert_eq!(of(JobState::Dead, "alpha").await.unwrap(), dead);
    assert!(of(JobState::Dead, "beta").await.unwrap().is_empty());
    let scheduled = of(JobState::Scheduled, "alpha").await.unwrap();
    assert_eq!(scheduled.len(), ALPHA_LATER);
    assert!(scheduled.iter().all(|j| j.kind.as_deref() == Some("alpha")));
    let one = watcher
        .job(dead[0].id)
        .await
        .unwrap()
        .expect("the dead letter");
    assert_eq!(one.kind.as_deref(), Some("alpha"));
    assert_eq!(one.state, JobState::Dead);

    // Requeued, alpha's dead letters run again (and now pass).
    fail.store(false, Ordering::SeqCst);
    let moved = watcher
        .requeue_dead(DeadLetters::All)
        .await
        .expect("requeue");
    assert_eq!(moved, failing);
    let s = watcher.stats().await.expect("stats");
    check(&s, readings);
    assert_eq!(kind(&s, "alpha").unwrap().dead.unwrap().rows, 0, "{s:?}");
    wait_until(
        "the requeued dead letters of alpha finish",
        Duration::from_secs(60),
        || {
            let watcher = &watcher;
            async move {
                let s = watcher.stats().await.expect("stats");
                check(&s, 0);
                kind(&s, "alpha").unwrap().finished.unwrap().rows == ALPHA as u64
            }
        },
    )
    .await;
    for sub in subs {
        sub.shutdown().await;
    }
    let s = watcher.stats().await.expect("stats");
    check(&s, readings);
    assert_eq!(kind(&s, "gamma").unwrap().due.rows, GAMMA as u64);
    other.close().await;
    watcher_broker.close().await;
    let _ = &mut fx;
    fx.cleanup().await;
}

/// The doctor of a kinds table warns naming each kind with unfinished rows that none of the
/// kinds it is told the workers know, with how many rows, and passes when they know them all;
/// told nothing, it lists the kinds it found. A table without a kind column has no such check,
/// and no counts by kind.
pub async fn the_doctor_names_kinds_no_worker_knows<D: TestDb>()
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    Json<OpsAlpha>: for<'q> Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    Json<OpsGamma>: for<'q> Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let mode = ClaimMode::Lease;
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q: Queue<D::B, KindRow> = fx.broker.queue(fx.table.clone()).await.expect("queue");
    for n in 0..3 {
        publish_kind::<D, _>(&q, OpsAlpha { n }, n, false).await;
    }
    for n in 0..2 {
        publish_kind::<D, _>(&q, OpsGamma { n }, n, true).await;
    }
    let doctor = |options: DoctorOptions| {
        let fx = &fx;
        async move {
            let report = fx.broker.doctor(&fx.table, &options).await;
            report
                .check(KINDS_CHECK)
                .cloned()
                .unwrap_or_else(|| panic!("no kinds check in {report}"))
        }
    };
    let c = doctor(DoctorOptions::new().kinds(["alpha", "beta"])).await;
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert!(c.found.contains("\"gamma\" (2 unfinished rows)"), "{c:?}");
    assert!(!c.found.contains("alpha"), "alpha is known: {c:?}");
    assert!(!c.fix.is_empty());
    let c = doctor(DoctorOptions::new().kinds(["alpha", "gamma"])).await;
    assert_eq!(c.status, Status::Pass, "{c:?}");
    let c = doctor(DoctorOptions::new()).await;
    assert_eq!(c.status, Status::Pass, "{c:?}");
    assert!(
        c.found.contains("\"alpha\" (3 unfinished)")
            && c.found.contains("\"gamma\" (2 unfinished)"),
        "{c:?}"
    );
    // A plain table: no kinds check, no counts by kind.
    let plain = Fixture::<D>::new(mode, |b| b).await;
    let report = plain
        .broker
        .doctor(&plain.table, &DoctorOptions::new().kinds(["alpha"]))
        .await;
    assert!(report.check(KINDS_CHECK).is_none(), "{report}");
    let pq = plain.queue().await;
    plain.publish(&pq, 2).await;
    assert!(pq.stats().await.unwrap().kinds.is_empty());
    assert!(matches!(
        pq.jobs_of_kind(JobState::Due, "alpha", Page::first(10))
            .await,
        Err(broker_core::SqlxBrokerError::Refused { .. })
    ));
    plain.cleanup().await;
    fx.cleanup().await;
}

//! Job kinds (issue #48): many kinds in one table, each run by its registered worker; a row of
//! a kind no worker of a subscription knows is never claimed by it; a kind's max attempts,
//! timeout, group, priority and unique key apply to its jobs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use broker_core::{
    ClaimMode, ColumnType, DeadLetter, Job, JobKind, JobState, Json, KindDefaults, KindRow,
    Outcome, Page, Queue, SubscribeOptions, TableBuilder, TableDescription, Workers,
};
use serde::{Deserialize, Serialize};
use sqlx::{Database, Encode, FromRow, Type};

use crate::fixture::DbOf;
use crate::{Fixture, TestDb, unique_name, wait_until};

/// A mail to send: grouped by recipient, unique by number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Email {
    /// The recipient.
    pub to: String,
    /// The job's number in the case.
    pub n: i64,
}

impl JobKind for Email {
    const KIND: &'static str = "email";
    fn defaults() -> KindDefaults {
        KindDefaults::new().priority(5)
    }
    fn group(&self) -> Option<String> {
        Some(format!("to-{}", self.to))
    }
    fn unique_key(&self) -> Option<String> {
        Some(format!("email-{}", self.n))
    }
}

/// An image to resize.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resize {
    /// The job's number in the case.
    pub n: i64,
    /// The width asked for.
    pub width: i64,
}

impl JobKind for Resize {
    const KIND: &'static str = "image.resize";
}

/// A report that fails every time, after sleeping `sleep_ms`: two attempts, and a timeout of
/// 300 ms unless its arguments ask for longer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The job's number in the case.
    pub n: i64,
    /// How long the worker sleeps before it fails.
    pub sleep_ms: u64,
}

impl JobKind for Report {
    const KIND: &'static str = "report:v2";
    fn defaults() -> KindDefaults {
        KindDefaults::new()
            .max_attempts(2)
            .timeout(Duration::from_millis(300))
    }
}

/// A report that reads its timeout from its arguments, in place of the kind's 300 ms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slow {
    /// The job's number in the case.
    pub n: i64,
    /// How long the worker sleeps before it acks.
    pub sleep_ms: u64,
    /// The job's own timeout.
    pub limit_ms: u64,
}

impl JobKind for Slow {
    const KIND: &'static str = "slow";
    fn defaults() -> KindDefaults {
        KindDefaults::new().timeout(Duration::from_millis(300))
    }
    fn timeout(&self) -> Option<Duration> {
        Some(Duration::from_millis(self.limit_ms))
    }
}

/// What each case's workers saw: (kind, number) per run.
type Seen = Arc<Mutex<Vec<(&'static str, i64)>>>;

/// A kinds table for `mode`: kind, JSON arguments, due time, last error, a dead-letter table
/// with max attempts 5 (more than [`Report`]'s 2); in advisory mode each row is its own key.
fn kinds_table(name: &str, mode: ClaimMode) -> TableBuilder {
    let b = TableDescription::builder(name)
        .kind("kind")
        .payload("args", ColumnType::Json)
        .due_at("due_at")
        .last_error("last_error")
        .max_attempts(5)
        .dead_letter(DeadLetter::Table(unique_name("dead")));
    match mode {
        ClaimMode::RowLock => b,
        ClaimMode::Lease => b.locked_until("locked_until"),
        ClaimMode::Advisory => b.advisory_lock("job-{id}"),
        other => panic!("the suite has no case for claim mode {other:?}"),
    }
}

async fn kinds_queue<D: TestDb>(fx: &Fixture<D>) -> Queue<D::B, KindRow>
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
{
    fx.broker
        .queue::<KindRow>(fx.table.clone())
        .await
        .expect("prepare the kinds queue")
}

fn options() -> SubscribeOptions {
    SubscribeOptions::new()
        .concurrency(4)
        .poll_interval(Duration::from_millis(100))
}

/// Workers for `Email` and `Resize` that record each run in `seen` and ack.
fn mail_and_resize(seen: &Seen) -> Workers {
    let (a, b) = (seen.clone(), seen.clone());
    Workers::new()
        .register(move |job: Job<Email>| {
            a.lock().unwrap().push((Email::KIND, job.payload().n));
            async { Outcome::Ack }
        })
        .register(move |job: Job<Resize>| {
            assert_eq!(job.payload().width, 100 + job.payload().n);
            b.lock().unwrap().push((Resize::KIND, job.payload().n));
            async { Outcome::Ack }
        })
}

async fn wait_for_runs(seen: &Seen, n: usize, what: &str) {
    wait_until(what, Duration::from_secs(30), || {
        let seen = seen.clone();
        async move { seen.lock().unwrap().len() >= n }
    })
    .await;
}

fn runs_by_job(seen: &Seen) -> HashMap<(&'static str, i64), usize> {
    let mut out = HashMap::new();
    for run in seen.lock().unwrap().iter() {
        *out.entry(*run).or_default() += 1;
    }
    out
}

/// Two kinds published interleaved into one table run once each on their own worker, with
/// their typed arguments, through one subscription; the subscription's counters add up.
pub async fn many_kinds_in_one_table_run_on_their_workers<D: TestDb>(mode: ClaimMode)
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Email>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<Resize>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q = kinds_queue(&fx).await;
    for n in 0..10 {
        let to = format!("user{}", n % 3);
        q.enqueue(Email { to, n }).await.expect("publish an email");
        q.enqueue(Resize { n, width: 100 + n })
            .await
            .expect("publish a resize");
    }
    let seen = Seen::default();
    let sub = q.work(options(), mail_and_resize(&seen)).await.unwrap();
    wait_for_runs(&seen, 20, "20 jobs of two kinds").await;
    wait_until("20 acks", Duration::from_secs(30), || {
        let acked = sub.metrics().acked;
        async move { acked >= 20 }
    })
    .await;
    let m = sub.metrics();
    sub.shutdown().await;
    let runs = runs_by_job(&seen);
    for n in 0..10 {
        for kind in [Email::KIND, Resize::KIND] {
            assert_eq!(
                runs.get(&(kind, n)),
                Some(&1),
                "{kind} {n} runs once: {runs:?}"
            );
        }
    }
    assert_eq!((m.claimed, m.acked), (20, 20), "{m:?}");
    assert_eq!(q.stats().await.unwrap().due.rows, 0);
    fx.cleanup().await;
}

/// Two brokers with workers for different kinds share one table: each runs only its own
/// kinds, and a row of a kind neither knows is never claimed (its attempt column and due time
/// stay as published, it never reaches a handler, and it is due in the stats), however long the
/// subscriptions run, until a subscription that knows the kind runs it once.
pub async fn a_row_of_an_unknown_kind_is_left_for_a_process_that_knows_it<D: TestDb>(
    mode: ClaimMode,
) where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Email>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<Resize>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<Report>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q = kinds_queue(&fx).await;
    // The unknown kind's row comes first in claim order, so every claim meets it.
    let stranger = q
        .enqueue(Report { n: 0, sleep_ms: 0 })
        .await
        .expect("publish a report")
        .id;
    let before = q
        .row_state(stranger)
        .await
        .unwrap()
        .expect("the report row");
    for n in 0..6 {
        q.enqueue(Email { to: "x".into(), n }).await.unwrap();
        q.enqueue(Resize { n, width: 100 + n }).await.unwrap();
    }
    // One broker knows mail, another resizing; neither knows reports.
    let other_broker = D::connect(&fx.url).await;
    let other = other_broker
        .queue::<KindRow>(fx.table.clone())
        .await
        .expect("the kinds queue on the other broker");
    let (mail, resize) = (Seen::default(), Seen::default());
    let (m, r) = (mail.clone(), resize.clone());
    let mail_sub = q
        .work(
            options(),
            Workers::new().register(move |job: Job<Email>| {
                m.lock().unwrap().push((Email::KIND, job.payload().n));
                async { Outcome::Ack }
            }),
        )
        .await
        .unwrap();
    let resize_sub = other
        .work(
            options(),
            Workers::new().register(move |job: Job<Resize>| {
                r.lock().unwrap().push((Resize::KIND, job.payload().n));
                async { Outcome::Ack }
            }),
        )
        .await
        .unwrap();
    wait_for_runs(&mail, 6, "the mail broker's 6 mails").await;
    wait_for_runs(&resize, 6, "the resize broker's 6 resizes").await;
    wait_until("12 acks", Duration::from_secs(30), || {
        let acked = mail_sub.metrics().acked + resize_sub.metrics().acked;
        async move { acked >= 12 }
    })
    .await;
    // Several polls of both subscriptions pass over the report row.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (mm, rm) = (mail_sub.metrics(), resize_sub.metrics());
    mail_sub.shutdown().await;
    resize_sub.shutdown().await;
    assert!(mail.lock().unwrap().iter().all(|(k, _)| *k == Email::KIND));
    assert!(
        resize
            .lock()
            .unwrap()
            .iter()
            .all(|(k, _)| *k == Resize::KIND)
    );
    assert_eq!(
        (mm.claimed, rm.claimed),
        (6, 6),
        "each subscription claims only its kind's rows: {mm:?} {rm:?}"
    );
    let after = q
        .row_state(stranger)
        .await
        .unwrap()
        .expect("the report row stays");
    assert_eq!(after, before, "the unknown kind's row is untouched");
    assert_eq!(
        q.stats().await.unwrap().due.rows,
        1,
        "the report waits, due"
    );

    // A subscription that knows reports runs it (it fails: two attempts, then dead).
    let reports = Seen::default();
    let seen = reports.clone();
    let sub = q
        .work(
            options(),
            Workers::new().register(move |job: Job<Report>| {
                seen.lock().unwrap().push((Report::KIND, job.payload().n));
                async { Err::<Outcome, _>("reports always fail") }
            }),
        )
        .await
        .unwrap();
    wait_until("the report dead-lettered", Duration::from_secs(30), || {
        let q = q.clone();
        async move {
            q.dead_letters(Page::first(10))
                .await
                .is_ok_and(|d| d.len() == 1)
        }
    })
    .await;
    sub.shutdown().await;
    assert_eq!(
        reports.lock().unwrap().len(),
        2,
        "the kind's max attempts: 2"
    );
    other_broker.close().await;
    fx.cleanup().await;
}

/// A kind's defaults apply to its jobs in place of the table's and the subscription's: the
/// report kind's max attempts (2, under the table's 5) dead-letters a failing job after two
/// deliveries, its timeout (300 ms) ends a worker that sleeps, with "timed out" as the last
/// error, and a job whose arguments ask for a longer timeout (`JobKind::timeout`) gets it.
/// Arguments that do not decode into the kind's type dead-letter the row at once, naming the
/// kind.
pub async fn a_kinds_max_attempts_and_timeout_apply_to_its_jobs<D: TestDb>(mode: ClaimMode)
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Report>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<Slow>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<serde_json::Value>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q = kinds_queue(&fx).await;
    let fails = q.enqueue(Report { n: 1, sleep_ms: 0 }).await.unwrap().id;
    let hangs = q
        .enqueue(Report {
            n: 2,
            sleep_ms: 60_000,
        })
        .await
        .unwrap()
        .id;
    // Not a report's arguments: "n" is text.
    let broken = q
        .publish(
            broker_core::NewJob::new(Json(serde_json::json!({"n": "seven"})))
                .column("kind", Report::KIND),
        )
        .await
        .unwrap();
    // Sleeps twice the kind's timeout, within its own.
    q.enqueue(Slow {
        n: 3,
        sleep_ms: 600,
        limit_ms: 60_000,
    })
    .await
    .unwrap();
    let runs = Seen::default();
    let (seen, slow) = (runs.clone(), runs.clone());
    let sub = q
        .work(
            options().cancel_grace(Duration::from_millis(100)),
            Workers::new()
                .register(move |job: Job<Report>| {
                    seen.lock().unwrap().push((Report::KIND, job.payload().n));
                    let sleep = Duration::from_millis(job.payload().sleep_ms);
                    async move {
                        tokio::time::sleep(sleep).await;
                        Err::<Outcome, _>("the report failed")
                    }
                })
                .register(move |job: Job<Slow>| {
                    let (slow, n) = (slow.clone(), job.payload().n);
                    let sleep = Duration::from_millis(job.payload().sleep_ms);
                    async move {
                        tokio::time::sleep(sleep).await;
                        slow.lock().unwrap().push((Slow::KIND, n));
                        Outcome::Ack
                    }
                }),
        )
        .await
        .unwrap();
    wait_until(
        "three dead letters and the slow job done",
        Duration::from_secs(30),
        || {
            let (q, runs) = (q.clone(), runs.clone());
            async move {
                runs.lock().unwrap().contains(&(Slow::KIND, 3))
                    && q.dead_letters(Page::first(10))
                        .await
                        .is_ok_and(|d| d.len() == 3)
            }
        },
    )
    .await;
    let m = sub.metrics();
    sub.shutdown().await;
    let runs = runs_by_job(&runs);
    assert_eq!(runs.get(&(Report::KIND, 1)), Some(&2), "{runs:?}");
    assert_eq!(runs.get(&(Report::KIND, 2)), Some(&2), "{runs:?}");
    assert_eq!(runs.get(&(Slow::KIND, 3)), Some(&1), "{runs:?}");
    assert_eq!(
        runs.len(),
        3,
        "the broken row never reaches the worker: {runs:?}"
    );
    assert_eq!(m.timed_out, 2, "the hanging report timed out twice: {m:?}");
    // Each report's first failure is a retry, its second the dead letter: the kind's max
    // attempts decides at the settlement, not a later claim.
    assert_eq!((m.retried, m.dead_lettered), (2, 3), "{m:?}");
    let dead = q.dead_letters(Page::first(10)).await.unwrap();
    let error = |id: i64| {
        dead.iter()
            .find(|j| j.id == id)
            .and_then(|j| j.last_error.clone())
            .unwrap_or_default()
    };
    assert!(error(fails).contains("the report failed"), "{dead:?}");
    assert!(error(hangs).contains("timed out after"), "{dead:?}");
    assert!(
        error(broken).contains("do not decode") && error(broken).contains(Report::KIND),
        "{dead:?}"
    );
    let broken_attempts = dead.iter().find(|j| j.id == broken).unwrap().attempt;
    let first = q.jobs(JobState::Due, Page::first(1)).await.unwrap();
    assert!(first.is_empty(), "nothing left due: {first:?}");
    // One delivery of the broken row: the column reads 1 (row lock counts at the put-back,
    // which a dead letter skips) or 2 (counted at the claim).
    assert!(
        broken_attempts <= 2,
        "dead-lettered at once: {broken_attempts}"
    );
    fx.cleanup().await;
}

/// A kind's group, priority and unique key come from its arguments and defaults: a second
/// publish of the same mail is a duplicate, each mail's group column names its recipient, and
/// mails (the kind's priority 5) run before resizes published earlier (priority 0).
pub async fn a_kinds_group_priority_and_unique_key_come_from_its_arguments<D: TestDb>(
    mode: ClaimMode,
) where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Email>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<Resize>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let fx = Fixture::<D>::build(mode, |name| {
        kinds_table(name, mode)
            .group("grp")
            .priority("priority")
            .unique_key("ukey")
    })
    .await;
    let q = kinds_queue(&fx).await;
    for n in 0..4 {
        q.enqueue(Resize { n, width: 100 + n }).await.unwrap();
    }
    let mut ids = Vec::new();
    for n in 0..6 {
        let to = format!("user{}", n % 2);
        let first = q.enqueue(Email { to: to.clone(), n }).await.unwrap();
        assert!(!first.duplicate);
        let again = q.enqueue(Email { to, n }).await.unwrap();
        assert!(again.duplicate, "the same mail again is a duplicate");
        assert_eq!(again.id, first.id);
        ids.push(first.id);
    }
    for (n, id) in ids.iter().enumerate() {
        let job = q.job(*id).await.unwrap().expect("the mail's row");
        assert_eq!(job.group, Some(format!("to-user{}", n % 2)), "{job:?}");
    }
    let seen = Seen::default();
    let sub = q
        .work(options().concurrency(1), mail_and_resize(&seen))
        .await
        .unwrap();
    wait_for_runs(&seen, 10, "6 mails and 4 resizes").await;
    sub.shutdown().await;
    let order: Vec<_> = seen.lock().unwrap().clone();
    let kinds: Vec<_> = order.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        kinds[..6],
        [Email::KIND; 6],
        "mails first (priority 5 over 0): {order:?}"
    );
    assert_eq!(order.len(), 10, "each once: {order:?}");
    fx.cleanup().await;
}

/// What a kinds table or registry cannot run with is refused with what to change: workers on
/// a table without a kind column, no worker, a kind twice, a kind's max attempts without a
/// dead-letter target, and a kinds table whose payload is not JSON.
pub async fn what_kinds_cannot_run_with_is_refused_with_what_to_change<D: TestDb>()
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Report>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let mode = ClaimMode::Lease;
    let fx = Fixture::<D>::build(mode, |name| {
        TableDescription::builder(name)
            .kind("kind")
            .payload("args", ColumnType::Json)
            .locked_until("locked_until")
    })
    .await;
    let q = kinds_queue(&fx).await;
    let refusal = |e: broker_core::SqlxBrokerError| e.to_string();
    let e = refusal(q.work(options(), Workers::new()).await.unwrap_err());
    assert!(e.contains("register at least one worker"), "{e}");
    let report = |_: Job<Report>| async { Outcome::Ack };
    let e = refusal(
        q.work(options(), Workers::new().register(report))
            .await
            .unwrap_err(),
    );
    assert!(e.contains("no dead-letter target"), "{e}");
    let e = refusal(
        TableDescription::builder("t")
            .kind("kind")
            .payload("args", ColumnType::Text)
            .build()
            .unwrap_err(),
    );
    assert!(e.contains("ColumnType::Json"), "{e}");
    let e = refusal(
        TableDescription::builder("t")
            .kind("kind")
            .build()
            .unwrap_err(),
    );
    assert!(e.contains("no payload column"), "{e}");
    let plain = fx
        .broker
        .queue::<KindRow>(
            TableDescription::builder(fx.table.name())
                .payload("args", ColumnType::Json)
                .locked_until("locked_until")
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    let e = refusal(
        plain
            .enqueue(Report { n: 1, sleep_ms: 0 })
            .await
            .unwrap_err(),
    );
    assert!(e.contains("no kind column"), "{e}");
    let e = refusal(
        plain
            .work(options(), Workers::new().register(report))
            .await
            .unwrap_err(),
    );
    assert!(
        e.contains("no kind column") || e.contains("dead-letter"),
        "{e}"
    );
    assert!(
        q.stats().await.unwrap().due.rows == 0,
        "nothing was published by a refusal"
    );
    fx.cleanup().await;
}

/// A job whose deliveries crashed past its kind's max attempts (leases that ran out: two
/// claims whose holders vanished) is dead-lettered at its next delivery without running, as
/// the table's max attempts would be (here 5, above the kind's 2).
pub async fn a_job_whose_kind_attempts_crashes_spent_is_dead_lettered_unrun<D: TestDb>()
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Report>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let mode = ClaimMode::Lease;
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode).lease_seconds(1)).await;
    let q = kinds_queue(&fx).await;
    let id = q.enqueue(Report { n: 1, sleep_ms: 0 }).await.unwrap().id;
    for crash in 1..=2 {
        let d = crate::claim_within(&q, Duration::from_secs(10), "the report's lease again").await;
        assert_eq!((d.id(), d.attempt()), (id, crash));
        // The holder vanishes: nothing settles or releases the row; its lease runs out.
        std::mem::forget(d);
    }
    wait_until(
        "the second lease to run out",
        Duration::from_secs(10),
        || {
            let q = q.clone();
            async move {
                q.row_state(id).await.ok().flatten().is_some_and(|r| {
                    r.locked_until_ms
                        .is_none_or(|until| until <= broker_core::driver::clock::now_ms())
                })
            }
        },
    )
    .await;
    let runs = Seen::default();
    let seen = runs.clone();
    let sub = q
        .work(
            options(),
            Workers::new().register(move |job: Job<Report>| {
                seen.lock().unwrap().push((Report::KIND, job.payload().n));
                async { Outcome::Ack }
            }),
        )
        .await
        .unwrap();
    wait_until("the report dead-lettered", Duration::from_secs(30), || {
        let q = q.clone();
        async move {
            q.dead_letters(Page::first(10))
                .await
                .is_ok_and(|d| d.len() == 1)
        }
    })
    .await;
    let m = sub.metrics();
    sub.shutdown().await;
    assert!(runs.lock().unwrap().is_empty(), "the worker never ran it");
    assert_eq!((m.claimed, m.dead_lettered, m.acked), (1, 1, 0), "{m:?}");
    fx.cleanup().await;
}

/// A layer that records each job's kind and what came of it.
#[derive(Clone)]
struct KindLog(Arc<Mutex<Vec<(String, String)>>>);

impl<S> broker_core::api::Layer<S> for KindLog {
    type Service = KindLogged<S>;
    fn layer(&self, inner: S) -> KindLogged<S> {
        KindLogged {
            inner,
            log: self.0.clone(),
        }
    }
}

#[derive(Clone)]
struct KindLogged<S> {
    inner: S,
    log: Arc<Mutex<Vec<(String, String)>>>,
}

impl<S> broker_core::api::Service<Job<KindRow>> for KindLogged<S>
where
    S: broker_core::api::Service<Job<KindRow>, Response = Outcome, Error = broker_core::BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = broker_core::BoxError;
    type Future = broker_core::BoxFuture<'static, Result<Outcome, broker_core::BoxError>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, job: Job<KindRow>) -> Self::Future {
        let kind = job.payload().kind().to_owned();
        let end = self.inner.call(job);
        let log = self.log.clone();
        Box::pin(async move {
            let result = end.await;
            let what = match &result {
                Ok(outcome) => format!("{outcome:?}"),
                Err(e) => format!("error: {e}"),
            };
            log.lock().unwrap().push((kind, what));
            result
        })
    }
}

/// A layer around a kinds subscription's workers (`work_layered`) sees every job with its
/// kind, and the worker's outcome or error after it; the subscription settles what the layer
/// returns.
pub async fn a_layer_around_the_workers_sees_each_jobs_kind_and_outcome<D: TestDb>()
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Email>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<Report>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let mode = ClaimMode::Lease;
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q = kinds_queue(&fx).await;
    q.enqueue(Email {
        to: "a".into(),
        n: 1,
    })
    .await
    .unwrap();
    q.enqueue(Report { n: 2, sleep_ms: 0 }).await.unwrap();
    let log = KindLog(Arc::default());
    let sub = q
        .work_layered(
            options(),
            log.clone(),
            Workers::new()
                .register(|_: Job<Email>| async { Outcome::Ack })
                .register(|_: Job<Report>| async { Err::<Outcome, _>("report down") }),
        )
        .await
        .unwrap();
    wait_until("the report's two attempts", Duration::from_secs(30), || {
        let m = sub.metrics();
        async move { m.acked == 1 && m.dead_lettered == 1 }
    })
    .await;
    sub.shutdown().await;
    let mut seen = log.0.lock().unwrap().clone();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("email".to_owned(), "Ack".to_owned()),
            ("report:v2".to_owned(), "error: report down".to_owned()),
            ("report:v2".to_owned(), "error: report down".to_owned()),
        ],
    );
    fx.cleanup().await;
}

/// Kind names are compared as written: a row of kind "Email" is not claimed by a worker of
/// "email" (MySQL and MariaDB compare text columns without case by default; the claim compares
/// bytes), and stays due.
pub async fn a_kind_is_its_exact_name_whatever_the_columns_collation<D: TestDb>()
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Email>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let mode = ClaimMode::Lease;
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q = kinds_queue(&fx).await;
    let upper = q
        .publish(
            broker_core::NewJob::new(Json(Email {
                to: "a".into(),
                n: 1,
            }))
            .column("kind", "Email"),
        )
        .await
        .unwrap();
    let lower = q
        .enqueue(Email {
            to: "b".into(),
            n: 2,
        })
        .await
        .unwrap()
        .id;
    let seen = Seen::default();
    let s = seen.clone();
    let sub = q
        .work(
            options(),
            Workers::new().register(move |job: Job<Email>| {
                s.lock().unwrap().push((Email::KIND, job.payload().n));
                async { Outcome::Ack }
            }),
        )
        .await
        .unwrap();
    wait_for_runs(&seen, 1, "the lower-case row").await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let m = sub.metrics();
    sub.shutdown().await;
    assert_eq!(*seen.lock().unwrap(), [(Email::KIND, 2)]);
    assert_eq!(m.claimed, 1, "{m:?}");
    assert!(q.row_state(lower).await.unwrap().is_none());
    assert_eq!(q.row_state(upper).await.unwrap().unwrap().attempt, 1);
    fx.cleanup().await;
}

/// A step of an order: grouped by its order, as the mails of [`Email`] are by recipient, so
/// the two kinds share groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The order (the group is `to-{order}`, an [`Email`]'s group of the same name).
    pub order: String,
    /// The job's number in the case.
    pub n: i64,
}

impl JobKind for Step {
    const KIND: &'static str = "order.step";
    fn group(&self) -> Option<String> {
        Some(format!("to-{}", self.order))
    }
}

/// On a FIFO kinds table a group is one order across kinds: mails and order steps published
/// interleaved into three shared groups run one at a time per group, in publish order, by
/// four workers of one subscription.
pub async fn a_fifo_group_is_one_order_across_kinds<D: TestDb>(mode: ClaimMode)
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Email>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
    for<'q> Json<Step>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let fx =
        Fixture::<D>::build(mode, |name| kinds_table(name, mode).group("grp").fifo(true)).await;
    let q = kinds_queue(&fx).await;
    let mut published: HashMap<String, Vec<i64>> = HashMap::new();
    for n in 0..18 {
        let g = format!("g{}", n % 3);
        if n % 2 == 0 {
            q.enqueue(Email { to: g.clone(), n }).await.unwrap();
        } else {
            q.enqueue(Step {
                order: g.clone(),
                n,
            })
            .await
            .unwrap();
        }
        published.entry(g).or_default().push(n);
    }
    // Per group: the numbers in start order, and how many ran at once at most.
    type Runs = Arc<
        Mutex<(
            HashMap<String, Vec<i64>>,
            HashMap<String, usize>,
            Vec<String>,
        )>,
    >;
    let runs: Runs = Arc::default();
    async fn run(runs: Runs, group: String, n: i64) -> Outcome {
        {
            let mut r = runs.lock().unwrap();
            r.0.entry(group.clone()).or_default().push(n);
            let now = r.1.entry(group.clone()).or_default();
            *now += 1;
            if *now > 1 {
                r.2.push(format!("group {group}: {n} started while another ran"));
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        *runs.lock().unwrap().1.get_mut(&group).unwrap() -= 1;
        Outcome::Ack
    }
    let (a, b) = (runs.clone(), runs.clone());
    let sub = q
        .work(
            options(),
            Workers::new()
                .register(move |job: Job<Email>| {
                    run(a.clone(), job.payload().to.clone(), job.payload().n)
                })
                .register(move |job: Job<Step>| {
                    run(b.clone(), job.payload().order.clone(), job.payload().n)
                }),
        )
        .await
        .unwrap();
    wait_until("18 acks", Duration::from_secs(30), || {
        let acked = sub.metrics().acked;
        async move { acked >= 18 }
    })
    .await;
    sub.shutdown().await;
    let (order, overlaps) = {
        let r = runs.lock().unwrap();
        (r.0.clone(), r.2.clone())
    };
    assert!(overlaps.is_empty(), "{overlaps:?}");
    assert_eq!(
        order, published,
        "each group in publish order, across kinds"
    );
    fx.cleanup().await;
}

/// A periodic schedule publishes jobs of a kind: its closure returns `new_kind_job`, and the
/// kind's worker runs each tick's row.
pub async fn a_schedule_publishes_a_kind_that_its_worker_runs<D: TestDb>()
where
    KindRow: for<'r> FromRow<'r, <DbOf<D> as Database>::Row>,
    for<'q> Json<Email>: Encode<'q, DbOf<D>> + Type<DbOf<D>>,
{
    let mode = ClaimMode::Lease;
    let fx = Fixture::<D>::build(mode, |name| kinds_table(name, mode)).await;
    let q = kinds_queue(&fx).await;
    let publisher = q.clone();
    let ticks = q
        .schedule(
            broker_core::Schedule::new(unique_name("kinds"), "* * * * * *").unwrap(),
            move |_| {
                publisher
                    .new_kind_job(Email {
                        to: "tick".into(),
                        n: 7,
                    })
                    .expect("a kinds table takes the job")
            },
        )
        .await
        .expect("start the schedule");
    let seen = Seen::default();
    let s = seen.clone();
    let sub = q
        .work(
            options(),
            Workers::new().register(move |job: Job<Email>| {
                s.lock().unwrap().push((Email::KIND, job.payload().n));
                async { Outcome::Ack }
            }),
        )
        .await
        .unwrap();
    wait_for_runs(&seen, 2, "two ticks' mails").await;
    ticks.stop().await;
    sub.shutdown().await;
    assert!(
        seen.lock().unwrap().iter().all(|r| *r == (Email::KIND, 7)),
        "{:?}",
        seen.lock().unwrap()
    );
    fx.cleanup().await;
}

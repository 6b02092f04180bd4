//! Many job kinds in one table: a kind is a serde type with a name ([`JobKind`]), its rows keep
//! the name in the table's [kind column](crate::TableBuilder::kind) and the value as JSON in
//! its payload column, and one subscription runs every kind a [`Workers`] registry knows,
//! each with its own worker, a plain `async fn` of a [`Job`] of that type.
//!
//! A subscription claims only rows of the kinds it knows: the kinds are written into its claim
//! statements, so a row of a kind no worker of this process knows is never claimed here (never
//! run, never counted against its attempts) and waits for a process that knows it. See
//! docs/job-kinds.md.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Database, Decode, FromRow, Row, Type};

use crate::broker::{Broker, Queue};
use crate::delivery::Job;
use crate::driver::{Backend, alias};
use crate::error::{Result, SqlxBrokerError};
use crate::publish::{NewJob, Published};
use crate::subscription::{
    BoxFuture, HandlerResult, IntoOutcome, Limits, SubscribeOptions, Subscription, Unrecoverable,
};
use crate::table::check_kind_name;

/// A kind of job: a type whose values are the jobs' arguments (kept as JSON), with the name its
/// rows carry and its defaults.
///
/// ```
/// use std::time::Duration;
/// use broker_core::{JobKind, KindDefaults};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct SendEmail {
///     to: String,
///     user: i64,
/// }
///
/// impl JobKind for SendEmail {
///     const KIND: &'static str = "send_email";
///     fn defaults() -> KindDefaults {
///         KindDefaults::new().max_attempts(5).timeout(Duration::from_secs(30))
///     }
///     // One user's mails run in publish order (the table needs a FIFO group column).
///     fn group(&self) -> Option<String> {
///         Some(format!("user-{}", self.user))
///     }
/// }
/// ```
pub trait JobKind: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The name every row of this kind carries in the kind column: 1 to
    /// [`MAX_KIND_CHARS`](crate::MAX_KIND_CHARS) ASCII letters, digits and `_ - . : /`
    /// ([`check_kind_name`]). Renaming a kind strands its queued rows: keep the old name
    /// registered until they are done.
    const KIND: &'static str;

    /// The kind's defaults: max attempts, priority, timeout. None set: the table's max attempts,
    /// no priority, the subscription's timeout.
    fn defaults() -> KindDefaults {
        KindDefaults::new()
    }

    /// The FIFO group of this job (the table needs a group column), from its arguments: jobs
    /// of one group run one at a time in publish order on a FIFO table. `None`: no group.
    fn group(&self) -> Option<String> {
        None
    }

    /// The unique key of this job (the table needs a unique key column), from its arguments:
    /// while an unfinished row has the key, publishing it again inserts nothing (see
    /// [`NewJob::unique_key`]). `None`: no key. Keys are shared by every kind of the table, so
    /// put the kind in it where two kinds could make the same one.
    fn unique_key(&self) -> Option<String> {
        None
    }

    /// The timeout of this job, from its arguments: the kind's default unless overridden, so a
    /// large export can be given longer than a small one. `None`: the subscription's
    /// [`timeout`](SubscribeOptions::timeout).
    fn timeout(&self) -> Option<Duration> {
        Self::defaults().timeout
    }
}

/// A job kind's defaults (see [`JobKind::defaults`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KindDefaults {
    /// Deliveries after which a failing job of this kind is dead-lettered, in place of the
    /// table's [`max_attempts`](crate::TableBuilder::max_attempts) (the table needs a
    /// dead-letter target).
    pub max_attempts: Option<u32>,
    /// The priority its jobs are published with (the table needs a priority column); a job
    /// published by hand may set its own.
    pub priority: Option<i64>,
    /// The handler's timeout, in place of the subscription's.
    pub timeout: Option<Duration>,
}

impl KindDefaults {
    /// No defaults: the table's and the subscription's settings.
    pub const fn new() -> Self {
        Self {
            max_attempts: None,
            priority: None,
            timeout: None,
        }
    }
    /// Deliveries after which a failing job of this kind is dead-lettered.
    pub const fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// The priority its jobs are published with.
    pub const fn priority(mut self, priority: i64) -> Self {
        self.priority = Some(priority);
        self
    }
    /// The handler's timeout.
    pub const fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// A row of a kinds table as a subscription claims it: its kind's name and its arguments as
/// JSON text. Use it as the queue's row type (`broker.queue::<KindRow>(table)`), then publish
/// with [`Queue::enqueue`] and run the kinds with [`Queue::work`].
pub struct KindRow {
    kind: String,
    args: Option<Box<RawValue>>,
    /// The arguments decoded into the kind's type, by the limits read before the handler runs
    /// (so a job is decoded once), or why they did not decode.
    decoded: Option<std::result::Result<Box<dyn Any + Send>, String>>,
}

impl std::fmt::Debug for KindRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KindRow")
            .field("kind", &self.kind)
            .field("args", &self.args())
            .finish_non_exhaustive()
    }
}

impl KindRow {
    /// The kind's name.
    pub fn kind(&self) -> &str {
        &self.kind
    }
    /// The arguments as JSON text (`null` for a NULL payload).
    pub fn args(&self) -> &str {
        self.args.as_deref().map_or("null", RawValue::get)
    }
    /// The arguments decoded as `A`.
    ///
    /// # Errors
    /// serde's error when the JSON does not decode as `A`.
    pub fn args_as<A: DeserializeOwned>(&self) -> std::result::Result<A, serde_json::Error> {
        serde_json::from_str(self.args())
    }
}

impl<'r, R> FromRow<'r, R> for KindRow
where
    R: Row,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Json<Box<RawValue>>: Decode<'r, R::Database> + Type<R::Database>,
    &'static str: ColumnIndex<R>,
{
    fn from_row(row: &'r R) -> std::result::Result<Self, sqlx::Error> {
        let kind: String = row.try_get(alias::KIND)?;
        let args: Option<Json<Box<RawValue>>> = row.try_get(alias::PAYLOAD)?;
        Ok(Self {
            kind,
            args: args.map(|a| a.0),
            decoded: None,
        })
    }
}

type Run = dyn Fn(Job<KindRow>) -> BoxFuture<'static, HandlerResult> + Send + Sync;

struct Entry {
    run: Arc<Run>,
    limits: fn(&mut KindRow) -> Limits,
    defaults: KindDefaults,
}

/// The workers of one subscription of a kinds table: for each registered kind, a worker, a
/// plain `async fn` of a [`Job`] of the kind's type returning an [`Outcome`](crate::Outcome)
/// or a `Result` of one (as a [`subscribe`](Queue::subscribe) handler does).
///
/// ```
/// use broker_core::{Job, JobKind, Outcome, Workers};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Resize { image: i64, width: u32 }
/// impl JobKind for Resize {
///     const KIND: &'static str = "resize";
/// }
///
/// async fn resize(job: Job<Resize>) -> Result<Outcome, std::io::Error> {
///     println!("image {} to {} px", job.payload().image, job.payload().width);
///     Ok(Outcome::Ack)
/// }
///
/// let workers = Workers::new().register(resize);
/// assert_eq!(workers.kinds(), ["resize"]);
/// ```
#[derive(Default)]
#[must_use]
pub struct Workers {
    entries: HashMap<&'static str, Entry>,
    order: Vec<&'static str>,
    twice: Vec<&'static str>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("kinds", &self.order)
            .finish_non_exhaustive()
    }
}

impl Workers {
    /// No workers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the worker of kind `K`. A kind registered twice is refused by
    /// [`Queue::work`].
    pub fn register<K, F, Fut>(mut self, worker: F) -> Self
    where
        K: JobKind,
        F: Fn(Job<K>) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoOutcome,
    {
        if self.entries.contains_key(K::KIND) {
            self.twice.push(K::KIND);
            return self;
        }
        let worker = Arc::new(worker);
        let run: Arc<Run> = Arc::new(move |mut job: Job<KindRow>| {
            let worker = worker.clone();
            Box::pin(async move {
                let row = job.payload_mut();
                let decoded = match row.decoded.take() {
                    Some(Ok(any)) => any
                        .downcast::<K>()
                        .map(|k| *k)
                        .map_err(|_| "the row's decoded arguments are of another kind".to_owned()),
                    Some(Err(e)) => Err(e),
                    None => row.args_as::<K>().map_err(|e| e.to_string()),
                };
                match decoded {
                    Ok(args) => worker(job.map_payload(|_| args)).await.into_outcome(),
                    Err(e) => Err(Unrecoverable::new(format!(
                        "the arguments of kind \"{}\" do not decode into {}: {e}",
                        K::KIND,
                        std::any::type_name::<K>()
                    ))
                    .into()),
                }
            })
        });
        self.entries.insert(
            K::KIND,
            Entry {
                run,
                limits: limits_of::<K>,
                defaults: K::defaults(),
            },
        );
        self.order.push(K::KIND);
        self
    }

    /// The registered kinds, in the order they were registered.
    pub fn kinds(&self) -> Vec<&'static str> {
        self.order.clone()
    }

    /// Refuses what the subscription could not run: no kind, a kind twice, a bad name, a
    /// kind's max attempts on a table without a dead-letter target.
    fn check(&self, table: &crate::TableDescription) -> Result<()> {
        let bad = |message: String| Err(SqlxBrokerError::description(table.name(), message));
        if let Some(kind) = self.twice.first() {
            return bad(format!(
                "kind \"{kind}\" is registered twice; register one worker per kind"
            ));
        }
        for kind in &self.order {
            if let Err(why) = check_kind_name(kind) {
                return bad(why);
            }
            let defaults = &self.entries[kind].defaults;
            if let (Some(n), None) = (defaults.max_attempts, table.dead_letter()) {
                return bad(format!(
                    "kind \"{kind}\" sets max_attempts ({n}) but the table has no dead-letter target, so an exhausted job would have nowhere to go; add .dead_letter(..) to the table"
                ));
            }
        }
        Ok(())
    }
}

/// The limits of a job of kind `K`: its arguments decoded once (kept in the row for the
/// worker), its timeout from them, the kind's max attempts.
fn limits_of<K: JobKind>(row: &mut KindRow) -> Limits {
    let defaults = K::defaults();
    let (timeout, decoded) = match row.args_as::<K>() {
        Ok(args) => (args.timeout(), Ok(Box::new(args) as Box<dyn Any + Send>)),
        Err(e) => (defaults.timeout, Err(e.to_string())),
    };
    row.decoded = Some(decoded);
    Limits {
        timeout,
        max_attempts: defaults.max_attempts,
    }
}

/// Publishing jobs of kinds and running them: a queue over a table with a
/// [kind column](crate::TableBuilder::kind).
impl<B: Backend> Queue<B, KindRow>
where
    KindRow: for<'r> FromRow<'r, <B::Db as Database>::Row>,
{
    /// The row for a job of kind `K`: its arguments as JSON, the kind's name in the kind
    /// column, and the kind's priority, group and unique key where the table has the column.
    /// Add a due time or other columns to it, then publish it with any of the queue's publish
    /// methods ([`publish_in`](Queue::publish_in) puts it in the caller's transaction).
    ///
    /// # Errors
    /// [`SqlxBrokerError::Description`] for a table without a kind column, or a kind name
    /// [`check_kind_name`] refuses.
    pub fn new_kind_job<K: JobKind>(&self, args: K) -> Result<NewJob<Json<K>>> {
        let table = &self.inner.shared.table;
        let Some(column) = table.kind() else {
            return Err(SqlxBrokerError::description(
                table.name(),
                format!(
                    "has no kind column, so it cannot hold jobs of kind \"{}\"; add .kind(\"kind\") and a JSON payload column",
                    K::KIND
                ),
            ));
        };
        check_kind_name(K::KIND).map_err(|why| SqlxBrokerError::description(table.name(), why))?;
        let group = table.group().and(args.group());
        let unique_key = table.unique_key().and(args.unique_key());
        let mut job = NewJob::new(Json(args)).column(column, K::KIND);
        if let (Some(_), Some(p)) = (table.priority(), K::defaults().priority) {
            job = job.priority(p);
        }
        if let Some(g) = group {
            job = job.group(g);
        }
        if let Some(k) = unique_key {
            job = job.unique_key(k);
        }
        Ok(job)
    }

    /// Publishes one job of kind `K` (see [`new_kind_job`](Self::new_kind_job)); a duplicate of an unfinished
    /// row with the kind's unique key inserts nothing and returns that row's id.
    ///
    /// # Errors
    /// As [`new_kind_job`](Self::new_kind_job) and [`publish_unique`](Queue::publish_unique).
    pub async fn enqueue<K: JobKind>(&self, args: K) -> Result<Published>
    where
        Json<K>: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    {
        let job = self.new_kind_job(args)?;
        self.publish_unique(job).await
    }

    /// Runs every kind `workers` knows, with `options.concurrency` jobs in work at once: one
    /// subscription whose claims take only rows of those kinds. Each job's worker gets a
    /// [`Job`] of its kind's type; arguments that do not decode into it dead-letter the row at
    /// once with the error ([`Unrecoverable`]). A kind's [defaults](KindDefaults) set the
    /// timeout and max attempts of its jobs in place of the subscription's and the table's.
    ///
    /// # Errors
    /// [`SqlxBrokerError::Description`] for a table without a kind column, no kind registered
    /// or one twice, a bad kind name, or a kind's max attempts without a dead-letter target;
    /// what [`Broker::queue`] and [`subscribe`](Queue::subscribe) refuse.
    pub async fn work(&self, options: SubscribeOptions, workers: Workers) -> Result<Subscription> {
        self.work_layered(options, tower_layer::Identity::new(), workers)
            .await
    }

    /// [`work`](Self::work) with every job going through `layer` on its way to its kind's
    /// worker: the layer wraps a [`KindsService`], a tower service of `Job<KindRow>` (so it can
    /// read each job's [kind](KindRow::kind)) whose response is the worker's outcome, and what
    /// the layer returns settles the row, as with
    /// [`subscribe_layered`](Queue::subscribe_layered).
    ///
    /// # Errors
    /// As [`work`](Self::work).
    pub async fn work_layered<L>(
        &self,
        options: SubscribeOptions,
        layer: L,
        workers: Workers,
    ) -> Result<Subscription>
    where
        L: tower_layer::Layer<KindsService>,
        L::Service: tower_service::Service<Job<KindRow>, Response = crate::Outcome>
            + Clone
            + Send
            + 'static,
        <L::Service as tower_service::Service<Job<KindRow>>>::Error: Into<crate::BoxError>,
        <L::Service as tower_service::Service<Job<KindRow>>>::Future: Send + 'static,
    {
        let table = &self.inner.shared.table;
        workers.check(table)?;
        let served = table.serving_kinds(&workers.kinds())?;
        let broker = Broker {
            inner: self.inner.shared.broker.clone(),
        };
        let queue = broker.queue::<KindRow>(served).await?;
        let entries = Arc::new(workers.entries);
        let limits = entries.clone();
        let handler = crate::subscription::Handler::service(layer.layer(KindsService { entries }))
            .with_limits(move |row: &mut KindRow| {
                limits
                    .get(row.kind())
                    .map(|e| (e.limits)(row))
                    .unwrap_or_default()
            });
        crate::subscription::start(queue.inner.clone(), options, handler)
    }
}

/// The tower service of a kinds subscription: it hands each job to its kind's worker (see
/// [`Queue::work_layered`], whose layer wraps it). Always ready.
#[derive(Clone)]
pub struct KindsService {
    entries: Arc<HashMap<&'static str, Entry>>,
}

impl std::fmt::Debug for KindsService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut kinds: Vec<_> = self.entries.keys().collect();
        kinds.sort_unstable();
        f.debug_struct("KindsService")
            .field("kinds", &kinds)
            .finish()
    }
}

impl tower_service::Service<Job<KindRow>> for KindsService {
    type Response = crate::Outcome;
    type Error = crate::BoxError;
    type Future = BoxFuture<'static, HandlerResult>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::result::Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, job: Job<KindRow>) -> Self::Future {
        match self.entries.get(job.payload().kind()) {
            Some(entry) => (entry.run)(job),
            // The claim takes only registered kinds; a row of another kind here means the
            // statements lost their kind condition: fail the attempt rather than guess.
            None => {
                let kind = job.payload().kind().to_owned();
                Box::pin(async move {
                    Err(format!("no worker for kind \"{kind}\" in this subscription").into())
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct A {
        n: i64,
    }
    impl JobKind for A {
        const KIND: &'static str = "a";
        fn defaults() -> KindDefaults {
            KindDefaults::new()
                .max_attempts(2)
                .timeout(Duration::from_secs(3))
        }
        fn timeout(&self) -> Option<Duration> {
            (self.n > 10).then(|| Duration::from_secs(60))
        }
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Bad;
    impl JobKind for Bad {
        const KIND: &'static str = "it's";
    }

    async fn a(_: Job<A>) -> crate::Outcome {
        crate::Outcome::Ack
    }

    fn row(kind: &str, args: &str) -> KindRow {
        KindRow {
            kind: kind.into(),
            args: Some(RawValue::from_string(args.into()).unwrap()),
            decoded: None,
        }
    }

    #[test]
    fn limits_come_from_the_kind_and_the_arguments() {
        let mut small = row("a", r#"{"n": 1}"#);
        let limits = limits_of::<A>(&mut small);
        assert_eq!(limits.max_attempts, Some(2));
        assert_eq!(
            limits.timeout, None,
            "the kind's timeout fn decides per job"
        );
        assert!(matches!(small.decoded, Some(Ok(_))));
        let mut big = row("a", r#"{"n": 11}"#);
        assert_eq!(
            limits_of::<A>(&mut big).timeout,
            Some(Duration::from_secs(60))
        );
        let mut broken = row("a", r#"{"m": 1}"#);
        let limits = limits_of::<A>(&mut broken);
        assert_eq!(limits.timeout, Some(Duration::from_secs(3)));
        assert!(matches!(&broken.decoded, Some(Err(e)) if e.contains("missing field")));
    }

    #[test]
    fn workers_refuse_twice_registered_and_badly_named_kinds() {
        let table = crate::TableDescription::builder("jobs")
            .kind("kind")
            .payload("args", crate::ColumnType::Json)
            .locked_until("lu")
            .build()
            .unwrap();
        let e = Workers::new()
            .register(a)
            .register(a)
            .check(&table)
            .unwrap_err();
        assert!(e.to_string().contains("registered twice"), "{e}");
        let e = Workers::new().register(a).check(&table).unwrap_err();
        assert!(e.to_string().contains("no dead-letter target"), "{e}");
        let e = Workers::new()
            .register(|_: Job<Bad>| async { crate::Outcome::Ack })
            .check(&table)
            .unwrap_err();
        assert!(e.to_string().contains("use ASCII letters"), "{e}");
    }

    #[test]
    fn the_kind_condition_lists_the_served_kinds_once() {
        let table = crate::TableDescription::builder("jobs")
            .kind("kind")
            .payload("args", crate::ColumnType::Json)
            .locked_until("lu")
            .build()
            .unwrap();
        assert_eq!(table.kind_condition("k"), None);
        let served = table.serving_kinds(&["a", "b", "a"]).unwrap();
        assert_eq!(served.kind_condition("k").unwrap(), "k IN ('a', 'b')");
        assert!(table.serving_kinds(&[]).is_err());
        assert!(table.serving_kinds(&["x'y"]).is_err());
        let plain = crate::TableDescription::builder("jobs")
            .locked_until("lu")
            .build()
            .unwrap();
        assert!(
            plain
                .serving_kinds(&["a"])
                .unwrap_err()
                .to_string()
                .contains("no kind column")
        );
    }
}

//! Bad input and faults: settlements that always fail, batch publishes that fail part way,
//! takes whose read fails, option values the engine cannot run with, names a database would cut
//! short, rows deleted under a delivery, NULL payloads, claims that keep failing, and more
//! workers than the pool serves. Each ends somewhere clear: an error that says what to change,
//! a dead letter with the reason, or a backoff; never a hot loop or a lost row.
//!
//! The faults are injected with a little SQL of each database (a CHECK constraint or trigger,
//! a renamed column, a deleted row): that is the one place the suite speaks a dialect itself,
//! chosen from the backend's [`Capabilities::database`](broker_core::Capabilities).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use broker_core::{
    Backend, Broker, ClaimMode, DeadLetter, Outcome, Payload, SqlxBrokerError, SubscribeOptions,
    TableDescription,
};
use sqlx::{Database, Executor};

use super::claim_one;
use crate::{DbOf, Fixture, TestDb, unique_name, wait_until};

/// Far enough that the test's CHECK (due before 2100) refuses it on every database.
const TWO_CENTURIES: Duration = Duration::from_secs(200 * 365 * 24 * 3600);

/// 2100-01-01 00:00:00 UTC in unix milliseconds (SQLite stores times as integers).
const YEAR_2100_MS: i64 = 4_102_444_800_000;

/// The SQL dialect of the backend under test, for injecting faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

fn dialect<D: TestDb>(broker: &Broker<D::B>) -> Dialect {
    match broker.backend().capabilities().database {
        "PostgreSQL" => Dialect::Postgres,
        "SQLite" => Dialect::Sqlite,
        _ => Dialect::MySql,
    }
}

/// Runs `sql` on a connection of `broker`'s pool; panics naming it when it fails.
async fn exec<D: TestDb>(broker: &Broker<D::B>, sql: String)
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let mut conn = broker.pool().acquire().await.expect("a test connection");
    if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
        .execute(&mut *conn)
        .await
    {
        panic!("test SQL {sql:?} failed: {e}");
    }
}

/// Makes `table` refuse every `event` (INSERT or UPDATE) whose new row fails `check`: a CHECK
/// constraint on PostgreSQL and MySQL, a trigger on SQLite (which cannot add a constraint to a
/// table). `check` is given per dialect: PostgreSQL, MySQL, SQLite (on `NEW`'s columns there).
async fn refuse<D: TestDb>(broker: &Broker<D::B>, table: &str, event: &str, check: [&str; 3])
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let [pg, my, lite] = check;
    let sql = match dialect::<D>(broker) {
        Dialect::Postgres => {
            format!("ALTER TABLE \"{table}\" ADD CONSTRAINT \"{table}_refuse\" CHECK ({pg})")
        }
        Dialect::MySql => {
            format!("ALTER TABLE `{table}` ADD CONSTRAINT `{table}_refuse` CHECK ({my})")
        }
        Dialect::Sqlite => format!(
            "CREATE TRIGGER \"{table}_refuse\" BEFORE {event} ON \"{table}\" WHEN NOT ({lite}) \
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
        ),
    };
    exec::<D>(broker, sql).await;
}

/// Makes every UPDATE that sets `due_at` past 2100 fail on `table`: a retry after
/// [`TWO_CENTURIES`] then fails every time, while claims, releases and dead letters work.
async fn refuse_far_retries<D: TestDb>(broker: &Broker<D::B>, table: &str)
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let lite = format!("NEW.due_at IS NULL OR NEW.due_at < {YEAR_2100_MS}");
    let check = [
        "due_at < TIMESTAMPTZ '2100-01-01 00:00:00+00'",
        "due_at < '2100-01-01 00:00:00'",
        lite.as_str(),
    ];
    refuse::<D>(broker, table, "UPDATE", check).await;
}

/// Makes every INSERT of the payload `'poison'` fail on `table`.
async fn refuse_poison<D: TestDb>(broker: &Broker<D::B>, table: &str)
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let check = [
        "payload <> 'poison'",
        "payload <> 'poison'",
        "NEW.payload IS NOT 'poison'",
    ];
    refuse::<D>(broker, table, "INSERT", check).await;
}

/// Publishes `n` jobs as [`Fixture::publish`] does, but in advisory mode with keys of this
/// table's own: advisory keys belong to the database, and cases here hold theirs for a while
/// (backoffs, hundreds of rows), which must not hold up other cases' `k0`, `k1`, ...
async fn publish_own_keys<D: TestDb>(
    fx: &Fixture<D>,
    q: &broker_core::Queue<D::B, D::Job>,
    n: usize,
) -> Vec<i64> {
    let jobs: Vec<_> = (0..n)
        .map(|i| {
            let job = broker_core::NewJob::new(D::Text::from(format!("job-{i}")));
            if fx.table.mode() == ClaimMode::Advisory {
                job.column("k", format!("{}-{i}", fx.table.name()))
            } else {
                job
            }
        })
        .collect();
    q.publish_batch(&jobs).await.expect("publish")
}

/// A plain lease table: every backend offers lease mode.
async fn lease_fixture<D: TestDb>() -> Fixture<D> {
    Fixture::<D>::new(ClaimMode::Lease, |b| b).await
}

fn quoted<D: TestDb>(broker: &Broker<D::B>, name: &str) -> String {
    match dialect::<D>(broker) {
        Dialect::MySql => format!("`{name}`"),
        _ => format!("\"{name}\""),
    }
}

/// `Outcome::RetryAfter(Duration::MAX)` settles: the due time is clamped to a far but valid
/// time (9999-12-31) on every database instead of failing the statement (PostgreSQL's
/// "interval out of range"), the row holds exactly that time, and it is not claimable.
pub async fn a_retry_after_duration_max_parks_the_row_far_away<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = publish_own_keys(&fx, &q, 1).await[0];
    claim_one::<D>(&q)
        .await
        .retry_after(Duration::MAX)
        .await
        .expect("a retry after Duration::MAX settles");
    let state = q.row_state(id).await.unwrap().expect("the row stays");
    // The stored due time is the clamp itself (to the second: a backend may read its time
    // column back at a coarser precision), on every database: not a later time a backend's
    // integers or timestamps happen to hold, nor one cut to the epoch or to now.
    let max = broker_core::driver::clock::MAX_DUE_MS;
    assert!(
        state
            .due_ms
            .is_some_and(|due| (max - 1_000..=max).contains(&due)),
        "the stored due time must be 9999-12-31 23:59:59.999 ({max} ms): {state:?}"
    );
    assert!(q.claim(1).await.unwrap().is_empty(), "not due for ages");
    let m = q.metrics();
    assert_eq!((m.retried, m.settle_failed), (1, 0), "{m:?}");
    fx.cleanup().await;
}

/// A settlement that fails every time (a CHECK constraint or trigger refuses the retry) ends
/// in the dead-letter table after three runs, in every mode: each failure is counted in
/// `settle_failed`, the row backs off, and the third failure dead-letters it at its next claim
/// without running the handler again. Row lock mode never moves the attempt here (the
/// settlement rolls back), so `max_attempts` alone could not end it.
pub async fn a_settlement_that_always_fails_ends_in_the_dead_letters<D: TestDb>(mode: ClaimMode)
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let dead = unique_name("dead");
    let fx = Fixture::<D>::new(mode, |b| b.dead_letter(DeadLetter::Table(dead))).await;
    refuse_far_retries::<D>(&fx.broker, fx.table.name()).await;
    let q = fx.queue().await;
    let id = publish_own_keys(&fx, &q, 1).await[0];
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .concurrency(2)
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::from_millis(10), Duration::from_millis(40)),
            move |_job| {
                counted.fetch_add(1, Ordering::SeqCst);
                async { Outcome::RetryAfter(TWO_CENTURIES) }
            },
        )
        .expect("subscribe");
    wait_until(
        "the row to be dead-lettered",
        Duration::from_secs(15),
        || {
            let q = q.clone();
            async move { q.row_state(id).await.ok().flatten().is_some_and(|s| s.dead) }
        },
    )
    .await;
    sub.shutdown().await;
    let m = q.metrics();
    assert_eq!(runs.load(Ordering::SeqCst), 3, "{m:?}");
    assert_eq!((m.settle_failed, m.dead_lettered), (3, 1), "{m:?}");
    crate::assert_counters_add_up(&q);
    fx.cleanup().await;
}

/// Without a dead-letter target, a settlement that always fails keeps the row, and every run
/// waits longer than the last: a bounded number of runs, never a loop.
pub async fn a_settlement_that_always_fails_without_dead_letters_backs_off<D: TestDb>(
    mode: ClaimMode,
) where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let fx = Fixture::<D>::new(mode, |b| b).await;
    refuse_far_retries::<D>(&fx.broker, fx.table.name()).await;
    let q = fx.queue().await;
    let id = publish_own_keys(&fx, &q, 1).await[0];
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new()
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |_job| {
                counted.fetch_add(1, Ordering::SeqCst);
                async { Outcome::RetryAfter(TWO_CENTURIES) }
            },
        )
        .expect("subscribe");
    wait_until("four runs", Duration::from_secs(10), || {
        let runs = runs.clone();
        async move { runs.load(Ordering::SeqCst) >= 4 }
    })
    .await;
    // The fourth run came after backoffs of 50, 100 and 200 ms; the next waits 400 ms, then
    // 800 ms. A hot loop ran thousands of times in this second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    sub.shutdown().await;
    let n = runs.load(Ordering::SeqCst);
    assert!(n <= 8, "{n} runs: the row loops");
    let m = q.metrics();
    assert_eq!(m.settle_failed, n as u64, "{m:?}");
    crate::assert_counters_add_up(&q);
    let state = q.row_state(id).await.unwrap().expect("the row stays");
    assert!(!state.dead, "{state:?}");
    fx.cleanup().await;
}

/// A batch publish whose last row the database refuses commits nothing, on every database:
/// the error comes back and a retry of the batch would duplicate nothing.
pub async fn a_batch_publish_with_a_poisoned_last_row_commits_nothing<D: TestDb>()
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let fx = lease_fixture::<D>().await;
    refuse_poison::<D>(&fx.broker, fx.table.name()).await;
    let q = fx.queue().await;
    // More rows than any backend writes in one statement.
    let mut jobs: Vec<_> = (0..2500).map(|i| fx.job(i)).collect();
    jobs.push(broker_core::NewJob::new(D::Text::from("poison".to_owned())));
    let err = q.publish_batch(&jobs).await.unwrap_err();
    assert!(
        matches!(
            err,
            SqlxBrokerError::Statement {
                name: "publish",
                ..
            }
        ),
        "{err:?}"
    );
    let claimed = q.claim(10).await.unwrap();
    assert!(
        claimed.is_empty(),
        "{} rows of a failed batch were committed",
        claimed.len()
    );
    jobs.pop();
    assert_eq!(q.publish_batch(&jobs).await.unwrap().len(), 2500);
    fx.cleanup().await;
}

/// An advisory take whose read fails (the payload column renamed under it) spends no attempt:
/// the row's attempt is what it was, and with the column back its first delivery reads 1.
pub async fn a_take_whose_read_fails_spends_no_attempt<D: TestDb>()
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    let mut fx = Fixture::<D>::new(ClaimMode::Advisory, |b| b).await;
    let q = fx.queue().await;
    let id = publish_own_keys(&fx, &q, 1).await[0];
    let t = quoted::<D>(&fx.broker, fx.table.name());
    exec::<D>(
        &fx.broker,
        format!("ALTER TABLE {t} RENAME COLUMN payload TO payload_gone"),
    )
    .await;
    for _ in 0..3 {
        assert!(q.claim(1).await.is_err(), "a take that cannot read fails");
    }
    exec::<D>(
        &fx.broker,
        format!("ALTER TABLE {t} RENAME COLUMN payload_gone TO payload"),
    )
    .await;
    let state = q.row_state(id).await.unwrap().expect("the row stays");
    assert_eq!(state.attempt, 1, "failed takes spent attempts: {state:?}");
    // A fresh broker, so no statement prepared against the renamed column is reused.
    let fresh = fx.other_queue().await;
    let d = claim_one::<D>(&fresh).await;
    assert_eq!((d.id(), d.attempt()), (id, 1));
    d.ack().await.unwrap();
    fx.cleanup().await;
}

/// Option values the engine cannot run with are refused at subscribe, each naming the option
/// and what is accepted: no slot, no batch, no claim, a poll that would spin, a backoff whose
/// base passes its maximum.
pub async fn option_values_the_engine_cannot_run_with_are_refused<D: TestDb>() {
    let fx = lease_fixture::<D>().await;
    let q = fx.queue().await;
    let o = SubscribeOptions::new;
    let cases = [
        (o().concurrency(0), "concurrency"),
        (o().batch_size(0), "batch_size"),
        (o().max_claims_in_flight(0), "max_claims_in_flight"),
        (o().poll_interval(Duration::ZERO), "poll_interval"),
        (o().poll_interval(Duration::from_millis(1)), "poll_interval"),
        (o().poll_cooldown(Duration::ZERO), "poll_cooldown"),
        (
            o().error_backoff(Duration::from_secs(2), Duration::from_secs(1)),
            "error_backoff",
        ),
    ];
    for (options, name) in cases {
        let err = q
            .subscribe(options, |_job| async { Outcome::Ack })
            .expect_err(name);
        match &err {
            SqlxBrokerError::InvalidOption { option, table, .. } => {
                assert_eq!((*option, table.as_str()), (name, fx.table.name()));
            }
            other => panic!("{name}: expected InvalidOption, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(name) && msg.contains("accepted:"), "{msg}");
    }
    // Extreme values that are valid still run and stop.
    let sub = q
        .subscribe(
            o().concurrency(1)
                .poll_interval(Duration::MAX)
                .poll_cooldown(Duration::MAX)
                .shutdown_timeout(Duration::MAX)
                .error_backoff(Duration::MAX, Duration::MAX),
            |_job| async { Outcome::Ack },
        )
        .expect("extreme valid options");
    // Each row wakes the idle loop, which claims it, finds nothing more and goes idle again
    // for the poll interval spread by a random draw: eight rows one after another make eight
    // such draws, so a spread that overflows near `Duration::MAX` (half the draws lengthen
    // the wait) stops the loop before the last row with all but certainty.
    for _ in 0..8 {
        let id = publish_own_keys(&fx, &q, 1).await[0];
        wait_until("the row to be acked", Duration::from_secs(10), || {
            let q = q.clone();
            async move { q.row_state(id).await.ok().flatten().is_none() }
        })
        .await;
    }
    sub.shutdown().await;
    fx.cleanup().await;
}

/// Claims that keep failing (the table is gone) back off, doubling from the poll interval,
/// and show in the subscription's health with the error, not only in the log; the health
/// clears when claims work again.
pub async fn claims_that_keep_failing_back_off_and_show_in_health<D: TestDb>() {
    let fx = lease_fixture::<D>().await;
    let q = fx.queue().await;
    let sub = q
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
            |_job| async { Outcome::Ack },
        )
        .expect("subscribe");
    wait_until("the first claims to work", Duration::from_secs(10), || {
        let h = sub.health();
        async move { h.is_healthy() }
    })
    .await;
    fx.broker.drop_tables(&fx.table).await.unwrap();
    wait_until("three failed claims", Duration::from_secs(10), || {
        let h = sub.health();
        async move { h.claim_errors_in_a_row >= 3 }
    })
    .await;
    let health = sub.health();
    assert!(!health.is_healthy());
    let last = health.last_claim_error.clone().expect("the last error");
    assert!(last.contains(fx.table.name()), "{last}");
    // After 50, 100 and 200 ms the waits are 400 and 800 ms: a poll-interval retry would fail
    // about 20 more times in this second.
    let before = q.metrics().claim_errors;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let more = q.metrics().claim_errors - before;
    assert!(
        more <= 3,
        "{more} more claim errors in a second: no backoff"
    );
    fx.broker.create_tables(&fx.table).await.unwrap();
    wait_until("claims to work again", Duration::from_secs(10), || {
        let h = sub.health();
        async move { h.is_healthy() }
    })
    .await;
    // Recovery clears the claim errors only: what the subscription runs at stays.
    let after = sub.health();
    assert_eq!(
        (after.concurrency, after.last_claim_error),
        (health.concurrency, None),
        "health after claims work again"
    );
    sub.shutdown().await;
    fx.cleanup().await;
}

/// A statement the database does not answer shows in the subscription's health while it
/// waits, before it fails. A claim: the pool has no connection to give (every one is taken), as
/// when a server is down and connecting hangs. A settlement (server databases): the row is
/// locked by another transaction, so the ack waits. Once the database answers, the health
/// clears.
pub async fn a_statement_that_waits_shows_in_health_before_it_fails<D: TestDb>() {
    let fx = lease_fixture::<D>().await;
    let q = fx.queue().await;
    let pool = fx.broker.pool();
    let mut taken = Vec::new();
    for _ in 0..pool.options().get_max_connections() {
        taken.push(pool.acquire().await.expect("a connection of the pool"));
    }
    let (started, mut handlers) = tokio::sync::mpsc::unbounded_channel();
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = release.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
            move |job: broker_core::Job<D::Job>| {
                let (started, gate) = (started.clone(), gate.clone());
                async move {
                    let _ = started.send(job.id());
                    gate.acquire().await.expect("the gate stays open").forget();
                    Outcome::Ack
                }
            },
        )
        .expect("subscribe");
    let waiting = |what: &'static str| {
        wait_until(what, Duration::from_secs(20), || {
            let h = sub.health();
            async move { h.waiting_for_database.is_some() && !h.is_healthy() }
        })
    };
    let healthy = |what: &'static str| {
        wait_until(what, Duration::from_secs(20), || {
            let h = sub.health();
            async move { h.is_healthy() && h.waiting_for_database.is_none() }
        })
    };
    waiting("the waiting claim in health").await;
    drop(taken);
    healthy("the claim to return").await;

    // A settlement that waits for a row lock.
    let id = q.publish(fx.job(1)).await.expect("publish");
    let ran = tokio::time::timeout(Duration::from_secs(20), handlers.recv())
        .await
        .expect("the handler starts");
    assert_eq!(ran, Some(id));
    let sql = format!(
        "SELECT {id_col} FROM {t} WHERE {id_col} = {id} FOR UPDATE",
        t = D::quote(fx.table.name()),
        id_col = D::quote(fx.table.id()),
    );
    if let Some(lock) = D::hold_row_lock(&fx.broker, &sql).await {
        release.add_permits(1);
        waiting("the waiting settlement in health").await;
        drop(lock);
    } else {
        release.add_permits(1);
    }
    healthy("the settlement to return").await;
    wait_until("the row acked", Duration::from_secs(20), || {
        let q = q.clone();
        async move { q.row_state(id).await.expect("row state").is_none() }
    })
    .await;
    sub.shutdown().await;
    fx.cleanup().await;
}

/// Table and column names longer than the database keeps are refused when the queue is
/// prepared and before DDL runs, naming the name and the limit; where the database keeps long
/// names (SQLite), the same description works and its dead-letter table stays its own.
pub async fn names_longer_than_the_database_keeps_are_refused<D: TestDb>() {
    let url = D::database().await;
    let broker = D::connect(&url).await;
    let base = unique_name("long");
    let name = format!("{base}_{}", "x".repeat(70 - base.len()));
    let dead = format!("{name}_dead");
    let table = TableDescription::builder(name.as_str())
        .payload("payload", broker_core::ColumnType::Text)
        .locked_until("locked_until")
        .dead_letter(DeadLetter::Table(dead.clone()))
        .build()
        .unwrap();
    let created = broker.create_tables(&table).await;
    let prepared = broker.queue::<D::Job>(table.clone()).await;
    match (created, prepared) {
        (Err(c), Err(p)) => {
            for err in [c, p] {
                assert!(
                    matches!(err, SqlxBrokerError::Description { .. }),
                    "{err:?}"
                );
                let msg = err.to_string();
                assert!(
                    msg.contains(&name) && msg.contains("at most") && msg.contains("shorter"),
                    "{msg}"
                );
            }
        }
        (Ok(()), Ok(q)) => {
            let id = q
                .publish(broker_core::NewJob::new(D::Text::from("long".to_owned())))
                .await
                .unwrap();
            claim_one::<D>(&q).await.dead_letter().await.unwrap();
            let state = q.row_state(id).await.unwrap().expect("in the dead letters");
            assert!(state.dead, "{state:?}");
            assert!(q.claim(1).await.unwrap().is_empty());
            broker.drop_tables(&table).await.unwrap();
        }
        (c, p) => panic!("create and prepare disagree: {:?} / {:?}", c.err(), p.err()),
    }
    broker.close().await;
    D::drop_database(&url).await;
}

/// A row deleted by hand while a delivery holds it (lease and advisory modes; a row lock keeps
/// the delete waiting) is reported as gone, not as a lease that ran out or a claim taken again.
pub async fn a_row_deleted_while_claimed_is_reported_gone<D: TestDb>(mode: ClaimMode)
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
{
    assert_ne!(
        mode,
        ClaimMode::RowLock,
        "a row lock keeps the delete waiting"
    );
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let id = publish_own_keys(&fx, &q, 1).await[0];
    let d = claim_one::<D>(&q).await;
    let t = quoted::<D>(&fx.broker, fx.table.name());
    exec::<D>(&fx.broker, format!("DELETE FROM {t} WHERE id = {id}")).await;
    let err = d.ack().await.unwrap_err();
    assert!(
        matches!(err, SqlxBrokerError::RowGone { id: gone, .. } if gone == id),
        "{err:?}"
    );
    assert!(err.to_string().contains("is gone"), "{err}");
    assert_eq!(q.metrics().lease_lost, 0);
    fx.cleanup().await;
}

/// A NULL payload is a decode error on every database when the handler reads the payload as
/// a `String` (SQLite used to hand over `""`), and reads as `None` as an `Option`.
pub async fn a_null_payload_is_a_decode_error_unless_the_payload_is_optional<D: TestDb>()
where
    for<'c> &'c mut <DbOf<D> as Database>::Connection: Executor<'c, Database = DbOf<D>>,
    String: for<'r> sqlx::Decode<'r, DbOf<D>> + sqlx::Type<DbOf<D>>,
    for<'a> &'a str: sqlx::ColumnIndex<<DbOf<D> as Database>::Row>,
{
    let fx = lease_fixture::<D>().await;
    let t = quoted::<D>(&fx.broker, fx.table.name());
    exec::<D>(
        &fx.broker,
        format!("INSERT INTO {t} (payload) VALUES (NULL)"),
    )
    .await;
    let strict = fx
        .broker
        .queue::<Payload<String>>(fx.table.clone())
        .await
        .unwrap();
    assert!(
        strict.claim(1).await.unwrap().is_empty(),
        "NULL is no String"
    );
    assert_eq!(strict.metrics().decode_errors, 1);
    let optional = fx
        .broker
        .queue::<Payload<Option<String>>>(fx.table.clone())
        .await
        .unwrap();
    let d = claim_one_of(&optional).await;
    assert_eq!(d.payload().0, None);
    d.ack().await.unwrap();
    fx.cleanup().await;
}

async fn claim_one_of<B, T>(q: &broker_core::Queue<B, T>) -> broker_core::Delivery<B, T>
where
    B: broker_core::Backend,
    T: for<'r> sqlx::FromRow<'r, <B::Db as Database>::Row> + Send + 'static,
{
    crate::claim_one(q).await
}

/// Concurrency 200 on the backend's default pool drains as many rows as concurrency 8, with no
/// more claim errors, in every mode: the engine lowers what it asks of the pool (claims in
/// flight, and in modes that hold a connection per delivery, the concurrency) instead of
/// queueing hundreds of waiters on it.
pub async fn concurrency_200_drains_like_8_on_the_default_pool<D: TestDb>(mode: ClaimMode) {
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    for concurrency in [8, 200] {
        let before = q.metrics();
        publish_own_keys(&fx, &q, 300).await;
        let sub = q
            .subscribe(
                SubscribeOptions::new()
                    .concurrency(concurrency)
                    .poll_interval(Duration::from_millis(100)),
                |_job| async {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Outcome::Ack
                },
            )
            .expect("subscribe");
        wait_until(
            &format!("300 rows acked at concurrency {concurrency}"),
            Duration::from_secs(30),
            || {
                let q = q.clone();
                async move { q.metrics().acked - before.acked == 300 }
            },
        )
        .await;
        sub.shutdown().await;
        let m = q.metrics();
        assert_eq!(
            (m.claim_errors - before.claim_errors, m.settle_failed),
            (0, 0),
            "concurrency {concurrency}: {m:?}"
        );
    }
    fx.cleanup().await;
}

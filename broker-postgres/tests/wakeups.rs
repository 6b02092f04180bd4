//! Cross-process wake-ups under load: publishes are coalesced into few notifications (a NOTIFY
//! in every insert serialises commits), yet a subscription in another process that waits on a
//! poll far longer than the test's bound still picks up every row, from pool publishes and from
//! publishes inside callers' transactions. Every wait is bounded.

mod common;

use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use broker_core::{ClaimMode, Outcome, SubscribeOptions};
use broker_testkit::{Fixture, wait_until};
use common::Pg;
use sha2::{Digest, Sha256};
use sqlx::postgres::PgListener;

/// The table's channel, as the backend names it (`sqlx_broker_` and 16 hex digits of the
/// SHA-256 of the table name).
fn channel(table: &str) -> String {
    let digest = Sha256::digest(table.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("sqlx_broker_{hex}")
}

/// What the test saw, in the order it saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// A publish (or the commit of a transaction that published) returned.
    Published,
    /// A notification arrived on the table's channel.
    Notified,
}

type Log = Arc<Mutex<Vec<Event>>>;

fn log(events: &Log, e: Event) {
    events.lock().unwrap().push(e);
}

/// Logs every notification on `channel`, in a task of its own.
async fn listen(url: &str, channel: &str, events: Log) -> tokio::task::JoinHandle<()> {
    let mut listener = PgListener::connect(url)
        .await
        .expect("connect the listener");
    listener.listen(channel).await.expect("LISTEN");
    tokio::spawn(async move {
        while let Ok(Some(_)) = listener.try_recv().await {
            log(&events, Event::Notified);
        }
    })
}

/// Waits (bounded) until a notification arrives after the last publish: the burst's trailing
/// notification, which covers the rows published after the previous one.
async fn trailing_notification(events: &Log) {
    wait_until(
        "a notification after the last publish",
        Duration::from_secs(10),
        || {
            let events = events.clone();
            async move {
                let events = events.lock().unwrap();
                let last = events.iter().rposition(|e| *e == Event::Published);
                last.is_some_and(|i| events[i..].contains(&Event::Notified))
            }
        },
    )
    .await;
}

fn count(events: &Log, e: Event) -> usize {
    events.lock().unwrap().iter().filter(|x| **x == e).count()
}

/// A subscription that only a notification (or a claim it makes anyway) can wake within the
/// test's bounds: its poll is an hour.
fn deaf_to_polls() -> SubscribeOptions {
    SubscribeOptions::new()
        .concurrency(4)
        .poll_interval(Duration::from_secs(3600))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_publishes_sends_few_notifications_and_wakes_every_row() {
    let mut fx = Fixture::<Pg>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    let elsewhere = fx.other_queue().await;
    let events = Log::default();
    let listener = listen(&fx.url, &channel(fx.table.name()), events.clone()).await;
    let sub = q
        .subscribe(deaf_to_polls(), |_job| async { Outcome::Ack })
        .expect("subscribe");
    // Let the subscription find the table empty and go idle.
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Eight publishers, one row per publish, as a busy service writes jobs.
    const PER_TASK: usize = 50;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let elsewhere = elsewhere.clone();
        let jobs: Vec<_> = (0..PER_TASK).map(|i| fx.job(t * PER_TASK + i)).collect();
        let events = events.clone();
        tasks.push(tokio::spawn(async move {
            for job in jobs {
                // Logged first: the listener may log the publish's notification before the
                // publish call returns here.
                log(&events, Event::Published);
                elsewhere.publish(job).await.expect("publish");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // A tail of publishes back to back from one task: whether the first of them opens a window
    // or falls into one, the last ones fall into a window and only its trailing notification
    // covers them.
    const TAIL: usize = 5;
    for i in 0..TAIL {
        log(&events, Event::Published);
        elsewhere
            .publish(fx.job(8 * PER_TASK + i))
            .await
            .expect("publish");
    }
    let published = 8 * PER_TASK + TAIL;
    trailing_notification(&events).await;
    wait_until(
        "every published row acked by the other process's subscription",
        Duration::from_secs(30),
        || {
            let q = q.clone();
            async move { q.metrics().acked == published as u64 }
        },
    )
    .await;
    let sent = count(&events, Event::Notified);
    assert!(sent >= 1, "the burst must notify at least once");
    assert!(
        sent * 4 <= published,
        "{sent} notifications for {published} publishes: they are not coalesced"
    );
    sub.shutdown().await;
    listener.abort();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishes_in_callers_transactions_wake_another_process_when_they_commit() {
    let mut fx = Fixture::<Pg>::new(ClaimMode::Lease, |b| b).await;
    let q = fx.queue().await;
    let elsewhere = fx.other_queue().await;
    let pool = elsewhere_pool(&fx).await;
    let events = Log::default();
    let listener = listen(&fx.url, &channel(fx.table.name()), events.clone()).await;
    let sub = q
        .subscribe(deaf_to_polls(), |_job| async { Outcome::Ack })
        .expect("subscribe");
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Transactions that publish one after another, each committed at once: the first carries
    // the notification in its insert, the next ones within its window are covered by the
    // notification one window later.
    for round in 0..3 {
        for i in 0..4 {
            let mut tx = pool.begin().await.unwrap();
            elsewhere
                .publish_in(&mut *tx, &[fx.job(round * 4 + i)])
                .await
                .unwrap();
            // Logged before the commit: the listener may log this commit's notification
            // before the commit call returns here.
            log(&events, Event::Published);
            tx.commit().await.unwrap();
        }
        trailing_notification(&events).await;
        let want = (round as u64 + 1) * 4;
        wait_until(
            "the committed rows acked in the other process",
            Duration::from_secs(20),
            || {
                let q = q.clone();
                async move { q.metrics().acked == want }
            },
        )
        .await;
    }
    // A transaction that rolls back wakes nobody and leaves nothing.
    let mut tx = pool.begin().await.unwrap();
    elsewhere.publish_in(&mut *tx, &[fx.job(99)]).await.unwrap();
    tx.rollback().await.unwrap();
    sub.shutdown().await;
    listener.abort();
    assert_eq!(q.metrics().claimed, 12);
    pool.close().await;
    fx.cleanup().await;
}

/// A pool of its own on the case's database, for the callers' transactions.
async fn elsewhere_pool(fx: &Fixture<Pg>) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&fx.url)
        .await
        .expect("connect")
}

/// A broker on `url` whose pool has `max` connections and whose sessions carry an application
/// name of their own; returns it with that name.
async fn broker_with_pool(url: &str, max: u32) -> (broker_postgres::PgBroker, String) {
    use std::str::FromStr;
    let app = broker_testkit::unique_name("app");
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .expect("a PostgreSQL URL")
        .application_name(&app);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(20))
        .connect_with(options)
        .await
        .expect("connect");
    (
        broker_core::Broker::new(broker_postgres::PgBackend::new(pool)),
        app,
    )
}

/// The server sessions of an application name, and how many of them last ran a `LISTEN`.
async fn sessions_of(app: &str) -> (i64, i64) {
    let mut admin = common::admin().await;
    let counts = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE query LIKE 'LISTEN%') \
         FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(app)
    .fetch_one(&mut admin)
    .await
    .expect("probe pg_stat_activity");
    let _ = sqlx::Connection::close(admin).await;
    counts
}

/// Issue #32: fifty queue tables with a subscription each on a pool of ten. Every subscription
/// used to keep a pool connection for its `LISTEN`, so the subscriptions held the whole pool
/// and every publish timed out. Now one connection outside the pool listens for all of them:
/// at idle at most two pool connections are out, rows another process publishes wake each
/// subscription (their poll is an hour), and publishes and claims through the pool work.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_subscriptions_on_a_pool_of_ten_share_one_listening_connection() {
    const QUEUES: usize = 50;
    const ROWS: usize = 20;
    let url = common::create_database().await;
    let (broker, app) = broker_with_pool(&url, 10).await;
    let (publisher, _) = broker_with_pool(&url, 4).await;
    let mut tables = Vec::new();
    let mut subs = Vec::new();
    let mut queues = Vec::new();
    let mut theirs = Vec::new();
    for i in 0..QUEUES {
        let name = broker_testkit::unique_name(&format!("q{i}"));
        let table = broker_testkit::describe(&name, ClaimMode::Lease)
            .build()
            .expect("a lease table");
        broker.create_tables(&table).await.expect("create");
        let q = broker
            .queue::<broker_testkit::Job>(table.clone())
            .await
            .expect("queue");
        subs.push(
            q.subscribe(deaf_to_polls(), |_job| async { Outcome::Ack })
                .expect("subscribe"),
        );
        theirs.push(
            publisher
                .queue::<broker_testkit::Job>(table.clone())
                .await
                .expect("queue"),
        );
        queues.push(q);
        tables.push(table);
    }
    let pool = broker.pool().clone();
    wait_until(
        "at most two pool connections out at idle",
        Duration::from_secs(10),
        || {
            let pool = pool.clone();
            async move {
                let out = usize::try_from(pool.size()).unwrap_or(usize::MAX) - pool.num_idle();
                out <= 2
            }
        },
    )
    .await;
    let (sessions, listening) = sessions_of(&app).await;
    assert_eq!(listening, 1, "one session listens for every table");
    assert!(
        sessions <= i64::from(pool.size()) + 1,
        "{sessions} sessions for a pool of {} and one listener",
        pool.size()
    );
    // Another process publishes: only a notification can wake a subscription within the wait.
    for q in &theirs {
        q.publish(broker_core::NewJob::new("elsewhere".to_owned()))
            .await
            .expect("publish elsewhere");
    }
    wait_until(
        "every subscription woken by the other process's publish",
        Duration::from_secs(30),
        || {
            let queues = queues.clone();
            async move { queues.iter().all(|q| q.metrics().acked == 1) }
        },
    )
    .await;
    // Publishes through the busy broker's own pool, and their claims.
    for q in &queues {
        let jobs: Vec<_> = (0..ROWS)
            .map(|i| broker_core::NewJob::new(format!("row {i}")))
            .collect();
        q.publish_batch(&jobs)
            .await
            .expect("publish on the shared pool");
    }
    wait_until("every queue drained", Duration::from_secs(60), || {
        let queues = queues.clone();
        async move { queues.iter().all(|q| q.metrics().acked == 1 + ROWS as u64) }
    })
    .await;
    for s in subs {
        s.shutdown().await;
    }
    for t in &tables {
        broker.drop_tables(t).await.expect("drop");
    }
    publisher.close().await;
    broker.close().await;
    broker.pool().close().await;
    common::drop_database(&url).await;
}

/// Issue #32: when the listening connection is killed, it connects again, listens on every
/// table again, and wakes each subscription once: rows inserted while nobody would have heard
/// of them (by plain SQL, which notifies nobody) are found by that wake-up, although the
/// subscriptions' poll is an hour away; later publishes from another process wake them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_listening_connection_listens_again_and_wakes_every_subscription_once() {
    let url = common::create_database().await;
    let (broker, app) = broker_with_pool(&url, 10).await;
    let (publisher, _) = broker_with_pool(&url, 4).await;
    let mut tables = Vec::new();
    let mut subs = Vec::new();
    let mut queues = Vec::new();
    for i in 0..3 {
        let name = broker_testkit::unique_name(&format!("k{i}"));
        let table = broker_testkit::describe(&name, ClaimMode::Lease)
            .build()
            .expect("a lease table");
        broker.create_tables(&table).await.expect("create");
        let q = broker
            .queue::<broker_testkit::Job>(table.clone())
            .await
            .expect("queue");
        subs.push(
            q.subscribe(deaf_to_polls(), |_job| async { Outcome::Ack })
                .expect("subscribe"),
        );
        queues.push(q);
        tables.push(table);
    }
    // Let every subscription find its table empty and wait for its hour-long poll.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for t in &tables {
        let sql = format!("INSERT INTO \"{}\" (payload) VALUES ('by hand')", t.name());
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(publisher.pool())
            .await
            .expect("insert by hand");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        queues.iter().all(|q| q.metrics().claimed == 0),
        "nothing wakes a subscription for a row inserted by hand before the kill"
    );
    let mut admin = common::admin().await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(&app)
    .fetch_all(&mut admin)
    .await
    .expect("terminate the listening session");
    let _ = sqlx::Connection::close(admin).await;
    assert_eq!(killed, [true], "one listening session, terminated");
    wait_until(
        "every subscription woken once after the listener came back",
        Duration::from_secs(30),
        || {
            let queues = queues.clone();
            async move { queues.iter().all(|q| q.metrics().acked == 1) }
        },
    )
    .await;
    for t in &tables {
        publisher
            .queue::<broker_testkit::Job>(t.clone())
            .await
            .expect("queue")
            .publish(broker_core::NewJob::new("after".to_owned()))
            .await
            .expect("publish elsewhere");
    }
    wait_until(
        "every subscription woken by a publish after the reconnect",
        Duration::from_secs(30),
        || {
            let queues = queues.clone();
            async move { queues.iter().all(|q| q.metrics().acked == 2) }
        },
    )
    .await;
    let (_, listening) = sessions_of(&app).await;
    assert_eq!(listening, 1, "one session listens again");
    for s in subs {
        s.shutdown().await;
    }
    for t in &tables {
        broker.drop_tables(t).await.expect("drop");
    }
    publisher.close().await;
    broker.close().await;
    broker.pool().close().await;
    common::drop_database(&url).await;
}

/// Terminates the listening session of application `app`; panics unless there was one.
async fn kill_listener(app: &str) {
    let mut admin = common::admin().await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(app)
    .fetch_all(&mut admin)
    .await
    .expect("terminate the listening session");
    let _ = sqlx::Connection::close(admin).await;
    assert_eq!(killed, [true], "one listening session, terminated");
}

/// Issue #48: operator signals survive a lost listening connection. A pause that no listener
/// heard (written by hand into the control table, as a `NOTIFY` lost with the connection would
/// be) is found when the listening connection comes back, long before the subscription's
/// hour-long poll; so is a pause made through another broker right after the connection is
/// terminated. Either way no handler starts while the queue is paused, and the resume (a
/// signal) restarts the subscription at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_missed_while_the_listener_was_down_holds_once_it_listens_again() {
    let url = common::create_database().await;
    let (broker, app) = broker_with_pool(&url, 10).await;
    let (operator, _) = broker_with_pool(&url, 4).await;
    let name = broker_testkit::unique_name("sig");
    let table = broker_testkit::describe(&name, ClaimMode::Lease)
        .build()
        .expect("a lease table");
    broker.create_tables(&table).await.expect("create");
    let q = broker
        .queue::<broker_testkit::Job>(table.clone())
        .await
        .expect("queue");
    let op = operator
        .queue::<broker_testkit::Job>(table.clone())
        .await
        .expect("queue");
    let sub = q
        .subscribe(deaf_to_polls(), |_job| async { Outcome::Ack })
        .expect("subscribe");
    let publish = |n: usize| {
        let op = op.clone();
        async move {
            for _ in 0..n {
                op.publish(broker_core::NewJob::new("x".to_owned()))
                    .await
                    .expect("publish");
            }
        }
    };
    let acked = |n: u64, what: &'static str| {
        let q = q.clone();
        async move {
            wait_until(what, Duration::from_secs(10), || {
                let a = q.metrics().acked;
                async move { a >= n }
            })
            .await;
        }
    };
    let nothing_runs = |what: &'static str| {
        let q = q.clone();
        async move {
            let before = q.metrics().claimed;
            tokio::time::sleep(Duration::from_millis(800)).await;
            assert_eq!(q.metrics().claimed, before, "{what}");
        }
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    // 1. A pause nobody heard: the subscription does not know of it (its poll is an hour) ...
    let by_hand = format!(
        "INSERT INTO {} (queue, paused_at_ms, paused_by) VALUES ('{}', 0, 'by hand')",
        broker_core::driver::CONTROL_TABLE,
        table.name()
    );
    sqlx::query(sqlx::AssertSqlSafe(by_hand))
        .execute(operator.pool())
        .await
        .expect("pause by hand");
    publish(1).await;
    acked(1, "a row published after an unheard pause runs").await;
    // ... until its listening connection drops and comes back: the subscription reads the
    // pause state then.
    kill_listener(&app).await;
    wait_until("health to show the pause", Duration::from_secs(10), || {
        let paused = sub.health().paused;
        async move { paused }
    })
    .await;
    publish(3).await;
    nothing_runs("a handler started after the reconnect found the pause").await;
    op.resume().await.expect("resume");
    acked(4, "the resume (a signal) restarts the subscription at once").await;

    // 2. A pause through another broker right after the listener is terminated.
    tokio::time::sleep(Duration::from_millis(200)).await;
    kill_listener(&app).await;
    op.pause("while the listener is down").await.expect("pause");
    wait_until(
        "one session listens again",
        Duration::from_secs(10),
        || async { sessions_of(&app).await.1 == 1 },
    )
    .await;
    publish(3).await;
    nothing_runs("a handler started while paused, after the listener came back").await;
    assert!(sub.health().paused, "health shows the pause");
    op.resume().await.expect("resume");
    acked(7, "the rows published while paused run after the resume").await;

    sub.shutdown().await;
    broker.drop_tables(&table).await.expect("drop");
    operator.close().await;
    broker.close().await;
    broker.pool().close().await;
    common::drop_database(&url).await;
}

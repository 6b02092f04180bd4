//! Faults and stress: killed processes, killed connections, and a long run with random outcomes,
//! each checked by the history checker.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use broker_core::{
    Backend, Broker, ClaimMode, DeadLetter, NewJob, Outcome, Queue, SubscribeOptions, Subscription,
    TableDescription,
};

use crate::history::{Expect, Final, History, Recorded};
use crate::{Fixture, JobText, TestDb, describe, unique_name, wait_until};

/// The environment variable that turns a test binary into a kill test's worker.
pub const CHILD_ENV: &str = "SQLX_BROKER_CHILD_WORKER";

/// Rows per stress run (`SQLX_BROKER_STRESS_ROWS`, default 10,000).
pub fn stress_rows() -> usize {
    std::env::var("SQLX_BROKER_STRESS_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// A small deterministic hash, so a row's outcomes repeat from run to run.
fn mix(id: i64, attempt: i64) -> u64 {
    let mut x = id.cast_unsigned().wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ attempt.cast_unsigned().wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

fn stress_table(name: &str, mode: ClaimMode, dead: &str) -> TableDescription {
    let b = TableDescription::builder(name)
        .payload("payload", broker_core::ColumnType::Text)
        .due_at("due_at")
        .max_attempts(4)
        .dead_letter(DeadLetter::Table(dead.to_owned()));
    match mode {
        ClaimMode::RowLock => b,
        ClaimMode::Lease => b.locked_until("locked_until").lease_seconds(5),
        ClaimMode::Advisory => b
            .column("k", broker_core::ColumnType::Text)
            .advisory_lock("key-{k}"),
    }
    .build()
    .expect("the stress table's description is valid")
}

/// The stress run's handlers panic on purpose, hundreds of times: keep those out of the test
/// output, and let every other panic through to the previous hook.
fn quiet_deliberate_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&DELIBERATE_PANIC) {
                previous(info);
            }
        }));
    });
}

const DELIBERATE_PANIC: &str = "a random handler panic";

/// One broker of a stress run: its subscription records into the shared history, with random
/// (but per-delivery deterministic) outcomes: ack, retry, delayed retry, error, panic, dead letter.
fn stress_worker<D: TestDb>(
    queue: &Queue<D::B, D::Job>,
    index: usize,
    history: &Arc<History>,
) -> Subscription {
    let history = history.clone();
    queue
        .subscribe(
            SubscribeOptions::new()
                .name(format!("stress-{index}"))
                .concurrency(8)
                .batch_size(8)
                .poll_interval(Duration::from_millis(100))
                .shutdown_timeout(Duration::ZERO)
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |job| {
                let history = history.clone();
                Box::pin(async move {
                    let at = history.start(
                        index,
                        job.id(),
                        job.attempt(),
                        job.key().map(str::to_owned),
                        None,
                    );
                    let roll = mix(job.id(), job.attempt()) % 100;
                    // Some handlers take a moment, so kills find deliveries in work.
                    match roll % 5 {
                        0 => tokio::time::sleep(Duration::from_millis(2)).await,
                        1 => tokio::task::yield_now().await,
                        _ => {}
                    }
                    let (recorded, result) = match roll {
                        0..70 => (Recorded::Ack, Ok(Outcome::Ack)),
                        70..78 => (Recorded::Retry, Ok(Outcome::Retry)),
                        78..84 => (
                            Recorded::RetryAfter,
                            Ok(Outcome::RetryAfter(Duration::from_millis(20))),
                        ),
                        84..92 => (Recorded::Error, Err("a random handler error".into())),
                        92..96 => {
                            history.finish(at, Recorded::Panic);
                            std::panic::panic_any(DELIBERATE_PANIC);
                        }
                        _ => (Recorded::DeadLetter, Ok(Outcome::DeadLetter)),
                    };
                    history.finish(at, recorded);
                    result
                })
            },
        )
        .expect("subscribe")
}

/// 4 brokers × 8 workers drain a table of [`stress_rows`] rows with random outcomes, while two
/// brokers are killed mid-run (their handlers dropped) and replaced; the history checker then
/// proves SPEC section 10 on the run, and the figures are printed.
pub async fn stress_with_random_outcomes_and_kills<D: TestDb>(mode: ClaimMode) {
    let url = D::database().await;
    let first = D::connect(&url).await;
    if !first.backend().capabilities().offers(mode) {
        first.close().await;
        D::drop_database(&url).await;
        return;
    }
    let name = unique_name("stress");
    let dead = format!("{name}_dead");
    let table = stress_table(&name, mode, &dead);
    first.create_tables(&table).await.unwrap();
    let rows = stress_rows();
    let queue = first.queue::<D::Job>(table.clone()).await.unwrap();
    let mut ids = Vec::with_capacity(rows);
    for chunk in (0..rows).collect::<Vec<_>>().chunks(1000) {
        let jobs: Vec<_> = chunk
            .iter()
            .map(|i| {
                let job = NewJob::new(D::Text::from(format!("job-{i}")));
                // 97 keys: many rows share each, so key exclusivity is exercised.
                if mode == ClaimMode::Advisory {
                    job.column("k", format!("k{}", i % 97))
                } else {
                    job
                }
            })
            .collect();
        ids.extend(queue.publish_batch(&jobs).await.unwrap());
    }
    quiet_deliberate_panics();
    let history = Arc::new(History::default());
    let start = Instant::now();
    let mut brokers: Vec<(Broker<D::B>, Subscription)> = Vec::new();
    let mut next = 0;
    for _ in 0..4 {
        let b = D::connect(&url).await;
        let q = b.queue::<D::Job>(table.clone()).await.unwrap();
        brokers.push((b, stress_worker::<D>(&q, next, &history)));
        next += 1;
    }
    let limit = Duration::from_secs(90);
    let max_attempts = table.max_attempts();
    let mut kills = 0;
    for tenths in [3, 6] {
        let target = rows * tenths / 10;
        wait_until(&format!("{target} rows finished"), limit, || {
            let h = history.clone();
            async move { h.finished_rows(max_attempts) >= target }
        })
        .await;
        // Brokers are killed oldest first, so the k-th kill is broker k.
        let (b, s) = brokers.remove(0);
        let at = history.now();
        s.shutdown().await;
        history.kill(kills, at);
        b.close().await;
        kills += 1;
        let nb = D::connect(&url).await;
        let q = nb.queue::<D::Job>(table.clone()).await.unwrap();
        brokers.push((nb, stress_worker::<D>(&q, next, &history)));
        next += 1;
    }
    // Done when every row has finished by the handlers' account, or (for the few that have
    // not) by the database's: a kill can spend a row's last attempts on claims no handler saw,
    // and the row is then dead-lettered at its next claim without a delivery.
    let waiting = Instant::now();
    loop {
        let unfinished = history.unfinished_rows(&ids, max_attempts);
        if unfinished.len() <= 50 {
            let mut open = false;
            for id in &unfinished {
                if queue.row_state(*id).await.unwrap().is_some_and(|s| !s.dead) {
                    open = true;
                    break;
                }
            }
            if !open {
                break;
            }
        }
        if waiting.elapsed() > limit {
            let mut stuck = String::new();
            for id in unfinished.into_iter().take(20) {
                let state = queue.row_state(id).await.unwrap();
                let last = history.records().into_iter().rfind(|r| r.id == id);
                stuck.push_str(&format!("\n  row {id}: {state:?}, last delivery {last:?}"));
            }
            let metrics: Vec<_> = brokers.iter().map(|(_, s)| s.metrics()).collect();
            panic!(
                "gave up after {limit:?}: {} of {rows} rows finished; stuck rows:{stuck}\nmetrics: {metrics:?}",
                history.finished_rows(max_attempts)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A row whose last delivery was cut by a kill may still be in the queue: the surviving
    // brokers deliver it again.
    wait_until("rows cut by a kill to finish", limit, || {
        let h = history.clone();
        let q = queue.clone();
        async move {
            for id in h.unsure_rows() {
                if q.row_state(id).await.unwrap().is_some_and(|s| !s.dead) {
                    return false;
                }
            }
            true
        }
    })
    .await;
    let elapsed = start.elapsed();
    for (b, s) in brokers.drain(..) {
        s.shutdown().await;
        b.close().await;
    }
    let mut finals = BTreeMap::new();
    for id in &ids {
        let state = queue.row_state(*id).await.unwrap();
        finals.insert(
            *id,
            match state {
                None => Final::Gone,
                Some(s) if s.dead => Final::Dead,
                Some(_) => Final::Present,
            },
        );
    }
    let expect = Expect {
        mode,
        fifo: false,
        max_attempts: table.max_attempts(),
        finals,
    };
    match history.check(&expect) {
        Ok(f) => crate::report(&format!(
            "stress {mode} on {}: {} rows, {} deliveries, {} retries, {} killed deliveries, {} acked, {} dead-lettered, {kills} broker kills, {:.1}s ({:.0} deliveries/s)",
            first.backend().capabilities().database,
            f.rows,
            f.deliveries,
            f.retries,
            f.killed,
            f.acked,
            f.dead,
            elapsed.as_secs_f64(),
            f.deliveries as f64 / elapsed.as_secs_f64()
        )),
        Err(problems) => {
            let head: String = problems.lines().take(60).collect::<Vec<_>>().join("\n");
            panic!("the history check failed:\n{head}");
        }
    }
    let leaks = D::leaks(&first).await;
    assert!(leaks.is_empty(), "leaks after the stress run: {leaks:?}");
    first.drop_tables(&table).await.unwrap();
    first.close().await;
    D::drop_database(&url).await;
}

/// The kill test's worker: run in a child process (the test binary itself, re-run with
/// [`CHILD_ENV`] set), it claims rows, prints `STARTED <id> <attempt>` and sleeps until killed.
async fn child_worker<D: TestDb>(spec: &str) {
    let mut parts = spec.splitn(3, '|');
    let (mode, table, url) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let mode = match mode {
        "row_lock" => ClaimMode::RowLock,
        "lease" => ClaimMode::Lease,
        _ => ClaimMode::Advisory,
    };
    let broker = D::connect(url).await;
    let queue = broker
        .queue::<D::Job>(kill_table(table, mode))
        .await
        .expect("the child's queue");
    let _sub = queue
        .subscribe(
            SubscribeOptions::new().concurrency(4).batch_size(4),
            |job| {
                Box::pin(async move {
                    println!("STARTED {} {}", job.id(), job.attempt());
                    tokio::time::sleep(Duration::from_secs(300)).await;
                    Ok(Outcome::Ack)
                })
            },
        )
        .expect("subscribe");
    tokio::time::sleep(Duration::from_secs(300)).await;
}

fn kill_table(name: &str, mode: ClaimMode) -> TableDescription {
    let b = describe(name, mode);
    let b = if mode == ClaimMode::Lease {
        b.lease_seconds(2)
    } else {
        b
    };
    b.build().expect("the kill test's description is valid")
}

/// A worker process killed with SIGKILL mid-handler gives its rows back as its mode says: row
/// lock at once with the attempt unused; lease after the lease (2 s) with one attempt used;
/// advisory at once with one attempt used and the keys free. `test_path` is this test's name in
/// its binary (the child re-runs it).
pub async fn a_killed_worker_gives_its_rows_back<D: TestDb>(mode: ClaimMode, test_path: &str) {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child_worker::<D>(&spec).await;
        return;
    }
    let Some(fx) = Fixture::<D>::new(mode, |b| {
        if mode == ClaimMode::Lease {
            b.lease_seconds(2)
        } else {
            b
        }
    })
    .await
    else {
        return;
    };
    let q = fx.queue().await;
    let ids = fx.publish(&q, 4).await;
    let mode_name = match mode {
        ClaimMode::RowLock => "row_lock",
        ClaimMode::Lease => "lease",
        ClaimMode::Advisory => "advisory",
    };
    let test_name = test_path
        .split_once("::")
        .map_or(test_path, |(_, rest)| rest)
        .to_owned();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            test_name.as_str(),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            CHILD_ENV,
            format!("{mode_name}|{}|{}", fx.table.name(), fx.url),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the worker process");
    let stdout = child.stdout.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        let mut started = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest prints "test <name> ... " without a newline first, so look anywhere.
            if let Some(at) = line.find("STARTED ") {
                let rest = &line[at + "STARTED ".len()..];
                let mut it = rest.split(' ').map(|x| x.parse::<i64>().unwrap());
                started.push((it.next().unwrap(), it.next().unwrap()));
                if started.len() == 4 {
                    break;
                }
            }
        }
        started
    });
    let started = match tokio::time::timeout(Duration::from_secs(60), started).await {
        Ok(s) => s.unwrap(),
        Err(_) => {
            let _ = child.kill();
            panic!("the worker process did not start four handlers within 60 s");
        }
    };
    assert_eq!(
        started.len(),
        4,
        "the worker started four handlers: {started:?}"
    );
    assert!(started.iter().all(|(_, attempt)| *attempt == 1));
    child.kill().expect("SIGKILL the worker");
    let _ = child.wait();
    let killed_at = Instant::now();

    if mode == ClaimMode::Lease {
        assert!(
            q.claim(4).await.unwrap().is_empty(),
            "the leases still hold right after the kill"
        );
    }
    let mut back = Vec::new();
    while back.len() < 4 {
        assert!(
            killed_at.elapsed() < Duration::from_secs(15),
            "the killed worker's rows came back: {} of 4",
            back.len()
        );
        back.extend(q.claim(4).await.unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waited = killed_at.elapsed();
    match mode {
        ClaimMode::Lease => assert!(
            waited >= Duration::from_millis(500),
            "a lease holds until it runs out ({waited:?})"
        ),
        _ => assert!(
            waited < Duration::from_secs(5),
            "rows come back at once, not after {waited:?}"
        ),
    }
    let expected = if mode == ClaimMode::RowLock { 1 } else { 2 };
    let mut seen: Vec<i64> = back.iter().map(|d| d.id()).collect();
    seen.sort_unstable();
    assert_eq!(seen, ids);
    for d in back {
        assert_eq!(d.attempt(), expected, "row {} after the kill", d.id());
        d.ack().await.unwrap();
    }
    for i in 0..4 {
        assert!(!D::key_is_held(&fx.broker, &format!("key-k{i}")).await);
    }
    let leaks = D::leaks(&fx.broker).await;
    assert!(leaks.is_empty(), "{leaks:?}");
    crate::report(&format!(
        "kill -9 {mode} on {}: 4 deliveries killed mid-handler, back after {:.1}s at attempt {expected}, no leaks",
        fx.broker.backend().capabilities().database,
        waited.as_secs_f64()
    ));
    fx.cleanup().await;
}

/// Killing the database connections under deliveries in work and under claims loses nothing:
/// the engine recovers, and the history checker passes. Backends without server connections
/// (SQLite) have nothing to kill.
pub async fn killed_connections_lose_nothing<D: TestDb>(mode: ClaimMode) {
    let Some(mut fx) = Fixture::<D>::new(mode, |b| {
        if mode == ClaimMode::Lease {
            b.lease_seconds(1)
        } else {
            b
        }
    })
    .await
    else {
        return;
    };
    let victim = D::connect(&fx.url).await;
    if D::kill_connections(&victim).await.is_none() {
        victim.close().await;
        fx.cleanup().await;
        return;
    }
    let q = victim.queue::<D::Job>(fx.table.clone()).await.unwrap();
    let helper = fx.other_queue().await;
    let ids = fx.publish(&q, 120).await;
    let history = Arc::new(History::default());
    let subscribe = |q: &Queue<D::B, D::Job>, index: usize| {
        let history = history.clone();
        q.subscribe(
            SubscribeOptions::new()
                .concurrency(4)
                .poll_interval(Duration::from_millis(50))
                .error_backoff(Duration::ZERO, Duration::ZERO),
            move |job| {
                let history = history.clone();
                Box::pin(async move {
                    let at = history.start(
                        index,
                        job.id(),
                        job.attempt(),
                        job.key().map(str::to_owned),
                        None,
                    );
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    let _ = job.payload().text();
                    history.finish(at, Recorded::Ack);
                    Ok(Outcome::Ack)
                })
            },
        )
        .expect("subscribe")
    };
    let s1 = subscribe(&q, 0);
    let mut terminated = 0;
    for target in [20, 50, 80] {
        wait_until(
            &format!("{target} rows handled"),
            Duration::from_secs(60),
            || {
                let h = history.clone();
                async move { h.finished_rows(None) >= target }
            },
        )
        .await;
        history.connections_killed();
        terminated += D::kill_connections(&victim).await.unwrap_or(0);
        // The kill lands some milliseconds after the first mark (the probe connects first): a
        // delivery that starts in between loses its connection too, so mark the end as well.
        history.connections_killed();
    }
    // A second broker drains what the victim cannot (a lost lease, a row it rolled back).
    let s2 = subscribe(&helper, 1);
    wait_until("every row handled", Duration::from_secs(60), || {
        let h = history.clone();
        async move { h.finished_rows(None) >= 120 }
    })
    .await;
    // A row whose ack died with its connection was put back: let it be delivered again.
    wait_until("the table to drain", Duration::from_secs(60), || {
        let helper = helper.clone();
        let ids = ids.clone();
        async move {
            for id in ids {
                if helper.row_state(id).await.unwrap().is_some() {
                    return false;
                }
            }
            true
        }
    })
    .await;
    s1.shutdown().await;
    s2.shutdown().await;
    let finals: BTreeMap<i64, Final> = ids.iter().map(|id| (*id, Final::Gone)).collect();
    let records = history.records();
    let expect = Expect {
        mode,
        fifo: false,
        max_attempts: None,
        finals,
    };
    if let Err(problems) = history.check(&expect) {
        panic!("the history check failed:\n{problems}");
    }
    assert!(terminated > 0, "some connections were terminated");
    victim.close().await;
    let leaks = D::leaks(&fx.broker).await;
    assert!(leaks.is_empty(), "{leaks:?}");
    crate::report(&format!(
        "killed connections {mode} on {}: {terminated} connections terminated, 120 rows in {} deliveries, history check passed, no leaks",
        fx.broker.backend().capabilities().database,
        records.len()
    ));
    fx.cleanup().await;
}

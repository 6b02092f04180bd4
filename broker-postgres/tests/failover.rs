//! A PostgreSQL primary with a synchronous standby (`.ci/pgfailover.sh`: ports 5440 and 5441,
//! folders under `SQLX_BROKER_PGFAILOVER_DIR`, default `/tmp/sqlx-broker-pgfailover`): brokers
//! given both hosts drain a table while the primary goes down (killed with SIGKILL, or stopped
//! cleanly with `pg_ctl stop -m fast`) and the standby is promoted; the history checker judges
//! the run (the lease run's table has FIFO groups, whose order the checker holds it to). One
//! run per claim mode, one after the other in one test (each starts the pair afresh
//! with the script, since the last one promoted the standby, and fails if it cannot).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use broker_core::{BoxError, ClaimMode, NewJob, Outcome, SubscribeOptions};
use broker_postgres::PgBackend;
use broker_testkit::history::{Expect, Final, History, Recorded};
use broker_testkit::{Job, JobText, describe, unique_name};

const PRIMARY: &str = "postgres://postgres@127.0.0.1:5440/test";
const STANDBY: &str = "postgres://postgres@127.0.0.1:5441/test";

fn dir() -> String {
    std::env::var("SQLX_BROKER_PGFAILOVER_DIR")
        .unwrap_or_else(|_| "/tmp/sqlx-broker-pgfailover".to_owned())
}

/// Runs `.ci/pgfailover.sh`: a fresh primary and synchronous standby.
fn start_pair() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/pgfailover.sh");
    let status = std::process::Command::new("bash")
        .arg(script)
        .status()
        .expect("run .ci/pgfailover.sh");
    assert!(
        status.success(),
        ".ci/pgfailover.sh could not start the pair"
    );
}

fn postmaster_pid(node: &str) -> String {
    let file = format!("{}/{node}/postmaster.pid", dir());
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("read {file}: {e}"))
        .lines()
        .next()
        .expect("a pid")
        .to_owned()
}

/// Rows drained per run: 3,000, or `SQLX_BROKER_FAILOVER_ROWS` (the stress size of issue #34 is
/// 10,000).
fn rows() -> usize {
    env_count("SQLX_BROKER_FAILOVER_ROWS", 3_000)
}

/// Brokers draining, 8 workers each: 2, or `SQLX_BROKER_FAILOVER_BROKERS`.
fn brokers() -> usize {
    env_count("SQLX_BROKER_FAILOVER_BROKERS", 2)
}

fn env_count(var: &str, default: usize) -> usize {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{var}={v:?}: give a whole number")),
        Err(_) => default,
    }
}

/// The FIFO group of row `i` of the lease run: two rows in three, in 32 groups.
fn group_of(i: usize) -> Option<String> {
    (!i.is_multiple_of(3)).then(|| format!("g{}", i % 32))
}

/// How the primary goes down.
#[derive(Debug, Clone, Copy)]
enum Down {
    /// SIGKILL to the postmaster: connections cut, nothing said to the clients.
    Kill,
    /// `pg_ctl stop -m fast`: sessions are terminated with an error, then the server stops.
    CleanStop,
}

fn pg_ctl() -> String {
    format!(
        "/usr/lib/postgresql/{}/bin/pg_ctl",
        std::fs::read_dir("/etc/postgresql")
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .file_name()
            .to_string_lossy()
    )
}

fn take_primary_down(down: Down) {
    let status = match down {
        Down::Kill => std::process::Command::new("kill")
            .args(["-9", &postmaster_pid("primary")])
            .status(),
        Down::CleanStop => std::process::Command::new("runuser")
            .args(["-u", "postgres", "--", &pg_ctl()])
            .args([
                "-D",
                &format!("{}/primary", dir()),
                "-m",
                "fast",
                "-w",
                "stop",
            ])
            .status(),
    }
    .expect("take the primary down");
    assert!(status.success(), "take the primary down ({down:?})");
}

/// After the failover, a row published through `publisher` wakes a subscription of
/// `subscriber` (another broker) at once, though its poll is 30 s away: the listening
/// connection listens on the new primary.
async fn wake_ups_follow_the_move(
    publisher: &broker_core::Broker<PgBackend>,
    subscriber: &broker_core::Broker<PgBackend>,
    name: &str,
) {
    let table = describe(&format!("{name}_wake"), ClaimMode::Lease)
        .build()
        .unwrap();
    publisher.create_tables(&table).await.unwrap();
    let (tx, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let sub = subscriber
        .queue::<Job>(table.clone())
        .await
        .unwrap()
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_secs(30)),
            move |job: broker_core::Job<Job>| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(job.id());
                    Ok::<_, BoxError>(Outcome::Ack)
                }
            },
        )
        .unwrap();
    // Longer than the listening connection waits between connects, so the wake-up of its
    // reconnect is over: only a notification can wake the subscription now.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let id = publisher
        .queue::<Job>(table.clone())
        .await
        .unwrap()
        .publish(NewJob::new("wake"))
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), heard.recv()).await;
    assert_eq!(
        got.ok().flatten(),
        Some(id),
        "a row published on the promoted primary did not wake a subscription whose poll is 30 s \
         away: LISTEN was not re-established there"
    );
    sub.shutdown().await;
    publisher.drop_tables(&table).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn brokers_follow_a_promoted_standby_and_lose_no_row() {
    // Lease with the primary killed, as a crash does; row lock with a clean stop (its
    // transactions are ended by the server, so each row in work must roll back and come back);
    // advisory killed (the keys' sessions die with the server).
    drain_through_failover(ClaimMode::Lease, Down::Kill).await;
    drain_through_failover(ClaimMode::RowLock, Down::CleanStop).await;
    drain_through_failover(ClaimMode::Advisory, Down::Kill).await;
}

async fn drain_through_failover(mode: ClaimMode, down: Down) {
    tokio::task::spawn_blocking(start_pair).await.unwrap();
    let urls = [PRIMARY, STANDBY];
    let name = unique_name("failover");
    // The lease run's table has FIFO groups: the order of each group must hold through the
    // failover too.
    let fifo = mode == ClaimMode::Lease;
    let mut builder = describe(&name, mode);
    if mode == ClaimMode::Lease {
        builder = builder.lease_seconds(2).group("grp").fifo(true);
    }
    let table = builder.build().unwrap();
    let (rows, broker_count) = (rows(), brokers());
    let first = PgBackend::connect_primary(&urls, 4).await.unwrap();
    first.create_tables(&table).await.unwrap();
    let queue = first.queue::<Job>(table.clone()).await.unwrap();
    let mut ids = Vec::with_capacity(rows);
    for chunk in (0..rows).collect::<Vec<_>>().chunks(500) {
        let jobs: Vec<_> = chunk
            .iter()
            .map(|i| {
                let job = NewJob::new(format!("job-{i}"));
                if mode == ClaimMode::Advisory {
                    job.column("k", format!("k{i}"))
                } else if let Some(group) = group_of(*i).filter(|_| fifo) {
                    job.group(group)
                } else {
                    job
                }
            })
            .collect();
        ids.extend(queue.publish_batch(&jobs).await.unwrap());
    }
    let history = Arc::new(History::new(&name));
    let mut brokers = Vec::new();
    for index in 0..broker_count {
        let broker = PgBackend::connect_primary(&urls, 12).await.unwrap();
        let q = broker.queue::<Job>(table.clone()).await.unwrap();
        let h = history.clone();
        let sub = q
            .subscribe(
                SubscribeOptions::new()
                    .name(History::subscription_name(index))
                    .concurrency(8)
                    .poll_interval(Duration::from_millis(200))
                    .error_backoff(Duration::from_millis(100), Duration::from_secs(1)),
                move |job: broker_core::Job<Job>| {
                    let h = h.clone();
                    async move {
                        let i: usize = job.payload().text()["job-".len()..]
                            .parse()
                            .expect("a payload this test wrote");
                        let at = h.start(
                            index,
                            job.id(),
                            job.attempt(),
                            job.key().map(str::to_owned),
                            group_of(i).filter(|_| fifo),
                            job.lease_expires_ms(),
                        );
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        h.finish(at, Recorded::Ack);
                        Ok::<_, BoxError>(Outcome::Ack)
                    }
                },
            )
            .expect("subscribe");
        brokers.push((broker, q, sub));
    }
    let started = Instant::now();
    // Generous for a loaded 2-core machine: about 25 rows a second at the least.
    let limit = Duration::from_secs(240.max(rows as u64 / 25));
    while history.finished_rows(None) < rows / 4 {
        assert!(started.elapsed() < limit, "no progress before the failover");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The primary goes down; the standby is promoted two seconds later.
    let from = history.now();
    let down_at = Instant::now();
    tokio::task::spawn_blocking(move || take_primary_down(down))
        .await
        .unwrap();
    let before = history.records().len();
    tokio::time::sleep(Duration::from_secs(2).saturating_sub(down_at.elapsed())).await;
    let unhealthy: Vec<bool> = brokers
        .iter()
        .map(|(_, _, s)| !s.health().is_healthy())
        .collect();
    let promoted = std::process::Command::new("runuser")
        .args(["-u", "postgres", "--", &pg_ctl()])
        .args(["-D", &format!("{}/standby", dir()), "-w", "promote"])
        .status()
        .expect("promote the standby");
    assert!(promoted.success(), "promote the standby");
    let promoted_at = history.now();
    // Claims resume: a claim that returned after the promotion starts a handler (rows fetched
    // ahead before the primary went down do not count).
    let resumed = loop {
        let records = history.records();
        if records[before..]
            .iter()
            .any(|r| r.claim.is_some_and(|c| c.returned > promoted_at))
        {
            break down_at.elapsed();
        }
        assert!(
            down_at.elapsed() < Duration::from_secs(60),
            "{mode:?}: no claim resumed within 60 s of the primary going down ({down:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for b in 0..broker_count {
        history.connections_killed(b, from, history.now());
    }
    // Done when every row is gone.
    let q2 = brokers[0].1.clone();
    loop {
        let left = q2
            .stats()
            .await
            .map(|s| s.due.rows + s.in_work.rows + s.scheduled.rows);
        if matches!(left, Ok(0)) {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "{mode:?}: gave up after {limit:?}: {} of {rows} rows finished ({left:?} left)",
            history.finished_rows(None)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if mode == ClaimMode::Lease {
        wake_ups_follow_the_move(&first, &brokers[0].0, &name).await;
    }
    let mut per_broker = Vec::new();
    let mut shutdowns = Vec::new();
    for (broker, q, sub) in brokers {
        let stopping = Instant::now();
        let report = sub.shutdown().await;
        shutdowns.push(format!("{:.2}s", stopping.elapsed().as_secs_f64()));
        let m = q.metrics();
        per_broker.push(format!(
            "claimed {}, acked {}, lease lost {}, settle failed {}, claim errors {}, gone {}; {report:?}",
            m.claimed, m.acked, m.lease_lost, m.settle_failed, m.claim_errors, m.gone
        ));
        broker.close().await;
    }
    let mut finals = BTreeMap::new();
    for id in &ids {
        let state = queue.row_state(*id).await.unwrap();
        finals.insert(
            *id,
            if state.is_none() {
                Final::Gone
            } else {
                Final::Present
            },
        );
    }
    let expect = Expect {
        mode,
        fifo,
        max_attempts: table.max_attempts(),
        finals,
    };
    let figures = history.check(&expect).unwrap_or_else(|problems| {
        panic!("{mode:?}: the history check failed:\n{problems}\nper broker: {per_broker:?}")
    });
    assert_eq!(
        figures.acked, rows,
        "{mode:?}: every row acked once the run ends"
    );
    broker_testkit::report(&format!(
        "postgres failover ({mode:?}, primary {down:?}): {} brokers, {} rows, {} deliveries; standby promoted 2 s after; claims resumed {:.1}s after the primary went down; unhealthy at 2 s: {unhealthy:?}; shutdowns took {shutdowns:?}; per broker: {}",
        broker_count,
        figures.rows,
        figures.deliveries,
        resumed.as_secs_f64(),
        per_broker.join(" | ")
    ));
    first.drop_tables(&table).await.unwrap();
    first.close().await;
}

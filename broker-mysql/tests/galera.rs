//! A three-node MariaDB Galera cluster with brokers on every node (`SQLX_BROKER_GALERA_URLS`,
//! comma-separated, default the three nodes `.ci/galera.sh` starts on ports 3311-3313; the
//! tests run that script when nothing answers at the defaults, and fail if the cluster does not
//! come up). What holds there is in the crate's `galera` module docs: lease mode, with FIFO
//! groups; row lock and advisory mode are refused at prepare.
//!
//! The drain case kills a node (SIGKILL of its `mariadbd`) under its broker and starts it
//! again, so it needs the cluster `.ci/galera.sh` started (it reads the node's pid file); on a
//! cluster given by `SQLX_BROKER_GALERA_URLS` it drains without the kill and reports that.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use broker_core::{
    BoxError, ClaimMode, ColumnType, DeadLetter, DoctorOptions, NewJob, Outcome, SqlxBrokerError,
    Status, SubscribeOptions, TableDescription,
};
use broker_mysql::{MySqlBackend, MySqlBroker};
use broker_testkit::history::{Expect, Final, History, Recorded};
use broker_testkit::{Job, JobText, unique_name};
use sqlx::mysql::MySqlPoolOptions;

fn node_urls() -> Vec<String> {
    std::env::var("SQLX_BROKER_GALERA_URLS")
        .unwrap_or_else(|_| {
            (1..=3)
                .map(|n| format!("mysql://root@127.0.0.1:331{n}/test"))
                .collect::<Vec<_>>()
                .join(",")
        })
        .split(',')
        .map(str::to_owned)
        .collect()
}

fn galera_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/galera.sh")
}

/// Runs `.ci/galera.sh`, which starts the nodes that are down and waits until the cluster has
/// three synced nodes.
fn start_cluster() {
    let status = std::process::Command::new("bash")
        .arg(galera_script())
        .status()
        .expect("run .ci/galera.sh");
    assert!(
        status.success(),
        ".ci/galera.sh could not start the Galera cluster ({status}; its output is above): it \
         needs root, galera-4 and rsync (as root: apt-get install -y galera-4 rsync), or set \
         SQLX_BROKER_GALERA_URLS to a cluster of three nodes"
    );
}

/// A broker on `url` with a pool of 12 and a short acquire timeout (a dead node's broker must
/// not wait out the default 30 s per claim).
async fn connect(url: &str) -> MySqlBroker {
    let options = MySqlBackend::connect_options(url).expect("a MySQL URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("the Galera node at {url} is unreachable: {e}"));
    broker_core::Broker::new(MySqlBackend::new(pool))
}

/// Every node's URL, once the cluster answers (started by the script when nothing answers at
/// the default URLs).
async fn nodes() -> Vec<String> {
    static STARTED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    let urls = node_urls();
    STARTED
        .get_or_init(|| async {
            let answers = |url: String| async move {
                let options = MySqlBackend::connect_options(&url).expect("a MySQL URL");
                MySqlPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(Duration::from_secs(2))
                    .connect_with(options)
                    .await
                    .is_ok()
            };
            let mut all = true;
            for url in &urls {
                all &= answers(url.clone()).await;
            }
            if !all && std::env::var("SQLX_BROKER_GALERA_URLS").is_err() {
                tokio::task::spawn_blocking(start_cluster).await.unwrap();
            }
        })
        .await;
    urls
}

/// The drain case kills node 3 and starts it again: it holds the cluster alone (write), and the
/// other cases, which need every node up, share it (read). Without this, a claim of the race
/// case on node 3 failed with "WSREP has not yet prepared node for application use".
static CLUSTER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn lease_table(name: &str, dead: &str) -> TableDescription {
    TableDescription::builder(name)
        .payload("payload", ColumnType::Text)
        .due_at("due_at")
        .group("grp")
        .fifo(true)
        .max_attempts(4)
        .dead_letter(DeadLetter::Table(dead.to_owned()))
        .locked_until("locked_until")
        .lease_seconds(2)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn row_lock_and_advisory_are_refused_with_what_to_use_and_lease_is_prepared() {
    let urls = nodes().await;
    let _shared = CLUSTER.read().await;
    let broker = connect(&urls[0]).await;
    let name = unique_name("galera_modes");
    let base = || {
        TableDescription::builder(&name)
            .payload("payload", ColumnType::Text)
            .column("k", ColumnType::Text)
    };
    let row_lock = base().build().unwrap();
    let advisory = base().advisory_lock("key-{k}").build().unwrap();
    let lease = base().locked_until("locked_until").build().unwrap();
    broker.create_tables(&lease).await.unwrap();
    for (table, says) in [
        (&row_lock, "FOR UPDATE SKIP LOCKED"),
        (&advisory, "GET_LOCK"),
    ] {
        let err = broker
            .queue::<Job>(table.clone())
            .await
            .err()
            .unwrap_or_else(|| panic!("{:?} mode was prepared on a Galera node", table.mode()));
        let text = err.to_string();
        assert!(
            matches!(err, SqlxBrokerError::Unsupported { .. }),
            "{:?}: {err:?}",
            table.mode()
        );
        for part in ["Galera node", "-node cluster", says, "lease mode"] {
            assert!(text.contains(part), "{:?}: {text}", table.mode());
        }
    }
    // The doctor names the node and says which modes hold.
    for (table, status) in [
        (&row_lock, Status::Fail),
        (&advisory, Status::Fail),
        (&lease, Status::Pass),
    ] {
        let report = broker.doctor(table, &DoctorOptions::new()).await;
        let check = report
            .check("cluster")
            .unwrap_or_else(|| panic!("no cluster check:\n{report}"));
        assert_eq!(check.status, status, "{:?}:\n{report}", table.mode());
        assert!(check.found.contains("Galera node"), "{report}");
    }
    let q = broker
        .queue::<Job>(lease.clone())
        .await
        .expect("lease holds on Galera");
    q.publish(NewJob::new("one".to_owned()).column("k", "a".to_owned()))
        .await
        .unwrap();
    broker.drop_tables(&lease).await.unwrap();
    broker.close().await;
}

/// Brokers on all three nodes claim the heads of one FIFO table at the same time, again and
/// again, and ack what they get: a row is handed to one claim per attempt. Each node's locking
/// read sees what that node has applied, so two nodes can both read a row as free; the claim's
/// update re-checks the row as it is, and the cluster's certification refuses the later of two
/// writes to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_on_three_nodes_never_hand_out_one_row_twice() {
    const ROWS: usize = 6_000;
    let urls = nodes().await;
    let _shared = CLUSTER.read().await;
    let name = unique_name("galera_race");
    let dead = format!("{name}_dead");
    let table = lease_table(&name, &dead);
    let first = connect(&urls[0]).await;
    first.create_tables(&table).await.unwrap();
    let queue = first.queue::<Job>(table.clone()).await.unwrap();
    for chunk in (0..ROWS).collect::<Vec<_>>().chunks(500) {
        let jobs: Vec<_> = chunk
            .iter()
            .map(|i| NewJob::new(format!("job-{i}")).group(format!("g{}", i % 61)))
            .collect();
        queue.publish_batch(&jobs).await.unwrap();
    }
    let mut tasks = Vec::new();
    // Two claimers per node.
    for url in urls.iter().take(3).chain(urls.iter().take(3)) {
        let broker = connect(url).await;
        let q = broker.queue::<Job>(table.clone()).await.unwrap();
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            let (mut empty, mut lost) = (0, 0);
            while empty < 50 {
                match q.claim(4).await {
                    Ok(ds) if ds.is_empty() => {
                        empty += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Ok(ds) => {
                        empty = 0;
                        for d in ds {
                            got.push((d.id(), d.attempt()));
                            // A refused ack (the row was another claim's) leaves it to run out.
                            let _ = d.ack().await;
                        }
                    }
                    // A claim that lost certification three times in a row: the rows are
                    // there, claim again (as a subscription does).
                    Err(e) if broker_mysql::is_transient(&e) => lost += 1,
                    Err(e) => panic!("claim: {e}"),
                }
            }
            broker.close().await;
            (got, lost)
        }));
    }
    let mut seen = std::collections::HashMap::new();
    let mut per_node = Vec::new();
    for t in tasks {
        let (got, lost) = t.await.unwrap();
        per_node.push((got.len(), lost));
        for d in got {
            *seen.entry(d).or_insert(0) += 1;
        }
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "(row, attempt) handed to two claims: {:?} (deliveries, conflicts per claimer: {per_node:?})",
        twice.iter().take(10).collect::<Vec<_>>()
    );
    broker_testkit::report(&format!(
        "galera claim race: {} deliveries of {ROWS} FIFO rows across three nodes, none twice; deliveries and claim conflicts per claimer {per_node:?}",
        seen.len()
    ));
    first.drop_tables(&table).await.unwrap();
    first.close().await;
}

/// The pid of a node's `mariadbd`, from the pid file `.ci/galera.sh` has it write.
fn node_pid(node: usize) -> i32 {
    let dir = std::env::var("SQLX_BROKER_GALERA_DIR")
        .unwrap_or_else(|_| "/tmp/sqlx-broker-galera".to_owned());
    let file = format!("{dir}/node{node}/mariadbd.pid");
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("read {file} (a cluster .ci/galera.sh started): {e}"))
        .trim()
        .parse()
        .expect("a pid")
}

/// Waits until the node at `url` counts `size` nodes in its cluster (`wsrep_cluster_size`),
/// asking every 100 ms for at most `limit`.
async fn wait_for_cluster_size(url: &str, size: u32, limit: Duration) {
    let options = MySqlBackend::connect_options(url).expect("a MySQL URL");
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("the Galera node at {url} is unreachable: {e}"));
    let started = Instant::now();
    loop {
        let found: Option<(String, String)> =
            sqlx::query_as("SHOW STATUS LIKE 'wsrep_cluster_size'")
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten();
        let n = found.and_then(|(_, v)| v.parse::<u32>().ok());
        if n == Some(size) {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "the node at {url} still counts {n:?} nodes, not {size}, after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    pool.close().await;
}

const ROWS: usize = 10_000;
const WORKERS: usize = 8;

/// Four brokers (on nodes 1, 2, 3, 1), eight workers each, drain 10,000 rows of a FIFO lease
/// table with mostly acks and some retries, errors and dead letters, handlers of 1-3 ms; a
/// quarter of the way in, node 3 is killed under its broker (SIGKILL) and started again. The
/// history checker then checks every delivery (those of node 3's broker while it was down as
/// cut), and the counters must be truthful: no ack counted for a row its delete did not remove.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_brokers_on_every_node_run_each_row_once_through_a_node_kill() {
    let urls = nodes().await;
    let _alone = CLUSTER.write().await;
    assert!(urls.len() >= 3, "three Galera nodes are needed: {urls:?}");
    let name = unique_name("galera");
    let dead = format!("{name}_dead");
    let table = lease_table(&name, &dead);
    let first = connect(&urls[0]).await;
    first.create_tables(&table).await.unwrap();
    let audit = std::env::var("SQLX_BROKER_GALERA_AUDIT").is_ok();
    if audit {
        // Every change of a row's attempt or lease, with the node and session that made it.
        use sqlx::Executor;
        let pool = first.pool();
        pool.execute(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE `{name}_audit` (n BIGINT AUTO_INCREMENT PRIMARY KEY, id BIGINT, \
             old_attempt INT, new_attempt INT, old_lu DATETIME(6), new_lu DATETIME(6), \
             node VARCHAR(20), conn BIGINT, at DATETIME(6), what VARCHAR(10))"
        )))
        .await
        .unwrap();
        pool.execute(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER `{name}_au` AFTER UPDATE ON `{name}` FOR EACH ROW \
             INSERT INTO `{name}_audit` (id, old_attempt, new_attempt, old_lu, new_lu, node, conn, at, what) \
             VALUES (NEW.id, OLD.attempt, NEW.attempt, OLD.locked_until, NEW.locked_until, \
             @@wsrep_node_name, CONNECTION_ID(), NOW(6), 'update')"
        )))
        .await
        .unwrap();
        pool.execute(sqlx::AssertSqlSafe(format!(
            "CREATE TRIGGER `{name}_ad` AFTER DELETE ON `{name}` FOR EACH ROW \
             INSERT INTO `{name}_audit` (id, old_attempt, old_lu, node, conn, at, what) \
             VALUES (OLD.id, OLD.attempt, OLD.locked_until, @@wsrep_node_name, CONNECTION_ID(), NOW(6), 'delete')"
        )))
        .await
        .unwrap();
    }
    let queue = first.queue::<Job>(table.clone()).await.unwrap();
    let mut ids = Vec::with_capacity(ROWS);
    for chunk in (0..ROWS).collect::<Vec<_>>().chunks(500) {
        let jobs: Vec<_> = chunk
            .iter()
            .map(|i| {
                let job = NewJob::new(format!("job-{i}"));
                match i % 3 {
                    0 => job,
                    _ => job.group(format!("g{}", i % 61)),
                }
            })
            .collect();
        ids.extend(queue.publish_batch(&jobs).await.unwrap());
    }
    let history = Arc::new(History::new(&name));
    // Four brokers: nodes 1, 2, 3 and 1 again.
    let on_node = [0, 1, 2, 0];
    let mut brokers = Vec::new();
    for (index, node) in on_node.iter().enumerate() {
        let broker = connect(&urls[*node]).await;
        let q = broker.queue::<Job>(table.clone()).await.unwrap();
        let h = history.clone();
        let sub = q
            .subscribe(
                SubscribeOptions::new()
                    .name(History::subscription_name(index))
                    .concurrency(WORKERS)
                    .poll_interval(Duration::from_millis(100))
                    .error_backoff(Duration::from_millis(50), Duration::from_secs(1)),
                move |job: broker_core::Job<Job>| {
                    let h = h.clone();
                    async move {
                        let i: usize = job.payload().text()["job-".len()..].parse()?;
                        let group = (!i.is_multiple_of(3)).then(|| format!("g{}", i % 61));
                        let at = h.start(
                            index,
                            job.id(),
                            job.attempt(),
                            None,
                            group,
                            job.lease_expires_ms(),
                        );
                        let roll =
                            (job.id().unsigned_abs() * 7 + job.attempt().unsigned_abs() * 13) % 100;
                        tokio::time::sleep(Duration::from_millis(1 + roll % 3)).await;
                        let (recorded, out): (Recorded, Result<Outcome, BoxError>) = match roll {
                            0..85 => (Recorded::Ack, Ok(Outcome::Ack)),
                            85..92 => (Recorded::Retry, Ok(Outcome::Retry)),
                            92..97 => (Recorded::Error, Err("a handler error".into())),
                            _ => (Recorded::DeadLetter, Ok(Outcome::DeadLetter)),
                        };
                        h.finish(at, recorded);
                        out
                    }
                },
            )
            .expect("subscribe");
        brokers.push((broker, q, sub));
    }
    let started = Instant::now();
    let limit = Duration::from_secs(300);
    // A quarter of the way in, node 3 dies under broker 2 and comes back.
    let max_attempts = table.max_attempts();
    // Only a node of the cluster `.ci/galera.sh` started is killed (and started again with it):
    // a cluster given by SQLX_BROKER_GALERA_URLS is the user's, and its nodes are not ours to
    // kill. The drain then runs without the kill and says so.
    let own_cluster = std::env::var_os("SQLX_BROKER_GALERA_URLS").is_none();
    let kill = std::env::var("SQLX_BROKER_GALERA_NO_KILL").is_err() && own_cluster;
    if !own_cluster {
        broker_testkit::report_not_run(
            "galera lease: the node kill: the cluster at SQLX_BROKER_GALERA_URLS is not one .ci/galera.sh started; unset it to let the tests start their own and kill a node of it",
        );
    }
    while kill && history.finished_rows(max_attempts) < ROWS / 4 {
        assert!(started.elapsed() < limit, "no progress on the cluster");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let from = history.now();
    let pid = if kill { node_pid(3) } else { 0 };
    let mut back_after = Duration::ZERO;
    if kill {
        let killed = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill node 3");
        assert!(killed.success(), "SIGKILL node 3 (pid {pid})");
        let down = Instant::now();
        // Node 3 comes back once nodes 1 and 2 have left it out of their view. Started while
        // they still counted it (3 s after the kill, inside their 5 s suspect timeout), its
        // return was seen to take them out of the primary component for about two seconds:
        // every broker's settlements failed then, on nodes the fault was not injected on.
        for url in &urls[..2] {
            wait_for_cluster_size(url, 2, limit).await;
        }
        tokio::task::spawn_blocking(start_cluster).await.unwrap();
        back_after = down.elapsed();
    }
    let cut = history.connections_killed(2, from, history.now());
    // Done when every row has finished by the database's account.
    loop {
        let unfinished = history.unfinished_rows(&ids, max_attempts);
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
        assert!(
            started.elapsed() < limit,
            "gave up after {limit:?}: {} of {ROWS} rows finished",
            history.finished_rows(max_attempts)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    let mut per_broker = Vec::new();
    let mut acked = 0;
    for (broker, q, sub) in brokers {
        let report = sub.shutdown().await;
        assert_eq!(report.dropped, 0, "{report:?}");
        let m = q.metrics();
        acked += m.acked;
        per_broker.push(format!(
            "claimed {}, acked {}, conflicts {}, claim errors {}, settle failed {}, lease lost {}, gone {}",
            m.claimed, m.acked, m.claim_conflicts, m.claim_errors, m.settle_failed, m.lease_lost, m.gone
        ));
        broker.close().await;
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
    let gone = finals.values().filter(|f| **f == Final::Gone).count() as u64;
    let expect = Expect {
        mode: ClaimMode::Lease,
        fifo: true,
        max_attempts,
        finals,
    };
    let figures = history.check(&expect).unwrap_or_else(|problems| {
        if audit {
            let ids: Vec<String> = problems
                .lines()
                .filter_map(|l| l.strip_prefix("row "))
                .filter_map(|l| l.split([':', ' ']).next())
                .take(4)
                .map(str::to_owned)
                .collect();
            eprintln!("audit of rows {ids:?} in `{name}_audit` (kept)");
        }
        panic!(
            "the history check failed:\n{problems}\nper broker (nodes 1, 2, 3, 1): {per_broker:?}"
        )
    });
    assert!(
        acked <= gone,
        "the brokers counted {acked} acks for {gone} rows their deletes removed: {per_broker:?}"
    );
    broker_testkit::report(&format!(
        "galera lease: {} rows, {} deliveries, {} acked, {} dead-lettered; node 3 killed under broker 2 ({cut} cut), back after {:.1}s; per broker (nodes 1, 2, 3, 1): {}; {:.1}s",
        figures.rows,
        figures.deliveries,
        figures.acked,
        figures.dead,
        back_after.as_secs_f64(),
        per_broker.join(" | "),
        elapsed.as_secs_f64(),
    ));
    first.drop_tables(&table).await.unwrap();
    first.close().await;
}

//! The stress run: brokers in this process and in child processes drain a table with random
//! outcomes while child processes are killed with SIGKILL mid-work and (on server databases) the
//! connections of the brokers in this process are terminated; the history checker then proves
//! SPEC section 10 on the run, knowing exactly which deliveries each fault reached.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_core::{
    Backend, BoxError, Broker, ClaimMode, DeadLetter, NewJob, Outcome, Queue, SubscribeOptions,
    Subscription, TableDescription,
};

use super::faults::{CHILD_ENV, spawn_child};
use crate::engine_events;
use crate::history::{Expect, Final, History, Marked, Recorded, unix_micros};
use crate::{JobText, TestDb, unique_name, wait_until};

/// Rows per stress run (`SQLX_BROKER_STRESS_ROWS`, default 4,000: each run now also starts and
/// kills child processes and waits out the leases they held, on a 2-core machine).
pub fn stress_rows() -> usize {
    std::env::var("SQLX_BROKER_STRESS_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4_000)
}

/// Deliveries in work at once per broker.
const CONCURRENCY: usize = 8;

/// Child processes killed per run.
const CRASHES: usize = 3;

/// A small deterministic hash, so a row's outcomes repeat from run to run.
fn mix(id: i64, attempt: i64) -> u64 {
    let mut x = id.cast_unsigned().wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ attempt.cast_unsigned().wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

/// The FIFO group of row number `i`: two rows in three belong to one of 61 groups, the third to
/// none (rows without a group are not ordered).
fn group_of(i: usize) -> Option<String> {
    (!i.is_multiple_of(3)).then(|| format!("g{}", i % 61))
}

fn stress_table(name: &str, mode: ClaimMode, dead: &str) -> TableDescription {
    let b = TableDescription::builder(name)
        .payload("payload", broker_core::ColumnType::Text)
        .due_at("due_at")
        .group("grp")
        .fifo(true)
        .max_attempts(4)
        .snoozes("snoozes")
        .dead_letter(DeadLetter::Table(dead.to_owned()));
    match mode {
        ClaimMode::RowLock => b,
        ClaimMode::Lease => b.locked_until("locked_until").lease_seconds(2),
        ClaimMode::Advisory => b
            .column("k", broker_core::ColumnType::Text)
            .advisory_lock("key-{k}"),
        other => panic!("the suite has no case for claim mode {other:?}"),
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

/// Where a stress broker's handlers record their deliveries: the shared history (a broker in
/// this process), or stdout lines the parent reads (a broker in a child process).
#[derive(Clone)]
enum Sink {
    History(Arc<History>),
    Stdout(Arc<AtomicUsize>),
}

/// The line a child prints when a handler starts: `@@S <n> <id> <attempt> <key> <group>
/// <lease expiry ms> <unix µs>`, `-` for what is missing.
const START: &str = "@@S ";
/// The line a child prints when a handler ends: `@@E <n> <outcome> <unix µs>`.
const END: &str = "@@E ";

impl Sink {
    fn start(
        &self,
        broker: usize,
        id: i64,
        attempt: i64,
        key: Option<&str>,
        group: Option<String>,
        lease: Option<i64>,
    ) -> usize {
        match self {
            Sink::History(h) => h.start(broker, id, attempt, key.map(str::to_owned), group, lease),
            Sink::Stdout(next) => {
                let n = next.fetch_add(1, Ordering::SeqCst);
                println!(
                    "{START}{n} {id} {attempt} {} {} {} {}",
                    key.unwrap_or("-"),
                    group.as_deref().unwrap_or("-"),
                    lease.map_or_else(|| "-".to_owned(), |l| l.to_string()),
                    unix_micros()
                );
                n
            }
        }
    }

    fn finish(&self, at: usize, outcome: Recorded) {
        match self {
            Sink::History(h) => h.finish(at, outcome),
            Sink::Stdout(_) => println!("{END}{at} {} {}", outcome.name(), unix_micros()),
        }
    }
}

/// The stress handlers' timeout: a hung one is signalled after this.
const STRESS_TIMEOUT: Duration = Duration::from_millis(300);

/// Records a timed-out delivery's end when its handler's future ends: returned on its signal,
/// or dropped by the engine after the grace.
struct TimedOutEnd(Sink, usize);

impl Drop for TimedOutEnd {
    fn drop(&mut self) {
        self.0.finish(self.1, Recorded::TimedOut);
    }
}

/// One broker of a stress run, with random (but per-delivery deterministic) outcomes: ack,
/// snooze, retry, delayed retry, error, panic, dead letter, and hung handlers that time out.
fn stress_worker<D: TestDb>(queue: &Queue<D::B, D::Job>, index: usize, sink: Sink) -> Subscription {
    queue
        .subscribe(
            SubscribeOptions::new()
                .name(History::subscription_name(index))
                .concurrency(CONCURRENCY)
                .batch_size(CONCURRENCY)
                .poll_interval(Duration::from_millis(100))
                .shutdown_timeout(Duration::from_secs(10))
                .error_backoff(Duration::ZERO, Duration::ZERO)
                .timeout(STRESS_TIMEOUT)
                .cancel_grace(Duration::from_millis(100)),
            move |job| {
                let sink = sink.clone();
                async move {
                    let i: usize = job.payload().text()["job-".len()..]
                        .parse()
                        .expect("a stress payload");
                    let at = sink.start(
                        index,
                        job.id(),
                        job.attempt(),
                        job.key(),
                        group_of(i),
                        job.lease_expires_ms(),
                    );
                    // A snooze leaves the attempt as it was, so the snoozes count too: the
                    // delivery after a snooze rolls again.
                    let snoozes = job.snoozes().unwrap_or(0);
                    let roll = mix(job.id(), job.attempt() + 1000 * snoozes) % 100;
                    // Some handlers take a moment, so faults find deliveries in work; in a child,
                    // which is killed only while it has a handler running, a longer one.
                    match roll % 5 {
                        0 if matches!(sink, Sink::Stdout(_)) => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        0 => tokio::time::sleep(Duration::from_millis(2)).await,
                        1 => tokio::task::yield_now().await,
                        _ => {}
                    }
                    let (recorded, result) = match roll {
                        // A row snoozes at most three times, so it cannot snooze for ever.
                        66..70 if snoozes < 3 => (
                            Recorded::Snooze,
                            Ok(Outcome::Snooze(Duration::from_millis(20))),
                        ),
                        0..70 => (Recorded::Ack, Ok::<_, BoxError>(Outcome::Ack)),
                        70..78 => (Recorded::Retry, Ok(Outcome::Retry)),
                        78..84 => (
                            Recorded::RetryAfter,
                            Ok(Outcome::RetryAfter(Duration::from_millis(20))),
                        ),
                        84..92 => (Recorded::Error, Err("a random handler error".into())),
                        92..96 => {
                            sink.finish(at, Recorded::Panic);
                            std::panic::panic_any(DELIBERATE_PANIC);
                        }
                        // Hung handlers: one ignores its cancel signal and is dropped after
                        // the grace, one returns on it; either way the delivery timed out, and
                        // ends (as the history records it) when its future does.
                        96 | 97 => {
                            let _ends = TimedOutEnd(sink.clone(), at);
                            if roll == 96 {
                                std::future::pending::<()>().await;
                            }
                            job.cancelled().await;
                            return Ok(Outcome::Ack);
                        }
                        _ => (Recorded::DeadLetter, Ok(Outcome::DeadLetter)),
                    };
                    sink.finish(at, recorded);
                    result
                }
            },
        )
        .expect("subscribe")
}

/// A stress broker in a child process: its reports go into the history as they come.
struct ChildBroker {
    index: usize,
    child: Child,
    reader: std::thread::JoinHandle<()>,
    /// The last lines the child wrote to stderr, to say why it stopped if it stops on its own.
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl ChildBroker {
    fn spawn(test_path: &str, spec: &str, index: usize, history: &Arc<History>) -> Self {
        let mut child = spawn_child(test_path, &format!("stress|{index}|{spec}"), Stdio::piped());
        let stdout = child.stdout.take().expect("the child's stdout is piped");
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let pipe = child.stderr.take().expect("the child's stderr is piped");
        let tail = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                // Backtrace frames would push the panic's message out of the tail.
                let t = line.trim_start();
                if t.starts_with("at ")
                    || t.split_once(": ")
                        .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
                {
                    continue;
                }
                let mut tail = tail.lock().unwrap();
                if tail.len() == 40 {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
        let history = history.clone();
        let reader = std::thread::spawn(move || {
            let mut local: HashMap<usize, usize> = HashMap::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest prints "test <name> ... " without a newline first: look anywhere.
                if let Some(at) = line.find(START) {
                    let f: Vec<&str> = line[at + START.len()..].split(' ').collect();
                    let opt = |s: &str| (s != "-").then(|| s.to_owned());
                    let n: usize = f[0].parse().expect("a start line");
                    let index_in_history = history.start_at(
                        history.at_unix_micros(f[6].parse().expect("a time")),
                        index,
                        f[1].parse().expect("an id"),
                        f[2].parse().expect("an attempt"),
                        opt(f[3]),
                        opt(f[4]),
                        opt(f[5]).map(|l| l.parse().expect("a lease expiry")),
                    );
                    local.insert(n, index_in_history);
                } else if engine_events::note_child_line(&line) {
                } else if let Some(at) = line.find(END) {
                    let f: Vec<&str> = line[at + END.len()..].split(' ').collect();
                    let n: usize = f[0].parse().expect("an end line");
                    let outcome = Recorded::from_name(f[1]).expect("an outcome");
                    history.finish_at(
                        local[&n],
                        outcome,
                        history.at_unix_micros(f[2].parse().expect("a time")),
                    );
                }
            }
        });
        Self {
            index,
            child,
            reader,
            stderr,
        }
    }

    /// Panics with the child's exit status and the end of its stderr if it has stopped on its
    /// own: a child that failed to start would otherwise only show as a wait that gives up.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("the child's status") {
            std::thread::sleep(Duration::from_millis(100));
            let tail: Vec<String> = self.stderr.lock().unwrap().iter().cloned().collect();
            panic!(
                "stress child {} stopped by itself ({status}); its stderr ends with:\n{}",
                self.index,
                tail.join("\n")
            );
        }
    }

    /// SIGKILLs the child and records the crash once all it reported is in: returns what the
    /// kill cut.
    fn kill(mut self, history: &History) -> Marked {
        let from = history.now();
        self.child.kill().expect("SIGKILL a stress child");
        let _ = self.child.wait();
        let to = history.now();
        self.reader.join().expect("the child's reader");
        history.process_killed(self.index, from, to)
    }
}

/// The child side of the stress run: a broker that runs [`stress_worker`] and reports on stdout
/// until it is killed.
async fn stress_child<D: TestDb>(spec: &str) {
    let mut parts = spec.splitn(5, '|');
    let (index, mode, table, dead, url) = (
        parts.next().unwrap().parse().unwrap(),
        crate::__private::mode(parts.next().unwrap()),
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    quiet_deliberate_panics();
    engine_events::install(true);
    let broker = D::connect(url).await;
    let queue = broker
        .queue::<D::Job>(stress_table(table, mode, dead))
        .await
        .expect("the stress child's queue");
    let _sub = stress_worker::<D>(&queue, index, Sink::Stdout(Arc::default()));
    // Killed long before this ends.
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// Brokers in this process and in child processes drain a table of [`stress_rows`] rows (a FIFO
/// table: two rows in three in groups) with random outcomes. Three times a child process is
/// killed with SIGKILL while it has deliveries in work, and on server databases the connections
/// of a broker in this process are terminated twice. Each fault reports how many deliveries it
/// cut, and the run fails if the faults cut none. The history checker then checks every
/// delivery no fault reached in full and the rest as their mode promises; the brokers in this
/// process, which did the work, must leak nothing; no advisory key stays held.
pub async fn stress_with_random_outcomes_and_kills<D: TestDb>(mode: ClaimMode, test_path: &str) {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let spec = spec.strip_prefix("stress|").expect("a stress child's spec");
        stress_child::<D>(spec).await;
        return;
    }
    let url = D::database().await;
    let first = D::connect(&url).await;
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
                let job = match group_of(*i) {
                    Some(g) => job.group(g),
                    None => job,
                };
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
    let history = Arc::new(History::new(&name));
    let start = Instant::now();
    // Keys held in one process are not seen by another: there, a child runs alone, and the
    // brokers of this process start once the last child is dead.
    let exclusive =
        mode == ClaimMode::Advisory && first.backend().capabilities().process_local_keys;
    let start_local = |local: &mut Vec<(Broker<D::B>, Subscription)>| {
        let (url, table, history) = (url.clone(), table.clone(), history.clone());
        let index = local.len();
        async move {
            let b = D::connect(&url).await;
            let q = b.queue::<D::Job>(table).await.unwrap();
            let s = stress_worker::<D>(&q, index, Sink::History(history));
            (b, s)
        }
    };
    let mut local: Vec<(Broker<D::B>, Subscription)> = Vec::new();
    if !exclusive {
        for _ in 0..2 {
            let started = start_local(&mut local).await;
            local.push(started);
        }
    }
    let mode_name = match mode {
        ClaimMode::RowLock => "row_lock",
        ClaimMode::Lease => "lease",
        ClaimMode::Advisory => "advisory",
        other => panic!("the suite has no case for claim mode {other:?}"),
    };
    let spec = format!("{mode_name}|{name}|{dead}|{url}");
    let limit = Duration::from_secs(120);
    let max_attempts = table.max_attempts();
    let mut next_child = 100;
    let mut child = Some(ChildBroker::spawn(test_path, &spec, next_child, &history));
    let mut cuts = Vec::new();
    let has_connections = D::kill_connections(&first).await.is_some();
    for round in 0..CRASHES {
        // Wait until the child has handlers in work, then kill it.
        let mut running = child.take().expect("a child runs between crashes");
        let index = running.index;
        let since = Instant::now();
        let mut drained = false;
        loop {
            running.assert_running();
            if history
                .records()
                .iter()
                .any(|r| r.broker == index && r.end.is_none())
            {
                break;
            }
            // The brokers of this process may finish every row before a child has one in
            // work (a fast engine on a quiet machine): the crashes left would cut nothing.
            if !exclusive && history.finished_rows(max_attempts) >= rows {
                drained = true;
                break;
            }
            assert!(
                since.elapsed() < limit,
                "gave up after {limit:?} waiting for stress child {index} to have deliveries in \
                 work; {} of {rows} rows finished",
                history.finished_rows(max_attempts)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if drained {
            cuts.push(format!(
                "child {index}: every row finished before it had one in work; crashes from \
                 round {round} on skipped"
            ));
            child = Some(running);
            break;
        }
        let cut = running.kill(&history);
        cuts.push(format!("SIGKILL child {index}: {cut} cut"));
        next_child += 1;
        if exclusive && round + 1 == CRASHES {
            for _ in 0..2 {
                let started = start_local(&mut local).await;
                local.push(started);
            }
            break;
        }
        child = Some(ChildBroker::spawn(test_path, &spec, next_child, &history));
        // Between crashes, terminate the connections of a broker in this process.
        if has_connections && round < 2 {
            let target = rows * (round + 1) / 4;
            wait_until(&format!("{target} rows finished"), limit, || {
                let h = history.clone();
                async move { h.finished_rows(max_attempts) >= target }
            })
            .await;
            let (b, _) = &local[round % 2];
            let from = history.now();
            let terminated = D::kill_connections(b).await.unwrap_or(0);
            let cut = history.connections_killed(round % 2, from, history.now());
            cuts.push(format!(
                "{terminated} connections of broker {} terminated: {cut} cut",
                round % 2
            ));
        }
    }
    // Done when every row has finished by the database's account; rows whose last delivery
    // finished (and was not cut) are taken at the handlers' word until the check.
    let mut polls = 0;
    loop {
        // Every unfinished row is looked up (the first still open ends the look): a run whose
        // kills cut hundreds of deliveries has hundreds of rows finished only by the database's
        // account.
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
        polls += 1;
        if polls > limit.as_millis() / 50 {
            let mut stuck = String::new();
            for id in unfinished.into_iter().take(20) {
                let state = queue.row_state(id).await.unwrap();
                let last = history.records().into_iter().rfind(|r| r.id == id);
                stuck.push_str(&format!("\n  row {id}: {state:?}, last delivery {last:?}"));
            }
            panic!(
                "gave up after {limit:?}: {} of {rows} rows finished; stuck rows:{stuck}",
                history.finished_rows(max_attempts)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = start.elapsed();
    if let Some(last) = child.take() {
        // The last child is killed too (its deliveries are then settled or cut, and checked).
        let cut = last.kill(&history);
        cuts.push(format!("SIGKILL child {next_child} at the end: {cut} cut"));
    }
    let mut leaks = Vec::new();
    for (b, s) in local.drain(..) {
        let report = s.shutdown().await;
        assert_eq!(report.dropped, 0, "{report:?}");
        leaks.extend(D::leaks(&b).await);
        b.close().await;
    }
    assert!(leaks.is_empty(), "leaks after the stress run: {leaks:?}");
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
        fifo: true,
        max_attempts: table.max_attempts(),
        finals,
    };
    let figures = match history.check(&expect) {
        Ok(f) => f,
        Err(problems) => {
            // The first problems, and the faults (listed last) that may explain them.
            let head: String = problems
                .lines()
                .enumerate()
                .filter(|(i, l)| *i < 60 || l.starts_with("fault: "))
                .map(|(_, l)| l)
                .collect::<Vec<_>>()
                .join("\n");
            panic!("the history check failed:\n{head}\nfaults: {cuts:?}");
        }
    };
    assert!(
        figures.cut > 0,
        "the faults of a stress run must cut deliveries: {cuts:?}"
    );
    assert!(
        figures.crashed > 0,
        "the SIGKILLs must cut deliveries: {cuts:?}"
    );
    assert!(
        figures.snoozes > 0,
        "a stress run snoozes rows, so the check sees snoozes spend no attempt"
    );
    if mode == ClaimMode::Advisory {
        for k in 0..97 {
            let key = format!("key-k{k}");
            assert!(!D::key_is_held(&first, &key).await, "{key} is still held");
        }
    }
    crate::report(&format!(
        "stress {mode} on {}: {} rows, {} deliveries, {} retries ({} timed out), {} snoozes, {} acked, {} dead-lettered, {} deliveries cut ({} in the handler, {} by SIGKILL), faults: {}; {:.1}s",
        first.backend().capabilities().database,
        figures.rows,
        figures.deliveries,
        figures.retries,
        figures.timed_out,
        figures.snoozes,
        figures.acked,
        figures.dead,
        figures.cut,
        figures.in_handler,
        figures.crashed,
        cuts.join("; "),
        elapsed.as_secs_f64(),
    ));
    first.drop_tables(&table).await.unwrap();
    first.close().await;
    D::drop_database(&url).await;
}

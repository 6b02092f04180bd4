//! Periodic schedules: every tick publishes exactly one row however many brokers run the
//! schedule, brokers that die and come back included; missed ticks follow the policy; bad
//! schedules are refused with a clear error.
//!
//! Runs are bounded loops that stop by themselves; nothing compares an elapsed time. The ticks
//! a broker *saw* are the ones it reports through `Scheduled::ticks` (published by it, or found
//! published).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use broker_core::{
    ClaimMode, JobState, Missed, NewJob, Outcome, Page, Queue, Schedule, Scheduled,
    SqlxBrokerError, SubscribeOptions, Tick,
};

use super::unique::keyed;
use crate::{Fixture, TestDb, unique_name, wait_until};

/// Every second.
const EVERY_SECOND: &str = "* * * * * *";

fn ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The job of a tick: its time in unix ms as the payload (and as the advisory key).
fn tick_job<D: TestDb>(mode: ClaimMode) -> impl Fn(SystemTime) -> NewJob<D::Text> + Send + Sync {
    move |t| {
        let payload = ms(t).to_string();
        let job = NewJob::new(D::Text::from(payload.clone()));
        if mode == ClaimMode::Advisory {
            job.column("k", payload)
        } else {
            job
        }
    }
}

/// What every broker saw, as (broker, tick).
type Seen = Arc<Mutex<Vec<(usize, Tick)>>>;

/// Starts `schedule` on `queue` and records what it sees under `who` until it stops.
async fn run<D: TestDb>(
    queue: &Queue<D::B, D::Job>,
    schedule: Schedule,
    mode: ClaimMode,
    who: usize,
    seen: &Seen,
) -> Scheduled {
    let handle = queue
        .schedule(schedule, tick_job::<D>(mode))
        .await
        .expect("start the schedule");
    let mut ticks = handle.ticks();
    let seen = seen.clone();
    tokio::spawn(async move {
        while let Ok(t) = ticks.recv().await {
            seen.lock().unwrap().push((who, t));
        }
    });
    handle
}

/// Every row of the queue, finished or not, as (id, payload).
async fn all_rows<D: TestDb>(q: &Queue<D::B, D::Job>) -> Vec<(i64, String)> {
    let mut out = Vec::new();
    for state in [
        JobState::Due,
        JobState::Scheduled,
        JobState::InWork,
        JobState::Finished,
        JobState::Dead,
    ] {
        let mut page = Page::first(Page::MAX);
        loop {
            let rows = q.jobs(state, page).await.expect("list rows");
            let Some(last) = rows.last().map(|j| j.id) else {
                break;
            };
            out.extend(
                rows.into_iter()
                    .map(|j| (j.id, j.payload.unwrap_or_default())),
            );
            page = Page::after(last, Page::MAX);
        }
    }
    out.sort_unstable();
    out
}

/// Checks the one-row-per-tick invariant: every row is a tick some broker published, no tick
/// has two rows or two publishers, and every tick any broker saw has its row. Returns how many
/// ticks were published.
fn check_one_row_per_tick(rows: &[(i64, String)], seen: &[(usize, Tick)]) -> usize {
    check_ticks(rows, seen, 0)
}

/// [`check_one_row_per_tick`], allowing up to `unreported` rows whose publisher never said so
/// (a process killed between its commit and its report).
fn check_ticks(rows: &[(i64, String)], seen: &[(usize, Tick)], unreported: usize) -> usize {
    let mut by_tick: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (id, payload) in rows {
        let tick: i64 = payload.parse().expect("a tick's payload is its time");
        by_tick.entry(tick).or_default().push(*id);
    }
    let twice: Vec<_> = by_tick.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(twice.is_empty(), "ticks with more than one row: {twice:?}");
    let mut publishers: BTreeMap<i64, Vec<(usize, i64)>> = BTreeMap::new();
    for (who, t) in seen {
        if let Some(id) = t.published {
            publishers.entry(t.at_ms).or_default().push((*who, id));
        }
        assert!(
            by_tick.contains_key(&t.at_ms),
            "broker {who} saw tick {} but it has no row",
            t.at_ms
        );
    }
    let mut silent = Vec::new();
    for (tick, ids) in &by_tick {
        let who = publishers.get(tick).cloned().unwrap_or_default();
        if who.is_empty() {
            silent.push((*tick, ids[0]));
            continue;
        }
        assert_eq!(
            who.len(),
            1,
            "tick {tick} (rows {ids:?}) must have exactly one publisher, had {who:?}"
        );
        assert_eq!(
            who[0].1, ids[0],
            "tick {tick}: the publisher's id is the row's"
        );
    }
    assert!(
        silent.len() <= unreported,
        "rows of ticks no process reported publishing: {silent:?}; sightings: {seen:?}"
    );
    by_tick.len()
}

/// Bad schedules are refused, each with an error naming what is wrong: an invalid cron
/// expression, an unknown time zone, a name too long, and a name registered with another
/// expression. The same schedule started twice is fine, and it is listed with its next tick.
pub async fn bad_schedules_are_refused_with_a_clear_error<D: TestDb>() {
    let err = Schedule::new("s", "every day at noon").unwrap_err();
    assert!(
        matches!(err, SqlxBrokerError::Schedule { .. })
            && err.to_string().contains("\"every day at noon\"")
            && err.to_string().contains("cron expression"),
        "{err}"
    );
    let err = Schedule::new("s", "61 * * * *").unwrap_err();
    assert!(err.to_string().contains("cron expression"), "{err}");
    let err = Schedule::new("s", "0 3 * * *")
        .unwrap()
        .time_zone("Mars/Olympus_Mons")
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("time zone \"Mars/Olympus_Mons\" is unknown"),
        "{err}"
    );
    let err = Schedule::new(
        "x".repeat(broker_core::MAX_SCHEDULE_NAME_CHARS + 1),
        "* * * * *",
    )
    .unwrap_err();
    assert!(err.to_string().contains("schedule name"), "{err}");

    let f = Fixture::<D>::new(ClaimMode::Lease, keyed).await;
    let q = f.queue().await;
    let name = unique_name("sched");
    let nightly = || {
        Schedule::new(&name, "0 3 * * *")
            .unwrap()
            .time_zone("Europe/Paris")
            .unwrap()
    };
    let first = q
        .schedule(nightly(), tick_job::<D>(ClaimMode::Lease))
        .await
        .expect("register");
    let again = q
        .schedule(nightly(), tick_job::<D>(ClaimMode::Lease))
        .await
        .expect("the same schedule twice is fine");
    let err = q
        .schedule(
            Schedule::new(&name, "0 4 * * *").unwrap(),
            tick_job::<D>(ClaimMode::Lease),
        )
        .await
        .expect_err("a name used with another expression");
    let msg = err.to_string();
    assert!(
        msg.contains("registered already")
            && msg.contains("0 3 * * *")
            && msg.contains("0 4 * * *"),
        "{msg}"
    );
    let listed = f.broker.schedules().await.expect("list schedules");
    let row = listed
        .iter()
        .find(|s| s.name == name)
        .expect("the schedule is listed");
    let now = broker_core::driver::clock::now_ms();
    let next = row.next_tick_ms(now).expect("a next tick");
    assert!(next > now && next - now <= 86_400_000 + 3_600_000, "{next}");
    let stats = q.stats().await.expect("stats");
    assert!(stats.schedules.iter().any(|s| s.name == name), "{stats:?}");
    first.stop().await;
    again.stop().await;
    f.cleanup().await;
}

/// Four brokers run one every-second schedule for 30 s; one is killed (its connections
/// terminated by the server where the database has any, its schedule and pool dropped without
/// a word) and restarted mid-run; a subscription acks the rows as they come. Every tick any
/// broker saw has exactly one row, no tick has two, and each row's publisher is unique.
pub async fn four_brokers_on_one_schedule_publish_each_tick_once_with_one_killed_and_restarted<
    D: TestDb,
>() {
    let mode = ClaimMode::Lease;
    let f = Fixture::<D>::new(mode, keyed).await;
    let name = unique_name("every_second");
    let schedule = || Schedule::new(&name, EVERY_SECOND).expect("a valid schedule");
    let seen: Seen = Arc::default();
    let mut brokers = Vec::new();
    let mut handles = Vec::new();
    for who in 0..4 {
        let broker = D::connect(&f.url).await;
        let q = broker
            .queue::<D::Job>(f.table.clone())
            .await
            .expect("queue");
        handles.push(Some(run::<D>(&q, schedule(), mode, who, &seen).await));
        brokers.push(Some(broker));
    }
    let q = f.queue().await;
    let sub = q
        .subscribe(SubscribeOptions::default(), |_job| async { Outcome::Ack })
        .expect("subscribe");
    // 30 s in steps of 1 s: the kill at step 10, the restart at step 14.
    for step in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if step == 10 {
            let broker = brokers[3].take().expect("broker 3 runs");
            let killed = D::kill_connections(&broker).await;
            drop(handles[3].take());
            broker.close().await;
            crate::report(&format!(
                "periodic: broker 3 killed at step {step} ({killed:?} server connections terminated)"
            ));
        }
        if step == 14 {
            let broker = D::connect(&f.url).await;
            let q3 = broker
                .queue::<D::Job>(f.table.clone())
                .await
                .expect("queue");
            handles[3] = Some(run::<D>(&q3, schedule(), mode, 4, &seen).await);
            brokers[3] = Some(broker);
        }
    }
    for h in handles.into_iter().flatten() {
        h.stop().await;
    }
    let _ = sub.shutdown().await;
    let rows = all_rows::<D>(&q).await;
    let seen = seen.lock().unwrap().clone();
    let published = check_one_row_per_tick(&rows, &seen);
    crate::report(&format!(
        "periodic: 4 brokers, 30 s, one killed and restarted: {published} ticks published, {} sightings, {} rows",
        seen.len(),
        rows.len()
    ));
    assert!(
        published >= 5,
        "an every-second schedule published only {published} ticks in 30 s"
    );
    for b in brokers.into_iter().flatten() {
        b.close().await;
    }
    f.cleanup().await;
}

/// Two brokers run one every-second schedule in the case's mode while a subscription on each
/// acks the rows (so a tick's row is often finished before the other broker gets to the tick):
/// every tick still has exactly one row.
pub async fn two_brokers_on_one_schedule_publish_each_tick_once_while_workers_ack<D: TestDb>(
    mode: ClaimMode,
) {
    let mut f = Fixture::<D>::new(mode, keyed).await;
    let qa = f.queue().await;
    let qb = f.other_queue().await;
    let name = unique_name("acked");
    let seen: Seen = Arc::default();
    let a = run::<D>(
        &qa,
        Schedule::new(&name, EVERY_SECOND).unwrap(),
        mode,
        0,
        &seen,
    )
    .await;
    let b = run::<D>(
        &qb,
        Schedule::new(&name, EVERY_SECOND).unwrap(),
        mode,
        1,
        &seen,
    )
    .await;
    let subs: Vec<_> = [&qa, &qb]
        .into_iter()
        .map(|q| {
            q.subscribe(SubscribeOptions::default(), |_job| async { Outcome::Ack })
                .expect("subscribe")
        })
        .collect();
    let published = || {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|(_, t)| t.published.is_some())
            .count()
    };
    wait_until("five ticks published", Duration::from_secs(60), || {
        let n = published();
        async move { n >= 5 }
    })
    .await;
    a.stop().await;
    b.stop().await;
    for s in subs {
        let _ = s.shutdown().await;
    }
    let rows = all_rows::<D>(&qa).await;
    let seen = seen.lock().unwrap().clone();
    check_one_row_per_tick(&rows, &seen);
    f.cleanup().await;
}

/// A broker that was down publishes no missed tick by default; with `Missed::RunLatest` it
/// publishes the latest missed tick once, then the ticks to come.
pub async fn missed_ticks_are_skipped_by_default_and_run_latest_publishes_the_latest_once<
    D: TestDb,
>() {
    let mode = ClaimMode::Lease;
    let f = Fixture::<D>::new(mode, keyed).await;
    let q = f.queue().await;
    let name = unique_name("missed");
    let seen: Seen = Arc::default();
    let first_published = |who: usize| {
        let seen = seen.clone();
        move || {
            let found = seen
                .lock()
                .unwrap()
                .iter()
                .find(|(w, t)| *w == who && t.published.is_some())
                .map(|(_, t)| t.at_ms);
            async move { found.is_some() }
        }
    };
    let published_by = |who: usize| -> Vec<i64> {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|(w, t)| *w == who && t.published.is_some())
            .map(|(_, t)| t.at_ms)
            .collect()
    };
    // Run 0 publishes a tick, then stops; ticks pass while nothing runs the schedule.
    let h = run::<D>(
        &q,
        Schedule::new(&name, EVERY_SECOND).unwrap(),
        mode,
        0,
        &seen,
    )
    .await;
    wait_until(
        "run 0 publishes",
        Duration::from_secs(30),
        first_published(0),
    )
    .await;
    h.stop().await;
    let down_0 = broker_core::driver::clock::now_ms();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Run 1 (Skip) starts after missed ticks: it publishes none of them.
    let start_1 = broker_core::driver::clock::now_ms();
    let h = run::<D>(
        &q,
        Schedule::new(&name, EVERY_SECOND).unwrap(),
        mode,
        1,
        &seen,
    )
    .await;
    wait_until(
        "run 1 publishes",
        Duration::from_secs(30),
        first_published(1),
    )
    .await;
    h.stop().await;
    let down_1 = broker_core::driver::clock::now_ms();
    let by_1 = published_by(1);
    assert!(
        by_1.iter().all(|t| *t > start_1),
        "Skip published a tick missed while down: {by_1:?} (started at {start_1})"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Run 2 (RunLatest) publishes the latest tick it missed, once.
    let start_2 = broker_core::driver::clock::now_ms();
    let h = run::<D>(
        &q,
        Schedule::new(&name, EVERY_SECOND)
            .unwrap()
            .missed(Missed::RunLatest),
        mode,
        2,
        &seen,
    )
    .await;
    wait_until(
        "run 2 publishes",
        Duration::from_secs(30),
        first_published(2),
    )
    .await;
    wait_until(
        "run 2 publishes a tick to come",
        Duration::from_secs(30),
        || {
            let n = published_by(2).iter().filter(|t| **t > start_2).count();
            async move { n >= 1 }
        },
    )
    .await;
    h.stop().await;
    let rows = all_rows::<D>(&q).await;
    let ticks: Vec<i64> = rows.iter().map(|(_, p)| p.parse().unwrap()).collect();
    let missed_0: Vec<_> = ticks
        .iter()
        .filter(|t| **t > down_0 && **t < start_1)
        .collect();
    assert!(
        missed_0.is_empty(),
        "ticks published while nothing ran: {missed_0:?}"
    );
    // Run 2's first tick is the one it caught up on: a tick missed while nothing ran.
    let first_2 = published_by(2)[0];
    assert!(
        first_2 > down_1 && first_2 <= broker_core::driver::clock::now_ms(),
        "RunLatest's first tick {first_2} is not one missed after {down_1}"
    );
    let missed_1: Vec<_> = ticks
        .iter()
        .filter(|t| **t > down_1 && **t < first_2)
        .collect();
    assert!(
        missed_1.is_empty(),
        "RunLatest published more than the latest missed tick: {missed_1:?} before {first_2}"
    );
    let seen = seen.lock().unwrap().clone();
    check_one_row_per_tick(&rows, &seen);
    f.cleanup().await;
}

/// Set in the child processes of
/// [`four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled`] to
/// `who|table|schedule|url`.
pub const PERIODIC_CHILD_ENV: &str = "SQLX_BROKER_PERIODIC_CHILD";

/// A process of the kill case: runs the schedule on a broker of its own, prints
/// `TICK <who> <at_ms> <id or ->` for each tick it saw, and stops when its stdin closes (or
/// dies when the parent kills it).
async fn periodic_child<D: TestDb>(spec: &str) {
    let mut parts = spec.splitn(4, '|');
    let (who, table, schedule, url) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let broker = D::connect(url).await;
    let description = keyed(crate::describe(table, ClaimMode::Lease))
        .build()
        .expect("the kill case's description");
    let queue = broker
        .queue::<D::Job>(description)
        .await
        .expect("the child's queue");
    let handle = queue
        .schedule(
            Schedule::new(schedule, EVERY_SECOND).unwrap(),
            tick_job::<D>(ClaimMode::Lease),
        )
        .await
        .expect("the child's schedule");
    let mut ticks = handle.ticks();
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
    });
    tokio::pin!(stdin_closed);
    loop {
        tokio::select! {
            t = ticks.recv() => match t {
                Ok(t) => {
                    let id = t.published.map_or_else(|| "-".to_owned(), |id| id.to_string());
                    println!("TICK {who} {} {id}", t.at_ms);
                    use std::io::Write as _;
                    let _ = std::io::stdout().flush();
                }
                Err(_) => break,
            },
            _ = &mut stdin_closed => break,
        }
    }
    handle.stop().await;
    broker.close().await;
}

/// Four processes (this test binary re-run as children) run one every-second schedule for
/// 30 s; one is killed with SIGKILL and a new one started mid-run. Every tick any process saw
/// has exactly one row, no tick has two, and at most one row (the killed process's tick in
/// flight) has no reported publisher. `test_path` is this test's name in its binary.
pub async fn four_processes_on_one_schedule_publish_each_tick_once_with_one_sigkilled<D: TestDb>(
    test_path: &str,
) {
    use std::io::BufRead as _;
    use std::process::{Command, Stdio};
    if let Ok(spec) = std::env::var(PERIODIC_CHILD_ENV) {
        periodic_child::<D>(&spec).await;
        return;
    }
    let f = Fixture::<D>::new(ClaimMode::Lease, keyed).await;
    let name = unique_name("sigkill");
    let seen: Seen = Arc::default();
    let test_name = test_path
        .split_once("::")
        .map_or(test_path, |(_, rest)| rest)
        .to_owned();
    let spawn = |who: usize| {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                test_name.as_str(),
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                PERIODIC_CHILD_ENV,
                format!("{who}|{}|{name}|{}", f.table.name(), f.url),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a child process");
        let stdout = child.stdout.take().unwrap();
        let seen = seen.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                // libtest prints "test <name> ... " without a newline first, so the child's
                // first line comes glued to it: look anywhere in the line.
                let Some(at) = line.find("TICK ") else {
                    continue;
                };
                let mut w = line[at + "TICK ".len()..].split_whitespace();
                let (Some(who), Some(at), Some(id)) = (w.next(), w.next(), w.next()) else {
                    continue;
                };
                let tick = Tick {
                    at_ms: at.parse().unwrap(),
                    published: id.parse().ok(),
                };
                seen.lock().unwrap().push((who.parse().unwrap(), tick));
            }
        });
        child
    };
    let mut children: Vec<_> = (0..4).map(spawn).collect();
    for step in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if step == 10 {
            children[3].kill().expect("SIGKILL child 3");
            let _ = children[3].wait();
        }
        if step == 14 {
            children[3] = spawn(4);
        }
    }
    // The others stop when their stdin closes; a child still running after 30 s is killed.
    for c in &mut children {
        drop(c.stdin.take());
    }
    for c in &mut children {
        let mut exited = false;
        for _ in 0..300 {
            if c.try_wait().ok().flatten().is_some() {
                exited = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !exited {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    let q = f.queue().await;
    let rows = all_rows::<D>(&q).await;
    let seen = seen.lock().unwrap().clone();
    let published = check_ticks(&rows, &seen, 1);
    crate::report(&format!(
        "periodic: 4 processes, 30 s, one SIGKILLed and replaced: {published} ticks, {} sightings, {} rows",
        seen.len(),
        rows.len()
    ));
    assert!(
        published >= 5,
        "an every-second schedule published only {published} ticks in 30 s"
    );
    assert!(
        seen.iter().any(|(who, _)| *who == 4),
        "the process started after the kill saw ticks"
    );
    f.cleanup().await;
}

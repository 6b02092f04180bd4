//! Operator signals across processes (issue #48): `pause`, `resume` and `run_now` issued in the
//! test's process reach a subscription in a child process (the test binary re-run), and a
//! pause outlives a child killed with SIGKILL: the next process starts paused.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use broker_core::{Backend, ClaimMode, Outcome, SubscribeOptions};

use super::faults::{CHILD_ENV, spawn_child};
use crate::{Fixture, TestDb, describe, wait_until};

/// The child's poll interval: what bounds how late a subscription on a database without
/// `LISTEN/NOTIFY` sees a signal.
const CHILD_POLL: Duration = Duration::from_millis(500);

/// The child: a subscription of four workers that prints `STARTED <id>` as each handler starts
/// and acks at once, until it is killed.
async fn child<D: TestDb>(spec: &str) {
    let mut parts = spec.splitn(3, '|');
    let (mode, table, url) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let mode = crate::__private::mode(mode);
    let broker = D::connect(url).await;
    let queue = broker
        .queue::<D::Job>(describe(table, mode).build().unwrap())
        .await
        .expect("the child's queue");
    let _sub = queue
        .subscribe(
            SubscribeOptions::new()
                .concurrency(4)
                .poll_interval(CHILD_POLL),
            |job| async move {
                println!("STARTED {}", job.id());
                Outcome::Ack
            },
        )
        .expect("the child's subscription");
    println!("READY");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// A child process and the ids its handlers started, read from its stdout as it prints them.
struct Worker {
    child: Child,
    started: Arc<Mutex<Vec<i64>>>,
    ready: Arc<Mutex<bool>>,
}

impl Worker {
    async fn spawn(test_path: &str, spec: &str) -> Self {
        let mut child = spawn_child(test_path, spec, Stdio::inherit());
        let stdout = child.stdout.take().unwrap();
        let started = Arc::new(Mutex::new(Vec::new()));
        let ready = Arc::new(Mutex::new(false));
        let (s, r) = (started.clone(), ready.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest prints "test <name> ... " without a newline first: look anywhere.
                if let Some(at) = line.find("STARTED ") {
                    let id = line[at + "STARTED ".len()..].trim().parse::<i64>().unwrap();
                    s.lock().unwrap().push(id);
                } else if line.contains("READY") {
                    *r.lock().unwrap() = true;
                }
            }
        });
        let worker = Self {
            child,
            started,
            ready,
        };
        let ready = worker.ready.clone();
        wait_until(
            "the child process's subscription",
            Duration::from_secs(60),
            || {
                let ready = *ready.lock().unwrap();
                async move { ready }
            },
        )
        .await;
        worker
    }

    fn started(&self, id: i64) -> bool {
        self.started.lock().unwrap().contains(&id)
    }

    async fn wait_started(&self, ids: &[i64], what: &str) {
        let started = self.started.clone();
        wait_until(what, Duration::from_secs(30), || {
            let all = ids.iter().all(|id| started.lock().unwrap().contains(id));
            async move { all }
        })
        .await;
    }

    fn kill(mut self) {
        self.child.kill().expect("SIGKILL the child");
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `pause`, `resume` and `run_now` from this process reach a subscription in a child process:
/// rows published while paused (at once after `pause` returns where the database pushes
/// signals, two of the child's polls after elsewhere) do not start there over three of its
/// polls and start after the resume; a row scheduled an hour ahead starts after `run_now`. Then, paused again, the child
/// is killed with SIGKILL, a row is published, and a new child process starts paused: it starts
/// nothing over three polls, and the row after the resume. Every wait is bounded and names what
/// it waited for.
pub async fn operator_signals_reach_a_subscription_in_another_process<D: TestDb>(
    mode: ClaimMode,
    test_path: &str,
) {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child::<D>(&spec).await;
        return;
    }
    let fx = Fixture::<D>::new(mode, |b| b).await;
    let q = fx.queue().await;
    let mode_name = match mode {
        ClaimMode::RowLock => "row_lock",
        ClaimMode::Lease => "lease",
        ClaimMode::Advisory => "advisory",
        other => panic!("the suite has no case for claim mode {other:?}"),
    };
    let spec = format!("{mode_name}|{}|{}", fx.table.name(), fx.url);
    let worker = Worker::spawn(test_path, &spec).await;
    let first = q.publish_batch(&[fx.job(0), fx.job(1)]).await.unwrap();
    worker
        .wait_started(&first, "the child to start the first rows")
        .await;

    // With LISTEN/NOTIFY the pause reaches the child at once: no handler there starts after
    // `pause` returns. Without, the child reads the pause at its next poll: rows published
    // within that poll may still start, so they are published two polls after.
    let pushes = fx.broker.backend().capabilities().cross_process_wakeups;
    q.pause("signals-process test").await.expect("pause");
    if !pushes {
        tokio::time::sleep(CHILD_POLL * 2).await;
    }
    let while_paused = q.publish_batch(&[fx.job(2), fx.job(3)]).await.unwrap();
    tokio::time::sleep(CHILD_POLL * 3).await;
    assert!(
        !while_paused.iter().any(|id| worker.started(*id)),
        "the child started a row published after the pause returned"
    );
    q.resume().await.expect("resume");
    worker
        .wait_started(
            &while_paused,
            "the child to start the rows after the resume",
        )
        .await;

    let later = q
        .publish(fx.job(4).run_after(Duration::from_secs(3600)))
        .await
        .unwrap();
    tokio::time::sleep(CHILD_POLL * 2).await;
    assert!(!worker.started(later), "a row an hour ahead started early");
    q.run_now(later).await.expect("run now");
    worker
        .wait_started(&[later], "the child to start the row run now")
        .await;

    q.pause("signals-process test").await.expect("pause again");
    worker.kill();
    let after_kill = q.publish(fx.job(5)).await.unwrap();
    let worker = Worker::spawn(test_path, &spec).await;
    tokio::time::sleep(CHILD_POLL * 3).await;
    assert!(
        !worker.started(after_kill),
        "a new process started a row while the queue was paused"
    );
    q.resume().await.expect("resume again");
    worker
        .wait_started(
            &[after_kill],
            "the new child to start the row after the resume",
        )
        .await;
    worker.kill();
    fx.cleanup().await;
}

//! Whether a subscription's queue is paused, as the claim loop sees it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::driver::{AdminDriver, Backend, Gate, Wakeup};
use crate::error::Result;
use crate::inner::Shared;

/// Runs `read` (a statement of the pause's) in a task of its own and waits for it, or for
/// `stop`, whichever comes first. A stop leaves the read to finish on its own, never cancelled
/// mid-statement (sqlx-mysql could hand the connection's next user its reply), and lets a
/// shutdown go on while a server that went away keeps the read waiting for a connection.
async fn unless_stopped<T: Send + 'static>(
    read: impl Future<Output = T> + Send + 'static,
    stop: impl Future<Output = ()>,
) -> Option<T> {
    let read = tokio::spawn(read);
    tokio::select! {
        biased;
        () = stop => None,
        out = read => out.ok(),
    }
}

/// Whether a subscription's queue is paused, read from the control table at most once per poll
/// interval, at once after a pause or resume through this broker, and after a signal or a lost
/// signal from another process ([`Wakeup`]). The state lives in the table's [`Gate`], which the
/// delivery tasks pass before their handlers start.
pub(super) struct PauseWatch {
    /// The gate of the table's handlers in this broker; `None` for a subscription stopped
    /// before it looked (it never claims, so the pause does not matter).
    gate: Option<Arc<Gate>>,
    /// Whether the control table existed when the subscription started; without it nothing
    /// can pause the queue, and nothing is read.
    pub(super) control: bool,
    read_at: Option<tokio::time::Instant>,
    /// The broker's pause counter at the last read.
    epoch: u64,
    wakeup: Arc<Wakeup>,
}

impl PauseWatch {
    /// A subscription stopped before it looked: it never claims, so the pause does not matter.
    pub(super) fn stopped(wakeup: Arc<Wakeup>) -> Self {
        Self {
            gate: None,
            control: false,
            read_at: None,
            epoch: 0,
            wakeup,
        }
    }

    /// Whether the queue is paused, as this broker knows it now.
    pub(super) fn paused(&self) -> bool {
        self.gate.as_ref().is_none_or(|g| g.is_paused())
    }

    /// Whether a signal asked the next claim to read from the start of the claim order (rows
    /// came back before where claims start); clears it.
    pub(super) fn rescan_asked(&self) -> bool {
        self.wakeup.take_rescan()
    }

    /// Looks whether the control table exists; without it, nothing is read later. `None` when
    /// `stop` came first.
    pub(super) async fn new<B: Backend>(
        shared: &Arc<Shared<B>>,
        wakeup: Arc<Wakeup>,
        gate: Arc<Gate>,
        stop: impl Future<Output = ()>,
    ) -> Option<Self> {
        let reading = shared.clone();
        let read = async move { reading.broker.backend.admin().has_control_table().await };
        let control = match unless_stopped(read, stop).await? {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(table = shared.name(), error = %e, "cannot tell whether the control table exists; pauses from other processes are not seen");
                false
            }
        };
        if !control {
            tracing::debug!(
                table = shared.name(),
                "no control table ({}): this subscription does not watch for pauses",
                crate::driver::CONTROL_TABLE
            );
        }
        Some(Self {
            gate: Some(gate),
            control,
            read_at: None,
            epoch: shared.broker.pause_epoch.load(Ordering::SeqCst),
            wakeup,
        })
    }

    /// Reads the pause again when the poll interval passed since the last read, this broker
    /// paused or resumed a queue since, or a signal asked for it. A read that fails keeps the
    /// last state; a read that `stop` overtakes too; a read that a signal overtook gives way to
    /// the signal.
    pub(super) async fn refresh<B: Backend>(
        &mut self,
        shared: &Arc<Shared<B>>,
        poll: Duration,
        stop: impl Future<Output = ()>,
    ) {
        let Some(gate) = self.gate.clone() else {
            return;
        };
        if !self.control {
            return;
        }
        let epoch = shared.broker.pause_epoch.load(Ordering::SeqCst);
        let signalled = self.wakeup.take_reread();
        let due = signalled
            || self
                .read_at
                .is_none_or(|at| at.elapsed() >= poll || epoch != self.epoch);
        if !due {
            return;
        }
        self.epoch = epoch;
        self.read_at = Some(tokio::time::Instant::now());
        let seq = gate.seq();
        let reading = shared.clone();
        let read = async move {
            let state: Result<_> = reading
                .broker
                .backend
                .admin()
                .pause_state(reading.name())
                .await;
            state
        };
        match unless_stopped(read, stop).await {
            None => {}
            Some(Ok(state)) => {
                let paused = state.is_some();
                if paused != gate.is_paused() {
                    tracing::info!(table = shared.name(), paused, "the queue's pause changed");
                }
                gate.apply_read(seq, paused);
            }
            Some(Err(e)) => {
                tracing::warn!(table = shared.name(), error = %e, "reading the queue's pause failed; keeping the last state");
            }
        }
    }
}

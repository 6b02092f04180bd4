//! Whether a subscription's queue is paused, as the claim loop sees it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::driver::{AdminDriver, Backend};
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
/// interval, and at once after a pause or resume through this broker.
pub(super) struct PauseWatch {
    /// Whether the queue was paused at the last read.
    pub(super) paused: bool,
    /// Whether the control table existed when the subscription started; without it nothing
    /// can pause the queue, and nothing is read.
    pub(super) control: bool,
    read_at: Option<tokio::time::Instant>,
    /// The broker's pause counter at the last read.
    epoch: u64,
}

impl PauseWatch {
    /// A subscription stopped before it looked: it never claims, so the pause does not matter.
    pub(super) fn stopped() -> Self {
        Self {
            paused: true,
            control: false,
            read_at: None,
            epoch: 0,
        }
    }

    /// Looks whether the control table exists; without it, nothing is read later. `None` when
    /// `stop` came first.
    pub(super) async fn new<B: Backend>(
        shared: &Arc<Shared<B>>,
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
            paused: false,
            control,
            read_at: None,
            epoch: shared.broker.pause_epoch.load(Ordering::SeqCst),
        })
    }

    /// Reads the pause again when the poll interval passed since the last read, or this broker
    /// paused or resumed a queue since. A read that fails keeps the last state; a read that
    /// `stop` overtakes too.
    pub(super) async fn refresh<B: Backend>(
        &mut self,
        shared: &Arc<Shared<B>>,
        poll: Duration,
        stop: impl Future<Output = ()>,
    ) {
        if !self.control {
            return;
        }
        let epoch = shared.broker.pause_epoch.load(Ordering::SeqCst);
        let due = self
            .read_at
            .is_none_or(|at| at.elapsed() >= poll || epoch != self.epoch);
        if !due {
            return;
        }
        self.epoch = epoch;
        self.read_at = Some(tokio::time::Instant::now());
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
                if paused != self.paused {
                    tracing::info!(table = shared.name(), paused, "the queue's pause changed");
                }
                self.paused = paused;
            }
            Some(Err(e)) => {
                tracing::warn!(table = shared.name(), error = %e, "reading the queue's pause failed; keeping the last state");
            }
        }
    }
}

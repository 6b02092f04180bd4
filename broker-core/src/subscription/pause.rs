//! Whether a subscription's queue is paused, as the claim loop sees it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::driver::{AdminDriver, Backend};

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
    /// Looks whether the control table exists; without it, nothing is read later.
    pub(super) async fn new<B: Backend>(shared: &crate::inner::Shared<B>) -> Self {
        let control = match shared.broker.backend.admin().has_control_table().await {
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
        Self {
            paused: false,
            control,
            read_at: None,
            epoch: shared.broker.pause_epoch.load(Ordering::SeqCst),
        }
    }

    /// Reads the pause again when the poll interval passed since the last read, or this broker
    /// paused or resumed a queue since. A read that fails keeps the last state.
    pub(super) async fn refresh<B: Backend>(
        &mut self,
        shared: &crate::inner::Shared<B>,
        poll: Duration,
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
        match shared
            .broker
            .backend
            .admin()
            .pause_state(shared.name())
            .await
        {
            Ok(state) => {
                let paused = state.is_some();
                if paused != self.paused {
                    tracing::info!(table = shared.name(), paused, "the queue's pause changed");
                }
                self.paused = paused;
            }
            Err(e) => {
                tracing::warn!(table = shared.name(), error = %e, "reading the queue's pause failed; keeping the last state");
            }
        }
    }
}

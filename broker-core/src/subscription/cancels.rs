//! How a subscription sees cancel requests for its table's rows: a read of the cancel table
//! ([`CANCEL_TABLE`](crate::driver::CANCEL_TABLE)) once per poll interval, in a task of its own
//! (the claim loop may wait for free slots while every handler runs, and those are the rows a
//! cancel is for). What the read finds goes onto the table's
//! [`CancelBoard`](crate::cancel::CancelBoard), which raises the signal of a delivery in work
//! here and keeps a claim of a requested row from running it. On PostgreSQL a `NOTIFY` brings a
//! request sooner; the read is the fallback there and the only path elsewhere.
//!
//! The read also cleans up: a request whose row is gone, finished or dead-lettered (the
//! handler finished before the cancel reached it, or a holder died between deleting the row
//! and deleting the request) is deleted, by the first subscription of the table that reads it
//! and holds no delivery of that row.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::driver::{AdminDriver, Backend, Gate};
use crate::inner::Shared;

/// Reads the cancel requests of `shared`'s table at once and then every `poll` until `stop` or
/// `broker_stop` says stop, and returns once the first read is in (or the stop came first), so
/// the subscription's first claim already knows the requests of rows whose holder went away.
/// Each read runs to its end (never cancelled mid-statement: sqlx-mysql could hand the
/// connection's next user its reply); the stop is seen between reads.
pub(super) async fn start<B: Backend>(
    shared: Arc<Shared<B>>,
    gate: Arc<Gate>,
    poll: Duration,
    mut stop: watch::Receiver<bool>,
    mut broker_stop: watch::Receiver<bool>,
) {
    let (first_read, first_done) = tokio::sync::oneshot::channel::<()>();
    let (mut sub, mut broker) = (stop.clone(), broker_stop.clone());
    tokio::spawn(async move {
        let keep_on = read_once(&shared, &gate, true).await;
        let _ = first_read.send(());
        if !keep_on {
            return;
        }
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                _ = broker_stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(poll) => {}
            }
            if !read_once(&shared, &gate, false).await {
                return;
            }
        }
    });
    tokio::select! {
        _ = first_done => {}
        _ = sub.wait_for(|s| *s) => {}
        _ = broker.wait_for(|s| *s) => {}
    }
}

/// One read and its clean-up; `false` when the subscription should stop reading (the first
/// read failed: most likely the cancel table is missing).
async fn read_once<B: Backend>(shared: &Arc<Shared<B>>, gate: &Gate, first: bool) -> bool {
    let board = &gate.cancels;
    let seq = board.seq();
    let admin = shared.broker.backend.admin();
    let ids = match admin.cancel_requests(shared.name()).await {
        Ok(ids) => ids,
        Err(e) if first => {
            tracing::warn!(table = shared.name(), error = %e, "reading cancel requests failed; this subscription does not see cancels of rows in work from other processes (create {} with the DDL helper)", crate::driver::CANCEL_TABLE);
            return false;
        }
        Err(e) => {
            tracing::debug!(table = shared.name(), error = %e, "reading cancel requests failed; trying again at the next poll");
            return true;
        }
    };
    board.apply_read(seq, &ids);
    for id in ids {
        if board.is_running(id) {
            continue;
        }
        let gone = match shared.broker.backend.row_state(&shared.table, id).await {
            Ok(None) => true,
            Ok(Some(state)) => state.processed || state.dead,
            Err(_) => false,
        };
        if gone {
            tracing::debug!(
                table = shared.name(),
                id,
                "deleting the cancel request of a row that is gone"
            );
            if admin.clear_cancel(shared.name(), id).await.is_ok() {
                board.forget(id);
            }
        }
    }
    true
}

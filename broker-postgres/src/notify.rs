//! Cross-process wake-ups with `LISTEN/NOTIFY`: publishes notify, coalesced per table; the
//! subscriptions of a backend listen on one shared connection (see `listener`).
//!
//! # Why publishes do not notify one by one
//! Every transaction that issued a `NOTIFY` takes one global lock at commit, so a notification in
//! every insert serialises the commits of all publishers (measured here: the same INSERT from 8
//! clients at 12.0k tps alone, 4.6k tps with `pg_notify` in it). A [`Notifier`] sends at most one
//! notification per table per [`WINDOW`] from this process, with a leading and a trailing edge:
//! - a publish on a pool connection (autocommit) inserts without notifying and then pokes the
//!   table's notifier, which notifies at once when it has been quiet, and otherwise once more at
//!   the end of the window, after every publish of the burst committed;
//! - a publish inside the caller's transaction puts `pg_notify` in its insert (delivered when the
//!   transaction commits, never when it rolls back) only when no other such insert of this
//!   process did within the window, and pokes the notifier one window later for the rest. So of
//!   several transactions that publish within one window, the first carries the notification;
//!   one of the others that commits more than a window after it is found by the subscriptions'
//!   next claim or poll (or at once in this process after
//!   [`Queue::wake`](broker_core::Queue::wake)). This is the price of not serialising commits.
//!
//! Notifications can be lost (a dropped connection, a full queue): the poll stays the
//! correctness path, and a listener that reconnects wakes its subscriptions once to cover the gap.
//! Rows inserted by the user's own SQL notify nobody; the poll finds them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use broker_core::Result;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use tokio::task::JoinHandle;

/// The channel of a table: `sqlx_broker_` and 16 hex digits of the SHA-256 of its name. Stable
/// across processes, and within PostgreSQL's 63-byte identifier limit whatever the name's length.
pub(crate) fn channel(table: &str) -> String {
    let digest = Sha256::digest(table.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("sqlx_broker_{hex}")
}

/// The library's channel for operator signals (`pause`, `resume`, `run_now`, `requeue_dead`):
/// one channel for every table, the signal and the table in the payload
/// ([`Signal::payload`](broker_core::driver::Signal::payload)). One channel, not the table's
/// own, so a tool that watches a database's operator actions listens once.
pub(crate) const SIGNALS: &str = "sqlx_broker_signals";

/// The longest a notification of a burst of publishes waits: at most one notification per table
/// per window leaves this process. Short against the poll interval, long against a commit.
pub(crate) const WINDOW: Duration = Duration::from_millis(10);

/// Coalesced `NOTIFY`s of this process, one task per table that was published to.
#[derive(Debug, Default)]
pub(crate) struct Notifier {
    tables: Mutex<HashMap<String, Arc<TableNotifier>>>,
}

/// The notification state of one table's channel.
#[derive(Debug)]
pub(crate) struct TableNotifier {
    channel: String,
    /// A publish happened that no notification has covered yet.
    dirty: AtomicBool,
    poke: tokio::sync::Notify,
    /// When an insert in a caller's transaction last carried a notification, host unix ms.
    last_in_tx_ms: AtomicI64,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Notifier {
    /// The table's notifier, its task started on first use.
    pub(crate) fn table(&self, pool: &PgPool, table: &str) -> Arc<TableNotifier> {
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = tables.get(table) {
            return t.clone();
        }
        let t = Arc::new(TableNotifier {
            channel: channel(table),
            dirty: AtomicBool::new(false),
            poke: tokio::sync::Notify::new(),
            last_in_tx_ms: AtomicI64::new(i64::MIN / 2),
            task: Mutex::new(None),
        });
        let task = tokio::spawn(notify_loop(t.clone(), pool.clone()));
        *t.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        tables.insert(table.to_owned(), t.clone());
        t
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        for t in self
            .tables
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            if let Some(task) = t.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
                task.abort();
            }
        }
    }
}

impl TableNotifier {
    /// The channel.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Asks for a notification: at once when the channel was quiet for a window, else at the
    /// end of the current window.
    pub(crate) fn poke(&self) {
        self.dirty.store(true, Ordering::SeqCst);
        self.poke.notify_one();
    }

    /// Whether an insert inside a caller's transaction should carry the notification itself:
    /// only when no other such insert of this process carried one within the window (the
    /// caller's commit delivers it). A notification the notifier sent does not count: it covers
    /// rows committed before it, not a transaction still open. Claims the window when it says yes.
    pub(crate) fn take_leading_edge(&self) -> bool {
        let now = broker_core::driver::clock::now_ms();
        let window = i64::try_from(WINDOW.as_millis()).unwrap_or(i64::MAX);
        let last = self.last_in_tx_ms.load(Ordering::SeqCst);
        now.saturating_sub(last) >= window
            && self
                .last_in_tx_ms
                .compare_exchange(last, now, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }

    /// A poke one window from now, for publishes inside a caller's transaction: by then the
    /// transaction has usually committed.
    pub(crate) fn poke_after_window(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(WINDOW).await;
            if let Some(me) = me.upgrade() {
                me.poke();
            }
        });
    }
}

/// Sends the table's notifications: one at once when poked after a quiet window, then at most
/// one per window while pokes keep coming. Ends when the pool closes, or is aborted when the
/// backend's notifier drops.
async fn notify_loop(t: Arc<TableNotifier>, pool: PgPool) {
    loop {
        if !t.dirty.swap(false, Ordering::SeqCst) {
            t.poke.notified().await;
            continue;
        }
        // The simple protocol (one message, no parameters: the channel is the broker's own hex
        // name), so it passes a transaction-mode pooler too.
        let sent = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("NOTIFY {}", t.channel)))
            .execute(&pool)
            .await;
        match sent {
            Ok(_) => {}
            Err(sqlx::Error::PoolClosed) => return,
            // A lost notification is covered by the subscriptions' poll.
            Err(e) => tracing::debug!(error = %e, "a coalesced NOTIFY failed; subscriptions poll"),
        }
        tokio::time::sleep(WINDOW).await;
    }
}

/// Whether two statements on one connection reach one server session. Behind a
/// transaction-mode pooler they may not, and session state (advisory locks, `LISTEN`) is lost
/// between them. Not a proof: a pooler with a single idle server connection passes.
pub(crate) async fn session_is_pinned(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    let first: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?;
    let second: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?;
    Ok(first == second)
}

/// Whether the pool reaches the server through a transaction-mode pooler: two connections of
/// the pool's options share a server session (a pooler hands the session a client just left to
/// the next one; PgBouncer reuses the most recently freed first), or one connection's statements
/// reach two. Runs on connections of its own, unprepared, and closes them.
pub(crate) async fn transaction_pooled(pool: &PgPool) -> Result<bool, sqlx::Error> {
    use sqlx::Connection;
    async fn pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
        use sqlx::Row;
        // The simple protocol: one message, which any pooler passes through whole.
        sqlx::raw_sql("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await?
            .try_get(0)
    }
    let options = pool.connect_options();
    let mut a = PgConnection::connect_with(&options).await?;
    let mut b = PgConnection::connect_with(&options).await?;
    // Several rounds: one round can pass through a busy pooler by chance (a's session goes to
    // another client and comes back to a just as b gets a third one), and a stress child that
    // took a pooler for a direct connection failed on named statements. Directly, a's session
    // never changes and b's is never a's; through a transaction-mode pooler every round is
    // another chance to see either.
    let first = pid(&mut a).await?;
    let mut pooled = false;
    for _ in 0..POOLER_PROBE_ROUNDS {
        let other = pid(&mut b).await?;
        let again = pid(&mut a).await?;
        if other == first || other == again || again != first {
            pooled = true;
            break;
        }
    }
    let _ = a.close().await;
    let _ = b.close().await;
    Ok(pooled)
}

/// Rounds of [`transaction_pooled`]'s probe (each two statements).
const POOLER_PROBE_ROUNDS: usize = 6;

/// What to say when a pooler breaks session state.
pub(crate) const POOLER_HINT: &str = "two statements on one connection reached different server sessions, as behind a transaction-mode pooler (PgBouncer pool_mode = transaction); advisory locks and LISTEN live in the session, so connect directly or through a session-mode pooler (row lock and lease mode work through any pooler)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_are_stable_short_and_distinct() {
        let a = channel("jobs");
        assert_eq!(a, channel("jobs"));
        assert_ne!(a, channel("jobs2"));
        assert!(a.starts_with("sqlx_broker_"));
        assert_eq!(channel(&"x".repeat(500)).len(), "sqlx_broker_".len() + 16);
        assert!(a.len() <= 63);
    }
}

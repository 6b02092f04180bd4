//! One `LISTEN` connection per backend, shared by every table its subscriptions listen for.
//!
//! A subscription registers its table's channel ([`Listener::register`]) and gets a guard; the
//! first registration of a channel adds a `LISTEN`, the last guard to drop takes it away again
//! (`UNLISTEN`). One task owns the connection: it runs those changes between notifications and
//! wakes every registration of a notification's channel. So a service with fifty queue tables
//! holds one connection for wake-ups, not fifty, and a subscription holds nothing at idle.
//!
//! # Which connection
//! The listening connection is opened with the pool's connect options, as they are at each
//! connect (so it follows a pool that moved to a promoted standby), in a pool of one of its
//! own, so it never takes a connection of the user's pool: it is one more server connection per
//! backend (per broker), counted against the server's `max_connections`, not the pool's size.
//! It closes when the user's pool closes or the backend is dropped.
//!
//! # Operator signals
//! Besides the tables' channels the connection listens on the library's signal channel
//! ([`SIGNALS`]), on which the admin statements notify `pause`, `resume`, `run_now` and
//! `requeue_dead` (in the transaction of their change) with the table in the payload; a signal
//! goes to the registrations of that table ([`Wakeup::signal`]).
//!
//! # Lost notifications
//! When the connection drops, the task connects again, listens on every registered channel, and
//! then tells each registration once ([`Wakeup::missed`]): what was published while nobody
//! listened is found by one look, and a pause made meanwhile by one read of the pause state,
//! made after the `LISTEN` so that no pause falls between the two. The poll stays the
//! correctness path.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use broker_core::driver::{Listening, Signal, Wakeup};
use broker_core::{Result, SqlxBrokerError};
use sqlx::Acquire;
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::{mpsc, oneshot};

use crate::notify::{POOLER_HINT, SIGNALS, channel as table_channel, session_is_pinned};

/// The wake-ups of one backend: registrations by channel, and the task that listens.
#[derive(Debug)]
pub(crate) struct Listener {
    wakers: Arc<Wakers>,
    /// The task's commands; started at the first registration.
    task: Mutex<Option<mpsc::UnboundedSender<Command>>>,
    /// Why listening is off for good (a transaction-mode pooler), once found.
    off: Arc<OnceLock<String>>,
}

/// What the listening task is asked to do, in the order registrations come and go.
#[derive(Debug)]
enum Command {
    /// `LISTEN` on a channel; the reply says whether it ran.
    Listen(String, oneshot::Sender<std::result::Result<(), String>>),
    /// `UNLISTEN` a channel no registration needs any more.
    Unlisten(String),
}

/// The registrations of one channel: a registration id and the subscription's waker.
type Registrations = Vec<(u64, Weak<Wakeup>)>;

/// Registrations by channel.
#[derive(Debug, Default)]
struct Wakers {
    channels: Mutex<HashMap<String, Registrations>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Wakers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Registrations>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a registration; returns its id and whether it is the channel's first.
    fn add(&self, channel: &str, wake: &Arc<Wakeup>) -> (u64, bool) {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut channels = self.lock();
        let list = channels.entry(channel.to_owned()).or_default();
        list.push((id, Arc::downgrade(wake)));
        (id, list.len() == 1)
    }

    /// Removes a registration; returns whether the channel has none left.
    fn remove(&self, channel: &str, id: u64) -> bool {
        let mut channels = self.lock();
        let Some(list) = channels.get_mut(channel) else {
            return false;
        };
        list.retain(|(i, _)| *i != id);
        if list.is_empty() {
            channels.remove(channel);
            true
        } else {
            false
        }
    }

    fn wake(&self, channel: &str) {
        if let Some(list) = self.lock().get(channel) {
            for w in list.iter().filter_map(|(_, w)| w.upgrade()) {
                w.rows();
            }
        }
    }

    /// Hands a notification of the library's signal channel to the registrations of the table
    /// it names; ignores text that is not a signal.
    fn signal(&self, payload: &str) {
        let Some((signal, table)) = Signal::parse(payload) else {
            tracing::debug!(
                payload,
                "a notification on the signal channel that is no signal"
            );
            return;
        };
        if let Some(list) = self.lock().get(&table_channel(table)) {
            for w in list.iter().filter_map(|(_, w)| w.upgrade()) {
                w.signal(signal);
            }
        }
    }

    /// Tells every registration that notifications may have been lost (after a reconnect):
    /// each reads the pause state again and looks once.
    fn missed_all(&self) {
        for list in self.lock().values() {
            for w in list.iter().filter_map(|(_, w)| w.upgrade()) {
                w.missed();
            }
        }
    }

    fn channels(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    fn has(&self, channel: &str) -> bool {
        self.lock().contains_key(channel)
    }
}

impl Listener {
    pub(crate) fn new() -> Self {
        Self {
            wakers: Arc::default(),
            task: Mutex::new(None),
            off: Arc::default(),
        }
    }

    /// Registers `wake` for notifications on `channel` until the returned guard drops. The
    /// channel's first registration waits until its `LISTEN` ran, so a publish after this
    /// returns is heard. When the `LISTEN` fails (the server is away), the registration stays
    /// and the task listens once it is back, waking the registration then.
    pub(crate) async fn register(
        self: &Arc<Self>,
        pool: &PgPool,
        table: &str,
        channel: String,
        wake: Arc<Wakeup>,
    ) -> Result<Listening> {
        if let Some(why) = self.off.get() {
            return Err(off(table, why));
        }
        let (id, first) = self.wakers.add(&channel, &wake);
        let guard = Registration {
            listener: self.clone(),
            channel: channel.clone(),
            id,
        };
        if first {
            let (reply, replied) = oneshot::channel();
            self.send(pool, Command::Listen(channel, reply));
            match replied.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(table, error = %e, "LISTEN failed; polling until the listening connection is back");
                }
                // The task ended without a reply: listening is off (see `off`).
                Err(_) => {
                    let why = self
                        .off
                        .get()
                        .cloned()
                        .unwrap_or_else(|| "the listening task ended".into());
                    return Err(off(table, &why));
                }
            }
        }
        Ok(Listening::new(guard))
    }

    /// Sends a command to the task, starting it first if it is not running.
    fn send(&self, pool: &PgPool, command: Command) {
        let mut task = self.task.lock().unwrap_or_else(|p| p.into_inner());
        let tx = task.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run(pool.clone(), rx, self.wakers.clone(), self.off.clone()));
            tx
        });
        if let Err(mpsc::error::SendError(command)) = tx.send(command) {
            // The task ended (the pool closed): a reply, if any, is dropped with the command.
            drop(command);
        }
    }
}

fn off(table: &str, why: &str) -> SqlxBrokerError {
    SqlxBrokerError::Unsupported {
        table: table.to_owned(),
        message: format!("cross-process wake-ups are off: {why}"),
    }
}

/// One subscription's registration; dropping it unregisters, and the last of a channel's
/// registrations to go takes its `LISTEN` away.
struct Registration {
    listener: Arc<Listener>,
    channel: String,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.listener.wakers.remove(&self.channel, self.id) {
            let task = self.listener.task.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(tx) = task.as_ref() {
                let _ = tx.send(Command::Unlisten(std::mem::take(&mut self.channel)));
            }
        }
    }
}

/// The pool the listening connection lives in: one connection, with the user's pool's connect
/// options, reconnected on demand.
fn own_pool(user: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(CONNECT_TIMEOUT)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
        .connect_lazy_with((*user.connect_options()).clone())
}

/// Points the listening pool at the server the user's pool connects to now, if that changed
/// since `seen`: a pool that follows the primary ([`PgBackend::connect_primary`]) moves to a
/// promoted standby, and the next `LISTEN` connection must go there too, not to the old host.
///
/// [`PgBackend::connect_primary`]: crate::PgBackend::connect_primary
fn follow(user: &PgPool, own: &PgPool, seen: &mut Arc<sqlx::postgres::PgConnectOptions>) {
    let now = user.connect_options();
    if !Arc::ptr_eq(&now, seen) {
        own.set_connect_options((*now).clone());
        *seen = now;
    }
}

/// How long one attempt to open the listening connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The first wait before connecting again; it doubles up to [`BACKOFF_MAX`]. The most is short:
/// after a failover the connection should listen on the new primary soon after the user's pool
/// moved, and an attempt costs one connect.
const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Opens the listening connection, checks that its statements reach one server session, and
/// listens on every registered channel; returns it with the channels it listens on.
async fn connect(
    pool: &PgPool,
    wakers: &Wakers,
) -> std::result::Result<(PgListener, HashSet<String>), Connect> {
    let mut l = PgListener::connect_with(pool).await.map_err(Connect::Sql)?;
    let conn = (&mut l).acquire().await.map_err(Connect::Sql)?;
    if !session_is_pinned(conn).await.map_err(Connect::Sql)? {
        return Err(Connect::Pooled);
    }
    // The library's signal channel, whatever tables are registered: operator signals of every
    // table come on it, with the table in the payload.
    let mut channels = wakers.channels();
    channels.push(SIGNALS.to_owned());
    l.listen_all(channels.iter().map(String::as_str))
        .await
        .map_err(Connect::Sql)?;
    Ok((l, channels.into_iter().collect()))
}

enum Connect {
    Sql(sqlx::Error),
    /// Behind a transaction-mode pooler: `LISTEN` would be lost without a word.
    Pooled,
}

/// The listening task: keeps one connection, runs `LISTEN`/`UNLISTEN` as registrations come and
/// go, and wakes registrations per notification. Ends when the user's pool closes or every
/// sender of commands is gone (the backend dropped).
async fn run(
    user: PgPool,
    mut commands: mpsc::UnboundedReceiver<Command>,
    wakers: Arc<Wakers>,
    off: Arc<OnceLock<String>>,
) {
    let pool = own_pool(&user);
    let mut seen = user.connect_options();
    let closed = user.close_event();
    tokio::pin!(closed);
    let mut listener: Option<PgListener> = None;
    // The channels the connection listens on: `PgListener` keeps a list of its own (it listens
    // on it again after it reconnects by itself) and would hold a channel twice if told twice.
    let mut listening: HashSet<String> = HashSet::new();
    let mut backoff = BACKOFF_START;
    // Whether the connection was up before: a reconnect wakes every registration once.
    let mut was_up = false;
    loop {
        // Before every connect, and before every read (sqlx connects again by itself when the
        // connection drops while it reads).
        follow(&user, &pool, &mut seen);
        let Some(l) = listener.as_mut() else {
            match connect(&pool, &wakers).await {
                Ok((l, channels)) => {
                    listener = Some(l);
                    listening = channels;
                    backoff = BACKOFF_START;
                    // Listening again: what was published or signalled while nobody listened is
                    // found by one look and one read of the pause state.
                    if was_up {
                        wakers.missed_all();
                    }
                    was_up = true;
                    continue;
                }
                Err(Connect::Pooled) => {
                    let _ = off.set(POOLER_HINT.to_owned());
                    tracing::warn!("cross-process wake-ups are off: {POOLER_HINT}");
                    break;
                }
                Err(Connect::Sql(sqlx::Error::PoolClosed)) => break,
                Err(Connect::Sql(e)) => {
                    tracing::warn!(error = %e, "the LISTEN connection failed; trying again (polling meanwhile)");
                    // Commands that come meanwhile: a LISTEN is answered with the error (its
                    // channel is listened on at the next connect), an UNLISTEN needs nothing.
                    let wait = tokio::time::sleep(backoff);
                    tokio::pin!(wait);
                    loop {
                        tokio::select! {
                            _ = &mut wait => break,
                            _ = &mut closed => return pool.close().await,
                            command = commands.recv() => match command {
                                Some(Command::Listen(_, reply)) => {
                                    let _ = reply.send(Err(e.to_string()));
                                }
                                Some(Command::Unlisten(_)) => {}
                                None => return pool.close().await,
                            },
                        }
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            }
        };
        // `try_recv` reads whole messages or nothing (sqlx keeps a partial message in its
        // buffer), so dropping it for a command loses no notification.
        let failed = tokio::select! {
            _ = &mut closed => break,
            command = commands.recv() => match command {
                None => break,
                Some(Command::Listen(channel, reply)) => {
                    if listening.contains(&channel) {
                        let _ = reply.send(Ok(()));
                        None
                    } else {
                        match l.listen(&channel).await {
                            Ok(()) => {
                                listening.insert(channel);
                                let _ = reply.send(Ok(()));
                                None
                            }
                            Err(e) => {
                                let _ = reply.send(Err(e.to_string()));
                                Some(e)
                            }
                        }
                    }
                }
                // A channel registered again since its last registration went keeps listening.
                Some(Command::Unlisten(channel)) if wakers.has(&channel) => None,
                Some(Command::Unlisten(channel)) => {
                    if listening.remove(&channel) {
                        l.unlisten(&channel).await.err()
                    } else {
                        None
                    }
                }
            },
            received = l.try_recv() => match received {
                Ok(Some(n)) if n.channel() == SIGNALS => {
                    wakers.signal(n.payload());
                    None
                }
                Ok(Some(n)) => {
                    wakers.wake(n.channel());
                    None
                }
                // The connection dropped. sqlx would connect again by itself at the next read;
                // connecting here instead tells the registrations only once it listens again,
                // so their read of the pause state sees every pause it could not hear.
                Ok(None) => {
                    tracing::warn!("the LISTEN connection dropped; reconnecting (polling meanwhile)");
                    listener = None;
                    continue;
                }
                Err(sqlx::Error::PoolClosed) => break,
                Err(e) => Some(e),
            },
        };
        if let Some(e) = failed {
            // Start over on a fresh connection that listens on exactly the registered channels.
            tracing::warn!(error = %e, "the LISTEN connection failed; reconnecting (polling meanwhile)");
            listener = None;
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }
    drop(listener);
    pool.close().await;
}

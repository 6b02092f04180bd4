//! Operator signals: what `pause`, `resume`, `run_now`, `requeue_dead` and `cancel` tell the
//! subscriptions of a table, and the gate that keeps handlers from starting while a queue is
//! paused.
//!
//! Within one broker the operation itself reaches its subscriptions (every backend). Across
//! brokers a backend that can push (PostgreSQL's `NOTIFY`, sent in the transaction of the
//! change, so no listener hears a signal before the change is visible) hands what it hears to
//! each registration's [`Wakeup`]; the others leave it to the subscriptions' poll.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tokio::sync::{Notify, watch};

/// What an operator did to a queue, as a signal to its subscriptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Signal {
    /// The queue was paused: no handler may start.
    Pause,
    /// The queue was resumed: claim at once.
    Resume,
    /// A scheduled row was made due now: claim at once.
    RunNow,
    /// Dead letters were put back: claim at once, from the start of the claim order.
    RequeueDead,
    /// A cancel of row `id`, which was in work, was requested: its holder signals the handler,
    /// waits the grace and deletes the row (see [`Queue::cancel`](crate::Queue::cancel)).
    Cancel {
        /// The row.
        id: i64,
    },
}

impl Signal {
    /// Every signal that carries nothing but its name (all but [`Signal::Cancel`]).
    pub const ALL: [Signal; 4] = [
        Signal::Pause,
        Signal::Resume,
        Signal::RunNow,
        Signal::RequeueDead,
    ];

    /// The signal's name in a payload.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::RunNow => "run_now",
            Self::RequeueDead => "requeue_dead",
            Self::Cancel { .. } => "cancel",
        }
    }

    /// A payload naming the signal and the queue's table: `pause:jobs`; a cancel names its row
    /// between them: `cancel:42:jobs`. The table name comes last, whole, so any name reads back
    /// unchanged.
    pub fn payload(self, table: &str) -> String {
        match self {
            Self::Cancel { id } => format!("cancel:{id}:{table}"),
            _ => format!("{}:{table}", self.as_str()),
        }
    }

    /// Reads a [`payload`](Self::payload): the signal and the table, or `None` for text that is
    /// not one (another program's notification on the channel). A broker that predates a signal
    /// reads its payload as `None` and ignores it (its poll still finds the change).
    pub fn parse(payload: &str) -> Option<(Signal, &str)> {
        let (name, rest) = payload.split_once(':')?;
        if name == "cancel" {
            let (id, table) = rest.split_once(':')?;
            return Some((
                Self::Cancel {
                    id: id.parse().ok()?,
                },
                table,
            ));
        }
        let signal = Self::ALL.into_iter().find(|s| s.as_str() == name)?;
        Some((signal, rest))
    }
}

/// Whether handlers of one table may start in this broker: shut while the queue is paused.
/// Every subscription of the table in the broker shares it.
///
/// A delivery task passes it right before its handler starts ([`Gate::enter`]); a pause
/// through this broker shuts it and then waits for the handlers that passed it to have started
/// ([`Gate::shut`]), so after `pause` returns no handler starts in this broker.
#[derive(Debug)]
pub(crate) struct Gate {
    /// Paused, for the check on the path to every handler.
    paused: AtomicBool,
    /// Paused, for the deliveries that wait for a resume.
    watch: watch::Sender<bool>,
    /// Handlers that passed the gate and have not been polled yet.
    starting: AtomicUsize,
    /// Counts every change a signal or a pause made; a read of the pause state that began
    /// before one is stale (see [`Gate::apply_read`]).
    seq: AtomicU64,
    /// The table's cancel requests and the signals of its deliveries in work in this broker.
    pub(crate) cancels: crate::cancel::CancelBoard,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            paused: AtomicBool::new(false),
            watch: watch::Sender::new(false),
            starting: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            cancels: crate::cancel::CancelBoard::default(),
        }
    }
}

/// A handler that passed the gate and is about to start: until it drops (after the handler's
/// first poll), a pause through this broker waits for it.
#[derive(Debug)]
pub(crate) struct Entered<'a>(&'a Gate);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.starting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    /// Whether the queue is paused, as this broker knows it now.
    pub(crate) fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// The change counter, read before a read of the pause state.
    pub(crate) fn seq(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    /// Sets the state from a signal or a pause through this broker.
    pub(crate) fn set(&self, paused: bool) {
        self.seq.fetch_add(1, Ordering::SeqCst);
        self.store(paused);
    }

    fn store(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
        self.watch
            .send_if_modified(|p| std::mem::replace(p, paused) != paused);
    }

    /// Sets the state from a read of the database that began at change `seq`, unless a signal
    /// changed it since (the signal is newer than the read).
    pub(crate) fn apply_read(&self, seq: u64, paused: bool) {
        if self.seq() == seq {
            self.store(paused);
        }
    }

    /// Shuts the gate for a pause through this broker, and returns once every handler that
    /// passed it before has started.
    pub(crate) async fn shut(&self) {
        self.set(true);
        // A delivery adds itself to `starting` before it reads `paused`, and the pause stores
        // `paused` before it reads `starting` (both sequentially consistent): either the
        // delivery sees the pause, or the pause sees the delivery and waits for its first poll,
        // which takes microseconds.
        while self.starting.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Passes the gate: at once while the queue runs; while it is paused, waits for a resume
    /// (`None` when `stop` comes first: the caller gives its row back unrun).
    pub(crate) async fn enter(&self, stop: impl Future<Output = ()>) -> Option<Entered<'_>> {
        let mut resumed = self.watch.subscribe();
        tokio::pin!(stop);
        loop {
            self.starting.fetch_add(1, Ordering::SeqCst);
            if !self.paused.load(Ordering::SeqCst) {
                return Some(Entered(self));
            }
            self.starting.fetch_sub(1, Ordering::SeqCst);
            tokio::select! {
                biased;
                () = &mut stop => return None,
                _ = resumed.wait_for(|p| !*p) => {}
            }
        }
    }
}

/// A future that keeps an [`Entered`] until its first poll: the handler has started once it
/// was polled. The handler's future is boxed already (`Unpin`), so this adds no allocation.
pub(crate) struct Started<'a, F> {
    inner: F,
    entered: Option<Entered<'a>>,
}

impl<'a, F> Started<'a, F> {
    pub(crate) fn new(inner: F, entered: Entered<'a>) -> Self {
        Self {
            inner,
            entered: Some(entered),
        }
    }
}

impl<F: Future + Unpin> Future for Started<'_, F> {
    type Output = F::Output;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let out = std::pin::Pin::new(&mut self.inner).poll(cx);
        self.entered = None;
        out
    }
}

/// What a backend wakes when it hears from another process about one subscription's table
/// (see [`Backend::listen`](super::Backend::listen)).
#[derive(Debug)]
pub struct Wakeup {
    wake: Arc<Notify>,
    gate: Arc<Gate>,
    /// The pause state must be read again: signals may have been missed.
    reread: AtomicBool,
    /// Claims must read from the start of the claim order once (rows came back before the
    /// claims' head).
    rescan: AtomicBool,
}

impl Wakeup {
    pub(crate) fn new(wake: Arc<Notify>, gate: Arc<Gate>) -> Self {
        Self {
            wake,
            gate,
            reread: AtomicBool::new(false),
            rescan: AtomicBool::new(false),
        }
    }

    /// Rows may have become claimable (a publish): the subscription looks at once.
    pub fn rows(&self) {
        self.wake.notify_one();
    }

    /// An operator's signal for this table: a pause shuts the gate at once (the signal is sent
    /// only once the pause committed); a cancel raises the signal of the row's delivery if it
    /// is in work here (and keeps the request, so a claim of the row does not run it); every
    /// signal also makes the subscription read the pause state again and look.
    pub fn signal(&self, signal: Signal) {
        match signal {
            Signal::Pause => self.gate.set(true),
            Signal::Resume => self.gate.set(false),
            Signal::RequeueDead => self.rescan.store(true, Ordering::SeqCst),
            Signal::RunNow => {}
            Signal::Cancel { id } => {
                self.gate.cancels.request(id);
                return;
            }
        }
        self.reread.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Notifications may have been lost (the listening connection dropped and came back): the
    /// subscription reads the pause state again and looks, so a missed signal costs one read.
    pub fn missed(&self) {
        self.reread.store(true, Ordering::SeqCst);
        self.rescan.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Whether the pause state must be read again; clears it.
    pub(crate) fn take_reread(&self) -> bool {
        self.reread.swap(false, Ordering::SeqCst)
    }

    /// Whether the next claim must read from the start; clears it.
    pub(crate) fn take_rescan(&self) -> bool {
        self.rescan.swap(false, Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_read_back_with_any_table_name() {
        for s in Signal::ALL {
            for t in ["jobs", "a:b", "\"odd name\"", ""] {
                assert_eq!(Signal::parse(&s.payload(t)), Some((s, t)));
            }
        }
        for t in ["jobs", "a:b", ""] {
            let s = Signal::Cancel { id: -42 };
            assert_eq!(Signal::parse(&s.payload(t)), Some((s, t)));
        }
        assert_eq!(Signal::parse("hello"), None);
        assert_eq!(Signal::parse("stop:jobs"), None);
        assert_eq!(Signal::parse("cancel:jobs"), None, "a cancel names its row");
        assert_eq!(Signal::parse("cancel:x:jobs"), None);
    }

    #[tokio::test]
    async fn a_read_older_than_a_signal_does_not_undo_it() {
        let g = Gate::default();
        let seq = g.seq();
        g.set(true);
        g.apply_read(seq, false);
        assert!(g.is_paused());
        g.apply_read(g.seq(), false);
        assert!(!g.is_paused());
    }

    #[tokio::test]
    async fn a_paused_gate_holds_until_resume_or_stop() {
        let g = Arc::new(Gate::default());
        g.shut().await;
        let stop = Arc::new(Notify::new());
        let (g2, s2) = (g.clone(), stop.clone());
        let waiting = tokio::spawn(async move { g2.enter(s2.notified()).await.is_some() });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        g.set(false);
        assert!(waiting.await.unwrap());
        g.shut().await;
        let (g2, s2) = (g.clone(), stop.clone());
        let waiting = tokio::spawn(async move { g2.enter(s2.notified()).await.is_some() });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        stop.notify_one();
        assert!(!waiting.await.unwrap());
    }
}

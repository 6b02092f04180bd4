//! Lease mode: an expiry in `locked_until` holds each claimed row. The token (expiry and
//! attempt) fences every settlement and renewal; renewal moves it forward. A dropped hold gives
//! the row back at once in a clean-up task (without a runtime the lease runs out).
//!
//! Acks that finish close together settle in one statement where the backend can
//! ([`LeaseStrategy::ack_many`]): one ack statement of a queue runs at a time and takes every
//! ack that arrived while the last one ran (as a database groups commits), so a batch costs
//! nothing when acks come one by one and grows with the load. A second statement starts only
//! for an ack that waited [`SECOND_FLIGHT_AFTER`] (the first is slow: it waits for a row lock
//! a user's transaction holds, say), so a stuck statement never holds up every ack.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::driver::{
    Action, Backend, ClaimedRow, ErrorClass, LeaseStrategy, LeaseToken, Position, Settle,
};
use crate::driver::{clock, retry};
use crate::error::{Result, SqlxBrokerError};
use crate::inner::Shared;
use crate::metrics::Counter;

/// The most acks one statement settles.
const MAX_ACK_BATCH: usize = 64;

/// The most ack statements of one queue in flight at once: more than one, so a statement that
/// waits (for a row lock a user's transaction holds, say) does not hold up every ack.
const MAX_ACK_FLIGHTS: usize = 2;

/// How long an ack waits for the statement in flight before it starts another (while fewer
/// than [`MAX_ACK_FLIGHTS`] run). Two statements side by side from the start cut each one's
/// batch in half: measured on PostgreSQL (lease, batch 16, 8 workers) one statement at a time
/// acked about 10-25% more rows per second than two. An ack statement takes well under a
/// millisecond there, so an ack that waits this long waits behind a slow one.
const SECOND_FLIGHT_AFTER: std::time::Duration = std::time::Duration::from_millis(5);

/// A table's lease strategy and its ack task.
pub(crate) struct LeaseMode<B: Backend> {
    strategy: Arc<B::Lease>,
    acks: Arc<AckBatch>,
}

impl<B: Backend> LeaseMode<B> {
    pub(crate) fn new(strategy: B::Lease) -> Self {
        Self {
            strategy: Arc::new(strategy),
            acks: Arc::default(),
        }
    }

    /// Gives back the connections the strategy keeps for its next statement.
    pub(crate) fn release_kept(&self) {
        self.strategy.release_kept();
    }

    /// How many connections the strategy keeps now.
    pub(crate) fn kept(&self) -> usize {
        self.strategy.kept()
    }
}

/// One ack waiting for an ack statement.
struct PendingAck {
    token: LeaseToken,
    settle: Settle,
    answer: oneshot::Sender<AckAnswer>,
}

/// What an ack statement made of one ack.
#[derive(Debug, Clone, Copy)]
enum AckAnswer {
    /// The statement ran: whether it acked this row (`false`: the row no longer held the
    /// token, and nothing changed), and whether it acked other rows with it.
    Acked { acked: bool, batched: bool },
    /// The statement failed, or the backend acks one row at a time: settle the row alone.
    /// `may_have_landed`: the statement lost its connection, so it may have acked the row.
    Alone { may_have_landed: bool },
}

/// The acks of one queue waiting for a statement, and how many statements are in flight.
#[derive(Default)]
struct AckQueue {
    waiting: Vec<PendingAck>,
    flights: usize,
}

/// Groups a queue's acks into shared statements. An ack that finds no statement in flight runs
/// one itself, over every ack waiting and its own; otherwise it waits to be taken into the
/// next, and after [`SECOND_FLIGHT_AFTER`] still waiting it runs one beside the others if fewer
/// than [`MAX_ACK_FLIGHTS`] run. A statement's runner goes on with the acks that arrived
/// meanwhile before it returns, so no ack is left waiting without a runner.
#[derive(Default)]
pub(crate) struct AckBatch {
    queue: Mutex<AckQueue>,
    /// The backend acks one row at a time (its `ack_many` said so).
    alone: AtomicBool,
}

impl AckBatch {
    fn lock(&self) -> std::sync::MutexGuard<'_, AckQueue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Acks `settle`'s row with others: whether it still held `token` and was acked, and
    /// whether the statement acked other rows with it; `Err(may_have_landed)` when it must be
    /// settled alone (`true` if a statement that took it lost its connection: see
    /// [`AckAnswer::Alone`]). `lost_connection` tells a lost connection from other errors.
    async fn ack<L: LeaseStrategy>(
        &self,
        strategy: &L,
        token: LeaseToken,
        settle: Settle,
        lost_connection: &(dyn Fn(&SqlxBrokerError) -> bool + Sync),
    ) -> Result<(bool, bool), bool> {
        if self.alone.load(Ordering::Relaxed) {
            return Err(false);
        }
        let (answer, mut answered) = oneshot::channel();
        let id = settle.id;
        let me = PendingAck {
            token,
            settle,
            answer,
        };
        let batch = {
            let mut q = self.lock();
            if q.flights > 0 {
                q.waiting.push(me);
                None
            } else {
                q.flights += 1;
                let mut batch = take_batch(&mut q.waiting);
                batch.push(me);
                Some(batch)
            }
        };
        let answer = match batch {
            Some(batch) => {
                self.run(strategy, batch, lost_connection).await;
                answered.await
            }
            None => match tokio::time::timeout(SECOND_FLIGHT_AFTER, &mut answered).await {
                Ok(answer) => answer,
                Err(_) => {
                    // Still unanswered: run a statement beside the slow one, if this ack is
                    // still waiting (not taken into a statement in flight) and there is room.
                    let batch = {
                        let mut q = self.lock();
                        if q.flights < MAX_ACK_FLIGHTS
                            && q.waiting.iter().any(|p| p.settle.id == id)
                        {
                            q.flights += 1;
                            Some(take_batch(&mut q.waiting))
                        } else {
                            None
                        }
                    };
                    if let Some(batch) = batch {
                        self.run(strategy, batch, lost_connection).await;
                    }
                    answered.await
                }
            },
        };
        match answer {
            Ok(AckAnswer::Acked { acked, batched }) => Ok((acked, batched)),
            Ok(AckAnswer::Alone { may_have_landed }) => Err(may_have_landed),
            Err(_) => Err(false),
        }
    }

    /// Runs ack statements, starting with `batch`, until no ack waits; holds one place among
    /// the flights (taken by the caller) and gives it back however it ends.
    async fn run<L: LeaseStrategy>(
        &self,
        strategy: &L,
        batch: Vec<PendingAck>,
        lost_connection: &(dyn Fn(&SqlxBrokerError) -> bool + Sync),
    ) {
        let mut runner = Runner {
            acks: self,
            done: false,
        };
        self.flight(strategy, batch, lost_connection).await;
        loop {
            let next = {
                let mut q = self.lock();
                if q.waiting.is_empty() {
                    // Under the lock, so an ack arriving now finds the place free.
                    q.flights -= 1;
                    runner.done = true;
                    return;
                }
                take_batch(&mut q.waiting)
            };
            self.flight(strategy, next, lost_connection).await;
        }
    }

    /// One ack statement over `batch`, one try; tells each ack what became of it.
    async fn flight<L: LeaseStrategy>(
        &self,
        strategy: &L,
        batch: Vec<PendingAck>,
        lost_connection: &(dyn Fn(&SqlxBrokerError) -> bool + Sync),
    ) {
        let acks: Vec<(i64, LeaseToken)> = batch.iter().map(|p| (p.settle.id, p.token)).collect();
        let now_ms = batch
            .iter()
            .map(|p| p.settle.now_ms)
            .max()
            .unwrap_or_default();
        let batched = batch.len() > 1;
        let mut may_have_landed = false;
        // One try, waiting for a connection only until the earliest deadline of its acks, as a
        // fenced settlement does (see `retry::acquire`): the rows it could not ack go on alone.
        let deadline_ms = acks
            .iter()
            .map(|(_, t)| t.expires_ms - retry::LEASE_MARGIN_MS)
            .min()
            .unwrap_or(i64::MAX);
        let tried = retry::acquiring_by(deadline_ms, strategy.ack_many(&acks, now_ms)).await;
        let acked = match tried {
            Ok(Some(_)) if retry::take_lost_reply() => {
                tracing::debug!(
                    "an ack statement's reply was dropped on a test's request; acking its rows one by one"
                );
                may_have_landed = true;
                None
            }
            Ok(Some(acked)) => Some(acked),
            Ok(None) => {
                self.alone.store(true, Ordering::Relaxed);
                None
            }
            Err(e) => {
                // Each ack runs again alone, with the per-row retries; a row whose ack fails
                // for a reason of its own (a trigger, a constraint) then fails alone. After a
                // lost connection the statement may have landed: the fence then refuses the
                // row's own ack, and the settlement looks at the row (see `LeaseHold::settle`).
                may_have_landed = lost_connection(&e);
                tracing::debug!(error = %e, rows = batch.len(), may_have_landed, "an ack statement failed; acking its rows one by one");
                None
            }
        };
        for p in batch {
            let answer = match &acked {
                Some(acked) => AckAnswer::Acked {
                    acked: acked.contains(&p.settle.id),
                    batched,
                },
                None => AckAnswer::Alone { may_have_landed },
            };
            let _ = p.answer.send(answer);
        }
    }
}

/// Up to [`MAX_ACK_BATCH`] waiting acks, oldest first.
fn take_batch(waiting: &mut Vec<PendingAck>) -> Vec<PendingAck> {
    let n = waiting.len().min(MAX_ACK_BATCH);
    waiting.drain(..n).collect()
}

/// A statement runner's place among the flights, given back however the runner ends. A runner
/// cut short (its settlement future dropped) leaves no ack waiting for it: the waiting acks
/// are sent back to be settled alone.
struct Runner<'a> {
    acks: &'a AckBatch,
    /// The runner gave its place back itself.
    done: bool,
}

impl Drop for Runner<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut q = self.acks.lock();
        q.flights -= 1;
        if q.flights == 0 {
            // Dropping the answers' senders sends each waiting ack back alone.
            q.waiting.clear();
        }
    }
}

/// A lease token that renewal can move while the handler runs.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    token: Mutex<LeaseToken>,
    lost: AtomicBool,
}

impl LeaseCell {
    fn new(token: LeaseToken) -> Self {
        Self {
            token: Mutex::new(token),
            lost: AtomicBool::new(false),
        }
    }
    pub(crate) fn token(&self) -> LeaseToken {
        *self.token.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn set(&self, token: LeaseToken) {
        *self.token.lock().unwrap_or_else(|p| p.into_inner()) = token;
    }
    /// The settlement that gives the row back, due at once, while it still holds this lease.
    fn release(&self, id: i64) -> Settle {
        Settle {
            id,
            action: Action::Retry { due_ms: None },
            now_ms: clock::now_ms(),
            attempt: self.token().attempt,
        }
    }
    fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// What holds a lease delivery's row. Renewal shares the cell; dropping the hold unsettled
/// releases the lease.
pub(crate) struct LeaseHold<B: Backend> {
    strategy: Arc<B::Lease>,
    acks: Arc<AckBatch>,
    shared: Arc<Shared<B>>,
    id: i64,
    cell: Arc<LeaseCell>,
    /// Whether the row still needs giving back when the hold drops.
    armed: bool,
}

/// Claims up to `limit` rows in one statement, each with its lease.
pub(crate) async fn claim<B: Backend>(
    mode: &LeaseMode<B>,
    shared: &Arc<Shared<B>>,
    limit: usize,
    now_ms: i64,
    from: Option<Position>,
) -> Result<Vec<(ClaimedRow<B::Db>, LeaseHold<B>)>> {
    let expires_ms = clock::lease_expiry_ms(now_ms, shared.table.lease_seconds());
    let rows = mode.strategy.claim(limit, now_ms, expires_ms, from).await?;
    if !rows.is_empty() && clock::now_ms() - now_ms > (expires_ms - now_ms) / 2 {
        // The claim's reply came back after half its leases had gone by: the server or the
        // network stalled it (a Galera cluster changing members, a failover), and the rows may
        // be another claim's before a handler could settle them (or already are). No handler
        // starts on them: they count as claimed and lost, and go back fenced on their tokens
        // (a release that changes nothing where another claim has them).
        let n = rows.len() as u64;
        tracing::warn!(
            table = shared.name(),
            rows = n,
            "a claim came back after its leases ran out; its rows run on a later claim"
        );
        shared.metrics.add(Counter::Claimed, n);
        shared.metrics.add(Counter::LeaseLost, n);
        for row in rows {
            crate::events::emit(|| crate::events::EngineEvent::ClaimLost {
                table: shared.name(),
                id: row.id,
                attempt: row.attempt,
                at: std::time::SystemTime::now(),
            });
            drop(LeaseHold {
                strategy: mode.strategy.clone(),
                acks: mode.acks.clone(),
                shared: shared.clone(),
                id: row.id,
                cell: Arc::new(LeaseCell::new(LeaseToken {
                    expires_ms,
                    attempt: row.attempt + 1,
                })),
                armed: true,
            });
        }
        return Ok(Vec::new());
    }
    Ok(rows
        .into_iter()
        .map(|row| {
            let token = LeaseToken {
                expires_ms,
                attempt: row.attempt + 1,
            };
            let hold = LeaseHold {
                strategy: mode.strategy.clone(),
                acks: mode.acks.clone(),
                shared: shared.clone(),
                id: row.id,
                cell: Arc::new(LeaseCell::new(token)),
                armed: true,
            };
            (row, hold)
        })
        .collect())
}

impl<B: Backend> LeaseHold<B> {
    pub(crate) fn cell(&self) -> &Arc<LeaseCell> {
        &self.cell
    }

    /// Settles while the row still holds the lease; [`SqlxBrokerError::LeaseLost`] (or
    /// `RowGone`) and nothing changed when it does not.
    ///
    /// A refusal after a lost connection (a try of this settlement, or the shared ack statement
    /// that took it, got no reply) may be the fence refusing the settlement's own first try,
    /// which landed: the row is then looked at, and an ack whose row is gone (or marked
    /// processed), or a dead letter whose row is dead-lettered, counts as done.
    pub(crate) async fn settle(mut self, settle: Settle) -> Result<()> {
        self.armed = false;
        let token = self.cell.token();
        let backend = &self.shared.broker.backend;
        let lost_connection = |e: &SqlxBrokerError| {
            e.sqlx_source()
                .is_some_and(|s| backend.classify(s) == ErrorClass::Connection)
        };
        let batched = match settle.action {
            Action::Ack => {
                self.acks
                    .ack(&*self.strategy, token, settle, &lost_connection)
                    .await
            }
            _ => Err(false),
        };
        let (settled, landed_before) = match batched {
            Ok((acked, batched)) => {
                if acked && batched {
                    self.shared.metrics.add(Counter::BatchedAcks, 1);
                }
                (Ok(acked), false)
            }
            Err(may_have_landed) => {
                let (settled, lost) =
                    retry::watching_lost_connections(self.strategy.settle(token, settle)).await;
                (settled, may_have_landed || lost)
            }
        };
        match settled {
            Ok(true) => Ok(()),
            Ok(false) if landed_before && self.own_try_landed(settle).await => {
                tracing::debug!(table = self.shared.name(), id = settle.id, ?settle.action, "a try whose reply was lost had settled the row; the settlement counts as done");
                self.shared.settle_failures.clear(settle.id);
                Ok(())
            }
            Ok(false) => {
                let e = self.shared.lost(settle.id).await;
                self.shared.settle_failed(settle.id, &e);
                Err(e)
            }
            Err(e) => {
                // Counted before the row is given back, so its next claim sees the failure.
                self.shared.settle_failed(settle.id, &e);
                // The row still holds this lease: give it back now, as a dropped delivery's
                // is, instead of leaving it until the lease runs out (its next delivery backs
                // off). In a clean-up task, so the settlement ends here: counted, with nothing
                // left to wait for (a shutdown waits for clean-ups up to its deadline).
                self.release_in_cleanup();
                Err(e)
            }
        }
    }
}

impl<B: Backend> LeaseHold<B> {
    /// Whether row `settle.id` shows `settle`'s own effect: an ack's row is gone or marked
    /// processed; a dead letter's row is dead-lettered. Only asked after a try of this
    /// settlement lost its connection and a later one was refused: the row held this delivery's
    /// lease until then, so nothing but that try can have done it (short of a hand-made delete
    /// in that window). A failed look says no.
    async fn own_try_landed(&self, settle: Settle) -> bool {
        let state = self
            .shared
            .broker
            .backend
            .row_state(&self.shared.table, settle.id)
            .await;
        match (settle.action, state) {
            (Action::Ack | Action::Cancel, Ok(None)) => true,
            (Action::Ack, Ok(Some(s))) => s.processed,
            (Action::DeadLetter, Ok(Some(s))) => s.dead,
            _ => false,
        }
    }
}

/// Moves the lease forward from the token the cell holds; marks the cell lost when the row no
/// longer holds it.
pub(crate) async fn renew<B: Backend>(
    strategy: &B::Lease,
    shared: &Shared<B>,
    id: i64,
    cell: &LeaseCell,
) -> Result<()> {
    if cell.is_lost() {
        return Err(SqlxBrokerError::LeaseLost {
            table: shared.name().to_owned(),
            id,
        });
    }
    let token = cell.token();
    let expires_ms = clock::lease_expiry_ms(clock::now_ms(), shared.table.lease_seconds());
    if expires_ms == token.expires_ms {
        return Ok(());
    }
    if strategy.renew(id, token, expires_ms).await? {
        cell.set(LeaseToken {
            expires_ms,
            attempt: token.attempt,
        });
        Ok(())
    } else {
        cell.mark_lost();
        Err(shared.lost(id).await)
    }
}

impl<B: Backend> LeaseHold<B> {
    /// A renewer for the engine's renewal loop, which runs beside the handler.
    pub(crate) fn renewer(&self) -> Renewer<B> {
        Renewer {
            strategy: self.strategy.clone(),
            shared: self.shared.clone(),
            id: self.id,
            cell: self.cell.clone(),
        }
    }
}

/// What the engine's renewal loop needs of a lease hold.
pub(crate) struct Renewer<B: Backend> {
    strategy: Arc<B::Lease>,
    shared: Arc<Shared<B>>,
    id: i64,
    cell: Arc<LeaseCell>,
}

impl<B: Backend> Renewer<B> {
    pub(crate) async fn renew(&self) -> Result<()> {
        renew(&*self.strategy, &self.shared, self.id, &self.cell).await
    }
    pub(crate) fn is_lost(&self) -> bool {
        self.cell.is_lost()
    }
}

impl<B: Backend> LeaseHold<B> {
    /// Gives the row back, due at once, in a clean-up task, while its lease lasts: a release
    /// fenced on a lease that ran out changes nothing (another claim may hold the row, or it
    /// is claimable already), and after a server went away it would wait for a connection
    /// for the pool's whole acquire timeout. A release that fails leaves the lease to run
    /// out.
    fn release_in_cleanup(&self) {
        let token = self.cell.token();
        if clock::now_ms() >= token.expires_ms {
            return;
        }
        let strategy = self.strategy.clone();
        let shared = self.shared.clone();
        let release = self.cell.release(self.id);
        let id = self.id;
        self.shared.broker.spawn_cleanup(async move {
            if let Err(e) = strategy.settle(token, release).await {
                tracing::warn!(table = shared.name(), id, error = %e, "release of a lease failed; it runs out instead");
            }
        });
    }
}

impl<B: Backend> Drop for LeaseHold<B> {
    fn drop(&mut self) {
        if self.armed {
            self.release_in_cleanup();
        }
    }
}

//! Advisory mode: a key lock, on a connection of its own where the database keeps keys in
//! sessions, holds every row with that key. The claim reads candidates, tries each key without
//! waiting, then takes the row while it is still claimable. A dropped hold unlocks the key in a
//! clean-up task (without a runtime the lock's own drop frees it).

use std::sync::Arc;

use crate::driver::{AdvisoryStrategy, Backend, Candidate, ClaimedRow, Settle};
use crate::error::{Result, SqlxBrokerError};
use crate::inner::Shared;

type Lock<B> = <<B as Backend>::Advisory as AdvisoryStrategy>::KeyLock;

/// A held advisory key; unlocks (in a clean-up task) when dropped unsettled.
pub(crate) struct KeyHold<B: Backend> {
    strategy: Arc<B::Advisory>,
    shared: Arc<Shared<B>>,
    key: String,
    lock: Option<Lock<B>>,
}

impl<B: Backend> KeyHold<B> {
    fn take_lock(&mut self) -> Lock<B> {
        self.lock
            .take()
            .expect("a key hold keeps its lock until unlocked")
    }

    async fn unlock(mut self) -> Result<()> {
        let lock = self.take_lock();
        let result = self.strategy.unlock(lock).await;
        self.shared.broker.forget_key(&self.key);
        result
    }

    /// Settles the row; the key unlocks once the settlement landed. A settlement the key's
    /// fence refused because the row is gone says so ([`SqlxBrokerError::RowGone`]).
    ///
    /// A settlement that landed counts as done even when the unlock after it fails: the
    /// strategy closes the key's connection then, which frees the key as the unlock would have
    /// (a PostgreSQL failover ending the session between the two counted such acks as failed).
    pub(crate) async fn settle(mut self, settle: Settle) -> Result<()> {
        let lock = self
            .lock
            .as_mut()
            .expect("a key hold keeps its lock until unlocked");
        let shared = self.shared.clone();
        let out = match self.strategy.settle(lock, settle).await {
            Err(SqlxBrokerError::ClaimLost { .. }) if self.shared.is_gone(settle.id).await => {
                Err(self.shared.gone(settle.id))
            }
            Err(e) => Err(e),
            Ok(()) => {
                let key = self.key.clone();
                if let Err(e) = self.unlock().await {
                    tracing::warn!(table = shared.name(), id = settle.id, key, error = %e, "the row was settled; unlocking its key failed, so the key's connection was closed, which frees it");
                }
                Ok(())
            }
        };
        if let Err(e) = &out {
            // Counted before the drop unlocks the key (when the settlement failed), so the
            // row's next claim sees it.
            shared.settle_failed(settle.id, e);
        }
        out
    }
}

impl<B: Backend> Drop for KeyHold<B> {
    fn drop(&mut self) {
        let Some(lock) = self.lock.take() else { return };
        let strategy = self.strategy.clone();
        let shared = self.shared.clone();
        let key = std::mem::take(&mut self.key);
        // Unlocking needs a statement; run it in a tracked clean-up task. Without a runtime the
        // lock's own drop frees the key (its connection closes).
        self.shared.broker.clone().spawn_cleanup(async move {
            if let Err(e) = strategy.unlock(lock).await {
                tracing::warn!(table = shared.name(), key, error = %e, "unlock of a dropped delivery failed");
            }
            shared.broker.forget_key(&key);
        });
    }
}

/// Candidate reads one claim makes at most while every row it read was under a held key: on a
/// FIFO table each window four times the last (16, 64, 256, 1,024, 4,096 rows for a claim of up
/// to four), so a claim passes up to about 5,000 rows of held keys before it gives up until its
/// next poll; otherwise the first read in claim order and then up to four steps of the key walk.
const CANDIDATE_READS: usize = 5;

/// Keys one step of the key walk visits.
const WALK_KEYS: usize = 32;

/// Claims up to `limit` rows: a key lock and a take for each.
///
/// Candidates come in claim order first. When a full window of them held only rows whose keys
/// are in work (one busy key ahead of the rest), the claim visits the keys instead, one index
/// probe per key from just after the key the last walk stopped at ([`AdvisoryStrategy::walk_keys`]),
/// so the busy key's backlog costs nothing however long it is. On a FIFO table the walk visits
/// the groups and takes their heads. Tables without a walk
/// ([`TableDescription::key_walk_columns`](crate::TableDescription::key_walk_columns): keys read
/// from the id alone) read on in claim order, in growing windows.
pub(crate) async fn claim<B: Backend>(
    strategy: &Arc<B::Advisory>,
    shared: &Arc<Shared<B>>,
    limit: usize,
    now_ms: i64,
) -> Result<Vec<(ClaimedRow<B::Db>, KeyHold<B>)>> {
    let s = &**strategy;
    let broker = &shared.broker;
    let walks = shared.table.key_walk_columns().is_some();
    // A FIFO table's candidates in claim order are only its rows without a group (the claim
    // index holds no others); its grouped rows come through the walk of the groups, always.
    let fifo_walk = walks && shared.table.fifo();
    let mut out = Vec::new();
    // Ask for more candidates than slots: some keys will be held elsewhere, and the rest serve
    // the next claims.
    let mut window = limit.saturating_mul(4).max(16);
    let mut reads = 0;
    let mut skip = 0;
    // Where this claim's reads in claim order start, asked of the head at the first.
    let mut from = None;
    // Whether the last read may have more rows after it (a full window, or a walk that has
    // keys left to visit).
    let mut more = false;
    while out.len() < limit {
        // Candidates left over by a recent read come first; the lock and the take check each
        // one again, so a stale one costs a statement, never a wrong claim.
        let c = match shared.candidates.pop() {
            Some(c) => c,
            // A read whose every row was passed over (its keys held) reads on: otherwise rows of
            // one held key filling the window would keep every other key's rows waiting until
            // they drained one by one.
            None if reads > 0
                && !(more && (out.is_empty() || fifo_walk) && reads < CANDIDATE_READS) =>
            {
                break;
            }
            None if reads > 0 && walks => {
                reads += 1;
                let after = shared
                    .key_cursor
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                let walk = s.walk_keys(after.as_deref(), WALK_KEYS, now_ms).await?;
                // A step that reached the last key starts the next from the first; one that
                // started there and reached it has seen every key.
                more = walk.visited == WALK_KEYS || after.is_some();
                *shared.key_cursor.lock().unwrap_or_else(|p| p.into_inner()) =
                    if walk.visited < WALK_KEYS {
                        None
                    } else {
                        walk.last
                    };
                shared.candidates.refill(walk.candidates);
                continue;
            }
            None => {
                if reads > 0 {
                    window = window.saturating_mul(4);
                }
                if reads == 0 {
                    from = shared.head.start();
                }
                reads += 1;
                let fresh = s.candidates(window, skip, now_ms, from).await?;
                // The first row a read from the head found, taken or not: a row passed over
                // because its key is held stays ahead of the head until its key is free.
                if skip == 0
                    && let Some(first) = fresh.iter().map(Candidate::position).min()
                {
                    shared.head.found(first);
                }
                more = fifo_walk || fresh.len() == window;
                skip = skip.saturating_add(fresh.len());
                shared.candidates.refill(fresh);
                continue;
            }
        };
        if c.held {
            continue;
        }
        // A key this broker holds already is skipped without spending a connection; the insert
        // also reserves the key against this broker's other claims.
        if broker.key_is_held(&c.key) || !broker.hold_key(&c.key) {
            continue;
        }
        let mut lock = match s.try_lock(&c.key).await {
            Ok(Some(lock)) => lock,
            Ok(None) => {
                broker.forget_key(&c.key);
                continue;
            }
            Err(e) => {
                broker.forget_key(&c.key);
                return finish(out, e);
            }
        };
        match s.take(&mut lock, c.id, now_ms).await {
            Ok(Some(row)) => {
                let hold = KeyHold {
                    strategy: strategy.clone(),
                    shared: shared.clone(),
                    key: c.key,
                    lock: Some(lock),
                };
                out.push((row, hold));
            }
            Ok(None) => {
                let _ = s.unlock(lock).await;
                broker.forget_key(&c.key);
            }
            Err(e) => {
                let _ = s.unlock(lock).await;
                broker.forget_key(&c.key);
                return finish(out, e);
            }
        }
    }
    Ok(out)
}

/// An advisory claim that failed part way keeps what it took: those rows are claimed and must be
/// delivered, so the error only surfaces when nothing was taken.
fn finish<T>(out: Vec<T>, err: SqlxBrokerError) -> Result<Vec<T>> {
    if out.is_empty() {
        return Err(err);
    }
    tracing::warn!(error = %err, "advisory claim stopped early");
    Ok(out)
}

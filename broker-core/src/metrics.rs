//! Counters a user can read ([`MetricsSnapshot`]), and, with the `metrics` feature (on by
//! default), the same counters, the histograms and the gauges exported through the [`metrics`
//! crate](https://docs.rs/metrics)'s facade, labelled by table.
//!
//! | name | kind | what |
//! |---|---|---|
//! | `sqlx_broker_claimed_total` and one `sqlx_broker_<outcome>_total` per field of [`MetricsSnapshot`] | counter | as the field |
//! | `sqlx_broker_handler_seconds` | histogram | how long handlers ran |
//! | `sqlx_broker_claim_seconds` | histogram | one claim's round trips, from its start to its rows |
//! | `sqlx_broker_due_to_start_seconds` | histogram | from a row's due time to its handler's start (rows with a due time) |
//! | `sqlx_broker_in_work` | gauge | deliveries whose handler runs now |
//! | `sqlx_broker_held` | gauge | rows claimed and not yet settled or given back: waiting for a worker, in work, or settling |
//! | `sqlx_broker_depth`, `sqlx_broker_lag_seconds` | gauge | unfinished rows (due, scheduled, in work) and the queue's lag, while a sampler runs (`Queue::export_depth`) |
//!
//! Handles are made when a queue is prepared: install the recorder (the exporter) before
//! preparing queues.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// The counters of [`MetricsSnapshot`], by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    Claimed,
    Acked,
    Retried,
    DeadLettered,
    LeaseLost,
    HandlerErrors,
    Panics,
    ClaimErrors,
    ClaimConflicts,
    DecodeErrors,
    SettleFailed,
    Gone,
    Released,
    BatchedAcks,
    TimedOut,
    Snoozed,
    Cancelled,
}

impl Counter {
    const ALL: [Counter; 17] = [
        Counter::Claimed,
        Counter::Acked,
        Counter::Retried,
        Counter::DeadLettered,
        Counter::LeaseLost,
        Counter::HandlerErrors,
        Counter::Panics,
        Counter::ClaimErrors,
        Counter::ClaimConflicts,
        Counter::DecodeErrors,
        Counter::SettleFailed,
        Counter::Gone,
        Counter::Released,
        Counter::BatchedAcks,
        Counter::TimedOut,
        Counter::Snoozed,
        Counter::Cancelled,
    ];

    /// The exported counter's name.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn name(self) -> &'static str {
        match self {
            Self::Claimed => "sqlx_broker_claimed_total",
            Self::Acked => "sqlx_broker_acked_total",
            Self::Retried => "sqlx_broker_retried_total",
            Self::DeadLettered => "sqlx_broker_dead_lettered_total",
            Self::LeaseLost => "sqlx_broker_lease_lost_total",
            Self::HandlerErrors => "sqlx_broker_handler_errors_total",
            Self::Panics => "sqlx_broker_panics_total",
            Self::ClaimErrors => "sqlx_broker_claim_errors_total",
            Self::ClaimConflicts => "sqlx_broker_claim_conflicts_total",
            Self::DecodeErrors => "sqlx_broker_decode_errors_total",
            Self::SettleFailed => "sqlx_broker_settle_failed_total",
            Self::Gone => "sqlx_broker_gone_total",
            Self::Released => "sqlx_broker_released_total",
            Self::BatchedAcks => "sqlx_broker_batched_acks_total",
            Self::TimedOut => "sqlx_broker_timed_out_total",
            Self::Snoozed => "sqlx_broker_snoozed_total",
            Self::Cancelled => "sqlx_broker_cancelled_total",
        }
    }

    /// Whether a row counted here has left the broker's hands: one of the nine counters every
    /// claimed row ends in exactly once (see [`MetricsSnapshot`]).
    fn counts_a_row_out(self) -> bool {
        matches!(
            self,
            Self::Acked
                | Self::Retried
                | Self::DeadLettered
                | Self::LeaseLost
                | Self::Gone
                | Self::SettleFailed
                | Self::Released
                | Self::Snoozed
                | Self::Cancelled
        )
    }
}

/// Live counters of one queue (shared by every subscription and manual claim on it).
#[derive(Debug)]
pub(crate) struct Metrics {
    counters: [AtomicU64; Counter::ALL.len()],
    pub(crate) in_work: AtomicU64,
    /// Rows claimed and not yet counted out (see [`MetricsSnapshot::held`]). Signed, so a
    /// row counted out twice (a bug) shows as a mismatch rather than a wrapped gauge.
    held: AtomicI64,
    #[cfg(feature = "metrics")]
    export: Export,
}

/// The queue's handles in the `metrics` facade.
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Export {
    counters: Vec<metrics::Counter>,
    handler: metrics::Histogram,
    claim: metrics::Histogram,
    due_to_start: metrics::Histogram,
    in_work: metrics::Gauge,
    held: metrics::Gauge,
    depth: metrics::Gauge,
    lag: metrics::Gauge,
}

impl Metrics {
    /// The counters of the queue on `table`.
    pub(crate) fn new(table: &str) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = table;
        Self {
            counters: Default::default(),
            in_work: AtomicU64::new(0),
            held: AtomicI64::new(0),
            #[cfg(feature = "metrics")]
            export: {
                let label = || [("table", table.to_owned())];
                Export {
                    counters: Counter::ALL
                        .iter()
                        .map(|c| metrics::counter!(c.name(), &label()))
                        .collect(),
                    handler: metrics::histogram!("sqlx_broker_handler_seconds", &label()),
                    claim: metrics::histogram!("sqlx_broker_claim_seconds", &label()),
                    due_to_start: metrics::histogram!("sqlx_broker_due_to_start_seconds", &label()),
                    in_work: metrics::gauge!("sqlx_broker_in_work", &label()),
                    held: metrics::gauge!("sqlx_broker_held", &label()),
                    depth: metrics::gauge!("sqlx_broker_depth", &label()),
                    lag: metrics::gauge!("sqlx_broker_lag_seconds", &label()),
                }
            },
        }
    }

    /// Adds `n` to a counter, and keeps [`MetricsSnapshot::held`]: a claimed row is held
    /// before it counts as claimed, and counted out before it stops being held, so a reading
    /// (which reads `claimed` first, then `held`, then the rest) never finds a row in no counter.
    pub(crate) fn add(&self, counter: Counter, n: u64) {
        let rows = i64::try_from(n).unwrap_or(i64::MAX);
        if counter == Counter::Claimed {
            self.move_held(rows);
        }
        self.counters[counter as usize].fetch_add(n, Ordering::SeqCst);
        #[cfg(feature = "metrics")]
        self.export.counters[counter as usize].increment(n);
        if counter.counts_a_row_out() {
            self.move_held(-rows);
        }
    }

    fn move_held(&self, rows: i64) {
        self.held.fetch_add(rows, Ordering::SeqCst);
        // Exact up to 2^53 rows.
        #[cfg(feature = "metrics")]
        #[allow(clippy::cast_precision_loss)]
        self.export.held.increment(rows as f64);
    }

    fn get(&self, counter: Counter) -> u64 {
        self.counters[counter as usize].load(Ordering::SeqCst)
    }

    /// A handler ran for `seconds`.
    pub(crate) fn handler_ran(&self, seconds: f64) {
        #[cfg(feature = "metrics")]
        self.export.handler.record(seconds);
        #[cfg(not(feature = "metrics"))]
        let _ = seconds;
    }

    /// A claim took `seconds` from its start to its rows.
    pub(crate) fn claim_took(&self, seconds: f64) {
        #[cfg(feature = "metrics")]
        self.export.claim.record(seconds);
        #[cfg(not(feature = "metrics"))]
        let _ = seconds;
    }

    /// A handler started `seconds` after its row's due time.
    pub(crate) fn started_after_due(&self, seconds: f64) {
        #[cfg(feature = "metrics")]
        self.export.due_to_start.record(seconds.max(0.0));
        #[cfg(not(feature = "metrics"))]
        let _ = seconds;
    }

    /// A sampler read the queue: its unfinished rows and its lag.
    #[cfg(feature = "metrics")]
    pub(crate) fn sampled(&self, depth: u64, lag_seconds: Option<f64>) {
        // Exact up to 2^53 rows.
        #[allow(clippy::cast_precision_loss)]
        self.export.depth.set(depth as f64);
        if let Some(lag) = lag_seconds {
            self.export.lag.set(lag);
        }
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        // In this order (see `add`): a row that leaves work while this reads may count twice,
        // never not at all.
        let claimed = self.get(Counter::Claimed);
        let held = u64::try_from(self.held.load(Ordering::SeqCst)).unwrap_or(0);
        MetricsSnapshot {
            claimed,
            held,
            acked: self.get(Counter::Acked),
            retried: self.get(Counter::Retried),
            dead_lettered: self.get(Counter::DeadLettered),
            lease_lost: self.get(Counter::LeaseLost),
            in_work: self.in_work.load(Ordering::Relaxed),
            handler_errors: self.get(Counter::HandlerErrors),
            panics: self.get(Counter::Panics),
            claim_errors: self.get(Counter::ClaimErrors),
            claim_conflicts: self.get(Counter::ClaimConflicts),
            decode_errors: self.get(Counter::DecodeErrors),
            settle_failed: self.get(Counter::SettleFailed),
            gone: self.get(Counter::Gone),
            released: self.get(Counter::Released),
            batched_acks: self.get(Counter::BatchedAcks),
            timed_out: self.get(Counter::TimedOut),
            snoozed: self.get(Counter::Snoozed),
            cancelled: self.get(Counter::Cancelled),
        }
    }
}

/// A reading of a queue's counters.
///
/// Every claimed row leaves work exactly once, through one of nine counters, and is
/// [`held`](Self::held) until then, so at every moment:
///
/// `claimed = acked + retried + snoozed + dead_lettered + cancelled + lease_lost + gone + settle_failed + released + held`
///
/// At rest (no subscription running, no manual delivery held) `held` is 0. A reading is not
/// atomic: a row that leaves work while it is taken may show in both `held` and its counter
/// (the right side then reads one more), never in neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Rows handed out by claims.
    pub claimed: u64,
    /// Rows acked.
    pub acked: u64,
    /// Rows put back for another attempt.
    pub retried: u64,
    /// Rows put back for later without spending an attempt ([`Outcome::Snooze`](crate::Outcome::Snooze)).
    /// A snooze past the subscription's cap is counted in [`dead_lettered`](Self::dead_lettered)
    /// instead.
    pub snoozed: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// Settlements refused because the delivery's hold was lost: its lease ran out (lease
    /// mode), or its key's session died and the row was claimed again (advisory mode).
    pub lease_lost: u64,
    /// Deliveries whose handler is running now (a gauge). Rows a claim fetched ahead that
    /// wait for a free worker, and rows whose handler returned and whose settlement is still
    /// in flight, are not in it: they are in [`held`](Self::held).
    pub in_work: u64,
    /// Rows claimed and not yet settled or given back (a gauge): waiting for a free worker, in
    /// work, or settling. What [`claimed`](Self::claimed) holds beyond the nine counters that
    /// rows leave through. `stats()`'s `in_work` counts rows in work in the table, of every
    /// process, and so includes this process's held rows.
    pub held: u64,
    /// Handlers that returned an error.
    pub handler_errors: u64,
    /// Handlers that panicked.
    pub panics: u64,
    /// Claims that failed (the engine retries them after a backoff).
    pub claim_errors: u64,
    /// Claims the server undid after the backend's own quick retries because another claim
    /// took the same rows at the same time (a deadlock; on a Galera cluster, a claim on another
    /// node that won certification). The subscription claims again at once: a conflict means
    /// rows are there, so it is neither a claim error nor a reason to back off. Not one of the
    /// nine counters that rows leave through: a conflict hands out no row.
    pub claim_conflicts: u64,
    /// Rows whose columns did not decode into the handler's type.
    pub decode_errors: u64,
    /// Settlements that failed for any other reason, e.g. their statement failed (the row was
    /// released). A row whose settlement keeps
    /// failing is backed off and, after three failures in a row, dead-lettered without running
    /// its handler again (see the crate docs, "Settlements that fail").
    pub settle_failed: u64,
    /// Settlements that found their row deleted by something other than the broker while the
    /// delivery held it.
    pub gone: u64,
    /// Rows given back without a settlement: a delivery dropped unsettled (a handler cut by
    /// the shutdown deadline, rows fetched ahead and never run, a manual delivery dropped), a
    /// settlement refused before it ran (no dead-letter target, no due-time column, the broker
    /// closed, the handler kept the transaction). The row is due again as its mode releases it.
    pub released: u64,
    /// Of the acked rows, those acked by a statement that acked others with them (lease mode,
    /// where the backend acks many rows at once: acks that finish close together share one
    /// statement and one commit). Not one of the nine counters that rows leave through: a part of `acked`.
    pub batched_acks: u64,
    /// Handlers that ran past their timeout
    /// ([`SubscribeOptions::timeout`](crate::SubscribeOptions::timeout)): each was signalled,
    /// then dropped if it had not returned within the grace. Not one of the seven counters
    /// above: the row leaves work through one of them too (usually `retried` or
    /// `dead_lettered`).
    pub timed_out: u64,
    /// Rows an operator cancelled while they were in work ([`Queue::cancel`](crate::Queue::cancel)),
    /// deleted by their holder's settlement (or by the next claim, without running the
    /// handler, where the holder went away). One of the counters rows leave work through.
    pub cancelled: u64,
}

/// Counts a delivery in `in_work` (and the exported gauge) until it leaves work, however it
/// leaves.
pub(crate) struct InWork<'a>(&'a Metrics);

impl<'a> InWork<'a> {
    pub(crate) fn enter(metrics: &'a Metrics) -> Self {
        metrics.in_work.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics.export.in_work.increment(1.0);
        Self(metrics)
    }
}

impl Drop for InWork<'_> {
    fn drop(&mut self) {
        self.0.in_work.fetch_sub(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.0.export.in_work.decrement(1.0);
    }
}

//! The history checker: every delivery's start, end and outcome, recorded as handlers see them,
//! and checked after a run against SPEC section 10.
//!
//! Faults are recorded as they happened, by the code that caused them: the fault injector tells
//! the history which broker it killed and when ([`History::connections_killed`],
//! [`History::process_killed`]), and the history marks exactly the deliveries that broker had in
//! work then: its handler running, its settlement not yet through (as the engine's `settled`
//! events say), or, for a connection kill, the claim that delivered it in flight (as its
//! `claimed` event says). Every other delivery gets every check; a cut one gets the checks of
//! what its mode promises after that fault.
//!
//! Times are wall-clock offsets from the history's start, so deliveries reported by child
//! processes (as unix microseconds) line up with the parent's.
//!
//! The check is a list of named invariants ([`Violation`] names what each can find broken),
//! every one stated as if no fault happened, and one table of what each fault excuses
//! ([`Excuse`]): a broken invariant is reported unless a fault the history recorded excuses it.
//!
//! | file | holds |
//! |---|---|
//! | `recording.rs` | [`History`]: deliveries as handlers report them, faults as injectors do |
//! | `check.rs` | the run as the invariants see it (claim order, cuts found at the check), the loop over them |
//! | `invariants.rs` | the invariants, each stated for a run without faults |
//! | `violation.rs` | [`Violation`]: what a broken invariant reports |
//! | `excuses.rs` | [`Excuse`] and the one table of which fault excuses which violation |

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use broker_core::ClaimMode;

mod check;
mod excuses;
mod invariants;
mod recording;
#[cfg(test)]
mod tests;
mod violation;

pub use excuses::Excuse;
pub use recording::History;
pub use violation::Violation;

/// What a handler did with a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Returned `Outcome::Ack`.
    Ack,
    /// Returned `Outcome::Retry`.
    Retry,
    /// Returned `Outcome::RetryAfter`.
    RetryAfter,
    /// Returned an error.
    Error,
    /// Panicked.
    Panic,
    /// Returned `Outcome::DeadLetter`.
    DeadLetter,
    /// Ran past its timeout: signalled, then returned within the grace or dropped after it
    /// (recorded when its future ended either way). A failed attempt, like an error.
    TimedOut,
    /// Returned `Outcome::Snooze`: the row comes back without an attempt spent (the history
    /// assumes no `max_snoozes`, so a snooze never finishes a row).
    Snooze,
    /// Its row was cancelled by an operator while it ran (issue #48): signalled, then returned
    /// within the grace or dropped (recorded when its future ended either way). The row is
    /// deleted and never starts again, whatever the handler returned.
    Cancelled,
}

impl Recorded {
    fn finishes(self) -> bool {
        matches!(self, Self::Ack | Self::DeadLetter | Self::Cancelled)
    }

    /// The name a child process reports it by.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::Retry => "retry",
            Self::RetryAfter => "retry_after",
            Self::Error => "error",
            Self::Panic => "panic",
            Self::DeadLetter => "dead_letter",
            Self::TimedOut => "timed_out",
            Self::Snooze => "snooze",
            Self::Cancelled => "cancelled",
        }
    }

    /// The outcome a child process reported by [`name`](Self::name).
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Ack,
            Self::Retry,
            Self::RetryAfter,
            Self::Error,
            Self::Panic,
            Self::DeadLetter,
            Self::TimedOut,
            Self::Snooze,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|r| r.name() == name)
    }
}

/// How a fault reached a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Its broker's database connections were terminated while its handler ran.
    ConnectionInHandler,
    /// Its broker's database connections were terminated while the claim that delivered it
    /// was in flight, and its handler began after: the hold (the key's session, the claim's
    /// transaction) may have died before the handler began.
    ConnectionInClaim,
    /// Its broker's connections were terminated after its handler returned, before its
    /// settlement was through.
    ConnectionSettling,
    /// Its process was killed (SIGKILL) while its handler ran.
    CrashInHandler,
    /// Its process was killed after its handler returned, before its settlement was known to
    /// be through.
    CrashSettling,
}

impl Cut {
    fn crash(self) -> bool {
        matches!(self, Self::CrashInHandler | Self::CrashSettling)
    }
}

/// One delivery as its handler saw it.
#[derive(Debug, Clone)]
pub struct Record {
    /// Which broker (process or pool) ran it.
    pub broker: usize,
    /// The row id.
    pub id: i64,
    /// The attempt the delivery reported.
    pub attempt: i64,
    /// The advisory key.
    pub key: Option<String>,
    /// The FIFO group.
    pub group: Option<String>,
    /// When the handler started.
    pub start: Duration,
    /// The claim that delivered it, as the engine reported it (a broker in this process whose
    /// subscription is named [`History::subscription_name`]; `None` for a child's report).
    pub claim: Option<Claim>,
    /// When the handler ended; `None` while it runs. A crash ends it at the kill.
    pub end: Option<Duration>,
    /// What it did; `None` when its process was killed under it.
    pub outcome: Option<Recorded>,
    /// The lease expiry the delivery held when its handler started (lease mode).
    pub lease_until: Option<Duration>,
    /// The fault that reached it, if one did.
    pub cut: Option<Cut>,
    /// When that fault began.
    pub cut_from: Option<Duration>,
}

/// When the claim that returned a delivery ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// When the claim began.
    pub began: Duration,
    /// When it returned the delivery.
    pub returned: Duration,
}

impl Record {
    /// When the claim that delivered it began; its start when that is not known.
    fn claim_began(&self) -> Duration {
        self.claim.map_or(self.start, |c| c.began)
    }

    /// When the claim that delivered it returned; its start when that is not known.
    fn claim_returned(&self) -> Duration {
        self.claim.map_or(self.start, |c| c.returned)
    }
}

/// What the database holds for a row after the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Final {
    /// Deleted (acked).
    Gone,
    /// Dead-lettered.
    Dead,
    /// Still in the queue table.
    Present,
}

/// What a history is checked against.
#[derive(Debug, Clone)]
pub struct Expect {
    /// The claim mode (attempt arithmetic depends on it).
    pub mode: ClaimMode,
    /// Whether groups are FIFO.
    pub fifo: bool,
    /// The table's `max_attempts`.
    pub max_attempts: Option<u32>,
    /// Every published row and what the database holds for it after the run.
    pub finals: BTreeMap<i64, Final>,
}

/// Figures of a checked run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    /// Rows published.
    pub rows: usize,
    /// Deliveries started.
    pub deliveries: usize,
    /// Deliveries that ended in a retry, an error, a panic or a timeout.
    pub retries: usize,
    /// Of those, deliveries that timed out.
    pub timed_out: usize,
    /// Deliveries that ended in a snooze.
    pub snoozes: usize,
    /// Deliveries a fault reached (see [`Cut`]).
    pub cut: usize,
    /// Of those, deliveries whose process was killed.
    pub crashed: usize,
    /// Of those, deliveries whose handler was running when the fault came.
    pub in_handler: usize,
    /// Rows acked.
    pub acked: usize,
    /// Rows dead-lettered.
    pub dead: usize,
}

/// The deliveries one fault reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Marked {
    /// Handlers running during the fault.
    pub in_handler: usize,
    /// Handlers that had returned, whose settlement may still have been on the wire.
    pub settling: usize,
}

impl std::fmt::Display for Marked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} cut in the handler, {} while settling",
            self.in_handler, self.settling
        )
    }
}

/// Unix microseconds now: how child processes stamp what they report.
pub fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// What a delivery's outcome makes of its row: acked, dead-lettered (explicitly, or a failure at
/// or past `max_attempts`), or `None` when the row goes back to the queue.
fn final_of(r: &Record, max_attempts: Option<u32>) -> Option<Final> {
    match r.outcome? {
        Recorded::Ack | Recorded::Cancelled => Some(Final::Gone),
        Recorded::DeadLetter => Some(Final::Dead),
        // A snooze spends no attempt, so `max_attempts` never dead-letters it.
        Recorded::Snooze => None,
        _ if max_attempts.is_some_and(|m| r.attempt >= i64::from(m)) => Some(Final::Dead),
        o => {
            debug_assert!(!o.finishes());
            None
        }
    }
}

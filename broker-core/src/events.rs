//! Typed engine events for test harnesses: the conformance suite's fault injectors must know,
//! per delivery, when the claim that returned it ran and when its settlement went through.
//! Matching `tracing` messages for that ties the tests to log text and takes the one global
//! subscriber; this hook hands the same facts over as values instead. The `tracing` events stay
//! for users.
//!
//! Not part of the user API: one observer per process, set once. With none set, an emission
//! point costs one relaxed atomic load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

/// What the engine did to one delivery.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineEvent<'a> {
    /// A claim returned the delivery (attempt `attempt` of row `id`).
    Claimed {
        /// The queue table.
        table: &'a str,
        /// The name of the subscription that claimed it (empty for a claim outside one).
        subscription: &'a str,
        /// The row id.
        id: i64,
        /// The attempt the delivery reports.
        attempt: i64,
        /// When the claim began: the row's hold was taken somewhere between this and
        /// `returned`.
        began: SystemTime,
        /// When the claim returned the delivery.
        returned: SystemTime,
    },
    /// The delivery's settlement went through (committed).
    Settled {
        /// The queue table.
        table: &'a str,
        /// The row id.
        id: i64,
        /// The attempt the delivery reported.
        attempt: i64,
        /// When the settlement was through.
        at: SystemTime,
    },
    /// A claim counted attempt `attempt` of row `id`, but no handler runs it: the claim's
    /// reply came back after half the lease had gone by, so the row went back (lease mode).
    /// The next delivery of the row reads a later attempt, and a row whose last attempt went
    /// this way is dead-lettered by its next claim without a delivery.
    ClaimLost {
        /// The queue table.
        table: &'a str,
        /// The row id.
        id: i64,
        /// The attempt the delivery would have reported.
        attempt: i64,
        /// When the claim returned.
        at: SystemTime,
    },
}

/// A process-wide observer of [`EngineEvent`]s. It runs on the engine's tasks: keep it short
/// and never block in it.
#[doc(hidden)]
pub type Observer = fn(&EngineEvent<'_>);

static OBSERVER: OnceLock<Observer> = OnceLock::new();
/// Set once `OBSERVER` is: lets the emission points skip the `OnceLock` (and building the
/// event) with one relaxed load when nobody observes, which is always outside tests.
static OBSERVED: AtomicBool = AtomicBool::new(false);

/// Sets the process's observer of engine events. Returns `false`, changing nothing, when one
/// is already set (a second harness in the process must share the first one's observer).
#[doc(hidden)]
pub fn observe(observer: Observer) -> bool {
    let set = OBSERVER.set(observer).is_ok();
    if set {
        OBSERVED.store(true, Ordering::Release);
    }
    set
}

/// Hands the event `event` builds to the observer, if one is set.
#[inline]
pub(crate) fn emit<'a>(event: impl FnOnce() -> EngineEvent<'a>) {
    if !OBSERVED.load(Ordering::Relaxed) {
        return;
    }
    if let Some(observer) = OBSERVER.get() {
        observer(&event());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicI64;

    static LAST_ID: AtomicI64 = AtomicI64::new(0);

    fn keep(event: &EngineEvent<'_>) {
        if let EngineEvent::Settled { id, .. } = event {
            LAST_ID.store(*id, Ordering::SeqCst);
        }
    }

    #[test]
    fn an_event_reaches_the_observer_set_once_and_only_it() {
        let settled = |id| {
            emit(|| EngineEvent::Settled {
                table: "jobs",
                id,
                attempt: 1,
                at: SystemTime::now(),
            });
        };
        // Nobody observes yet: the event is not even built.
        emit(|| unreachable!("no observer is set"));
        assert!(observe(keep));
        settled(7);
        assert_eq!(LAST_ID.load(Ordering::SeqCst), 7);
        // A second observer is refused; the first keeps its place.
        assert!(!observe(|_| panic!("the second observer must not run")));
        settled(8);
        assert_eq!(LAST_ID.load(Ordering::SeqCst), 8);
    }
}

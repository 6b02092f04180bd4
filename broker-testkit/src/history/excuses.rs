//! The one table of what each fault excuses. The invariants are stated as if no fault happened;
//! a fault takes away what a mode's guarantee rests on (the transaction, the key's session, the
//! settlement's reply, the claim's reply), and [`excuse`] says, per [`Violation`], which of
//! those losses makes the broken guarantee expected. A violation no entry excuses is reported.

use std::time::Duration;

use broker_core::ClaimMode;

use super::check::Run;
use super::{Final, Record, Recorded, Violation};

/// What a fault took away, that makes a broken guarantee expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Excuse {
    /// The fault ended what held the earlier delivery: row lock's transaction, advisory's key
    /// session (a lease outlives its connection and its process). Its row, key or group may
    /// be taken while its handler still runs, and a FIFO group may go on from it.
    HoldFreed,
    /// The later delivery is the late handler of an earlier claim: the fault freed its hold
    /// while its claim was in flight, before the earlier delivery took the row (a claim of the
    /// same row at a lower attempt, or a claim that began first), so its handler started late.
    LateHandler,
    /// The fault reached the delivery that finished the row before its settlement was known to
    /// be through: the ack or dead letter may never have landed. Likewise a snooze, which gives
    /// back the attempt a lease or advisory claim counted: the next delivery then reads one more.
    SettlementCut,
    /// Row lock: the later delivery lost its transaction to a connection kill, so its claim
    /// may have read the row (at the same attempt) before another delivery finished it, and its
    /// handler ran after.
    StaleClaim,
    /// Row lock: the fault rolled the delivery's transaction back, so the attempt its
    /// settlement would have counted was not counted.
    RolledBack,
    /// Lease and advisory: a fault between a claim's write and its handler's start (a killed
    /// process's prefetched rows, a claim whose reply died with its connection) counted
    /// attempts no handler saw; the row's next claim may have dead-lettered it without a
    /// delivery.
    UnseenClaim,
    /// Lease: the engine reported the missing attempts counted by claims whose replies came
    /// back after half their leases had gone by; those rows went back with no handler run.
    LostClaim,
}

/// Which fault, if any, excuses `violation` in `run`: the one table of exceptions to the
/// invariants.
pub(super) fn excuse(violation: &Violation, run: &Run<'_>) -> Option<Excuse> {
    let mode = run.mode();
    let excused = |cond: bool, why: Excuse| cond.then_some(why);
    match violation {
        Violation::RowInTwoDeliveries { first, second }
        | Violation::TimedOutOverlapsNext { first, second }
        | Violation::KeyInTwoDeliveries { first, second }
        | Violation::GroupInTwoDeliveries { first, second } => {
            excused(run.hold_freed(first), Excuse::HoldFreed).or_else(|| {
                let earlier_claim = (second.id == first.id && second.attempt < first.attempt)
                    || claimed_earlier(second, first);
                excused(run.hold_freed(second) && earlier_claim, Excuse::LateHandler)
            })
        }
        Violation::GroupOutOfOrder { first, .. } => {
            excused(run.hold_freed(first), Excuse::HoldFreed)
        }
        // The head row's dead letter came from a claim no handler saw.
        Violation::GroupMovedOnEarly {
            first,
            second,
            database,
            ..
        } => excused(
            *database == Some(Final::Dead) && run.unseen_claim(first.start, second.start),
            Excuse::UnseenClaim,
        )
        .or_else(|| {
            excused(
                *database == Some(Final::Dead) && lost_the_rest(run, first),
                Excuse::LostClaim,
            )
        }),
        Violation::FirstAttemptNotOne { delivery } => excused(
            run.unseen_claim(Duration::ZERO, delivery.start),
            Excuse::UnseenClaim,
        )
        .or_else(|| {
            excused(
                run.lost_claims(delivery.id, 1..delivery.attempt),
                Excuse::LostClaim,
            )
        }),
        Violation::RunAfterFinished { first, second } => {
            excused(first.cut.is_some(), Excuse::SettlementCut).or_else(|| {
                excused(
                    mode == ClaimMode::RowLock
                        && second.attempt == first.attempt
                        && second.cut.is_some_and(|c| !c.crash()),
                    Excuse::StaleClaim,
                )
            })
        }
        Violation::AttemptMiscounted {
            first,
            second,
            expected,
            ..
        } => excused(
            mode == ClaimMode::RowLock && first.cut.is_some() && second.attempt == first.attempt,
            Excuse::RolledBack,
        )
        .or_else(|| {
            excused(
                mode != ClaimMode::RowLock
                    && first.cut.is_some()
                    && first.outcome == Some(Recorded::Snooze)
                    && second.attempt == first.attempt + 1,
                Excuse::SettlementCut,
            )
        })
        .or_else(|| {
            excused(
                second.attempt > *expected && run.unseen_claim(first.start, second.start),
                Excuse::UnseenClaim,
            )
        })
        .or_else(|| {
            excused(
                second.attempt > *expected && run.lost_claims(first.id, *expected..second.attempt),
                Excuse::LostClaim,
            )
        }),
        // After the last delivery, claims no handler saw (a killed process's prefetched rows)
        // or a cut settlement can spend the row's last attempts; its next claim then
        // dead-letters it without a delivery.
        Violation::SettlementLost {
            said,
            database: Final::Dead,
            last,
            ..
        } => excused(
            (said.is_none() || (*said == Some(Final::Gone) && last.cut.is_some()))
                && run.unseen_claim(last.start, Duration::MAX),
            Excuse::UnseenClaim,
        )
        .or_else(|| {
            excused(
                said.is_none() && lost_the_rest(run, last),
                Excuse::LostClaim,
            )
        }),
        Violation::SettlementLost { .. }
        | Violation::RunAfterCancelled { .. }
        | Violation::StillRunning { .. }
        | Violation::RowNeverDelivered { .. }
        | Violation::RowNeverPublished { .. }
        | Violation::LeaseCutShort { .. } => None,
    }
}

/// Whether `b`, a delivery a fault reached, is the late handler of a claim that began before
/// `a`'s, where `a`'s claim returned after that fault began: the fault freed `b`'s hold (its
/// transaction or key session) while `b`'s claim was in flight, so `a` could take what `b`
/// held, and `b`'s handler started after `a`'s although its claim came first. Both claims must
/// be known: a child process reports no claims, and its handler's start is later than its
/// claim began.
pub(super) fn claimed_earlier(b: &Record, a: &Record) -> bool {
    b.claim.is_some()
        && a.claim.is_some()
        && b.claim_began() < a.claim_began()
        && b.cut_from.is_some_and(|from| a.claim_returned() >= from)
}

/// Whether lost claims (see [`Excuse::LostClaim`]) counted every attempt of `last`'s row after
/// `last` up to the table's maximum, so the row's next claim dead-lettered it without a
/// delivery.
fn lost_the_rest(run: &Run<'_>, last: &Record) -> bool {
    run.expect.max_attempts.is_some_and(|max| {
        let max = i64::from(max);
        last.attempt < max && run.lost_claims(last.id, last.attempt + 1..max + 1)
    })
}

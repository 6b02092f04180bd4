//! The invariants, each stated for a run without faults: what it finds broken is a
//! [`Violation`], which the table of excuses may then put down to a fault.

use std::collections::BTreeMap;

use broker_core::ClaimMode;

use super::check::Run;
use super::{Cut, Final, Record, Recorded, Violation, final_of};

/// One invariant: every violation of it the run shows.
type Invariant = fn(&Run<'_>) -> Vec<Violation>;

/// Every invariant the check runs, in the order it reports them.
pub(super) const INVARIANTS: &[Invariant] = &[
    every_handler_returned,
    a_row_is_in_one_delivery_at_a_time,
    a_timed_out_delivery_ends_before_the_rows_next_one,
    a_key_is_in_one_delivery_at_a_time,
    a_group_is_in_one_delivery_at_a_time,
    a_group_runs_its_rows_in_order,
    every_published_row_is_delivered_and_only_those,
    a_first_delivery_reads_attempt_one,
    a_finished_row_runs_no_more,
    a_cancelled_row_never_starts_again,
    attempts_count_as_the_mode_says,
    a_crashed_lease_holds_until_it_runs_out,
    every_outcome_is_settled,
];

fn every_handler_returned(run: &Run<'_>) -> Vec<Violation> {
    run.records
        .iter()
        .filter(|r| r.end.is_none())
        .map(|r| Violation::StillRunning {
            delivery: Box::new(r.clone()),
        })
        .collect()
}

fn a_row_is_in_one_delivery_at_a_time(run: &Run<'_>) -> Vec<Violation> {
    run.by_id
        .values()
        .flat_map(|list| overlaps(list))
        .map(|(first, second)| Violation::RowInTwoDeliveries { first, second })
        .collect()
}

/// A timed-out handler's future is dropped before its row is given back, so the row's next
/// delivery starts only after it ended (returned within the grace, or dropped).
fn a_timed_out_delivery_ends_before_the_rows_next_one(run: &Run<'_>) -> Vec<Violation> {
    pairs(run)
        .filter(|(a, b)| {
            a.outcome == Some(Recorded::TimedOut) && a.end.is_some_and(|end| b.start < end)
        })
        .map(|(a, b)| Violation::TimedOutOverlapsNext {
            first: Box::new(a.clone()),
            second: Box::new(b.clone()),
        })
        .collect()
}

fn a_key_is_in_one_delivery_at_a_time(run: &Run<'_>) -> Vec<Violation> {
    by_start(run, |r| r.key.as_deref())
        .values()
        .flat_map(|list| overlaps(list))
        .map(|(first, second)| Violation::KeyInTwoDeliveries { first, second })
        .collect()
}

fn a_group_is_in_one_delivery_at_a_time(run: &Run<'_>) -> Vec<Violation> {
    if !run.expect.fifo {
        return Vec::new();
    }
    by_start(run, |r| r.group.as_deref())
        .values()
        .flat_map(|list| overlaps(list))
        .map(|(first, second)| Violation::GroupInTwoDeliveries { first, second })
        .collect()
}

/// A FIFO group never goes back to an earlier row, and goes on to a later one only once its
/// head row is finished: by the outcome of its delivery before, or by another delivery of it
/// that ended by then (a delivery whose handler started late, its claim's connection killed,
/// may come after a later claim of its row finished it).
fn a_group_runs_its_rows_in_order(run: &Run<'_>) -> Vec<Violation> {
    if !run.expect.fifo {
        return Vec::new();
    }
    let max_attempts = run.expect.max_attempts;
    let mut found = Vec::new();
    for (group, list) in by_start(run, |r| r.group.as_deref()) {
        for w in list.windows(2) {
            let (a, b) = (w[0], w[1]);
            if b.id < a.id {
                found.push(Violation::GroupOutOfOrder {
                    group: group.to_owned(),
                    first: Box::new(a.clone()),
                    second: Box::new(b.clone()),
                });
            } else if b.id > a.id
                && final_of(a, max_attempts).is_none()
                && !finished_by(run, a.id, b)
            {
                found.push(Violation::GroupMovedOnEarly {
                    group: group.to_owned(),
                    first: Box::new(a.clone()),
                    second: Box::new(b.clone()),
                    database: run.expect.finals.get(&a.id).copied(),
                    deliveries: run.by_id[&a.id].iter().map(|r| (*r).clone()).collect(),
                });
            }
        }
    }
    found
}

fn every_published_row_is_delivered_and_only_those(run: &Run<'_>) -> Vec<Violation> {
    let lost = run
        .expect
        .finals
        .iter()
        .filter(|(id, _)| !run.by_id.contains_key(id))
        .map(|(id, database)| Violation::RowNeverDelivered {
            id: *id,
            database: *database,
        });
    let unpublished = run
        .by_id
        .keys()
        .filter(|id| !run.expect.finals.contains_key(id))
        .map(|id| Violation::RowNeverPublished { id: *id });
    lost.chain(unpublished).collect()
}

fn a_first_delivery_reads_attempt_one(run: &Run<'_>) -> Vec<Violation> {
    run.by_id
        .values()
        .filter(|list| list[0].attempt != 1)
        .map(|list| Violation::FirstAttemptNotOne {
            delivery: Box::new(list[0].clone()),
        })
        .collect()
}

fn a_finished_row_runs_no_more(run: &Run<'_>) -> Vec<Violation> {
    pairs(run)
        .filter(|(a, _)| a.outcome != Some(Recorded::Cancelled))
        .filter(|(a, _)| final_of(a, run.expect.max_attempts).is_some())
        .map(|(a, b)| Violation::RunAfterFinished {
            first: Box::new(a.clone()),
            second: Box::new(b.clone()),
        })
        .collect()
}

/// A row an operator cancelled while it ran is deleted by its holder, or, where the holder went
/// away, by its next claim without a run (issue #48): no delivery of it starts after the
/// cancelled one, whatever fault came. No fault excuses it: a crash leaves the request to the
/// next claim, which deletes the row unrun.
fn a_cancelled_row_never_starts_again(run: &Run<'_>) -> Vec<Violation> {
    pairs(run)
        .filter(|(a, _)| a.outcome == Some(Recorded::Cancelled))
        .map(|(a, b)| Violation::RunAfterCancelled {
            first: Box::new(a.clone()),
            second: Box::new(b.clone()),
        })
        .collect()
}

/// The attempt a row's next delivery reads (SPEC 2): lease and advisory count one at every
/// claim; row lock counts one in the settlement of a retry, none when the row is taken again
/// without one. A snooze spends no attempt in any mode (issue #48): the next delivery reads the
/// same attempt (where a fault reached the snooze, it may not have landed: see the excuses). A
/// row its delivery finished is checked by
/// [`a_finished_row_runs_no_more`] instead, unless a fault reached that delivery (its
/// settlement may not have landed).
fn attempts_count_as_the_mode_says(run: &Run<'_>) -> Vec<Violation> {
    let mode = run.mode();
    pairs(run)
        .filter(|(a, _)| a.cut.is_some() || final_of(a, run.expect.max_attempts).is_none())
        .filter_map(|(a, b)| {
            let retried = a.outcome.is_some_and(|o| !o.finishes());
            let snoozed = a.outcome == Some(Recorded::Snooze);
            let step = i64::from(!snoozed && (mode != ClaimMode::RowLock || retried));
            let expected = a.attempt + step;
            (b.attempt != expected).then(|| Violation::AttemptMiscounted {
                first: Box::new(a.clone()),
                second: Box::new(b.clone()),
                expected,
                mode,
            })
        })
        .collect()
}

/// A lease outlives a crashed process: nobody gets the row before it runs out.
fn a_crashed_lease_holds_until_it_runs_out(run: &Run<'_>) -> Vec<Violation> {
    if run.mode() != ClaimMode::Lease {
        return Vec::new();
    }
    pairs(run)
        .filter(|(a, b)| {
            a.cut == Some(Cut::CrashInHandler) && a.lease_until.is_some_and(|until| b.start < until)
        })
        .map(|(a, b)| Violation::LeaseCutShort {
            first: Box::new(a.clone()),
            second: Box::new(b.clone()),
        })
        .collect()
}

/// Every row ends in the database as the outcome of its last delivery says.
fn every_outcome_is_settled(run: &Run<'_>) -> Vec<Violation> {
    let mut found = Vec::new();
    for (id, database) in &run.expect.finals {
        let Some(last) = run.by_id.get(id).and_then(|list| list.last()) else {
            continue;
        };
        let said = final_of(last, run.expect.max_attempts);
        if !matches!(
            (said, database),
            (Some(Final::Gone), Final::Gone) | (Some(Final::Dead), Final::Dead)
        ) {
            found.push(Violation::SettlementLost {
                id: *id,
                said,
                database: *database,
                last: Box::new((*last).clone()),
            });
        }
    }
    found
}

/// Consecutive deliveries of each row, in claim order.
fn pairs<'a>(run: &'a Run<'_>) -> impl Iterator<Item = (&'a Record, &'a Record)> {
    run.by_id
        .values()
        .flat_map(|list| list.windows(2).map(|w| (w[0], w[1])))
}

/// The deliveries that carry each value of `of` (a key, a group), in start order.
fn by_start<'a>(
    run: &'a Run<'_>,
    of: impl Fn(&'a Record) -> Option<&'a str>,
) -> BTreeMap<&'a str, Vec<&'a Record>> {
    let mut by: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
    for r in run.records {
        if let Some(v) = of(r) {
            by.entry(v).or_default().push(r);
        }
    }
    for list in by.values_mut() {
        list.sort_by_key(|r| r.start);
    }
    by
}

/// Consecutive deliveries of `sorted` where the next began before the one before it ended.
fn overlaps(sorted: &[&Record]) -> Vec<(Box<Record>, Box<Record>)> {
    sorted
        .windows(2)
        .filter(|w| w[0].end.is_some_and(|end| w[1].start < end))
        .map(|w| (Box::new(w[0].clone()), Box::new(w[1].clone())))
        .collect()
}

/// Whether another delivery of row `id`, which no fault reached (so its settlement landed),
/// finished the row and ended by the time `next` began.
fn finished_by(run: &Run<'_>, id: i64, next: &Record) -> bool {
    run.by_id.get(&id).is_some_and(|list| {
        list.iter().any(|r| {
            r.cut.is_none()
                && final_of(r, run.expect.max_attempts).is_some()
                && r.end.is_some_and(|end| end <= next.start)
        })
    })
}

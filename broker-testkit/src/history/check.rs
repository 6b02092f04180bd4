//! The check: the run as the invariants see it (each row's deliveries in claim order, the cuts
//! only the check can find), then every invariant in turn, each broken one reported unless the
//! table of excuses says a fault explains it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use broker_core::ClaimMode;

use super::excuses::{claimed_earlier, excuse};
use super::invariants::INVARIANTS;
use super::recording::Fault;
use super::{Cut, Excuse, Expect, Figures, History, Record, Recorded, Violation};

/// A recorded run, as the invariants and the excuses read it.
pub(super) struct Run<'a> {
    /// What the run is checked against.
    pub(super) expect: &'a Expect,
    /// Every fault, in the order the injectors reported them.
    pub(super) faults: &'a [Fault],
    /// Every delivery, in the order handlers started (as recorded).
    pub(super) records: &'a [Record],
    /// Each row's deliveries, in claim order (see [`claim_order`]).
    pub(super) by_id: BTreeMap<i64, Vec<&'a Record>>,
    /// The (row id, attempt) of each claim the engine reported lost: it counted the attempt and
    /// ran no handler (a lease claim whose reply came back too late).
    pub(super) lost: BTreeSet<(i64, i64)>,
}

impl Run<'_> {
    /// The claim mode.
    pub(super) fn mode(&self) -> ClaimMode {
        self.expect.mode
    }

    /// Whether a claim may have counted an attempt no handler saw between `from` and `to`: a
    /// fault landed between a claim's write and its handler's start (a killed process's
    /// prefetched rows, a claim whose reply died with its connection). Row lock counts nothing
    /// at the claim.
    pub(super) fn unseen_claim(&self, from: Duration, to: Duration) -> bool {
        self.mode() != ClaimMode::RowLock
            && self.faults.iter().any(|f| f.from <= to && f.to >= from)
    }

    /// Whether the engine reported every attempt of row `id` in `attempts` counted by a claim
    /// that ran no handler (an empty range: true).
    pub(super) fn lost_claims(&self, id: i64, attempts: std::ops::Range<i64>) -> bool {
        attempts.into_iter().all(|a| self.lost.contains(&(id, a)))
    }

    /// Whether the fault that reached `r` freed what held it (row lock: the transaction died;
    /// advisory: the key's session died), so the next delivery of its row, key or group may
    /// begin while it runs. A lease outlives its connection and its process.
    pub(super) fn hold_freed(&self, r: &Record) -> bool {
        r.cut.is_some() && self.mode() != ClaimMode::Lease
    }
}

impl History {
    /// Checks the history against SPEC sections 2, 7 and 10 (see [`Violation`] for each
    /// guarantee); returns the run's figures, or every violation no recorded fault excuses (see
    /// [`Excuse`]).
    pub fn violations(&self, expect: &Expect) -> Result<Figures, Vec<Violation>> {
        let (figures, judged) = self.judge(expect);
        let violations: Vec<Violation> = judged
            .into_iter()
            .filter(|(_, excuse)| excuse.is_none())
            .map(|(v, _)| v)
            .collect();
        if violations.is_empty() {
            Ok(figures)
        } else {
            Err(violations)
        }
    }

    /// Every invariant in turn: each violation found, with the fault that excuses it if one
    /// does; and the run's figures (meaningful when nothing is left unexcused).
    pub(super) fn judge(&self, expect: &Expect) -> (Figures, Vec<(Violation, Option<Excuse>)>) {
        let mut records = self.records();
        let faults = self
            .faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        cut_in_claim(&mut records, &faults);
        let mut by_id: BTreeMap<i64, Vec<&Record>> = BTreeMap::new();
        for r in &records {
            by_id.entry(r.id).or_default().push(r);
        }
        for list in by_id.values_mut() {
            claim_order(list, expect.mode);
        }
        let run = Run {
            expect,
            faults: &faults,
            records: &records,
            by_id,
            lost: crate::engine_events::lost(&self.table),
        };
        let judged = INVARIANTS
            .iter()
            .flat_map(|invariant| invariant(&run))
            .map(|v| {
                let why = excuse(&v, &run);
                (v, why)
            })
            .collect();
        (figures(&run), judged)
    }

    /// [`violations`](Self::violations), with a failed check as text: each violation, then the
    /// faults that may explain them, each line starting `fault: `.
    pub fn check(&self, expect: &Expect) -> Result<Figures, String> {
        self.violations(expect).map_err(|violations| {
            let mut problems = String::new();
            for v in &violations {
                let _ = writeln!(problems, "{v}");
            }
            for f in self.faults.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                let _ = writeln!(
                    problems,
                    "fault: {} of broker {} from {:?} to {:?}",
                    if f.crash { "crash" } else { "connection kill" },
                    f.broker,
                    f.from,
                    f.to
                );
            }
            problems
        })
    }
}

/// Marks the deliveries a connection kill reached through their claim, which only the check can
/// find. A delivery whose claim was in flight while its broker's connections were terminated,
/// and whose handler began after the kill began, was not there for the kill to mark (it began
/// after the kill was over, or its record came in just after the kill marked the handlers it
/// found); but the kill may have taken its hold first (the key's session, the claim's
/// transaction) with the claim's reply already read, so its row or key may be claimed again
/// while it runs, and its settlement may fail. It gets the checks of a cut delivery. A delivery
/// whose claim began after the kill had live connections.
fn cut_in_claim(records: &mut [Record], faults: &[Fault]) {
    for r in records.iter_mut().filter(|r| r.cut.is_none()) {
        let began = r.claim_began();
        if let Some(f) = faults
            .iter()
            .find(|f| !f.crash && f.broker == r.broker && began <= f.to && r.start >= f.from)
        {
            r.cut = Some(Cut::ConnectionInClaim);
            r.cut_from = Some(f.from);
        }
    }
}

/// Sorts a row's deliveries in claim order. A row's attempt never goes down, so the attempt
/// orders them; lease and advisory count one at every claim, so it orders them even when a
/// handler whose claim's connection was killed starts after a later claim's handler. Row lock
/// keeps the attempt across a rollback: within one attempt the start orders its deliveries,
/// save for the late handler of an earlier claim, which goes before the deliveries whose claims
/// came after it (see [`late_in_row_lock`]).
fn claim_order(list: &mut [&Record], mode: ClaimMode) {
    list.sort_by_key(|r| (r.attempt, r.start));
    if mode == ClaimMode::RowLock {
        for i in 1..list.len() {
            let mut j = i;
            while j > 0 && late_in_row_lock(list[j], list[j - 1]) {
                list.swap(j, j - 1);
                j -= 1;
            }
        }
    }
}

/// Row lock: whether `b`, a delivery of the same row and attempt as `a` that started after it,
/// was claimed before `a`. `b` must have lost its transaction to a kill of its connections that
/// began before `a` took the row (by `a`'s claim's return; its start when the claim is not
/// known). Then either both claims are known and `b`'s began first (`claimed_earlier`), or `a`
/// ran uncut to an outcome other than a snooze: its settlement counted the attempt or finished
/// the row, so a claim after `a`'s would have read another attempt or no row. A snooze leaves
/// the row at its attempt, so a claim after it reads the same one: only the claims' times can
/// order them then.
fn late_in_row_lock(b: &Record, a: &Record) -> bool {
    let lost_first = matches!(
        b.cut,
        Some(Cut::ConnectionInHandler | Cut::ConnectionInClaim)
    ) && b.cut_from.is_some_and(|from| from < a.claim_returned());
    let a_moved_the_row = a.cut.is_none() && a.outcome.is_some_and(|o| o != Recorded::Snooze);
    b.attempt == a.attempt && lost_first && (claimed_earlier(b, a) || a_moved_the_row)
}

/// The figures of a run that passed: then every row ended as the database says (acked rows are
/// gone, dead-lettered ones dead).
fn figures(run: &Run<'_>) -> Figures {
    let mut figures = Figures {
        rows: run.expect.finals.len(),
        deliveries: run.records.len(),
        acked: run
            .expect
            .finals
            .values()
            .filter(|f| **f == super::Final::Gone)
            .count(),
        dead: run
            .expect
            .finals
            .values()
            .filter(|f| **f == super::Final::Dead)
            .count(),
        ..Figures::default()
    };
    for r in run.records {
        if matches!(
            r.outcome,
            Some(
                Recorded::Retry
                    | Recorded::RetryAfter
                    | Recorded::Error
                    | Recorded::Panic
                    | Recorded::TimedOut
            )
        ) {
            figures.retries += 1;
        }
        if r.outcome == Some(Recorded::TimedOut) {
            figures.timed_out += 1;
        }
        if r.outcome == Some(Recorded::Snooze) {
            figures.snoozes += 1;
        }
        if let Some(c) = r.cut {
            figures.cut += 1;
            if c.crash() {
                figures.crashed += 1;
            }
            if matches!(c, Cut::ConnectionInHandler | Cut::CrashInHandler) {
                figures.in_handler += 1;
            }
        }
    }
    figures
}

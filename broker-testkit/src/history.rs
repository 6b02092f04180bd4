//! The history checker: every delivery's start, end and outcome, recorded as handlers see them,
//! and checked after a run against SPEC section 10.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use broker_core::ClaimMode;

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
}

impl Recorded {
    fn finishes(self) -> bool {
        matches!(self, Self::Ack | Self::DeadLetter)
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
    /// When the handler started, from the history's start.
    pub start: Duration,
    /// When the handler ended; `None` while it runs or when its broker was killed under it.
    pub end: Option<Duration>,
    /// What it did; `None` when its broker was killed under it.
    pub outcome: Option<Recorded>,
    /// Its broker was killed while it ran or soon after it ended, so its settlement may never
    /// have landed.
    pub unsure: bool,
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
    /// Deliveries that ended in a retry, an error or a panic.
    pub retries: usize,
    /// Deliveries cut short by a kill.
    pub killed: usize,
    /// Rows acked.
    pub acked: usize,
    /// Rows dead-lettered.
    pub dead: usize,
}

/// A shared, append-only record of deliveries.
#[derive(Debug)]
pub struct History {
    epoch: Instant,
    records: Mutex<Vec<Record>>,
    connection_kills: Mutex<Vec<Duration>>,
    broker_kills: Mutex<Vec<(Duration, Duration)>>,
}

impl Default for History {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            records: Mutex::new(Vec::new()),
            connection_kills: Mutex::new(Vec::new()),
            broker_kills: Mutex::new(Vec::new()),
        }
    }
}

/// How long after a handler's end its settlement may still be on the wire: a connection killed
/// within this window may have taken the settlement with it.
const SETTLE_WINDOW: Duration = Duration::from_secs(2);

impl History {
    /// Now, on the history's clock (for [`kill`](Self::kill)).
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Notes that database connections are being killed now: a delivery in work (or settling)
    /// across this moment may lose its claim or its settlement, so the checker treats it as cut
    /// short — its row may be delivered again, at the same attempt or the next.
    pub fn connections_killed(&self) {
        let now = self.epoch.elapsed();
        self.connection_kills
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(now);
    }

    fn cut(&self, r: &Record, kills: &[Duration]) -> bool {
        r.outcome.is_none()
            || r.unsure
            || kills
                .iter()
                .any(|k| *k >= r.start && r.end.is_none_or(|end| *k <= end + SETTLE_WINDOW))
    }

    /// Records a handler's start; returns the record's index for [`finish`](Self::finish).
    pub fn start(
        &self,
        broker: usize,
        id: i64,
        attempt: i64,
        key: Option<String>,
        group: Option<String>,
    ) -> usize {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        records.push(Record {
            broker,
            id,
            attempt,
            key,
            group,
            start: self.epoch.elapsed(),
            end: None,
            outcome: None,
            unsure: false,
        });
        records.len() - 1
    }

    /// Records a handler's end and outcome.
    pub fn finish(&self, index: usize, outcome: Recorded) {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let r = &mut records[index];
        r.end = Some(self.epoch.elapsed());
        r.outcome = Some(outcome);
    }

    /// Marks every unfinished delivery of `broker` as cut short at `at` (taken with
    /// [`now`](Self::now) just before the broker was killed: its rows can be claimed again only
    /// after that).
    ///
    /// Deliveries that ended shortly before may not have settled (the kill can cut the settlement
    /// after the handler returned), and rows it had claimed but not started count an attempt
    /// nobody saw; the checker allows for both.
    ///
    /// Call it once the kill is over: until then the dying broker may still claim, so the kill
    /// spans from `at` to now.
    pub fn kill(&self, broker: usize, at: Duration) {
        let over = self.epoch.elapsed();
        self.broker_kills
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((at, over));
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        for r in records.iter_mut().filter(|r| r.broker == broker) {
            match r.end {
                None => {
                    r.end = Some(at.max(r.start));
                    r.unsure = true;
                }
                Some(end) if end + SETTLE_WINDOW >= at => r.unsure = true,
                Some(_) => {}
            }
        }
    }

    /// Published rows (`ids`) that have not reached a final outcome by the handlers' account.
    pub fn unfinished_rows(&self, ids: &[i64], max_attempts: Option<u32>) -> Vec<i64> {
        let records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let mut last: HashMap<i64, &Record> = HashMap::new();
        for r in records.iter() {
            let e = last.entry(r.id).or_insert(r);
            if r.start >= e.start {
                *e = r;
            }
        }
        ids.iter()
            .copied()
            .filter(|id| {
                last.get(id)
                    .is_none_or(|r| final_of(r, max_attempts).is_none())
            })
            .collect()
    }

    /// Rows whose latest delivery ended unsure (its broker was killed around it): the database,
    /// not the history, says whether they finished.
    pub fn unsure_rows(&self) -> Vec<i64> {
        let records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let mut last: HashMap<i64, &Record> = HashMap::new();
        for r in records.iter() {
            let e = last.entry(r.id).or_insert(r);
            if r.start >= e.start {
                *e = r;
            }
        }
        last.values().filter(|r| r.unsure).map(|r| r.id).collect()
    }

    /// A copy of the records so far.
    pub fn records(&self) -> Vec<Record> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many rows have reached a final outcome (acked or dead-lettered) so far, by the
    /// handlers' account.
    pub fn finished_rows(&self, max_attempts: Option<u32>) -> usize {
        let records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let mut last: HashMap<i64, &Record> = HashMap::new();
        for r in records.iter() {
            let e = last.entry(r.id).or_insert(r);
            if r.start >= e.start {
                *e = r;
            }
        }
        last.values()
            .filter(|r| final_of(r, max_attempts).is_some())
            .count()
    }

    /// Checks the history: no row in two deliveries at once, no two deliveries of one advisory
    /// key at once, FIFO order and one-at-a-time per group, every row ending exactly as its
    /// outcomes say (none lost, none acked twice), and attempts as SPEC section 2 counts them.
    /// A failed check names the offending records.
    pub fn check(&self, expect: &Expect) -> Result<Figures, String> {
        let records = self.records();
        let kills = self
            .connection_kills
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let cut = |r: &Record| self.cut(r, &kills);
        let broker_kills = self
            .broker_kills
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        // A broker killed between two moments may have claimed the row unseen (claimed, never
        // started): lease and advisory count that attempt. So may a claim whose connection was
        // killed after its write committed but before the reply arrived: the claim fails, and
        // the attempt it counted is used, as a crash's is.
        let unseen_claim = |from: Duration, to: Duration| {
            expect.mode != ClaimMode::RowLock
                && (broker_kills
                    .iter()
                    .any(|(at, over)| *at <= to && *over >= from)
                    || kills.iter().any(|k| *k <= to && *k >= from))
        };
        let mut problems = String::new();
        let mut by_id: BTreeMap<i64, Vec<&Record>> = BTreeMap::new();
        for r in &records {
            by_id.entry(r.id).or_default().push(r);
            if r.end.is_none() {
                let _ = writeln!(problems, "still running at the check: {r:?}");
            }
        }
        for list in by_id.values_mut() {
            list.sort_by_key(|r| r.start);
        }
        let mut figures = Figures {
            rows: expect.finals.len(),
            deliveries: records.len(),
            ..Figures::default()
        };
        for r in &records {
            match r.outcome {
                None => figures.killed += 1,
                Some(
                    Recorded::Retry | Recorded::RetryAfter | Recorded::Error | Recorded::Panic,
                ) => {
                    figures.retries += 1;
                }
                _ => {}
            }
        }
        // One row, one delivery at a time.
        for list in by_id.values() {
            no_overlap("row", list, &cut, &mut problems);
        }
        // One key, one delivery at a time.
        let mut by_key: HashMap<&str, Vec<&Record>> = HashMap::new();
        for r in &records {
            if let Some(k) = &r.key {
                by_key.entry(k).or_default().push(r);
            }
        }
        for list in by_key.values_mut() {
            list.sort_by_key(|r| r.start);
            no_overlap("key", list, &cut, &mut problems);
        }
        // FIFO: per group, in id order, one at a time, a row finished before the next starts.
        if expect.fifo {
            let mut by_group: HashMap<&str, Vec<&Record>> = HashMap::new();
            for r in &records {
                if let Some(g) = &r.group {
                    by_group.entry(g).or_default().push(r);
                }
            }
            for (g, list) in &mut by_group {
                list.sort_by_key(|r| r.start);
                no_overlap("group", list, &cut, &mut problems);
                for w in list.windows(2) {
                    let (a, b) = (w[0], w[1]);
                    if b.id < a.id {
                        let _ = writeln!(
                            problems,
                            "group {g} went back from row {} to row {}:\n  {a:?}\n  {b:?}",
                            a.id, b.id
                        );
                    } else if b.id > a.id && final_of(a, expect.max_attempts).is_none() {
                        let _ = writeln!(
                            problems,
                            "group {g} moved on from row {} before it finished:\n  {a:?}\n  {b:?}",
                            a.id
                        );
                    }
                }
            }
        }
        // Outcomes and attempts, row by row.
        for (id, expected_final) in &expect.finals {
            let Some(list) = by_id.get(id) else {
                let _ = writeln!(
                    problems,
                    "row {id} was never delivered (final state {expected_final:?})"
                );
                continue;
            };
            if list[0].attempt != 1 && !unseen_claim(Duration::ZERO, list[0].start) {
                let _ = writeln!(
                    problems,
                    "row {id}: first delivery reads attempt {}, not 1:\n  {:?}",
                    list[0].attempt, list[0]
                );
            }
            for w in list.windows(2) {
                let (a, b) = (w[0], w[1]);
                if cut(a) && a.outcome.is_some() {
                    // The claim or the settlement may have died with the connection: the next
                    // delivery reads the same attempt (rolled back) or the next one.
                    if b.attempt < a.attempt
                        || (b.attempt > a.attempt + 1 && !unseen_claim(a.start, b.start))
                    {
                        let _ = writeln!(
                            problems,
                            "row {id}: attempt went from {} to {} across a killed connection:\n  {a:?}\n  {b:?}",
                            a.attempt, b.attempt
                        );
                    }
                    continue;
                }
                if final_of(a, expect.max_attempts).is_some() {
                    let _ = writeln!(
                        problems,
                        "row {id} was delivered again after it finished:\n  {a:?}\n  {b:?}"
                    );
                    continue;
                }
                let step = match (a.outcome, expect.mode) {
                    (None, ClaimMode::RowLock) => 0,
                    _ => 1,
                };
                if b.attempt != a.attempt + step
                    && !(b.attempt > a.attempt + step && unseen_claim(a.start, b.start))
                {
                    let _ = writeln!(
                        problems,
                        "row {id}: attempt went from {} to {} (expected +{step} in {} mode):\n  {a:?}\n  {b:?}",
                        a.attempt, b.attempt, expect.mode
                    );
                }
            }
            let last = list[list.len() - 1];
            let said = final_of(last, expect.max_attempts);
            match (said, expected_final) {
                (Some(Final::Gone), Final::Gone) => figures.acked += 1,
                (Some(Final::Dead), Final::Dead) => figures.dead += 1,
                // Claims no handler saw (a broker killed after the last delivery) can spend the
                // row's last attempts; its next claim then dead-letters it without a delivery.
                // So can a kill that cut the last delivery's settlement (its attempt stays
                // used): the row is then dead-lettered at its next claim, unseen.
                (_, Final::Dead)
                    if expect.mode != ClaimMode::RowLock
                        && (cut(last) || unseen_claim(last.start, Duration::MAX)) =>
                {
                    figures.dead += 1;
                }
                _ => {
                    let _ = writeln!(
                        problems,
                        "row {id}: outcomes say {said:?}, the database says {expected_final:?}; last delivery {last:?}"
                    );
                }
            }
        }
        for id in by_id.keys() {
            if !expect.finals.contains_key(id) {
                let _ = writeln!(problems, "row {id} was delivered but never published");
            }
        }
        if problems.is_empty() {
            Ok(figures)
        } else {
            Err(problems)
        }
    }
}

/// What a delivery's outcome makes of its row: acked, dead-lettered (explicitly, or a failure at
/// or past `max_attempts`), or `None` when the row goes back to the queue.
fn final_of(r: &Record, max_attempts: Option<u32>) -> Option<Final> {
    match r.outcome? {
        Recorded::Ack => Some(Final::Gone),
        Recorded::DeadLetter => Some(Final::Dead),
        _ if max_attempts.is_some_and(|m| r.attempt >= i64::from(m)) => Some(Final::Dead),
        o => {
            debug_assert!(!o.finishes());
            None
        }
    }
}

/// Consecutive deliveries (sorted by start) must not overlap, unless the first was cut short
/// by a killed connection: its claim ended with the connection, while its handler ran on.
fn no_overlap(
    what: &str,
    sorted: &[&Record],
    cut: &dyn Fn(&Record) -> bool,
    problems: &mut String,
) {
    for w in sorted.windows(2) {
        let (a, b) = (w[0], w[1]);
        if let Some(end) = a.end
            && b.start < end
            && !(cut(a) && a.outcome.is_some())
        {
            let _ = writeln!(
                problems,
                "one {what} in two deliveries at once:\n  {a:?}\n  {b:?}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: i64, attempt: i64, start: u64, end: u64, outcome: Option<Recorded>) -> Record {
        Record {
            broker: 0,
            id,
            attempt,
            key: Some(format!("k{id}")),
            group: Some("g".into()),
            start: Duration::from_millis(start),
            end: Some(Duration::from_millis(end)),
            outcome,
            unsure: false,
        }
    }

    fn history(records: Vec<Record>) -> History {
        let h = History::default();
        *h.records.lock().unwrap() = records;
        h
    }

    fn expect(mode: ClaimMode, finals: &[(i64, Final)]) -> Expect {
        Expect {
            mode,
            fifo: true,
            max_attempts: Some(3),
            finals: finals.iter().copied().collect(),
        }
    }

    #[test]
    fn a_clean_history_passes_with_its_figures() {
        let h = history(vec![
            rec(1, 1, 0, 10, Some(Recorded::Error)),
            rec(1, 2, 10, 20, Some(Recorded::Ack)),
            rec(2, 1, 20, 30, Some(Recorded::Retry)),
            rec(2, 2, 30, 40, None),
            rec(2, 3, 40, 50, Some(Recorded::Panic)),
        ]);
        let f = h
            .check(&expect(
                ClaimMode::Lease,
                &[(1, Final::Gone), (2, Final::Dead)],
            ))
            .unwrap();
        assert_eq!(
            (f.rows, f.deliveries, f.retries, f.killed, f.acked, f.dead),
            (2, 5, 3, 1, 1, 1)
        );
    }

    #[test]
    fn each_broken_guarantee_is_named() {
        type Case = (
            Vec<Record>,
            ClaimMode,
            &'static [(i64, Final)],
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                vec![
                    rec(1, 1, 0, 10, Some(Recorded::Retry)),
                    rec(1, 2, 5, 15, Some(Recorded::Ack)),
                ],
                ClaimMode::Lease,
                &[(1, Final::Gone)],
                "one row in two deliveries",
            ),
            (
                vec![
                    rec(1, 1, 0, 10, Some(Recorded::Ack)),
                    rec(1, 2, 10, 15, Some(Recorded::Ack)),
                ],
                ClaimMode::Lease,
                &[(1, Final::Gone)],
                "delivered again after it finished",
            ),
            (
                vec![
                    rec(1, 1, 0, 10, None),
                    rec(1, 2, 10, 15, Some(Recorded::Ack)),
                ],
                ClaimMode::RowLock,
                &[(1, Final::Gone)],
                "attempt went from 1 to 2",
            ),
            (
                vec![rec(1, 1, 0, 10, Some(Recorded::Ack))],
                ClaimMode::Lease,
                &[(1, Final::Present)],
                "the database says Present",
            ),
            (
                vec![
                    rec(2, 1, 0, 10, Some(Recorded::Ack)),
                    rec(1, 1, 10, 15, Some(Recorded::Ack)),
                ],
                ClaimMode::Lease,
                &[(1, Final::Gone), (2, Final::Gone)],
                "went back from row 2 to row 1",
            ),
            (
                vec![
                    rec(1, 1, 0, 10, Some(Recorded::Retry)),
                    rec(2, 1, 10, 15, Some(Recorded::Ack)),
                ],
                ClaimMode::Lease,
                &[(1, Final::Present), (2, Final::Gone)],
                "moved on from row 1",
            ),
            (
                vec![],
                ClaimMode::Lease,
                &[(1, Final::Gone)],
                "never delivered",
            ),
            (
                vec![rec(1, 2, 0, 10, Some(Recorded::Ack))],
                ClaimMode::Lease,
                &[(1, Final::Gone)],
                "not 1",
            ),
        ];
        for (records, mode, finals, needle) in cases {
            let err = history(records).check(&expect(mode, finals)).unwrap_err();
            assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
        }
    }
}

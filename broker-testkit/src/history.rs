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

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

    /// The name a child process reports it by.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::Retry => "retry",
            Self::RetryAfter => "retry_after",
            Self::Error => "error",
            Self::Panic => "panic",
            Self::DeadLetter => "dead_letter",
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
    /// Deliveries that ended in a retry, an error or a panic.
    pub retries: usize,
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

/// One fault: which broker, between which moments.
#[derive(Debug, Clone, Copy)]
struct Fault {
    broker: usize,
    from: Duration,
    to: Duration,
    crash: bool,
}

/// A shared, append-only record of deliveries and faults.
#[derive(Debug)]
pub struct History {
    table: String,
    epoch: SystemTime,
    records: Mutex<Vec<Record>>,
    faults: Mutex<Vec<Fault>>,
}

/// Unix microseconds now: how child processes stamp what they report.
pub fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

impl History {
    /// A history of deliveries from the queue table `table`; starts keeping the settlements and
    /// claims the engine reports (see [`crate::engine_events`]), so faults can tell which
    /// settlements were through and which claims were in flight.
    pub fn new(table: &str) -> Self {
        crate::engine_events::install(false);
        Self {
            table: table.to_owned(),
            epoch: SystemTime::now(),
            records: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
        }
    }

    /// Now, on the history's clock.
    pub fn now(&self) -> Duration {
        SystemTime::now()
            .duration_since(self.epoch)
            .unwrap_or_default()
    }

    /// A unix time in microseconds on the history's clock.
    pub fn at_unix_micros(&self, micros: i64) -> Duration {
        let at = UNIX_EPOCH + Duration::from_micros(micros.max(0).cast_unsigned());
        at.duration_since(self.epoch).unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Record>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The name a broker's subscription takes ([`SubscribeOptions::name`]), so the history can
    /// tell its claims from those of other brokers in this process.
    ///
    /// [`SubscribeOptions::name`]: broker_core::SubscribeOptions::name
    pub fn subscription_name(broker: usize) -> String {
        format!("history-broker-{broker}")
    }

    /// Records a handler's start now; returns the record's index for [`finish`](Self::finish).
    /// `lease_expires_ms`: the delivery's lease expiry (unix ms), in lease mode. The claim that
    /// delivered it is found among the engine's events when the broker's subscription is named
    /// [`subscription_name`](Self::subscription_name)`(broker)`; else its claim time is unknown
    /// and taken to be its start.
    pub fn start(
        &self,
        broker: usize,
        id: i64,
        attempt: i64,
        key: Option<String>,
        group: Option<String>,
        lease_expires_ms: Option<i64>,
    ) -> usize {
        let at = self.now();
        // The latest claim that returned this attempt of the row (row lock may claim one
        // attempt again after a rollback).
        let subscription = Self::subscription_name(broker);
        let claim = crate::engine_events::claims(&self.table, &subscription, id, attempt)
            .into_iter()
            .map(|(began, returned)| Claim {
                began: self.at_unix_micros(began),
                returned: self.at_unix_micros(returned),
            })
            .filter(|c| c.returned <= at)
            .max_by_key(|c| c.returned);
        let index = self.start_at(at, broker, id, attempt, key, group, lease_expires_ms);
        self.lock()[index].claim = claim;
        index
    }

    /// Records a handler's start at `at` (a child's report).
    #[allow(clippy::too_many_arguments)]
    pub fn start_at(
        &self,
        at: Duration,
        broker: usize,
        id: i64,
        attempt: i64,
        key: Option<String>,
        group: Option<String>,
        lease_expires_ms: Option<i64>,
    ) -> usize {
        let lease_until = lease_expires_ms.map(|ms| self.at_unix_micros(ms.saturating_mul(1000)));
        let mut records = self.lock();
        records.push(Record {
            broker,
            id,
            attempt,
            key,
            group,
            start: at,
            claim: None,
            end: None,
            outcome: None,
            lease_until,
            cut: None,
            cut_from: None,
        });
        records.len() - 1
    }

    /// Records a handler's end and outcome now.
    pub fn finish(&self, index: usize, outcome: Recorded) {
        self.finish_at(index, outcome, self.now());
    }

    /// Records a handler's end and outcome at `at` (a child's report).
    pub fn finish_at(&self, index: usize, outcome: Recorded, at: Duration) {
        let mut records = self.lock();
        let r = &mut records[index];
        r.end = Some(at);
        r.outcome = Some(outcome);
    }

    /// The fault injector terminated `broker`'s database connections between `from` and `to`
    /// (both from [`now`](Self::now)). Marks the deliveries the kill reached: every handler of
    /// `broker` that ran at some moment between `from` and `to`, and every delivery of `broker`
    /// whose handler had returned by `from` but whose settlement the engine had not reported
    /// through by then. Returns what it marked.
    pub fn connections_killed(&self, broker: usize, from: Duration, to: Duration) -> Marked {
        self.mark(broker, from, to, false)
    }

    /// The fault injector killed `broker`'s process (SIGKILL) between `from` and `to`, and every
    /// report the process made has been recorded. Marks its handlers that had not returned by
    /// `to` (their end becomes `to`), and its deliveries whose handler had returned but whose
    /// settlement it never reported through. Returns what it marked.
    pub fn process_killed(&self, broker: usize, from: Duration, to: Duration) -> Marked {
        self.mark(broker, from, to, true)
    }

    fn mark(&self, broker: usize, from: Duration, to: Duration, crash: bool) -> Marked {
        self.faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Fault {
                broker,
                from,
                to,
                crash,
            });
        // A crash stops everything at once; a connection kill only what was on the wire before
        // it began.
        let settled_by = if crash { to } else { from };
        let mut records = self.lock();
        let next_starts = next_starts(&records);
        let mut marked = Marked::default();
        let (in_handler, settling) = if crash {
            (Cut::CrashInHandler, Cut::CrashSettling)
        } else {
            (Cut::ConnectionInHandler, Cut::ConnectionSettling)
        };
        for (i, r) in records
            .iter_mut()
            .enumerate()
            .filter(|(_, r)| r.broker == broker && r.cut.is_none())
        {
            if r.start > to {
                continue;
            }
            let running = match r.end {
                None => true,
                // A handler that ran while connections were being killed may have lost its
                // claim's connection; a crash cuts only what had not returned when it was over.
                Some(end) if !crash => end >= from,
                Some(_) => false,
            };
            if running {
                r.cut = Some(in_handler);
                r.cut_from = Some(from);
                marked.in_handler += 1;
                if crash {
                    r.end = Some(to);
                }
                continue;
            }
            let through = crate::engine_events::settled(&self.table, r.id, r.attempt)
                .into_iter()
                .map(|micros| self.at_unix_micros(micros))
                .any(|at| at >= r.start && at <= settled_by && at < next_starts[i]);
            if !through {
                r.cut = Some(settling);
                r.cut_from = Some(from);
                marked.settling += 1;
            }
        }
        marked
    }

    /// Published rows (`ids`) that have not reached a final outcome by the handlers' account.
    pub fn unfinished_rows(&self, ids: &[i64], max_attempts: Option<u32>) -> Vec<i64> {
        let records = self.lock();
        let last = last_per_row(&records);
        ids.iter()
            .copied()
            .filter(|id| {
                last.get(id)
                    .is_none_or(|r| r.cut.is_some() || final_of(r, max_attempts).is_none())
            })
            .collect()
    }

    /// A copy of the records so far.
    pub fn records(&self) -> Vec<Record> {
        self.lock().clone()
    }

    /// How many rows have reached a final outcome (acked or dead-lettered) so far, by the
    /// handlers' account.
    pub fn finished_rows(&self, max_attempts: Option<u32>) -> usize {
        let records = self.lock();
        last_per_row(&records)
            .values()
            .filter(|r| final_of(r, max_attempts).is_some())
            .count()
    }

    /// Checks the history: no row in two deliveries at once, no two deliveries of one advisory
    /// key at once, FIFO order and one-at-a-time per group, every row ending exactly as its
    /// outcomes say (none lost, none acked twice), and attempts as SPEC section 2 counts them.
    /// A delivery a fault reached gets what its mode promises after that fault instead (see
    /// [`Cut`]): row lock rolled back with the attempt unused; lease held until it ran out;
    /// advisory key freed with one attempt used. A failed check names the offending records.
    pub fn check(&self, expect: &Expect) -> Result<Figures, String> {
        let mut records = self.records();
        let faults = self
            .faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        // A delivery whose claim was in flight while its broker's connections were terminated,
        // and whose handler began after the kill began, was not there for the kill to mark (it
        // began after the kill was over, or its record came in just after the kill marked the
        // handlers it found); but the kill may have taken its hold first (the key's session,
        // the claim's transaction) with the claim's reply already read, so its row or key may
        // be claimed again while it runs, and its settlement may fail. It gets the checks of a
        // cut delivery. A delivery whose claim began after the kill had live connections.
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
        let mode = expect.mode;
        // A claim can count an attempt no handler saw when a fault lands between its write and
        // the handler's start (a killed process's prefetched rows, a claim whose reply died
        // with its connection). Row lock counts nothing at the claim.
        let unseen_claim = |from: Duration, to: Duration| {
            mode != ClaimMode::RowLock && faults.iter().any(|f| f.from <= to && f.to >= from)
        };
        // Whether a delivery may overlap the next of its row, key or group: the fault freed what
        // held it (row lock: the transaction died; advisory: the key's session died). A lease
        // outlives its connection and its process.
        let may_overlap = |r: &Record| r.cut.is_some() && mode != ClaimMode::Lease;
        let mut problems = String::new();
        let mut by_id: BTreeMap<i64, Vec<&Record>> = BTreeMap::new();
        for r in &records {
            by_id.entry(r.id).or_default().push(r);
            if r.end.is_none() {
                let _ = writeln!(problems, "still running at the check: {r:?}");
            }
        }
        // A row's deliveries in claim order. A row's attempt never goes down, so the attempt
        // orders them; lease and advisory count one at every claim, so it orders them even
        // when a handler whose claim's connection was killed starts after a later claim's
        // handler. Row lock keeps the attempt across a rollback: within one attempt the start
        // orders its deliveries, save for the late handler of an earlier claim, which goes
        // before the deliveries whose claims came after it (see `late_in_row_lock`).
        for list in by_id.values_mut() {
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
        let mut figures = Figures {
            rows: expect.finals.len(),
            deliveries: records.len(),
            ..Figures::default()
        };
        for r in &records {
            if matches!(
                r.outcome,
                Some(Recorded::Retry | Recorded::RetryAfter | Recorded::Error | Recorded::Panic)
            ) {
                figures.retries += 1;
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
        for list in by_id.values() {
            no_overlap("row", list, &may_overlap, &mut problems);
        }
        let mut by_key: HashMap<&str, Vec<&Record>> = HashMap::new();
        for r in &records {
            if let Some(k) = &r.key {
                by_key.entry(k).or_default().push(r);
            }
        }
        for list in by_key.values_mut() {
            list.sort_by_key(|r| r.start);
            no_overlap("key", list, &may_overlap, &mut problems);
        }
        if expect.fifo {
            let mut by_group: HashMap<&str, Vec<&Record>> = HashMap::new();
            for r in &records {
                if let Some(g) = &r.group {
                    by_group.entry(g).or_default().push(r);
                }
            }
            for (g, list) in &mut by_group {
                list.sort_by_key(|r| r.start);
                no_overlap("group", list, &may_overlap, &mut problems);
                for w in list.windows(2) {
                    let (a, b) = (w[0], w[1]);
                    let a_dead = expect.finals.get(&a.id) == Some(&Final::Dead);
                    if b.id < a.id && !(a.cut.is_some() && may_overlap(a)) {
                        let _ = writeln!(
                            problems,
                            "group {g} went back from row {} to row {}:\n  {a:?}\n  {b:?}",
                            a.id, b.id
                        );
                    } else if b.id > a.id
                        && final_of(a, expect.max_attempts).is_none()
                        && !(a_dead && unseen_claim(a.start, b.start))
                        && !finished_by(&by_id, a.id, b.start, expect.max_attempts)
                    {
                        let _ = writeln!(
                            problems,
                            "group {g} moved on from row {} before it finished:\n  {a:?}\n  {b:?}\n  \
                             row {} ends {:?} in the database; its deliveries by attempt:{}",
                            a.id,
                            a.id,
                            expect.finals.get(&a.id),
                            by_id.get(&a.id).map_or_else(String::new, |list| list
                                .iter()
                                .map(|r| format!("\n    {r:?}"))
                                .collect::<String>()),
                        );
                    }
                }
            }
        }
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
                check_pair(w[0], w[1], expect, &unseen_claim, &mut problems);
            }
            let last = list[list.len() - 1];
            let said = final_of(last, expect.max_attempts);
            match (said, expected_final) {
                (Some(Final::Gone), Final::Gone) => figures.acked += 1,
                (Some(Final::Dead), Final::Dead) => figures.dead += 1,
                // After the last delivery, claims no handler saw (a killed process's prefetched
                // rows) or a cut settlement can spend the row's last attempts; its next claim
                // then dead-letters it without a delivery.
                (None, Final::Dead) if unseen_claim(last.start, Duration::MAX) => figures.dead += 1,
                (Some(Final::Gone), Final::Dead)
                    if last.cut.is_some() && unseen_claim(last.start, Duration::MAX) =>
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
            for f in &faults {
                let _ = writeln!(
                    problems,
                    "fault: {} of broker {} from {:?} to {:?}",
                    if f.crash { "crash" } else { "connection kill" },
                    f.broker,
                    f.from,
                    f.to
                );
            }
            Err(problems)
        }
    }
}

fn last_per_row(records: &[Record]) -> HashMap<i64, &Record> {
    let mut last: HashMap<i64, &Record> = HashMap::new();
    for r in records {
        let e = last.entry(r.id).or_insert(r);
        if r.start >= e.start {
            *e = r;
        }
    }
    last
}

/// For each record, when the next delivery of its row at the same attempt began
/// (`Duration::MAX` if none): row lock keeps the attempt when a transaction dies, so the row and
/// attempt alone do not say whose settlement a settlement event was, and one after that start
/// belongs to the later delivery.
fn next_starts(records: &[Record]) -> Vec<Duration> {
    let mut starts: BTreeMap<(i64, i64), Vec<Duration>> = BTreeMap::new();
    for r in records {
        starts.entry((r.id, r.attempt)).or_default().push(r.start);
    }
    for list in starts.values_mut() {
        list.sort();
    }
    records
        .iter()
        .map(|r| {
            starts[&(r.id, r.attempt)]
                .iter()
                .copied()
                .find(|s| *s > r.start)
                .unwrap_or(Duration::MAX)
        })
        .collect()
}

/// Two consecutive deliveries `a`, `b` of one row: what may come after `a`.
fn check_pair(
    a: &Record,
    b: &Record,
    expect: &Expect,
    unseen_claim: &dyn Fn(Duration, Duration) -> bool,
    problems: &mut String,
) {
    let id = a.id;
    let mode = expect.mode;
    let Some(cut) = a.cut else {
        if final_of(a, expect.max_attempts).is_some() {
            // Row lock: a delivery whose connection a kill reached lost its row lock with its
            // transaction, and its handler may start (records are in order of handler start)
            // after another claim took the row and finished it. Claimed before that finish, it
            // read the same attempt; one claimed after it would find no row.
            let stale = mode == ClaimMode::RowLock
                && b.attempt == a.attempt
                && b.cut.is_some_and(|c| !c.crash());
            if !stale {
                let _ = writeln!(
                    problems,
                    "row {id} was delivered again after it finished:\n  {a:?}\n  {b:?}"
                );
            }
            return;
        }
        let step = match (a.outcome, mode) {
            (None, ClaimMode::RowLock) => 0,
            _ => 1,
        };
        if b.attempt != a.attempt + step
            && !(b.attempt > a.attempt + step && unseen_claim(a.start, b.start))
        {
            let _ = writeln!(
                problems,
                "row {id}: attempt went from {} to {} (expected +{step} in {mode} mode):\n  {a:?}\n  {b:?}",
                a.attempt, b.attempt
            );
        }
        return;
    };
    // What the mode promises after the fault.
    let retried = a.outcome.is_some_and(|o| !o.finishes());
    let ok = match mode {
        // The transaction died: rolled back, the attempt unused; or, when the handler had
        // returned a retry and its commit got through before its connection died, counted once.
        ClaimMode::RowLock => b.attempt == a.attempt || (retried && b.attempt == a.attempt + 1),
        // The claim counted one attempt; unseen claims may count more.
        _ => {
            b.attempt == a.attempt + 1
                || (b.attempt > a.attempt + 1 && unseen_claim(a.start, b.start))
        }
    };
    if !ok {
        let _ = writeln!(
            problems,
            "row {id}: attempt went from {} to {} across a {cut:?} in {mode} mode:\n  {a:?}\n  {b:?}",
            a.attempt, b.attempt
        );
    }
    // A lease outlives a crashed process: nobody gets the row before it runs out.
    if mode == ClaimMode::Lease
        && cut == Cut::CrashInHandler
        && let Some(until) = a.lease_until
        && b.start < until
    {
        let _ = writeln!(
            problems,
            "row {id} was delivered again before the crashed holder's lease ran out:\n  {a:?}\n  {b:?}"
        );
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

/// Whether `b`, a delivery a fault reached, is the late handler of a claim that began before
/// `a`'s, where `a`'s claim returned after that fault began: the fault freed `b`'s hold (its
/// transaction or key session) while `b`'s claim was in flight, so `a` could take what `b`
/// held, and `b`'s handler started after `a`'s although its claim came first. Both claims must
/// be known: a child process reports no claims, and its handler's start is later than its
/// claim began.
fn claimed_earlier(b: &Record, a: &Record) -> bool {
    b.claim.is_some()
        && a.claim.is_some()
        && b.claim_began() < a.claim_began()
        && b.cut_from.is_some_and(|from| a.claim_returned() >= from)
}

/// Whether another delivery of row `id`, which no fault reached (so its settlement landed),
/// finished the row and ended by `at`. A group may move on from a delivery whose handler started
/// late (its claim's connection was killed) once a later claim of its row has finished it.
fn finished_by(
    by_id: &BTreeMap<i64, Vec<&Record>>,
    id: i64,
    at: Duration,
    max_attempts: Option<u32>,
) -> bool {
    by_id.get(&id).is_some_and(|list| {
        list.iter().any(|r| {
            r.cut.is_none()
                && final_of(r, max_attempts).is_some()
                && r.end.is_some_and(|end| end <= at)
        })
    })
}

/// Row lock: whether `b`, a delivery of the same row and attempt as `a` that started after it,
/// was claimed before `a`. `b` must have lost its transaction to a kill of its connections that
/// began before `a` took the row (by `a`'s claim's return; its start when the claim is not
/// known). Then either both claims are known and `b`'s began first (`claimed_earlier`), or `a`
/// ran uncut to an outcome: its settlement counted the attempt or finished the row, so a claim
/// after `a`'s would have read another attempt or no row.
fn late_in_row_lock(b: &Record, a: &Record) -> bool {
    let lost_first = matches!(
        b.cut,
        Some(Cut::ConnectionInHandler | Cut::ConnectionInClaim)
    ) && b.cut_from.is_some_and(|from| from < a.claim_returned());
    b.attempt == a.attempt
        && lost_first
        && (claimed_earlier(b, a) || (a.cut.is_none() && a.outcome.is_some()))
}

/// Consecutive deliveries (sorted by start) must not overlap, unless the fault that reached the
/// first freed what held it (`may_overlap`).
fn no_overlap(
    what: &str,
    sorted: &[&Record],
    may_overlap: &dyn Fn(&Record) -> bool,
    problems: &mut String,
) {
    for w in sorted.windows(2) {
        let (a, b) = (w[0], w[1]);
        // `b` may be the late handler of an earlier claim whose hold the fault that reached it
        // freed before `a` took what it held: a claim of the same row at a lower attempt (lease
        // and advisory count one at each claim; the row's own check orders them by attempt), or
        // one that began before `a`'s claim, where `a`'s returned after that fault began.
        let earlier_claim =
            may_overlap(b) && ((b.id == a.id && b.attempt < a.attempt) || claimed_earlier(b, a));
        if let Some(end) = a.end
            && b.start < end
            && !may_overlap(a)
            && !earlier_claim
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
            claim: None,
            end: Some(Duration::from_millis(end)),
            outcome,
            lease_until: None,
            cut: None,
            cut_from: None,
        }
    }

    /// A claim that began and returned at these times.
    fn claim(began: Duration, returned: Duration) -> Option<Claim> {
        Some(Claim { began, returned })
    }

    fn history(records: Vec<Record>) -> History {
        let h = History::new(&crate::unique_name("unit"));
        *h.records.lock().unwrap() = records;
        h
    }

    /// Notes that the settlement of `attempt` of row `id` went through at `at_ms`.
    fn settled(h: &History, id: i64, attempt: i64, at_ms: u64) {
        let at = h.epoch + Duration::from_millis(at_ms);
        let micros = at.duration_since(UNIX_EPOCH).unwrap().as_micros();
        crate::engine_events::note(&h.table, id, attempt, i64::try_from(micros).unwrap());
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
            Record {
                end: None,
                ..rec(2, 2, 30, 40, None)
            },
            rec(2, 3, 40, 50, Some(Recorded::Panic)),
        ]);
        for (id, attempt, at) in [(1, 1, 11), (1, 2, 21), (2, 1, 31)] {
            settled(&h, id, attempt, at);
        }
        let marked = h.process_killed(0, Duration::from_millis(35), Duration::from_millis(36));
        assert_eq!((marked.in_handler, marked.settling), (1, 0));
        let f = h
            .check(&expect(
                ClaimMode::Lease,
                &[(1, Final::Gone), (2, Final::Dead)],
            ))
            .unwrap();
        assert_eq!(
            (
                f.rows,
                f.deliveries,
                f.retries,
                f.cut,
                f.crashed,
                f.acked,
                f.dead
            ),
            (2, 5, 3, 1, 1, 1, 1)
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

    fn cut(mut r: Record, cut: Cut) -> Record {
        r.cut = Some(cut);
        r
    }

    #[test]
    fn a_fault_excuses_only_what_its_mode_promises() {
        // Row 1 acked in a delivery a connection kill reached (0-10 ms), then delivered again
        // at `attempt` from 5 ms on; `None`: the history passes.
        let after_kill = |attempt: i64| {
            vec![
                cut(
                    rec(1, 1, 0, 10, Some(Recorded::Ack)),
                    Cut::ConnectionInHandler,
                ),
                rec(1, attempt, 5, 15, Some(Recorded::Ack)),
            ]
        };
        // Row 1 acked (0-10 ms), then a delivery at `attempt` whose handler ran 12-15 ms, cut by a
        // connection kill if `killed`.
        let stale_after = |attempt: i64, killed: bool| {
            let later = rec(1, attempt, 12, 15, Some(Recorded::Ack));
            vec![
                rec(1, 1, 0, 10, Some(Recorded::Ack)),
                if killed {
                    cut(later, Cut::ConnectionInHandler)
                } else {
                    later
                },
            ]
        };
        // Row 1's holder crashed with a lease until 100 ms; delivered again at `start`.
        let after_crash = |start: u64| {
            let mut crashed = cut(rec(1, 1, 0, 10, None), Cut::CrashInHandler);
            crashed.lease_until = Some(Duration::from_millis(100));
            vec![crashed, rec(1, 2, start, start + 10, Some(Recorded::Ack))]
        };
        let gone: &[(i64, Final)] = &[(1, Final::Gone)];
        type Case<'a> = (Vec<Record>, ClaimMode, &'a [(i64, Final)], Option<&'a str>);
        let cases: Vec<Case> = vec![
            // A killed connection does not free a lease: no overlap, cut or not.
            (
                after_kill(2),
                ClaimMode::Lease,
                gone,
                Some("one row in two deliveries"),
            ),
            // A crashed lease holder keeps the row until its lease runs out.
            (
                after_crash(50),
                ClaimMode::Lease,
                gone,
                Some("before the crashed holder's lease ran out"),
            ),
            (after_crash(100), ClaimMode::Lease, gone, None),
            // Row lock rolls back: the attempt is not used.
            (
                after_kill(2),
                ClaimMode::RowLock,
                gone,
                Some("across a ConnectionInHandler"),
            ),
            (after_kill(1), ClaimMode::RowLock, gone, None),
            // Row lock: a delivery whose transaction a kill ended may run its handler after
            // another delivery finished the row, at the attempt it claimed; not at a later one,
            // and not without the kill, and never in lease mode (the lease still holds).
            (stale_after(1, true), ClaimMode::RowLock, gone, None),
            (
                stale_after(2, true),
                ClaimMode::RowLock,
                gone,
                Some("delivered again after it finished"),
            ),
            (
                stale_after(1, false),
                ClaimMode::RowLock,
                gone,
                Some("delivered again after it finished"),
            ),
            (
                stale_after(1, true),
                ClaimMode::Lease,
                gone,
                Some("delivered again after it finished"),
            ),
            // Advisory frees the key (overlap allowed) and uses one attempt.
            (
                after_kill(1),
                ClaimMode::Advisory,
                gone,
                Some("across a ConnectionInHandler"),
            ),
            (after_kill(2), ClaimMode::Advisory, gone, None),
            // An ack nothing cut must land: dead-lettered instead is a failure.
            (
                vec![rec(1, 1, 0, 10, Some(Recorded::Ack))],
                ClaimMode::Lease,
                &[(1, Final::Dead)],
                Some("the database says Dead"),
            ),
        ];
        for (records, mode, finals, needle) in cases {
            let result = history(records).check(&expect(mode, finals));
            match needle {
                Some(needle) => {
                    let err = result.unwrap_err();
                    assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
                }
                None => {
                    result.unwrap();
                }
            }
        }
    }

    #[test]
    fn a_connection_kill_marks_running_and_settling_deliveries_of_its_broker_only() {
        let mut other = rec(3, 1, 0, 100, Some(Recorded::Ack));
        other.broker = 1;
        let h = history(vec![
            rec(1, 1, 0, 10, Some(Recorded::Ack)),
            rec(2, 1, 0, 19, Some(Recorded::Ack)),
            rec(4, 1, 15, 40, Some(Recorded::Ack)),
            other,
        ]);
        // At 20 one handler (row 4) runs, row 1's settlement is through, row 2's is not.
        settled(&h, 1, 1, 12);
        settled(&h, 2, 1, 25);
        let marked = h.connections_killed(0, Duration::from_millis(20), Duration::from_millis(21));
        assert_eq!((marked.in_handler, marked.settling), (1, 1));
        let cuts: Vec<_> = h.records().iter().map(|r| (r.id, r.cut)).collect();
        assert_eq!(
            cuts,
            [
                (1, None),
                (2, Some(Cut::ConnectionSettling)),
                (4, Some(Cut::ConnectionInHandler)),
                (3, None)
            ]
        );
    }
    #[test]
    fn a_delivery_whose_claim_was_in_flight_during_a_kill_is_cut() {
        // The kill of broker 0's connections runs from 20 to 21 ms. Broker 0 starts a handler
        // for row 1 at 25 ms from a claim that began at `claimed`; broker 1 runs row 1 alongside
        // it at the same attempt (row lock: the kill rolled broker 0's claim back) and acks it.
        let run = |claimed: u64| {
            let mut mine = rec(1, 1, 25, 35, Some(Recorded::Ack));
            mine.claim = claim(Duration::from_millis(claimed), Duration::from_millis(24));
            let mut other = rec(1, 1, 27, 45, Some(Recorded::Ack));
            other.broker = 1;
            let h = history(vec![mine, other]);
            settled(&h, 1, 1, 46);
            h.connections_killed(0, Duration::from_millis(20), Duration::from_millis(21));
            h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
        };
        run(19).unwrap();
        run(21).unwrap();
        let err = run(22).unwrap_err();
        assert!(err.contains("one row in two deliveries"), "{err}");
    }

    #[test]
    fn a_handler_start_takes_its_claim_time_from_the_engines_event() {
        let h = History::new(&crate::unique_name("unit"));
        // The claim begins after the history's start.
        std::thread::sleep(Duration::from_millis(20));
        // What the engine emits when a claim that took 5 ms returns a delivery.
        tracing::debug!(
            target: "broker_core::delivery",
            table = h.table.as_str(),
            subscription = History::subscription_name(3).as_str(),
            id = 7_i64,
            attempt = 2_i64,
            claim_us = 5_000_u64,
            "claimed"
        );
        let at = h.start(3, 7, 2, None, None, None);
        let r = &h.records()[at];
        let claim = r.claim.expect("the claim's event was kept");
        assert!(
            claim.returned - claim.began >= Duration::from_millis(5) && claim.returned <= r.start,
            "{claim:?} {:?}",
            r.start
        );
        // Another attempt of the row, or another broker's delivery of it, has no claim on
        // record.
        let other = h.start(3, 7, 3, None, None, None);
        assert_eq!(h.records()[other].claim, None);
        let other = h.start(4, 7, 2, None, None, None);
        assert_eq!(h.records()[other].claim, None);
    }

    #[test]
    fn a_late_handler_of_an_earlier_claim_is_ordered_by_its_claim() {
        // Row lock: broker 1 claimed row 1 at 10-11 ms; the kill of its connections (20-23 ms)
        // rolled its claim back before its handler began at 22 ms. Broker 0's claim, returned at
        // `returned`, ran the row from 21 ms, at the same attempt.
        let run = |returned: u64| {
            let mut mine = rec(1, 1, 21, 30, Some(Recorded::Ack));
            mine.claim = claim(
                Duration::from_millis(returned - 1),
                Duration::from_millis(returned),
            );
            let mut late = rec(1, 1, 22, 25, Some(Recorded::Ack));
            late.broker = 1;
            late.claim = claim(Duration::from_millis(10), Duration::from_millis(11));
            let h = history(vec![mine, late]);
            settled(&h, 1, 1, 31);
            h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(23));
            h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
        };
        run(21).unwrap();
        // A claim that returned before the kill took the row while broker 1 still held it.
        let err = run(15).unwrap_err();
        assert!(err.contains("one row in two deliveries"), "{err}");
    }

    #[test]
    fn a_late_handler_of_an_earlier_row_lock_claim_comes_before_a_retry() {
        // Row lock: broker 1's claim of row 1 (from `late_began` to 22 ms) read attempt 1 and
        // its transaction died in the kill of its connections (20-23 ms); its handler panicked
        // at 22 ms. Broker 0's claim (with `known` claim times: 15 ms to `mine_took`) took the
        // row and its handler panicked at `mine_took`: the retry counted the attempt, and
        // broker 0 ran attempt 2 at 30 ms. Broker 1 read attempt 1, so it took the row before
        // broker 0 did, which it could only if its transaction had died by then.
        let run = |late_began: u64, mine_took: u64, known: bool| {
            let mut mine = rec(1, 1, mine_took, mine_took, Some(Recorded::Panic));
            mine.claim = known.then_some(Claim {
                began: Duration::from_millis(15),
                returned: Duration::from_millis(mine_took),
            });
            let mut late = rec(1, 1, 22, 22, Some(Recorded::Panic));
            late.broker = 1;
            late.claim = claim(Duration::from_millis(late_began), Duration::from_millis(22));
            let mut again = rec(1, 2, 30, 31, Some(Recorded::Ack));
            again.claim = claim(Duration::from_millis(29), Duration::from_millis(30));
            let h = history(vec![mine, late, again]);
            settled(&h, 1, 1, mine_took);
            settled(&h, 1, 2, 31);
            h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(23));
            h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
        };
        run(12, 21, true).unwrap();
        // Claims that overlapped, and a claim (a child process's) whose times are unknown.
        run(16, 21, true).unwrap();
        run(12, 21, false).unwrap();
        // Broker 0 took the row before the kill: broker 1 still held it then.
        for known in [true, false] {
            let err = run(12, 19, known).unwrap_err();
            assert!(err.contains("attempt went from 1 to 1"), "{err}");
        }
        // A claim that began first but read the attempt a later retry counted came after that
        // retry, whatever its start: broker 0's claim (12-30 ms, through the kill of its
        // connections at 10-13 ms) read attempt 2, after broker 1 ran attempt 1 (a retry).
        let mut slow = rec(1, 2, 30, 31, Some(Recorded::Ack));
        slow.claim = claim(Duration::from_millis(12), Duration::from_millis(30));
        let mut first = rec(1, 1, 20, 20, Some(Recorded::Retry));
        first.broker = 1;
        first.claim = claim(Duration::from_millis(13), Duration::from_millis(20));
        let h = history(vec![first, slow]);
        settled(&h, 1, 1, 20);
        settled(&h, 1, 2, 31);
        h.connections_killed(0, Duration::from_millis(10), Duration::from_millis(13));
        h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
            .unwrap();
    }

    #[test]
    fn a_late_handler_is_not_put_before_a_delivery_whose_claim_is_unknown() {
        // Row lock: a child process (broker 100, which reports no claims) ran row 1 from 30 ms
        // until it was killed at 35 ms. Broker 1's claim began at 25 ms, in the kill of its
        // connections (20-28 ms), and took the row after the crash; its handler retried at
        // 40 ms, and broker 0 acked attempt 2 at 50 ms. The child's claim began before its
        // start, so nothing says broker 1's came first.
        let mut child = rec(1, 1, 30, 0, None);
        child.broker = 100;
        child.end = None;
        let mut late = rec(1, 1, 40, 41, Some(Recorded::RetryAfter));
        late.broker = 1;
        late.claim = claim(Duration::from_millis(25), Duration::from_millis(40));
        let mut last = rec(1, 2, 50, 51, Some(Recorded::Ack));
        last.claim = claim(Duration::from_millis(49), Duration::from_millis(50));
        let h = history(vec![child, late, last]);
        settled(&h, 1, 1, 41);
        settled(&h, 1, 2, 51);
        h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(28));
        h.process_killed(100, Duration::from_millis(35), Duration::from_millis(36));
        h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
            .unwrap();
    }

    #[test]
    fn a_group_moves_on_once_a_later_claim_finished_a_late_handlers_row() {
        // Advisory: broker 1's connections were killed from 7 ms on. Its delivery of row 1 at
        // attempt 2 (claimed 15-21 ms) began after a child process had claimed attempt 3 and
        // started it at 20 ms; the child acked at `acked`. Row 2 of the group ran at 40 ms.
        let run = |acked: u64| {
            let mut first = rec(1, 1, 5, 8, Some(Recorded::Retry));
            first.broker = 1;
            first.claim = claim(Duration::from_millis(4), Duration::from_millis(5));
            let mut late = rec(1, 2, 21, 25, Some(Recorded::Error));
            late.broker = 1;
            late.claim = claim(Duration::from_millis(15), Duration::from_millis(21));
            let mut child = rec(1, 3, 20, acked, Some(Recorded::Ack));
            child.broker = 100;
            let mut next = rec(2, 1, 40, 41, Some(Recorded::Ack));
            next.key = Some("k2".into());
            next.claim = claim(Duration::from_millis(39), Duration::from_millis(40));
            let h = history(vec![first, late, child, next]);
            settled(&h, 1, 3, acked);
            settled(&h, 2, 1, 41);
            h.connections_killed(1, Duration::from_millis(7), Duration::from_millis(100));
            h.check(&expect(
                ClaimMode::Advisory,
                &[(1, Final::Gone), (2, Final::Gone)],
            ))
        };
        run(22).unwrap();
        // The row was still in work when the group's next row began.
        let err = run(45).unwrap_err();
        assert!(err.contains("group g moved on from row 1"), "{err}");
    }

    #[test]
    fn a_handler_recorded_just_after_a_kill_marked_its_broker_is_cut() {
        // Row lock: broker 1's claim of row 1 (10-29 ms) was in flight through the kill of its
        // connections (20-30 ms) and lost its transaction; its handler began at 29 ms, but its
        // record came in just after the kill marked the handlers it found. Broker 1's next
        // claim (29.5-31 ms) took the row again, at the same attempt, and both acked.
        let mut missed = rec(1, 1, 29, 40, Some(Recorded::Ack));
        missed.broker = 1;
        missed.claim = claim(Duration::from_millis(10), Duration::from_millis(29));
        let mut again = rec(1, 1, 31, 39, Some(Recorded::Ack));
        again.broker = 1;
        again.claim = claim(Duration::from_micros(29_500), Duration::from_millis(31));
        let h = history(vec![again]);
        settled(&h, 1, 1, 39);
        h.connections_killed(1, Duration::from_millis(20), Duration::from_millis(30));
        h.records.lock().unwrap().insert(0, missed);
        h.check(&expect(ClaimMode::RowLock, &[(1, Final::Gone)]))
            .unwrap();
    }

    #[test]
    fn a_late_handler_of_an_earlier_claim_is_ordered_by_its_attempt() {
        // Advisory: the claim at attempt 1 lost its key's session before its handler began at
        // 8 ms; the claim at attempt 2 ran from 0 to 10 ms and acked.
        let late = cut(
            rec(1, 1, 8, 9, Some(Recorded::Ack)),
            Cut::ConnectionInHandler,
        );
        let h = history(vec![rec(1, 2, 0, 10, Some(Recorded::Ack)), late]);
        h.check(&expect(ClaimMode::Advisory, &[(1, Final::Gone)]))
            .unwrap();
    }
}

//! Recording a run: handlers report their deliveries, fault injectors their faults, and each
//! fault marks the deliveries it reached.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{Claim, Cut, Marked, Record, Recorded, final_of};

/// One fault: which broker, between which moments.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fault {
    /// The broker it struck.
    pub(super) broker: usize,
    /// When it began.
    pub(super) from: Duration,
    /// When it was over.
    pub(super) to: Duration,
    /// A SIGKILL of the broker's process, not a kill of its connections.
    pub(super) crash: bool,
}

/// A shared, append-only record of deliveries and faults.
#[derive(Debug)]
pub struct History {
    pub(super) table: String,
    pub(super) epoch: SystemTime,
    pub(super) records: Mutex<Vec<Record>>,
    pub(super) faults: Mutex<Vec<Fault>>,
}

impl History {
    /// A history of deliveries from the queue table `table`; starts keeping the settlements and
    /// claims the engine reports (see `engine_events`), so faults can tell which
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

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Record>> {
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
        let subscription = Self::subscription_name(broker);
        let claims = crate::engine_events::claims(&self.table, &subscription, id, attempt);
        // The start is read under the records' lock, so a fault marked meanwhile (`mark`, which
        // holds the lock) either sees this record or was over before it began. Read outside
        // the lock, a thread descheduled between the read and the push (a loaded machine)
        // recorded a start before a connection kill whose marking had not seen the record, and
        // a handler the kill had cut was checked as uncut.
        let mut records = self.lock();
        let at = self.now();
        // The latest claim that returned this attempt of the row (row lock may claim one
        // attempt again after a rollback).
        let claim = claims
            .into_iter()
            .map(|(began, returned)| Claim {
                began: self.at_unix_micros(began),
                returned: self.at_unix_micros(returned),
            })
            .filter(|c| c.returned <= at)
            .max_by_key(|c| c.returned);
        let who = (broker, id, attempt, key, group, lease_expires_ms);
        let index = self.push_start(&mut records, at, who);
        records[index].claim = claim;
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
        let who = (broker, id, attempt, key, group, lease_expires_ms);
        self.push_start(&mut self.lock(), at, who)
    }

    /// Pushes a handler's start at `at` onto `records` (held locked): who ran it (broker, row
    /// id, attempt, key, group, lease expiry in unix ms, as [`start`](Self::start) takes them).
    /// Returns the record's index.
    fn push_start(&self, records: &mut Vec<Record>, at: Duration, who: Started) -> usize {
        let (broker, id, attempt, key, group, lease_expires_ms) = who;
        let lease_until = lease_expires_ms.map(|ms| self.at_unix_micros(ms.saturating_mul(1000)));
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
}

/// Who ran a delivery, as [`History::start`] takes it: broker, row id, attempt, key, group and
/// lease expiry (unix ms).
type Started = (usize, i64, i64, Option<String>, Option<String>, Option<i64>);

pub(super) fn last_per_row(records: &[Record]) -> HashMap<i64, &Record> {
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

//! Where a table's claims start reading: past the dead head of the claim order.
//!
//! A queue table's claim order is its id (and due time, where it has one), and acked rows leave
//! their index entries behind at the front of that order until vacuum (PostgreSQL) or purge
//! (InnoDB) removes them. A claim that reads from the start walks every one of them: measured
//! on PostgreSQL with 190,000 deleted rows ahead and an old snapshot holding vacuum back, one
//! claim read 1,766 buffers in 16 ms, against 12 buffers in 0.17 ms from the first live row.
//! A queue that slows down as it falls behind never catches up.
//!
//! So a table's claims start at a [`Position`] in the claim order, its *head*, instead of the
//! start, and read from the start only now and then:
//!
//! - The head trails the claims: it is where a claim found its first row [`LAG`] ago. Rows a
//!   claim passed over in that time (a row whose insert committed after a row with a higher id,
//!   a row locked by a claim in flight elsewhere) are still at or after it.
//! - A row this process gives back (a retry, a released lease, a rolled back or dropped
//!   delivery) moves the head back to that row at once.
//! - At least every [`FULL_SCAN_EVERY`] a claim reads from the start, so rows that come back
//!   before the head otherwise (a lease that ran out, another process's retry or crash, a due
//!   time moved back by hand) are found within that long.
//!
//! Tables whose claim order cannot be resumed from a position this way (a priority column, FIFO
//! groups) always read from the start.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::driver::Position;
use crate::table::TableDescription;

/// How far the head trails the claims.
pub(crate) const LAG: Duration = Duration::from_secs(1);

/// How often a claim reads from the start at least.
pub(crate) const FULL_SCAN_EVERY: Duration = Duration::from_secs(5);

/// A table's head (see the module docs).
#[derive(Debug)]
pub(crate) struct Head {
    /// Whether the table's claim order can be resumed from a position.
    enabled: bool,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Where claims start now; `None`: from the start.
    head: Option<Position>,
    /// The first row of recent claims, oldest first, with when it was found.
    found: VecDeque<(Instant, Position)>,
    /// When a claim last read from the start.
    full_scan: Option<Instant>,
}

impl Head {
    pub(crate) fn new(table: &TableDescription) -> Self {
        Self {
            enabled: Position::resumes(table),
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the next claim starts reading: `None` from the start (no head yet, or the last
    /// read from the start was [`FULL_SCAN_EVERY`] ago, which this call then counts as done).
    pub(crate) fn start(&self) -> Option<Position> {
        if !self.enabled {
            return None;
        }
        let now = Instant::now();
        let mut s = self.lock();
        let due = s
            .full_scan
            .is_none_or(|at| now.duration_since(at) >= FULL_SCAN_EVERY);
        if due || s.head.is_none() {
            s.full_scan = Some(now);
            return None;
        }
        s.head
    }

    /// A claim found rows; `first` is the earliest of them in the claim order. The head moves
    /// to where claims found their first row [`LAG`] ago.
    pub(crate) fn found(&self, first: Position) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        let mut s = self.lock();
        s.found.push_back((now, first));
        while let Some(&(at, position)) = s.found.front() {
            if now.duration_since(at) < LAG {
                break;
            }
            s.head = Some(position);
            s.found.pop_front();
        }
    }

    /// Rows came back before the head (dead letters requeued): the next claim reads from the
    /// start.
    pub(crate) fn rescan(&self) {
        self.lock().full_scan = None;
    }

    /// This process gave a row back at `position` (retried, released, rolled back): claims
    /// start at or before it from now on.
    pub(crate) fn gave_back(&self, position: Position) {
        if !self.enabled {
            return;
        }
        let mut s = self.lock();
        if let Some(head) = s.head.as_mut() {
            *head = (*head).min(position);
        }
        for (_, p) in s.found.iter_mut() {
            *p = (*p).min(position);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> Head {
        Head::new(
            &TableDescription::builder("jobs")
                .locked_until("locked_until")
                .build()
                .unwrap(),
        )
    }

    fn at(id: i64) -> Position {
        Position { due_ms: None, id }
    }

    #[tokio::test(start_paused = true)]
    async fn the_head_trails_the_claims_by_the_lag() {
        let head = plain();
        assert_eq!(head.start(), None, "no head yet: from the start");
        head.found(at(10));
        assert_eq!(head.start(), None, "nothing found a lag ago yet");
        tokio::time::advance(LAG / 2).await;
        head.found(at(20));
        tokio::time::advance(LAG / 2).await;
        head.found(at(30));
        assert_eq!(head.start(), Some(at(10)));
        tokio::time::advance(LAG / 2).await;
        head.found(at(40));
        assert_eq!(head.start(), Some(at(20)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_reads_from_the_start_every_so_often() {
        let head = plain();
        assert_eq!(head.start(), None);
        head.found(at(10));
        tokio::time::advance(LAG).await;
        head.found(at(20));
        assert_eq!(head.start(), Some(at(10)));
        tokio::time::advance(FULL_SCAN_EVERY).await;
        assert_eq!(head.start(), None, "the full scan is due");
        assert_eq!(head.start(), Some(at(10)), "and counted as done");
    }

    #[tokio::test(start_paused = true)]
    async fn a_row_given_back_moves_the_head_and_the_claims_behind_it_back() {
        let head = plain();
        head.start();
        head.found(at(10));
        tokio::time::advance(LAG).await;
        head.found(at(50));
        assert_eq!(head.start(), Some(at(10)));
        head.gave_back(at(5));
        assert_eq!(head.start(), Some(at(5)));
        // A claim found 50 before the row came back: the head must not move past 5 when that
        // claim is a lag old.
        tokio::time::advance(LAG).await;
        head.found(at(60));
        assert_eq!(head.start(), Some(at(5)));
    }

    #[tokio::test(start_paused = true)]
    async fn positions_order_by_due_time_then_id_a_null_due_time_first() {
        let due = |due_ms, id| Position { due_ms, id };
        assert!(due(None, 100) < due(Some(i64::MIN), 1));
        assert!(due(Some(5), 100) < due(Some(6), 1));
        assert!(due(Some(5), 1) < due(Some(5), 2));
    }

    #[tokio::test(start_paused = true)]
    async fn tables_with_a_priority_or_fifo_groups_always_read_from_the_start() {
        for t in [
            TableDescription::builder("p")
                .locked_until("l")
                .priority("prio")
                .build()
                .unwrap(),
            TableDescription::builder("f")
                .locked_until("l")
                .group("g")
                .fifo(true)
                .build()
                .unwrap(),
        ] {
            let head = Head::new(&t);
            head.found(at(10));
            tokio::time::advance(LAG * 2).await;
            head.found(at(20));
            assert_eq!(head.start(), None);
            assert_eq!(head.start(), None);
        }
    }
}

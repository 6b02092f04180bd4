//! A backend wrapper that times every strategy call, so a run can say where its time went
//! (claims vs settlements, rows per claim) without touching the engine or the backends.
//!
//! [`Timed`] implements [`Backend`] by delegating each call to the wrapped backend; its
//! strategies ([`TimedStrategy`]) delegate to the backend's own strategies, so the statements are
//! exactly the backend's. The cost is two `Instant::now()` and three relaxed atomic adds per
//! call, far below one statement's round trip. It can also turn cross-process wake-ups off
//! (`listen = false`), for measuring latency with polling only.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use broker_core::driver::{
    AdvisoryStrategy, Candidate, ClaimedRow, KeyWalk, LeaseStrategy, LeaseToken, Position,
    Prepared, RowLockClaim, RowLockStrategy, RowTransaction, Settle,
};
use broker_core::{Backend, Capabilities, NewJob, Result, RowState, TableDescription};
use sqlx::{Database, Pool};

/// A timed strategy call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A lease claim or a row lock claim (the statement that hands out rows).
    Claim,
    /// Advisory: reading due rows with their keys.
    Candidates,
    /// Advisory: trying a key's lock.
    TryLock,
    /// Advisory: taking a row under its key.
    Take,
    /// Any mode's settlement.
    Settle,
    /// Advisory: freeing a key.
    Unlock,
    /// Lease: moving an expiry forward.
    Renew,
}

impl Op {
    /// Every op, in report order.
    pub const ALL: [Op; 7] = [
        Op::Claim,
        Op::Candidates,
        Op::TryLock,
        Op::Take,
        Op::Settle,
        Op::Unlock,
        Op::Renew,
    ];

    /// The op's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::Claim => "claim",
            Op::Candidates => "candidates",
            Op::TryLock => "try_lock",
            Op::Take => "take",
            Op::Settle => "settle",
            Op::Unlock => "unlock",
            Op::Renew => "renew",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Default)]
struct OpCounters {
    calls: AtomicU64,
    nanos: AtomicU64,
    rows: AtomicU64,
}

/// Live counters of every strategy call made through one [`Timed`] backend.
#[derive(Debug, Default)]
pub struct Stats {
    ops: [OpCounters; 7],
}

impl Stats {
    fn record(&self, op: Op, started: Instant, rows: usize) {
        let c = &self.ops[op.index()];
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        c.calls.fetch_add(1, Ordering::Relaxed);
        c.nanos.fetch_add(nanos, Ordering::Relaxed);
        c.rows
            .fetch_add(u64::try_from(rows).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// A reading of the counters; subtract two readings with [`StatsSnapshot::since`].
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut out = StatsSnapshot::default();
        for (slot, c) in out.ops.iter_mut().zip(&self.ops) {
            *slot = OpTotals {
                calls: c.calls.load(Ordering::Relaxed),
                nanos: c.nanos.load(Ordering::Relaxed),
                rows: c.rows.load(Ordering::Relaxed),
            };
        }
        out
    }
}

/// Totals of one op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpTotals {
    /// Calls made.
    pub calls: u64,
    /// Time spent in them, summed over calls (overlapping calls count twice).
    pub nanos: u64,
    /// Rows they handed out (claims, candidates, takes) or 1 per successful lock.
    pub rows: u64,
}

impl OpTotals {
    /// Mean time per call in milliseconds (0 without calls).
    pub fn mean_ms(&self) -> f64 {
        if self.calls == 0 {
            return 0.0;
        }
        ms_of_nanos(self.nanos) / count_f64(self.calls)
    }

    /// Mean rows per call (0 without calls).
    pub fn rows_per_call(&self) -> f64 {
        if self.calls == 0 {
            return 0.0;
        }
        count_f64(self.rows) / count_f64(self.calls)
    }
}

/// A reading of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    ops: [OpTotals; 7],
}

impl StatsSnapshot {
    /// The totals of `op`.
    pub fn op(&self, op: Op) -> OpTotals {
        self.ops[op.index()]
    }

    /// What happened between `earlier` and this reading.
    pub fn since(&self, earlier: &StatsSnapshot) -> StatsSnapshot {
        let mut out = *self;
        for (o, e) in out.ops.iter_mut().zip(&earlier.ops) {
            o.calls = o.calls.saturating_sub(e.calls);
            o.nanos = o.nanos.saturating_sub(e.nanos);
            o.rows = o.rows.saturating_sub(e.rows);
        }
        out
    }

    /// Time spent in all calls, milliseconds (overlapping calls count twice).
    pub fn total_ms(&self) -> f64 {
        self.ops.iter().map(|o| ms_of_nanos(o.nanos)).sum()
    }
}

/// Milliseconds of a nanosecond count, as a float for reports.
pub fn ms_of_nanos(nanos: u64) -> f64 {
    count_f64(nanos) / 1e6
}

/// A count as a float for reports (exact below 2^53, which every count here is).
#[allow(clippy::cast_precision_loss)]
pub fn count_f64(n: u64) -> f64 {
    n as f64
}

/// A backend whose strategy calls are timed into a shared [`Stats`].
#[derive(Debug, Clone)]
pub struct Timed<B> {
    inner: B,
    stats: Arc<Stats>,
    listen: bool,
}

impl<B: Backend> Timed<B> {
    /// Wraps `inner`; cross-process wake-ups stay as the backend has them.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            stats: Arc::new(Stats::default()),
            listen: true,
        }
    }

    /// The same backend with cross-process wake-ups off (`listen` starts nothing), so
    /// subscriptions find rows published elsewhere only by polling. Counters are shared.
    pub fn without_listen(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            stats: self.stats.clone(),
            listen: false,
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }
}

/// A strategy of any mode, timed.
#[derive(Debug)]
pub struct TimedStrategy<S> {
    inner: S,
    stats: Arc<Stats>,
}

impl<S> TimedStrategy<S> {
    fn new(inner: S, stats: &Arc<Stats>) -> Self {
        Self {
            inner,
            stats: stats.clone(),
        }
    }
}

impl<S: RowLockStrategy> RowLockStrategy for TimedStrategy<S> {
    type Db = S::Db;

    async fn claim(
        &self,
        now_ms: i64,
        from: Option<Position>,
    ) -> Result<Option<RowLockClaim<S::Db>>> {
        let t = Instant::now();
        let r = self.inner.claim(now_ms, from).await;
        let rows = r.as_ref().map_or(0, |c| usize::from(c.is_some()));
        self.stats.record(Op::Claim, t, rows);
        r
    }

    async fn begin_writes(&self, tx: &mut RowTransaction<S::Db>) -> Result<()> {
        self.inner.begin_writes(tx).await
    }

    async fn settle(
        &self,
        tx: RowTransaction<S::Db>,
        settle: Settle,
        writes_began: bool,
        keep_connection: bool,
    ) -> Result<()> {
        let t = Instant::now();
        let r = self
            .inner
            .settle(tx, settle, writes_began, keep_connection)
            .await;
        self.stats.record(Op::Settle, t, 1);
        r
    }

    fn release_kept(&self) {
        self.inner.release_kept();
    }
}

impl<S: LeaseStrategy> LeaseStrategy for TimedStrategy<S> {
    type Db = S::Db;

    async fn claim(
        &self,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
        from: Option<Position>,
    ) -> Result<Vec<ClaimedRow<S::Db>>> {
        let t = Instant::now();
        let r = self.inner.claim(limit, now_ms, expires_ms, from).await;
        let rows = r.as_ref().map_or(0, Vec::len);
        self.stats.record(Op::Claim, t, rows);
        r
    }

    async fn renew(&self, id: i64, token: LeaseToken, expires_ms: i64) -> Result<bool> {
        let t = Instant::now();
        let r = self.inner.renew(id, token, expires_ms).await;
        self.stats.record(Op::Renew, t, 1);
        r
    }

    async fn settle(&self, token: LeaseToken, settle: Settle) -> Result<bool> {
        let t = Instant::now();
        let r = self.inner.settle(token, settle).await;
        self.stats.record(Op::Settle, t, 1);
        r
    }

    async fn ack_many(&self, acks: &[(i64, LeaseToken)], now_ms: i64) -> Result<Option<Vec<i64>>> {
        let t = Instant::now();
        let r = self.inner.ack_many(acks, now_ms).await;
        // A backend that acks one row at a time ran no statement.
        if !matches!(r, Ok(None)) {
            self.stats.record(Op::Settle, t, acks.len());
        }
        r
    }

    fn release_kept(&self) {
        self.inner.release_kept();
    }
}

impl<S: AdvisoryStrategy> AdvisoryStrategy for TimedStrategy<S> {
    type Db = S::Db;
    type KeyLock = S::KeyLock;

    async fn candidates(
        &self,
        limit: usize,
        skip: usize,
        now_ms: i64,
        from: Option<Position>,
    ) -> Result<Vec<Candidate>> {
        let t = Instant::now();
        let r = self.inner.candidates(limit, skip, now_ms, from).await;
        let rows = r.as_ref().map_or(0, Vec::len);
        self.stats.record(Op::Candidates, t, rows);
        r
    }

    async fn walk_keys(
        &self,
        after: Option<&[String]>,
        limit: usize,
        now_ms: i64,
    ) -> Result<KeyWalk> {
        let t = Instant::now();
        let r = self.inner.walk_keys(after, limit, now_ms).await;
        let rows = r.as_ref().map_or(0, |w| w.candidates.len());
        self.stats.record(Op::Candidates, t, rows);
        r
    }

    async fn try_lock(&self, key: &str) -> Result<Option<S::KeyLock>> {
        let t = Instant::now();
        let r = self.inner.try_lock(key).await;
        let rows = r.as_ref().map_or(0, |l| usize::from(l.is_some()));
        self.stats.record(Op::TryLock, t, rows);
        r
    }

    async fn take(
        &self,
        lock: &mut S::KeyLock,
        id: i64,
        now_ms: i64,
    ) -> Result<Option<ClaimedRow<S::Db>>> {
        let t = Instant::now();
        let r = self.inner.take(lock, id, now_ms).await;
        let rows = r.as_ref().map_or(0, |c| usize::from(c.is_some()));
        self.stats.record(Op::Take, t, rows);
        r
    }

    async fn settle(&self, lock: &mut S::KeyLock, settle: Settle) -> Result<()> {
        let t = Instant::now();
        let r = self.inner.settle(lock, settle).await;
        self.stats.record(Op::Settle, t, 1);
        r
    }

    async fn unlock(&self, lock: S::KeyLock) -> Result<()> {
        let t = Instant::now();
        let r = self.inner.unlock(lock).await;
        self.stats.record(Op::Unlock, t, 1);
        r
    }

    fn release_kept(&self) {
        self.inner.release_kept();
    }
}

impl<B: Backend> Backend for Timed<B> {
    type Db = B::Db;
    type Admin<'a>
        = B::Admin<'a>
    where
        B: 'a;
    type RowLock = TimedStrategy<B::RowLock>;
    type Lease = TimedStrategy<B::Lease>;
    type Advisory = TimedStrategy<B::Advisory>;

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn classify(&self, error: &sqlx::Error) -> broker_core::driver::ErrorClass {
        self.inner.classify(error)
    }

    fn pool(&self) -> &Pool<B::Db> {
        self.inner.pool()
    }

    fn admin(&self) -> Self::Admin<'_> {
        self.inner.admin()
    }

    async fn prepare(&self, table: &Arc<TableDescription>) -> Result<Prepared<Self>> {
        Ok(match self.inner.prepare(table).await? {
            Prepared::RowLock(s) => Prepared::RowLock(TimedStrategy::new(s, &self.stats)),
            Prepared::Lease(s) => Prepared::Lease(TimedStrategy::new(s, &self.stats)),
            Prepared::Advisory(s) => Prepared::Advisory(TimedStrategy::new(s, &self.stats)),
        })
    }

    async fn publish<'c, P>(
        &self,
        conn: &'c mut <B::Db as Database>::Connection,
        table: &TableDescription,
        jobs: &[NewJob<P>],
    ) -> Result<Vec<i64>>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        self.inner.publish(conn, table, jobs).await
    }

    async fn publish_unique<'c, P>(
        &self,
        conn: &'c mut <B::Db as Database>::Connection,
        table: &TableDescription,
        job: &NewJob<P>,
    ) -> Result<broker_core::Published>
    where
        P: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db> + Send + Sync,
    {
        self.inner.publish_unique(conn, table, job).await
    }

    async fn register_schedule(
        &self,
        row: &broker_core::ScheduleRow,
    ) -> Result<broker_core::ScheduleRow> {
        self.inner.register_schedule(row).await
    }

    async fn record_tick(
        &self,
        conn: &mut <B::Db as Database>::Connection,
        name: &str,
        tick_ms: i64,
        prune_before_ms: i64,
    ) -> Result<bool> {
        self.inner
            .record_tick(conn, name, tick_ms, prune_before_ms)
            .await
    }

    async fn schedules(&self) -> Result<Vec<broker_core::ScheduleRow>> {
        self.inner.schedules().await
    }

    async fn row_state(&self, table: &TableDescription, id: i64) -> Result<Option<RowState>> {
        self.inner.row_state(table, id).await
    }

    fn ddl(&self, table: &TableDescription) -> Vec<String> {
        self.inner.ddl(table)
    }

    fn drop_ddl(&self, table: &TableDescription) -> Vec<String> {
        self.inner.drop_ddl(table)
    }

    async fn execute_ddl(&self, statements: &[String]) -> Result<()> {
        self.inner.execute_ddl(statements).await
    }

    async fn listen(
        &self,
        table: &Arc<TableDescription>,
        wakeup: Arc<broker_core::driver::Wakeup>,
    ) -> Result<Option<broker_core::driver::Listening>> {
        if self.listen {
            self.inner.listen(table, wakeup).await
        } else {
            Ok(None)
        }
    }
}

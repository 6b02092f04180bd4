//! The driver interface: what a backend crate implements, for backend authors only. An
//! application never needs anything here; it uses the user API a backend crate re-exports
//! ([`crate::api`]).
//!
//! A backend implements [`Backend`] (prepare a table, publish, DDL, row states, wake-ups) and
//! one strategy per claim mode it offers ([`RowLockStrategy`], [`LeaseStrategy`],
//! [`AdvisoryStrategy`]; [`NotOffered`] for a mode it lacks). The engine drives these traits
//! and never sees SQL; [`clock`] holds the time arithmetic every backend shares.

mod admin;
pub mod clock;
pub mod connect;
mod group_cursor;
pub mod indexes;
mod on_pool;
pub mod retry;
mod row_tx;
mod schedules;
mod session_lock;
mod settle;
mod signal;

pub use admin::AdminDriver;
pub use group_cursor::GroupCursor;
pub use on_pool::{ConnFuture, on_pool};
pub use row_tx::{KeptForClaim, RowTransaction, WarmConnections};
pub use schedules::{ScheduleStatements, TickParam};
pub use session_lock::{LockStatement, SessionKeyLock, TryLocked};
pub use settle::{
    ADVISORY_SETTLE_RETRY, DeadMove, DeadStatements, MoveStep, Run, SettleStatements, bind_settle,
    settle_advisory, settle_advisory_on_pool,
};
pub(crate) use signal::{Gate, Started};
pub use signal::{Signal, Wakeup};

use std::future::Future;
use std::sync::Arc;

use sqlx::{Database, Pool};

pub use crate::admin::{Count, DeadLetters, JobInfo, JobState, KindStats, Page, Pause, RowChange};
use crate::claim_mode::ClaimMode;
use crate::doctor::{Check, DoctorOptions};
use crate::error::Result;
pub use crate::error::driver_message;
pub use crate::publish::PublishPlan;
use crate::publish::{NewJob, Published};
pub use crate::schedule::{SCHEDULES_TABLE, ScheduleRow, TICKS_TABLE};
use crate::table::TableDescription;

/// The startup check's error for the columns a table lacks, naming every one with its role
/// (`missing`, in description order; not empty) so one run tells the whole fix. `source` is the
/// driver's error for the first.
pub fn missing_columns(
    table: &TableDescription,
    missing: &[(&str, &str)],
    source: sqlx::Error,
) -> crate::SqlxBrokerError {
    let names = missing
        .iter()
        .map(|(c, role)| format!("\"{c}\" ({role})"))
        .collect::<Vec<_>>()
        .join(", ");
    let what = if missing.len() == 1 {
        format!("column {names} is missing; add it or fix the description")
    } else {
        format!("columns {names} are missing; add them or fix the description")
    };
    crate::SqlxBrokerError::Schema {
        table: table.name().to_owned(),
        what,
        statement: "column check",
        source,
    }
}

/// The statement of [`Backend::payload_probe`] for a table and payload column quoted in the
/// backend's dialect: one row whose only column is the payload column, NULL, aliased as a claim
/// aliases it ([`alias::PAYLOAD`]). The false join keeps the column's type in the row's
/// description whatever the table holds.
pub fn payload_probe_sql(table: &str, column: &str) -> String {
    format!(
        "SELECT q.{column} AS {} FROM (SELECT 1 AS sqlx_broker_one) AS o LEFT JOIN {table} AS q ON 1 = 0",
        alias::PAYLOAD
    )
}

/// Column aliases every backend gives the broker's own columns in a claimed row, so core code
/// and [`Payload`](crate::Payload) can read them whatever the table calls them.
pub mod alias {
    /// The row id, as a 64-bit integer.
    pub const ID: &str = "sqlx_broker_id";
    /// The attempt as it stood before the claim, as a 64-bit integer.
    pub const ATTEMPT: &str = "sqlx_broker_attempt";
    /// The payload column, where the table has one.
    pub const PAYLOAD: &str = "sqlx_broker_payload";
    /// The row's due time as unix milliseconds rounded down, NULL when it has none (or an
    /// infinite one), on tables with a due-time column: where the row stands in the claim
    /// order (see [`Position`](super::Position)). Optional: a claim that leaves it out reads
    /// as NULL, which places the row earlier than it is and only costs the next claims a
    /// longer read.
    pub const DUE: &str = "sqlx_broker_due_ms";
    /// How many times the row was snoozed, as a 64-bit integer (NULL read as 0), on tables
    /// with a snooze counter column ([`TableDescription::snoozes`](crate::TableDescription::snoozes)).
    /// Optional: a claim that leaves it out reads as no counter.
    pub const SNOOZES: &str = "sqlx_broker_snoozes";
    /// The kind column, as text, on tables of many job kinds
    /// ([`TableDescription::kind`](crate::TableDescription::kind)):
    /// [`KindRow`](crate::KindRow) reads it.
    pub const KIND: &str = "sqlx_broker_kind";
    /// The job's own timeout in milliseconds, as a 64-bit integer (NULL: none), on tables with
    /// a job timeout column ([`TableDescription::job_timeout`](crate::TableDescription::job_timeout)).
    /// Optional: a claim that leaves it out reads as no timeout of its own.
    pub const TIMEOUT_MS: &str = "sqlx_broker_timeout_ms";
}

/// A place in the claim order of a table without a priority column or FIFO groups: the due
/// time (a row without one, or on a table without a due-time column, first: `None` sorts
/// before every time), then the id. The core passes one to a claim as where to start reading
/// (see [`LeaseStrategy::claim`]), so that acked rows whose index entries vacuum has not
/// removed yet are not read again by every claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    /// The due time in unix milliseconds, rounded down; `None` for no due time.
    pub due_ms: Option<i64>,
    /// The row id.
    pub id: i64,
}

impl Position {
    /// Whether claims of `table` can resume from a position: its claim order is due time and
    /// id, without a priority column in front or FIFO groups.
    pub fn resumes(table: &TableDescription) -> bool {
        table.priority().is_none() && !table.fifo()
    }
}

/// What a backend can do, so shared code and the conformance suite ask the backend instead of
/// testing for a database by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The database's name for messages (e.g. "SQLite").
    pub database: &'static str,
    /// Whether row lock mode is offered.
    pub row_lock: bool,
    /// Whether advisory keys live in this process only (two processes do not see each other's
    /// keys).
    pub process_local_keys: bool,
    /// Whether a publish in another process wakes subscriptions (e.g. LISTEN/NOTIFY).
    pub cross_process_wakeups: bool,
}

impl Capabilities {
    /// Everything offered, keys shared across processes, no cross-process wake-ups; a backend
    /// then turns off what it lacks.
    pub fn default_for(database: &'static str) -> Self {
        Self {
            database,
            row_lock: true,
            process_local_keys: false,
            cross_process_wakeups: false,
        }
    }

    /// Whether the backend offers `mode`.
    pub fn offers(&self, mode: ClaimMode) -> bool {
        mode != ClaimMode::RowLock || self.row_lock
    }
}

/// A row a claim handed out, with the broker's columns already read.
#[derive(Debug)]
pub struct ClaimedRow<DB: Database> {
    /// The row id.
    pub id: i64,
    /// The attempt as it stood before this claim (the first delivery reads 1).
    pub attempt: i64,
    /// The advisory key, in advisory mode.
    pub key: Option<String>,
    /// The row's due time ([`alias::DUE`]), where the claim read it.
    pub due_ms: Option<i64>,
    /// How many times the row was snoozed ([`alias::SNOOZES`]), where the claim read it.
    pub snoozes: Option<i64>,
    /// The job's own timeout in milliseconds ([`alias::TIMEOUT_MS`]), where the claim read one.
    pub timeout_ms: Option<i64>,
    /// The whole row, for the handler's `FromRow` type.
    pub row: DB::Row,
}

impl<DB: Database> ClaimedRow<DB>
where
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'a> &'a str: sqlx::ColumnIndex<DB::Row>,
{
    /// Reads the broker's columns of a claimed row by their [`alias`]es (the claim statement
    /// must select them as 64-bit integers; [`alias::DUE`] and [`alias::SNOOZES`] are
    /// optional), keeping the whole row for the handler's type.
    pub fn read(row: DB::Row, key: Option<String>) -> std::result::Result<Self, sqlx::Error> {
        use sqlx::Row;
        let optional = |name: &str| match row.try_get::<Option<i64>, _>(name) {
            Ok(value) => Ok(value),
            Err(sqlx::Error::ColumnNotFound(_)) => Ok(None),
            Err(e) => Err(e),
        };
        let due_ms = optional(alias::DUE)?;
        let timeout_ms = optional(alias::TIMEOUT_MS)?;
        let snoozes = match row.try_column(alias::SNOOZES) {
            Ok(_) => Some(optional(alias::SNOOZES)?.unwrap_or(0)),
            Err(_) => None,
        };
        Ok(Self {
            id: row.try_get(alias::ID)?,
            attempt: row.try_get(alias::ATTEMPT)?,
            key,
            due_ms,
            snoozes,
            timeout_ms,
            row,
        })
    }
}

impl<DB: Database> ClaimedRow<DB> {
    /// Where the row stands in the claim order.
    pub fn position(&self) -> Position {
        Position {
            due_ms: self.due_ms,
            id: self.id,
        }
    }
}

/// A due row an advisory claim may take, with its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The row id.
    pub id: i64,
    /// The rendered advisory key.
    pub key: String,
    /// Whether the backend already found the key held by another session (a read that checks
    /// keys in bulk); the claim passes such a candidate over without trying its lock, and
    /// counts it as read, so a window full of held keys still reads on.
    pub held: bool,
    /// The row's due time, where the read returned it (see [`ClaimedRow::due_ms`]).
    pub due_ms: Option<i64>,
}

impl Candidate {
    /// Where the row stands in the claim order.
    pub fn position(&self) -> Position {
        Position {
            due_ms: self.due_ms,
            id: self.id,
        }
    }
}

/// What one step of an advisory key walk found (see [`AdvisoryStrategy::walk_keys`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyWalk {
    /// For each key visited that has a claimable row, its first (by id).
    pub candidates: Vec<Candidate>,
    /// The values of the key columns of the last key visited, as text: where the next step
    /// starts after. `None` when no key was visited.
    pub last: Option<Vec<String>>,
    /// How many keys were visited; fewer than asked means the walk reached the last key.
    pub visited: usize,
}

impl KeyWalk {
    /// Reads the rows of a key walk statement laid out as: the `columns` walked as text, the
    /// candidate's id (NULL when the key or group has none), then the `template`'s columns of
    /// the candidate's row as text, from which its key is rendered. Candidates are not marked
    /// held.
    pub fn read<R: sqlx::Row>(
        rows: &[R],
        columns: usize,
        template: &crate::KeyTemplate,
    ) -> std::result::Result<Self, sqlx::Error>
    where
        usize: sqlx::ColumnIndex<R>,
        String: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        let mut walk = KeyWalk {
            visited: rows.len(),
            ..KeyWalk::default()
        };
        for row in rows {
            let values = (0..columns)
                .map(|i| row.try_get::<String, _>(i))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            if let Some(id) = row.try_get::<Option<i64>, _>(columns)? {
                let key = (columns + 1..row.len())
                    .map(|i| row.try_get::<Option<String>, _>(i))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                walk.candidates.push(Candidate {
                    id,
                    key: template.render(&key),
                    held: false,
                    due_ms: None,
                });
            }
            walk.last = Some(values);
        }
        Ok(walk)
    }
}

/// What a settlement does to the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Delete the row, or set `processed_at`.
    Ack,
    /// Put the row back; with a due time (unix milliseconds) it waits until then.
    Retry {
        /// When the row is due again, if later than now.
        due_ms: Option<i64>,
    },
    /// Move the row to the dead-letter table, or set the dead-letter column.
    DeadLetter,
    /// Put the row back due at `due_ms` without spending the delivery's attempt: the attempt
    /// column is left as it stood before the claim (one less where the claim counted it), and
    /// the snooze counter, where the table has one, counts one more.
    Snooze {
        /// When the row is due again (unix milliseconds).
        due_ms: i64,
    },
    /// Delete the row (whatever the table keeps of acked rows): an operator cancelled it while
    /// it was in work (see [`Queue::cancel`](crate::Queue::cancel)).
    Cancel,
}

/// A settlement: which row, what to do, and the host's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settle {
    /// The row id.
    pub id: i64,
    /// What to do.
    pub action: Action,
    /// The host's clock, unix milliseconds (written into `processed_at` and the like).
    pub now_ms: i64,
    /// The attempt column's value this delivery holds: as read (row lock), or after its claim
    /// counted it (lease, advisory). Every claim changes it, so a backend can fence a settlement
    /// on it: a stale settlement that lands after the row was claimed again changes nothing.
    pub attempt: i64,
}

impl Settle {
    /// The ack of a lease row that holds `token`, written at `now_ms`: what a backend's
    /// [`LeaseStrategy::ack_many`] runs through its per-row ack for a single row.
    pub fn lease_ack(id: i64, token: LeaseToken, now_ms: i64) -> Self {
        Self {
            id,
            action: Action::Ack,
            now_ms,
            attempt: token.attempt,
        }
    }
}

/// The token a lease claim hands out: a settlement or renewal takes effect only while the row
/// still holds both values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseToken {
    /// The expiry written into `locked_until`, unix milliseconds at a whole second.
    pub expires_ms: i64,
    /// The attempt column's value after the claim counted this delivery.
    pub attempt: i64,
}

/// What a settlement must still find in the row for it to take effect: the fence its statements
/// check, the same on every backend. A backend binds the values after the settlement's own
/// parameters (id, then the time it writes), in the order given here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// Row lock: the claim's transaction holds the row; nothing to check.
    None,
    /// Lease: the token (expiry, then attempt).
    Lease(LeaseToken),
    /// Advisory: the attempt the take wrote. The key lock keeps other claims out while it is
    /// held; this keeps out a settlement from a delivery whose key was released under it (its
    /// session ended, or a dropped future's statement landed after the drop).
    Attempt(i64),
}

impl Fence {
    /// The lease token, in lease mode.
    pub fn token(self) -> Option<LeaseToken> {
        match self {
            Self::Lease(token) => Some(token),
            Self::None | Self::Attempt(_) => None,
        }
    }
}

/// What a row lock claim hands out: the open transaction and the row it locked.
pub type RowLockClaim<DB> = (RowTransaction<DB>, ClaimedRow<DB>);

/// Row lock mode: an open transaction holds each claimed row.
pub trait RowLockStrategy: Send + Sync + 'static {
    /// The database.
    type Db: Database;

    /// Opens a transaction and takes one due row with `FOR UPDATE SKIP LOCKED`; the transaction
    /// stays open while the handler runs. `Ok(None)` when no row is due. `from`: read the claim
    /// order from this [`Position`] on (`None`: from the start); a backend may read from the
    /// start anyway, which only costs time.
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped claim may leave its connection mid-statement. The engine never
    /// cancels it.
    fn claim(
        &self,
        now_ms: i64,
        from: Option<Position>,
    ) -> impl Future<Output = Result<Option<RowLockClaim<Self::Db>>>> + Send;

    /// Marks where the handler's writes through the claim's transaction begin (a savepoint),
    /// so a retry or dead letter can undo them while the row stays locked. The engine calls it
    /// once, when the handler first asks for the delivery's transaction, and never on a
    /// delivery whose handler does not: a savepoint on every claim would put the queue row's
    /// change in a subtransaction (on PostgreSQL a MultiXact per delivery).
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped call may leave the connection mid-statement. The engine never
    /// cancels it.
    fn begin_writes(
        &self,
        tx: &mut RowTransaction<Self::Db>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Runs the settlement in the claim's transaction and commits it. `writes_began` says
    /// whether [`begin_writes`](Self::begin_writes) ran: then a retry or dead letter first
    /// rolls the handler's writes back to that mark, and every settlement ends the mark before
    /// it changes the queue row, so the row never changes inside a subtransaction.
    ///
    /// `keep_connection`: a subscription's claim loop will claim again right away, so the
    /// committed connection may be kept for that claim (see [`WarmConnections`]); `false` for
    /// rows claimed by hand, whose connection goes back to the pool.
    fn settle(
        &self,
        tx: RowTransaction<Self::Db>,
        settle: Settle,
        writes_began: bool,
        keep_connection: bool,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Gives back to the pool every connection kept for the next claim (see
    /// [`WarmConnections`]); the engine calls it when a subscription stops. None by default.
    fn release_kept(&self) {}

    /// How many connections are kept for the next claim now (see [`WarmConnections`]), so a
    /// test can tell that a stopped subscription gave them back. None by default.
    fn kept(&self) -> usize {
        0
    }
}

/// Lease mode: an expiry in `locked_until` holds each claimed row.
pub trait LeaseStrategy: Send + Sync + 'static {
    /// The database.
    type Db: Database;

    /// Claims up to `limit` due rows: writes `expires_ms` into `locked_until`, counts the
    /// attempt, and commits at once. Rows come back with the attempt before the claim.
    ///
    /// `from`: read the claim order from this [`Position`] on, not from the start (`None`). The
    /// core passes one only for tables without a priority or FIFO groups, trailing its claims
    /// and reading from the start every few seconds (see `broker-core/src/head.rs`), so that
    /// index entries of acked rows that vacuum has not removed are not read by every claim. A
    /// backend may ignore it and read from the start: that only costs time.
    fn claim(
        &self,
        limit: usize,
        now_ms: i64,
        expires_ms: i64,
        from: Option<Position>,
    ) -> impl Future<Output = Result<Vec<ClaimedRow<Self::Db>>>> + Send;

    /// Moves the expiry of row `id` from `token` to `expires_ms`; `false` when the row no longer
    /// holds the token (the lease was lost).
    fn renew(
        &self,
        id: i64,
        token: LeaseToken,
        expires_ms: i64,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Settles row `settle.id` while it still holds `token`; `false` (and nothing changed) when
    /// it does not.
    fn settle(
        &self,
        token: LeaseToken,
        settle: Settle,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Acks, in one statement and one commit, every row of `acks` (id and token) that still
    /// holds its token, and returns the ids it acked: a row missing from them no longer held
    /// its token (or was gone), and nothing changed in it. `now_ms` is what an ack writes where
    /// the table keeps acked rows.
    ///
    /// One try, no retries: when it fails the engine settles each row with
    /// [`settle`](Self::settle), which runs again after lost connections and isolates a row
    /// whose ack fails for a reason of its own. The engine calls it with the acks that finished
    /// while its last ack statements ran (one or more). `None`, the default, says this backend
    /// acks one row at a time: the engine then calls `settle` for each and does not ask again.
    fn ack_many(
        &self,
        acks: &[(i64, LeaseToken)],
        now_ms: i64,
    ) -> impl Future<Output = Result<Option<Vec<i64>>>> + Send {
        let _ = (acks, now_ms);
        async { Ok(None) }
    }

    /// Gives back to the pool every connection kept for the next statement (see
    /// [`WarmConnections`]); the engine calls it when a subscription stops. None by default.
    fn release_kept(&self) {}

    /// How many connections are kept for the next statement now (see [`WarmConnections`]), so
    /// a test can tell that a stopped subscription gave them back. None by default.
    fn kept(&self) -> usize {
        0
    }
}

/// Advisory mode: a key lock, on a connection of its own, holds every row with that key.
pub trait AdvisoryStrategy: Send + Sync + 'static {
    /// The database.
    type Db: Database;
    /// A held key lock. Dropping it without [`unlock`](Self::unlock) must still free the key
    /// (e.g. by closing its connection).
    type KeyLock: Send + 'static;

    /// Due rows with their keys, best first, at most `limit`, after the first `skip` of them
    /// (the claim reads on past a window whose keys were all held). `from`: read the claim
    /// order from this [`Position`] on (see [`LeaseStrategy::claim`]); a backend may ignore it.
    fn candidates(
        &self,
        limit: usize,
        skip: usize,
        now_ms: i64,
        from: Option<Position>,
    ) -> impl Future<Output = Result<Vec<Candidate>>> + Send;

    /// Visits the tuples of [`TableDescription::key_walk_columns`](crate::TableDescription::key_walk_columns)
    /// (none of them NULL) in the order of their index, from just after the tuple whose column
    /// values are `after` (`None`: from the first), at most `limit` of them, and returns for
    /// each a candidate: on a table without FIFO groups the key's first claimable row by id; on
    /// a FIFO table the group's head (its first unfinished row) when it is due and free. A
    /// candidate's key is rendered from its own row. One index probe per tuple visited,
    /// whatever the number of rows under it: the claim walks when a window in claim order held
    /// only rows of keys in work, so that rows of one busy key or group ahead cost each claim
    /// nothing.
    fn walk_keys(
        &self,
        after: Option<&[String]>,
        limit: usize,
        now_ms: i64,
    ) -> impl Future<Output = Result<KeyWalk>> + Send;

    /// Tries the key's lock without waiting; `None` when another session holds it.
    fn try_lock(&self, key: &str) -> impl Future<Output = Result<Option<Self::KeyLock>>> + Send;

    /// Takes row `id` (counting the attempt and reading the row) only while it is still
    /// claimable; `None` when it no longer is.
    fn take(
        &self,
        lock: &mut Self::KeyLock,
        id: i64,
        now_ms: i64,
    ) -> impl Future<Output = Result<Option<ClaimedRow<Self::Db>>>> + Send;

    /// Settles a taken row; the key stays locked.
    fn settle(
        &self,
        lock: &mut Self::KeyLock,
        settle: Settle,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Frees the key.
    fn unlock(&self, lock: Self::KeyLock) -> impl Future<Output = Result<()>> + Send;

    /// Gives back to the pool every connection kept for the next try-lock (see
    /// [`WarmConnections`]); the engine calls it when a subscription stops. None by default.
    fn release_kept(&self) {}

    /// How many connections are kept for the next try-lock now (see [`WarmConnections`]), so a
    /// test can tell that a stopped subscription gave them back. None by default.
    fn kept(&self) -> usize {
        0
    }
}

/// The strategy type of a mode a backend does not offer: it has no values, so no code path can
/// reach it.
#[derive(Debug)]
pub enum NotOffered<DB> {
    #[doc(hidden)]
    _Never(
        std::convert::Infallible,
        std::marker::PhantomData<fn() -> DB>,
    ),
}

impl<DB: Database> RowLockStrategy for NotOffered<DB> {
    type Db = DB;
    async fn claim(
        &self,
        _now_ms: i64,
        _from: Option<Position>,
    ) -> Result<Option<RowLockClaim<DB>>> {
        match self {
            NotOffered::_Never(never, _) => match *never {},
        }
    }
    async fn begin_writes(&self, _tx: &mut RowTransaction<DB>) -> Result<()> {
        match self {
            NotOffered::_Never(never, _) => match *never {},
        }
    }
    async fn settle(
        &self,
        _tx: RowTransaction<DB>,
        _settle: Settle,
        _writes_began: bool,
        _keep_connection: bool,
    ) -> Result<()> {
        match self {
            NotOffered::_Never(never, _) => match *never {},
        }
    }
}

/// One prepared table: the strategy of its mode, with statements built for it.
#[derive(Debug)]
pub enum Prepared<B: Backend> {
    /// Row lock mode.
    RowLock(B::RowLock),
    /// Lease mode.
    Lease(B::Lease),
    /// Advisory mode.
    Advisory(B::Advisory),
}

/// What the row of one id looks like now (see [`Backend::row_state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RowState {
    /// The attempt column.
    pub attempt: i64,
    /// The lease expiry, unix milliseconds, if set.
    pub locked_until_ms: Option<i64>,
    /// The due time, unix milliseconds, if set.
    pub due_ms: Option<i64>,
    /// Whether `processed_at` is set.
    pub processed: bool,
    /// Whether the row is dead-lettered (moved to the dead-letter table, or marked).
    pub dead: bool,
}

impl RowState {
    /// A row state from its parts.
    pub fn new(
        attempt: i64,
        locked_until_ms: Option<i64>,
        due_ms: Option<i64>,
        processed: bool,
        dead: bool,
    ) -> Self {
        Self {
            attempt,
            locked_until_ms,
            due_ms,
            processed,
            dead,
        }
    }
}

/// What a driver error says about running the statement again: the backend's
/// [`Backend::classify`] maps its database's codes, and the core decides from it (a
/// settlement that failed `Permanent`ly counts against its row; see
/// [`SETTLE_FAILURE_LIMIT`](crate::SETTLE_FAILURE_LIMIT)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
    /// The server undid the statement (deadlock, serialization failure, lock not available,
    /// SQLite busy or locked): it can run again and will likely work.
    Transient,
    /// The connection failed or the server went away: the statement may or may not have
    /// landed, and a fresh connection may work.
    Connection,
    /// Anything else: a constraint, a trigger, a type, a missing table. It will fail again.
    Permanent,
}

/// A database backend: it prepares a table's strategy, publishes rows, and writes DDL.
pub trait Backend: Clone + Send + Sync + Sized + 'static {
    /// The sqlx database.
    type Db: Database;
    /// Row lock mode ([`NotOffered`] where the database has no row locks).
    type RowLock: RowLockStrategy<Db = Self::Db>;
    /// Lease mode.
    type Lease: LeaseStrategy<Db = Self::Db>;
    /// Advisory mode.
    type Advisory: AdvisoryStrategy<Db = Self::Db>;

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Classifies a driver error of this database (see [`ErrorClass`]).
    fn classify(&self, error: &sqlx::Error) -> ErrorClass;

    /// The pool the broker runs on.
    fn pool(&self) -> &Pool<Self::Db>;

    /// Refuses names the database would not keep as written (e.g. longer than its identifier
    /// limit), before DDL or preparation uses them. The broker runs it before
    /// [`prepare`](Self::prepare) and before creating tables.
    fn check_names(&self, table: &TableDescription) -> Result<()> {
        let _ = table;
        Ok(())
    }

    /// One row holding the table's payload column as a claim reads it, NULL (the statement of
    /// [`payload_probe_sql`] in the backend's quoting): [`Broker::queue`](crate::Broker::queue)
    /// decodes it as the queue's row type, so that a [`Payload`](crate::Payload) of a type the
    /// column does not decode into is refused before any row is claimed. `None` (the default; a
    /// table without a payload column; a probe that failed) skips that check.
    fn payload_probe(
        &self,
        table: &TableDescription,
    ) -> impl Future<Output = Option<<Self::Db as Database>::Row>> + Send {
        let _ = table;
        async { None }
    }

    /// Checks the server version, the table and its columns, and prepares every statement of
    /// the table's mode.
    fn prepare(
        &self,
        table: &Arc<TableDescription>,
    ) -> impl Future<Output = Result<Prepared<Self>>> + Send;

    /// Inserts rows on `conn` (a pool connection or the caller's transaction); returns the id of
    /// each row, in order.
    fn publish<'c, P>(
        &self,
        conn: &'c mut <Self::Db as Database>::Connection,
        table: &TableDescription,
        jobs: &[NewJob<P>],
    ) -> impl Future<Output = Result<Vec<i64>>> + Send
    where
        P: for<'q> sqlx::Encode<'q, Self::Db> + sqlx::Type<Self::Db> + Send + Sync;

    /// Inserts one job that carries a [unique key](NewJob::unique_key) on `conn` (a pool
    /// connection or the caller's transaction) unless an unfinished row of `table` has that key;
    /// then it returns that row's id as a duplicate. The database decides, through the unique
    /// index over unfinished rows that [`ddl`](Self::ddl) makes: never a read before the insert,
    /// and never a failed statement that would abort the caller's transaction on PostgreSQL.
    /// When the conflicting row finishes before its id is read, the insert runs again.
    fn publish_unique<'c, P>(
        &self,
        conn: &'c mut <Self::Db as Database>::Connection,
        table: &TableDescription,
        job: &NewJob<P>,
    ) -> impl Future<Output = Result<Published>> + Send
    where
        P: for<'q> sqlx::Encode<'q, Self::Db> + sqlx::Type<Self::Db> + Send + Sync;

    /// Registers a schedule in [`SCHEDULES_TABLE`]: inserts `row` unless a row of its name
    /// exists, and returns the row stored (the core compares it with `row`).
    fn register_schedule(
        &self,
        row: &ScheduleRow,
    ) -> impl Future<Output = Result<ScheduleRow>> + Send;

    /// Records tick `tick_ms` of schedule `name` in [`TICKS_TABLE`] on `conn`, inside the
    /// transaction the core opened to publish the tick's job, unless it is recorded already
    /// (then `false`: another process published it, and the core rolls back). Recording waits
    /// for a concurrent recorder of the same tick to finish, so exactly one transaction records
    /// it. Also raises the schedule's `last_tick_ms` to the tick and deletes its ticks older than
    /// `prune_before_ms`.
    fn record_tick(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        name: &str,
        tick_ms: i64,
        prune_before_ms: i64,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Every schedule registered in [`SCHEDULES_TABLE`], by name; empty when the table is
    /// missing.
    fn schedules(&self) -> impl Future<Output = Result<Vec<ScheduleRow>>> + Send;

    /// The row `id` now, or `None` when it is gone (acked by deletion).
    fn row_state(
        &self,
        table: &TableDescription,
        id: i64,
    ) -> impl Future<Output = Result<Option<RowState>>> + Send;

    /// The DDL for a description: the table, the index the claim needs, and the dead-letter
    /// table if there is one.
    fn ddl(&self, table: &TableDescription) -> Vec<String>;

    /// The statements that drop what [`ddl`](Self::ddl) creates.
    fn drop_ddl(&self, table: &TableDescription) -> Vec<String>;

    /// Runs DDL statements in order on one connection.
    fn execute_ddl(&self, statements: &[String]) -> impl Future<Output = Result<()>> + Send;

    /// The backend's own checks of a deployment for `table`, for
    /// [`Broker::doctor`](crate::Broker::doctor): server version, pooler, server settings that
    /// would cut deliveries short, the clock, the indexes the claim reads. A check that cannot
    /// run is reported as a failed check, never as an error. The default has no checks of its
    /// own (the broker's shared checks still run).
    fn doctor(
        &self,
        table: &TableDescription,
        options: &DoctorOptions,
    ) -> impl Future<Output = Vec<Check>> + Send {
        let _ = (table, options);
        async { Vec::new() }
    }

    /// The backend's operator statements (counts, listings, job control, pauses), as a value
    /// that borrows the backend: see [`AdminDriver`].
    type Admin<'a>: AdminDriver
    where
        Self: 'a;

    /// The operator statements of this backend (see [`AdminDriver`]).
    fn admin(&self) -> Self::Admin<'_>;

    /// Starts delivering wake-ups and operator [`Signal`]s from other processes for `table`
    /// into `wakeup`, where the database can (see [`Capabilities::cross_process_wakeups`]),
    /// until the returned [`Listening`] drops: [`Wakeup::rows`] for a publish,
    /// [`Wakeup::signal`] for a signal (which the backend's admin statements send in the
    /// transaction of their change), [`Wakeup::missed`] after notifications may have been
    /// lost. The poll stays the fallback. A backend shares what it holds for this (a
    /// connection) between every table it listens for: a subscription must cost nothing of its
    /// own at idle.
    fn listen(
        &self,
        table: &Arc<TableDescription>,
        wakeup: Arc<Wakeup>,
    ) -> impl Future<Output = Result<Option<Listening>>> + Send;
}

/// The table that holds which queues are paused, shared by every queue of a database (the DDL
/// helper creates it beside each queue table): one row per paused queue, with the queue's
/// table name, when it was paused (unix ms) and by whom.
pub const CONTROL_TABLE: &str = "sqlx_broker_control";

/// The table that holds cancel requests for rows in work, shared by every queue of a database
/// (the DDL helper creates it beside the control table): one row per requested cancel, with
/// the queue's table name, the row's id and when it was requested (unix ms), keyed on the queue
/// and the id, so the subscriptions' read of one queue's requests is an index range. A table of
/// its own, not rows of the control table, whose key is the queue alone (one pause per queue).
pub const CANCEL_TABLE: &str = "sqlx_broker_cancels";

/// The statement of a backend's [`drop_ddl`](Backend::drop_ddl) that deletes a dropped queue's
/// pause, the queue's name given as a string literal of the backend's dialect: a plain
/// statement (no procedural block whose quoting a name could end), which fails where the
/// control table was never created; a backend skips that error ([`is_unpause_ddl`]).
pub fn unpause_ddl(queue_literal: &str) -> String {
    format!("DELETE FROM {CONTROL_TABLE} WHERE queue = {queue_literal}")
}

/// The statement of a backend's [`drop_ddl`](Backend::drop_ddl) that deletes a dropped queue's
/// cancel requests (as [`unpause_ddl`] its pause; skipped likewise where the cancel table was
/// never created).
pub fn uncancel_ddl(queue_literal: &str) -> String {
    format!("DELETE FROM {CANCEL_TABLE} WHERE queue = {queue_literal}")
}

/// Whether `sql` is [`unpause_ddl`]'s or [`uncancel_ddl`]'s.
pub fn is_unpause_ddl(sql: &str) -> bool {
    sql.starts_with(&format!("DELETE FROM {CONTROL_TABLE} WHERE "))
        || sql.starts_with(&format!("DELETE FROM {CANCEL_TABLE} WHERE "))
}

/// Row counts by state, as a backend reads them for [`AdminDriver::stats`]; the core adds the
/// table, the clock and the pause to make a [`QueueStats`](crate::QueueStats).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsCounts {
    /// Due now, held by no delivery.
    pub due: Count,
    /// Due later, held by no delivery.
    pub scheduled: Count,
    /// Held by a delivery.
    pub in_work: Count,
    /// Unfinished with an attempt above 1.
    pub retrying: Count,
    /// Dead letters; `None` without a dead-letter target.
    pub dead: Option<Count>,
    /// Acked rows kept; `None` when acks delete.
    pub finished: Option<Count>,
    /// The due time of the oldest due row that has one.
    pub oldest_due_ms: Option<i64>,
    /// The counts of each kind, on a table with a kind column (see [`by_kind`](Self::by_kind)).
    pub kinds: Vec<crate::admin::KindStats>,
}

/// The part of a kinds table's stats statement that counts its dead-letter table by kind:
/// appended to the statement that counts the table grouped by kind (whose select list is the
/// six counts of [`kind_part`] in its order, the oldest due time, then the kind), so both are
/// read in one statement, one snapshot. `dead_table` and `kind` (an expression of the kind
/// column as text, the same one the statement groups by) come quoted by the backend;
/// `null_int` is its typed integer NULL.
pub fn dead_by_kind(dead_table: &str, kind: &str, null_int: &str) -> String {
    format!(
        " UNION ALL SELECT 0, 0, 0, 0, {null_int}, count(*), {null_int}, {kind} \
         FROM {dead_table} GROUP BY {kind}"
    )
}

/// One row of a stats statement grouped by kind, as [`KindStats`]:
/// `counts` are due, scheduled, in work, retrying, finished and dead, in that order (NULL
/// finished or dead: the table keeps none), each made a [`Count`] by `count`.
pub fn kind_part(
    kind: Option<String>,
    counts: [Option<i64>; 6],
    count: impl Fn(i64) -> Count,
) -> crate::admin::KindStats {
    let c = |v: Option<i64>| count(v.unwrap_or(0));
    let mut part = crate::admin::KindStats::new(kind);
    part.due = c(counts[0]);
    part.scheduled = c(counts[1]);
    part.in_work = c(counts[2]);
    part.retrying = c(counts[3]);
    part.finished = counts[4].map(&count);
    part.dead = counts[5].map(&count);
    part
}

impl StatsCounts {
    /// The counts of a kinds table from the rows of one statement grouped by kind: the parts
    /// (several for one kind where the statement counts the dead-letter table apart, say) are
    /// merged by kind and sorted, and the totals are their sums, so every row counts once in
    /// the totals and once in its kind.
    pub fn by_kind(
        table: &crate::TableDescription,
        parts: Vec<crate::admin::KindStats>,
        oldest_due_ms: Option<i64>,
    ) -> Self {
        use crate::admin::KindStats;
        let mut kinds: Vec<KindStats> = Vec::new();
        for part in parts {
            match kinds.iter_mut().find(|k| k.kind == part.kind) {
                Some(k) => k.add(&part),
                None => kinds.push(part),
            }
        }
        // Every kind has the table's dead and finished counts (zero where none), or none.
        for k in &mut kinds {
            k.dead = table
                .dead_letter()
                .map(|_| k.dead.unwrap_or(Count::exact(0)));
            k.finished = table
                .processed_at()
                .map(|_| k.finished.unwrap_or(Count::exact(0)));
        }
        kinds.sort_by(|a, b| a.kind.cmp(&b.kind));
        let mut total = KindStats::new(None);
        total.dead = table.dead_letter().map(|_| Count::exact(0));
        total.finished = table.processed_at().map(|_| Count::exact(0));
        for k in &kinds {
            total.add(k);
        }
        Self {
            due: total.due,
            scheduled: total.scheduled,
            in_work: total.in_work,
            retrying: total.retrying,
            dead: total.dead,
            finished: total.finished,
            oldest_due_ms,
            kinds,
        }
    }
}

/// A registration for wake-ups from other processes (see [`Backend::listen`]): dropping it
/// ends the registration (the backend stops listening on the table's behalf once no
/// registration needs it).
pub struct Listening {
    _guard: Box<dyn Send + Sync>,
}

impl Listening {
    /// A registration that `guard` ends when it drops.
    pub fn new(guard: impl Send + Sync + 'static) -> Self {
        Self {
            _guard: Box::new(guard),
        }
    }
}

impl std::fmt::Debug for Listening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listening").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod kinds_tests {
    use super::*;
    use crate::{ColumnType, DeadLetter, TableDescription};

    #[test]
    fn counts_by_kind_merge_their_parts_and_the_totals_are_their_sums() {
        let t = TableDescription::builder("jobs")
            .payload("args", ColumnType::Json)
            .kind("kind")
            .locked_until("locked_until")
            .max_attempts(2)
            .dead_letter(DeadLetter::Table("jobs_dead".into()))
            .build()
            .unwrap();
        let exact = |n| Count::exact(u64::try_from(n).unwrap());
        let parts = vec![
            kind_part(
                Some("b".into()),
                [Some(2), Some(1), Some(1), Some(0), None, Some(0)],
                exact,
            ),
            kind_part(
                Some("a".into()),
                [Some(5), None, None, Some(1), None, Some(0)],
                exact,
            ),
            // The dead-letter table's part of kind b, and of a kind only dead letters have.
            kind_part(
                Some("b".into()),
                [Some(0), Some(0), Some(0), Some(0), None, Some(3)],
                exact,
            ),
            kind_part(
                Some("gone".into()),
                [Some(0), Some(0), Some(0), Some(0), None, Some(4)],
                exact,
            ),
        ];
        let s = StatsCounts::by_kind(&t, parts, Some(7));
        let names: Vec<_> = s.kinds.iter().map(|k| k.kind.as_deref()).collect();
        assert_eq!(names, [Some("a"), Some("b"), Some("gone")]);
        assert_eq!(s.kinds[1].dead, Some(Count::exact(3)));
        assert_eq!(s.kinds[1].due, Count::exact(2));
        assert_eq!(s.due, Count::exact(7));
        assert_eq!(s.dead, Some(Count::exact(7)));
        assert_eq!(s.finished, None, "acks delete on this table");
        assert!(s.kinds.iter().all(|k| k.finished.is_none()));
        assert_eq!(s.oldest_due_ms, Some(7));
        // An estimate in any part makes the sum one.
        let parts = vec![kind_part(
            Some("a".into()),
            [Some(1), Some(0), Some(0), Some(0), None, Some(0)],
            |n| Count::estimate(u64::try_from(n).unwrap()),
        )];
        assert!(!StatsCounts::by_kind(&t, parts, None).due.exact);
    }
}

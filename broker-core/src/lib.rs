//! The core of sqlx-broker: a task queue that serves work from a service's own SQL tables.
//!
//! A [`TableDescription`] names the roles of a table's columns and so selects a claim mode; a
//! backend crate (`broker-sqlite`, `broker-postgres`, `broker-mysql`) prepares it as a [`Queue`];
//! a [`Subscription`] claims due rows, runs a handler on each [`Delivery`], and settles it with
//! the handler's [`Outcome`]. This crate holds the protocol and the engine and knows no
//! database's SQL.
//!
//! | claim mode | selected by | PostgreSQL 11+ | MySQL 8.0.1+ / MariaDB 10.6+ | SQLite |
//! |---|---|---|---|---|
//! | row lock | no mode set | yes | yes | no (refused: add `locked_until` or `advisory_lock`) |
//! | lease | a `locked_until` column | yes | yes | yes |
//! | advisory lock | `advisory_lock = "<template>"` | yes (session locks) | yes (`GET_LOCK`) | yes (keys held in the process) |
//!
//! ```
//! use broker_core::{ClaimMode, TableDescription};
//!
//! let jobs = TableDescription::builder("jobs")
//!     .payload("payload", broker_core::ColumnType::Text)
//!     .locked_until("locked_until")
//!     .due_at("due_at")
//!     .build()
//!     .unwrap();
//! assert_eq!(jobs.mode(), ClaimMode::Lease);
//!
//! let err = TableDescription::builder("jobs")
//!     .locked_until("locked_until")
//!     .advisory_lock("account-{account}")
//!     .build()
//!     .unwrap_err();
//! assert!(err.to_string().contains("keep one of them"));
//! ```
//!
//! A runnable end-to-end example is `broker-sqlite`'s quickstart
//! (`cargo run -p broker-sqlite --example quickstart`).
//!
//! # Attempts
//! The attempt column starts at 1 and every delivery reports it as it stood before its claim, so
//! the first delivery reads 1 in every mode. Row lock counts the attempt in the settlement that
//! puts the row back (a crash rolls it back, so it uses none); lease counts it at the claim and
//! advisory at the take (a crash uses one). With `max_attempts = n`, a delivery that fails when
//! its attempt is `n` or more dead-letters the row, and a row whose attempts crashes spent is
//! dead-lettered when next claimed, without running the handler.
//!
//! # Settlements that fail
//! A settlement whose statement fails leaves the row as the claim found it: row lock rolls back
//! (the attempt never moves), lease gives the row back at once, advisory unlocks the key. Every
//! such failure counts in [`MetricsSnapshot::settle_failed`]. A failure that will happen again
//! (a constraint, a trigger, a value the column cannot hold; not a lost connection, a deadlock
//! or a lock timeout) also counts against the row, in this process: its next delivery waits
//! first, holding its claim (the error backoff for that many failures, at least the poll
//! interval doubled per failure up to 30 s), and after [`SETTLE_FAILURE_LIMIT`] failures in a
//! row the row is dead-lettered at its next claim without running the handler again, with the
//! last error in the log. A table without a dead-letter target keeps such a row and runs it
//! ever more rarely. The count lives in the engine because in row lock mode nothing the failed
//! settlement wrote survives its rollback.
//!
//! Due times are clamped to [`driver::clock::MAX_DUE_MS`] (9999-12-31), so
//! `Outcome::RetryAfter(Duration::MAX)` parks a row instead of failing its settlement.
//!
//! # Time
//! Due times and lease expiries come from the host's clock in unix milliseconds; lease expiries
//! are whole seconds, so a time column without fractions fences exactly.

pub mod admin;
mod broker;
mod cancel;
mod claim_mode;
mod delivery;
pub mod doctor;
pub mod driver;
mod error;
#[doc(hidden)]
pub mod events;
mod head;
mod inner;
mod kinds;
mod metrics;
mod mode;
mod payload;
mod publish;
mod redact;
mod schedule;
mod subscription;
mod table;
mod warnings;

pub use admin::{
    Cancelled, Count, DeadLetters, JobInfo, JobState, KindStats, Page, Pause, QueueStats,
};
#[cfg(feature = "metrics")]
pub use broker::DepthExport;
pub use broker::{Broker, Queue};
pub use cancel::{CancelReason, CancelSignal};
pub use claim_mode::{ClaimMode, ModeColumns};
pub use delivery::{Delivery, Job, JobTransaction, Outcome, TxGuard};
pub use doctor::{Check, DoctorOptions, DoctorReport, Status};
pub use driver::{Backend, Capabilities, RowState, RowTransaction};
pub use error::{Result, SqlxBrokerError};
pub use inner::SETTLE_FAILURE_LIMIT;
pub use kinds::{JobKind, KindDefaults, KindRow, KindsService, Workers};
pub use metrics::MetricsSnapshot;
pub use payload::Payload;
pub use publish::{NewJob, Published, Value};
pub use redact::redact_passwords;
pub use schedule::{
    DEFAULT_MAX_LATENESS, MAX_LATENESS_CAP, MAX_SCHEDULE_NAME_CHARS, Missed, Schedule, ScheduleRow,
    Scheduled, Tick,
};
/// sqlx's JSON wrapper: a kinds table's jobs are published as `Json` of the kind's type.
pub use sqlx::types::Json;
pub use subscription::{
    BoxError, BoxFuture, DEFAULT_CANCEL_GRACE, DEFAULT_POLL_COOLDOWN, HandlerPanicked,
    HandlerResult, HandlerService, Health, IntoOutcome, MIN_POLL_INTERVAL, ShutdownReport,
    SubscribeOptions, Subscription, Unrecoverable, handler_service,
};
pub use table::{
    ColumnType, DEFAULT_LEASE_SECONDS, DeadLetter, IsolationLevel, KeyPart, KeyTemplate,
    MAX_KIND_CHARS, MAX_UNIQUE_KEY_CHARS, TableBuilder, TableDescription, check_kind_name,
};

/// The user API, in one glob: every backend crate re-exports it at its root
/// (`pub use broker_core::api::*`), so an application depends on one backend crate alone.
/// What backends implement lives in [`driver`] and is not part of it.
pub mod api {
    #[cfg(feature = "metrics")]
    pub use crate::DepthExport;
    /// The counts of one kind in [`QueueStats::kinds`].
    pub use crate::KindStats;
    pub use crate::{
        BoxError, Broker, CancelReason, CancelSignal, Cancelled, Check, ClaimMode, ColumnType,
        Count, DEFAULT_CANCEL_GRACE, DEFAULT_LEASE_SECONDS, DEFAULT_POLL_COOLDOWN, DeadLetter,
        DeadLetters, Delivery, DoctorOptions, DoctorReport, HandlerPanicked, HandlerResult,
        HandlerService, Health, IntoOutcome, IsolationLevel, Job, JobInfo, JobState,
        JobTransaction, KeyPart, KeyTemplate, MIN_POLL_INTERVAL, MetricsSnapshot, ModeColumns,
        NewJob, Outcome, Page, Pause, Payload, Queue, QueueStats, Result, RowState, RowTransaction,
        SETTLE_FAILURE_LIMIT, ShutdownReport, SqlxBrokerError, Status, SubscribeOptions,
        Subscription, TableBuilder, TableDescription, TxGuard, Value,
    };
    pub use crate::{BoxFuture, handler_service};
    pub use crate::{
        DEFAULT_MAX_LATENESS, MAX_LATENESS_CAP, MAX_SCHEDULE_NAME_CHARS, MAX_UNIQUE_KEY_CHARS,
        Missed, Published, Schedule, ScheduleRow, Scheduled, Tick,
    };
    pub use crate::{
        JobKind, Json, KindDefaults, KindRow, MAX_KIND_CHARS, Unrecoverable, Workers,
        check_kind_name,
    };
    /// The tower traits a middleware implements: a [`Layer`] wraps a [`Service`] of jobs (see
    /// [`HandlerService`]).
    pub use tower_layer::Layer;
    pub use tower_service::Service;
}

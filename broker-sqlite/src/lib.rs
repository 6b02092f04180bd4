//! The SQLite backend of sqlx-broker: a task queue in the application's own SQLite file.
//!
//! SQLite has no row locks, so it offers **lease** mode (a `locked_until` column) and
//! **advisory** mode (an `advisory_lock` template, with keys held in this process). A table with
//! neither is refused with [`SqlxBrokerError::ModeNotOffered`].
//!
//! | mode | claim | what gives a row back when the process dies |
//! |---|---|---|
//! | lease | one `UPDATE .. RETURNING` writes the expiry and counts the attempt | the lease runs out |
//! | advisory | select due rows with their keys, take each key in the process's key table, then `UPDATE .. RETURNING` the row if still claimable | nothing is held outside the process |
//!
//! One crate is all you depend on (with tokio): it re-exports the whole user API, and
//! [`sqlx`] for your own queries. A handler is a plain `async fn` of a [`Job`] (or a closure
//! returning an `async` block).
//!
//! ```no_run
//! use broker_sqlite::{
//!     ColumnType, Job, NewJob, Outcome, Payload, SqliteBackend, SubscribeOptions,
//!     TableDescription,
//! };
//!
//! async fn greet(job: Job<Payload<String>>) -> Result<Outcome, std::io::Error> {
//!     println!("hello, {}", job.payload().0);
//!     Ok(Outcome::Ack)
//! }
//!
//! # async fn run() -> broker_sqlite::Result<()> {
//! let broker = SqliteBackend::connect("sqlite:jobs.db").await?;
//! let table = TableDescription::builder("jobs")
//!     .payload("payload", ColumnType::Text)
//!     .locked_until("locked_until")
//!     .build()?;
//! broker.create_tables(&table).await?;
//! let queue = broker.queue::<Payload<String>>(table).await?;
//! queue.publish(NewJob::new("world".to_owned())).await?;
//! let sub = queue.subscribe(SubscribeOptions::new().concurrency(4), greet)?;
//! sub.shutdown().await;
//! broker.close().await;
//! # Ok(()) }
//! ```
//!
//! Complete programs are in `examples/`: `quickstart`, `sqlite_lease` (a typed row with a JSON
//! payload) and `sqlite_advisory`, e.g. `cargo run -p broker-sqlite --example sqlite_lease`.
//! The guide in the repository's `docs/` covers every builder call, outcomes, typed rows and
//! JSON, operating and deploying.
//!
//! # Things to know
//! - **Times** are INTEGER unix milliseconds (the DDL helper creates them so).
//! - **One writer at a time** is SQLite's design: connections use WAL and a 30 s busy timeout,
//!   and multi-statement writes start with `BEGIN IMMEDIATE`, so workers wait for the writer
//!   instead of failing with "database is locked". A write still busy past the timeout is
//!   transient (see [`classify`] and [`is_transient`]): claims and settlements run again under
//!   the core's retry policy, as on the other databases.
//! - **Advisory keys live in this process**, in one key table per database file (by canonical
//!   path; an in-memory database by its name). Two processes on one file do not see each other's
//!   keys, so a row can then be delivered twice: run one process per file in advisory mode, or
//!   use lease mode.
//! - **FIFO** needs no guard lock: with one writer, reading a group's head and taking it never
//!   interleave with another claim. A claim walks the groups in turn through the group index,
//!   one probe per group however many rows a group holds.
//! - The lease claim's `RETURNING` hands rows back in no particular order.
//! - **Rows in work** in `queue.stats()` and `queue.jobs(..)`: a lease not run out, or an
//!   advisory key this process holds (one row per held key). Another process's deliveries on the
//!   same file hold keys this process does not see, so in advisory mode its rows count as due.

mod admin;
mod advisory;
mod backend;
mod doctor;
mod fifo;
mod keys;
mod lease;
mod schedule;
mod schema;
mod sql;
mod version;

pub use admin::SqliteAdmin;
pub use backend::{SqliteBackend, SqliteBroker};
pub use broker_core::api::*;
pub use sql::{ErrorClass, classify, is_transient};
/// The sqlx this crate is built on, for your own queries in the same transaction as a job.
pub use sqlx;

/// A prepared table on this database (see [`Queue`]).
pub type SqliteQueue<T> = Queue<SqliteBackend, T>;
/// A row claimed by hand on this database (see [`Delivery`]).
pub type SqliteDelivery<T> = Delivery<SqliteBackend, T>;

/// The README's examples, compiled as doctests so they stay true (the PostgreSQL and MySQL
/// ones through this crate's dev-dependencies on those backends).
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The guide's snippets (`docs/*.md`), compiled as doctests; the SQLite ones run.
#[cfg(doctest)]
pub mod guide {
    /// `docs/modes.md`.
    #[doc = include_str!("../../docs/modes.md")]
    pub struct Modes;
    /// `docs/tables.md`.
    #[doc = include_str!("../../docs/tables.md")]
    pub struct Tables;
    /// `docs/publishing.md`.
    #[doc = include_str!("../../docs/publishing.md")]
    pub struct Publishing;
    /// `docs/handlers.md`.
    #[doc = include_str!("../../docs/handlers.md")]
    pub struct Handlers;
    /// `docs/job-kinds.md`.
    #[doc = include_str!("../../docs/job-kinds.md")]
    pub struct JobKinds;
    /// `docs/timeouts-and-cancelling.md`.
    #[doc = include_str!("../../docs/timeouts-and-cancelling.md")]
    pub struct TimeoutsAndCancelling;
    /// `docs/typed-rows.md`.
    #[doc = include_str!("../../docs/typed-rows.md")]
    pub struct TypedRows;
    /// `docs/fifo-and-keys.md`.
    #[doc = include_str!("../../docs/fifo-and-keys.md")]
    pub struct FifoAndKeys;
    /// `docs/unique-and-periodic.md`.
    #[doc = include_str!("../../docs/unique-and-periodic.md")]
    pub struct UniqueAndPeriodic;
    /// `docs/operating.md`.
    #[doc = include_str!("../../docs/operating.md")]
    pub struct Operating;
    /// `docs/deploying.md`.
    #[doc = include_str!("../../docs/deploying.md")]
    pub struct Deploying;
    /// `docs/testing.md`.
    #[doc = include_str!("../../docs/testing.md")]
    pub struct Testing;
}

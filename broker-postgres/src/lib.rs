//! The PostgreSQL backend of sqlx-broker: a task queue in the application's own PostgreSQL
//! tables (PostgreSQL 11 or newer).
//!
//! All three claim modes are offered; the table description chooses one (see
//! [`ClaimMode`]).
//!
//! | mode | claim | what gives a row back when the process dies | attempt counted |
//! |---|---|---|---|
//! | row lock (no mode set) | a transaction selects one row `FOR UPDATE SKIP LOCKED` and stays open while the handler runs | the server rolls the transaction back; the row is due again at once | at settlement (a crash uses none) |
//! | lease (`locked_until`) | one statement: a CTE locks claimable rows `FOR UPDATE SKIP LOCKED`, an `UPDATE` writes the expiry and counts the attempt, `RETURNING` hands them back | the lease runs out (30 s unless set) | at the claim |
//! | advisory (`advisory_lock = ".."`) | due rows with their keys (keys held anywhere left out), then `pg_try_advisory_lock(hashtextextended(key, 0))` on a connection of its own, then the row if still claimable | the session ends and the server frees the key | at the take |
//!
//! One crate is all you depend on (with tokio): it re-exports the whole user API, and
//! [`sqlx`] for your own queries. A handler is a plain `async fn` of a [`Job`].
//!
//! ```no_run
//! use broker_postgres::{
//!     BoxError, ColumnType, Job, NewJob, Outcome, Payload, PgBackend, SubscribeOptions,
//!     TableDescription,
//! };
//!
//! async fn greet(job: Job<Payload<String>>) -> Result<Outcome, BoxError> {
//!     println!("hello, {}", job.payload().0);
//!     Ok(Outcome::Ack)
//! }
//!
//! # async fn run() -> broker_postgres::Result<()> {
//! let broker = PgBackend::connect("postgres://app@localhost/app").await?;
//! let table = TableDescription::builder("jobs")
//!     .payload("payload", ColumnType::Text)
//!     .locked_until("locked_until")
//!     .due_at("due_at")
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
//! A row lock table (no mode set) can lend its claim's transaction to the handler, so that what
//! the handler writes commits with the ack, or not at all:
//!
//! ```no_run
//! use broker_postgres::{Job, Outcome, Payload, PgJobTransaction, PgQueue, SubscribeOptions};
//!
//! async fn ship(job: Job<Payload<String>>, tx: PgJobTransaction) -> broker_postgres::HandlerResult {
//!     let mut tx = tx.get().await?;
//!     broker_postgres::sqlx::query("UPDATE orders SET shipped = true WHERE ref = $1")
//!         .bind(&job.payload().0)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(Outcome::Ack) // the update commits with the ack; a retry would roll it back
//! }
//!
//! # fn run(queue: PgQueue<Payload<String>>) -> broker_postgres::Result<()> {
//! let sub = queue.subscribe_with_transaction(SubscribeOptions::new().concurrency(4), ship)?;
//! # Ok(()) }
//! ```
//!
//! Complete programs, one per mode, are in `examples/`: `postgres_row_lock`,
//! `postgres_lease` (a typed row with a JSONB payload) and `postgres_advisory`, e.g.
//! `cargo run -p broker-postgres --example postgres_lease`. The guide in the repository's
//! `docs/` covers every builder call, outcomes, typed rows and JSON, operating and deploying.
//!
//! # Things to know
//! - **Row lock holds a transaction, and a connection, per delivery in work.** An open
//!   transaction pins the xmin horizon: while it runs, vacuum cannot remove rows that died after
//!   it began, in any table, so long handlers bloat busy tables. Prefer lease mode for handlers
//!   that run longer than a few seconds. Size the pool above the subscription's concurrency.
//! - **Row lock writes commit with the ack.** A handler may write through
//!   the [`JobTransaction`] of [`Queue::subscribe_with_transaction`] (or
//!   [`Delivery::transaction`] on a claim by hand); a retry or dead letter rolls
//!   those writes back (to a savepoint taken when the handler first asks for the transaction)
//!   and keeps the row locked while it counts the attempt.
//! - **Advisory mode and `LISTEN` need the session**: connect directly or through a
//!   session-mode pooler. Behind a transaction-mode pooler (PgBouncer
//!   `pool_mode = transaction`) a session advisory lock and the statements after it may reach
//!   different server connections; advisory tables are refused there, and wake-ups fall back to
//!   polling. Row lock and lease work through it: see
//!   [`PgBackend::behind_transaction_pooler`] (found out at the first prepare when not said).
//! - **Advisory keys belong to the database**, not the table: two tables (or two services) with
//!   the same key wait on each other. Keys are 64-bit hashes (`hashtextextended`); two keys with
//!   the same hash share a lock. Each delivery in work holds a pool connection, and its
//!   settlement is fenced on the attempt its take wrote: if the key's session died under the
//!   handler and the row was claimed again, the settlement changes nothing and returns
//!   [`SqlxBrokerError::ClaimLost`].
//! - **Pool size**: [`PgBackend::connect`] opens up to 16 connections. Row lock and advisory
//!   hold one connection per delivery in work, and a subscription whose concurrency is above
//!   three quarters of the pool is lowered to that (with a warning), so give the pool at least
//!   a third more connections than the concurrency of the subscriptions that share it, and one
//!   `LISTEN` connection per subscription.
//! - **Lease reads the host's clock**: the host computes expiries (whole seconds) and due times,
//!   and settlements compare them, so keep the hosts' clocks in sync (NTP).
//! - **Times are `TIMESTAMPTZ`**; the host's unix milliseconds are converted in SQL, and the
//!   startup check refuses a time column of another type.
//! - **Migrations**: claims name the table's columns as they were at subscribe time (a prepared
//!   `SELECT *` would fail with "cached plan must not change result type" on every connection
//!   once a column is added), so adding a column does not disturb running subscriptions; handlers
//!   see it after the next subscribe. A dead-letter table needs the queue table's columns (the DDL
//!   helper makes it so); add a new column to both.
//! - **Wake-ups**: publishes notify the table's channel (`sqlx_broker_` and a hash of the
//!   table name), coalesced: at most one notification per table per 10 ms leaves a process, one
//!   at once after a quiet spell and one at the end of a busy window, because every transaction
//!   that notifies takes one global lock at commit (a notification in every insert serialises
//!   all publishers). A publish on the pool notifies after its insert committed; a publish inside
//!   your transaction carries the notification in its insert (delivered at your commit, never on
//!   rollback) unless another one of this process did within the window. Notifications can be
//!   lost, and rows inserted by your own SQL notify nobody: the poll interval is the fallback.
//! - **FIFO**: a claim walks the groups in turn through the group index (one probe per group,
//!   however many rows a group holds) and takes only the head of each group, under a
//!   transaction-level advisory
//!   lock on the hash of table and group, so brokers on different hosts keep a group's order. A
//!   head that keeps failing blocks its group until `max_attempts` dead-letters it. Ids come from
//!   an identity column; rows published in concurrent transactions that commit out of id order
//!   can be claimed in commit order.
//! - **Transient errors** (serialization failure, deadlock, lock not available; see
//!   [`classify`] and [`is_transient`]) make a claim or a single-statement settlement run again
//!   a few times before the error surfaces. [`PgBackend::is_key_held`] tells whether a session
//!   holds an advisory key.
//! - The table's `isolation` applies to row lock claim transactions.
//! - A payload column of type `JSONB` takes `sqlx::types::Json<T>` (or `serde_json::Value`)
//!   as the published payload, not a `String`. Both need sqlx's `json` feature, which this
//!   crate does not turn on: depend on `sqlx` (0.9) yourself with the `json` feature, and
//!   `derive` for `#[derive(sqlx::FromRow)]` row types (see `docs/typed-rows.md`).

mod admin;
mod advisory;
mod backend;
mod doctor;
mod failover;
mod fifo;
mod lease;
mod listener;
mod notify;
mod row_lock;
mod schedule;
mod schema;
mod sql;
mod stats;
mod version;

pub use admin::PgAdmin;
pub use backend::{PgBackend, PgBroker};
pub use broker_core::api::*;
/// The sqlx this crate is built on, for your own queries in the same transaction as a job.
pub use sqlx;

/// A prepared table on this database (see [`Queue`]).
pub type PgQueue<T> = Queue<PgBackend, T>;
/// A row claimed by hand on this database (see [`Delivery`]).
pub type PgDelivery<T> = Delivery<PgBackend, T>;
/// A row lock delivery's transaction lent to a handler on this database (see
/// [`JobTransaction`]).
pub type PgJobTransaction = JobTransaction<PgBackend>;
pub use sql::{ErrorClass, classify, is_transient};

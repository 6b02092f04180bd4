//! The MySQL and MariaDB backend of sqlx-broker: a task queue in the application's own MySQL 8.0.1+
//! or MariaDB 10.6+ tables.
//!
//! All three claim modes are offered, each chosen by the table description:
//!
//! | mode | selected by | claim | what gives a row back when the process dies |
//! |---|---|---|---|
//! | row lock | no mode set | a READ COMMITTED transaction selects one row `FOR UPDATE SKIP LOCKED` and stays open while the handler runs | the server rolls the transaction back: due again at once, no attempt used |
//! | lease | a `locked_until` column | a locking read `FOR UPDATE SKIP LOCKED`, then one `UPDATE .. WHERE id IN (..)` writing the expiry and counting the attempt, committed at once | the lease runs out (30 s unless set) |
//! | advisory lock | `advisory_lock = "<template>"` | select due rows with their keys, `GET_LOCK(name, 0)` each key on a connection of its own, count the attempt only while the row is still claimable | the session ends and the server frees the key |
//!
//! One crate is all you depend on (with tokio): it re-exports the whole user API, and
//! [`sqlx`] for your own queries. A handler is a plain `async fn` of a [`Job`]; a row lock
//! handler may also take the claim's transaction, so that its writes commit with the ack:
//!
//! ```no_run
//! use broker_mysql::{
//!     ColumnType, HandlerResult, Job, MySqlBackend, MySqlJobTransaction, NewJob, Outcome,
//!     Payload, SubscribeOptions, TableDescription,
//! };
//!
//! async fn ship(job: Job<Payload<String>>, tx: MySqlJobTransaction) -> HandlerResult {
//!     let mut tx = tx.get().await?;
//!     broker_mysql::sqlx::query("UPDATE orders SET shipped = 1 WHERE ref = ?")
//!         .bind(&job.payload().0)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(Outcome::Ack) // commits with the ack; a retry or dead letter rolls it back
//! }
//!
//! # async fn run() -> broker_mysql::Result<()> {
//! let broker = MySqlBackend::connect("mysql://app@127.0.0.1:3306/app").await?;
//! let table = TableDescription::builder("jobs")
//!     .payload("payload", ColumnType::Text)
//!     .due_at("due_at")
//!     .build()?; // no mode set: row lock
//! broker.create_tables(&table).await?;
//! let queue = broker.queue::<Payload<String>>(table).await?;
//! queue.publish(NewJob::new("order-17".to_owned())).await?;
//! let sub = queue.subscribe_with_transaction(SubscribeOptions::new().concurrency(4), ship)?;
//! sub.shutdown().await;
//! broker.close().await;
//! # Ok(()) }
//! ```
//!
//! Complete programs, one per mode, are in `examples/`: `mysql_row_lock`, `mysql_lease` (FIFO
//! groups, a typed row with a JSON payload) and `mysql_advisory`, e.g.
//! `cargo run -p broker-mysql --example mysql_lease`. The guide in the repository's `docs/`
//! covers every builder call, outcomes, typed rows and JSON, operating and deploying.
//!
//! # Things to know
//!
//! - **READ COMMITTED.** Claim transactions open at READ COMMITTED unless the description sets
//!   an isolation level. Under MySQL's default REPEATABLE READ a locking read keeps the locks of
//!   every row it scanned and of the gaps between them, so concurrent claims would skip rows
//!   nobody took and block publishers.
//! - **The claim index (filesort).** A `FOR UPDATE SKIP LOCKED` claim that sorts its rows (a
//!   filesort) locks every row it scans before sorting, and a second worker then gets nothing.
//!   The DDL helper creates `sqlx_broker_claim` on the columns that finish a row, then
//!   `priority DESC, due time, id`, so claims read rows in order and stop at their `LIMIT`;
//!   tables you create yourself need the same. Descending index parts need MySQL 8.0 or
//!   MariaDB 10.8.
//! - **The claim window.** Row lock and lease claims first read the ids of the next 32
//!   claimable rows in claim order at READ UNCOMMITTED, outside any transaction, then lock
//!   rows among them through the primary key with every condition checked again. A locking
//!   read through the claim index itself drained about 40% slower at 8 workers on MariaDB:
//!   InnoDB looks up the clustered row of every index entry it passes, including the deleted
//!   ones purge has not removed yet. The dirty read only chooses candidates; it never decides
//!   what a claim takes.
//! - **Row lock mode holds a connection and a transaction per delivery in work** (advisory
//!   mode likewise: each held key is a connection). A subscription whose concurrency is above
//!   three quarters of the pool is lowered to that, with a warning: give the pool at least a
//!   third more connections than the concurrency of the subscriptions that share it. Long
//!   transactions keep old row versions alive (the InnoDB history list grows and purge falls
//!   behind): prefer lease mode for handlers that run minutes. A retry or dead letter rolls
//!   back to a savepoint set when the handler first asks for the transaction, undoing the
//!   handler's writes through the [`JobTransaction`] of [`Queue::subscribe_with_transaction`]
//!   while the row stays locked, then counts the attempt and commits. A killed connection rolls
//!   everything back: the row is due again at once and no attempt is used.
//! - **Times** cross the wire as integers from the epoch and are computed in SQL with
//!   `TIMESTAMPADD` / `TIMESTAMPDIFF` against `1970-01-01`, which is independent of the session
//!   time zone for `DATETIME` columns and has no 2038 limit (`FROM_UNIXTIME` and
//!   `UNIX_TIMESTAMP` return NULL past 2038 on MariaDB before 11.5, which would make a job
//!   scheduled for 2040 due at once). Time columns hold UTC; the DDL helper makes them
//!   `DATETIME(6)`. A `TIMESTAMP` column is converted through the session time zone, so
//!   [`MySqlBackend::connect`] sets sessions to UTC (sqlx's default, made explicit) and startup
//!   refuses a table with a `TIMESTAMP` time column on a pool whose sessions are not UTC.
//! - **Whole-second leases.** Lease expiries are whole seconds, bound as seconds and written with
//!   `TIMESTAMPADD(SECOND, ..)`, so a `DATETIME` or `TIMESTAMP` column without fractions (which
//!   would round or truncate milliseconds) stores them exactly, and the token a settlement
//!   compares is equal to the one in the row. Due times keep milliseconds where the column does.
//! - **Transient errors.** Deadlocks (1213), lock wait timeouts (1205) and `NOWAIT` conflicts are
//!   told apart in one place; claims, renewals and lease settlements that meet one run again at
//!   once (a few times), and a claim that still meets one is claimed again by the subscription
//!   at once, counted in `claim_conflicts` (another claim took the rows: they are there, so it is
//!   no reason to back off). The server undid the work, so nothing is lost or counted twice. See
//!   [`classify`] and [`is_transient`]. A connection lost while a lease claim commits (or an
//!   advisory take counts) may leave the attempt counted with no delivery, as a crash does; the
//!   row comes back when its lease runs out (lease) or at once (advisory).
//! - **Galera.** On a MariaDB Galera Cluster node only lease mode holds: row lock and advisory
//!   mode are refused at prepare, naming the node (their locks live on one node), and the doctor
//!   says the same. See docs/deploying.md, "MariaDB Galera Cluster".
//! - **Cancellation.** sqlx-mysql can leave a reply on the wire when a statement's future is
//!   dropped, which the connection's next statement would read. The engine never cancels a
//!   claim, renewal or settlement; and every connection this crate runs statements on outside a
//!   delivery's transaction is closed instead of returned to the pool if its statements were cut
//!   short.
//! - **FIFO** (a group column and `fifo`): a claim takes only the head (first unfinished row by
//!   id) of each group, reading the groups in turn through the group index (windows of 32
//!   groups, one probe per group). The head condition is a consistent-read subquery in the claim, so a head
//!   that is in work is seen even though `SKIP LOCKED` skips it; a guard in the claim's
//!   transaction then reads the group's earlier unfinished rows with `FOR UPDATE NOWAIT`, which
//!   catches a row that took a lower id but committed later, so brokers on different hosts keep
//!   the group's order. The guard needs an index that starts with the group column (the DDL
//!   helper creates `sqlx_broker_group`; startup checks). A head-of-line row that keeps failing
//!   blocks its group until `max_attempts` dead-letters it.
//! - **Publish ids.** MariaDB returns the ids of a multi-row insert with `INSERT .. RETURNING`.
//!   MySQL has no `RETURNING`: with `innodb_autoinc_lock_mode` 0 or 1 a multi-row insert takes
//!   consecutive ids from `LAST_INSERT_ID()` (`auto_increment_increment` apart); with mode 2,
//!   MySQL 8's default, concurrent inserts interleave ids, so the backend inserts one row per
//!   statement there. The id column must be `AUTO_INCREMENT` for publishes through the broker.
//! - **No cross-process wake-ups**: MySQL has no LISTEN/NOTIFY. Publishes through a broker wake
//!   its own subscriptions at once; other processes find rows at their next poll.
//! - **Rows in work** in `queue.stats()` and `queue.jobs(..)`: a lease not run out; an advisory
//!   key in use (`IS_USED_LOCK` on the claim's lock name, one row per held key); under row lock,
//!   neither server lists other transactions' row locks on every supported version, so a row is
//!   in work when a shared locking read with `SKIP LOCKED` through the primary key passes over
//!   it (`LOCK IN SHARE MODE SKIP LOCKED` on MariaDB, `FOR SHARE SKIP LOCKED` on MySQL). That
//!   read waits for nothing, but holds a shared lock on each free row for its statement, which a
//!   claim at that moment passes over. Exact for deliveries; a row another open transaction
//!   locked counts too. Cancel and run-now of a row in work are refused, never waited for.
//!
//! # Advisory lock names
//! Keys belong to the database, not the table: a key is locked under `"<database>:<key>"`, so
//! two tables with the same key wait on each other. MySQL takes lock names of up to 64
//! characters and converts them to utf8mb3; MariaDB takes up to 192 bytes. A name over 64
//! characters, or with a character outside the Basic Multilingual Plane, is replaced by the
//! lowercase hex SHA-256 of its UTF-8 bytes (64 characters), computed the same way in every
//! process; see [`lock_name`]. Characters are counted as Unicode scalar values, as MySQL counts
//! them, so a kept name is at most 64 characters and 192 bytes, within both limits. MariaDB
//! compares lock names exactly; MySQL may compare them without case, which can make two keys
//! that differ only in case wait on each other (never the reverse). [`MySqlBackend::is_key_held`]
//! asks the server whether any session holds a key.
//!
//! # MySQL and MariaDB differences
//! | | MySQL 8.0.1+ | MariaDB 10.6+ |
//! |---|---|---|
//! | `SKIP LOCKED`, `NOWAIT` | 8.0.1 | 10.6 (`NOWAIT` from 10.3) |
//! | `NOWAIT` conflict | error 3572 | error 1205 (lock wait timeout) |
//! | `INSERT .. RETURNING` | no (ids from `LAST_INSERT_ID()`, see above) | yes |
//! | lock name limit | 64 characters, utf8mb3 | 192 bytes |
//! | descending index parts | yes | from 10.8 |
//! | `FROM_UNIXTIME` past 2038 | yes (8.0.28+) | NULL before 11.5 (not used here) |
//!
//! Only MariaDB is exercised against a live server in this crate's tests; the MySQL paths are
//! the same statements (checked to be valid MySQL 8 syntax) and their differences are unit
//! tested.

mod admin;
mod advisory;
mod backend;
mod doctor;
mod fifo;
mod galera;
mod lease;
mod row_lock;
mod schedule;
mod schema;
mod sql;
mod version;
mod window;

pub use admin::MySqlAdmin;
pub use advisory::{MAX_LOCK_NAME_CHARS, lock_name};
pub use backend::{MySqlBackend, MySqlBroker};
pub use broker_core::api::*;
/// The sqlx this crate is built on, for your own queries in the same transaction as a job.
pub use sqlx;

/// A prepared table on this database (see [`Queue`]).
pub type MySqlQueue<T> = Queue<MySqlBackend, T>;
/// A row claimed by hand on this database (see [`Delivery`]).
pub type MySqlDelivery<T> = Delivery<MySqlBackend, T>;
/// A row lock delivery's transaction lent to a handler on this database (see
/// [`JobTransaction`]).
pub type MySqlJobTransaction = JobTransaction<MySqlBackend>;
pub use sql::{ErrorClass, classify, is_transient};

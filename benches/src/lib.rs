//! Benchmarks of sqlx-broker: claim + ack throughput of the subscription engine against a raw
//! loop over the same statements, publish throughput, and publish-to-handler latency, on
//! PostgreSQL, MariaDB and SQLite.
//!
//! - `cargo run -p benches --release -- --quick` runs every scenario briefly and writes
//!   `benches/results/quick.md` and `quick.svg`; without `--quick`, a longer run writes
//!   `full.*`. `--help` lists the filters (`--db sqlite`, `--mode lease`, ...).
//! - `cargo bench -p benches` runs the same scenarios under criterion (`benches/claim.rs`);
//!   narrow it with the binary's flags in `SQLX_BROKER_BENCH_ARGS` (e.g. `"--db sqlite --mode
//!   lease"`) or with criterion's name filter (`cargo bench -p benches -- postgres/lease`).
//!
//! PostgreSQL and MariaDB are found at `SQLX_BROKER_PG_URL` and `SQLX_BROKER_MYSQL_URL`
//! (defaults: the local test servers); a selected database that cannot be reached fails the run
//! with a message naming its URL. SQLite runs in a temporary file.
//!
//! The raw loop ([`drain`]) drives the backend's own prepared strategy objects from plain tokio
//! tasks: those are the statements the engine runs, rendered by the same backend code, so the
//! two cannot drift apart. Both sides run through [`Timed`], a backend wrapper that times every
//! strategy call, which is how a report says where the time went.
//!
//! | mode | PostgreSQL | MariaDB | SQLite |
//! |---|---|---|---|
//! | row lock | yes | yes | not offered |
//! | lease | yes | yes | yes |
//! | advisory lock | yes | yes | yes |

pub mod cli;
pub mod drain;
pub mod report;
pub mod run;
pub mod scenario;
pub mod target;
pub mod timed;

pub use timed::Timed;

/// The error every benchmark step returns: a driver error, a broker error, or a message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

//! Benchmarks of sqlx-broker: claim + ack throughput of the subscription engine against a
//! hand-written sqlx loop per mode ([`handwritten`]) and against ruststream-sqlx ([`peer`]),
//! publish throughput, and publish-to-handler latency, on PostgreSQL, MariaDB and SQLite.
//!
//! The benches are a workspace of their own (`cargo build` and `cargo test --workspace` at the
//! root leave them out); from the repository's root:
//!
//! - `cargo run --manifest-path benches/Cargo.toml --release -- --quick` runs every scenario
//!   briefly and writes `benches/results/quick.md` and `quick.svg`; without `--quick`, a longer
//!   run writes `full.*`. `--help` lists the filters (`--db sqlite`, `--mode lease`, ...).
//! - `cargo bench --manifest-path benches/Cargo.toml` runs the same scenarios under criterion
//!   (`benches/claim.rs`); narrow it with the binary's flags in `SQLX_BROKER_BENCH_ARGS` (e.g.
//!   `"--db sqlite --mode lease"`) or with criterion's name filter (`-- postgres/lease`).
//! - `--bin backlog -- --quick` measures the backlog shapes of [`backlog`] (rows that cannot be
//!   claimed ahead of those that can) and how a claim's time grows with the table, and writes
//!   `benches/results/backlog-quick.md` and `.svg`.
//! - `--bin publish` times single-job publishes against a hand-written `INSERT` and
//!   publish-to-handler latency across processes on PostgreSQL.
//! - `--bin queues` puts 50 queue tables with a subscription each on one pool of 10 connections
//!   (issue #32): the connections they hold at idle, and how fast 100 rows in each drain against
//!   5,000 rows in one; writes `benches/results/queues.md`.
//! - `--bin kinds` drains a kinds table of 10 job kinds with one `work` subscription against
//!   the same rows in a one-type table with one `subscribe` (issue #48), sides alternating
//!   round by round; writes `benches/results/kinds.md`.
//! - `--bin stats` times `Queue::stats()` on a large table (issue #29).
//! - `--bin steady -- --db postgres --rate 2000` drains a table that an outside producer
//!   (pgbench, or a second process) fills at a fixed rate, and prints per 10 s the rows handled,
//!   the queue depth, the insert-to-handler lag and the process's memory; `--max` measures the
//!   consumer's top rate, `--overload` runs the producer above it (issue #32); writes
//!   `benches/results/steady-<db>.md`.
//!
//! PostgreSQL and MariaDB are found at `SQLX_BROKER_PG_URL` and `SQLX_BROKER_MYSQL_URL`
//! (defaults: the local test servers); a selected database that cannot be reached fails the run
//! with a message naming its URL. SQLite runs in a temporary file.
//!
//! The hand-written loop shares no code and no statement text with the backends, so a statement
//! the engine adds shows up in the ratio. FIFO tables, which have no hand-written loop, are
//! compared with the strategy loop ([`drain`]): plain tokio tasks driving the backend's own
//! strategy objects, which shows what the engine's scheduling costs apart from its statements
//! (and would hide a statement's cost, as it hid the row-lock savepoint's). The engine and the
//! strategy loop run through [`Timed`], a backend wrapper that times every strategy call, which
//! is how a report says where their time went.
//!
//! | mode | PostgreSQL | MariaDB | SQLite |
//! |---|---|---|---|
//! | row lock | yes | yes | not offered |
//! | lease | yes | yes | yes |
//! | advisory lock | yes | yes | yes |

pub mod backlog;
pub mod cli;
pub mod drain;
pub mod handwritten;
pub mod host;
pub mod lag;
pub mod peer;
pub mod report;
pub mod run;
pub mod scenario;
pub mod target;
pub mod timed;

pub use timed::Timed;

/// The error every benchmark step returns: a driver error, a broker error, or a message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Runs a bench binary's `main` future on a multi-threaded tokio runtime and turns its result
/// into the exit code, printing the error: the one `main` every bench binary shares.
pub fn block_on<F>(bench: F) -> std::process::ExitCode
where
    F: std::future::Future<Output = Result<(), BoxError>>,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(bench) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

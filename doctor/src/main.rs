//! `doctor`: checks a sqlx-broker deployment for one table and prints every check with pass,
//! warn or fail, what it found and what to change. Exits 1 when a check fails.
//!
//! ```text
//! cargo run -p sqlx-broker-doctor -- postgres://app@db/app --table jobs --locked-until locked_until --concurrency 16
//! cargo run -p sqlx-broker-doctor -- mysql://root@127.0.0.1/test --table jobs
//! cargo run -p sqlx-broker-doctor -- sqlite://jobs.db --table emails --advisory-lock 'acct-{account}' --column account:text
//! ```
//!
//! The table is described with the same roles as [`TableDescription`]'s builder; the checks are
//! [`Broker::doctor`](broker_core::Broker::doctor)'s.

use std::process::ExitCode;

use broker_core::{
    Backend, Broker, ColumnType, DeadLetter, DoctorOptions, DoctorReport, Status, TableDescription,
};
use clap::Parser;

/// Checks a sqlx-broker deployment for one table and says what to change.
#[derive(Debug, Parser)]
#[command(name = "doctor")]
struct Args {
    /// The database URL: postgres://, mysql:// (MariaDB too) or sqlite://.
    url: String,
    /// The queue table.
    #[arg(long)]
    table: String,
    /// The payload column (text).
    #[arg(long)]
    payload: Option<String>,
    /// The id column (default `id`).
    #[arg(long)]
    id: Option<String>,
    /// The attempt column (default `attempt`).
    #[arg(long)]
    attempt: Option<String>,
    /// The lease column: lease mode.
    #[arg(long)]
    locked_until: Option<String>,
    /// The lease length in seconds.
    #[arg(long)]
    lease_seconds: Option<u32>,
    /// The advisory key template, e.g. 'acct-{account}': advisory mode.
    #[arg(long)]
    advisory_lock: Option<String>,
    /// The due-time column.
    #[arg(long)]
    due_at: Option<String>,
    /// The processed-at column (acks mark it instead of deleting).
    #[arg(long)]
    processed_at: Option<String>,
    /// The group column.
    #[arg(long)]
    group: Option<String>,
    /// Groups run in order, one row at a time.
    #[arg(long)]
    fifo: bool,
    /// The priority column.
    #[arg(long)]
    priority: Option<String>,
    /// The dead-letter table.
    #[arg(long)]
    dead_letter_table: Option<String>,
    /// The dead-letter column.
    #[arg(long)]
    dead_letter_column: Option<String>,
    /// Further columns, as name:type (text, bigint, json, bytes); e.g. the key template's.
    #[arg(long = "column", value_parser = parse_column)]
    columns: Vec<(String, ColumnType)>,
    /// The concurrency each subscription will run with.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// How many subscriptions share the broker's pool.
    #[arg(long, default_value_t = 1)]
    subscriptions: usize,
}

fn parse_column(s: &str) -> Result<(String, ColumnType), String> {
    let (name, ty) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: write a column as name:type"))?;
    let ty = match ty.to_ascii_lowercase().as_str() {
        "text" => ColumnType::Text,
        "bigint" => ColumnType::BigInt,
        "json" => ColumnType::Json,
        "bytes" => ColumnType::Bytes,
        other => {
            return Err(format!(
                "{other:?}: a column type is text, bigint, json or bytes"
            ));
        }
    };
    Ok((name.to_owned(), ty))
}

fn describe(a: &Args) -> broker_core::Result<TableDescription> {
    let mut b = TableDescription::builder(&a.table);
    if let Some(c) = &a.payload {
        b = b.payload(c, ColumnType::Text);
    }
    let set =
        |b: broker_core::TableBuilder,
         c: &Option<String>,
         f: fn(broker_core::TableBuilder, String) -> broker_core::TableBuilder| match c {
            Some(c) => f(b, c.clone()),
            None => b,
        };
    b = set(b, &a.id, |b, c| b.id(c));
    b = set(b, &a.attempt, |b, c| b.attempt(c));
    b = set(b, &a.locked_until, |b, c| b.locked_until(c));
    b = set(b, &a.advisory_lock, |b, c| b.advisory_lock(c));
    b = set(b, &a.due_at, |b, c| b.due_at(c));
    b = set(b, &a.processed_at, |b, c| b.processed_at(c));
    b = set(b, &a.group, |b, c| b.group(c));
    b = set(b, &a.priority, |b, c| b.priority(c));
    b = set(b, &a.dead_letter_table, |b, c| {
        b.dead_letter(DeadLetter::Table(c))
    });
    b = set(b, &a.dead_letter_column, |b, c| {
        b.dead_letter(DeadLetter::Column(c))
    });
    if let Some(s) = a.lease_seconds {
        b = b.lease_seconds(s);
    }
    for (c, ty) in &a.columns {
        b = b.column(c, *ty);
    }
    b.fifo(a.fifo).build()
}

async fn check<B: Backend>(
    broker: Broker<B>,
    table: &TableDescription,
    options: &DoctorOptions,
) -> DoctorReport {
    let report = broker.doctor(table, options).await;
    broker.close().await;
    report
}

async fn run(args: Args) -> Result<DoctorReport, String> {
    let table = describe(&args).map_err(|e| e.to_string())?;
    let options = DoctorOptions::new()
        .concurrency(args.concurrency)
        .subscriptions(args.subscriptions);
    let url = args.url.as_str();
    let err = |e: broker_core::SqlxBrokerError| format!("cannot connect to {url}: {e}");
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let broker = broker_postgres::PgBackend::connect(url)
            .await
            .map_err(err)?;
        Ok(check(broker, &table, &options).await)
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let broker = broker_mysql::MySqlBackend::connect(url)
            .await
            .map_err(err)?;
        Ok(check(broker, &table, &options).await)
    } else if url.starts_with("sqlite:") {
        let broker = broker_sqlite::SqliteBackend::connect(url)
            .await
            .map_err(err)?;
        Ok(check(broker, &table, &options).await)
    } else {
        Err(format!(
            "{url}: the URL must start with postgres://, mysql:// or sqlite:"
        ))
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(report) => {
            print!("{report}");
            if report.worst() == Status::Fail {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

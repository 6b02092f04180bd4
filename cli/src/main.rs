//! `sqlx-broker`: operate the queues of a service's own tables from a shell, on PostgreSQL,
//! MySQL/MariaDB and SQLite: rows by state and lag, dead letters (list, requeue, discard),
//! cancel and run one row now, pause and resume a queue across processes, purge finished rows,
//! and the doctor's checks of a deployment.
//!
//! ```text
//! sqlx-broker --url postgres://app@db/app --table jobs --locked-until locked_until stats
//! sqlx-broker --config jobs.toml dead list --limit 20
//! sqlx-broker --config jobs.toml dead requeue --id 41 --id 42
//! sqlx-broker --config jobs.toml pause --by "incident 1234"
//! sqlx-broker --config jobs.toml --json stats
//! SQLX_BROKER_WEB_TOKEN=$(openssl rand -hex 32) sqlx-broker --config jobs.toml web --listen 0.0.0.0:8080
//! sqlx-broker --url sqlite://jobs.db --table emails --advisory-lock 'acct-{account}' \
//!     --column account:text doctor --concurrency 8
//! ```
//!
//! The table is described with the roles of `TableDescription`'s builder, by flags or in a TOML
//! file (see `table.rs`). Output is a human table, or JSON with `--json`. Exit status: 0 done,
//! 1 refused or failed (the message says why and what to change), 2 bad arguments; `doctor`
//! exits 1 when a check fails. No message prints the database password, and no text read from
//! the database reaches the terminal with its control characters.

mod check;
mod connect;
mod output;
mod table;

use std::process::ExitCode;
use std::time::Duration;

use broker_core::{
    Backend, Broker, DeadLetters, DoctorOptions, JobState, Page, Queue, SqlxBrokerError, Status,
    TableDescription,
};
use clap::{Parser, Subcommand};

use crate::output::Out;
use crate::table::TableArgs;

/// Operate sqlx-broker queues: stats, dead letters, cancel, run now, pause, purge, doctor.
#[derive(Debug, Parser)]
#[command(name = "sqlx-broker", version)]
struct Cli {
    /// The database URL: postgres://, mysql:// (MariaDB too) or sqlite://.
    #[arg(long, env = "SQLX_BROKER_URL", global = true)]
    url: Option<String>,
    /// A TOML file with `url` and a `[table]` of column roles; flags win over it.
    #[arg(long, global = true)]
    config: Option<std::path::PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(flatten)]
    table: TableArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Rows by state, the lag, and whether the queue is paused.
    Stats,
    /// Rows in one state, a page at a time.
    Jobs {
        /// due, scheduled, in-work, retrying, dead or finished.
        state: JobState,
        /// Only rows with a larger id (the last id of the previous page).
        #[arg(long)]
        after: Option<i64>,
        /// Rows per page (1 to 1000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Only rows of this kind (a table with a kind column).
        #[arg(long, value_name = "KIND")]
        of_kind: Option<String>,
    },
    /// Dead letters: list, requeue, discard.
    Dead {
        #[command(subcommand)]
        command: DeadCommand,
    },
    /// Takes an unfinished row out of the queue (deletes it). A row in work is cancelled
    /// through its holder, in whichever process it runs: its handler is signalled, and the row
    /// is deleted once the handler stops or the subscription's grace ends.
    Cancel {
        /// The row id.
        id: i64,
    },
    /// Makes a scheduled or delayed row due now; refused while a delivery holds it.
    RunNow {
        /// The row id.
        id: i64,
    },
    /// Pauses the queue in every process: claims stop, rows in work finish, publishes go on.
    Pause {
        /// Who pauses it, shown by `stats`.
        #[arg(long, default_value = "sqlx-broker CLI")]
        by: String,
    },
    /// Resumes a paused queue.
    Resume,
    /// Deletes finished rows (kept with processed_at) older than a duration.
    Purge {
        /// How old: 30s, 15m, 12h, 7d.
        #[arg(long, value_parser = parse_duration)]
        older_than: Duration,
    },
    /// Serves the web dashboard for the table (see docs/dashboard.md) until Ctrl-C. Anyone
    /// who reaches it can requeue, discard, cancel and pause: give it a token, or keep it on
    /// a loopback address behind a proxy that authenticates.
    Web(WebArgs),
    /// Runs the conformance suite against the server at --url, in a scratch schema
    /// (PostgreSQL), database (MariaDB/MySQL) or folder (SQLite) of its own that it drops at
    /// the end, and reports which guarantees hold there, per claim mode. It never restarts or
    /// reconfigures the server and touches no table of yours; see docs/testing.md.
    Check(check::CheckArgs),
    /// Checks the deployment for the table and says what to change.
    Doctor {
        /// The concurrency each subscription will run with.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// How many subscriptions share the broker's pool.
        #[arg(long, default_value_t = 1)]
        subscriptions: usize,
        /// The pool size of the workers' broker (`connect` opens 16), for the pool check.
        #[arg(long, default_value_t = 16)]
        pool_size: u32,
        /// The job kinds the deployment's workers know, comma-separated (a table with a kind
        /// column): the doctor warns naming each kind with unfinished rows that none knows.
        #[arg(long, value_delimiter = ',', value_name = "KIND,..")]
        known_kinds: Option<Vec<String>>,
    },
}

/// The flags of `web`.
#[derive(Debug, clap::Args)]
struct WebArgs {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// Require this bearer token (an `Authorization: Bearer` header, or the login page); at
    /// least 16 bytes.
    #[arg(long, env = "SQLX_BROKER_WEB_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Also answer to this host name (repeat the flag). Without a token only loopback names
    /// (localhost, 127.0.0.1, `[::1]`) are served, so that a page on another site cannot reach
    /// the dashboard through a DNS name pointed at this machine.
    #[arg(long = "allowed-host", value_name = "NAME")]
    allowed_hosts: Vec<String>,
    /// Mark the cookies `Secure`, with `__Host-` names: when a proxy in front serves the
    /// dashboard over HTTPS.
    #[arg(long)]
    secure_cookies: bool,
    /// Show the queue and refuse every action.
    #[arg(long)]
    read_only: bool,
    /// Listen on a non-loopback address without a token (only behind a proxy that
    /// authenticates).
    #[arg(long)]
    insecure_no_auth: bool,
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// The dead letters with their attempt and last error, a page at a time.
    List {
        /// Only rows with a larger id.
        #[arg(long)]
        after: Option<i64>,
        /// Rows per page (1 to 1000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Puts dead letters back, due now with attempt 1.
    Requeue(Which),
    /// Deletes dead letters for good.
    Discard(Which),
}

/// Which dead letters: ids, an error text, or all.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
struct Which {
    /// These ids (repeat the flag).
    #[arg(long = "id")]
    ids: Vec<i64>,
    /// Those whose last error contains this text.
    #[arg(long)]
    error: Option<String>,
    /// All of them.
    #[arg(long)]
    all: bool,
}

impl Which {
    fn dead_letters(&self) -> DeadLetters {
        match (&self.error, self.all) {
            (Some(text), _) => DeadLetters::ErrorContains(text.clone()),
            (None, true) => DeadLetters::All,
            (None, false) => DeadLetters::Ids(self.ids.clone()),
        }
    }
}

/// `30s`, `15m`, `12h`, `7d`, or whole seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = number.parse().map_err(|_| {
        format!("{s:?}: write a duration as a number and a unit, e.g. 30s, 15m, 12h, 7d")
    })?;
    let seconds = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        other => return Err(format!("{other:?}: a duration's unit is s, m, h or d")),
    };
    Ok(Duration::from_secs(n.saturating_mul(seconds)))
}

/// Runs a command on a queue of `broker`.
async fn run_on<B: Backend>(
    broker: Broker<B>,
    table: TableDescription,
    command: &Command,
) -> Result<Out, String> {
    if let Command::Doctor {
        concurrency,
        subscriptions,
        known_kinds,
        ..
    } = command
    {
        let mut options = DoctorOptions::new()
            .concurrency(*concurrency)
            .subscriptions(*subscriptions);
        if let Some(kinds) = known_kinds {
            options = options.kinds(kinds.iter().map(|k| k.trim().to_owned()));
        }
        let report = broker.doctor(&table, &options).await;
        broker.close().await;
        return Ok(Out::Doctor(report));
    }
    let queue: Queue<B, ()> = broker.queue(table).await.map_err(message)?;
    if let Command::Web(web) = command {
        let out = serve(queue, web).await;
        broker.close().await;
        return out;
    }
    let out = run_queue(&queue, command).await;
    broker.close().await;
    out.map_err(message)
}

async fn run_queue<B: Backend>(q: &Queue<B, ()>, command: &Command) -> broker_core::Result<Out> {
    Ok(match command {
        Command::Stats => Out::Stats(q.stats().await?),
        Command::Jobs {
            state,
            after,
            limit,
            of_kind,
        } => Out::Jobs {
            jobs: match of_kind {
                Some(k) => q.jobs_of_kind(*state, k, page(*after, *limit)).await?,
                None => q.jobs(*state, page(*after, *limit)).await?,
            },
            limit: *limit,
        },
        Command::Dead { command } => match command {
            DeadCommand::List { after, limit } => Out::Jobs {
                jobs: q.dead_letters(page(*after, *limit)).await?,
                limit: *limit,
            },
            DeadCommand::Requeue(which) => Out::Count {
                what: "requeued",
                rows: q.requeue_dead(which.dead_letters()).await?,
            },
            DeadCommand::Discard(which) => Out::Count {
                what: "discarded",
                rows: q.discard_dead(which.dead_letters()).await?,
            },
        },
        Command::Cancel { id } => match q.cancel(*id).await? {
            broker_core::Cancelled::Removed => Out::Done(format!("row {id} cancelled")),
            _ => Out::Done(format!(
                "row {id} is in work: its holder was signalled to cancel it, and deletes it once the handler stops or the grace ends"
            )),
        },
        Command::RunNow { id } => {
            q.run_now(*id).await?;
            Out::Done(format!("row {id} is due now"))
        }
        Command::Pause { by } => {
            q.pause(by).await?;
            Out::Done(format!("queue \"{}\" paused", q.table().name()))
        }
        Command::Resume => {
            q.resume().await?;
            Out::Done(format!("queue \"{}\" resumed", q.table().name()))
        }
        Command::Purge { older_than } => Out::Count {
            what: "purged",
            rows: q.purge_finished(*older_than).await?,
        },
        Command::Doctor { .. } => unreachable!("run before the queue is prepared"),
        Command::Web(_) => unreachable!("served by run_on"),
        Command::Check(_) => unreachable!("run by main"),
    })
}

/// Serves the dashboard of `queue` as `web` says until Ctrl-C.
async fn serve<B: Backend>(queue: Queue<B, ()>, web: &WebArgs) -> Result<Out, String> {
    let name = queue.table().name().to_owned();
    let mut dashboard = broker_web::Dashboard::new()
        .queue(queue)
        .read_only(web.read_only)
        .allowed_hosts(web.allowed_hosts.iter().cloned())
        .secure_cookies(web.secure_cookies);
    if let Some(t) = &web.token {
        dashboard = dashboard
            .bearer_token(t.clone())
            .map_err(|e| format!("--token (or SQLX_BROKER_WEB_TOKEN): {e}"))?;
    }
    let listen = web.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    eprintln!("dashboard for table \"{name}\" on http://{addr}/ (Ctrl-C stops it)");
    axum::serve(listener, dashboard.router::<()>())
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| format!("serving the dashboard on {addr}: {e}"))?;
    Ok(Out::Done("dashboard stopped".to_owned()))
}

/// Refuses a dashboard that anyone on the network could use, and a token too short to guard
/// it, before anything connects.
fn check_web(command: &Command) -> Result<(), String> {
    let Command::Web(web) = command else {
        return Ok(());
    };
    // An empty SQLX_BROKER_WEB_TOKEN reaches here as an empty token, and is refused with it.
    if let Some(t) = &web.token {
        broker_web::check_token(t)
            .map_err(|e| format!("--token (or SQLX_BROKER_WEB_TOKEN): {e}"))?;
    }
    let listen = web.listen;
    if !listen.ip().is_loopback() && web.token.is_none() && !web.insecure_no_auth {
        return Err(format!(
            "{listen} is reachable from other machines, and without a token anyone there could requeue, discard, cancel and pause: pass --token (or SQLX_BROKER_WEB_TOKEN), listen on 127.0.0.1 behind a proxy that authenticates, or pass --insecure-no-auth if such a proxy guards this address"
        ));
    }
    Ok(())
}

fn page(after: Option<i64>, limit: usize) -> Page {
    Page { after, limit }
}

fn message(e: SqlxBrokerError) -> String {
    e.to_string()
}

async fn run(cli: Cli) -> Result<Out, String> {
    check_web(&cli.command)?;
    let (file_url, file_table) = match &cli.config {
        Some(path) => {
            let config = table::read_config(path)?;
            (config.url, config.table)
        }
        None => (None, TableArgs::default()),
    };
    let table = cli.table.clone().or(file_table).describe()?;
    let url = cli
        .url
        .clone()
        .or(file_url)
        .ok_or("give the database URL: --url, SQLX_BROKER_URL, or url = \"..\" in --config")?;
    // Every message names the URL without its password, and a message that repeats the
    // password some other way (a driver's text, a URL cut at a blank) shows it as *** too.
    let secret = connect::password_of(&url);
    open_and_run(&url, table, &cli.command)
        .await
        .map_err(|e| connect::hide(&e, secret.as_deref()))
}

/// Connects to `url` and runs `command` on `table` there.
async fn open_and_run(
    url: &str,
    table: TableDescription,
    command: &Command,
) -> Result<Out, String> {
    let shown = broker_core::redact_passwords(url);
    let err = |e: SqlxBrokerError| format!("cannot connect to {shown}: {e}");
    // The doctor's pool check reads the pool's size: give it the workers'.
    let pool = match command {
        Command::Doctor { pool_size, .. } => *pool_size,
        _ => connect::POOL,
    };
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let broker = connect::postgres(url, pool).await.map_err(err)?;
        run_on(broker, table, command).await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let broker = connect::mysql(url, pool).await.map_err(err)?;
        run_on(broker, table, command).await
    } else if url.starts_with("sqlite:") {
        // A file, not a server: its pool costs no server connection.
        let broker = broker_sqlite::SqliteBackend::connect_existing(url)
            .await
            .map_err(err)?;
        run_on(broker, table, command).await
    } else {
        Err(format!(
            "{shown}: the URL must start with postgres://, mysql:// or sqlite:"
        ))
    }
}

fn main() -> ExitCode {
    // A child process a check case started (this program re-run to play a killed worker).
    if let Some(code) = check::run_child() {
        return code;
    }
    let cli = Cli::parse();
    let json = cli.json;
    if let Command::Check(args) = &cli.command {
        // The cases run their own runtimes, one at a time: no runtime here.
        let Some(url) = cli.url.clone().or_else(|| {
            cli.config
                .as_ref()
                .and_then(|p| table::read_config(p).ok())
                .and_then(|c| c.url)
        }) else {
            eprintln!(
                "error: give the server to check: --url, SQLX_BROKER_URL, or url = \"..\" in --config"
            );
            return ExitCode::from(2);
        };
        let secret = connect::password_of(&url);
        return match check::run(&url, args, json) {
            Ok(code) => code,
            Err(e) => {
                let e = connect::hide(&e, secret.as_deref());
                if json {
                    println!(
                        "{}",
                        output::json_safe(serde_json::json!({ "error": e }).to_string())
                    );
                } else {
                    eprintln!("error: {}", output::terminal_text(&e));
                }
                ExitCode::from(1)
            }
        };
    }
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
    match runtime.block_on(run(cli)) {
        Ok(out) => {
            let failed = matches!(&out, Out::Doctor(r) if r.worst() == Status::Fail);
            print!("{}", out.render(json));
            if failed {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            // A message may quote a URL (from the driver, a file, a flag): hide its password.
            let e = broker_core::redact_passwords(&e);
            if json {
                println!(
                    "{}",
                    output::json_safe(serde_json::json!({ "error": e }).to_string())
                );
            } else {
                eprintln!("error: {}", output::terminal_text(&e));
            }
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_with_their_unit() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(604_800));
        assert_eq!(parse_duration("12").unwrap(), Duration::from_secs(12));
        assert!(parse_duration("1w").unwrap_err().contains("s, m, h or d"));
        assert!(parse_duration("soon").unwrap_err().contains("e.g. 30s"));
    }

    #[test]
    fn the_command_line_parses_flags_after_the_subcommand() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "sqlx-broker",
            "dead",
            "requeue",
            "--id",
            "4",
            "--id",
            "5",
            "--url",
            "sqlite://x.db",
            "--table",
            "jobs",
        ])
        .unwrap();
        assert_eq!(cli.table.name.as_deref(), Some("jobs"));
        match cli.command {
            Command::Dead {
                command: DeadCommand::Requeue(w),
            } => assert_eq!(w.dead_letters(), DeadLetters::Ids(vec![4, 5])),
            other => panic!("{other:?}"),
        }
        assert!(
            Cli::try_parse_from(["sqlx-broker", "dead", "requeue", "--all", "--id", "3"]).is_err(),
            "one selection at a time"
        );
    }
}

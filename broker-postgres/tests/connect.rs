//! Connecting (issue #33): a wrong port fails at once with its cause, a URL of another database
//! is refused naming the backend to use, and server errors read without the server's C source
//! line.

use std::time::{Duration, Instant};

use broker_postgres::PgBackend;
use broker_testkit::{Job, describe, unique_name};

fn url() -> String {
    std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

#[tokio::test]
async fn a_wrong_port_fails_at_once_naming_the_refused_connection() {
    let began = Instant::now();
    let err = PgBackend::connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.to_lowercase().contains("refused") && msg.contains("port"),
        "{msg}"
    );
    assert!(!msg.contains("timed out"), "{msg}");
    // The pool alone retried a refused connection for its 30 s acquire timeout; a refusal
    // takes no time, so this bound only has to tell the two apart on a loaded machine.
    assert!(
        began.elapsed() < Duration::from_secs(20),
        "{:?}",
        began.elapsed()
    );
}

#[tokio::test]
async fn a_url_for_another_database_is_refused_naming_the_backend_to_use() {
    let err = PgBackend::connect("mysql://root@127.0.0.1:3306/test")
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("MySQL/MariaDB URL") && msg.contains("MySqlBackend"),
        "{msg}"
    );
    let err = PgBackend::connect("sqlite:jobs.db").await.unwrap_err();
    assert!(err.to_string().contains("SqliteBackend"), "{err}");
}

#[tokio::test]
async fn server_errors_do_not_end_with_the_servers_source_line() {
    let broker = PgBackend::connect(&url()).await.unwrap();
    // A table that does not exist: the server's error carries the line of its C source that
    // raised it, which our message must not show as if it were a line of the user's SQL.
    let table = describe(&unique_name("absent"), broker_core::ClaimMode::Lease)
        .build()
        .unwrap();
    let err = broker.queue::<Job>(table).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("does not exist"), "{msg}");
    assert!(msg.contains("(code 42P01)"), "{msg}");
    assert!(!msg.contains(" at line "), "{msg}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "the driver's error stays the source"
    );
    broker.close().await;
}

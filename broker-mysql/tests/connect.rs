//! Connecting (issue #33): a wrong port fails at once with its cause, and a URL of another
//! database is refused naming the backend to use.

use std::time::{Duration, Instant};

use broker_mysql::MySqlBackend;

#[tokio::test]
async fn a_wrong_port_fails_at_once_naming_the_refused_connection() {
    let began = Instant::now();
    let err = MySqlBackend::connect("mysql://root@127.0.0.1:1/test")
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
    let err = MySqlBackend::connect("postgres://postgres@127.0.0.1:5432/test")
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("PostgreSQL URL") && msg.contains("PgBackend"),
        "{msg}"
    );
    let err = MySqlBackend::connect("sqlite:jobs.db").await.unwrap_err();
    assert!(err.to_string().contains("SqliteBackend"), "{err}");
}

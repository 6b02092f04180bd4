//! Opening a database file (issue #33): a file in a missing folder names the folder (there is
//! no server to be up), a URL of another database is refused naming the backend to use, and
//! `connect_existing` (the CLI's, the doctor's) never creates the file it was asked to open.

use broker_sqlite::SqliteBackend;

fn dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join("sqlx-broker-tests");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn a_file_in_a_missing_folder_names_the_folder() {
    let folder = dir().join(broker_testkit::unique_name("missing"));
    let url = format!("sqlite://{}/jobs.db", folder.display());
    let err = SqliteBackend::connect(&url).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("folder") && msg.contains(&*folder.to_string_lossy()),
        "{msg}"
    );
    assert!(!msg.contains("server"), "{msg}");
}

#[tokio::test]
async fn a_url_for_another_database_is_refused_naming_the_backend_to_use() {
    let err = SqliteBackend::connect("postgres://postgres@127.0.0.1:5432/test")
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("PostgreSQL URL") && msg.contains("PgBackend"),
        "{msg}"
    );
    assert!(!std::path::Path::new("postgres:").exists());
}

#[tokio::test]
async fn connect_existing_never_creates_the_file() {
    let path = dir().join(format!("{}.db", broker_testkit::unique_name("absent")));
    let url = format!("sqlite://{}", path.display());
    let err = SqliteBackend::connect_existing(&url).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("does not exist") && msg.contains("nothing was created"),
        "{msg}"
    );
    assert!(!path.exists(), "the file was created");
    // The ordinary connect creates it, and connect_existing then opens it.
    SqliteBackend::connect(&url).await.unwrap().close().await;
    SqliteBackend::connect_existing(&url)
        .await
        .unwrap()
        .close()
        .await;
    let _ = std::fs::remove_file(&path);
}

//! SQLite for `check`: a scratch folder of its own beside the user's file (in the temp folder
//! for an in-memory URL), a fresh database file in it per case, as the suite's tests do.

use std::path::{Path, PathBuf};

use broker_core::Broker;
use broker_sqlite::sqlx::{self, AssertSqlSafe};
use broker_sqlite::{SqliteBackend, SqliteBroker};

use super::{Place, Scratch, scratch_name};

/// The folder the user's database file is in.
fn folder_of(url: &str) -> PathBuf {
    let path = url
        .trim_start_matches("sqlite://")
        .trim_start_matches("sqlite:");
    let path = path.split('?').next().unwrap_or(path);
    if path.is_empty() || path.starts_with(":memory:") {
        return std::env::temp_dir();
    }
    match Path::new(path).parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// Makes the scratch folder beside the user's file, or says why it cannot.
pub(super) fn prepare(url: &str) -> Result<Scratch, String> {
    let folder = folder_of(url);
    let dir = folder.join(scratch_name());
    std::fs::create_dir(&dir).map_err(|e| {
        format!(
            "cannot make the scratch folder {} beside the database file: {e}; `sqlx-broker check` needs to create (and removes) a folder of files there",
            dir.display()
        )
    })?;
    Ok(Scratch {
        server: format!("SQLite {}", sqlite_version()),
        url: format!("sqlite://{}", dir.join("case.db").display()),
        admin_url: url.to_owned(),
        place: Place::SqliteFolder(dir),
    })
}

fn sqlite_version() -> String {
    // The library linked into this binary is the one every case used.
    let rt = tokio::runtime::Builder::new_current_thread().build();
    rt.ok()
        .and_then(|rt| {
            rt.block_on(async {
                use sqlx::Connection as _;
                let mut c = sqlx::SqliteConnection::connect("sqlite::memory:")
                    .await
                    .ok()?;
                sqlx::query_scalar::<_, String>("SELECT sqlite_version()")
                    .fetch_one(&mut c)
                    .await
                    .ok()
            })
        })
        .unwrap_or_default()
}

/// Removes the scratch folder and every file in it.
pub(super) fn clean(scratch: &Scratch) -> Result<String, String> {
    let Place::SqliteFolder(dir) = &scratch.place else {
        unreachable!("a SQLite scratch place")
    };
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(format!("folder {} removed", dir.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(format!("folder {} removed", dir.display()))
        }
        Err(e) => Err(format!(
            "removing the scratch folder {}: {e}",
            dir.display()
        )),
    }
}

/// The check's view of SQLite: a fresh file per case in the scratch folder.
pub(crate) struct CheckSqlite;

impl broker_testkit::TestDb for CheckSqlite {
    type B = SqliteBackend;
    type Job = broker_testkit::Job;
    type Text = String;
    const BATCHED_ACKS: bool = true;

    async fn database() -> String {
        let scratch = super::scratch_url();
        let dir = Path::new(scratch.trim_start_matches("sqlite://"))
            .parent()
            .expect("the scratch folder")
            .to_owned();
        let file = dir.join(format!("{}.db", broker_testkit::unique_name("db")));
        format!("sqlite://{}", file.display())
    }

    async fn connect(url: &str) -> Broker<SqliteBackend> {
        SqliteBackend::connect(url)
            .await
            .expect("open the case's database")
    }

    async fn key_is_held(broker: &SqliteBroker, key: &str) -> bool {
        broker
            .backend()
            .is_key_held(key)
            .await
            .expect("probe the key")
    }

    async fn kill_connections(_broker: &SqliteBroker) -> Option<usize> {
        None
    }

    async fn execute(broker: &SqliteBroker, sql: &str) -> u64 {
        let mut conn = broker.pool().acquire().await.expect("a connection");
        // A read first, so the connection sees the schema other connections changed.
        sqlx::query("SELECT count(*) FROM sqlite_master")
            .execute(&mut *conn)
            .await
            .expect("read the schema");
        sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }

    async fn slow_down_deletes(broker: &SqliteBroker, table: &str) -> bool {
        let rows = Self::quote(&format!("{table}_slow_rows"));
        let statements = [
            format!("CREATE TABLE {rows} (x INTEGER)"),
            format!(
                "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 200000) \
                 INSERT INTO {rows} SELECT x FROM c"
            ),
            format!(
                "CREATE TRIGGER {} BEFORE DELETE ON {} BEGIN SELECT sum(x) FROM {rows}; END",
                Self::quote(&format!("{table}_slow")),
                Self::quote(table)
            ),
        ];
        for sql in &statements {
            Self::execute(broker, sql).await;
        }
        true
    }

    async fn leaks(broker: &SqliteBroker) -> Vec<String> {
        let mut leaks = Vec::new();
        let held = broker.backend().held_keys();
        if held > 0 {
            leaks.push(format!("{held} advisory keys still held"));
        }
        let pool = broker.pool();
        let in_use = || {
            pool.size()
                .saturating_sub(u32::try_from(pool.num_idle()).unwrap_or(u32::MAX))
        };
        for _ in 0..100 {
            if in_use() == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let in_use = in_use();
        if in_use > 0 {
            leaks.push(format!("{in_use} pool connections still in use"));
        }
        leaks
    }

    async fn drop_database(url: &str) {
        let path = url.trim_start_matches("sqlite://");
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{path}{suffix}"));
        }
    }
}

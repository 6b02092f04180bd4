//! SQLite for `check`: a scratch folder of its own beside the user's file (in the temp folder
//! for an in-memory URL), a fresh database file in it per case, as the suite's tests do.

use std::path::{Path, PathBuf};

use broker_sqlite::sqlx;
use broker_testkit::sqlite::{SqliteDb, SqlitePlace};

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

/// The check's place on SQLite: the scratch folder.
pub(crate) struct InScratch;

impl SqlitePlace for InScratch {
    fn folder() -> PathBuf {
        let scratch = super::scratch_url();
        Path::new(scratch.trim_start_matches("sqlite://"))
            .parent()
            .expect("the scratch folder")
            .to_owned()
    }
}

/// The check's view of SQLite: a fresh file per case in the scratch folder.
pub(crate) type CheckSqlite = SqliteDb<InScratch>;

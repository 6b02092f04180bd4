//! MariaDB / MySQL for `check`: a scratch database of its own (or, where the user may not
//! create one, tables of this run's own names in the URL's database), brokers whose server
//! connections are known by id, and the probes the cases ask for.

use std::time::Duration;

use broker_mysql::sqlx::{self, AssertSqlSafe, Connection, Executor, MySqlConnection};
use broker_testkit::mysql::{MySqlDb, MySqlPlace, admin_at as connect_one, quote};
use broker_testkit::url_with_database as with_database;

use super::{Place, Scratch, scratch_name};

/// The statements whose refusal says a right is missing: what the cases do to a table of
/// their own (create, index, trigger, alter, drop).
async fn probe_table_rights(conn: &mut MySqlConnection, db: &str) -> Result<(), String> {
    let t = format!(
        "{}.{}",
        quote(db),
        quote(&format!("{}_probe", scratch_name()))
    );
    let steps = [
        (
            "CREATE",
            format!("CREATE TABLE {t} (id BIGINT PRIMARY KEY, v INT)"),
        ),
        ("INDEX", format!("CREATE INDEX probe_v ON {t} (v)")),
        ("ALTER", format!("ALTER TABLE {t} ADD COLUMN w INT")),
        (
            "TRIGGER",
            format!(
                "CREATE TRIGGER {}.{} BEFORE DELETE ON {t} FOR EACH ROW SET @sqlx_broker_probe = 1",
                quote(db),
                quote(&format!("{}_probe_t", scratch_name()))
            ),
        ),
    ];
    let mut failed = None;
    for (right, sql) in &steps {
        if let Err(e) = conn.execute(AssertSqlSafe(sql.clone())).await {
            failed = Some(format!("{right} ({e})"));
            break;
        }
    }
    let dropped = conn
        .execute(AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
        .await;
    match (failed, dropped) {
        (Some(f), _) => Err(f),
        (None, Err(e)) => Err(format!("DROP ({e})")),
        (None, Ok(_)) => Ok(()),
    }
}

/// Checks the rights `check` needs and makes its scratch database, or says what to grant.
pub(super) async fn prepare(url: &str) -> Result<Scratch, String> {
    let mut conn = connect_one(url).await?;
    let (user, version, current): (String, String, Option<String>) = sqlx::query_as(
        "SELECT CAST(CURRENT_USER() AS CHAR), CAST(VERSION() AS CHAR), CAST(DATABASE() AS CHAR)",
    )
    .fetch_one(&mut conn)
    .await
    .map_err(|e| format!("reading the user: {e}"))?;
    let server = format!("MySQL/MariaDB {version}, as {user}");
    let grant_user = match user.split_once('@') {
        Some((u, h)) => format!("'{u}'@'{h}'"),
        None => format!("'{user}'"),
    };
    let name = scratch_name();
    let own = conn
        .execute(AssertSqlSafe(format!(
            "CREATE DATABASE {} CHARACTER SET utf8mb4",
            quote(&name)
        )))
        .await;
    let mut why_not_own = match own {
        Ok(_) => match probe_table_rights(&mut conn, &name).await {
            Ok(()) => {
                let _ = conn.close().await;
                return Ok(Scratch {
                    server,
                    url: with_database(url, &name),
                    admin_url: url.to_owned(),
                    place: Place::MyDatabase(name),
                });
            }
            Err(right) => {
                let _ = conn
                    .execute(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {}",
                        quote(&name)
                    )))
                    .await;
                format!("it may create a database but not {right} in it")
            }
        },
        Err(e) => format!("it may not create a database ({e})"),
    };
    // The fallback: tables of this run's own names in the URL's database, where it may
    // create them and the broker's shared tables are not.
    if let Some(db) = current.clone() {
        let shared: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME IN (?, ?, ?, ?)",
        )
        .bind(super::SHARED_TABLES[0])
        .bind(super::SHARED_TABLES[1])
        .bind(super::SHARED_TABLES[2])
        .bind(super::SHARED_TABLES[3])
        .fetch_all(&mut conn)
        .await
        .map_err(|e| format!("listing tables: {e}"))?;
        if shared.is_empty() {
            match probe_table_rights(&mut conn, &db).await {
                Ok(()) => {
                    let before = own_tables(&mut conn).await?;
                    let _ = conn.close().await;
                    return Ok(Scratch {
                        server,
                        url: url.to_owned(),
                        admin_url: url.to_owned(),
                        place: Place::MyPrefix {
                            database: db,
                            before,
                        },
                    });
                }
                Err(right) => {
                    why_not_own.push_str(&format!(
                        ", nor {right} in its database `{db}` (the fallback)"
                    ));
                }
            }
        } else {
            why_not_own.push_str(&format!(
                "; it would fall back to tables of its own in `{db}`, but the broker's shared tables ({}) are there and the cases would write to them",
                shared.join(", ")
            ));
        }
    }
    let _ = conn.close().await;
    let fallback = match &current {
        Some(db) => format!(
            ", or let it make tables of its own in `{db}`: GRANT CREATE, DROP, ALTER, INDEX, TRIGGER, SELECT, INSERT, UPDATE, DELETE ON {}.* TO {grant_user}",
            quote(db)
        ),
        None => String::new(),
    };
    Err(format!(
        "user {user} cannot run the check: {why_not_own}. `sqlx-broker check` runs its cases in a scratch database it creates and drops (named sqlx_broker_check_..). Grant it with GRANT ALL ON `sqlx\\_broker\\_check\\_%`.* TO {grant_user}{fallback}"
    ))
}

/// Tables of the current database whose names the cases of this process make, and the
/// broker's shared tables.
async fn own_tables(conn: &mut MySqlConnection) -> Result<Vec<String>, String> {
    sqlx::query_scalar(
        "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND (TABLE_NAME LIKE ? OR TABLE_NAME IN (?, ?, ?, ?))",
    )
    .bind(super::own_pattern())
    .bind(super::SHARED_TABLES[0])
    .bind(super::SHARED_TABLES[1])
    .bind(super::SHARED_TABLES[2])
    .bind(super::SHARED_TABLES[3])
    .fetch_all(conn)
    .await
    .map_err(|e| format!("listing tables: {e}"))
}

/// Ends this run's connections and drops what it made.
pub(super) async fn clean(scratch: &Scratch) -> Result<String, String> {
    let mut conn = connect_one(&scratch.admin_url).await?;
    for id in broker_testkit::mysql::all_connection_ids() {
        let _ = conn
            .execute(AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .await;
    }
    let done = match &scratch.place {
        Place::MyDatabase(name) => {
            conn.execute(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {}",
                quote(name)
            )))
            .await
            .map_err(|e| format!("dropping the scratch database {name}: {e}"))?;
            let left: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?",
            )
            .bind(name)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
            if left > 0 {
                return Err(format!("the scratch database {name} is still there"));
            }
            format!("database {name} dropped")
        }
        Place::MyPrefix { database, before } => {
            let now = own_tables(&mut conn).await?;
            let made: Vec<_> = now.iter().filter(|t| !before.contains(t)).collect();
            for t in &made {
                conn.execute(AssertSqlSafe(format!("DROP TABLE IF EXISTS {}", quote(t))))
                    .await
                    .map_err(|e| format!("dropping {t}: {e}"))?;
            }
            format!(
                "{} tables of this run dropped from database {database}",
                made.len()
            )
        }
        _ => unreachable!("a MySQL scratch place"),
    };
    let _ = conn.close().await;
    Ok(done)
}

/// The check's place on MariaDB / MySQL: the scratch database (or the fallback's tables),
/// probes on the scratch URL.
pub(crate) struct InScratch;

impl MySqlPlace for InScratch {
    fn admin_url() -> String {
        super::scratch_url()
    }

    async fn database() -> String {
        super::scratch_url()
    }

    const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(60);
}

/// The check's view of MariaDB / MySQL: the scratch database.
pub(crate) type CheckMySql = MySqlDb<InScratch>;

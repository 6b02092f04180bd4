//! PostgreSQL for `check`: a scratch schema of its own (the URL's database, `search_path` set
//! to the schema on every session the cases open), brokers whose sessions carry an
//! application name of this run, and the probes the cases ask for.

use std::time::Duration;

use broker_postgres::sqlx::{self, AssertSqlSafe, Connection, Executor, PgConnection};
use broker_testkit::pg::{PgDb, PgPlace};

use super::{Place, Scratch, quote_double, scratch_name};

/// The prefix of this run's application names: `sbc_<pid>_`.
fn app_prefix() -> String {
    format!("sbc_{}_", std::process::id())
}

async fn connect_one(url: &str) -> Result<PgConnection, String> {
    match tokio::time::timeout(Duration::from_secs(20), PgConnection::connect(url)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("cannot connect: {e}")),
        Err(_) => Err("the server did not answer within 20 s".to_owned()),
    }
}

/// `url` with `options=-c search_path=<schema>` added, so every session works in the schema.
fn in_schema(url: &str, schema: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20search_path%3D{schema}")
}

/// Checks the rights `check` needs and makes its scratch schema, or says what to grant.
pub(super) async fn prepare(url: &str) -> Result<Scratch, String> {
    let mut conn = connect_one(url).await?;
    let (user, database, may_create, schema_now, may_create_here): (
        String,
        String,
        bool,
        Option<String>,
        Option<bool>,
    ) = sqlx::query_as(
        "SELECT current_user::text, current_database()::text, \
         has_database_privilege(current_database(), 'CREATE'), current_schema()::text, \
         CASE WHEN current_schema() IS NULL THEN NULL \
              ELSE has_schema_privilege(current_schema(), 'CREATE') END",
    )
    .fetch_one(&mut conn)
    .await
    .map_err(|e| format!("reading the role's rights: {e}"))?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut conn)
        .await
        .map_err(|e| format!("reading the server version: {e}"))?;
    let server = format!("PostgreSQL {version}, database {database:?} as {user:?}");
    if may_create {
        let schema = scratch_name();
        conn.execute(AssertSqlSafe(format!(
            "CREATE SCHEMA {}",
            quote_double(&schema)
        )))
        .await
        .map_err(|e| format!("creating the scratch schema {schema}: {e}"))?;
        let _ = conn.close().await;
        return Ok(Scratch {
            server,
            url: in_schema(url, &schema),
            admin_url: url.to_owned(),
            place: Place::PgSchema(schema),
        });
    }
    // No schema of its own: tables of this run's own names in the role's current schema, where
    // it may create tables and the broker's shared tables are not (so all it creates is its own).
    let shared = shared_tables_in(&mut conn).await?;
    match (schema_now, may_create_here) {
        (Some(schema), Some(true)) if shared.is_empty() => {
            let before = own_tables(&mut conn, &schema).await?;
            let _ = conn.close().await;
            Ok(Scratch {
                server,
                url: url.to_owned(),
                admin_url: url.to_owned(),
                place: Place::PgPrefix { schema, before },
            })
        }
        (schema, _) => {
            let _ = conn.close().await;
            let schema_part = match (&schema, shared.is_empty()) {
                (Some(s), false) => format!(
                    "; it would fall back to tables of its own in schema {s:?}, but the broker's shared tables ({}) are there and the cases would write to them",
                    shared.join(", ")
                ),
                (Some(s), true) => format!(
                    ", nor a table in its current schema {s:?} (the fallback): GRANT CREATE ON SCHEMA {} TO {}",
                    quote_double(s),
                    quote_double(&user)
                ),
                (None, _) => {
                    ", and it has no current schema to fall back to (none on its search_path exists)"
                        .to_owned()
                }
            };
            Err(format!(
                "role {user:?} may not create a schema in database {database:?}: `sqlx-broker check` runs its cases in a scratch schema it creates and drops. Grant it with GRANT CREATE ON DATABASE {} TO {} (and revoke it after){schema_part}",
                quote_double(&database),
                quote_double(&user),
            ))
        }
    }
}

/// The broker's shared tables in the current schema (`sqlx_broker_control`, ..).
async fn shared_tables_in(conn: &mut PgConnection) -> Result<Vec<String>, String> {
    sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = ANY($1)",
    )
    .bind(super::SHARED_TABLES.map(str::to_owned).to_vec())
    .fetch_all(conn)
    .await
    .map_err(|e| format!("listing tables: {e}"))
}

/// Tables in `schema` whose names the cases of this process make (`sb_.._<pid>_..`), and the
/// broker's shared tables.
async fn own_tables(conn: &mut PgConnection, schema: &str) -> Result<Vec<String>, String> {
    sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = $1 AND (table_name LIKE $2 OR table_name = ANY($3))",
    )
    .bind(schema)
    .bind(super::own_pattern())
    .bind(super::SHARED_TABLES.map(str::to_owned).to_vec())
    .fetch_all(conn)
    .await
    .map_err(|e| format!("listing tables: {e}"))
}

/// Ends this run's sessions and drops what it made: the scratch schema with everything in it,
/// or (the fallback) the tables it made.
pub(super) async fn clean(scratch: &Scratch) -> Result<String, String> {
    let mut conn = connect_one(&scratch.admin_url).await?;
    let _ = sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name LIKE $1 AND pid <> pg_backend_pid()",
    )
    .bind(format!("{}%", app_prefix().replace('_', "\\_")))
    .execute(&mut conn)
    .await;
    let done = match &scratch.place {
        Place::PgSchema(schema) => {
            conn.execute(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {} CASCADE",
                quote_double(schema)
            )))
            .await
            .map_err(|e| format!("dropping the scratch schema {schema}: {e}"))?;
            let left: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                    .bind(schema)
                    .fetch_one(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
            if left {
                return Err(format!("the scratch schema {schema} is still there"));
            }
            format!("schema {schema} dropped")
        }
        Place::PgPrefix { schema, before } => {
            let now = own_tables(&mut conn, schema).await?;
            let made: Vec<_> = now.iter().filter(|t| !before.contains(t)).collect();
            for t in &made {
                conn.execute(AssertSqlSafe(format!(
                    "DROP TABLE IF EXISTS {}.{} CASCADE",
                    quote_double(schema),
                    quote_double(t)
                )))
                .await
                .map_err(|e| format!("dropping {t}: {e}"))?;
            }
            // The slow-delete triggers' functions are named after the tables.
            let functions: Vec<String> = sqlx::query_scalar(
                "SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                 WHERE n.nspname = $1 AND p.proname LIKE $2",
            )
            .bind(schema)
            .bind(super::own_pattern())
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
            for f in functions {
                let _ = conn
                    .execute(AssertSqlSafe(format!(
                        "DROP FUNCTION IF EXISTS {}.{}() CASCADE",
                        quote_double(schema),
                        quote_double(&f)
                    )))
                    .await;
            }
            format!(
                "{} tables of this run dropped from schema {schema}",
                made.len()
            )
        }
        _ => unreachable!("a PostgreSQL scratch place"),
    };
    let _ = conn.close().await;
    Ok(done)
}

/// The check's place on PostgreSQL: the scratch schema (or the fallback's tables), sessions
/// named `sbc_<pid>_<n>_..`, probes on the scratch URL.
pub(crate) struct InScratch;

impl PgPlace for InScratch {
    fn app_prefix() -> String {
        app_prefix()
    }

    fn admin_url() -> String {
        super::scratch_url()
    }

    async fn database() -> String {
        super::scratch_url()
    }
}

/// The check's view of PostgreSQL: the scratch schema.
pub(crate) type CheckPg = PgDb<InScratch>;

//! The `sqlx-broker` binary against real databases (SQLite, PostgreSQL, MariaDB): what it
//! prints, what it changes, and the exit status of a refusal.

use std::process::{Command, Output};

use broker_core::{Broker, ColumnType, DeadLetter, NewJob, Payload, Schedule, TableDescription};

fn table(name: &str) -> TableDescription {
    TableDescription::builder(name)
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .due_at("due_at")
        .processed_at("done_at")
        .last_error("last_error")
        .max_attempts(1)
        .dead_letter(DeadLetter::Column("dead_at".into()))
        .build()
        .unwrap()
}

/// Runs the binary on `url` and `table` with `args`.
fn cli(url: &str, table: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sqlx-broker"))
        .args([
            "--url",
            url,
            "--table",
            table,
            "--payload",
            "payload",
            "--locked-until",
            "locked_until",
            "--due-at",
            "due_at",
            "--processed-at",
            "done_at",
            "--last-error",
            "last_error",
            "--max-attempts",
            "1",
            "--dead-letter-column",
            "dead_at",
        ])
        .args(args)
        .output()
        .expect("run sqlx-broker")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Publishes four rows and dead-letters the first; returns the ids.
async fn prepare<B: broker_core::Backend>(broker: &Broker<B>, t: &TableDescription) -> Vec<i64>
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
{
    broker.create_tables(t).await.unwrap();
    let q = broker.queue::<Payload<String>>(t.clone()).await.unwrap();
    let ids = q
        .publish_batch(
            &(0..4)
                .map(|i| NewJob::new(format!("job-{i}")))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    let d = q.claim(1).await.unwrap().pop().unwrap();
    d.dead_letter().await.unwrap();
    // A schedule registered for the queue, for `stats` to list with its next tick.
    let nightly = Schedule::new(format!("{}-nightly", t.name()), "0 3 * * *").unwrap();
    q.schedule(nightly, |_| NewJob::new("nightly".to_owned()))
        .await
        .unwrap()
        .stop()
        .await;
    ids
}

/// The commands in order, on a database at `url` whose table `name` `prepare` filled.
fn exercise(url: &str, name: &str, ids: &[i64]) {
    let o = cli(url, name, &["--json", "stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["due"]["rows"], 3, "{s}");
    assert_eq!(s["dead"]["rows"], 1, "{s}");
    assert_eq!(s["paused"], serde_json::Value::Null);
    assert_eq!(s["schedules"][0]["expression"], "0 3 * * *", "{s}");
    assert!(s["schedules"][0]["next_tick_ms"].is_i64(), "{s}");
    let o = cli(url, name, &["stats"]);
    assert!(
        stdout(&o).contains(&format!(
            "schedule   \"{name}-nightly\" \"0 3 * * *\" (UTC), next tick "
        )),
        "{}",
        stdout(&o)
    );

    let o = cli(url, name, &["dead", "list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(&ids[0].to_string()), "{}", stdout(&o));

    let id = ids[0].to_string();
    let o = cli(url, name, &["dead", "requeue", "--id", &id]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "1 row requeued\n");
    let o = cli(url, name, &["dead", "requeue", "--id", &id]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "requeueing a row that is no dead letter"
    );
    assert!(
        stderr(&o).contains("among the dead letters"),
        "{}",
        stderr(&o)
    );

    let o = cli(url, name, &["pause", "--by", "the test"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = cli(url, name, &["stats"]);
    assert!(
        stdout(&o).contains("PAUSED") && stdout(&o).contains("the test"),
        "{}",
        stdout(&o)
    );
    let o = cli(url, name, &["pause"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("paused already"), "{}", stderr(&o));
    assert!(cli(url, name, &["resume"]).status.success());

    let o = cli(url, name, &["cancel", &ids[1].to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = cli(url, name, &["cancel", "987654321"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no row 987654321"), "{}", stderr(&o));
    let o = cli(url, name, &["--json", "jobs", "due"]);
    let due: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(due.as_array().map(Vec::len), Some(3), "{due}");
    assert!(
        due.as_array()
            .unwrap()
            .iter()
            .all(|j| j["last_error_cut"] == serde_json::Value::Bool(false)),
        "a listing says whether it cut each row's last error: {due}"
    );
    // The next-page hint only under a full page: three rows fill a page of 2 and 3, not of 4.
    let o = cli(url, name, &["jobs", "due", "--limit", "2"]);
    assert!(
        stdout(&o).contains(&format!("(next page: --after {})", ids[2])),
        "{}",
        stdout(&o)
    );
    let o = cli(url, name, &["jobs", "due", "--limit", "3"]);
    assert!(
        stdout(&o).contains(&format!("(next page: --after {})", ids[3])),
        "{}",
        stdout(&o)
    );
    let o = cli(url, name, &["jobs", "due", "--limit", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("next page"), "{}", stdout(&o));

    let o = cli(url, name, &["purge", "--older-than", "1d"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "0 rows purged\n");
    let o = cli(url, name, &["jobs", "sleeping"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "an unknown state is a usage error"
    );
    assert!(stderr(&o).contains("in-work"), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_operates_a_sqlite_queue() {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("cli"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/q.db", dir.display());
    let broker = broker_sqlite::SqliteBackend::connect(&url).await.unwrap();
    let t = table("cli_jobs");
    let ids = prepare(&broker, &t).await;
    broker.close().await;
    exercise(&url, t.name(), &ids);
    let o = cli(&url, t.name(), &["doctor"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_operates_a_postgres_queue() {
    let url = std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let broker = broker_postgres::PgBackend::connect(&url).await.unwrap();
    let t = table(&broker_testkit::unique_name("cli"));
    let ids = prepare(&broker, &t).await;
    exercise(&url, t.name(), &ids);
    // The doctor checks the workers' pool, not the CLI's two connections.
    let o = cli(
        &url,
        t.name(),
        &["doctor", "--pool-size", "3", "--concurrency", "40"],
    );
    assert!(
        stdout(&o).contains("pool size: 3 connections for 1 subscription(s) at concurrency 40"),
        "{}",
        stdout(&o)
    );
    broker.drop_tables(&t).await.unwrap();
    broker.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_operates_a_mariadb_queue() {
    let url = std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let broker = broker_mysql::MySqlBackend::connect(&url).await.unwrap();
    let t = table(&broker_testkit::unique_name("cli"));
    let ids = prepare(&broker, &t).await;
    exercise(&url, t.name(), &ids);
    broker.drop_tables(&t).await.unwrap();
    broker.close().await;
}

/// One HTTP/1.0 GET to the dashboard on `port`; the whole response as text.
fn http_get(port: u16, path: &str, auth: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let auth = auth
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// A dashboard token of the length the CLI takes (16 bytes or more).
const TOKEN: &str = "s3cret-s3cret-s3cret";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_serves_the_dashboard_behind_its_token() {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("cli-web"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/q.db", dir.display());
    let broker = broker_sqlite::SqliteBackend::connect(&url).await.unwrap();
    let t = table("web_jobs");
    prepare(&broker, &t).await;
    broker.close().await;

    let o = cli(&url, t.name(), &["web", "--listen", "0.0.0.0:0"]);
    assert_eq!(o.status.code(), Some(1), "a dashboard open to the network");
    assert!(stderr(&o).contains("--token"), "{}", stderr(&o));

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = Command::new(env!("CARGO_BIN_EXE_sqlx-broker"))
        .args(["--url", &url, "--table", t.name(), "--payload", "payload"])
        .args(["--locked-until", "locked_until", "--due-at", "due_at"])
        .args(["--processed-at", "done_at", "--last-error", "last_error"])
        .args(["--max-attempts", "1", "--dead-letter-column", "dead_at"])
        .args([
            "web",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--token",
            TOKEN,
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the dashboard never listened"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let anonymous = http_get(port, "/", None);
    let wrong = http_get(port, "/", Some("guess"));
    let page = http_get(port, "/", Some(TOKEN));
    server.kill().unwrap();
    server.wait().unwrap();
    assert!(anonymous.starts_with("HTTP/1.0 303"), "{anonymous}");
    assert!(anonymous.contains("location: /login"), "{anonymous}");
    assert!(wrong.starts_with("HTTP/1.0 303"), "{wrong}");
    assert!(page.starts_with("HTTP/1.0 200"), "{page}");
    assert!(
        page.contains(r#"data-state="due">3<"#) && page.contains(r#"data-state="dead">1<"#),
        "{page}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn pg_url() -> String {
    std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn mysql_url() -> String {
    std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// `url` with `user` and `password` in its user information (the URLs above have a user and
/// no password).
fn with_login(url: &str, user: &str, password: Option<&str>) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, h)| h);
    match password {
        Some(p) => format!("{scheme}://{user}:{p}@{host}"),
        None => format!("{scheme}://{user}@{host}"),
    }
}

const SECRET: &str = "S3CRETPW";

/// Runs a failing command with and without `--json`; both exit 1, print neither the password
/// nor an escape, and the message shows the URL with `***` in the password's place.
fn refused_without_the_password(url: &str, config: Option<&std::path::Path>, expect: &[&str]) {
    for json in [false, true] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sqlx-broker"));
        if let Some(path) = config {
            c.arg("--config").arg(path);
        } else {
            c.args(["--url", url]);
        }
        if json {
            c.arg("--json");
        }
        let o = c
            .args(["--table", "jobs", "--payload", "payload", "stats"])
            .output()
            .unwrap();
        let (out, err) = (stdout(&o), stderr(&o));
        assert_eq!(o.status.code(), Some(1), "{out}{err}");
        // Its halves too: a quote in a password cuts a URL in two.
        for part in [SECRET, &SECRET[..4], &SECRET[4..]] {
            assert!(
                !out.contains(part) && !err.contains(part),
                "the password was printed:\n{out}{err}"
            );
        }
        let message = if json {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            v["error"].as_str().unwrap().to_owned()
        } else {
            err
        };
        for e in expect {
            assert!(message.contains(e), "{e:?} not in {message}");
        }
    }
}

#[test]
fn a_postgres_connect_error_never_prints_the_password() {
    let db = broker_testkit::unique_name("nodb");
    let url = format!(
        "{}/{db}",
        with_login(&pg_url(), "postgres", Some(SECRET))
            .rsplit_once('/')
            .unwrap()
            .0
    );
    refused_without_the_password(&url, None, &["postgres:***@", "does not exist"]);
    // A blank and a quote in the password, as written (sqlx's URL parser takes both).
    let odd = url.replacen(SECRET, &format!("{} \"{}", &SECRET[..4], &SECRET[4..]), 1);
    refused_without_the_password(&odd, None, &["postgres:***@", "does not exist"]);
    // The libpq form, with the password as a parameter.
    let url = format!("{}?password={SECRET}", pg_url().rsplit_once('/').unwrap().0);
    let url = format!("{url}&dbname={db}");
    refused_without_the_password(&url, None, &["password=***", "does not exist"]);
}

#[test]
fn a_mariadb_connect_error_never_prints_the_password() {
    // root has no password on the test server: one given is refused.
    let url = with_login(&mysql_url(), "root", Some(SECRET));
    refused_without_the_password(&url, None, &["root:***@", "Access denied"]);
    let url = with_login(&mysql_url(), "root", Some(SECRET)).replacen("mysql://", "mariadb://", 1);
    refused_without_the_password(&url, None, &["root:***@", "Access denied"]);
}

#[test]
fn a_bad_url_or_config_never_prints_the_password() {
    refused_without_the_password(
        &format!("postgress://alice:{SECRET}@db.invalid/app"),
        None,
        &["alice:***@", "postgres://"],
    );
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("cli-toml"));
    std::fs::create_dir_all(&dir).unwrap();
    // The URL's line is the one the TOML parser quotes: its string never ends.
    let unterminated = dir.join("unterminated.toml");
    std::fs::write(
        &unterminated,
        format!("url = \"postgres://alice:{SECRET}@db.invalid/app\n[table]\nname = \"jobs\"\n"),
    )
    .unwrap();
    refused_without_the_password("", Some(&unterminated), &["line 1"]);
    // A password with a quote in it ends the string early.
    let quoted = dir.join("quoted.toml");
    std::fs::write(
        &quoted,
        format!(
            "url = \"postgres://alice:{}\"{}@db.invalid/app\"\n",
            &SECRET[..4],
            &SECRET[4..]
        ),
    )
    .unwrap();
    refused_without_the_password("", Some(&quoted), &["line 1"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Escapes a terminal would act on: OSC (window title), CSI colours, a BEL, an 8-bit CSI, and a
/// right-to-left override.
const ESCAPES: &str = "\u{1b}]0;pwned\u{7}\u{1b}[31mred\u{9b}1m\u{202e}drow\nqueue \"x\" resumed";

fn has_escape(s: &str) -> bool {
    s.chars().any(|c| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminal_escapes_in_the_output_are_shown_as_text() {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("cli-esc"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/q.db", dir.display());
    let broker = broker_sqlite::SqliteBackend::connect(&url).await.unwrap();
    let t = table("esc_jobs");
    prepare(&broker, &t).await;
    broker.close().await;

    let o = cli(&url, t.name(), &["pause", "--by", ESCAPES]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = cli(&url, t.name(), &["stats"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!has_escape(&out), "{out:?}");
    assert!(out.contains("pwned") && out.contains("\\u{1b}"), "{out}");
    assert!(
        !out.lines().any(|l| l.starts_with("queue \"x\"")),
        "a line break in the text makes a line of its own: {out}"
    );
    // JSON keeps the text as it is, every escape written as \u.
    let o = cli(&url, t.name(), &["--json", "stats"]);
    let out = stdout(&o);
    assert!(!has_escape(&out), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["paused"]["by"], ESCAPES);
    // An error that quotes the table's name.
    let o = cli(&url, &format!("no_such{ESCAPES}"), &["stats"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!has_escape(&stderr(&o)), "{:?}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A role that may open no connection: the server answers 53300, "too many connections".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_server_out_of_connections_is_not_blamed_on_the_password() {
    let admin = broker_postgres::PgBackend::connect(&pg_url())
        .await
        .unwrap();
    let role = broker_testkit::unique_name("cli_role");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN CONNECTION LIMIT 0"
    )))
    .execute(admin.pool())
    .await
    .unwrap();
    let o = cli(&with_login(&pg_url(), &role, None), "jobs", &["stats"]);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
        .execute(admin.pool())
        .await
        .unwrap();
    admin.close().await;
    refused_for_connections(&o, "53300");
}

/// The CLI's refusal for a server out of connections: the server's code, and what to do
/// about connections, not about the password.
fn refused_for_connections(o: &Output, code: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(code), "{err}");
    assert!(!err.contains("password"), "{err}");
    assert!(err.contains("no connection to spare"), "{err}");
}

/// A user that may hold one connection, holding it: the server answers 1226.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mariadb_server_out_of_connections_is_not_blamed_on_the_password() {
    use sqlx::Connection;
    let admin = broker_mysql::MySqlBackend::connect(&mysql_url())
        .await
        .unwrap();
    let user = broker_testkit::unique_name("cli_user");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE USER '{user}'@'%' WITH MAX_USER_CONNECTIONS 1"
    )))
    .execute(admin.pool())
    .await
    .unwrap();
    let url = with_login(&mysql_url(), &user, None);
    let no_db = url.rsplit_once('/').unwrap().0.to_owned();
    let held = sqlx::MySqlConnection::connect(&no_db).await.unwrap();
    let o = cli(&url, "jobs", &["stats"]);
    held.close().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP USER '{user}'@'%'")))
        .execute(admin.pool())
        .await
        .unwrap();
    admin.close().await;
    refused_for_connections(&o, "max_user_connections");
}

/// Starts `sqlx-broker web` for table `name` with `args`; waits until it listens on `port`.
fn start_web(url: &str, name: &str, port: u16, args: &[&str]) -> std::process::Child {
    let child = Command::new(env!("CARGO_BIN_EXE_sqlx-broker"))
        .args(["--url", url, "--table", name, "--payload", "payload"])
        .args(["--locked-until", "locked_until", "--due-at", "due_at"])
        .args(["--processed-at", "done_at", "--last-error", "last_error"])
        .args(["--max-attempts", "1", "--dead-letter-column", "dead_at"])
        .args(["web", "--listen", &format!("127.0.0.1:{port}")])
        .args(args)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the dashboard never listened"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    child
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The dashboard's pages, 24 at once, need the CLI's pool only: it holds at most two
/// connections (one more listens for wake-ups), where it used to open sixteen.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_holds_at_most_two_postgres_connections() {
    let broker = broker_postgres::PgBackend::connect(&pg_url())
        .await
        .unwrap();
    let t = table(&broker_testkit::unique_name("cli_pool"));
    prepare(&broker, &t).await;
    let app = broker_testkit::unique_name("cli_app");
    let sep = if pg_url().contains('?') { '&' } else { '?' };
    let url = format!("{}{sep}application_name={app}", pg_url());
    let port = free_port();
    let mut server = start_web(&url, t.name(), port, &[]);
    let pages: Vec<_> = (0..24)
        .map(|_| {
            let path = format!("/queues/{}?state=due", t.name());
            std::thread::spawn(move || http_get_as(port, &path, "127.0.0.1", None))
        })
        .collect();
    for p in pages {
        assert!(p.join().unwrap().starts_with("HTTP/1.0 200"));
    }
    // Idle pool connections stay open (sqlx closes them after 10 minutes): what the pool
    // opened under the load is still there to count.
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query NOT ILIKE 'LISTEN%'",
    )
    .bind(&app)
    .fetch_one(broker.pool())
    .await
    .unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    broker.drop_tables(&t).await.unwrap();
    broker.close().await;
    assert!((1..=2).contains(&open), "{open} connections");
}

/// One HTTP/1.0 GET with `host` as its Host header.
fn http_get_as(port: u16, path: &str, host: &str, auth: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let auth = auth
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n{auth}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn a_short_or_empty_dashboard_token_is_refused() {
    let url = "sqlite://does-not-matter.db";
    for (token, env) in [(Some(""), None), (Some("short"), None), (None, Some(""))] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sqlx-broker"));
        c.args([
            "--url",
            url,
            "--table",
            "jobs",
            "web",
            "--listen",
            "127.0.0.1:0",
        ]);
        if let Some(t) = token {
            c.args(["--token", t]);
        }
        c.env_remove("SQLX_BROKER_WEB_TOKEN");
        if let Some(e) = env {
            c.env("SQLX_BROKER_WEB_TOKEN", e);
        }
        let o = c.output().unwrap();
        assert_eq!(
            o.status.code(),
            Some(1),
            "{token:?} {env:?}: {}",
            stderr(&o)
        );
        assert!(stderr(&o).contains("16 bytes"), "{}", stderr(&o));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_dashboard_without_a_token_answers_only_to_loopback_names() {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("cli-host"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/q.db", dir.display());
    let broker = broker_sqlite::SqliteBackend::connect(&url).await.unwrap();
    let t = table("host_jobs");
    prepare(&broker, &t).await;
    broker.close().await;
    let port = free_port();
    let mut server = start_web(&url, t.name(), port, &["--allowed-host", "queues.internal"]);
    let at = |host: &str| http_get_as(port, "/", host, None);
    let rebound = at("attacker.example");
    let rebound_with_port = at(&format!("attacker.example:{port}"));
    let pages = [
        at(&format!("127.0.0.1:{port}")),
        at(&format!("localhost:{port}")),
        at("LOCALHOST"),
        at(&format!("[::1]:{port}")),
        at("queues.internal"),
    ];
    server.kill().unwrap();
    server.wait().unwrap();
    for r in [&rebound, &rebound_with_port] {
        assert!(r.starts_with("HTTP/1.0 403"), "{r}");
        assert!(r.contains("--allowed-host"), "{r}");
    }
    for p in pages {
        assert!(p.starts_with("HTTP/1.0 200"), "{p}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kind the kinds tests publish and run.
#[derive(serde::Serialize, serde::Deserialize)]
struct Resize {
    image: i64,
}
impl broker_core::JobKind for Resize {
    const KIND: &'static str = "resize";
}

/// A kind no worker runs.
#[derive(serde::Serialize, serde::Deserialize)]
struct Export {
    user: i64,
}
impl broker_core::JobKind for Export {
    const KIND: &'static str = "export";
}

fn kinds_table(name: &str) -> TableDescription {
    TableDescription::builder(name)
        .payload("args", ColumnType::Json)
        .kind("kind")
        .locked_until("locked_until")
        .due_at("due_at")
        .processed_at("done_at")
        .last_error("last_error")
        .max_attempts(1)
        .dead_letter(DeadLetter::Column("dead_at".into()))
        .build()
        .unwrap()
}

/// Publishes three resize rows (one dead-lettered) and two export rows.
async fn prepare_kinds<B: broker_core::Backend>(broker: &Broker<B>, t: &TableDescription)
where
    broker_core::KindRow: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
    sqlx::types::Json<Resize>: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    sqlx::types::Json<Export>: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
{
    broker.create_tables(t).await.unwrap();
    let q = broker
        .queue::<broker_core::KindRow>(t.clone())
        .await
        .unwrap();
    for image in 0..3 {
        q.enqueue(Resize { image }).await.unwrap();
    }
    for user in 0..2 {
        q.enqueue(Export { user }).await.unwrap();
    }
    let d = q.claim(1).await.unwrap().pop().unwrap();
    assert_eq!(d.payload().kind(), "resize");
    d.dead_letter().await.unwrap();
}

/// `stats`, `jobs` and `doctor` of a kinds table, described by a TOML file with a kind role
/// and by the `--kind` flag.
fn exercise_kinds(url: &str, name: &str) {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("cli-kinds"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("kinds.toml");
    std::fs::write(
        &config,
        format!(
            "[table]\nname = \"{name}\"\npayload = \"args\"\nkind = \"kind\"\n\
             locked_until = \"locked_until\"\ndue_at = \"due_at\"\nprocessed_at = \"done_at\"\n\
             last_error = \"last_error\"\nmax_attempts = 1\ndead_letter_column = \"dead_at\"\n"
        ),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_sqlx-broker"))
            .args(["--url", url, "--config"])
            .arg(&config)
            .args(args)
            .output()
            .expect("run sqlx-broker");
        assert!(o.status.success(), "{args:?}: {}{}", stdout(&o), stderr(&o));
        stdout(&o)
    };
    let out = run(&["stats"]);
    let line = |kind: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(kind))
            .unwrap_or_else(|| panic!("no line of kind {kind}: {out}"))
            .split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
    };
    assert!(out.contains("by kind"), "{out}");
    // due, scheduled, in work, retrying, dead, finished
    assert_eq!(line("export"), ["2", "0", "0", "0", "0", "0"], "{out}");
    assert_eq!(line("resize"), ["2", "0", "0", "0", "1", "0"], "{out}");
    let v: serde_json::Value = serde_json::from_str(&run(&["--json", "stats"])).unwrap();
    let kinds = v["kinds"].as_array().expect("kinds in the JSON");
    assert_eq!(kinds.len(), 2, "{v}");
    assert_eq!(kinds[1]["kind"], "resize");
    assert_eq!(kinds[1]["due"]["rows"], 2);
    assert_eq!(kinds[1]["dead"]["rows"], 1);
    assert_eq!(kinds[0]["kind"], "export");
    // Listings show each row's kind.
    let out = run(&["jobs", "due"]);
    assert!(out.lines().next().unwrap().contains("kind"), "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains("export")).count(),
        2,
        "{out}"
    );
    assert_eq!(
        out.lines().filter(|l| l.contains("resize")).count(),
        2,
        "{out}"
    );
    let out = run(&["jobs", "due", "--of-kind", "export"]);
    assert_eq!(out.lines().count(), 3, "a header and two rows: {out}");
    assert!(!out.contains("resize"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&run(&["--json", "dead", "list"])).unwrap();
    assert_eq!(v[0]["kind"], "resize", "{v}");
    // The doctor names the kind no worker knows.
    let out = run(&["doctor", "--known-kinds", "resize,thumbnail"]);
    assert!(
        out.contains("[warn] job kinds: no worker knows \"export\" (2 unfinished rows)"),
        "{out}"
    );
    let out = run(&["doctor", "--known-kinds", "resize,export"]);
    assert!(out.contains("[pass] job kinds"), "{out}");
    // The --kind flag is the kind role too (flags win over the file: here, the same roles).
    let o = cli_kinds(url, name, &["--json", "stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["kinds"].as_array().map(Vec::len), Some(2), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_shows_a_sqlite_kinds_table_by_kind() {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("cli"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/q.db", dir.display());
    let broker = broker_sqlite::SqliteBackend::connect(&url).await.unwrap();
    let t = kinds_table("kind_jobs");
    prepare_kinds(&broker, &t).await;
    // A kind written by other software, with terminal escapes in it.
    let hostile = "ev\u{1b}]0;pwned\u{7}il\n[pass] fake";
    sqlx::query("INSERT INTO kind_jobs (args, kind, attempt) VALUES ('{}', ?1, 1)")
        .bind(hostile)
        .execute(broker.pool())
        .await
        .unwrap();
    broker.close().await;
    let o = cli_kinds(&url, t.name(), &["stats"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!has_escape(&out), "{out:?}");
    assert!(out.contains("pwned") && out.contains("\\u{1b}"), "{out}");
    let o = cli_kinds(
        &url,
        t.name(),
        &["doctor", "--known-kinds", "resize,export"],
    );
    let out = stdout(&o);
    assert!(!has_escape(&out), "{out:?}");
    assert!(!out.lines().any(|l| l.starts_with("[pass] fake")), "{out}");
    assert!(out.contains("[warn] job kinds"), "{out}");
    // Take the hostile row out again for the common checks.
    let broker = broker_sqlite::SqliteBackend::connect(&url).await.unwrap();
    sqlx::query("DELETE FROM kind_jobs WHERE kind = ?1")
        .bind(hostile)
        .execute(broker.pool())
        .await
        .unwrap();
    broker.close().await;
    exercise_kinds(&url, t.name());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs the binary on a kinds table described by flags.
fn cli_kinds(url: &str, table: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sqlx-broker"))
        .args([
            "--url",
            url,
            "--table",
            table,
            "--payload",
            "args",
            "--kind",
            "kind",
            "--locked-until",
            "locked_until",
            "--due-at",
            "due_at",
            "--processed-at",
            "done_at",
            "--max-attempts",
            "1",
            "--dead-letter-column",
            "dead_at",
        ])
        .args(args)
        .output()
        .expect("run sqlx-broker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_shows_a_postgres_kinds_table_by_kind() {
    let broker = broker_postgres::PgBackend::connect(&pg_url())
        .await
        .unwrap();
    let t = kinds_table(&broker_testkit::unique_name("cli_kinds"));
    prepare_kinds(&broker, &t).await;
    exercise_kinds(&pg_url(), t.name());
    broker.drop_tables(&t).await.unwrap();
    broker.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_shows_a_mariadb_kinds_table_by_kind() {
    let broker = broker_mysql::MySqlBackend::connect(&mysql_url())
        .await
        .unwrap();
    let t = kinds_table(&broker_testkit::unique_name("cli_kinds"));
    prepare_kinds(&broker, &t).await;
    exercise_kinds(&mysql_url(), t.name());
    broker.drop_tables(&t).await.unwrap();
    broker.close().await;
}

/// `cancel` of a row in work, from the CLI's own process: the command says it signalled the
/// holder, the holder's handler sees an operator's cancel (through `NOTIFY`: its poll is longer
/// than the wait), and the row is deleted; `cancel` of a row no delivery holds still deletes
/// it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_cancels_a_running_job_through_its_holder() {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    let url = pg_url();
    let broker = broker_postgres::PgBackend::connect(&url).await.unwrap();
    let t = table(&broker_testkit::unique_name("cli"));
    broker.create_tables(&t).await.unwrap();
    let q = broker.queue::<Payload<String>>(t.clone()).await.unwrap();
    let running = q.publish(NewJob::new("runs".to_owned())).await.unwrap();
    let seen: Arc<Mutex<Option<broker_core::CancelReason>>> = Arc::default();
    let saw = seen.clone();
    let sub = q
        .subscribe(
            broker_core::SubscribeOptions::new().poll_interval(Duration::from_secs(120)),
            move |job| {
                let saw = saw.clone();
                async move {
                    let reason = job.cancelled().await;
                    *saw.lock().unwrap() = Some(reason);
                    broker_core::Outcome::Ack
                }
            },
        )
        .unwrap();
    broker_testkit::wait_until("the row in work", Duration::from_secs(30), || {
        let q = q.clone();
        async move {
            q.row_state(running)
                .await
                .unwrap()
                .is_some_and(|r| r.locked_until_ms.is_some())
        }
    })
    .await;
    let o = cli(&url, t.name(), &["cancel", &running.to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("its holder was signalled"),
        "{}",
        stdout(&o)
    );
    broker_testkit::wait_until(
        "the holder's handler signalled",
        Duration::from_secs(30),
        || {
            let got = seen.lock().unwrap().is_some();
            async move { got }
        },
    )
    .await;
    assert_eq!(
        *seen.lock().unwrap(),
        Some(broker_core::CancelReason::Cancelled)
    );
    broker_testkit::wait_until("the cancelled row deleted", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.row_state(running).await.unwrap().is_none() }
    })
    .await;
    sub.shutdown().await;
    assert_eq!(q.metrics().cancelled, 1);
    let waiting = q
        .publish(NewJob::new("waits".to_owned()).run_after(Duration::from_secs(3600)))
        .await
        .unwrap();
    let o = cli(&url, t.name(), &["cancel", &waiting.to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), format!("row {waiting} cancelled\n"));
    assert!(q.row_state(waiting).await.unwrap().is_none());
    broker.drop_tables(&t).await.unwrap();
    broker.close().await;
}

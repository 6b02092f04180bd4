//! The dashboard in a real browser (Chromium through chromedriver, from the system packages),
//! against real databases: the counts it shows are the database's, a pause clicked in it stops
//! a subscription in another broker, a dead letter requeued in it runs again, markup in a
//! payload or an error is shown as text, and a POST without its CSRF token changes nothing.
//!
//! Each test starts its own chromedriver on a free port. When the driver or the browser is
//! missing at the default paths, the first test runs `.ci/chromium.sh`, which installs both
//! from the system packages; the tests fail (they do not skip) when that cannot be done.
//! `SQLX_BROKER_CHROMEDRIVER` and `SQLX_BROKER_CHROMIUM` set the paths (then nothing is
//! installed).
//! `SQLX_BROKER_SCREENSHOT=path` writes the PostgreSQL queues page's screenshot there (the one
//! in docs/); every run writes them under the test's target directory.

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use broker_core::{
    Backend, Broker, ColumnType, DeadLetter, NewJob, Outcome, Payload, Queue, SubscribeOptions,
    TableDescription,
};
use broker_web::Dashboard;
use fantoccini::{Client, ClientBuilder, Locator};

/// Browsers at once in this binary (the machine is small and shared).
static BROWSERS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// A chromedriver we started, and a session in a fresh profile.
struct Browser {
    client: Client,
    driver: Child,
    profile: std::path::PathBuf,
    _permit: tokio::sync::SemaphorePermit<'static>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Chromium and chromedriver, installed by `.ci/chromium.sh` (once per test binary; the script
/// waits for any other package install on the machine) when they are missing at the default
/// paths, as the PgBouncer and Galera tests start theirs. Paths set by the variables are
/// the user's: missing there, they are reported, not installed. Returns the driver's and the
/// browser's paths, or why they cannot be had.
async fn browser_binaries() -> (String, String) {
    static INSTALLED: tokio::sync::OnceCell<Result<(), String>> =
        tokio::sync::OnceCell::const_new();
    let driver = std::env::var("SQLX_BROKER_CHROMEDRIVER");
    let chromium = std::env::var("SQLX_BROKER_CHROMIUM");
    let paths = [
        ("chromedriver", "SQLX_BROKER_CHROMEDRIVER", driver.clone()),
        ("chromium", "SQLX_BROKER_CHROMIUM", chromium.clone()),
    ];
    let missing = |path: &str| !std::path::Path::new(path).exists();
    for (what, var, path) in &paths {
        if let Ok(path) = path {
            assert!(
                !missing(path),
                "{what} is not at {path} ({var}): install it there, or unset {var} to have the tests install Chromium from the system packages"
            );
        }
    }
    let driver = driver.unwrap_or_else(|_| "/usr/bin/chromedriver".to_owned());
    let chromium = chromium.unwrap_or_else(|_| "/usr/bin/chromium".to_owned());
    if missing(&driver) || missing(&chromium) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../.ci/chromium.sh");
        let installed = INSTALLED
            .get_or_init(|| async move {
                eprintln!("Chromium or chromedriver is missing: running {script}");
                let status =
                    tokio::task::spawn_blocking(move || Command::new("bash").arg(script).status())
                        .await
                        .expect("the script's task");
                match status {
                    Ok(s) if s.success() => Ok(()),
                    Ok(s) => Err(format!("{script} failed ({s}; its output is above)")),
                    Err(e) => Err(format!("cannot run {script}: {e}")),
                }
            })
            .await;
        if let Err(why) = installed {
            panic!(
                "Chromium and chromedriver are missing and could not be installed: {why}. Install them (as root: apt-get install -y chromium chromium-driver), or set SQLX_BROKER_CHROMIUM and SQLX_BROKER_CHROMEDRIVER to where they are; the browser tests do not skip"
            );
        }
        for (what, path) in [("chromedriver", &driver), ("chromium", &chromium)] {
            assert!(
                !missing(path),
                "{what} is still not at {path} after {script}: install it (apt-get install -y chromium chromium-driver)"
            );
        }
    }
    (driver, chromium)
}

impl Browser {
    async fn start() -> Browser {
        let (driver_path, chromium) = browser_binaries().await;
        let permit = BROWSERS.acquire().await.expect("semaphore");
        let port = free_port();
        let driver = Command::new(&driver_path)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {driver_path}: {e}"));
        let profile = std::env::temp_dir().join(broker_testkit::unique_name("chromium-profile"));
        std::fs::create_dir_all(&profile).unwrap();
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": chromium,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--disable-dev-shm-usage", "--window-size=1280,800",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(c) => break c,
                // chromedriver is still starting.
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("cannot open a Chromium session through {driver_path}: {e}"),
            }
        };
        Browser {
            client,
            driver,
            profile,
            _permit: permit,
        }
    }

    async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }

    /// The text of the element at `css`, waiting for it. The refresh script replaces the live
    /// part of a page each refresh: an element found just before one is gone when its text is
    /// read, so it is found again (the PostgreSQL queues page failed so once in 17 runs).
    async fn text(&self, css: &str) -> String {
        for _ in 0..10 {
            match self.wait(css).await.text().await {
                Ok(text) => return text,
                Err(e) if e.is_stale_element_reference() => {}
                Err(e) => panic!("the text of {css}: {e}"),
            }
        }
        panic!("{css} was replaced before its text could be read, 10 times")
    }

    async fn wait(&self, css: &str) -> fantoccini::elements::Element {
        self.client
            .wait()
            .at_most(Duration::from_secs(30))
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no element {css}: {e}"))
    }

    async fn click(&self, css: &str) {
        self.wait(css).await.click().await.unwrap();
    }

    /// Clicks Pause in `queue`'s row of the queues page and waits until the page shows it
    /// paused.
    async fn pause(&self, queue: &str) {
        self.click(&format!("tr[data-queue=\"{queue}\"] button.pause"))
            .await;
        self.wait(&format!("tr[data-queue=\"{queue}\"] td.state .paused"))
            .await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // A failed test still ends the driver it started (and Chromium with it).
        let _ = self.driver.kill();
    }
}

/// Serves `dashboard` nested under `/admin/queues`, as a service would; returns its URL.
async fn serve(dashboard: Dashboard) -> String {
    let app: axum::Router = axum::Router::new().nest("/admin/queues", dashboard.router());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/admin/queues")
}

fn table(name: &str, max_attempts: u32) -> TableDescription {
    TableDescription::builder(name)
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .lease_seconds(30)
        .due_at("due_at")
        .processed_at("done_at")
        .last_error("last_error")
        .max_attempts(max_attempts)
        .dead_letter(DeadLetter::Column("dead_at".into()))
        .build()
        .unwrap()
}

/// Waits until `check` holds, for at most `secs` seconds.
async fn until<F: AsyncFnMut() -> bool>(secs: u64, what: &str, mut check: F) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check().await {
        assert!(Instant::now() < deadline, "not within {secs} s: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A database for one test: two brokers on it (a dashboard's and a worker's, as two processes
/// would have), and its name for screenshots.
struct Db<B: Backend> {
    name: &'static str,
    dashboard: Broker<B>,
    worker: Broker<B>,
}

async fn prepare<B: Backend>(
    db: &Db<B>,
    t: &TableDescription,
) -> (Queue<B, Payload<String>>, Queue<B, Payload<String>>)
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
{
    db.dashboard.create_tables(t).await.unwrap();
    let a = db
        .dashboard
        .queue::<Payload<String>>(t.clone())
        .await
        .unwrap();
    let b = db.worker.queue::<Payload<String>>(t.clone()).await.unwrap();
    (a, b)
}

async fn cell(browser: &Browser, queue: &str, state: &str) -> String {
    browser
        .text(&format!(
            "tr[data-queue=\"{queue}\"] td[data-state=\"{state}\"]"
        ))
        .await
}

/// Rows in every state; the queues page shows the numbers `stats()` reads, and a second, busy
/// queue draws its throughput.
async fn the_queues_page_shows_the_counts_in_the_database<B: Backend>(db: Db<B>)
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
{
    let t = table(&broker_testkit::unique_name("web_jobs"), 3);
    let busy_t = table(&broker_testkit::unique_name("web_emails"), 3);
    let (q, _) = prepare(&db, &t).await;
    let (busy, busy_worker) = prepare(&db, &busy_t).await;

    let jobs: Vec<_> = (0..6)
        .map(|i| NewJob::new(format!("{{\"n\":{i}}}")))
        .collect();
    q.publish_batch(&jobs).await.unwrap();
    for i in 0..2 {
        q.publish(NewJob::new(format!("later-{i}")).run_after(Duration::from_secs(3600)))
            .await
            .unwrap();
    }
    let mut claimed = q.claim(4).await.unwrap();
    assert_eq!(claimed.len(), 4);
    let held = claimed.remove(0); // in work until the end
    claimed.remove(0).dead_letter().await.unwrap();
    claimed.remove(0).ack().await.unwrap();
    claimed.remove(0).retry().await.unwrap();
    let s = q.stats().await.unwrap();
    let expect = [
        ("due", 3, s.due.rows),
        ("scheduled", 2, s.scheduled.rows),
        ("in-work", 1, s.in_work.rows),
        // Unfinished rows above attempt 1: the retried one, and the held one where a claim
        // counts its attempt up front.
        ("retrying", s.retrying.rows, s.retrying.rows),
        ("dead", 1, s.dead.unwrap().rows),
        ("finished", 1, s.finished.unwrap().rows),
    ];
    for (state, n, read) in expect {
        assert_eq!(read, n, "{state}: stats() itself");
    }
    assert!(s.retrying.rows >= 1);

    // A busy queue: a worker in the other broker acks what a producer trickles in.
    let sub = busy_worker
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_millis(100)),
            |_job| async { Outcome::Ack },
        )
        .unwrap();
    let producer = {
        let busy = busy.clone();
        tokio::spawn(async move {
            for i in 0..40u32 {
                let n = 1 + (i % 7);
                let jobs: Vec<_> = (0..n)
                    .map(|j| NewJob::new(format!("mail-{i}-{j}")))
                    .collect();
                busy.publish_batch(&jobs).await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let dashboard = Dashboard::new()
        .queue(q.clone())
        .queue(busy.clone())
        .sampling(Duration::from_millis(250), Duration::from_secs(60))
        .refresh(Duration::from_secs(1));
    let url = serve(dashboard).await;
    let browser = Browser::start().await;
    browser.client.goto(&url).await.unwrap();
    for (state, n, _) in expect {
        assert_eq!(
            cell(&browser, t.name(), state).await,
            n.to_string(),
            "{state} on the page"
        );
    }
    let mode = browser
        .text(&format!("tr[data-queue=\"{}\"] td:nth-child(2)", t.name()))
        .await;
    assert_eq!(mode, "lease");
    assert!(
        browser
            .text(&format!("tr[data-queue=\"{}\"] td.state", t.name()))
            .await
            .contains("running")
    );

    // The refresh script brings the chart in once the sampler has two readings.
    producer.await.unwrap();
    browser
        .wait(&format!(
            "tr[data-queue=\"{}\"] .chart svg polyline",
            busy_t.name()
        ))
        .await;
    browser.client.set_window_size(1280, 460).await.unwrap();
    let shot = browser.client.screenshot().await.unwrap();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::write(dir.join(format!("dashboard-{}.png", db.name)), &shot).unwrap();
    if db.name == "postgres"
        && let Ok(path) = std::env::var("SQLX_BROKER_SCREENSHOT")
    {
        std::fs::write(&path, &shot).unwrap();
    }
    browser.close().await;
    sub.shutdown().await;
    drop(held);
    db.dashboard.drop_tables(&t).await.unwrap();
    db.dashboard.drop_tables(&busy_t).await.unwrap();
}

/// A subscription in the other broker handles rows; Pause in the browser stops it (rows wait,
/// due), Resume starts it again.
async fn pausing_in_the_browser_stops_a_subscription_in_another_broker<B: Backend>(db: Db<B>)
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
{
    let t = table(&broker_testkit::unique_name("web_pause"), 3);
    let (q, worker_q) = prepare(&db, &t).await;
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let sub = {
        let seen = seen.clone();
        worker_q
            .subscribe(
                SubscribeOptions::new().poll_interval(Duration::from_millis(100)),
                move |job| {
                    let seen = seen.clone();
                    async move {
                        seen.lock().unwrap().insert(job.id());
                        Outcome::Ack
                    }
                },
            )
            .unwrap()
    };
    let first = q.publish(NewJob::new("before".to_owned())).await.unwrap();
    until(30, "the worker handles a row", async || {
        seen.lock().unwrap().contains(&first)
    })
    .await;

    let url = serve(Dashboard::new().queue(q.clone())).await;
    let browser = Browser::start().await;
    browser.client.goto(&url).await.unwrap();
    browser.pause(t.name()).await;
    let pause = q
        .paused()
        .await
        .unwrap()
        .expect("the click paused the queue");
    assert_eq!(pause.by, "dashboard");

    // The worker sees the pause within its poll interval; give it ten, then publish.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ids = q
        .publish_batch(&[NewJob::new("a".to_owned()), NewJob::new("b".to_owned())])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        ids.iter().all(|id| !seen.lock().unwrap().contains(id)),
        "a paused queue's subscription in another broker claimed a row"
    );
    assert_eq!(q.stats().await.unwrap().due.rows, 2);

    browser
        .click(&format!("tr[data-queue=\"{}\"] button.resume", t.name()))
        .await;
    until(30, "the worker handles the rows after resume", async || {
        let seen = seen.lock().unwrap();
        ids.iter().all(|id| seen.contains(id))
    })
    .await;
    assert!(q.paused().await.unwrap().is_none());
    browser.close().await;
    sub.shutdown().await;
    db.dashboard.drop_tables(&t).await.unwrap();
}

/// A handler fails once (an error with markup in it): the row is dead-lettered; the dead
/// letters show the error as text; Requeue selected puts it back and the worker runs it at
/// attempt 1.
async fn a_dead_letter_requeued_in_the_browser_runs_again<B: Backend>(db: Db<B>)
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
{
    let t = table(&broker_testkit::unique_name("web_dead"), 1);
    let (q, worker_q) = prepare(&db, &t).await;
    let runs = Arc::new(Mutex::new(Vec::new()));
    let sub = {
        let runs = runs.clone();
        worker_q
            .subscribe(
                SubscribeOptions::new().poll_interval(Duration::from_millis(100)),
                move |job| {
                    let runs = runs.clone();
                    async move {
                        let first = {
                            let mut runs = runs.lock().unwrap();
                            runs.push((job.id(), job.attempt()));
                            runs.len() == 1
                        };
                        if first {
                            Err("boom: <b>not bold</b>".to_owned())
                        } else {
                            Ok(Outcome::Ack)
                        }
                    }
                },
            )
            .unwrap()
    };
    let id = q.publish(NewJob::new("once".to_owned())).await.unwrap();
    until(30, "the row is dead-lettered", async || {
        q.stats().await.unwrap().dead.unwrap().rows == 1
    })
    .await;

    let url = serve(Dashboard::new().queue(q.clone())).await;
    let browser = Browser::start().await;
    browser
        .client
        .goto(&format!("{url}/queues/{}?state=dead", t.name()))
        .await
        .unwrap();
    let row = format!("tr[data-id=\"{id}\"]");
    assert_eq!(
        browser.text(&format!("{row} td.error-text")).await,
        "boom: <b>not bold</b>",
        "the last error, as text"
    );
    browser.click(&format!("{row} input[type=checkbox]")).await;
    browser.click("button[name=selected]").await;
    assert_eq!(browser.text("p.notice").await, "1 row requeued.");
    until(30, "the requeued row runs again", async || {
        runs.lock().unwrap().len() == 2
    })
    .await;
    assert_eq!(runs.lock().unwrap()[1], (id, 1), "again, at attempt 1");
    until(30, "the row is acked", async || {
        q.stats().await.unwrap().finished.unwrap().rows == 1
    })
    .await;
    browser.close().await;
    sub.shutdown().await;
    db.dashboard.drop_tables(&t).await.unwrap();
}

/// A payload of markup is shown as its text on the job page and in the listing, and its script
/// does not run.
async fn a_payload_with_markup_is_shown_as_text<B: Backend>(db: Db<B>)
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
{
    let t = table(&broker_testkit::unique_name("web_xss"), 3);
    let (q, _) = prepare(&db, &t).await;
    let payload = "<script>document.title='pwned'</script><b id=\"injected\">bold</b>";
    let id = q.publish(NewJob::new(payload.to_owned())).await.unwrap();
    let url = serve(Dashboard::new().queue(q.clone())).await;
    let browser = Browser::start().await;
    browser
        .client
        .goto(&format!("{url}/queues/{}/jobs/{id}", t.name()))
        .await
        .unwrap();
    assert_eq!(browser.text("#payload").await, payload);
    assert_eq!(browser.text("#state").await, "due");
    assert!(
        browser
            .client
            .find_all(Locator::Css("#injected"))
            .await
            .unwrap()
            .is_empty()
    );
    assert_ne!(browser.client.title().await.unwrap(), "pwned");
    browser
        .client
        .goto(&format!("{url}/queues/{}?state=due", t.name()))
        .await
        .unwrap();
    assert_eq!(
        browser
            .text(&format!("tr[data-id=\"{id}\"] code.payload-preview"))
            .await,
        payload
    );
    assert!(
        browser
            .client
            .find_all(Locator::Css("#injected"))
            .await
            .unwrap()
            .is_empty()
    );
    browser.close().await;
    db.dashboard.drop_tables(&t).await.unwrap();
}

/// The Pause form posted without its CSRF token, and with a wrong one, is refused and the
/// queue stays as it was; with its token it pauses. A read-only dashboard has no buttons and
/// refuses the POST.
async fn a_post_without_the_csrf_token_is_refused<B: Backend>(db: Db<B>)
where
    String: for<'q> sqlx::Encode<'q, B::Db> + sqlx::Type<B::Db>,
    Payload<String>: for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
{
    let t = table(&broker_testkit::unique_name("web_csrf"), 3);
    let (q, _) = prepare(&db, &t).await;
    let url = serve(Dashboard::new().queue(q.clone())).await;
    let browser = Browser::start().await;
    let form = format!("tr[data-queue=\"{}\"] form", t.name());
    for tamper in [
        "f.querySelector('input[name=csrf]').remove()",
        "f.querySelector('input[name=csrf]').value = '00'.repeat(32)",
    ] {
        browser.client.goto(&url).await.unwrap();
        browser.wait(&form).await;
        browser
            .client
            .execute(
                &format!(
                    "var f = document.querySelector('{}'); {tamper};",
                    form.replace('\'', "\\'")
                ),
                vec![],
            )
            .await
            .unwrap();
        browser.click(&format!("{form} button.pause")).await;
        // Either page: the refusal, or (were the POST let through) the queues page again.
        browser.wait("#error, td.state .paused").await;
        assert!(
            q.paused().await.unwrap().is_none(),
            "{tamper}: the queue was paused"
        );
        let error = browser.text("#error").await;
        assert!(error.contains("CSRF"), "{tamper}: {error}");
    }
    // The same form untouched pauses it.
    browser.client.goto(&url).await.unwrap();
    browser.click(&format!("{form} button.pause")).await;
    browser
        .wait(&format!("tr[data-queue=\"{}\"] td.state .paused", t.name()))
        .await;
    assert!(q.paused().await.unwrap().is_some());

    let read_only = serve(Dashboard::new().queue(q.clone()).read_only(true)).await;
    browser.client.goto(&read_only).await.unwrap();
    browser.wait(".badge").await;
    assert!(
        browser
            .client
            .find_all(Locator::Css("form"))
            .await
            .unwrap()
            .is_empty(),
        "a read-only dashboard shows no forms"
    );
    browser.close().await;
    db.dashboard.drop_tables(&t).await.unwrap();
}

/// One HTTP/1.0 GET on 127.0.0.1:`port`; the response's head and body.
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// Text between `start` and the next `end` in `s`.
fn between<'s>(s: &'s str, start: &str, end: &str) -> &'s str {
    let from = s
        .find(start)
        .unwrap_or_else(|| panic!("no {start:?} in {s}"))
        + start.len();
    &s[from..from + s[from..].find(end).unwrap()]
}

const TOKEN: &str = "browser-test-token-0123456789";

/// Signs the browser in at the dashboard's login page.
async fn sign_in(browser: &Browser, url: &str) {
    browser.client.goto(url).await.unwrap();
    browser
        .wait("input[name=token]")
        .await
        .send_keys(TOKEN)
        .await
        .unwrap();
    browser.click("form button[type=submit]").await;
    browser.wait("h1").await;
    assert_eq!(browser.text("h1").await, "Queues", "signed in");
}

/// A page on another port of the same host is same-site with the dashboard: it can plant a
/// CSRF cookie for a path under the dashboard (which the browser then sends first) and post
/// the pause form with a token the public login page gave it. The signed-in operator's browser
/// sends the session with it (SameSite=Strict lets same-site requests through); the queue must
/// stay running.
async fn a_page_on_another_port_cannot_pause_with_its_own_csrf_cookie(
    db: Db<broker_sqlite::SqliteBackend>,
) {
    let t = table(&broker_testkit::unique_name("web_toss"), 3);
    let (q, _) = prepare(&db, &t).await;
    let url = serve(
        Dashboard::new()
            .queue(q.clone())
            .bearer_token(TOKEN)
            .unwrap(),
    )
    .await;
    let port: u16 = between(&url, "127.0.0.1:", "/").parse().unwrap();

    // The attacker's pair, from the login page anyone may load.
    let login = http_get(port, "/admin/queues/login").await;
    let cookie = between(&login, "sqlx_broker_csrf=", ";").to_owned();
    let token = between(&login, r#"name="csrf" value=""#, "\"").to_owned();
    let pause = format!("{url}/queues/{}/pause", t.name());
    let page = format!(
        "<!doctype html><form method=post action=\"{pause}\"><input name=csrf value=\"{token}\"></form><script>document.forms[0].submit()</script>"
    );
    let planted = format!(
        "sqlx_broker_csrf={cookie}; Path=/admin/queues/queues/{}; SameSite=Lax",
        t.name()
    );
    let attacker: axum::Router = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let (page, planted) = (page.clone(), planted.clone());
            async move {
                (
                    [
                        (axum::http::header::SET_COOKIE, planted),
                        (axum::http::header::CONTENT_TYPE, "text/html".to_owned()),
                    ],
                    page,
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let attacker_url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, attacker).await });

    let browser = Browser::start().await;
    sign_in(&browser, &url).await;
    browser.client.goto(&attacker_url).await.unwrap();
    // Either page: the refusal, or (were the POST let through) the queues page.
    browser.wait("#error, td.state .paused").await;
    assert!(
        q.paused().await.unwrap().is_none(),
        "the page on another port paused the queue"
    );
    assert!(browser.text("#error").await.contains("refused"));
    // The operator's own form still works.
    browser.client.goto(&url).await.unwrap();
    browser
        .click(&format!("tr[data-queue=\"{}\"] button.pause", t.name()))
        .await;
    browser.wait("#error, td.state .paused").await;
    let own = q.paused().await.unwrap();
    let error = if own.is_none() {
        browser.text("#error").await
    } else {
        String::new()
    };
    browser.close().await;
    db.dashboard.drop_tables(&t).await.unwrap();
    assert!(
        own.is_some(),
        "the operator's own Pause was refused: {error}"
    );
}

/// With `secure_cookies(true)` the cookies are `Secure` and named `__Host-`: a browser keeps
/// them on `http://localhost` (a secure context), signs in, pauses, and signs out; after that
/// the dashboard sends it back to the login page.
async fn secure_cookies_sign_in_act_and_sign_out_in_a_browser(
    db: Db<broker_sqlite::SqliteBackend>,
) {
    let t = table(&broker_testkit::unique_name("web_secure"), 3);
    let (q, _) = prepare(&db, &t).await;
    let dashboard = Dashboard::new()
        .queue(q.clone())
        .bearer_token(TOKEN)
        .unwrap()
        .secure_cookies(true);
    let url = serve(dashboard).await.replacen("127.0.0.1", "localhost", 1);
    let browser = Browser::start().await;
    sign_in(&browser, &url).await;
    let names: Vec<String> = browser
        .client
        .get_all_cookies()
        .await
        .unwrap()
        .iter()
        .map(|c| {
            format!(
                "{}{}",
                c.name(),
                if c.secure() == Some(true) {
                    " secure"
                } else {
                    ""
                }
            )
        })
        .collect();
    assert!(
        names.contains(&"__Host-sqlx_broker_auth secure".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"__Host-sqlx_broker_csrf secure".to_owned()),
        "{names:?}"
    );
    browser.pause(t.name()).await;
    assert!(q.paused().await.unwrap().is_some());
    browser.click("button.signout").await;
    browser.wait("input[name=token]").await;
    browser.client.goto(&url).await.unwrap();
    browser.wait("input[name=token]").await;
    assert_eq!(browser.text("h1").await, "Sign in");
    browser.close().await;
    db.dashboard.drop_tables(&t).await.unwrap();
}

async fn sqlite() -> Db<broker_sqlite::SqliteBackend> {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("web"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/q.db", dir.display());
    Db {
        name: "sqlite",
        dashboard: broker_sqlite::SqliteBackend::connect(&url).await.unwrap(),
        worker: broker_sqlite::SqliteBackend::connect(&url).await.unwrap(),
    }
}

async fn postgres() -> Db<broker_postgres::PgBackend> {
    let url = std::env::var("SQLX_BROKER_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    Db {
        name: "postgres",
        dashboard: broker_postgres::PgBackend::connect(&url).await.unwrap(),
        worker: broker_postgres::PgBackend::connect(&url).await.unwrap(),
    }
}

async fn mariadb() -> Db<broker_mysql::MySqlBackend> {
    let url = std::env::var("SQLX_BROKER_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    Db {
        name: "mariadb",
        dashboard: broker_mysql::MySqlBackend::connect(&url).await.unwrap(),
        worker: broker_mysql::MySqlBackend::connect(&url).await.unwrap(),
    }
}

macro_rules! browser_tests {
    ($db:ident: $($case:ident),* $(,)?) => {
        mod $db {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    super::$case(super::$db().await).await;
                }
            )*
        }
    };
}

browser_tests!(sqlite:
    the_queues_page_shows_the_counts_in_the_database,
    pausing_in_the_browser_stops_a_subscription_in_another_broker,
    a_dead_letter_requeued_in_the_browser_runs_again,
    a_payload_with_markup_is_shown_as_text,
    a_post_without_the_csrf_token_is_refused,
    // Cookies and sign-in: the same on every database, so run on SQLite only.
    a_page_on_another_port_cannot_pause_with_its_own_csrf_cookie,
    secure_cookies_sign_in_act_and_sign_out_in_a_browser,
);
browser_tests!(postgres:
    the_queues_page_shows_the_counts_in_the_database,
    pausing_in_the_browser_stops_a_subscription_in_another_broker,
    a_dead_letter_requeued_in_the_browser_runs_again,
    a_payload_with_markup_is_shown_as_text,
    a_post_without_the_csrf_token_is_refused,
);
browser_tests!(mariadb:
    the_queues_page_shows_the_counts_in_the_database,
    pausing_in_the_browser_stops_a_subscription_in_another_broker,
    a_dead_letter_requeued_in_the_browser_runs_again,
    a_payload_with_markup_is_shown_as_text,
    a_post_without_the_csrf_token_is_refused,
);

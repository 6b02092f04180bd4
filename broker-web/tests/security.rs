//! Who the dashboard serves and which POSTs it takes, request by request (tower's `oneshot` on
//! the router, as a service nests it), over a real SQLite queue: the Host check, token length,
//! sessions (expiry, sign-out, the limit on failed sign-ins), cookie attributes, and the CSRF
//! token's binding to the signed-in session. What only a browser can show (the order it sends
//! cookies in, whether it keeps `__Host-` cookies) is in `browser.rs`.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode, header};
use broker_core::{ColumnType, Queue, TableDescription};
use broker_sqlite::SqliteBackend;
use broker_web::{Dashboard, DashboardError};
use tower::ServiceExt;

const TOKEN: &str = "0123456789abcdef-the-token";
const BASE: &str = "/admin/queues";

/// A SQLite queue in a file of its own.
async fn queue() -> Queue<SqliteBackend, ()> {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("web-sec"));
    std::fs::create_dir_all(&dir).unwrap();
    let broker = SqliteBackend::connect(&format!("sqlite://{}/q.db", dir.display()))
        .await
        .unwrap();
    let t = TableDescription::builder("jobs")
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .build()
        .unwrap();
    broker.create_tables(&t).await.unwrap();
    broker.queue(t).await.unwrap()
}

/// A dashboard of `q` with the bearer token, nested.
fn guarded(q: Queue<SqliteBackend, ()>) -> Router {
    app(Dashboard::new().queue(q).bearer_token(TOKEN).unwrap())
}

/// Every one of `hosts` (as the Host header of a GET of the queues page) gets `status`.
async fn answers(app: &Router, hosts: &[&str], status: StatusCode) {
    for host in hosts {
        let r = send(app, "GET", "/", host, &[], None, &[]).await;
        assert_eq!(r.status, status, "{host}: {}", r.body);
    }
}

/// The answer sends the browser to the login page.
fn sent_to_login(r: &Answer) {
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(r.location(), format!("{BASE}/login"));
}

/// The POST went through: it redirects, and the queue is paused.
async fn paused_by(r: &Answer, q: &Queue<SqliteBackend, ()>) {
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert!(q.paused().await.unwrap().is_some());
}

/// The POST was refused, and the queue runs.
async fn refused(r: &Answer, q: &Queue<SqliteBackend, ()>) {
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert_eq!(q.paused().await.unwrap(), None);
}

/// The dashboard nested where a service would put it.
fn app(d: Dashboard) -> Router {
    Router::new().nest(BASE, d.router())
}

/// A response: status, headers, body.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    /// The `name=value` of every cookie the response sets, and the whole header of each.
    fn set_cookies(&self) -> Vec<(String, String)> {
        self.headers
            .get_all(header::SET_COOKIE)
            .iter()
            .map(|v| {
                let v = v.to_str().unwrap().to_owned();
                (v.split(';').next().unwrap().to_owned(), v)
            })
            .collect()
    }

    /// The Set-Cookie header of the cookie named `name`.
    fn set_cookie(&self, name: &str) -> Option<String> {
        self.set_cookies()
            .into_iter()
            .find(|(kv, _)| kv.split_once('=').is_some_and(|(k, _)| k == name))
            .map(|(_, whole)| whole)
    }

    /// The `name=value` part of the cookie named `name`.
    fn cookie(&self, name: &str) -> String {
        self.set_cookie(name)
            .unwrap_or_else(|| panic!("no {name} cookie set: {:?}", self.headers))
            .split(';')
            .next()
            .unwrap()
            .to_owned()
    }

    /// The CSRF token of the page's first form.
    fn csrf(&self) -> String {
        let at = self
            .body
            .find(r#"name="csrf" value=""#)
            .unwrap_or_else(|| panic!("no form on the page: {}", self.body));
        let rest = &self.body[at + r#"name="csrf" value=""#.len()..];
        rest[..rest.find('"').unwrap()].to_owned()
    }

    fn location(&self) -> &str {
        self.headers
            .get(header::LOCATION)
            .map_or("", |v| v.to_str().unwrap())
    }
}

/// One request: `host` as its Host header, `cookies` as its Cookie header, a form body for a
/// POST, and further headers.
async fn send(
    app: &Router,
    method: &str,
    path: &str,
    host: &str,
    cookies: &[&str],
    form: Option<&str>,
    extra: &[(&str, &str)],
) -> Answer {
    // The queues page of a nested router is the mount path itself.
    let uri = if path == "/" {
        BASE.to_owned()
    } else {
        format!("{BASE}{path}")
    };
    let mut r = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::HOST, host);
    if !cookies.is_empty() {
        r = r.header(header::COOKIE, cookies.join("; "));
    }
    for (k, v) in extra {
        r = r.header(*k, *v);
    }
    let body = match form {
        Some(f) => {
            r = r.header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
            Body::from(f.to_owned())
        }
        None => Body::empty(),
    };
    let response = app.clone().oneshot(r.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

const LOCAL: &str = "127.0.0.1:8080";

/// A GET from 127.0.0.1 with `cookies`.
async fn get(app: &Router, path: &str, cookies: &[&str]) -> Answer {
    send(app, "GET", path, LOCAL, cookies, None, &[]).await
}

/// The queue's Pause form posted from 127.0.0.1 with `cookies`.
async fn pause(app: &Router, cookies: &[&str], form: &str) -> Answer {
    post(app, "/queues/jobs/pause", cookies, form).await
}

/// A form POST from 127.0.0.1 with `cookies`.
async fn post(app: &Router, path: &str, cookies: &[&str], form: &str) -> Answer {
    send(app, "POST", path, LOCAL, cookies, Some(form), &[]).await
}

/// Signs in at the login page as a browser would; returns its CSRF cookie and session cookie.
async fn sign_in(app: &Router, names: (&str, &str)) -> (String, String) {
    let form = send(app, "GET", "/login", LOCAL, &[], None, &[]).await;
    let csrf = form.cookie(names.0);
    let body = format!("csrf={}&token={TOKEN}", form.csrf());
    let done = send(app, "POST", "/login", LOCAL, &[&csrf], Some(&body), &[]).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    (csrf, done.cookie(names.1))
}

const PLAIN: (&str, &str) = ("sqlx_broker_csrf", "sqlx_broker_auth");

#[tokio::test]
async fn an_open_dashboard_answers_only_to_loopback_and_allowed_host_names() {
    let q = queue().await;
    let open = app(Dashboard::new().queue(q.clone()));
    // What the tester did: a page whose name points at 127.0.0.1 reads the dashboard, takes its
    // token and cookie, and pauses the queue.
    let rebound = send(&open, "GET", "/", "attacker.example", &[], None, &[]).await;
    assert_eq!(rebound.status, StatusCode::FORBIDDEN, "{}", rebound.body);
    assert!(rebound.body.contains("allowed_hosts"), "{}", rebound.body);
    assert!(
        rebound.set_cookie(PLAIN.0).is_none(),
        "no CSRF cookie for it"
    );
    let page = get(&open, "/", &[]).await;
    let (csrf, token) = (page.cookie(PLAIN.0), page.csrf());
    let form = format!("csrf={token}");
    let pause = send(
        &open,
        "POST",
        "/queues/jobs/pause",
        "attacker.example:8080",
        &[&csrf],
        Some(&form),
        &[],
    )
    .await;
    assert_eq!(pause.status, StatusCode::FORBIDDEN, "{}", pause.body);
    assert_eq!(q.paused().await.unwrap(), None);

    let loopback = [
        "localhost",
        "LOCALHOST:8080",
        "localhost.",
        "app.localhost:1",
        "127.0.0.1",
        "127.1.2.3:80",
        "[::1]:8080",
    ];
    answers(&open, &loopback, StatusCode::OK).await;
    let others = [
        "10.0.0.7",
        "0.0.0.0:8080",
        "localhost.attacker.example",
        "[::]",
    ];
    answers(&open, &others, StatusCode::FORBIDDEN).await;

    // Names given to it are served, in any case, with any port.
    let listed = app(Dashboard::new()
        .queue(q.clone())
        .allowed_hosts(["Queues.Example.", "[fd00::1]"]));
    let given = [
        "queues.example:8443",
        "QUEUES.example",
        "[fd00::1]:80",
        "localhost",
    ];
    answers(&listed, &given, StatusCode::OK).await;
    answers(&listed, &["other.example"], StatusCode::FORBIDDEN).await;

    // With a token every name is served (a rebound page has no session), unless a list is given.
    let guarded = guarded(q.clone());
    let r = send(&guarded, "GET", "/login", "queues.example", &[], None, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    let guarded_listed = app(Dashboard::new()
        .queue(q)
        .bearer_token(TOKEN)
        .unwrap()
        .allowed_hosts(["queues.example"]));
    let r = send(
        &guarded_listed,
        "GET",
        "/login",
        "other.example",
        &[],
        None,
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
}

#[test]
fn a_token_shorter_than_16_bytes_is_refused() {
    for short in ["", "s3cret", "fifteen-bytes!!"] {
        let e = Dashboard::new().bearer_token(short).unwrap_err();
        assert_eq!(e, DashboardError::TokenTooShort { len: short.len() });
        assert!(e.to_string().contains("at least 16 bytes"), "{e}");
    }
    assert!(Dashboard::new().bearer_token("sixteen-bytes-ok").is_ok());
    assert!(broker_web::check_token("").is_err());
}

/// The CSRF pair of an anonymous visitor (from the public login page) does not work for a
/// signed-in operator's session, even when the operator's browser sends that pair's cookie.
#[tokio::test]
async fn a_csrf_pair_from_the_login_page_does_not_act_for_a_signed_in_operator() {
    let q = queue().await;
    let app = guarded(q.clone());
    let (_, session) = sign_in(&app, PLAIN).await;

    // The attacker's pair: the login page hands one to anyone.
    let theirs = get(&app, "/login", &[]).await;
    let (their_cookie, their_token) = (theirs.cookie(PLAIN.0), theirs.csrf());
    let form = format!("csrf={their_token}");
    let r = pause(&app, &[&their_cookie, &session], &form).await;
    refused(&r, &q).await;
    assert!(r.body.contains("CSRF"), "{}", r.body);

    // The operator's own page, with the same cookie, gives a token that works.
    let page = get(&app, "/", &[&their_cookie, &session]).await;
    let form = format!("csrf={}", page.csrf());
    let r = pause(&app, &[&their_cookie, &session], &form).await;
    paused_by(&r, &q).await;
}

#[tokio::test]
async fn a_post_with_two_csrf_cookies_is_refused() {
    let q = queue().await;
    let app = guarded(q.clone());
    let (csrf, session) = sign_in(&app, PLAIN).await;
    let page = get(&app, "/", &[&csrf, &session]).await;
    let form = format!("csrf={}", page.csrf());
    let planted = format!("{}={}", PLAIN.0, "ab".repeat(32));
    // The browser sends the cookie with the longer Path first: here, the dashboard's own.
    let r = pause(&app, &[&csrf, &planted, &session], &form).await;
    refused(&r, &q).await;
    assert!(r.body.contains("2 sqlx_broker_csrf cookies"), "{}", r.body);
    // The answer deletes the planted cookie wherever it can sit (not the dashboard's own
    // path) and sets a new one of the dashboard's.
    let set = r.set_cookies();
    for path in [
        "/",
        "/admin",
        "/admin/queues/queues/jobs",
        "/admin/queues/queues/jobs/pause",
    ] {
        assert!(
            set.iter()
                .any(|(_, v)| v == &format!("{}=; Path={path}; Max-Age=0", PLAIN.0)),
            "{path}: {set:?}"
        );
    }
    assert!(
        !set.iter()
            .any(|(_, v)| v.contains(&format!("Path={BASE};")) && v.contains("Max-Age=0")),
        "{set:?}"
    );
    assert!(
        set.iter()
            .any(|(kv, v)| kv.len() > PLAIN.0.len() + 1 && v.contains(&format!("Path={BASE};"))),
        "{set:?}"
    );
}

#[tokio::test]
async fn a_post_the_browser_says_came_from_another_origin_is_refused() {
    let q = queue().await;
    let app = app(Dashboard::new().queue(q.clone()));
    let page = get(&app, "/", &[]).await;
    let (csrf, form) = (page.cookie(PLAIN.0), format!("csrf={}", page.csrf()));
    for site in ["same-site", "cross-site"] {
        let r = send(
            &app,
            "POST",
            "/queues/jobs/pause",
            LOCAL,
            &[&csrf],
            Some(&form),
            &[("sec-fetch-site", site)],
        )
        .await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{site}: {}", r.body);
        assert!(r.body.contains(site), "{}", r.body);
    }
    assert_eq!(q.paused().await.unwrap(), None);
    let r = send(
        &app,
        "POST",
        "/queues/jobs/pause",
        LOCAL,
        &[&csrf],
        Some(&form),
        &[("sec-fetch-site", "same-origin")],
    )
    .await;
    paused_by(&r, &q).await;
}

#[tokio::test]
async fn cookies_expire_and_are_secure_with_host_names_when_asked() {
    let q = queue().await;
    let plain = guarded(q.clone());
    let form = get(&plain, "/login", &[]).await;
    let csrf = form.set_cookie(PLAIN.0).unwrap();
    assert!(
        csrf.contains(&format!("Path={BASE};")) && !csrf.contains("Secure"),
        "{csrf}"
    );
    let body = format!("csrf={}&token={TOKEN}", form.csrf());
    let done = post(&plain, "/login", &[&form.cookie(PLAIN.0)], &body).await;
    let auth = done.set_cookie(PLAIN.1).unwrap();
    for part in [
        &format!("Path={BASE}"),
        "HttpOnly",
        "SameSite=Strict",
        "Max-Age=28800",
    ] {
        assert!(auth.contains(part), "{part} in {auth}");
    }

    let secure = app(Dashboard::new()
        .queue(q)
        .bearer_token(TOKEN)
        .unwrap()
        .secure_cookies(true)
        .session_lifetime(Duration::from_secs(3600)));
    let names = ("__Host-sqlx_broker_csrf", "__Host-sqlx_broker_auth");
    let form = get(&secure, "/login", &[]).await;
    let csrf = form.set_cookie(names.0).unwrap();
    assert!(
        csrf.contains("Path=/;") && csrf.ends_with("; Secure"),
        "{csrf}"
    );
    // A cookie without the prefix is not the dashboard's once it is secure.
    let body = format!("csrf={}&token={TOKEN}", form.csrf());
    let unprefixed = form.cookie(names.0).replacen("__Host-", "", 1);
    let r = post(&secure, "/login", &[&unprefixed], &body).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let done = post(&secure, "/login", &[&form.cookie(names.0)], &body).await;
    let auth = done.set_cookie(names.1).unwrap();
    let page = get(&secure, "/", &[&done.cookie(names.1)]).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    for part in ["Path=/;", "HttpOnly", "Max-Age=3600", "Secure"] {
        assert!(auth.contains(part), "{part} in {auth}");
    }
}

#[tokio::test]
async fn a_session_past_its_lifetime_no_longer_signs_in() {
    let q = queue().await;
    let app = app(Dashboard::new()
        .queue(q)
        .bearer_token(TOKEN)
        .unwrap()
        .session_lifetime(Duration::from_secs(1)));
    let (_, session) = sign_in(&app, PLAIN).await;
    // Whole seconds: a session of 1 s has ended 2 s later, whenever it started in its second.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    sent_to_login(&get(&app, "/", &[&session]).await);
}

#[tokio::test]
async fn signing_out_ends_the_session_on_the_server() {
    let q = queue().await;
    let app = guarded(q);
    let (csrf, session) = sign_in(&app, PLAIN).await;
    let page = get(&app, "/", &[&csrf, &session]).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains("Sign out"), "{}", page.body);
    let form = format!("csrf={}", page.csrf());
    let out = post(&app, "/logout", &[&csrf, &session], &form).await;
    sent_to_login(&out);
    let cleared = out.set_cookie(PLAIN.1).unwrap();
    assert!(cleared.contains("Max-Age=0"), "{cleared}");
    // A copy of the cookie kept from before (stolen, or a browser that ignored the deletion).
    sent_to_login(&get(&app, "/", &[&csrf, &session]).await);
}

#[tokio::test]
async fn failed_sign_ins_are_limited_for_the_whole_dashboard() {
    let q = queue().await;
    let app = guarded(q);
    let form = get(&app, "/login", &[]).await;
    let csrf = form.cookie(PLAIN.0);
    let token = form.csrf();
    for i in 0..10 {
        let body = format!("csrf={token}&token=guess-number-{i:04}");
        let r = post(&app, "/login", &[&csrf], &body).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "attempt {i}");
    }
    // The right token now waits too: it is not even compared.
    let body = format!("csrf={token}&token={TOKEN}");
    let r = post(&app, "/login", &[&csrf], &body).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    assert!(r.set_cookie(PLAIN.1).is_none());
    let wait: u64 = r.headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    // API clients with the token in the header are not locked out.
    let auth = format!("Bearer {TOKEN}");
    let r = send(
        &app,
        "GET",
        "/",
        LOCAL,
        &[],
        None,
        &[("authorization", &auth)],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
}

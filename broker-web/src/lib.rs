//! A web dashboard for sqlx-broker queues: an axum [`Router`] that a service mounts under a path
//! of its choosing, or that `sqlx-broker web` serves on its own.
//!
//! - **Queues**: each queue's rows by state (due, scheduled, in work, retrying, dead, finished),
//!   its lag, its throughput over the last minutes (drawn on the server as a small SVG), and
//!   whether it is paused, with pause and resume.
//! - **Rows and dead letters**: rows by state a page at a time; dead letters with their attempt
//!   and last error, requeued or discarded one at a time, a selection, or all (after a
//!   confirmation page).
//! - **A job page**: payload (cut at 4 KiB), attempt, due time, lease, state, last error, and
//!   the actions the row's state allows.
//!
//! Pages are rendered on the server ([maud](https://docs.rs/maud), which escapes every value:
//! a payload holding `<script>` is shown as text); the only script refreshes the live part of a
//! page. Every action is a POST carrying a CSRF token, checked before any handler runs.
//!
//! **The dashboard must sit behind authentication**: anyone who reaches it can requeue, discard,
//! cancel and pause. Give it a bearer token ([`Dashboard::bearer_token`], at least 16 bytes),
//! or your application's own check ([`Dashboard::authorize`]), or put it behind a proxy that
//! authenticates, or make it [`read_only`](Dashboard::read_only). Without authentication it
//! answers only to loopback host names and those given to [`Dashboard::allowed_hosts`]. Behind
//! a proxy that serves it over HTTPS, set [`Dashboard::secure_cookies`].
//!
//! ```no_run
//! # async fn run(queue: broker_core::Queue<impl broker_core::Backend, ()>) {
//! use broker_web::Dashboard;
//! let dashboard = Dashboard::new()
//!     .queue(queue.clone())
//!     .bearer_token(std::env::var("DASHBOARD_TOKEN").unwrap())
//!     .expect("a token of at least 16 bytes");
//! let app: axum::Router = axum::Router::new()
//!     // ... the service's own routes ...
//!     .nest("/admin/queues", dashboard.router());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```
//!
//! It works on every database and claim mode that `broker-core`'s operations API does
//! (PostgreSQL, MySQL/MariaDB and SQLite; row lock, lease and advisory), since it calls nothing
//! else. See `docs/dashboard.md` for the pages, the security model and the CLI.

mod chart;
mod pages;
mod queue;
mod routes;
mod security;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::Router;
use axum::http::request::Parts;
use axum::routing::{get, post};
use broker_core::{Backend, Queue};

use crate::chart::Series;
use crate::queue::AnyQueue;
use crate::security::{Cookies, LoginLimit, Revoked};

pub use crate::security::{MIN_TOKEN_BYTES, check_token};

/// A dashboard setting that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DashboardError {
    /// The bearer token is shorter than [`MIN_TOKEN_BYTES`].
    #[error(
        "the bearer token is {len} bytes long, and the dashboard takes one of at least {MIN_TOKEN_BYTES} bytes: make a random one, e.g. `openssl rand -hex 32`"
    )]
    TokenTooShort {
        /// The length of the token given, in bytes.
        len: usize,
    },
}

/// The name of whoever a request comes from, as the host application's
/// [`authorize`](Dashboard::authorize) hook tells it; the dashboard records it as who paused a
/// queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator(pub String);

type Hook = dyn Fn(&Parts) -> Option<Operator> + Send + Sync;

/// How requests are authenticated.
enum Auth {
    None,
    Bearer(String),
    Hook(Box<Hook>),
}

/// A dashboard over some queues, built into a [`Router`] by [`router`](Self::router).
pub struct Dashboard {
    queues: Vec<Arc<dyn AnyQueue>>,
    auth: Auth,
    allowed_hosts: Vec<String>,
    secure_cookies: bool,
    session: Duration,
    read_only: bool,
    sample_every: Duration,
    window: Duration,
    refresh: Duration,
}

impl std::fmt::Debug for Dashboard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dashboard")
            .field(
                "queues",
                &self
                    .queues
                    .iter()
                    .map(|q| q.table().name())
                    .collect::<Vec<_>>(),
            )
            .field("allowed_hosts", &self.allowed_hosts)
            .field("secure_cookies", &self.secure_cookies)
            .field("session", &self.session)
            .field("read_only", &self.read_only)
            .field("sample_every", &self.sample_every)
            .finish_non_exhaustive()
    }
}

impl Default for Dashboard {
    fn default() -> Self {
        Self::new()
    }
}

impl Dashboard {
    /// A dashboard with no queues, no authentication (see [`bearer_token`](Self::bearer_token)
    /// and [`authorize`](Self::authorize)), so answering only to loopback host names, actions
    /// on, cookies without `Secure`, sign-ins that last 8 hours, a reading of every queue each
    /// 10 s kept for 15 minutes, and pages that refresh every 5 s.
    pub fn new() -> Self {
        Self {
            queues: Vec::new(),
            auth: Auth::None,
            allowed_hosts: Vec::new(),
            secure_cookies: false,
            session: Duration::from_secs(8 * 3600),
            read_only: false,
            sample_every: Duration::from_secs(10),
            window: Duration::from_secs(15 * 60),
            refresh: Duration::from_secs(5),
        }
    }

    /// Shows `queue` (of any backend and row type). Queues are listed by table name; a second
    /// queue on a table already shown replaces the first.
    pub fn queue<B: Backend, T: 'static>(mut self, queue: Queue<B, T>) -> Self {
        self.queues
            .retain(|q| q.table().name() != queue.table().name());
        self.queues.push(Arc::new(queue));
        self.queues
            .sort_by(|a, b| a.table().name().cmp(b.table().name()));
        self
    }

    /// Shows the queues and the rows, and refuses every action (and hides their buttons).
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Requires `Authorization: Bearer <token>` on every request, or a browser signed in with
    /// the token through the dashboard's login page (which sets an `HttpOnly` cookie that
    /// expires after [`session_lifetime`](Self::session_lifetime)). Replaces an
    /// [`authorize`](Self::authorize) hook.
    ///
    /// Refuses a token shorter than [`MIN_TOKEN_BYTES`] (16): an empty one would let anyone
    /// sign in. Make it random (`openssl rand -hex 32`).
    pub fn bearer_token(mut self, token: impl Into<String>) -> Result<Self, DashboardError> {
        let token = token.into();
        check_token(&token)?;
        self.auth = Auth::Bearer(token);
        Ok(self)
    }

    /// Host names (without port) the dashboard answers to besides the loopback ones
    /// (`localhost`, `*.localhost`, 127.0.0.0/8, `[::1]`), compared without case. Without
    /// authentication no other name is served (403): a page on another site could otherwise
    /// point its own name at 127.0.0.1 (DNS rebinding) and use the dashboard as its own. With
    /// authentication, a list given here is enforced too; without one, every name is served.
    pub fn allowed_hosts<I, S>(mut self, hosts: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.allowed_hosts.extend(hosts.into_iter().map(|h| {
            let h: String = h.into();
            let h = h.trim();
            h.strip_prefix('[')
                .and_then(|v6| v6.strip_suffix(']'))
                .unwrap_or(h)
                .trim_end_matches('.')
                .to_ascii_lowercase()
        }));
        self
    }

    /// Marks the cookies `Secure` and names them with the `__Host-` prefix (which also scopes
    /// them to `Path=/`), for a dashboard served over HTTPS, by itself or by a proxy that
    /// terminates TLS in front of it. The browser then never sends them over plain HTTP, and
    /// refuses such a cookie set by a plain-HTTP page or for a narrower path. Off by default:
    /// a browser drops `Secure` cookies on plain HTTP to any host but localhost.
    pub fn secure_cookies(mut self, secure: bool) -> Self {
        self.secure_cookies = secure;
        self
    }

    /// How long a sign-in at the login page lasts (8 hours by default), in whole seconds, at
    /// least one: the cookie's `Max-Age`, and the expiry the dashboard checks itself.
    pub fn session_lifetime(mut self, lifetime: Duration) -> Self {
        self.session = Duration::from_secs(lifetime.as_secs().max(1));
        self
    }

    /// Asks the host application about every request: `hook` returns who is asking, or `None`
    /// to refuse it (403). A hook reads the request's headers and extensions, so an
    /// application whose own middleware (`Router::layer` on the router this returns, or on
    /// the router it is nested in) authenticated the user and stored it in the extensions
    /// answers from there. Replaces a [`bearer_token`](Self::bearer_token).
    pub fn authorize<F>(mut self, hook: F) -> Self
    where
        F: Fn(&Parts) -> Option<Operator> + Send + Sync + 'static,
    {
        self.auth = Auth::Hook(Box::new(hook));
        self
    }

    /// Reads every queue's counts each `every` (at least 100 ms; 10 s by default) for the
    /// throughput chart, and keeps `window` of readings (15 minutes by default). Each reading is
    /// one `stats()` statement per queue.
    pub fn sampling(mut self, every: Duration, window: Duration) -> Self {
        self.sample_every = every.max(Duration::from_millis(100));
        self.window = window.max(self.sample_every * 2);
        self
    }

    /// How often a page refreshes its live part (5 s by default; zero turns refreshing off).
    pub fn refresh(mut self, every: Duration) -> Self {
        self.refresh = every;
        self
    }

    /// The dashboard's routes, to serve or to nest under a path (`Router::nest("/queues",
    /// dashboard.router())`); links follow the path it is nested at. The sampler for the
    /// throughput charts starts with the first request and stops when the router is dropped.
    pub fn router<S: Clone + Send + Sync + 'static>(self) -> Router<S> {
        let inner = Arc::new(Inner {
            queues: self.queues,
            auth: self.auth,
            allowed_hosts: self.allowed_hosts,
            cookies: Cookies {
                secure: self.secure_cookies,
            },
            session: self.session,
            revoked: Revoked::default(),
            login_limit: LoginLimit::default(),
            read_only: self.read_only,
            secret: security::random(),
            sample_every: self.sample_every,
            window: self.window,
            refresh: self.refresh,
            series: Mutex::new(HashMap::new()),
            sampler: std::sync::Once::new(),
        });
        Router::new()
            .route("/", get(routes::queues))
            .route("/queues/{queue}", get(routes::queue))
            .route("/queues/{queue}/jobs/{id}", get(routes::job))
            .route("/queues/{queue}/pause", post(routes::pause))
            .route("/queues/{queue}/resume", post(routes::resume))
            .route("/queues/{queue}/dead/requeue", post(routes::requeue))
            .route("/queues/{queue}/dead/discard", post(routes::discard))
            .route("/queues/{queue}/jobs/{id}/cancel", post(routes::cancel))
            .route("/queues/{queue}/jobs/{id}/run-now", post(routes::run_now))
            .route("/login", get(routes::login_form).post(routes::login))
            .route("/logout", post(routes::logout))
            .route("/assets/style.css", get(routes::style))
            .route("/assets/refresh.js", get(routes::script))
            .fallback(routes::not_found)
            .layer(axum::middleware::from_fn_with_state(
                inner.clone(),
                security::guard,
            ))
            .with_state(inner)
    }
}

/// The dashboard's state, shared by its routes.
pub(crate) struct Inner {
    queues: Vec<Arc<dyn AnyQueue>>,
    auth: Auth,
    /// Host names served besides the loopback ones, lowercase.
    allowed_hosts: Vec<String>,
    cookies: Cookies,
    /// How long a sign-in lasts.
    session: Duration,
    /// Sessions signed out before they expired.
    revoked: Revoked,
    login_limit: LoginLimit,
    read_only: bool,
    secret: [u8; 32],
    sample_every: Duration,
    window: Duration,
    refresh: Duration,
    series: Mutex<HashMap<String, Series>>,
    sampler: std::sync::Once,
}

impl Inner {
    fn find(&self, name: &str) -> Option<&Arc<dyn AnyQueue>> {
        self.queues.iter().find(|q| q.table().name() == name)
    }

    fn window_ms(&self) -> i64 {
        i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX)
    }

    /// Starts the sampler once, in the runtime that serves the first request.
    fn start_sampler(self: &Arc<Self>) {
        self.sampler.call_once(|| {
            let weak = Arc::downgrade(self);
            tokio::spawn(sample(weak, self.sample_every));
        });
    }
}

/// Reads every queue each `every` until the dashboard is gone.
async fn sample(dashboard: Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(d) = dashboard.upgrade() else { return };
        for q in &d.queues {
            match q.stats().await {
                Ok(stats) => {
                    let metrics = q.metrics();
                    let mut series = d.series.lock().unwrap_or_else(|e| e.into_inner());
                    series
                        .entry(stats.table.clone())
                        .or_insert_with(Series::new)
                        .record(&stats, &metrics, d.window_ms());
                }
                Err(e) => {
                    tracing::warn!(table = q.table().name(), error = %broker_core::redact_passwords(&e.to_string()), "dashboard: reading the queue for its chart failed");
                }
            }
        }
    }
}

//! The handlers: pages (GET) and actions (POST, whose CSRF token the guard checked already).
//! An action answers with a redirect to the page it came from (a fixed choice, never a URL
//! from the request) and a notice, or with a page saying why it was refused.

use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use broker_core::{Cancelled, DeadLetters, JobState, Page, SqlxBrokerError};

use crate::Inner;
use crate::pages::{self, Listed, QueueView, seg};
use crate::queue::AnyQueue;
use crate::security::{Ctx, Session, form_fields, sign};

/// Rows per page of a listing.
const PAGE_ROWS: usize = 50;

fn html(m: maud::Markup) -> Response {
    Html(m.into_string()).into_response()
}

fn window_min(d: &Inner) -> u64 {
    d.window.as_secs().div_ceil(60)
}

fn series(d: &Inner, name: &str) -> Option<crate::chart::Series> {
    d.series
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned()
}

/// An error as a page shows it: without the password of any URL it quotes.
fn shown(e: &SqlxBrokerError) -> String {
    broker_core::redact_passwords(&e.to_string())
}

/// The status and message of a refused or failed operation.
fn failure(ctx: &Ctx, e: &SqlxBrokerError) -> Response {
    let status = match e {
        SqlxBrokerError::RowNotFound { .. } => StatusCode::NOT_FOUND,
        SqlxBrokerError::RowInWork { .. } | SqlxBrokerError::Refused { .. } => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    pages::error_page(ctx, status, &shown(e))
}

fn no_queue(ctx: &Ctx, name: &str) -> Response {
    pages::error_page(
        ctx,
        StatusCode::NOT_FOUND,
        &format!("no queue \"{name}\" on this dashboard"),
    )
}

fn lookup<'d>(d: &'d Inner, ctx: &Ctx, name: &str) -> Result<&'d Arc<dyn AnyQueue>, Box<Response>> {
    d.find(name).ok_or_else(|| Box::new(no_queue(ctx, name)))
}

/// The query of a queue page.
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct QueueQuery {
    state: Option<String>,
    after: Option<i64>,
    done: Option<String>,
    n: Option<u64>,
    /// Only rows of this kind (a kinds table).
    kind: Option<String>,
}

/// GET `/`: every queue.
pub(crate) async fn queues(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    d.start_sampler();
    let mut listed = Vec::with_capacity(d.queues.len());
    for q in &d.queues {
        let name = q.table().name().to_owned();
        listed.push(Listed {
            stats: q.stats().await.map_err(|e| shown(&e)),
            series: series(&d, &name),
            name,
        });
    }
    html(pages::queues(&ctx, d.refresh, window_min(&d), &listed))
}

/// GET `/queues/{queue}`: a queue's counts and its rows in one state.
pub(crate) async fn queue(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path(name): Path<String>,
    Query(query): Query<QueueQuery>,
) -> Response {
    d.start_sampler();
    let q = match lookup(&d, &ctx, &name) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    let stats = q.stats().await.map_err(|e| shown(&e));
    let listable = pages::states(q.table());
    let state = match query.state.as_deref().map(str::parse::<JobState>) {
        Some(Ok(s)) if listable.contains(&s) => s,
        Some(Ok(s)) => {
            return pages::error_page(
                &ctx,
                StatusCode::BAD_REQUEST,
                &format!("the table keeps no {s} rows"),
            );
        }
        Some(Err(e)) => return pages::error_page(&ctx, StatusCode::BAD_REQUEST, &e),
        None => match &stats {
            Ok(s) if s.dead.is_some_and(|c| c.rows > 0) => JobState::Dead,
            _ => JobState::Due,
        },
    };
    let page = Page {
        after: query.after,
        limit: PAGE_ROWS,
    };
    let kind = query.kind.filter(|_| q.table().kind().is_some());
    let rows = match &kind {
        Some(k) => q.jobs_of_kind(state, k.clone(), page).await,
        None => q.jobs(state, page).await,
    }
    .map_err(|e| shown(&e));
    let next_after = match &rows {
        Ok(r) if r.len() == PAGE_ROWS => r.last().map(|j| j.id),
        _ => None,
    };
    let view = QueueView {
        table: q.table(),
        stats,
        series: series(&d, &name),
        state,
        rows,
        next_after,
        kind,
        notice: pages::notice(query.done.as_deref(), query.n),
    };
    html(pages::queue(&ctx, d.refresh, window_min(&d), &view))
}

/// GET `/queues/{queue}/jobs/{id}`: one row.
pub(crate) async fn job(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path((name, id)): Path<(String, i64)>,
    Query(query): Query<QueueQuery>,
) -> Response {
    let q = match lookup(&d, &ctx, &name) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    let notice = pages::notice(query.done.as_deref(), query.n);
    match q.job(id).await {
        Ok(Some(j)) => html(pages::job(&ctx, q.table(), &j, notice)),
        Ok(None) => pages::error_page(
            &ctx,
            StatusCode::NOT_FOUND,
            &format!("table \"{name}\" has no row {id}"),
        ),
        Err(e) => failure(&ctx, &e),
    }
}

/// Where an action returns: the queues page, the queue's page (a state tab), or a row's page.
fn back(
    ctx: &Ctx,
    fields: &[(String, String)],
    name: &str,
    id: Option<i64>,
    notice: &str,
) -> Response {
    let to = fields
        .iter()
        .find(|(k, _)| k == "back")
        .map(|(_, v)| v.as_str());
    let queue = ctx.url(&format!("/queues/{}", seg(name)));
    let url = match (to, id) {
        (Some("home"), _) => format!("{}?{notice}", ctx.home()),
        (Some("job"), Some(id)) => format!("{queue}/jobs/{id}?{notice}"),
        (Some("dead"), _) => format!("{queue}?state=dead&{notice}"),
        _ => format!("{queue}?{notice}"),
    };
    Redirect::to(&url).into_response()
}

/// POST `/queues/{queue}/pause`.
pub(crate) async fn pause(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let q = match lookup(&d, &ctx, &name) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    match q.pause(ctx.operator.clone()).await {
        Ok(()) => back(&ctx, &form_fields(&body), &name, None, "done=paused"),
        Err(e) => failure(&ctx, &e),
    }
}

/// POST `/queues/{queue}/resume`.
pub(crate) async fn resume(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let q = match lookup(&d, &ctx, &name) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    match q.resume().await {
        Ok(()) => back(&ctx, &form_fields(&body), &name, None, "done=resumed"),
        Err(e) => failure(&ctx, &e),
    }
}

/// Requeue or discard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeadOp {
    Requeue,
    Discard,
}

async fn dead_letters(d: &Inner, ctx: &Ctx, name: &str, body: &[u8], op: DeadOp) -> Response {
    let q = match lookup(d, ctx, name) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    let fields = form_fields(body);
    let has = |k: &str, v: &str| fields.iter().any(|(fk, fv)| fk == k && fv == v);
    let mut ids = Vec::new();
    for (k, v) in &fields {
        if k == "id" {
            match v.parse::<i64>() {
                Ok(id) => ids.push(id),
                Err(_) => {
                    return pages::error_page(
                        ctx,
                        StatusCode::BAD_REQUEST,
                        &format!("\"{v}\" is not a row id"),
                    );
                }
            }
        }
    }
    let verb = if op == DeadOp::Requeue {
        "requeue"
    } else {
        "discard"
    };
    let which = if has("all", "1") {
        if !has("confirm", "yes") {
            let dead = q.stats().await.ok().and_then(|s| s.dead);
            return html(pages::confirm_all(ctx, name, verb, dead));
        }
        DeadLetters::All
    } else if ids.is_empty() {
        return pages::error_page(
            ctx,
            StatusCode::BAD_REQUEST,
            &format!("nothing to {verb}: select at least one dead letter"),
        );
    } else {
        DeadLetters::Ids(ids.clone())
    };
    let result = match op {
        DeadOp::Requeue => q.requeue_dead(which).await,
        DeadOp::Discard => q.discard_dead(which).await,
    };
    match result {
        Ok(n) => {
            let done = if op == DeadOp::Requeue {
                "requeued"
            } else {
                "discarded"
            };
            let notice = format!("done={done}&n={n}");
            // A requeued row still exists: its page shows it due; a discarded one is gone.
            let single = (ids.len() == 1 && op == DeadOp::Requeue).then(|| ids[0]);
            let mut fields = fields.clone();
            if single.is_none() || !has("back", "job") {
                fields.retain(|(k, _)| k != "back");
                fields.push(("back".into(), "dead".into()));
            }
            back(ctx, &fields, name, single, &notice)
        }
        Err(e) => failure(ctx, &e),
    }
}

/// POST `/queues/{queue}/dead/requeue`: `id` fields, or `all=1` (then `confirm=yes`).
pub(crate) async fn requeue(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    dead_letters(&d, &ctx, &name, &body, DeadOp::Requeue).await
}

/// POST `/queues/{queue}/dead/discard`: as requeue.
pub(crate) async fn discard(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    dead_letters(&d, &ctx, &name, &body, DeadOp::Discard).await
}

/// POST `/queues/{queue}/jobs/{id}/cancel`: deletes a row no delivery holds; a row in work is
/// cancelled through its holder, and the page says the holder was signalled.
pub(crate) async fn cancel(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path((name, id)): Path<(String, i64)>,
) -> Response {
    let q = match lookup(&d, &ctx, &name) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    match q.cancel(id).await {
        Ok(Cancelled::Removed) => back(&ctx, &[], &name, None, "done=cancelled"),
        Ok(_) => back(&ctx, &[], &name, None, "done=cancel-signalled"),
        Err(e) => failure(&ctx, &e),
    }
}

/// POST `/queues/{queue}/jobs/{id}/run-now`.
pub(crate) async fn run_now(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    Path((name, id)): Path<(String, i64)>,
) -> Response {
    let q = match lookup(&d, &ctx, &name) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    match q.run_now(id).await {
        Ok(()) => back(
            &ctx,
            &[("back".into(), "job".into())],
            &name,
            Some(id),
            "done=due-now",
        ),
        Err(e) => failure(&ctx, &e),
    }
}

/// GET `/login`.
pub(crate) async fn login_form(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    if !matches!(d.auth, crate::Auth::Bearer(_)) {
        return Redirect::to(&ctx.home()).into_response();
    }
    html(pages::login(&ctx, None))
}

/// POST `/login`: a right token sets the signed-in cookie. Failed attempts are limited for
/// the whole dashboard (see `LoginLimit`): past the limit the token is not even compared.
pub(crate) async fn login(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
    body: Bytes,
) -> Response {
    let crate::Auth::Bearer(token) = &d.auth else {
        return Redirect::to(&ctx.home()).into_response();
    };
    if let Some(wait) = d.login_limit.wait() {
        let secs = wait.as_secs().max(1);
        let mut r = html(pages::login(
            &ctx,
            Some(&format!(
                "Too many failed sign-ins on this dashboard; try again in {secs} s."
            )),
        ));
        *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return r;
    }
    let presented = form_fields(&body)
        .into_iter()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v)
        .unwrap_or_default();
    let expected = sign(&d.secret, "bearer", token.as_bytes());
    if !crate::security::verify(&d.secret, "bearer", presented.as_bytes(), &expected) {
        d.login_limit.failed();
        if d.login_limit.wait().is_some() {
            tracing::warn!(
                "dashboard: {} failed sign-ins within a minute; the login form refuses attempts for the rest of it",
                crate::security::LoginLimit::FAILURES
            );
        }
        let mut r = html(pages::login(
            &ctx,
            Some("That token is not the dashboard's."),
        ));
        *r.status_mut() = StatusCode::UNAUTHORIZED;
        return r;
    }
    let value = Session::start(&d.secret, token, d.session);
    let mut r = Redirect::to(&ctx.home()).into_response();
    if let Some(v) = d
        .cookies
        .set(d.cookies.auth(), &value, &ctx.base, Some(d.session))
    {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

/// POST `/logout`: ends the browser's session on the server (its cookie no longer signs in,
/// even if kept) and deletes the cookie.
pub(crate) async fn logout(
    State(d): State<Arc<Inner>>,
    Extension(ctx): Extension<Ctx>,
) -> Response {
    if let Some(s) = &ctx.session {
        d.revoked.revoke(s);
    }
    let to = if matches!(d.auth, crate::Auth::Bearer(_)) {
        ctx.url("/login")
    } else {
        ctx.home()
    };
    let mut r = Redirect::to(&to).into_response();
    if let Some(v) = d.cookies.set(
        d.cookies.auth(),
        "",
        &ctx.base,
        Some(std::time::Duration::ZERO),
    ) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

/// The stylesheet.
pub(crate) async fn style() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        include_str!("assets/style.css"),
    )
        .into_response()
}

/// The refresh script: the only script the dashboard runs.
pub(crate) async fn script() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        include_str!("assets/refresh.js"),
    )
        .into_response()
}

/// Any other path.
pub(crate) async fn not_found(Extension(ctx): Extension<Ctx>) -> Response {
    pages::error_page(&ctx, StatusCode::NOT_FOUND, "no such page on the dashboard")
}

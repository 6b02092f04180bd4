//! The pages, rendered with maud: every value goes through its escaping (`(value)` in a
//! template), and no template writes `PreEscaped` of anything that came from a row, an error
//! or a request.

use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use broker_core::{Count, JobInfo, JobState, QueueStats, TableDescription};
use maud::{DOCTYPE, Markup, html};

use crate::chart::{self, Series};
use crate::security::{CSRF_FIELD, Ctx};

/// A path segment for a table name (percent-encoding all but `[A-Za-z0-9_.-]`).
pub(crate) fn seg(name: &str) -> String {
    let mut out = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The page frame: title, navigation, the stylesheet and the refresh script.
pub(crate) fn layout(ctx: &Ctx, title: &str, refresh: Duration, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · sqlx-broker" }
                link rel="stylesheet" href=(ctx.url("/assets/style.css"));
                script src=(ctx.url("/assets/refresh.js")) defer {}
            }
            body data-refresh=(refresh.as_secs()) {
                header {
                    a.brand href=(ctx.home()) { "sqlx-broker" }
                    nav { a href=(ctx.home()) { "Queues" } }
                    @if ctx.read_only { span.badge title="actions are off" { "read-only" } }
                    @if ctx.session.is_some() {
                        form.inline.signout method="post" action=(ctx.url("/logout")) {
                            (csrf(ctx)) button.signout type="submit" { "Sign out" }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

fn csrf(ctx: &Ctx) -> Markup {
    html! { input type="hidden" name=(CSRF_FIELD) value=(ctx.csrf); }
}

/// A count cell: `~N` for an estimate, `–` for a state the table does not keep.
fn count_cell(state: JobState, count: Option<Count>, missing: &str) -> Markup {
    html! {
        @match count {
            Some(c) => td.num data-state=(state.as_str()) title=[(!c.exact).then_some("the planner's estimate")] { (c) },
            None => td.num.muted data-state=(state.as_str()) title=(missing) { "–" },
        }
    }
}

/// The host's clock, unix ms.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// `3m 4s`.
pub(crate) fn duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// A unix-ms time in UTC, and how far from now.
fn time(ms: Option<i64>, now_ms: i64) -> Markup {
    let Some(ms) = ms else {
        return html! { span.muted { "–" } };
    };
    let at = chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| ms.to_string());
    let rel = if ms > now_ms {
        format!(
            "in {}",
            duration(Duration::from_millis((ms - now_ms).unsigned_abs()))
        )
    } else {
        format!(
            "{} ago",
            duration(Duration::from_millis((now_ms - ms).unsigned_abs()))
        )
    };
    html! { time title=(at) { (rel) } }
}

fn lag(s: &QueueStats) -> Markup {
    match s.lag() {
        Some(d) => html! { (duration(d)) },
        None => html! { span.muted title="the due rows have no due time" { "?" } },
    }
}

fn state_cell(s: &QueueStats, now_ms: i64) -> Markup {
    html! {
        @match &s.paused {
            Some(p) => td.state { span.paused { "paused" } " " span.muted { (time(Some(p.since_ms), now_ms)) " by " (p.by) } },
            None => td.state { span.running { "running" } },
        }
    }
}

/// The pause or resume button of a queue; `back` names the page to return to.
fn pause_form(ctx: &Ctx, s: &QueueStats, back: &str) -> Markup {
    let name = seg(&s.table);
    html! {
        @if s.paused.is_some() {
            form.inline method="post" action=(ctx.url(&format!("/queues/{name}/resume"))) {
                (csrf(ctx)) input type="hidden" name="back" value=(back);
                button.resume type="submit" { "Resume" }
            }
        } @else {
            form.inline method="post" action=(ctx.url(&format!("/queues/{name}/pause"))) {
                (csrf(ctx)) input type="hidden" name="back" value=(back);
                button.pause type="submit" { "Pause" }
            }
        }
    }
}

fn stats_head(ctx: &Ctx) -> Markup {
    html! {
        thead { tr {
            th { "Queue" } th { "Mode" }
            th.num { "Due" } th.num { "Scheduled" } th.num { "In work" } th.num { "Retrying" }
            th.num { "Dead" } th.num { "Finished" } th.num { "Lag" } th { "Throughput" } th { "State" }
            @if !ctx.read_only { th {} }
        } }
    }
}

fn stats_row(
    ctx: &Ctx,
    s: &QueueStats,
    series: Option<&Series>,
    window_min: u64,
    back: &str,
) -> Markup {
    let now = s.read_at_ms;
    html! {
        tr data-queue=(s.table) {
            td { a href=(ctx.url(&format!("/queues/{}", seg(&s.table)))) { (s.table) } }
            td { (s.mode) }
            (count_cell(JobState::Due, Some(s.due), ""))
            (count_cell(JobState::Scheduled, Some(s.scheduled), ""))
            (count_cell(JobState::InWork, Some(s.in_work), ""))
            (count_cell(JobState::Retrying, Some(s.retrying), ""))
            (count_cell(JobState::Dead, s.dead, "the table has no dead-letter target"))
            (count_cell(JobState::Finished, s.finished, "acks delete rows on this table"))
            td.num.lag { (lag(s)) }
            td { (chart::chart(series, window_min)) }
            (state_cell(s, now))
            @if !ctx.read_only { td { (pause_form(ctx, s, back)) } }
        }
    }
}

/// A kinds table's counts by kind (empty for other tables). Kinds come from rows, which any
/// software may write: each is escaped like every other value, and cut to a preview.
fn kinds_table(base: &str, s: &QueueStats) -> Markup {
    html! {
        @if !s.kinds.is_empty() {
            table.kinds {
                caption { "By kind" }
                thead { tr {
                    th { "Kind" }
                    th.num { "Due" } th.num { "Scheduled" } th.num { "In work" } th.num { "Retrying" }
                    th.num { "Dead" } th.num { "Finished" }
                } }
                tbody {
                    @for k in &s.kinds {
                        tr {
                            td { @match &k.kind {
                                Some(name) => a href={(base) "?state=due&kind=" (seg(name))} title="list this kind's rows" { code { (preview(name, 60)) } },
                                None => span.muted { "(no kind)" },
                            } }
                            (count_cell(JobState::Due, Some(k.due), ""))
                            (count_cell(JobState::Scheduled, Some(k.scheduled), ""))
                            (count_cell(JobState::InWork, Some(k.in_work), ""))
                            (count_cell(JobState::Retrying, Some(k.retrying), ""))
                            (count_cell(JobState::Dead, k.dead, "the table has no dead-letter target"))
                            (count_cell(JobState::Finished, k.finished, "acks delete rows on this table"))
                        }
                    }
                }
            }
        }
    }
}

/// One queue as the queues page lists it: its counts, or the error reading them.
pub(crate) struct Listed {
    pub(crate) name: String,
    pub(crate) stats: Result<QueueStats, String>,
    pub(crate) series: Option<Series>,
}

/// The queues page.
pub(crate) fn queues(ctx: &Ctx, refresh: Duration, window_min: u64, listed: &[Listed]) -> Markup {
    layout(
        ctx,
        "Queues",
        refresh,
        html! {
            h1 { "Queues" }
            div #live {
                table.queues {
                    (stats_head(ctx))
                    tbody {
                        @for q in listed {
                            @match &q.stats {
                                Ok(s) => (stats_row(ctx, s, q.series.as_ref(), window_min, "home")),
                                Err(e) => tr data-queue=(q.name) {
                                    td { a href=(ctx.url(&format!("/queues/{}", seg(&q.name)))) { (q.name) } }
                                    td.error colspan="11" { "cannot read the queue: " (e) }
                                },
                            }
                        }
                        @if listed.is_empty() { tr { td colspan="12" .muted { "No queues: add them with Dashboard::queue." } } }
                    }
                }
                p.muted.small {
                    "Throughput: rows acked or dead-lettered per minute over the last "
                    @if window_min == 1 { "minute" } @else { (window_min) " minutes" }
                    " (* counted by this process only: the table keeps no finished rows)."
                }
            }
        },
    )
}

/// A notice after an action (from a fixed list; nothing of the request's text is shown).
pub(crate) fn notice(done: Option<&str>, n: Option<u64>) -> Option<String> {
    let rows = |n: u64| {
        if n == 1 {
            "1 row".to_owned()
        } else {
            format!("{n} rows")
        }
    };
    Some(match (done?, n) {
        ("requeued", Some(n)) => format!("{} requeued.", rows(n)),
        ("discarded", Some(n)) => format!("{} discarded.", rows(n)),
        ("paused", _) => "Queue paused.".to_owned(),
        ("resumed", _) => "Queue resumed.".to_owned(),
        ("cancelled", _) => "Row cancelled.".to_owned(),
        ("cancel-signalled", _) => "Row in work: its holder was signalled to cancel it; it deletes the row after the handler stops (or the grace ends).".to_owned(),
        ("due-now", _) => "Row due now.".to_owned(),
        _ => return None,
    })
}

/// The states a table can list.
pub(crate) fn states(table: &TableDescription) -> Vec<JobState> {
    JobState::ALL
        .into_iter()
        .filter(|s| match s {
            JobState::Dead => table.dead_letter().is_some(),
            JobState::Finished => table.processed_at().is_some(),
            _ => true,
        })
        .collect()
}

fn preview(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let mut s: String = text.chars().take(max).collect();
        s.push('…');
        s
    }
}

/// What the queue page shows.
pub(crate) struct QueueView<'a> {
    pub(crate) table: &'a TableDescription,
    pub(crate) stats: Result<QueueStats, String>,
    pub(crate) series: Option<Series>,
    pub(crate) state: JobState,
    pub(crate) rows: Result<Vec<JobInfo>, String>,
    pub(crate) next_after: Option<i64>,
    /// The kind the listing is limited to, if any.
    pub(crate) kind: Option<String>,
    pub(crate) notice: Option<String>,
}

/// A queue's page: its counts, and its rows in one state a page at a time.
pub(crate) fn queue(ctx: &Ctx, refresh: Duration, window_min: u64, v: &QueueView<'_>) -> Markup {
    let name = v.table.name();
    let base = ctx.url(&format!("/queues/{}", seg(name)));
    let now = now_ms();
    let dead = v.state == JobState::Dead;
    let actions = dead && !ctx.read_only;
    let of_kind = v
        .kind
        .as_ref()
        .map(|k| format!("&kind={}", seg(k)))
        .unwrap_or_default();
    layout(
        ctx,
        name,
        refresh,
        html! {
            h1 { "Queue " code { (name) } }
            @if let Some(n) = &v.notice { p.notice role="status" { (n) } }
            div #live {
                @match &v.stats {
                    Ok(s) => {
                        table.queues { (stats_head(ctx)) tbody { (stats_row(ctx, s, v.series.as_ref(), window_min, "queue")) } }
                        (kinds_table(&base, s))
                    },
                    Err(e) => p.error { "cannot read the queue: " (e) },
                }
            }
            nav.tabs {
                @for st in states(v.table) {
                    a href={(base) "?state=" (st.as_str()) (of_kind)} class=[(st == v.state).then_some("current")] { (st.as_str()) }
                }
            }
            @if let Some(k) = &v.kind {
                p.filter { "Rows of kind " code { (preview(k, 60)) } " · " a href={(base) "?state=" (v.state.as_str())} { "all kinds" } }
            }
            @match &v.rows {
                Err(e) => p.error { (e) },
                Ok(rows) => {
                    @if rows.is_empty() { p.muted { "No " (v.state.as_str()) " rows." } }
                    @else {
                        form #rows method="post" action={(base) "/dead/requeue"} {
                            @if actions { (csrf(ctx)) }
                            table.rows {
                                thead { tr {
                                    @if actions { th { span.sr { "select" } } }
                                    th.num { "Id" } th.num { "Attempt" }
                                    @if v.table.kind().is_some() { th { "Kind" } }
                                    th { "Due" }
                                    @if v.state == JobState::InWork { th { "Lease until" } }
                                    @if dead || v.state == JobState::Finished { th { (if dead { "Dead since" } else { "Finished" }) } }
                                    @if v.table.last_error().is_some() { th { "Last error" } }
                                    th { "Payload" }
                                } }
                                tbody {
                                    @for r in rows {
                                        tr data-id=(r.id) {
                                            @if actions { td { input type="checkbox" name="id" value=(r.id) aria-label={"select row " (r.id)}; } }
                                            td.num { a href={(base) "/jobs/" (r.id)} { (r.id) } }
                                            td.num { (r.attempt) }
                                            @if v.table.kind().is_some() { td.kind { @if let Some(k) = &r.kind { code { (preview(k, 60)) } } } }
                                            td { (time(r.due_ms, now)) }
                                            @if v.state == JobState::InWork { td { (time(r.locked_until_ms, now)) } }
                                            @if dead || v.state == JobState::Finished { td { (time(r.finished_ms, now)) } }
                                            @if v.table.last_error().is_some() {
                                                td.error-text { @if let Some(e) = &r.last_error { (preview(e, 160)) @if r.last_error_cut && e.chars().count() <= 160 { "…" } } }
                                            }
                                            td { code.payload-preview { @if let Some(p) = &r.payload { (preview(p, 120)) } } }
                                        }
                                    }
                                }
                            }
                            @if actions {
                                div.actions {
                                    button type="submit" name="selected" value="1" { "Requeue selected" }
                                    " "
                                    button.danger type="submit" name="selected" value="1" formaction={(base) "/dead/discard"} { "Discard selected" }
                                }
                            }
                        }
                        @if actions {
                            div.actions {
                                form.inline method="post" action={(base) "/dead/requeue"} {
                                    (csrf(ctx)) input type="hidden" name="all" value="1";
                                    button type="submit" { "Requeue all…" }
                                }
                                " "
                                form.inline method="post" action={(base) "/dead/discard"} {
                                    (csrf(ctx)) input type="hidden" name="all" value="1";
                                    button.danger type="submit" { "Discard all…" }
                                }
                            }
                        }
                        @if let Some(after) = v.next_after {
                            p { a.next href={(base) "?state=" (v.state.as_str()) (of_kind) "&after=" (after)} { "Next page →" } }
                        }
                    }
                }
            }
        },
    )
}

/// The confirmation asked before an action on every dead letter.
pub(crate) fn confirm_all(ctx: &Ctx, table: &str, verb: &str, dead: Option<Count>) -> Markup {
    let base = ctx.url(&format!("/queues/{}", seg(table)));
    let what = match dead {
        Some(c) => format!("all {c} dead letters"),
        None => "all dead letters".to_owned(),
    };
    let action = if verb == "requeue" {
        "Requeue"
    } else {
        "Discard"
    };
    layout(
        ctx,
        "Confirm",
        Duration::ZERO,
        html! {
            h1 { (action) " " (what) " of " code { (table) } "?" }
            p {
                @if verb == "requeue" { "They go back to the queue, due now with attempt 1." }
                @else { "They are deleted for good." }
            }
            form.inline method="post" action={(base) "/dead/" (verb)} {
                (csrf(ctx))
                input type="hidden" name="all" value="1";
                input type="hidden" name="confirm" value="yes";
                button.danger[verb == "discard"] #confirm type="submit" { "Yes, " (action.to_lowercase()) " " (what) }
            }
            " "
            a href={(base) "?state=dead"} { "Cancel" }
        },
    )
}

/// A row's page.
pub(crate) fn job(
    ctx: &Ctx,
    table: &TableDescription,
    j: &JobInfo,
    notice: Option<String>,
) -> Markup {
    let name = table.name();
    let base = ctx.url(&format!("/queues/{}", seg(name)));
    let now = now_ms();
    let unfinished = !matches!(j.state, JobState::Dead | JobState::Finished);
    layout(
        ctx,
        &format!("Row {}", j.id),
        Duration::ZERO,
        html! {
            h1 { "Row " (j.id) " of " a href=(base) { code { (name) } } }
            @if let Some(n) = &notice { p.notice role="status" { (n) } }
            dl.job {
                dt { "State" } dd #state { (j.state.as_str()) @if unfinished && j.attempt > 1 { " (retrying)" } }
                dt { "Attempt" } dd #attempt { (j.attempt) }
                dt { "Due" } dd { (time(j.due_ms, now)) }
                @if j.locked_until_ms.is_some() { dt { "Lease until" } dd { (time(j.locked_until_ms, now)) } }
                @if j.finished_ms.is_some() { dt { (if j.state == JobState::Dead { "Dead since" } else { "Finished" }) } dd { (time(j.finished_ms, now)) } }
                @if let Some(k) = &j.key { dt { "Key" } dd { code { (k) } } }
                @if let Some(g) = &j.group { dt { "Group" } dd { code { (g) } } }
                @if let Some(k) = &j.kind { dt { "Kind" } dd #kind { code { (k) } } }
            }
            @if table.last_error().is_some() {
                h2 { "Last error" }
                @match &j.last_error { Some(e) => pre #last-error { (e) }, None => p.muted { "none" } }
                @if j.last_error_cut { p.muted { "The first " (broker_core::admin::LAST_ERROR_READ_CHARS) " characters: the rest is in the row." } }
            }
            h2 { "Payload" }
            @match &j.payload {
                Some(p) => {
                    pre #payload { (p) }
                    @if j.payload_cut { p.muted.small { "Cut at " (broker_core::admin::PAYLOAD_PREVIEW_BYTES) " bytes." } }
                },
                None => p.muted { "no payload column, or NULL" },
            }
            @if !ctx.read_only {
                div.actions {
                    @if j.state == JobState::Dead {
                        form.inline method="post" action={(base) "/dead/requeue"} {
                            (csrf(ctx)) input type="hidden" name="id" value=(j.id); input type="hidden" name="back" value="job";
                            button type="submit" { "Requeue" }
                        }
                        " "
                        form.inline method="post" action={(base) "/dead/discard"} {
                            (csrf(ctx)) input type="hidden" name="id" value=(j.id);
                            button.danger type="submit" { "Discard" }
                        }
                    }
                    @if unfinished {
                        @if j.state == JobState::Scheduled {
                            form.inline method="post" action={(base) "/jobs/" (j.id) "/run-now"} {
                                (csrf(ctx)) button type="submit" { "Run now" }
                            }
                            " "
                        }
                        form.inline method="post" action={(base) "/jobs/" (j.id) "/cancel"} {
                            (csrf(ctx))
                            @if j.state == JobState::InWork {
                                button.danger type="submit" title="Signals the handler that runs it; the row is deleted once the handler stops or the grace ends" { "Cancel (in work)" }
                            } @else {
                                button.danger type="submit" { "Cancel" }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// The login page of a dashboard with a bearer token, with why the last attempt failed.
pub(crate) fn login(ctx: &Ctx, failed: Option<&str>) -> Markup {
    layout(
        ctx,
        "Sign in",
        Duration::ZERO,
        html! {
            h1 { "Sign in" }
            @if let Some(why) = failed { p.error #login-error { (why) } }
            form method="post" action=(ctx.url("/login")) {
                (csrf(ctx))
                label { "Token " input type="password" name="token" autocomplete="current-password" autofocus; }
                " " button type="submit" { "Sign in" }
            }
        },
    )
}

/// A refusal or failure as a page with its status; `message` is escaped like everything else.
pub(crate) fn refusal(status: StatusCode, message: &str) -> Response {
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head { meta charset="utf-8"; title { (status.as_u16()) " · sqlx-broker" } }
            body { h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) } p #error { (message) } }
        }
    };
    (status, Html(page.into_string())).into_response()
}

/// A page of `ctx`'s dashboard with `status`, for errors inside the dashboard (with its frame).
pub(crate) fn error_page(ctx: &Ctx, status: StatusCode, message: &str) -> Response {
    let page = layout(
        ctx,
        "Error",
        Duration::ZERO,
        html! {
            h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
            p.error #error { (message) }
            p { a href=(ctx.home()) { "Back to the queues" } }
        },
    );
    (status, Html(page.into_string())).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(duration(Duration::from_secs(5)), "5s");
        assert_eq!(duration(Duration::from_secs(185)), "3m 5s");
        assert_eq!(duration(Duration::from_secs(7_500)), "2h 5m");
        assert_eq!(duration(Duration::from_secs(90_000)), "1d 1h");
    }

    #[test]
    fn table_names_become_safe_path_segments() {
        assert_eq!(seg("public.jobs_1"), "public.jobs_1");
        assert_eq!(seg("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn a_last_error_the_database_cut_shows_as_cut_even_at_the_listings_length() {
        let table = TableDescription::builder("jobs")
            .payload("payload", broker_core::ColumnType::Text)
            .last_error("last_error")
            .build()
            .unwrap();
        let ctx = Ctx {
            base: String::new(),
            csrf: "t".into(),
            operator: "op".into(),
            read_only: true,
            session: None,
        };
        // Exactly the listing's length: only the flag says whether the row holds more.
        let row = |id, cut| {
            let mut j = JobInfo::new(id, 1, JobState::Due);
            j.last_error = Some("e".repeat(broker_core::admin::LAST_ERROR_PREVIEW_CHARS));
            j.last_error_cut = cut;
            j
        };
        let page = |cut| {
            let v = QueueView {
                table: &table,
                stats: Err("not read".into()),
                series: None,
                state: JobState::Due,
                rows: Ok(vec![row(7, cut)]),
                next_after: None,
                kind: None,
                notice: None,
            };
            queue(&ctx, Duration::from_secs(5), 60, &v).into_string()
        };
        assert!(page(true).contains("…"), "a cut error is marked");
        assert!(!page(false).contains("…"), "a whole error is not");
        let mut one = row(7, true);
        one.last_error = Some("e".repeat(broker_core::admin::LAST_ERROR_READ_CHARS));
        let page = job(&ctx, &table, &one, None).into_string();
        assert!(page.contains("The first 16384 characters"), "{page}");
    }

    #[test]
    fn notices_come_from_a_fixed_list() {
        assert_eq!(
            notice(Some("requeued"), Some(1)).as_deref(),
            Some("1 row requeued.")
        );
        assert_eq!(notice(Some("<b>"), Some(1)), None);
    }
}

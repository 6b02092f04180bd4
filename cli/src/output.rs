//! What the CLI prints: a human table, or JSON.
//!
//! Text from the database (who paused a queue, payloads, errors, names) can hold terminal
//! escapes: an `ESC ]` that retitles the window, colours, a right-to-left override that
//! reverses what follows. None reaches the terminal as such: human output writes each as its
//! Rust escape (`\u{1b}`), a line break inside a value included, so a value cannot pose as a
//! line of its own; JSON writes each as `\uXXXX`, which parses back to the same text.

use std::fmt::Write as _;

use broker_core::{Count, DoctorReport, JobInfo, QueueStats};
use serde_json::{Value, json};

/// A command's result.
pub(crate) enum Out {
    Stats(QueueStats),
    /// A page of rows, and the page size asked for.
    Jobs {
        jobs: Vec<JobInfo>,
        limit: usize,
    },
    Count {
        what: &'static str,
        rows: u64,
    },
    Done(String),
    Doctor(DoctorReport),
}

impl Out {
    pub(crate) fn render(&self, as_json: bool) -> String {
        if as_json {
            let mut s = json_safe(serde_json::to_string_pretty(&self.json()).unwrap_or_default());
            s.push('\n');
            return s;
        }
        let text = match self {
            Out::Stats(s) => stats(s),
            Out::Jobs { jobs, limit } => jobs_table(jobs, *limit),
            Out::Count { what, rows } => {
                format!(
                    "{rows} {} {what}\n",
                    if *rows == 1 { "row" } else { "rows" }
                )
            }
            Out::Done(text) => format!("{}\n", clean(text)),
            Out::Doctor(report) => report.to_string(),
        };
        // Values are cleaned where they are written; this catches what was not (the doctor's
        // findings quote the server), keeping the lines.
        terminal_text(&text)
    }

    fn json(&self) -> Value {
        let count = |c: &Count| json!({ "rows": c.rows, "exact": c.exact });
        match self {
            Out::Stats(s) => json!({
                "table": s.table,
                "mode": s.mode.to_string(),
                "due": count(&s.due),
                "scheduled": count(&s.scheduled),
                "in_work": count(&s.in_work),
                "retrying": count(&s.retrying),
                "dead": s.dead.as_ref().map(count),
                "finished": s.finished.as_ref().map(count),
                "oldest_due_ms": s.oldest_due_ms,
                "lag_seconds": s.lag().map(|d| d.as_secs_f64()),
                "read_at_ms": s.read_at_ms,
                "paused": s.paused.as_ref().map(|p| json!({ "since_ms": p.since_ms, "by": p.by })),
                "kinds": s.kinds.iter().map(|k| json!({
                    "kind": k.kind,
                    "due": count(&k.due),
                    "scheduled": count(&k.scheduled),
                    "in_work": count(&k.in_work),
                    "retrying": count(&k.retrying),
                    "dead": k.dead.as_ref().map(count),
                    "finished": k.finished.as_ref().map(count),
                })).collect::<Vec<_>>(),
                "schedules": s.schedules.iter().map(|c| json!({
                    "name": c.name,
                    "expression": c.expression,
                    "time_zone": c.time_zone,
                    "last_tick_ms": c.last_tick_ms,
                    "next_tick_ms": c.next_tick_ms(s.read_at_ms),
                })).collect::<Vec<_>>(),
            }),
            Out::Jobs { jobs, .. } => Value::Array(
                jobs.iter()
                    .map(|j| {
                        json!({
                            "id": j.id,
                            "attempt": j.attempt,
                            "state": j.state.as_str(),
                            "due_ms": j.due_ms,
                            "locked_until_ms": j.locked_until_ms,
                            "finished_ms": j.finished_ms,
                            "key": j.key,
                            "group": j.group,
                            "kind": j.kind,
                            "payload": j.payload,
                            "payload_cut": j.payload_cut,
                            "last_error": j.last_error,
                            "last_error_cut": j.last_error_cut,
                        })
                    })
                    .collect(),
            ),
            Out::Count { what, rows } => json!({ *what: rows }),
            Out::Done(text) => json!({ "done": text }),
            Out::Doctor(report) => json!({
                "worst": report.worst().to_string(),
                "checks": report.checks.iter().map(|c| json!({
                    "name": c.name,
                    "status": c.status.to_string(),
                    "found": c.found,
                    "fix": c.fix,
                })).collect::<Vec<_>>(),
            }),
        }
    }
}

/// Unix ms as `YYYY-MM-DD hh:mm:ss UTC`.
pub(crate) fn utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn stats(s: &QueueStats) -> String {
    let mut out = String::new();
    let state = match &s.paused {
        Some(p) => format!("PAUSED since {} by \"{}\"", utc(p.since_ms), clean(&p.by)),
        None => "running".into(),
    };
    let _ = writeln!(
        out,
        "queue \"{}\" ({} mode), {state}",
        clean(&s.table),
        s.mode
    );
    let mut row = |name: &str, c: Option<&Count>, note: &str| {
        let value = c.map_or_else(|| "-".to_owned(), |c| c.to_string());
        let _ = writeln!(out, "  {name:<10} {value:>12}{note}");
    };
    row("due", Some(&s.due), "");
    row("scheduled", Some(&s.scheduled), "");
    row("in work", Some(&s.in_work), "");
    row("retrying", Some(&s.retrying), "  (of the rows above)");
    row(
        "dead",
        s.dead.as_ref(),
        if s.dead.is_none() {
            "  (no dead-letter target)"
        } else {
            ""
        },
    );
    row(
        "finished",
        s.finished.as_ref(),
        if s.finished.is_none() {
            "  (acks delete)"
        } else {
            ""
        },
    );
    let lag = match s.lag() {
        Some(d) => format!("{:.3} s", d.as_secs_f64()),
        None => "unknown (due rows without a due time)".into(),
    };
    let _ = writeln!(out, "  {:<10} {lag:>12}", "lag");
    if [
        Some(&s.due),
        Some(&s.scheduled),
        s.dead.as_ref(),
        s.finished.as_ref(),
    ]
    .iter()
    .flatten()
    .any(|c| !c.exact)
    {
        let _ = writeln!(out, "  (~ marks the planner's estimate on a large table)");
    }
    if !s.kinds.is_empty() {
        let _ = writeln!(
            out,
            "  by kind    {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "due", "scheduled", "in work", "retrying", "dead", "finished"
        );
        let opt = |c: Option<&Count>| c.map_or_else(|| "-".to_owned(), Count::to_string);
        for k in &s.kinds {
            let name = k
                .kind
                .as_deref()
                .map_or_else(|| "(no kind)".to_owned(), |k| cell(k, 20));
            let _ = writeln!(
                out,
                "  {name:<20} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
                k.due.to_string(),
                k.scheduled.to_string(),
                k.in_work.to_string(),
                k.retrying.to_string(),
                opt(k.dead.as_ref()),
                opt(k.finished.as_ref()),
            );
        }
    }
    for sched in &s.schedules {
        let next = sched
            .next_tick_ms(s.read_at_ms)
            .map_or_else(|| "none".to_owned(), utc);
        let _ = writeln!(
            out,
            "  schedule   \"{}\" \"{}\" ({}), next tick {next}",
            clean(&sched.name),
            clean(&sched.expression),
            clean(&sched.time_zone)
        );
    }
    out
}

/// Whether `c` would act on a terminal rather than show: a control character (C0, DEL, C1)
/// or a bidirectional override or isolate (which reorders the text after it).
fn acts(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` as one line that shows every character that would act on a terminal as its escape
/// (`\u{1b}`, `\n`).
pub(crate) fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if acts(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Output for a terminal: as [`clean`], but line breaks stay.
pub(crate) fn terminal_text(text: &str) -> String {
    text.split('\n').map(clean).collect::<Vec<_>>().join("\n")
}

/// JSON text with every character that would act on a terminal written as `\uXXXX`.
/// serde_json writes C0 controls so already; DEL, C1 controls and bidirectional overrides it
/// writes as they are. They can only stand inside strings, where the escape reads back the same.
pub(crate) fn json_safe(json: String) -> String {
    if !json.chars().any(acts) {
        return json;
    }
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if acts(c) && c != '\n' {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// One line of text, at most `max` characters: line breaks and tabs read as spaces, other
/// characters that would act on a terminal as their escapes.
fn cell(text: &str, max: usize) -> String {
    let spaced: String = text
        .chars()
        .map(|c| {
            if matches!(c, '\n' | '\r' | '\t') {
                ' '
            } else {
                c
            }
        })
        .collect();
    let one = clean(&spaced);
    if one.chars().count() <= max {
        one
    } else {
        let mut cut: String = one.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

/// The rows of a page; `limit` is the page size asked for.
fn jobs_table(jobs: &[JobInfo], limit: usize) -> String {
    if jobs.is_empty() {
        return "no rows\n".into();
    }
    // A kinds table's rows show their kind; other tables' output is as it was.
    let kinds = jobs.iter().any(|j| j.kind.is_some());
    let kind = |k: Option<&str>| match kinds {
        true => format!("{:<20}  ", cell(k.unwrap_or("-"), 20)),
        false => String::new(),
    };
    let mut out = format!(
        "{:>10}  {:>7}  {:<9}  {}{:<23}  {:<30}  {}\n",
        "id",
        "attempt",
        "state",
        kind(Some("kind")),
        "due",
        "last error",
        "payload"
    );
    for j in jobs {
        let _ = writeln!(
            out,
            "{:>10}  {:>7}  {:<9}  {}{:<23}  {:<30}  {}",
            j.id,
            j.attempt,
            j.state.as_str(),
            kind(j.kind.as_deref()),
            j.due_ms.map(utc).unwrap_or_else(|| "-".into()),
            cell(j.last_error.as_deref().unwrap_or("-"), 30),
            cell(j.payload.as_deref().unwrap_or("-"), 40),
        );
    }
    // A page that is not full is the last: no hint that sends the operator to an empty one.
    if let Some(last) = jobs.last().filter(|_| jobs.len() >= limit) {
        let _ = writeln!(out, "(next page: --after {})", last.id);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_milliseconds_read_as_utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_796_490_621_635), "2026-12-05 17:10:21 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn cells_are_one_line_and_cut() {
        assert_eq!(cell("a\nb", 10), "a b");
        assert_eq!(cell("abcdef", 4), "abc…");
        assert_eq!(cell("\u{1b}[31mred", 20), "\\u{1b}[31mred");
    }

    #[test]
    fn json_text_escapes_what_serde_json_leaves() {
        let value = json!({ "by": "\u{1b}]0;x\u{7}\u{9b}1m\u{7f}\u{202e}\u{1F600}" });
        let text = json_safe(value.to_string());
        assert!(!text.chars().any(acts), "{text:?}");
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, value);
    }
}

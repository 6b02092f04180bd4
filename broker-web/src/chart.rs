//! Throughput over the last minutes: a sampler that reads each queue at an interval, and the
//! small SVG chart the queues page draws from its samples on the server.
//!
//! Throughput is rows leaving the queue (acked or dead-lettered) per minute. A table that keeps
//! acked rows (`processed_at`) shows it for every process, from the finished and dead counts of
//! `stats()`; a table whose acks delete rows leaves nothing in the database to count, so the
//! chart falls back to this process's own counters (`Queue::metrics`) and says so.

use std::collections::VecDeque;

use broker_core::{MetricsSnapshot, QueueStats};
use maud::{Markup, html};

/// Where a queue's throughput comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// Finished and dead counts in the table: every process's work.
    Table,
    /// This process's acks and dead letters: the table keeps no finished rows.
    Process,
}

/// One reading: when, and the rows that had left the queue by then.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ms: i64,
    done: u64,
}

/// A queue's readings over the window.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    source: Source,
    samples: VecDeque<Sample>,
}

impl Series {
    /// An empty series.
    pub(crate) fn new() -> Self {
        Self {
            source: Source::Table,
            samples: VecDeque::new(),
        }
    }

    /// Adds a reading of `stats` (and this process's `metrics`) and forgets readings older
    /// than `window_ms`.
    pub(crate) fn record(&mut self, stats: &QueueStats, metrics: &MetricsSnapshot, window_ms: i64) {
        let table_done = stats
            .finished
            .map(|finished| finished.rows + stats.dead.map_or(0, |d| d.rows));
        self.record_done(
            stats.read_at_ms,
            table_done,
            metrics.acked + metrics.dead_lettered,
            window_ms,
        );
    }

    fn record_done(&mut self, at_ms: i64, table_done: Option<u64>, here_done: u64, window_ms: i64) {
        let (source, done) = match table_done {
            Some(done) => (Source::Table, done),
            None => (Source::Process, here_done),
        };
        if source != self.source {
            self.samples.clear();
            self.source = source;
        }
        self.samples.push_back(Sample { at_ms, done });
        while let Some(first) = self.samples.front() {
            if at_ms - first.at_ms > window_ms {
                self.samples.pop_front();
            } else {
                break;
            }
        }
    }

    /// Rows per minute between consecutive readings, oldest first. A count that went down (a
    /// purge, a requeue) counts as zero for that interval.
    pub(crate) fn rates(&self) -> Vec<f64> {
        self.samples
            .iter()
            .zip(self.samples.iter().skip(1))
            .map(|(a, b)| {
                let ms = (b.at_ms - a.at_ms).max(1);
                #[allow(clippy::cast_precision_loss)] // counts far below 2^52
                let rows = b.done.saturating_sub(a.done) as f64;
                #[allow(clippy::cast_precision_loss)]
                let per_min = rows * 60_000.0 / ms as f64;
                per_min
            })
            .collect()
    }

    /// Where the figures come from.
    pub(crate) fn source(&self) -> Source {
        self.source
    }
}

/// Width and height of the chart, in CSS pixels.
const W: f64 = 160.0;
const H: f64 = 32.0;

/// The chart of `series`: a line of rows per minute, scaled to its peak, with the latest rate
/// beside it; a note while fewer than two readings exist.
pub(crate) fn chart(series: Option<&Series>, window_min: u64) -> Markup {
    let rates = series.map(Series::rates).unwrap_or_default();
    if rates.is_empty() {
        return html! { span.muted { "sampling…" } };
    }
    let peak = rates.iter().copied().fold(0.0_f64, f64::max);
    let last = rates.last().copied().unwrap_or(0.0);
    #[allow(clippy::cast_precision_loss)]
    let step = if rates.len() > 1 {
        W / (rates.len() - 1) as f64
    } else {
        W
    };
    let y = |r: f64| {
        if peak > 0.0 {
            H - 1.0 - (r / peak) * (H - 2.0)
        } else {
            H - 1.0
        }
    };
    let mut points = String::new();
    for (i, r) in rates.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let x = i as f64 * step;
        points.push_str(&format!("{x:.1},{:.1} ", y(*r)));
    }
    if rates.len() == 1 {
        points.push_str(&format!("{W:.1},{:.1}", y(last)));
    }
    let area = format!("0,{H:.1} {points} {W:.1},{H:.1}");
    let here = series.is_some_and(|s| s.source() == Source::Process);
    let title = format!(
        "rows acked or dead-lettered per minute over the last {window_min} min{}; peak {peak:.0}/min",
        if here { ", by this process" } else { "" }
    );
    html! {
        span.chart {
            svg width=(W) height=(H) viewBox={"0 0 " (W) " " (H)} role="img" aria-label=(title) {
                title { (title) }
                polygon.area points=(area) {}
                polyline.line points=(points) {}
            }
            span.rate { (format!("{last:.0}/min")) @if here { sup title="this process only" { "*" } } }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_rows_per_minute_between_readings_and_old_readings_go() {
        let mut s = Series::new();
        s.record_done(0, Some(0), 0, 60_000);
        s.record_done(30_000, Some(10), 0, 60_000);
        s.record_done(60_000, Some(40), 0, 60_000);
        assert_eq!(s.rates(), vec![20.0, 60.0]);
        s.record_done(90_000, Some(30), 0, 60_000);
        assert_eq!(
            s.rates(),
            vec![60.0, 0.0],
            "the first reading left the window"
        );
        assert_eq!(s.source(), Source::Table);
        s.record_done(100_000, None, 7, 60_000);
        assert_eq!(s.source(), Source::Process);
        assert!(s.rates().is_empty(), "a change of source starts again");
    }

    #[test]
    fn the_chart_says_it_is_sampling_until_two_readings_exist() {
        let mut s = Series::new();
        s.record_done(0, Some(0), 0, 60_000);
        assert!(chart(Some(&s), 1).into_string().contains("sampling"));
        s.record_done(1_000, Some(5), 0, 60_000);
        let svg = chart(Some(&s), 1).into_string();
        assert!(svg.contains("<svg") && svg.contains("300/min"), "{svg}");
    }
}

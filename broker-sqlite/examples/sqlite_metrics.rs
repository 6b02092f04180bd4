//! Exporting the queue's metrics to Prometheus: the `metrics` feature (on by default) reports
//! every counter, histogram and gauge through the `metrics` crate's facade, and the Prometheus
//! exporter of that ecosystem serves them at `/metrics`.
//!
//! Run it with `cargo run -p broker-sqlite --example sqlite_metrics`; it needs no server. It
//! serves `http://127.0.0.1:9464/metrics` while a subscription works through 200 jobs, prints
//! the lines about the queue, and stops.
//!
//! Your crate needs `metrics-exporter-prometheus` (with its `http-listener` feature), or any
//! other exporter of the `metrics` facade. Install it before preparing queues: a queue takes
//! its metric handles from the recorder installed when it is prepared.

use std::time::{Duration, Instant};

use broker_sqlite::{
    BoxError, ColumnType, Outcome, Payload, SqliteBackend, SubscribeOptions, TableDescription,
};
use metrics_exporter_prometheus::PrometheusBuilder;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], 9464));
    PrometheusBuilder::new()
        .with_http_listener(address)
        .install()?;

    let path = std::env::temp_dir().join("sqlx-broker-example-metrics.db");
    let remove = || {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    };
    remove();
    let broker = SqliteBackend::connect(&format!("sqlite://{}", path.display())).await?;
    let table = TableDescription::builder("metered")
        .payload("payload", ColumnType::Text)
        .locked_until("locked_until")
        .due_at("due_at")
        .build()?;
    broker.create_tables(&table).await?;
    let queue = broker.queue::<Payload<String>>(table).await?;
    let jobs: Vec<_> = (0..200)
        .map(|i| broker_sqlite::NewJob::new(format!("job {i}")))
        .collect();
    queue.publish_batch(&jobs).await?;
    let sub = queue.subscribe(SubscribeOptions::new().concurrency(4), |job| async move {
        // Every tenth job fails once, so the retry counters move too.
        let Payload(text) = job.payload();
        if text.ends_with('0') && job.attempt() == 1 {
            return Err::<Outcome, BoxError>("failed once on purpose".into());
        }
        Ok(Outcome::Ack)
    })?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while sub.metrics().acked < 200 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Warnings (a concurrency lowered to fit the pool, a missing claim index) and rows that do
    // not decode into the row type reach you without a tracing subscriber: in health(), and
    // once on standard error while no subscriber is installed.
    let health = sub.health();
    println!(
        "healthy: {}, warnings: {:?}",
        health.is_healthy(),
        health.warnings
    );
    sub.shutdown().await;

    // What a Prometheus server would scrape.
    let page = scrape(address).await?;
    for line in page.lines().filter(|l| l.contains("table=\"metered\"")) {
        if line.contains("_total") || line.contains("_count") || line.contains("in_work") {
            println!("{line}");
        }
    }
    if !page.contains("sqlx_broker_acked_total{table=\"metered\"} 200") {
        return Err("the exporter did not report 200 acked jobs".into());
    }
    broker.close().await;
    remove();
    Ok(())
}

/// `GET /metrics` over a plain TCP connection (HTTP/1.0: the server closes when done).
async fn scrape(address: std::net::SocketAddr) -> Result<String, BoxError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut page = String::new();
    stream.read_to_string(&mut page).await?;
    Ok(page)
}

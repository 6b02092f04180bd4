//! Many job kinds in one table: three kinds of jobs, each a serde type with its worker, one
//! subscription for all of them, and a row of a kind this process has no worker for, which it
//! leaves alone. Run it with `cargo run -p broker-sqlite --example sqlite_kinds`.
//!
//! It checks what it shows and exits with an error otherwise: each job ran once on its kind's
//! worker, the failing kind ended in the dead letters after its own two attempts, and the row of
//! the unknown kind is still waiting, its attempt untouched.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use broker_sqlite::{
    BoxError, ColumnType, DeadLetter, Job, JobKind, KindDefaults, KindRow, Outcome, Page,
    SqliteBackend, SubscribeOptions, TableDescription, Workers,
};
use serde::{Deserialize, Serialize};

/// A welcome mail.
#[derive(Serialize, Deserialize)]
struct WelcomeMail {
    user: i64,
    address: String,
}

impl JobKind for WelcomeMail {
    const KIND: &'static str = "welcome_mail";
    fn defaults() -> KindDefaults {
        // Mails go before thumbnails published earlier.
        KindDefaults::new().priority(10)
    }
}

/// A thumbnail to render.
#[derive(Serialize, Deserialize)]
struct Thumbnail {
    image: i64,
    width: u32,
}

impl JobKind for Thumbnail {
    const KIND: &'static str = "thumbnail";
    fn defaults() -> KindDefaults {
        KindDefaults::new().timeout(Duration::from_secs(10))
    }
}

/// A webhook whose endpoint is down: two attempts, then the dead letters.
#[derive(Serialize, Deserialize)]
struct Webhook {
    url: String,
}

impl JobKind for Webhook {
    const KIND: &'static str = "webhook";
    fn defaults() -> KindDefaults {
        KindDefaults::new().max_attempts(2)
    }
}

/// A kind another service runs; this process registers no worker for it.
#[derive(Serialize, Deserialize)]
struct Invoice {
    order: i64,
}

impl JobKind for Invoice {
    const KIND: &'static str = "invoice";
}

static MAILS: AtomicUsize = AtomicUsize::new(0);
static THUMBNAILS: AtomicUsize = AtomicUsize::new(0);

async fn send_welcome(job: Job<WelcomeMail>) -> Outcome {
    let mail = job.payload();
    println!("  mail to {} (user {})", mail.address, mail.user);
    MAILS.fetch_add(1, Ordering::SeqCst);
    Outcome::Ack
}

async fn render(job: Job<Thumbnail>) -> Outcome {
    let t = job.payload();
    println!("  thumbnail of image {} at {} px", t.image, t.width);
    THUMBNAILS.fetch_add(1, Ordering::SeqCst);
    Outcome::Ack
}

async fn call_webhook(job: Job<Webhook>) -> Result<Outcome, BoxError> {
    Err(format!(
        "{} answered 503 (attempt {})",
        job.payload().url,
        job.attempt()
    )
    .into())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("sqlx-broker-kinds.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let broker = SqliteBackend::connect(&format!("sqlite://{}", path.display())).await?;

    // A kinds table: the kind's name, its arguments as JSON, and the usual roles.
    let table = TableDescription::builder("jobs")
        .kind("kind")
        .payload("args", ColumnType::Json)
        .locked_until("locked_until")
        .due_at("due_at")
        .priority("priority")
        .last_error("last_error")
        .max_attempts(5)
        .dead_letter(DeadLetter::Table("jobs_dead".into()))
        .build()?;
    broker.create_tables(&table).await?;
    let queue = broker.queue::<KindRow>(table).await?;

    for image in 1..=3 {
        queue.enqueue(Thumbnail { image, width: 320 }).await?;
    }
    for user in 1..=3 {
        let address = format!("user{user}@example.com");
        queue.enqueue(WelcomeMail { user, address }).await?;
    }
    queue
        .enqueue(Webhook {
            url: "https://hooks.example.com/orders".into(),
        })
        .await?;
    let invoice = queue.enqueue(Invoice { order: 42 }).await?.id;
    let invoice_before = queue.row_state(invoice).await?;

    let workers = Workers::new()
        .register(send_welcome)
        .register(render)
        .register(call_webhook);
    let options = SubscribeOptions::new()
        .concurrency(1)
        .poll_interval(Duration::from_millis(100));
    let sub = queue.work(options, workers).await?;

    let deadline = Instant::now() + Duration::from_secs(30);
    while MAILS.load(Ordering::SeqCst) < 3
        || THUMBNAILS.load(Ordering::SeqCst) < 3
        || queue.dead_letters(Page::first(10)).await?.is_empty()
    {
        if Instant::now() > deadline {
            return Err("the jobs did not finish within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A few more polls pass over the invoice.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sub.shutdown().await;

    let dead = queue.dead_letters(Page::first(10)).await?;
    println!(
        "dead letters: {:?}",
        dead.iter()
            .map(|d| d.last_error.as_deref().unwrap_or(""))
            .collect::<Vec<_>>()
    );
    let waiting = queue.row_state(invoice).await?;
    println!("the invoice (no worker here) waits: {waiting:?}");
    if dead.len() != 1
        || !dead[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("attempt 2")
    {
        return Err("the webhook should be dead after its kind's two attempts".into());
    }
    if waiting != invoice_before {
        return Err("the invoice row should be untouched".into());
    }
    if queue.stats().await?.due.rows != 1 {
        return Err("only the invoice should be due".into());
    }
    println!("ok: every kind ran on its worker; the invoice waits for a process that knows it");
    broker.close().await;
    Ok(())
}

//! Middleware that carries an OpenTelemetry trace context from the code that publishes a job to
//! the handler that runs it, through a column of the row: the handler's span joins the
//! publisher's trace, however long the row waited and whichever process claimed it.
//!
//! The publisher injects the current context as a W3C `traceparent` into the row's
//! `trace_context` column; a tower layer around every handler of the subscription extracts it
//! and runs the handler inside a span whose parent is that context. The example checks that the
//! handler saw the publisher's trace id, and prints both.
//!
//! Run it with `cargo run -p broker-sqlite --example sqlite_trace_context`; it needs no server.
//! A real service would export the spans (an OTLP exporter on the tracer provider); here they
//! stay in the process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use broker_sqlite::{
    BoxError, BoxFuture, ColumnType, Job, Layer, NewJob, Outcome, Service, SqliteBackend,
    SubscribeOptions, TableDescription,
};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TraceId, TracerProvider};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// What the handler reads of a row.
#[derive(Debug, sqlx::FromRow)]
struct Signup {
    payload: String,
    /// The publisher's trace context, as a W3C `traceparent` header value.
    trace_context: String,
}

/// The publisher's side: the current span's context as a `traceparent` value.
fn current_traceparent() -> String {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&tracing::Span::current().context(), &mut carrier);
    carrier.remove("traceparent").unwrap_or_default()
}

/// The layer: every job's handler runs in a `job` span whose parent is the row's trace context.
#[derive(Clone)]
struct TraceContextLayer;

impl<S> Layer<S> for TraceContextLayer {
    type Service = WithTraceContext<S>;
    fn layer(&self, inner: S) -> WithTraceContext<S> {
        WithTraceContext(inner)
    }
}

#[derive(Clone)]
struct WithTraceContext<S>(S);

impl<S> Service<Job<Signup>> for WithTraceContext<S>
where
    S: Service<Job<Signup>, Response = Outcome, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Outcome, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, job: Job<Signup>) -> Self::Future {
        let carrier = HashMap::from([(
            "traceparent".to_owned(),
            job.payload().trace_context.clone(),
        )]);
        let parent = TraceContextPropagator::new().extract(&carrier);
        let span = tracing::info_span!("job", id = job.id(), attempt = job.attempt());
        // A row published outside any trace carries no context: its span starts a trace.
        let _ = span.set_parent(parent);
        let run = self.0.call(job).instrument(span.clone());
        Box::pin(async move {
            let result = run.await;
            span.in_scope(|| tracing::info!(?result, "job ended"));
            result
        })
    }
}

/// The trace the current span belongs to.
fn current_trace_id() -> TraceId {
    tracing::Span::current()
        .context()
        .span()
        .span_context()
        .trace_id()
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // Spans go to an in-process tracer provider (a real service adds an exporter).
    let provider = SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("example")));
    tracing::subscriber::set_global_default(subscriber)?;

    let path = std::env::temp_dir().join("sqlx-broker-example-trace.db");
    let remove = || {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    };
    remove();
    let broker = SqliteBackend::connect(&format!("sqlite://{}", path.display())).await?;
    let table = TableDescription::builder("signups")
        .payload("payload", ColumnType::Text)
        .column("trace_context", ColumnType::Text)
        .locked_until("locked_until")
        .build()?;
    broker.create_tables(&table).await?;
    let queue = broker.queue::<Signup>(table).await?;

    // The publisher, inside a request's span: the row carries the span's context.
    let request = tracing::info_span!("signup request");
    let published_trace = async {
        queue
            .publish(
                NewJob::new("ada@example.com".to_owned())
                    .column("trace_context", current_traceparent()),
            )
            .await?;
        Ok::<_, BoxError>(current_trace_id())
    }
    .instrument(request)
    .await?;

    // The worker: every handler of the subscription runs behind the layer.
    let seen = Arc::new(Mutex::new(None));
    let record = seen.clone();
    let subscription = queue.subscribe_layered(
        SubscribeOptions::new().poll_interval(Duration::from_millis(50)),
        TraceContextLayer,
        move |job: Job<Signup>| {
            let record = record.clone();
            async move {
                let trace = current_trace_id();
                println!("welcome mail to {} in trace {trace}", job.payload().payload);
                *record.lock().unwrap() = Some(trace);
                Outcome::Ack
            }
        },
    )?;
    for _ in 0..200 {
        if seen.lock().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    subscription.shutdown().await;
    broker.close().await;
    remove();

    let handled_trace = seen.lock().unwrap().take().ok_or("the job never ran")?;
    println!("published in trace {published_trace}");
    assert_ne!(
        published_trace,
        TraceId::INVALID,
        "the publisher was in a trace"
    );
    assert_eq!(
        handled_trace, published_trace,
        "the handler ran in the publisher's trace"
    );
    println!("the handler's span joined the publisher's trace");
    provider.shutdown()?;
    Ok(())
}

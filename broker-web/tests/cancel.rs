//! The dashboard's cancel of a row in work (issue #48): the job page offers it, the POST
//! signals the row's holder and says so, and the holder's handler sees an operator's cancel
//! and the row is deleted. Over a real SQLite queue, request by request (tower's `oneshot`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use broker_core::{CancelReason, ColumnType, Outcome, Payload, SubscribeOptions, TableDescription};
use broker_sqlite::SqliteBackend;
use broker_web::Dashboard;
use tower::ServiceExt;

const BASE: &str = "/admin/queues";

/// Sends one request from 127.0.0.1; returns the status, the Location and Set-Cookie headers,
/// and the body.
async fn send(
    app: &Router,
    method: &str,
    path: &str,
    cookie: Option<&str>,
    form: Option<&str>,
) -> (StatusCode, String, Option<String>, String) {
    let uri = if path.starts_with(BASE) {
        path.to_owned()
    } else {
        format!("{BASE}{path}")
    };
    let mut r = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::HOST, "127.0.0.1:8080");
    if let Some(c) = cookie {
        r = r.header(header::COOKIE, c);
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
    let location = response
        .headers()
        .get(header::LOCATION)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let cookie = response
        .headers()
        .get(header::SET_COOKIE)
        .map(|v| v.to_str().unwrap().split(';').next().unwrap().to_owned());
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        location,
        cookie,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

/// The CSRF token of the first form on `page`.
fn csrf(page: &str) -> String {
    let at = page
        .find(r#"name="csrf" value=""#)
        .unwrap_or_else(|| panic!("no form on the page: {page}"));
    let rest = &page[at + r#"name="csrf" value=""#.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dashboard_cancels_a_row_in_work_through_its_holder() {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("web-cancel"));
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
    let q = broker.queue::<Payload<String>>(t).await.unwrap();
    let id = q
        .publish(broker_core::NewJob::new("runs".to_owned()))
        .await
        .unwrap();
    let seen: Arc<Mutex<Option<CancelReason>>> = Arc::default();
    let saw = seen.clone();
    let sub = q
        .subscribe(
            SubscribeOptions::new().poll_interval(Duration::from_millis(100)),
            move |job| {
                let saw = saw.clone();
                async move {
                    *saw.lock().unwrap() = Some(job.cancelled().await);
                    Outcome::Ack
                }
            },
        )
        .unwrap();
    broker_testkit::wait_until("the row in work", Duration::from_secs(30), || {
        let q = q.clone();
        async move {
            q.row_state(id)
                .await
                .unwrap()
                .is_some_and(|r| r.locked_until_ms.is_some())
        }
    })
    .await;
    let app = Router::new().nest(BASE, Dashboard::new().queue(q.clone()).router());

    let (status, _, cookie, page) =
        send(&app, "GET", &format!("/queues/jobs/jobs/{id}"), None, None).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains("Cancel (in work)"),
        "the job page offers it: {page}"
    );
    let cookie = cookie.expect("a CSRF cookie");
    let form = format!("csrf={}", csrf(&page));
    let (status, location, _, body) = send(
        &app,
        "POST",
        &format!("/queues/jobs/jobs/{id}/cancel"),
        Some(&cookie),
        Some(&form),
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER, "{body}");
    assert!(location.contains("done=cancel-signalled"), "{location}");
    let (_, _, _, shown) = send(&app, "GET", &location, Some(&cookie), None).await;
    assert!(shown.contains("its holder was signalled"), "{shown}");

    broker_testkit::wait_until("the handler signalled", Duration::from_secs(30), || {
        let got = seen.lock().unwrap().is_some();
        async move { got }
    })
    .await;
    assert_eq!(*seen.lock().unwrap(), Some(CancelReason::Cancelled));
    broker_testkit::wait_until("the row deleted", Duration::from_secs(30), || {
        let q = q.clone();
        async move { q.row_state(id).await.unwrap().is_none() }
    })
    .await;
    sub.shutdown().await;
    assert_eq!(q.metrics().cancelled, 1);
    broker.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

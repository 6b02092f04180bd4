//! The dashboard of a kinds table, request by request over a real SQLite queue: the queue page
//! shows the counts by kind and each listed row's kind, and a kind written by other software
//! (markup in it) shows as text.

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use broker_core::{ColumnType, DeadLetter, JobKind, KindRow, TableDescription};
use broker_sqlite::SqliteBackend;
use broker_web::Dashboard;
use tower::ServiceExt;

#[derive(serde::Serialize, serde::Deserialize)]
struct Resize {
    image: i64,
}
impl JobKind for Resize {
    const KIND: &'static str = "resize";
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Export {
    user: i64,
}
impl JobKind for Export {
    const KIND: &'static str = "export";
}

const HOSTILE: &str = "<script>alert(1)</script><b>bold</b>";

/// GET `path` of `app` from 127.0.0.1: status and body.
async fn get(app: &Router, path: &str) -> (StatusCode, String) {
    let r = Request::builder()
        .uri(format!("/admin{path}"))
        .header(header::HOST, "127.0.0.1:8080")
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(r).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 22)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_page_counts_by_kind_and_lists_each_rows_kind_as_text() {
    let dir = std::env::temp_dir().join(broker_testkit::unique_name("web-kinds"));
    std::fs::create_dir_all(&dir).unwrap();
    let broker = SqliteBackend::connect(&format!("sqlite://{}/q.db", dir.display()))
        .await
        .unwrap();
    let t = TableDescription::builder("jobs")
        .payload("args", ColumnType::Json)
        .kind("kind")
        .locked_until("locked_until")
        .due_at("due_at")
        .max_attempts(1)
        .dead_letter(DeadLetter::Table("jobs_dead".into()))
        .build()
        .unwrap();
    broker.create_tables(&t).await.unwrap();
    let q = broker.queue::<KindRow>(t.clone()).await.unwrap();
    for image in 0..3 {
        q.enqueue(Resize { image }).await.unwrap();
    }
    let export = q.enqueue(Export { user: 7 }).await.unwrap().id;
    let dead = q.claim(1).await.unwrap().pop().unwrap();
    assert_eq!(dead.payload().kind(), "resize");
    dead.dead_letter().await.unwrap();
    sqlx::query("INSERT INTO jobs (args, kind, attempt) VALUES ('{}', ?1, 1)")
        .bind(HOSTILE)
        .execute(broker.pool())
        .await
        .unwrap();
    let app = Router::new().nest(
        "/admin",
        Dashboard::new()
            .queue(broker.queue::<()>(t.clone()).await.unwrap())
            .router(),
    );

    let (status, page) = get(&app, "/queues/jobs?state=due").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("By kind"), "{page}");
    // One row per kind: due, scheduled, in work, retrying, dead, finished.
    let row = |kind: &str| {
        let at = page
            .find(&format!("<code>{kind}</code>"))
            .unwrap_or_else(|| panic!("no row of kind {kind}: {page}"));
        let end = at + page[at..].find("</tr>").unwrap();
        page[at..end]
            .split("<td")
            .skip(1)
            .map(|cell| {
                let text = &cell[cell.find('>').unwrap() + 1..];
                text[..text.find('<').unwrap()].to_owned()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(row("resize"), ["2", "0", "0", "0", "1", "–"], "{page}");
    assert_eq!(row("export"), ["1", "0", "0", "0", "0", "–"], "{page}");
    // The kind other software wrote is text, never markup.
    assert!(!page.contains("<script>alert"), "{page}");
    assert!(!page.contains("<b>bold"), "{page}");
    assert!(
        page.contains("&lt;script&gt;alert(1)&lt;/script&gt;&lt;b&gt;bold&lt;/b&gt;"),
        "{page}"
    );
    // The listing has a Kind column with each row's kind.
    assert!(page.contains("<th>Kind</th>"), "{page}");
    assert_eq!(
        page.matches("<td class=\"kind\"><code>resize</code></td>")
            .count(),
        2,
        "{page}"
    );
    assert_eq!(
        page.matches("<td class=\"kind\"><code>export</code></td>")
            .count(),
        1,
        "{page}"
    );
    let (_, page) = get(&app, "/queues/jobs?state=dead").await;
    assert_eq!(
        page.matches("<td class=\"kind\"><code>resize</code></td>")
            .count(),
        1,
        "{page}"
    );
    // A kind's rows alone, from the link in its row of counts; the tabs keep the kind.
    assert!(page.contains("?state=due&amp;kind=export\""), "{page}");
    let (status, page) = get(&app, "/queues/jobs?state=due&kind=export").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("Rows of kind <code>export</code>"), "{page}");
    assert_eq!(page.matches("<td class=\"kind\">").count(), 1, "{page}");
    assert!(page.contains("?state=dead&amp;kind=export\""), "{page}");
    // The hostile kind's link is percent-encoded, its rows listed by it.
    let (_, page) = get(
        &app,
        "/queues/jobs?state=due&kind=%3Cscript%3Ealert(1)%3C%2Fscript%3E%3Cb%3Ebold%3C%2Fb%3E",
    )
    .await;
    assert_eq!(page.matches("<td class=\"kind\">").count(), 1, "{page}");
    assert!(!page.contains("<script>alert"), "{page}");
    // A row's page names its kind.
    let (status, page) = get(&app, &format!("/queues/jobs/jobs/{export}")).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains("<dd id=\"kind\"><code>export</code></dd>"),
        "{page}"
    );
    broker.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

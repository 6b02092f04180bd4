//! The kinds bench binary (`--bin kinds`) runs end to end on SQLite at a tiny size: both sides
//! drain every row once (the binary fails otherwise) and the report is written. No timing is
//! asserted.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn kinds_bench_runs_on_sqlite_at_a_tiny_size() {
    let out = std::env::temp_dir().join(format!("sxb-kinds-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kinds"))
        .args([
            "--db", "sqlite", "--rows", "120", "--rounds", "2", "--limit", "60",
        ])
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the kinds bench");
    // Bounded: a hung drain fails this case by name rather than hanging the suite.
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the kinds bench") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            panic!("kinds_bench_runs_on_sqlite_at_a_tiny_size: the bench ran over 180 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::io::read_to_string(child.stderr.take().expect("the bench's stderr"))
        .unwrap_or_default();
    assert!(
        status.success(),
        "the kinds bench failed ({status}):\n{stderr}"
    );
    assert_eq!(
        stderr.matches("round ").count(),
        2,
        "two rounds reported:\n{stderr}"
    );
    let report = std::fs::read_to_string(out.join("kinds.md")).expect("kinds.md written");
    assert!(
        report.contains("| SQLite | lease |"),
        "a SQLite lease row in the report:\n{report}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

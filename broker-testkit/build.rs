//! Whether the suite may restart, stop or reconfigure the servers it is given: with
//! `SQLX_BROKER_DISRUPTIVE=1` at build time (`.ci/run` sets it), `broker_testkit::disruptive_test!` stamps
//! runnable tests; without it, ignored ones that say why. Test binaries are built and run by one
//! `cargo test`, so the variable of that command decides; changing it rebuilds the tests.

fn main() {
    println!("cargo:rerun-if-env-changed=SQLX_BROKER_DISRUPTIVE");
    println!("cargo:rustc-check-cfg=cfg(sqlx_broker_disruptive)");
    if std::env::var("SQLX_BROKER_DISRUPTIVE").is_ok_and(|v| v == "1") {
        println!("cargo:rustc-cfg=sqlx_broker_disruptive");
    }
}

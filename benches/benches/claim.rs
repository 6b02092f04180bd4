//! Claim + ack throughput under criterion: for every scenario of the bench matrix, an `engine`
//! and a `raw` benchmark in one group, so criterion reports them side by side (elements/s is
//! msg/s).
//!
//! Each sample fills a table of its own with the sample's rows plus a warm-up, starts the
//! engine's subscription or the raw loop's tasks, and times only the rows after the warm-up.
//! Narrow the matrix with the binary's flags in `SQLX_BROKER_BENCH_ARGS` (e.g.
//! `SQLX_BROKER_BENCH_ARGS="--db sqlite --mode lease" cargo bench --manifest-path
//! benches/Cargo.toml`), or with criterion's name filter (`cargo bench --manifest-path
//! benches/Cargo.toml -- postgres/lease`). A selected database that is unreachable fails the
//! bench with the same message as the binary. Under
//! `cargo test --benches` each benchmark runs once, without a warm-up, as a smoke test.

use std::time::Duration;

use benches::cli::Options;
use benches::drain::RunLimits;
use benches::run::connect_all;
use benches::target::{Side, Urls};
use benches::timed::count_f64;
use criterion::{Criterion, SamplingMode, Throughput, criterion_main};

fn claim(c: &mut Criterion) {
    let args = std::env::var("SQLX_BROKER_BENCH_ARGS").unwrap_or_default();
    let options = Options::parse(args.split_whitespace().map(str::to_owned))
        .unwrap_or_else(|e| panic!("SQLX_BROKER_BENCH_ARGS: {e}"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    // `cargo test --benches` runs each benchmark once without `--bench`: skip the warm-up there.
    let smoke_test = !std::env::args().any(|a| a == "--bench");
    let targets = runtime
        .block_on(connect_all(&options.filter.used_dbs(), &Urls::from_env()))
        .unwrap_or_else(|e| panic!("{e}"));
    for target in &targets {
        let scenarios = options.filter.scenarios();
        for scenario in scenarios.iter().filter(|s| s.db == target.db()) {
            let mut group = c.benchmark_group(format!("claim/{}", scenario.id()));
            group
                .throughput(Throughput::Elements(1))
                .sample_size(10)
                .warm_up_time(Duration::from_secs(1))
                .measurement_time(Duration::from_secs(3))
                .sampling_mode(SamplingMode::Flat);
            let warmup = if smoke_test {
                0
            } else {
                u64::try_from((scenario.workers * scenario.batch).max(16)).unwrap_or(16)
            };
            for (name, side) in [
                ("engine", Side::Engine),
                ("hand-written", Side::HandWritten),
            ] {
                group.bench_function(name, |b| {
                    b.iter_custom(|iters| {
                        let limits = RunLimits {
                            rows: iters + warmup,
                            warmup,
                            // A FIFO table with one group makes the engine wait a poll
                            // interval per row today; the cap keeps such a sample finite (its
                            // rate still comes from the rows it did).
                            cap: Duration::from_secs(20),
                        };
                        let run = runtime
                            .block_on(target.run_side(scenario, side, limits))
                            .unwrap_or_else(|e| panic!("{}: {e}", scenario.id()));
                        // The timed stretch may hold a row more or less than asked for.
                        if run.timed_rows == 0 {
                            run.elapsed
                        } else {
                            run.elapsed
                                .mul_f64(count_f64(iters) / count_f64(run.timed_rows))
                        }
                    });
                });
            }
            group.finish();
        }
    }
    runtime.block_on(async {
        for t in targets {
            t.close().await;
        }
    });
}

/// The benchmark group (what `criterion_group!` would write, with a doc comment).
fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    claim(&mut criterion);
}

criterion_main!(benches);

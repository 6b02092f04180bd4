//! The bench binary: `cargo run --manifest-path benches/Cargo.toml --release -- --quick` (see
//! `--help`).

use std::process::ExitCode;

use benches::cli::Options;
use benches::report;

fn main() -> ExitCode {
    let options = match Options::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => e.exit(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(url) = &options.url {
        eprintln!(
            "claim comparison on {} ({} rows per run, {} rounds per side, workers and batch per row below; tables sxb_bench_{}_.., each dropped after its run)",
            broker_core::redact_passwords(url),
            options.profile.rows,
            options.profile.reps,
            std::process::id()
        );
    }
    let result = runtime.block_on(async {
        tokio::select! {
            r = benches::run::run(&options, |line| eprintln!("{line}")) => Some(r),
            _ = tokio::signal::ctrl_c(), if options.url.is_some() => None,
        }
    });
    // A run cut short (an error, Ctrl-C) may leave its table on the user's server: drop it.
    if let Some(url) = &options.url
        && !matches!(result, Some(Ok(_)))
    {
        match runtime.block_on(benches::run::sweep(url)) {
            Ok(n) => eprintln!("cleaned up: {n} tables of this run dropped"),
            Err(e) => eprintln!(
                "error: cleaning up: {e}; drop the tables named sxb_bench_{}_.. by hand",
                std::process::id()
            ),
        }
    }
    let Some(result) = result else {
        eprintln!("interrupted");
        return ExitCode::from(130);
    };
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let markdown = report::markdown(&report);
    println!("{markdown}");
    if let Some(dir) = &options.out {
        let stem = if options.filtered {
            format!("{}-partial", report.profile)
        } else {
            report.profile.clone()
        };
        let title = format!(
            "sqlx-broker claim + ack throughput ({}): vs hand-written sqlx and ruststream-sqlx",
            report.profile
        );
        let written = report::svg(&title, &report.scenarios).and_then(|svg| {
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(dir.join(format!("{stem}.md")), &markdown))
                .and_then(|()| std::fs::write(dir.join(format!("{stem}.svg")), svg))
                .map_err(Into::into)
        });
        match written {
            Ok(()) => eprintln!("wrote {}/{stem}.md and {stem}.svg", dir.display()),
            Err(e) => {
                eprintln!("error: cannot write results to {}: {e}", dir.display());
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

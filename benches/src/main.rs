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
    let result = runtime.block_on(benches::run::run(&options, |line| eprintln!("{line}")));
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

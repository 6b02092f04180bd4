//! Backlog shapes (issue #13): the engine on tables whose first rows cannot be claimed now,
//! as a ratio to the plain table in the same run, and how one claim's time grows with the
//! table. See `benches::backlog`.
//!
//! `cargo run --manifest-path benches/Cargo.toml --release --bin backlog -- --quick` (see
//! `--help`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use benches::BoxError;
use benches::backlog::{self, Shape, ShapeResult, Sizes};
use benches::cli::ServerUrls;
use benches::scenario::{Db, Scenario, mode_key};
use broker_core::Broker;
use broker_mysql::MySqlBackend;
use broker_postgres::PgBackend;
use broker_sqlite::SqliteBackend;
use clap::Parser;

/// Backlog shapes against plain tables, and claim time against table size.
#[derive(Debug, Parser)]
struct Args {
    /// Small tables (50,000 rows, 10,000 ahead), as CI runs it.
    #[arg(long)]
    quick: bool,
    /// Databases (postgres, mariadb, sqlite).
    #[arg(long, value_delimiter = ',', default_value = "postgres,mariadb,sqlite")]
    db: Vec<String>,
    /// Shapes (notdue, fifobusy, heldkey).
    #[arg(long, value_delimiter = ',', default_value = "notdue,fifobusy,heldkey")]
    shape: Vec<String>,
    /// Rows per claim.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batch: Vec<usize>,
    /// Deliveries in work at once.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Skip the claim-time growth measurement.
    #[arg(long)]
    no_growth: bool,
    /// Where to write `backlog-{quick,full}.md` and `.svg`.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    out: PathBuf,
    /// The servers.
    #[command(flatten)]
    servers: ServerUrls,
}

fn main() -> ExitCode {
    let args = Args::parse();
    benches::block_on(run(&args))
}

/// The sizes of a shape on a database.
fn sizes(quick: bool, db: Db, shape: Shape) -> Sizes {
    if quick {
        return Sizes {
            total: 50_000,
            ahead: 10_000,
            acks: 1_000,
            cap: Duration::from_secs(5),
        };
    }
    let (total, ahead) = match (db, shape) {
        (Db::Postgres, Shape::NotDue) => (1_000_000, 200_000),
        _ => (300_000, 100_000),
    };
    Sizes {
        total,
        ahead,
        acks: 3_000,
        cap: Duration::from_secs(30),
    }
}

/// Runs `$body` with `$b` bound to a broker of `db`.
macro_rules! with_broker {
    ($db:expr, $args:expr, $b:ident => $body:expr) => {
        match $db {
            Db::Postgres => {
                let $b: Broker<PgBackend> = PgBackend::connect(&$args.servers.pg_url)
                    .await
                    .map_err(|e| format!("PostgreSQL at {}: {e}", $args.servers.pg_url))?;
                let out = $body;
                $b.close().await;
                out
            }
            Db::MariaDb => {
                let $b: Broker<MySqlBackend> = MySqlBackend::connect(&$args.servers.mysql_url)
                    .await
                    .map_err(|e| format!("MariaDB at {}: {e}", $args.servers.mysql_url))?;
                let out = $body;
                $b.close().await;
                out
            }
            Db::Sqlite => {
                let file = std::env::temp_dir()
                    .join(format!("sqlx-broker-backlog-{}.db", std::process::id()));
                let $b: Broker<SqliteBackend> =
                    SqliteBackend::connect(&format!("sqlite://{}", file.display())).await?;
                let out = $body;
                $b.close().await;
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
                }
                out
            }
        }
    };
}

async fn run(args: &Args) -> Result<(), BoxError> {
    let dbs: Vec<Db> = args
        .db
        .iter()
        .map(|s| Db::parse(s).ok_or_else(|| format!("unknown database {s:?}")))
        .collect::<Result<_, _>>()?;
    let shapes: Vec<Shape> = args
        .shape
        .iter()
        .map(|s| Shape::parse(s).ok_or_else(|| format!("unknown shape {s:?}")))
        .collect::<Result<_, _>>()?;
    let growth_sizes: &[usize] = if args.quick {
        &[10_000, 50_000]
    } else {
        &[10_000, 100_000, 1_000_000]
    };
    let mut results: Vec<ShapeResult> = Vec::new();
    let mut growth: Vec<(Db, Vec<(usize, Duration)>)> = Vec::new();
    for &db in &dbs {
        with_broker!(db, args, broker => {
            for &shape in &shapes {
                for mode in shape.modes(db) {
                    for &batch in &args.batch {
                        let scenario = Scenario {
                            db,
                            mode,
                            workers: args.workers,
                            batch,
                            fifo_groups: None,
                        };
                        let s = sizes(args.quick, db, shape);
                        let r = backlog::measure(&broker, scenario, shape, s).await?;
                        eprintln!(
                            "{} {} {} b{}: plain {:.0} msg/s, backlog {:.0} msg/s, ratio {:.2}",
                            db.label(),
                            shape.key(),
                            mode_key(mode),
                            batch,
                            r.plain.rate(),
                            r.backlog.rate(),
                            r.ratio()
                        );
                        results.push(r);
                    }
                }
            }
            if !args.no_growth {
                let mut points = Vec::new();
                for &total in growth_sizes {
                    let t = backlog::claim_time(&broker, db, total, 200).await?;
                    eprintln!("{} claim + ack at {total} rows: {t:?}", db.label());
                    points.push((total, t));
                }
                growth.push((db, points));
            }
            Ok::<(), BoxError>(())
        })?;
    }
    let profile = if args.quick { "quick" } else { "full" };
    let md = markdown(profile, args.workers, &results, &growth);
    println!("{md}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join(format!("backlog-{profile}.md")), &md)?;
    if !growth.is_empty() {
        std::fs::write(
            args.out.join(format!("backlog-{profile}.svg")),
            plot(profile, &growth)?,
        )?;
    }
    eprintln!("wrote {}/backlog-{profile}.md", args.out.display());
    Ok(())
}

fn markdown(
    profile: &str,
    workers: usize,
    results: &[ShapeResult],
    growth: &[(Db, Vec<(usize, Duration)>)],
) -> String {
    let mut md = format!(
        "# Backlog shapes ({profile})\n\nThe engine ({workers} workers, an instant ack) on a table whose first rows cannot be claimed now, against the same table with every row claimable, in the same run. A ratio near 1 means the claim does not read the rows ahead.\n\n| database | shape | mode | batch | rows (ahead) | plain msg/s | backlog msg/s | ratio |\n|---|---|---|---:|---|---:|---:|---:|\n"
    );
    for r in results {
        let capped = if r.backlog.capped { " (capped)" } else { "" };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} ({}) | {:.0} | {:.0}{capped} | {:.2} |",
            r.scenario.db.label(),
            r.shape.key(),
            mode_key(r.scenario.mode),
            r.scenario.batch,
            r.sizes.total,
            r.sizes.ahead,
            r.plain.rate(),
            r.backlog.rate(),
            r.ratio()
        );
    }
    if !growth.is_empty() {
        md.push_str("\n## One claim and its ack against table size\n\nLease mode, claimed one at a time by hand, a fifth of the rows scheduled ahead.\n\n| database | rows | mean claim + ack |\n|---|---:|---:|\n");
        for (db, points) in growth {
            for (total, t) in points {
                let _ = writeln!(
                    md,
                    "| {} | {total} | {:.2} ms |",
                    db.label(),
                    t.as_secs_f64() * 1e3
                );
            }
        }
    }
    md
}

fn plot(profile: &str, growth: &[(Db, Vec<(usize, Duration)>)]) -> Result<String, BoxError> {
    use plotters::prelude::*;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let max_rows = growth
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(n, _)| *n))
            .max()
            .unwrap_or(10_000) as f64;
        let max_ms = growth
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, t)| t.as_secs_f64() * 1e3))
            .fold(0.1, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "one claim + ack vs table size, lease, a fifth scheduled ahead ({profile})"
                ),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d((5_000f64..max_rows * 1.5).log_scale(), 0f64..max_ms * 1.2)?;
        chart
            .configure_mesh()
            .x_desc("rows in the table")
            .y_desc("ms")
            .draw()?;
        let colors = [
            RGBColor(51, 102, 204),
            RGBColor(220, 57, 18),
            RGBColor(16, 150, 24),
        ];
        for (i, (db, points)) in growth.iter().enumerate() {
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(
                    points
                        .iter()
                        .map(|(n, t)| (*n as f64, t.as_secs_f64() * 1e3)),
                    color.stroke_width(2),
                ))?
                .label(db.label())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

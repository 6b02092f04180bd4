//! What the bench process and its host look like while a bench runs: the process's memory, the
//! load average, the command line, the wall clock. On Linux; elsewhere the readings are `None`.

use std::time::{SystemTime, UNIX_EPOCH};

/// The process's resident memory (`VmRSS` of `/proc/self/status`), in KiB.
pub fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The 1, 5 and 15 minute load averages, as `/proc/loadavg` writes them (`"2.06 6.22 7.71"`).
pub fn load_average() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let fields: Vec<&str> = s.split_whitespace().take(3).collect();
    (fields.len() == 3).then(|| fields.join(" "))
}

/// Removes a SQLite database file and its `-wal` and `-shm` files, whichever exist: what a
/// bench's temporary database leaves.
pub fn remove_sqlite_files(file: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut p = file.as_os_str().to_owned();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

/// The 1-minute load average alone (the first of [`load_average`]).
pub fn load_average_1m() -> Option<String> {
    load_average()?.split(' ').next().map(str::to_owned)
}

/// The CPU model and memory, where the platform tells (Linux).
pub fn machine() -> Option<String> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let model = cpu
        .lines()
        .find_map(|l| l.strip_prefix("model name"))?
        .trim_start_matches([' ', '\t', ':'])
        .to_owned();
    let mem = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = mem
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(format!(
        "{model}, {} GiB",
        (kib + 512 * 1024) / (1024 * 1024)
    ))
}

/// The number of CPUs the process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The command line this process was started with, program name shortened to its file name.
pub fn command_line() -> String {
    let mut args = std::env::args();
    let program = args
        .next()
        .map(|p| {
            std::path::Path::new(&p)
                .file_name()
                .map_or(p.clone(), |f| f.to_string_lossy().into_owned())
        })
        .unwrap_or_default();
    std::iter::once(program)
        .chain(args)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Microseconds since the unix epoch on this host's clock (0 before 1970).
pub fn unix_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

//! The `workload` example (`examples/workload.rs`) as real OS processes, for the fault-injection
//! tests and the fault benchmarks: building it ([`build_example`]), running it ([`Workload`]),
//! its JSON-lines log ([`LogLine`]) and the checker of the guarantees a fault must not break
//! ([`check`]).
//!
//! Times are wall-clock µs since the Unix epoch ([`now_us`]), as in the workload's log lines, so
//! the caller's own instants (when it sent a signal) compare with the processes' lines.

mod check;
mod log;
mod process;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use check::{CONT_GRACE_US, Interval, Report, Stop, check};
pub use check::{check_allowing_unreplicated_loss, check_without_key_order};
pub use log::HookCall;
pub use log::{
    Expected, FenceRejected, Handled, HandlerCall, Handling, LogLine, Ownership, ProcessLog, Read,
    Ready,
};
pub use process::{Workload, first_read_since, handled_messages, owned_before};

/// Wall-clock µs since the Unix epoch.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Polls `done` every 50 ms, blocking the thread, until it holds or `deadline` passes; returns
/// its last value. (Not faster: the conditions scan logs, and the caller shares the CPU with the
/// processes it watches. Measured times come from the logs' timestamps, not from polling.)
pub fn poll_until(deadline: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

/// Builds the example `name` with `cargo build <cargo_args> --example <name>` run by `cargo` in
/// `manifest_dir` (pass `env!("CARGO")` and `env!("CARGO_MANIFEST_DIR")`), so cargo decides
/// whether it is up to date; returns the executable's path as cargo reports it (so
/// `CARGO_TARGET_DIR` works).
///
/// # Panics
///
/// When cargo does not run, the build fails, or cargo reports no executable.
pub fn build_example(cargo: &str, manifest_dir: &str, cargo_args: &[&str], name: &str) -> String {
    let output = Command::new(cargo)
        .arg("build")
        .args(cargo_args)
        .args([
            "--example",
            name,
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(manifest_dir)
        .stderr(Stdio::inherit())
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "building examples/{name}.rs failed"
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("cargo reports the {name} executable"))
}

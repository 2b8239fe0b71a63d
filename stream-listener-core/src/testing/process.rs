//! Child processes: one long-lived spawner thread, the parent-death signal, and Unix signals.
//!
//! On Linux every child gets `prctl(PR_SET_PDEATHSIG, SIGKILL)`, so it dies with the test process
//! even when that process is killed with `SIGKILL` and no destructor runs. The kernel sends that
//! signal when the *thread* that forked the child exits, not the process, and tests create servers
//! from short-lived threads and tokio workers; so every child is forked by one dedicated thread that
//! lives as long as the process. Elsewhere (macOS) children are killed on `Drop` only.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;

use super::HarnessError;

/// What to run: built into a [`Command`] on the spawner thread.
#[derive(Debug)]
pub(crate) struct SpawnSpec {
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<OsString>,
    pub(crate) cwd: PathBuf,
    /// Receives both stdout and stderr.
    pub(crate) output: File,
}

struct Request {
    spec: SpawnSpec,
    reply: mpsc::SyncSender<io::Result<Child>>,
}

/// Spawns `spec` from the harness's spawner thread and returns the child.
///
/// # Errors
///
/// [`HarnessError::SpawnerGone`] if the spawner thread could not be started or has died, and
/// [`HarnessError::Spawn`] if the OS refused to start the program.
pub(crate) fn spawn(spec: SpawnSpec) -> Result<Child, HarnessError> {
    let sender = spawner().ok_or(HarnessError::SpawnerGone)?;
    let program = spec.program.clone();
    let (reply, answer) = mpsc::sync_channel(1);
    sender
        .send(Request { spec, reply })
        .map_err(|_| HarnessError::SpawnerGone)?;
    answer
        .recv()
        .map_err(|_| HarnessError::SpawnerGone)?
        .map_err(|source| HarnessError::Spawn { program, source })
}

fn spawner() -> Option<&'static mpsc::Sender<Request>> {
    static SPAWNER: OnceLock<Option<mpsc::Sender<Request>>> = OnceLock::new();
    SPAWNER
        .get_or_init(|| {
            let (sender, requests) = mpsc::channel::<Request>();
            std::thread::Builder::new()
                .name("stream-listener-redis-spawner".into())
                .spawn(move || {
                    // The static sender is never dropped, so this loop runs until the process ends.
                    for request in requests {
                        let child = spawn_here(request.spec);
                        // The requester may have given up; the child is then dropped, and
                        // reaped by nobody, but it still dies with this process.
                        let _ = request.reply.send(child);
                    }
                })
                .ok()
                .map(|_| sender)
        })
        .as_ref()
}

fn spawn_here(spec: SpawnSpec) -> io::Result<Child> {
    let stderr = spec.output.try_clone()?;
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(spec.output))
        .stderr(Stdio::from(stderr));
    die_with_parent(&mut command);
    command.spawn()
}

/// Makes the child receive `SIGKILL` when the thread that forks it (the spawner) exits, which
/// happens only when the whole process ends.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs in the forked child before `exec`. It only calls prctl(2) and
    // getppid(2), both async-signal-safe, and builds `io::Error`s from raw OS codes, which
    // allocates nothing and takes no lock.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) == -1
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl: then nobody would kill us.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

/// A signal the harness sends to a Redis process.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Signal {
    Stop,
    Cont,
}

impl Signal {
    fn name(self) -> &'static str {
        match self {
            Self::Stop => "SIGSTOP",
            Self::Cont => "SIGCONT",
        }
    }

    fn number(self) -> libc::c_int {
        match self {
            Self::Stop => libc::SIGSTOP,
            Self::Cont => libc::SIGCONT,
        }
    }
}

/// Sends `signal` to the process `child`. The child must not have been reaped (waited for), so its
/// pid cannot have been reused.
pub(crate) fn send_signal(child: &Child, signal: Signal) -> Result<(), HarnessError> {
    let pid = child.id();
    let error = |source| HarnessError::Signal {
        signal: signal.name(),
        pid,
        source,
    };
    let raw = libc::pid_t::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| error(io::Error::from_raw_os_error(libc::ESRCH)))?;
    kill(raw, signal.number()).map_err(error)
}

#[allow(unsafe_code)]
fn kill(pid: libc::pid_t, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: kill(2) takes two integers and touches no memory of this process; `pid` is positive,
    // so it names one process, never a process group.
    let rc = unsafe { libc::kill(pid, signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

//! Finding the `redis-server` and `redis-cli` binaries.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::HarnessError;

/// Environment variable naming the `redis-server` binary the harness runs (default: `redis-server`
/// found on `PATH`).
pub const REDIS_SERVER_ENV: &str = "STREAM_LISTENER_REDIS_SERVER";

/// Environment variable naming the `redis-cli` binary the harness runs to create clusters (default:
/// `redis-cli` found on `PATH`).
pub const REDIS_CLI_ENV: &str = "STREAM_LISTENER_REDIS_CLI";

/// One of the two Redis binaries the harness runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Binary {
    Server,
    Cli,
}

impl Binary {
    fn name(self) -> &'static str {
        match self {
            Self::Server => "redis-server",
            Self::Cli => "redis-cli",
        }
    }

    fn env_var(self) -> &'static str {
        match self {
            Self::Server => REDIS_SERVER_ENV,
            Self::Cli => REDIS_CLI_ENV,
        }
    }

    /// Resolves the binary: the explicit override first, then the environment variable, then
    /// `PATH`.
    pub(crate) fn resolve(self, explicit: Option<&Path>) -> Result<PathBuf, HarnessError> {
        let not_installed = |looked_for: String| HarnessError::RedisNotInstalled {
            binary: self.name(),
            looked_for,
            env_var: self.env_var(),
        };
        if let Some(path) = explicit {
            return check_file(path)
                .ok_or_else(|| not_installed(format!("{} (builder option)", path.display())));
        }
        if let Some(value) = std::env::var_os(self.env_var()).filter(|v| !v.is_empty()) {
            let path = PathBuf::from(&value);
            return check_file(&path).ok_or_else(|| {
                not_installed(format!("{} (from {})", path.display(), self.env_var()))
            });
        }
        find_on_path(self.name(), std::env::var_os("PATH"))
            .ok_or_else(|| not_installed(format!("`{}` on PATH", self.name())))
    }
}

/// `Some(path)` when `path` is an existing regular file (or a symlink to one).
fn check_file(path: &Path) -> Option<PathBuf> {
    if path.components().count() == 1 && !path.is_absolute() {
        // A bare name such as `redis-server`: look it up on PATH like a shell would.
        return find_on_path(path.as_os_str(), std::env::var_os("PATH"));
    }
    path.is_file().then(|| path.to_path_buf())
}

fn find_on_path(name: impl AsRef<std::ffi::OsStr>, path_var: Option<OsString>) -> Option<PathBuf> {
    let path_var = path_var?;
    std::env::split_paths(&path_var)
        .map(|dir| dir.join(name.as_ref()))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

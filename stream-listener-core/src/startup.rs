//! The one way a process reaches Redis before its members run (docs/design.md §1): connect and
//! `PING`, retrying while Redis does not answer, then check that every node runs Redis 7.0 or
//! newer. `run()` of the facade and [`crate::member::Listener::start`] both go through
//! [`connect`]; the [`Connected`] it returns is what [`crate::member::Listener::start_on`] needs, so
//! no member starts on a connection that skipped the checks.

use std::time::{Duration, Instant};

use crate::connection::RedisFailure;
use crate::connection::{DEFAULT_RESPONSE_TIMEOUT, RedisConnection, RedisTarget};

/// The oldest Redis accepted (docs/design.md §1): `XAUTOCLAIM`'s reply and the purging of
/// trimmed entries by `XCLAIM` are from 7.0.
pub const MINIMUM_REDIS_VERSION: (u32, u32, u32) = (7, 0, 0);

/// Why [`connect`] gave up.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StartupError {
    /// Redis did not answer: every attempt failed to connect or timed out until the startup
    /// timeout had passed (after one attempt without a timeout).
    #[error("no answer after {attempts} attempts in {}", humantime::format_duration(whole_ms(*waited)))]
    Unreachable {
        /// How long it tried.
        waited: Duration,
        /// Connection attempts made.
        attempts: u32,
        /// The last attempt's error; `None` when it timed out without one.
        #[source]
        last_error: Option<redis::RedisError>,
    },
    /// Redis refused the connection or a command (authentication, ACL), or the settings cannot
    /// be used (an invalid URL, an unreadable TLS file, a master name no sentinel monitors):
    /// retrying cannot fix it; the source says which.
    #[error("cannot use Redis as configured (retrying cannot fix it)")]
    Refused(#[source] redis::RedisError),
    /// A node runs a Redis older than [`MINIMUM_REDIS_VERSION`].
    #[error(
        "Redis {found} is too old: stream-listener needs Redis {}.{}.{} or newer",
        MINIMUM_REDIS_VERSION.0, MINIMUM_REDIS_VERSION.1, MINIMUM_REDIS_VERSION.2
    )]
    TooOld {
        /// The version `INFO server` reported (the oldest node of a cluster).
        found: String,
    },
    /// The TLS handshake failed ([`RedisFailure::TlsHandshake`]): the server's certificate did
    /// not verify, the server refused the client's certificate, or the URL's scheme does not
    /// match the server (`redis://` to a TLS port, `rediss://` to a plain one). Not retried: the
    /// configuration must change.
    #[error("TLS with Redis failed: {advice}")]
    Tls {
        /// What to check ([`crate::connection::tls_advice`]).
        advice: &'static str,
        /// The handshake's error.
        #[source]
        source: redis::RedisError,
    },
}

crate::report::readable_debug!(StartupError);

/// A connection that answered `PING` and passed the version check: what members start on.
#[derive(Debug, Clone)]
pub struct Connected {
    conn: RedisConnection,
    target: RedisTarget,
}

impl Connected {
    /// The connection (a cheap clone sharing the multiplexed connection).
    pub fn connection(&self) -> RedisConnection {
        self.conn.clone()
    }

    /// A new connection to the same, already checked server (one attempt and a `PING`, no
    /// version check): each listener of a process runs on a connection of its own, so one
    /// listener's large read replies never queue in front of another's heartbeats.
    ///
    /// # Errors
    /// As [`connect`] without a startup timeout: [`StartupError::Unreachable`] or
    /// [`StartupError::Refused`].
    pub async fn another(&self) -> Result<Connected, StartupError> {
        let conn = connect_with_retry(&self.target, None).await?;
        Ok(Connected {
            conn,
            target: self.target.clone(),
        })
    }
}

/// Connects to `target` and `PING`s it, then checks the version (`INFO server` on every node).
///
/// With `startup_timeout`, retries with capped backoff (100 ms doubling to 2 s) while Redis does
/// not answer, until the timeout has passed; without, makes one attempt (limited by the
/// connection's response timeout).
///
/// # Errors
/// [`StartupError::Unreachable`] once the attempts are used up; [`StartupError::Refused`] at once
/// for errors retrying cannot fix, [`StartupError::Tls`] for a failed TLS handshake;
/// [`StartupError::TooOld`].
pub async fn connect(
    target: &RedisTarget,
    startup_timeout: Option<Duration>,
) -> Result<Connected, StartupError> {
    if target.tls().insecure {
        tracing::warn!(
            redis = %target.describe(),
            "tls_insecure = true: the Redis server's TLS certificate is not verified; anyone on the network path can impersonate it"
        );
    }
    let mut conn = connect_with_retry(target, startup_timeout).await?;
    check_version(&mut conn).await?;
    Ok(Connected {
        conn,
        target: target.clone(),
    })
}

/// How long the attempt made at the `startup_timeout` deadline may take to answer.
const LAST_ATTEMPT: Duration = Duration::from_millis(250);

/// `d` cut to whole milliseconds, for messages.
fn whole_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

async fn connect_with_retry(
    target: &RedisTarget,
    startup_timeout: Option<Duration>,
) -> Result<RedisConnection, StartupError> {
    let started = Instant::now();
    let deadline = started + startup_timeout.unwrap_or_default();
    let mut delay = Duration::from_millis(100);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let attempt = async {
            let mut conn = RedisConnection::connect(target, DEFAULT_RESPONSE_TIMEOUT).await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await?;
            Ok::<_, redis::RedisError>(conn)
        };
        let outcome = match startup_timeout {
            Some(_) => {
                // The attempt at the deadline still gets a moment to answer.
                let remaining = deadline.saturating_duration_since(Instant::now());
                tokio::time::timeout(remaining.max(LAST_ATTEMPT), attempt)
                    .await
                    .ok()
            }
            None => Some(attempt.await),
        };
        let last_error = match outcome {
            Some(Ok(conn)) => {
                if attempts > 1 {
                    tracing::info!(attempts, "connected to Redis");
                }
                return Ok(conn);
            }
            Some(Err(error)) if RedisFailure::of(&error) == RedisFailure::TlsHandshake => {
                let advice = crate::connection::tls_advice(&error).unwrap_or_default();
                return Err(StartupError::Tls {
                    advice,
                    source: error,
                });
            }
            Some(Err(error)) if !RedisFailure::of(&error).is_unreachable() => {
                return Err(StartupError::Refused(error));
            }
            Some(Err(error)) => Some(error),
            // startup_timeout ended before the attempt's own timeout (a plain server never
            // answers a ClientHello): say why when the check can, as the attempt would have.
            None => match crate::connection::explain_timed_out_attempt(target).await {
                Some(error) => {
                    let advice = crate::connection::tls_advice(&error).unwrap_or_default();
                    return Err(StartupError::Tls {
                        advice,
                        source: error,
                    });
                }
                None => None,
            },
        };
        let now = Instant::now();
        if startup_timeout.is_none() || now >= deadline {
            return Err(StartupError::Unreachable {
                waited: now - started,
                attempts,
                last_error,
            });
        }
        if attempts == 1 || attempts.is_power_of_two() {
            tracing::warn!(
                attempts,
                error = last_error.as_ref().map(|e| e as &dyn std::error::Error),
                "Redis does not answer yet; retrying until startup_timeout"
            );
        }
        // The last sleep ends at the deadline, for one more attempt: giving up as soon as the
        // next backoff step would pass it left up to 2 s of `startup_timeout` unused.
        tokio::time::sleep(delay.min(deadline - now)).await;
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

/// `INFO server` on every node; the oldest `redis_version` must be at least 7.0.
async fn check_version(conn: &mut RedisConnection) -> Result<(), StartupError> {
    let reply: redis::Value = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .map_err(StartupError::Refused)?;
    let mut texts = Vec::new();
    collect_text(&reply, &mut texts);
    let versions: Vec<(u32, u32, u32)> = texts.iter().filter_map(|t| redis_version(t)).collect();
    match versions.iter().min() {
        Some(&oldest) if oldest < MINIMUM_REDIS_VERSION => Err(StartupError::TooOld {
            found: format!("{}.{}.{}", oldest.0, oldest.1, oldest.2),
        }),
        Some(_) => Ok(()),
        None => {
            tracing::warn!("INFO server reported no redis_version; cannot check for Redis 7.0");
            Ok(())
        }
    }
}

fn collect_text(value: &redis::Value, out: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(bytes) => out.push(String::from_utf8_lossy(bytes).into_owned()),
        redis::Value::SimpleString(s) | redis::Value::VerbatimString { text: s, .. } => {
            out.push(s.clone())
        }
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().for_each(|v| collect_text(v, out))
        }
        redis::Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            collect_text(k, out);
            collect_text(v, out);
        }),
        _ => {}
    }
}

/// `redis_version:7.2.4` in an `INFO` reply → `(7, 2, 4)`.
fn redis_version(info: &str) -> Option<(u32, u32, u32)> {
    let line = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let mut parts = line.trim().split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .ok()
    });
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

#[cfg(test)]
mod tests {
    use super::redis_version;

    #[test]
    fn versions_are_read_from_info() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(redis_version(info), Some((7, 0, 15)));
        assert_eq!(redis_version("redis_version:6.2.14\r\n"), Some((6, 2, 14)));
        assert_eq!(
            redis_version("redis_version:255.255.255"),
            Some((255, 255, 255))
        );
        assert!(redis_version("redis_version:6.0.9").unwrap() < super::MINIMUM_REDIS_VERSION);
        assert_eq!(redis_version("# Server\r\n"), None);
    }
}

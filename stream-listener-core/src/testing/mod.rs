//! A real-Redis test harness (cargo feature `testing`): throwaway `redis-server` processes, a local
//! 3-master Redis Cluster, and fault injection.
//!
//! - [`RedisServer`]: one `redis-server` on a free `127.0.0.1` port in its own temporary
//!   directory, without persistence unless asked for an append-only file
//!   ([`RedisServerBuilder::aof`]);
//! - [`RedisCluster`]: a local Redis Cluster of 3 masters for redis-rs's
//!   `cluster::ClusterClient`, with replicas when asked ([`RedisClusterBuilder::replicas`]), and
//!   its failovers (`CLUSTER FAILOVER`, a promotion after a kill);
//! - [`RedisSentinel`]: one master, one replica and three sentinels (`redis-server --sentinel`),
//!   with `kill_master` and `wait_for_failover`;
//! - fault injection on both: `pause` (`SIGSTOP`), `resume` (`SIGCONT`), `kill` (`SIGKILL`) and
//!   `restart` (same port, same directory);
//! - TLS-only servers (`--port 0 --tls-port`) with certificates made at test time:
//!   [`RedisServerBuilder::tls`], [`TlsMaterial`];
//! - [`fixtures`]: protocol values and Redis setup that tests and benchmarks share.
//!
//! Every process is stopped when its handle is dropped, and on Linux also when the test process
//! dies, even by `SIGKILL` (children get `PR_SET_PDEATHSIG` and are forked by one long-lived thread).
//! Nothing panics: every fallible call returns [`HarnessError`], whose
//! [`RedisNotInstalled`](HarnessError::RedisNotInstalled) variant says how to install Redis.
//!
//! Binaries come from `PATH`, or from [`REDIS_SERVER_ENV`] (`STREAM_LISTENER_REDIS_SERVER`) and
//! [`REDIS_CLI_ENV`] (`STREAM_LISTENER_REDIS_CLI`). Unix only.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use stream_listener_core::testing::RedisServer;
//!
//! let server = RedisServer::builder().aof(true).start()?;
//! let mut con = server.client().get_connection()?;
//! redis::cmd("SET").arg("k").arg("v").exec(&mut con)?;
//! server.pause()?; // the server stops answering
//! server.resume()?;
//! # Ok(())
//! # }
//! ```

#[cfg(all(feature = "testing", not(unix)))]
compile_error!("the stream-listener testing harness needs a Unix-like OS (Linux or macOS)");

// Without the feature (the crate's own unit tests), only the pure fixtures are compiled.
pub mod fixtures;

#[cfg(feature = "testing")]
pub mod acl;
#[cfg(feature = "testing")]
mod binaries;
#[cfg(feature = "testing")]
mod cluster;
#[cfg(feature = "testing")]
mod error;
#[cfg(feature = "testing")]
mod ports;
#[cfg(feature = "testing")]
mod probe;
#[cfg(feature = "testing")]
mod process;
#[cfg(feature = "testing")]
mod sentinel;
#[cfg(feature = "testing")]
mod server;
#[cfg(feature = "testing")]
mod tls;
#[cfg(feature = "testing")]
pub mod workload;

#[cfg(feature = "testing")]
pub use binaries::{REDIS_CLI_ENV, REDIS_SERVER_ENV};
#[cfg(feature = "testing")]
pub use cluster::{RedisCluster, RedisClusterBuilder};
#[cfg(feature = "testing")]
pub use error::HarnessError;
#[cfg(feature = "testing")]
pub use sentinel::{RedisSentinel, RedisSentinelBuilder};
#[cfg(feature = "testing")]
pub use server::{Appendfsync, RedisServer, RedisServerBuilder};
#[cfg(feature = "testing")]
pub use tls::{TlsAuthClients, TlsMaterial};

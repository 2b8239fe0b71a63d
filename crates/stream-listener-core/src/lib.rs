//! The core of stream-listener: everything that is not the macro or the facade.
//!
//! One module per concept (DESIGN.md §1):
//! - [`model`]: the protocol's data (stream, group and member metadata, heartbeat request and response);
//! - [`assignor`]: the sticky assignor (DESIGN.md §7);
//! - [`coordinator`]: the pure coordinator state machine (DESIGN.md §4–§6); it knows nothing of Redis;
//! - `testing` (feature `testing`): a real-Redis test harness.

pub mod assignor;
pub mod coordinator;
pub mod fence;
pub mod model;

#[cfg(feature = "testing")]
pub mod testing;

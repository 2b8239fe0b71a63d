//! Procedural macros of stream-listener.
//!
//! The `#[stream_listener(stream = "...", group = "...", concurrency = N)]` attribute lives here
//! (DESIGN.md §7, §11). It is not written yet: it arrives with the user-facing surface (issue 6),
//! once the member runtime it generates calls to exists. Until then this crate exports nothing.

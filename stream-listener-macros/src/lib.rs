//! Procedural macros of stream-listener: the `#[stream_listener(...)]` attribute (docs/design.md
//! §1, §7, §11). Use it through the `stream-listener` crate, which re-exports it and holds the
//! types its expansion names; its documentation is there (`stream_listener::stream_listener`).

mod args;
mod listener;

use proc_macro::TokenStream;

/// Registers an `async fn` as a listener of a sharded stream. Documented on the re-export,
/// `stream_listener::stream_listener`.
#[proc_macro_attribute]
pub fn stream_listener(args: TokenStream, item: TokenStream) -> TokenStream {
    listener::expand(args.into(), item.into()).into()
}

//! The root package of the stream-listener workspace. It publishes nothing: it exists so that
//! `examples/` and `tests/` at the repository root build with `cargo run --example <name>` and
//! `cargo test --workspace`. Users depend on the `stream-listener` crate instead.

//! Two `#[stream_listener]` functions on the same (stream, group) in one program: `run_with`
//! refuses to start, naming both (docs/design.md §11).

use stream_listener::{Config, RunError, run_with, stream_listener};

#[stream_listener(stream = "orders", group = "billing")]
async fn bill(_: stream_listener::RawMessage) {}

#[stream_listener(stream = "orders", group = "billing")]
async fn bill_again(_: stream_listener::RawMessage) {}

#[tokio::test]
async fn two_macro_listeners_on_one_stream_and_group_are_an_error() {
    // Checked before Redis is contacted: nothing listens on port 1.
    let config =
        Config::from_toml_str("[redis]\nurl = \"redis://127.0.0.1:1\"\n", "app.toml").unwrap();
    let err = run_with(config).await.unwrap_err();
    let RunError::DuplicateStreamGroup { first, second, .. } = &err else {
        panic!("expected DuplicateStreamGroup, got {err:?}");
    };
    assert!(
        first.starts_with("`bill` (run_duplicate, tests/run_duplicate.rs:"),
        "{first}"
    );
    assert!(
        second.starts_with("`bill_again` (run_duplicate, tests/run_duplicate.rs:"),
        "{second}"
    );
}

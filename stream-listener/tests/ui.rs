//! UI tests of `#[stream_listener]` (trybuild): `ui/pass/` must compile, each file of `ui/fail/`
//! must fail with exactly the compiler output pinned in its `.stderr` file.
//!
//! After an intended change of a message (or a new compiler that words things differently),
//! regenerate the `.stderr` files and review the diff:
//!
//! ```sh
//! TRYBUILD=overwrite cargo test -p stream-listener --test ui
//! ```
//!
//! The pinned output is that of the toolchain CI uses (rustc 1.95); another compiler may word
//! its part of the messages differently.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}

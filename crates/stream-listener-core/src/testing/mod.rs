//! testing harness (in progress)

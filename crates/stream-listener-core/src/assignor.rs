//! assignor (in progress)

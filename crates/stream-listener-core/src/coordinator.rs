//! coordinator (in progress)

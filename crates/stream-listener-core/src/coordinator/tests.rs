//! Scenario tests of the coordinator rules.

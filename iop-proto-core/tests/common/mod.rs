//! Shared proptest strategies for the integration tests.
#![allow(dead_code, unreachable_pub)]

pub mod arb;
pub mod edge;

//! Test support shared by the crate's tests, the simulator and the fuzz targets.
//! Compiled only with the `testkit` feature; it adds no dependencies.

pub mod fuzz;

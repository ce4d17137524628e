//! Integration tests of the run spec: one test binary, one module per area.
//!
//! `plan` checks which groups a run rolls out (the one rule the binary and the bridge share);
//! `output` what a run may do with an output that holds rows; `spec` the checks before any
//! work and a run wired against the simulator.

mod output;
mod plan;
mod spec;

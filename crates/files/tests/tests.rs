//! Integration tests of the dataset and output files: one test binary, one module per area.
//!
//! `data` checks what a run rolls out (the plan: passes, shards, ids); `output` what an
//! output it cannot continue is refused with.

mod data;
mod output;

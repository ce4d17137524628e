//! One rollout run, specified once, for every program that runs the engine.
//!
//! The `async-grpo` binary and the TRL bridge (`async_grpo`) take a run's inputs in their own
//! shapes, flags and a settings file in one, Python objects in the other, and hand them to
//! this crate, which decides what a run is by one rule each:
//!
//! - [`PlanSpec`]: which groups a run rolls out: passes (bounded or until stopped),
//!   shuffle, shard, resume, `max_groups` of the whole run; a shard that holds no row is an
//!   error, not an empty run.
//! - [`DatasetSource`]: the rows, a file or rows in memory, scanned before any work (every row
//!   parsed, the columns the rewards read present) and read again for the plan.
//! - [`Destination`]: the output, refused when it holds rows the run would lose, continued
//!   when resumed.
//! - [`RunSpec`]: the engine wired: the client of the servers, waited for and health-checked;
//!   the tool pool (one thread per rollout in flight unless set, see [`ToolPool`]); the
//!   environment's sessions on that pool; the recording proxy and the loop-owning agent on
//!   it; the scorer; the loop.
//!
//! - [`rows`] (feature `stream`): the row stream, groups served live to trainers over Arrow
//!   Flight as the output is written, held until acknowledged, positions kept across a resume.
//! - [`control`] and [`listen`]: a trainer's pause and resume, answered alike by the binary's
//!   control endpoint and the stream; where a server listens and the token it then wants.
//!
//! What stays with the adapters is what is theirs alone: argument parsing, printing, signals
//! and the control endpoint (the binary), Python callables, the GIL and TRL's queues (the
//! bridge).

pub mod control;
mod dataset;
pub mod listen;
mod output;
mod plan;
#[cfg(feature = "stream")]
pub mod rows;
mod spec;

pub use crate::{
    dataset::{DatasetSource, MissingColumn, ScanError, Scanned},
    output::{Destination, OutputError, OutputMode},
    plan::{PlanError, PlanSpec, RunPlan},
    spec::{
        AgentFactory, Connected, DEFAULT_MODEL_NAME, EnvironmentFactory, HealthChecks,
        MAX_DEFAULT_TOOL_THREADS, RunSpec, Running, Servers, SpecError, ToolPool,
    },
};

//! The rollout engine's API without its loop: what an environment, an agent and an
//! inference server implement, and the dataset row they are given.
//!
//! - [`Environment`] opens one [`Episode`] per rollout attempt: its tools, its status after
//!   each turn, its verdict at the end (OpenEnv's shape).
//! - [`Agent`] owns a rollout's whole loop and samples each turn through a [`Sampler`]
//!   (a coding agent behind the recording proxy, say).
//! - [`Generator`] samples one turn from prompt ids: vllm-client's `Client` is one (feature
//!   `vllm-client`), a simulator or a test's script another.
//! - [`DatasetRow`] is a row as the loop receives it, whatever file it came from.
//!
//! The loop itself (async-grpo-rollout) re-exports every item here, so a user of the engine
//! needs one import path; an environment or an agent of one's own needs only this crate.
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `vllm-client` | yes | [`Generator`] for vllm-client's `Client` | vllm-client |
//! | `clap` | no | `clap::Args` for [`Sampling`] | clap |

mod agent;
mod episode;
mod generator;
mod row;

pub use crate::{
    agent::{
        Agent, AgentError, AgentOutcome, AgentRun, SampleRefused, SampleRequest, SampleRequests,
        Sampled, Sampler,
    },
    episode::{Environment, Episode, EpisodeRequest, EpisodeStatus, OpenError, Verdict},
    generator::{
        Finish, GenerateError, GenerateRequest, Generation, Generator, GeneratorStats, Sampling,
    },
    row::{DatasetError, DatasetRow},
};

/// A setting that cannot work, with its key: what every settings table of the engine is
/// refused with (async-grpo-settings').
pub use settings::SettingError;

//! [`Settings`]: the engine's settings as the Python worker passes them, one mapping read
//! into the engine's own types ([`RolloutConfig`], its [`Sampling`] and
//! [`ReconcilerConfig`]) and the bridge's ([`BridgeSettings`]).
//!
//! The mapping is flat, as a run's settings file is: every key is a field of one of those
//! structs, by its serde name (`num_generations`, `max_inflight`, `temperature`,
//! `fork_threshold_tokens`, `groups`, `epochs`, `shard`, ...), durations as text (`10m`,
//! `500ms`); TRL's names are accepted where they differ (`max_inflight_tasks`, an alias on
//! [`BridgeSettings`]). Each struct is read from the whole mapping and ignores the others'
//! keys, as the binary reads its file; a key none of them knows is an error naming it and
//! the keys expected. (Not `#[serde(flatten)]`: serde buffers a flattened struct's values,
//! so an error in one of them could no longer name its key, and `deny_unknown_fields`
//! does not combine with flatten.)

use std::{path::PathBuf, time::Duration};

use files::Shard;
use rollout::{RolloutConfig, Sampling, field_names};
use rollout_core::ReconcilerConfig;
use scoring::AdvantageConfig;
use serde::{Deserialize, de::DeserializeOwned};
use serde_json::Value;

/// What the engine runs with: its loop's settings, and the bridge's.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// The loop's settings, `sampling`, `reconciler` and `advantages` included.
    pub(crate) engine: RolloutConfig,
    /// The bridge's own.
    pub(crate) bridge: BridgeSettings,
}

/// The settings only the bridge has, and TRL's names for the engine's.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub(crate) struct BridgeSettings {
    /// TRL's `max_inflight_tasks`: the engine's `max_inflight` (either name).
    #[serde(alias = "max_inflight_tasks")]
    max_inflight: Option<usize>,
    /// How rewards become advantages: a preset's name (`scoring::PRESETS`).
    pub(crate) estimator: String,
    /// How long one tool call (or environment call) may take.
    #[serde(with = "humantime_serde")]
    pub(crate) tool_timeout: Duration,
    /// How long one reward function may take on a group.
    #[serde(with = "humantime_serde")]
    pub(crate) reward_timeout: Duration,
    /// The engine's runtime threads.
    pub(crate) runtime_threads: usize,
    /// Threads of the tool pool (sync tools and environment sessions); default: one per
    /// rollout in flight, at most 512, by the binary's rule.
    pub(crate) tool_threads: Option<usize>,
    /// Sync Python tools running at once (default: as many as the tool pool's threads).
    pub(crate) python_tool_threads: Option<usize>,
    /// How many steps of nice value below the trainer's the engine's threads and worker
    /// processes run (Linux), so that the trainer's threads get the CPU first: 0 to 19.
    pub(crate) nice: i32,
    /// Passes over the dataset (default: passes until the worker is stopped).
    pub(crate) epochs: Option<u64>,
    /// Each pass in an order of its own, seeded by the sampling seed (or 0).
    pub(crate) shuffle: bool,
    /// The one shard of the dataset rolled out (`I/N`).
    pub(crate) shard: Option<Shard>,
    /// Where every group handed to the trainer is also written (JSON Lines, or Parquet for a
    /// `.parquet` path).
    pub(crate) output: Option<PathBuf>,
    /// Continue `output`: the groups it holds are not rolled out again.
    pub(crate) resume: bool,
    /// Serve the rows live on this address (`PORT` or `HOST:PORT`) over Arrow Flight,
    /// instead of handing them to TRL's `rollout_buffer`.
    pub(crate) serve_rows: Option<String>,
    /// The bearer token every call to the row stream must carry.
    pub(crate) serve_rows_token: Option<String>,
    /// Groups the stream holds unacknowledged at most.
    pub(crate) serve_rows_capacity: usize,
    /// The stream's PEM certificate (chain): TLS only.
    pub(crate) serve_rows_cert: Option<PathBuf>,
    /// Its PEM private key.
    pub(crate) serve_rows_key: Option<PathBuf>,
}

impl Default for BridgeSettings {
    /// TRL's estimator, a minute per tool call, five per reward, two runtime threads at nice
    /// 10 below the trainer's, passes in order over the whole dataset until stopped, no
    /// output, no row stream.
    fn default() -> Self {
        BridgeSettings {
            max_inflight: None,
            estimator: "trl".to_owned(),
            tool_timeout: Duration::from_secs(60),
            reward_timeout: Duration::from_secs(300),
            runtime_threads: 2,
            tool_threads: None,
            python_tool_threads: None,
            nice: 10,
            epochs: None,
            shuffle: false,
            shard: None,
            output: None,
            resume: false,
            serve_rows: None,
            serve_rows_token: None,
            serve_rows_capacity: async_grpo_run::rows::DEFAULT_CAPACITY,
            serve_rows_cert: None,
            serve_rows_key: None,
        }
    }
}

impl BridgeSettings {
    fn validate(&self) -> Result<(), String> {
        for (key, value) in [
            ("tool_timeout", self.tool_timeout),
            ("reward_timeout", self.reward_timeout),
        ] {
            if value.is_zero() {
                return Err(format!("{key}: must be longer than 0s"));
            }
        }
        let zero = [
            ("runtime_threads", self.runtime_threads == 0),
            ("tool_threads", self.tool_threads == Some(0)),
            ("python_tool_threads", self.python_tool_threads == Some(0)),
            ("epochs", self.epochs == Some(0)),
        ];
        if let Some((key, _)) = zero.iter().find(|(_, zero)| *zero) {
            return Err(format!("{key}: must be at least 1"));
        }
        if !(0..=19).contains(&self.nice) {
            return Err(format!("nice: must be 0 to 19, got {}", self.nice));
        }
        if self.resume && self.output.is_none() {
            return Err("resume: give output=, the file to continue".to_owned());
        }
        if self.serve_rows.is_none() {
            let given = [
                ("serve_rows_token", self.serve_rows_token.is_some()),
                ("serve_rows_cert", self.serve_rows_cert.is_some()),
                ("serve_rows_key", self.serve_rows_key.is_some()),
            ];
            if let Some((key, _)) = given.iter().find(|(_, given)| *given) {
                return Err(format!(
                    "{key}: a setting of the row stream, but no serve_rows"
                ));
            }
        }
        Ok(())
    }

    /// The row stream's settings, when `serve_rows` asks for one.
    pub(crate) fn rows_spec(&self) -> Option<async_grpo_run::rows::RowsSpec> {
        Some(async_grpo_run::rows::RowsSpec {
            address: self.serve_rows.clone()?,
            token: self.serve_rows_token.clone(),
            capacity: self.serve_rows_capacity,
            certificate: self.serve_rows_cert.clone(),
            key: self.serve_rows_key.clone(),
        })
    }
}

impl Settings {
    /// Reads the mapping `value`; the error names the key at fault.
    pub(crate) fn read(value: &Value) -> Result<Settings, String> {
        let Some(map) = value.as_object() else {
            return Err(format!("settings: expected a mapping, got {value}"));
        };
        let known = [
            field_names::<BridgeSettings>(),
            field_names::<RolloutConfig>(),
            field_names::<Sampling>(),
            field_names::<ReconcilerConfig>(),
        ]
        .concat();
        if let Some(key) = map.keys().find(|key| !known.contains(&key.as_str())) {
            let mut expected = known.clone();
            expected.sort_unstable();
            return Err(format!(
                "settings: unknown key `{key}`, expected one of {}",
                expected
                    .iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let bridge: BridgeSettings = layer(value)?;
        bridge.validate()?;
        let mut engine: RolloutConfig = layer(value)?;
        engine.sampling = layer(value)?;
        engine.reconciler = layer(value)?;
        if let Some(max_inflight) = bridge.max_inflight {
            engine.max_inflight = max_inflight;
        }
        engine.advantages = AdvantageConfig::preset(&bridge.estimator).ok_or_else(|| {
            format!(
                "estimator: unknown estimator '{}'; expected one of {}",
                bridge.estimator,
                scoring::PRESETS.join(", ")
            )
        })?;
        engine.validate().map_err(|e| e.to_string())?;
        Ok(Settings { engine, bridge })
    }
}

/// One struct read from the whole mapping (the others' keys ignored); the error names the key.
fn layer<T: DeserializeOwned>(value: &Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|error| {
        let path = error.path().to_string();
        if path == "." {
            error.inner().to_string()
        } else {
            format!("{path}: {}", error.inner())
        }
    })
}

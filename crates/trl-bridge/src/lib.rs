//! The rollout engine as a Python extension module, `async_grpo._native`, under the Python
//! package `async_grpo` (`python/async_grpo/`), which implements TRL's rollout worker
//! protocol on top of it.
//!
//! - `engine`: `NativeEngine`, the rollout loop on a tokio runtime of its own; the worker's
//!   pump thread reads scored groups from it without holding the GIL, and writes those it
//!   delivered to the output.
//! - `settings`: the engine's settings, one mapping from Python read into the engine's own
//!   types (`RolloutConfig`, `Sampling`, `ReconcilerConfig`) and the bridge's.
//! - `data`: the dataset (rows, or a JSON Lines or Parquet file), the plan of passes,
//!   shuffle and shard, and the output a restarted worker resumes, through the engine's
//!   `files::data` and `files::output`, planned by `async_grpo_run`.
//! - `callables`: Python tools and reward functions as tool-dispatch tools and scoring
//!   rewards (sync ones on the engine's pools, `async def` ones on the worker's asyncio loop).
//! - `inbox`: how `async def` calls reach that loop: pushed without the GIL, taken by the loop
//!   when a socket it watches wakes it.
//! - `environment`: a Python object of OpenEnv's session-factory shape as the harness's
//!   blocking session factory (`environment=`), its calls on the engine's tool pool.
//! - `tokenizer`: `processing_class` as the worker hands it over: a tokenizer folder, or a
//!   tokenizer's parts as it is in memory (its edited chat template included).
//! - `agent`: loop-owning agents (`agent=`): a program as the binary's `[agent]` table, or a
//!   Python callable, each rollout run against the worker's recording proxy; and the
//!   forwarder a sandboxed program reaches its proxy through.
//! - `simulator`: `Simulator`, the vLLM-compatible simulator served from Python.
//!
//! Built by maturin (`pip install ./crates/trl-bridge`): PyO3 with the stable ABI of Python
//! 3.10 and later.

/// mimalloc, as the binary: the engine allocates per turn (renders, tokenization, HTTP), and
/// with the system's allocator W2 and W3 cost 8-12% more CPU per turn (BENCHMARKS.md).
/// Only Rust's allocations: Python's own are untouched.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod agent;
mod callables;
mod data;
mod engine;
mod environment;
mod inbox;
mod lane;
mod pool;
mod settings;
mod simulator;
mod tokenizer;

use pyo3::prelude::*;

/// `async_grpo._native`: the engine, the simulator, and the version.
#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    // Rust-side warnings (a failed rollout, a late heartbeat) go to stderr, at the level
    // `ASYNC_GRPO_LOG` sets (default `warn`); a program that set a subscriber keeps its own.
    let filter = tracing_subscriber::EnvFilter::try_from_env("ASYNC_GRPO_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    module.add_class::<engine::NativeEngine>()?;
    module.add_class::<inbox::Inbox>()?;
    module.add_class::<simulator::Simulator>()?;
    module.add_function(wrap_pyfunction!(agent::agent_forward, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// Locks a mutex, going on past a panic elsewhere: every mutex of the crate guards one value
/// that is set or taken whole, so a panic cannot leave it half-changed.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

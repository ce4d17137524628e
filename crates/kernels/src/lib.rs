//! Jupyter kernels as the Python sessions of RL rollouts, through a gateway's REST and
//! WebSocket API: [Jupyter Kernel Gateway], or [Jupyter Enterprise Gateway], which serves the
//! same API with each kernel in a pod of its own.
//!
//! One [`Kernel`] per rollout: what a cell defines, imports or writes the next cell of the
//! same kernel sees, and nothing of it reaches another kernel's variables (kernels of one Kernel
//! Gateway share its machine's files; Enterprise Gateway's pods do not). The kernel is deleted
//! when the rollout ends, by [`Kernel::close`] or, if it was not closed, when it is dropped.
//! A [lease folder](Gateway::with_lease_dir) holds a file per engine listing the kernels it
//! holds, locked while the engine lives, so that [`Gateway::reap_leases`] deletes what an
//! engine that was killed left (and never a live engine's); the gateway's idle cull
//! (`--MappingKernelManager.cull_idle_timeout`) is the last resort for a kernel no lease
//! covers. Kernels dropped without [`Kernel::close`] are deleted in the background, and
//! [`Gateway::settle`] waits for those deletes before the engine exits.
//!
//! Everything a kernel sends is untrusted: its WebSocket messages are bounded in size, a
//! malformed message is an error (never a panic), and a cell's output is capped.
//!
//! ```no_run
//! # async fn example() -> Result<(), async_grpo_kernels::KernelError> {
//! use async_grpo_kernels::Gateway;
//!
//! let gateway = Gateway::new("http://127.0.0.1:8888", None)?.with_lease_dir("kernel-leases");
//! let left = gateway.reap_leases().await?;
//! println!("deleted {left} kernels an earlier run left");
//! let mut kernel = gateway.start(None).await?;
//! kernel.execute("x = 6 * 7", 4096).await?;
//! let cell = kernel.execute("print(x)", 4096).await?;
//! assert_eq!(cell.output, "42\n");
//! kernel.close().await?;
//! # Ok(())
//! # }
//! ```
//!
//! [Jupyter Kernel Gateway]: https://jupyter-kernel-gateway.readthedocs.io
//! [Jupyter Enterprise Gateway]: https://jupyter-enterprise-gateway.readthedocs.io

mod error;
mod gateway;
mod kernel;
mod leases;
mod output;

pub use error::KernelError;
pub use gateway::Gateway;
pub use kernel::{Cell, Kernel};

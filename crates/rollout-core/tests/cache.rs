//! Where `cargo xtask fixtures` keeps the real tokenizers and templates, for the tests and
//! benchmarks that read them (shared by path with the turn benchmark and the root tests).

use std::path::PathBuf;

/// `ASYNC_GRPO_CACHE`, else `${XDG_CACHE_HOME:-~/.cache}/async-grpo`, as xtask's own.
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ASYNC_GRPO_CACHE") {
        return PathBuf::from(dir);
    }
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"))
        .join("async-grpo")
}

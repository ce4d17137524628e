//! Writes the simulator's tokenizer, [`async_grpo_vllm_sim::training_tokenizer`], as
//! `tokenizer.json` into the folder given as the one argument (pretty-printed; the training
//! is deterministic, so every run writes the same bytes). `cargo xtask quickstart` runs it
//! for `examples/quickstart/`:
//!
//! ```text
//! cargo run -p async-grpo-vllm-sim --example quickstart_files -- examples/quickstart
//! ```

use std::{path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), None) = (args.next(), args.next()) else {
        eprintln!("usage: quickstart_files <out dir>");
        return ExitCode::FAILURE;
    };
    let path = PathBuf::from(dir).join("tokenizer.json");
    match async_grpo_vllm_sim::training_tokenizer().save(&path, true) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "quickstart_files: could not write {}: {error}",
                path.display()
            );
            ExitCode::FAILURE
        }
    }
}

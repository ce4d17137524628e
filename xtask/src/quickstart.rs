//! `cargo xtask quickstart`: rewrites the quickstart's generated files, deterministically.
//!
//! - `examples/quickstart/tokenizer.json`: the tokenizer `vllm_sim::training_tokenizer`
//!   trains (its training is deterministic: the same vocabulary and merges on every run,
//!   which the root package's `quickstart` test checks against the committed file), written
//!   by vllm-sim's example `quickstart_files` (run through cargo, so that xtask itself does
//!   not build the simulator and its tokenizer library);
//! - `examples/quickstart/arithmetic.jsonl`: 64 questions `What is A op B?` with their
//!   answers, `op` cycling through `+ - *`, operands in 2..=99 drawn from a fixed seed.
//!
//! `tokenizer_config.json` (the chat template) and `examples/quickstart.toml` are written
//! by hand and left alone.

use std::{fmt::Write as _, path::Path};

use anyhow::Context;

use crate::{cargo, root, run_checked};

/// Rows of the arithmetic dataset.
const ROWS: usize = 64;

pub(crate) fn run() -> anyhow::Result<()> {
    let dir = root().join("examples/quickstart");
    std::fs::create_dir_all(&dir).with_context(|| format!("could not create {}", dir.display()))?;

    let mut write_tokenizer = cargo(&[
        "run",
        "--package",
        "async-grpo-vllm-sim",
        "--example",
        "quickstart_files",
        "--",
    ]);
    run_checked(write_tokenizer.arg(&dir))?;
    eprintln!("quickstart: wrote {}", shown(&dir.join("tokenizer.json")));

    let dataset_path = dir.join("arithmetic.jsonl");
    std::fs::write(&dataset_path, arithmetic_rows())
        .with_context(|| format!("could not write {}", dataset_path.display()))?;
    eprintln!("quickstart: wrote {} ({ROWS} rows)", shown(&dataset_path));
    Ok(())
}

fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The dataset as JSON Lines: `{"prompt": "What is 17 * 23?", "answer": "391"}`.
fn arithmetic_rows() -> String {
    let mut state = 0x5EED_0000_0000_0001_u64;
    let mut operand = || {
        state = splitmix64(state);
        (state % 98 + 2) as i64
    };
    let mut text = String::new();
    for row in 0..ROWS {
        let (a, b) = (operand(), operand());
        let (op, answer) = match row % 3 {
            0 => ('+', a + b),
            1 => ('-', a - b),
            _ => ('*', a * b),
        };
        let _ = writeln!(
            text,
            r#"{{"prompt": "What is {a} {op} {b}?", "answer": "{answer}"}}"#
        );
    }
    text
}

/// SplitMix64: a deterministic, well-mixed step (the same everywhere, unlike a std hasher).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dataset_is_the_same_on_every_run_and_its_answers_are_right() {
        let rows = arithmetic_rows();
        assert_eq!(rows, arithmetic_rows());
        assert_eq!(rows.lines().count(), ROWS);
        for line in rows.lines() {
            let words: Vec<&str> = line.split(['"', ' ', '?']).collect();
            let (a, op, b) = (words[6], words[7], words[8]);
            let (a, b): (i64, i64) = (a.parse().expect("a"), b.parse().expect("b"));
            assert!((2..=99).contains(&a) && (2..=99).contains(&b), "{line}");
            let answer = match op {
                "+" => a + b,
                "-" => a - b,
                _ => a * b,
            };
            assert!(
                line.ends_with(&format!(r#""answer": "{answer}"}}"#)),
                "{line}"
            );
        }
    }
}

//! The agent example's `verify.py` (`examples/agent/`) pays for a solved task only: scripted
//! agents (`tests/fixtures/agent/fake_agent.py`) that rewrite their directory to fool it, or
//! that look for the answer wherever the engine might have leaked it, get 0; an honest one
//! gets 1. The agents call the model once (through the proxy, to the simulator) and decide
//! nothing on what it says.

use std::path::Path;

use serde_json::json;

use super::{
    reliability::run_marked,
    rollout::{Case, runtime, simulator, toml_path},
};

/// The tasks, their answers chosen so that no other test's dataset holds them.
const TASKS: [(&str, &str); 2] = [
    (
        "Write solution.py with a function solve() that returns 7919 * 13.",
        "102947",
    ),
    (
        "Write solution.py with a function solve() that returns 31337 + 4242.",
        "35579",
    ),
];

/// `path` in the repository (`examples/...`) or in this package (`tests/...`).
fn repository(path: &str) -> String {
    let base = if path.starts_with("examples/") {
        crate::repository()
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
    };
    toml_path(&base.join(path))
}

/// The env reward of every rollout (2 tasks × 2) of the fake agent in `mode` judged by the
/// example's verify; the run must succeed and leave no process behind.
fn env_rewards(mode: &str) -> Vec<Option<f64>> {
    let name = format!("forgery-{mode}");
    let case = Case::new(&name);
    let dataset: String = TASKS
        .iter()
        .map(|(prompt, answer)| json!({ "prompt": prompt, "answer": answer }).to_string() + "\n")
        .collect();
    std::fs::write(case.dataset(), dataset).expect("write the dataset");
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 2\nretries = 0\n\n\
         [agent]\ncommand = [\"python3\", {agent}, \"{mode}\", \"{{prompt}}\"]\n\
         verify = [\"python3\", {verify}]\ntimeout = \"60s\"\n",
        agent = repository("tests/fixtures/agent/fake_agent.py"),
        verify = repository("examples/agent/verify.py"),
    ));
    let runtime = runtime();
    let sim = simulator(&runtime, 0, "calculator");
    let (output, left) = run_marked(&mut case.command(&["--server", &sim.url()]), &name);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(left.is_empty(), "processes outlived the run: {left:?}");
    let rows = case.rows();
    assert_eq!(rows.len(), 4, "one row per rollout: {stderr}");
    rows.iter().map(|row| row.rewards["env"].as_f64()).collect()
}

#[test]
fn an_agent_that_rewrites_the_test_and_returns_an_always_equal_object_is_paid_nothing() {
    assert_eq!(env_rewards("forge"), [Some(0.0); 4]);
}

#[test]
fn an_agent_that_searches_its_arguments_environment_directory_and_proc_for_the_answer_is_paid_nothing()
 {
    assert_eq!(env_rewards("snoop"), [Some(0.0); 4]);
}

#[test]
fn an_agent_that_writes_the_right_solution_is_paid() {
    assert_eq!(env_rewards("honest"), [Some(1.0); 4]);
}

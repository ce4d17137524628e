//! `[agent]`: loop-owning agents behind the recording proxy. The agent is a real program on
//! OpenAI's own Python client (`tests/fixtures/agent/openai_agent.py`), streaming or not, with
//! tool calls, against the proxy over the simulator: every trained token is one the simulator
//! sampled, a rollout whose agent only re-serialized its history is one row, verify's number
//! is the `env` reward, and no process of an agent outlives the run.

use std::path::{Path, PathBuf};

use rollout_core::TrainingSample;

use super::{
    reliability::run_marked,
    rollout::{Case, assert_rows_are_what_was_sampled, runtime, simulator, toml_path},
};

/// The Python with OpenAI's client.
fn agent_python() -> PathBuf {
    installed("venv-agents/bin/python", "OpenAI's Python client")
}

/// A file `cargo xtask fixtures` installs into the cache, failing with what to run when
/// it is missing.
fn installed(relative: &str, what: &str) -> PathBuf {
    let path = test_support::cache_dir().join(relative);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo xtask fixtures` (it installs {what} there)",
        path.display()
    );
    path
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/agent")
        .join(name)
}

/// A run of 3 prompts × 2 rollouts whose agent is the `openai` client in `mode`.
fn agent_case(name: &str, mode: &str) -> Case {
    let case = Case::new(name);
    case.write_dataset(3);
    let python = toml_path(&agent_python());
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 4\nmax_turns = 4\nseed = 11\n\n\
         [agent]\ncommand = [{python}, {agent}, \"{mode}\", \"{{prompt}}\"]\n\
         verify = [{python}, {verify}, \"{{task_json}}\"]\ntimeout = \"60s\"\n",
        agent = toml_path(&fixture("openai_agent.py")),
        verify = toml_path(&fixture("verify.py")),
    ));
    case
}

/// Runs the case against `sim` with every process marked; the run must succeed and leave no
/// process behind. Returns its rows, each checked to hold exactly what `sim` sampled, one
/// row per rollout of `turns` sampled answers.
fn run_exact(
    case: &Case,
    sim: &vllm_sim::Simulator,
    name: &str,
    turns: usize,
) -> Vec<TrainingSample> {
    let (output, left) = run_marked(&mut case.command(&["--server", &sim.url()]), name);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(
        left.is_empty(),
        "agent processes outlived the run: {left:?}"
    );
    let rows = case.rows();
    let runs = assert_rows_are_what_was_sampled(&rows, &sim.transcript());
    assert!(
        runs.iter().all(|&n| n == turns),
        "{turns} answers per rollout, in one row: {runs:?}"
    );
    for row in &rows {
        let metric = |name: &str| row.metrics.get(name).unwrap_or(f64::NAN);
        assert_eq!(metric("forked_turns"), 0.0, "{row:?}");
        assert_eq!(metric("capture_forks"), 0.0, "{row:?}");
        assert_eq!(
            metric("capture_reused_turns"),
            (turns - 1) as f64,
            "the agent's re-serialized answers were replaced by the sampled ids: {row:?}"
        );
    }
    rows
}

fn run_agents(mode: &str) {
    let case = agent_case(&format!("agent-{mode}"), mode);
    let runtime = runtime();
    let sim = simulator(&runtime, 1, "calculator");
    let rows = run_exact(&case, &sim, &format!("agent-{mode}"), 2);
    assert_eq!(rows.len(), 6, "one row per rollout");
    for row in &rows {
        // The agent's own prompt, then its transcript with the proxy's answers.
        assert_eq!(row.prompt[0]["role"], "system");
        assert_eq!(row.prompt[1]["role"], "user");
        let roles: Vec<&str> = row.completion.iter().map(|m| m.role()).collect();
        assert_eq!(roles, ["assistant", "tool", "assistant"], "{row:?}");
        assert_eq!(
            row.completion[0]["tool_calls"][0]["function"]["name"],
            "calculator"
        );
        // verify read the answer the agent wrote; the same judgement as the numeric reward.
        let env = row.rewards["env"].as_f64().expect("verify gave a reward");
        let numeric = row.rewards["numeric_answer"]
            .as_f64()
            .expect("a numeric reward");
        assert_eq!(env, numeric, "{row:?}");
    }
    let rewards: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.rewards["env"].as_f64())
        .collect();
    assert!(
        rewards.contains(&1.0) && rewards.contains(&0.0),
        "the simulator answers right half of the time: {rewards:?}"
    );
}

#[test]
fn a_streaming_openai_client_agent_gives_one_exact_row_per_rollout() {
    run_agents("stream");
}

#[test]
fn a_non_streaming_openai_client_agent_gives_one_exact_row_per_rollout() {
    run_agents("plain");
}

/// opencode (`cargo xtask fixtures` installs it) and the example's scripts.
fn opencode() -> PathBuf {
    installed("opencode/node_modules/.bin/opencode", "opencode")
}

fn example(name: &str) -> String {
    toml_path(&crate::repository().join("examples/agent").join(name))
}

#[test]
fn opencode_edits_a_file_with_its_own_tool_and_its_rows_are_exact() {
    // The example's script finds opencode where the fixtures put it.
    opencode();
    let case = Case::new("opencode");
    case.write_dataset(2);
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 6\nseed = 5\nmax_tokens = 256\n\n\
         [agent]\ncommand = [{command}, \"{{prompt}}\"]\n\
         verify = [\"python3\", {verify}]\ntimeout = \"3m\"\nhome = [\".cache/async-grpo\"]\n",
        command = example("opencode-agent.sh"),
        verify = example("verify.py"),
    ));
    let runtime = runtime();
    let mut config = vllm_sim::SimConfig::from_tokenizer_file(
        &super::rollout::quickstart().join("tokenizer.json"),
    )
    .expect("the quickstart tokenizer loads");
    config.record = true;
    config.tool_rounds = 1;
    config.tool_name = "write".to_owned();
    config.tool_arguments = Some(serde_json::json!({
        "filePath": "solution.py",
        "content": "def solve():\n    return {answer}\n",
    }));
    config.answer_tokens = 8;
    config.correct_rate = 0.5;
    config.max_model_len = 65536;
    let sim = runtime
        .block_on(vllm_sim::Simulator::start(
            config,
            "127.0.0.1:0".parse().expect("an address"),
        ))
        .expect("the simulator starts");
    let rows = run_exact(&case, &sim, "opencode", 2);
    assert_eq!(rows.len(), 4, "one row per rollout");
    for row in &rows {
        // opencode also asked for a title for its session: sampled, counted, not a row.
        assert_eq!(row.metrics["agent_side_conversations"], 1.0, "{row:?}");
        let call = &row.completion[0]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "write", "{row:?}");
        assert_eq!(row.completion[1]["role"], "tool");
        // verify ran the solve() of the file opencode wrote: it passes exactly when the model
        // wrote the right answer.
        let written = call["arguments"]["content"]
            .as_str()
            .expect("the file's text");
        // Groups are admitted in dataset order: group i asked question i.
        let (question, expected) = super::rollout::question(row.group_id as usize);
        let right = written.trim_end().ends_with(&format!("return {expected}"));
        assert_eq!(
            row.rewards["env"].as_f64(),
            Some(if right { 1.0 } else { 0.0 }),
            "{written:?} for {question:?}"
        );
    }
}

#[test]
fn an_agent_past_its_timeout_is_killed_with_its_children_and_its_turns_still_count() {
    let case = Case::new("agent-timeout");
    case.write_dataset(1);
    // One turn, then a child that would outlive it, then a hang.
    let agent = case.dir.join("hang.py");
    std::fs::write(
        &agent,
        "import subprocess, sys, time\nfrom openai import OpenAI\n\
         OpenAI().chat.completions.create(model='policy', messages=[{'role': 'user', 'content': sys.argv[1]}])\n\
         subprocess.Popen(['sleep', '1000'])\ntime.sleep(1000)\n",
    )
    .expect("write the agent");
    let python = toml_path(&agent_python());
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nretries = 0\n\n\
         [agent]\ncommand = [{python}, {agent}, \"{{prompt}}\"]\ntimeout = \"10s\"\n",
        agent = toml_path(&agent),
    ));
    let runtime = runtime();
    let sim = simulator(&runtime, 0, "calculator");
    let (output, left) = run_marked(
        &mut case.command(&["--server", &sim.url()]),
        "agent-timeout",
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        left.is_empty(),
        "processes outlived their agent's timeout: {left:?}"
    );
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let rows = case.rows();
    assert_eq!(rows.len(), 2, "{stderr}");
    for row in &rows {
        assert_eq!(row.metrics.get("agent_timed_out"), Some(1.0));
        assert_eq!(row.metrics.get("turns"), Some(1.0));
    }
}

#[test]
fn an_environment_s_verify_judges_an_agent_s_transcript() {
    let case = Case::new("agent-environment");
    case.write_dataset(2);
    let python = toml_path(&agent_python());
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 4\n\n\
         [agent]\ncommand = [{python}, {agent}, \"plain\", \"{{prompt}}\"]\ntimeout = \"60s\"\n\n\
         [environment]\nkind = \"mcp\"\ncommand = [{mcp}, {server}]\ntimeout = \"60s\"\n",
        agent = toml_path(&fixture("openai_agent.py")),
        mcp = toml_path(&super::environment::mcp_python()),
        server = toml_path(&super::environment::kv_env()),
    ));
    let log = case.dir.join("verify.jsonl");
    let runtime = runtime();
    let sim = simulator(&runtime, 1, "calculator");
    let mut command = case.command(&["--server", &sim.url()]);
    let (output, left) = run_marked(command.env("KV_ENV_LOG", &log), "agent-environment");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(left.is_empty(), "processes outlived the run: {left:?}");
    let rows = case.rows();
    assert_eq!(rows.len(), 4, "{stderr}");
    // One session per rollout, reset with its task (the log names its episode), whose
    // verify gave the row's env reward.
    let verified = super::environment::verified(&log);
    assert_eq!(verified.len(), rows.len(), "{verified:?}");
    for row in &rows {
        let episode = format!("r{}-a1", row.rollout_id.0);
        assert_eq!(row.rewards["env"].as_f64(), Some(verified[&episode]));
        // The agent's own tools, not the environment's.
        let call = &row.completion[0]["tool_calls"][0]["function"]["name"];
        assert_eq!(call, "calculator");
    }
}

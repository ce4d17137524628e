//! Per-turn cost of a long agent conversation: parse, render, tokenize, reconcile.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-rollout-core --bench turns`; the real
//! Qwen3 tokenizer comes from `cargo xtask fixtures`). A Qwen3 agent conversation of 128
//! turns (each: reasoning, a tool call, a tool result) grows to about 64k tokens. Each turn
//! does what the rollout loop does between two generations: parse the sampled text into an
//! assistant message, append it and the tool result, build the next prompt's ids, and
//! reconcile the turn record. Three ways to build the prompt are compared: append mode (the
//! previous prompt, the sampled ids and the template's delta, `IncrementalRender::delta`),
//! incremental (`IncrementalRender::prompt`) and a full `apply_chat_template` every turn.
//! Prints a markdown table and, when `BENCH_OUT` names a folder, writes `rollout-core.json`
//! there.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::{
    hint::black_box,
    path::PathBuf,
    time::{Duration, Instant},
};

use async_grpo_rollout_core::{
    ChatTokenizer, Message, Reconciler, ReconcilerConfig, RenderOptions, RolloutId, ToolCallParser,
    TurnRecord, parse::HermesParser,
};
use serde_json::{Value, json};
use test_support::cache_dir;

const TURNS: usize = 128;
const REPORTED: [usize; 3] = [8, 32, 128];

/// Deterministic English-like text of `words` words.
fn words(seed: u64, words: usize) -> String {
    const VOCAB: &[&str] = &[
        "the", "model", "checks", "file", "value", "returns", "because", "error", "function",
        "result", "we", "should", "test", "output", "line", "path", "config", "and", "then",
        "search", "parse", "number", "string", "list", "first", "next", "with", "without",
        "server", "request", "token", "cache", "update", "index", "query", "answer", "is", "of",
    ];
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut text = String::new();
    for i in 0..words {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        if i > 0 {
            text.push(if i % 17 == 0 { '\n' } else { ' ' });
        }
        text.push_str(VOCAB[(state >> 33) as usize % VOCAB.len()]);
        if i % 11 == 10 {
            text.push_str(&format!(" {}.", state % 1000));
        }
    }
    text
}

/// What the model sampled at `turn`: Qwen3 reasoning, a sentence, and one hermes tool call
/// written as Qwen3 writes it (Python's JSON separators).
fn sampled_text(turn: usize) -> String {
    format!(
        "<think>\n{}\n</think>\n\n{}\n<tool_call>\n{{\"name\": \"search\", \"arguments\": {{\"query\": \"{}\", \"limit\": {}}}}}\n</tool_call>",
        words(turn as u64 * 7 + 2, 150),
        words(turn as u64 * 7 + 3, 20),
        words(turn as u64 * 7 + 1, 6).replace('\n', " "),
        turn % 10 + 1
    )
}

/// The parse step of a turn: content and reasoning split, tool call read.
fn assistant_message(text: &str) -> Message {
    let parsed = HermesParser.parse(text);
    let (reasoning, content) = parsed
        .content
        .split_once("</think>")
        .map(|(r, c)| {
            (
                r.trim_start_matches("<think>").trim_matches('\n'),
                c.trim_matches('\n'),
            )
        })
        .unwrap_or(("", parsed.content.as_str()));
    Message::assistant(content)
        .with("reasoning_content", Value::from(reasoning))
        .with_tool_calls(&parsed.tool_calls)
}

struct Turn {
    sampled_text: String,
    sampled_ids: Vec<u32>,
    logprobs: Vec<f32>,
    tool_result: Message,
}

fn start() -> (Vec<Message>, RenderOptions) {
    let tools = vec![
        json!({"type": "function", "function": {"name": "search", "description": "Search the code base", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}}),
        json!({"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}),
    ];
    (
        vec![
            Message::system("You are a coding agent. Use the tools to answer."),
            Message::user(words(99, 60)),
        ],
        RenderOptions::generation().with_tools(tools),
    )
}

/// Per-turn durations of one conversation, building prompts incrementally.
fn run_incremental(tokenizer: &ChatTokenizer, turns: &[Turn]) -> (Vec<Duration>, Vec<usize>) {
    let (history, options) = start();
    let mut conversation = tokenizer.incremental(options).expect("the template");
    conversation.push(&history);
    let ids = conversation.prompt().expect("renders").ids.to_vec();
    let mut reconciler = Reconciler::new(RolloutId(1), ReconcilerConfig::default());
    let mut prompt_ids = ids;
    let mut durations = Vec::with_capacity(turns.len());
    let mut lengths = Vec::with_capacity(turns.len());
    for turn in turns {
        let started = Instant::now();
        reconciler
            .push(&TurnRecord::new(
                prompt_ids,
                turn.sampled_ids.clone(),
                turn.logprobs.clone(),
                0,
            ))
            .expect("a valid turn");
        let message = assistant_message(&turn.sampled_text);
        conversation.push(&[message, turn.tool_result.clone()]);
        prompt_ids = conversation.prompt().expect("renders").ids.to_vec();
        durations.push(started.elapsed());
        lengths.push(prompt_ids.len());
    }
    let tally = reconciler.tally();
    assert_eq!(
        (tally.realign, tally.fork),
        (0, 0),
        "the rendered history must extend the sampled ids: {tally:?}"
    );
    assert_eq!(conversation.stats().rewrites, 0);
    black_box(reconciler.finish());
    (durations, lengths)
}

/// Per-turn durations of one conversation in append mode: the next prompt is the previous
/// one, the sampled ids and the template's delta after them.
fn run_append(tokenizer: &ChatTokenizer, turns: &[Turn]) -> (Vec<Duration>, Vec<usize>) {
    let (history, options) = start();
    let mut conversation = tokenizer.incremental(options).expect("the template");
    conversation.push(&history);
    let mut prompt_ids = conversation.prompt().expect("renders").ids.to_vec();
    let prompt = conversation.state();
    let eos = tokenizer.eos_token_id().expect("Qwen3 names its EOS");
    let mut reconciler = Reconciler::new(RolloutId(1), ReconcilerConfig::default());
    let mut durations = Vec::with_capacity(turns.len());
    let mut lengths = Vec::with_capacity(turns.len());
    for turn in turns {
        let started = Instant::now();
        let record = TurnRecord::new(
            prompt_ids,
            turn.sampled_ids.clone(),
            turn.logprobs.clone(),
            0,
        );
        reconciler.push(&record).expect("a valid turn");
        let message = assistant_message(&turn.sampled_text);
        let at = conversation.len();
        conversation.push(&[message, turn.tool_result.clone()]);
        let delta = conversation
            .delta(&prompt, at, eos)
            .expect("an exact delta");
        prompt_ids = record.prompt_ids;
        prompt_ids.extend_from_slice(&record.sampled_ids);
        prompt_ids.extend_from_slice(&delta);
        durations.push(started.elapsed());
        lengths.push(prompt_ids.len());
    }
    let tally = reconciler.tally();
    assert_eq!((tally.realign, tally.fork), (0, 0), "{tally:?}");
    let stats = conversation.stats();
    assert_eq!(stats.deltas, turns.len() as u64);
    assert_eq!(stats.wide_deltas, 0, "the window was exact at every turn");
    black_box(reconciler.finish());
    (durations, lengths)
}

/// Per-turn durations of one conversation, rendering and tokenizing everything each turn.
fn run_full(tokenizer: &ChatTokenizer, turns: &[Turn]) -> (Vec<Duration>, Vec<usize>) {
    let (mut history, options) = start();
    let mut prompt_ids = tokenizer
        .apply_chat_template(&history, &options)
        .expect("renders")
        .ids;
    let mut reconciler = Reconciler::new(RolloutId(1), ReconcilerConfig::default());
    let mut durations = Vec::with_capacity(turns.len());
    let mut lengths = Vec::with_capacity(turns.len());
    for turn in turns {
        let started = Instant::now();
        reconciler
            .push(&TurnRecord::new(
                prompt_ids,
                turn.sampled_ids.clone(),
                turn.logprobs.clone(),
                0,
            ))
            .expect("a valid turn");
        history.push(assistant_message(&turn.sampled_text));
        history.push(turn.tool_result.clone());
        prompt_ids = tokenizer
            .apply_chat_template(&history, &options)
            .expect("renders")
            .ids;
        durations.push(started.elapsed());
        lengths.push(prompt_ids.len());
    }
    assert_eq!(reconciler.tally().fork, 0);
    (durations, lengths)
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

fn main() {
    let dir = cache_dir().join("qwen3");
    let tokenizer = ChatTokenizer::from_dir(&dir)
        .unwrap_or_else(|error| panic!("{error}: run `cargo xtask fixtures` first"));
    let eos = tokenizer.eos_token_id().expect("Qwen3 names its EOS");
    let turns: Vec<Turn> = (0..TURNS)
        .map(|turn| {
            let sampled_text = sampled_text(turn);
            let mut sampled_ids = tokenizer.encode(&sampled_text).expect("encodes");
            sampled_ids.push(eos);
            let logprobs = sampled_ids
                .iter()
                .map(|&id| -((id % 97) as f32) / 50.0)
                .collect();
            Turn {
                sampled_text,
                sampled_ids,
                logprobs,
                tool_result: Message::tool(format!("call_{turn}"), words(turn as u64 * 7 + 5, 150)),
            }
        })
        .collect();

    // Warm-up, then the measured runs. `BENCH_PROFILE=1` runs only the incremental way, in
    // a loop, for a profiler.
    if std::env::var_os("BENCH_PROFILE").is_some() {
        for _ in 0..40 {
            black_box(run_incremental(&tokenizer, &turns));
        }
        return;
    }
    run_append(&tokenizer, &turns);
    run_incremental(&tokenizer, &turns);
    let append: Vec<(Vec<Duration>, Vec<usize>)> =
        (0..7).map(|_| run_append(&tokenizer, &turns)).collect();
    let incremental: Vec<(Vec<Duration>, Vec<usize>)> = (0..7)
        .map(|_| run_incremental(&tokenizer, &turns))
        .collect();
    let full: Vec<(Vec<Duration>, Vec<usize>)> =
        (0..3).map(|_| run_full(&tokenizer, &turns)).collect();
    assert_eq!(
        incremental[0].1, full[0].1,
        "both ways build the same prompts"
    );
    assert_eq!(
        append[0].1, incremental[0].1,
        "append mode builds prompts of the same lengths (the template keeps this history)"
    );

    println!(
        "| turn | prompt tokens | append (median of 7) | incremental (median of 7) | full re-render (median of 3) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for turn in REPORTED {
        let index = turn - 1;
        let app = median(append.iter().map(|(d, _)| d[index]).collect());
        let inc = median(incremental.iter().map(|(d, _)| d[index]).collect());
        let ful = median(full.iter().map(|(d, _)| d[index]).collect());
        let tokens = incremental[0].1[index];
        println!(
            "| {turn} | {tokens} | {:.3} ms | {:.3} ms | {:.3} ms |",
            app.as_secs_f64() * 1e3,
            inc.as_secs_f64() * 1e3,
            ful.as_secs_f64() * 1e3,
        );
        rows.push(json!({
            "turn": turn,
            "prompt_tokens": tokens,
            "append_ms": app.as_secs_f64() * 1e3,
            "incremental_ms": inc.as_secs_f64() * 1e3,
            "full_ms": ful.as_secs_f64() * 1e3,
        }));
    }
    let total = |runs: &[(Vec<Duration>, Vec<usize>)]| {
        median(runs.iter().map(|(d, _)| d.iter().sum()).collect())
    };
    let (app_total, inc_total, full_total) = (total(&append), total(&incremental), total(&full));
    println!(
        "\nwhole conversation ({TURNS} turns): append {:.1} ms, incremental {:.1} ms, full re-render {:.1} ms",
        app_total.as_secs_f64() * 1e3,
        inc_total.as_secs_f64() * 1e3,
        full_total.as_secs_f64() * 1e3
    );
    // Where the time of a late turn goes.
    let (mut history, options) = start();
    for turn in &turns {
        history.push(assistant_message(&turn.sampled_text));
        history.push(turn.tool_result.clone());
    }
    let render_started = Instant::now();
    for _ in 0..10 {
        black_box(tokenizer.render(&history, &options).expect("renders"));
    }
    let render = render_started.elapsed() / 10;
    let chunk = format!(
        "<|im_start|>assistant\n{}<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        turns[5].sampled_text,
        turns[5].tool_result.content().unwrap_or("")
    );
    let encode_started = Instant::now();
    for _ in 0..100 {
        black_box(tokenizer.encode(&chunk).expect("encodes"));
    }
    let encode = encode_started.elapsed() / 100;
    let parse_started = Instant::now();
    for _ in 0..100 {
        black_box(assistant_message(&turns[5].sampled_text));
    }
    let parse = parse_started.elapsed() / 100;
    println!(
        "\nturn {TURNS} parts: full template render {:.3} ms, tokenizing one turn's text ({} bytes) {:.3} ms, parsing one answer {:.3} ms",
        render.as_secs_f64() * 1e3,
        chunk.len(),
        encode.as_secs_f64() * 1e3,
        parse.as_secs_f64() * 1e3
    );
    if let Some(out) = std::env::var_os("BENCH_OUT") {
        let report = json!({
            "bench": "rollout-core turns",
            "turns": rows,
            "conversation_ms": {"append": app_total.as_secs_f64() * 1e3, "incremental": inc_total.as_secs_f64() * 1e3, "full": full_total.as_secs_f64() * 1e3},
        });
        let path = PathBuf::from(out).join("rollout-core.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&report).unwrap_or_default(),
        )
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    }
}

//! Template parity: every llama.cpp template and the tokenizers' own, on every case of
//! `parity/cases.json`, against what transformers' `apply_chat_template` produced
//! (`xtask/parity/generate.py`, run by `cargo xtask fixtures` into the cache). Llama-3
//! templates go through the real Llama-3.1 tokenizer, the others through the real Qwen3 one.

use std::{collections::BTreeMap, fmt::Write};

use async_grpo_rollout_core::{ChatTemplate, Message, RenderError, RenderOptions};
use serde_json::Value;

use crate::{fixture, llama31, qwen3};

/// 2026-01-15 12:30:45 UTC, the clock the generator froze.
const FROZEN_CLOCK: i64 = 1_768_480_245;
const CASES: &str = include_str!("parity/cases.json");

struct Case {
    name: String,
    messages: Vec<Message>,
    options: RenderOptions,
}

fn cases(spec: &Value) -> Vec<Case> {
    let tools: Vec<Value> = spec["tools"].as_array().cloned().unwrap_or_default();
    spec["cases"]
        .as_array()
        .expect("cases is a list")
        .iter()
        .map(|case| Case {
            name: case["name"].as_str().expect("a case has a name").to_owned(),
            messages: serde_json::from_value(case["messages"].clone()).expect("messages"),
            options: RenderOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(false),
                continue_final_message: case["continue_final_message"].as_bool().unwrap_or(false),
                tools: case["tools"]
                    .as_bool()
                    .unwrap_or(false)
                    .then(|| tools.clone()),
                kwargs: case["kwargs"].as_object().cloned().unwrap_or_default(),
                ..RenderOptions::default()
            },
        })
        .collect()
}

/// How a render was refused, told apart the same way on both sides.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// The template called `raise_exception`: transformers' `TemplateError`, Rust's
    /// [`RenderError::Raised`].
    Raised,
    /// The template failed while rendering: one of Jinja2's own errors (`UndefinedError`,
    /// `SecurityError`, ...) or Python's (`TypeError`, ...) in transformers, a
    /// [`RenderError::Template`] in Rust.
    Failed,
    /// Rust refused in another way (its tokenizer, `continue_final_message`): nothing the
    /// generator records.
    Other(String),
}

impl Refusal {
    /// The kind of what the generator recorded: `"{type(error).__name__}: {error}"`. Jinja2
    /// raises its own failures as subclasses of `TemplateError`, named after the subclass; a
    /// bare `TemplateError` is what transformers' `raise_exception` raises.
    fn of_python(recorded: &str) -> Refusal {
        match recorded.split_once(':').map_or(recorded, |(name, _)| name) {
            "TemplateError" => Refusal::Raised,
            _ => Refusal::Failed,
        }
    }

    fn of_rust(error: &RenderError) -> Refusal {
        match error {
            RenderError::Raised { .. } => Refusal::Raised,
            RenderError::Template { .. } => Refusal::Failed,
            other => Refusal::Other(other.to_string()),
        }
    }
}

/// Where two texts first differ, with some context, for the report.
fn first_difference(expected: &str, actual: &str) -> String {
    let at = expected
        .char_indices()
        .zip(actual.chars())
        .find(|((_, e), a)| e != a)
        .map_or(expected.len().min(actual.len()), |((i, _), _)| i);
    let from = expected[..at]
        .char_indices()
        .rev()
        .nth(30)
        .map_or(0, |(i, _)| i);
    let show = |s: &str| {
        let start = from.min(s.len());
        let end = s[start..]
            .char_indices()
            .nth(80)
            .map_or(s.len(), |(i, _)| start + i);
        format!("{:?}", s.get(start..end).unwrap_or(""))
    };
    format!(
        "byte {at}: expected {} got {}",
        show(expected),
        show(actual)
    )
}

#[test]
fn every_template_renders_every_case_as_transformers_does() {
    let spec: Value = serde_json::from_str(CASES).expect("cases.json is JSON");
    let expected_path = fixture("parity/expected.json");
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(&expected_path).expect("expected outputs readable"),
    )
    .expect("expected outputs are JSON");
    let explained = spec["explained"].as_object().cloned().unwrap_or_default();
    let cases = cases(&spec);
    let mut report = String::new();
    let mut unexplained = Vec::new();
    let mut stale_explanations = Vec::new();
    let (mut total_pass, mut compared, mut both_refused) = (0, 0, 0);
    let results = expected["results"]
        .as_object()
        .expect("results by template");
    let families: BTreeMap<&String, &Value> = results.iter().collect();
    // What the fixture holds: each template's result for each case of cases.json, no fewer.
    let case_names: Vec<&str> = cases.iter().map(|case| case.name.as_str()).collect();
    let mut fixture_cases = 0;
    for (family, outputs) in &families {
        let held: Vec<&str> = outputs
            .as_object()
            .map(|outputs| outputs.keys().map(String::as_str).collect())
            .unwrap_or_default();
        let missing: Vec<&&str> = case_names.iter().filter(|c| !held.contains(c)).collect();
        assert!(
            missing.is_empty(),
            "{expected_path:?} has no result of {family} for {missing:?}: run `cargo xtask fixtures`"
        );
        fixture_cases += held.len();
    }
    assert!(
        !cases.is_empty() && fixture_cases > 0,
        "nothing to compare: {} cases in cases.json, {} results in {expected_path:?} \
         ({} templates); run `cargo xtask fixtures`",
        cases.len(),
        fixture_cases,
        families.len()
    );
    // Two tokenizers loaded once; the template is what varies.
    let (qwen3, llama31) = (qwen3(), llama31());
    let llama_families: Vec<&str> = spec["llama31_families"]
        .as_array()
        .map(|families| families.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (family, outputs) in families {
        let tokenizer = if llama_families.contains(&family.as_str()) {
            &llama31
        } else {
            &qwen3
        };
        let template = if family.ends_with("-tokenizer") {
            let source = tokenizer
                .template(&RenderOptions::default())
                .expect("the tokenizer's own template")
                .source();
            ChatTemplate::new(family.as_str(), source)
        } else {
            let path = fixture(&format!("templates/{family}"));
            let source = std::fs::read_to_string(&path).expect("template readable");
            ChatTemplate::new(path.display().to_string(), source)
        };
        let mut template = match template {
            Ok(template) => template,
            Err(error) => {
                unexplained.push(format!("{family}: does not compile: {error}"));
                continue;
            }
        };
        template.freeze_clock(FROZEN_CLOCK);
        let mut passed = 0;
        let mut notes = Vec::new();
        for case in &cases {
            let want = &outputs[&case.name];
            // What `ChatTokenizer::apply_chat_template` does: render, then encode.
            let got = template
                .render(&case.messages, &case.options, tokenizer.special_tokens())
                .and_then(|text| Ok((tokenizer.encode(&text)?, text)));
            compared += 1;
            let verdict = match (want.get("error"), &got) {
                (Some(error), Err(refusal)) => {
                    let python = Refusal::of_python(error.as_str().unwrap_or_default());
                    let rust = Refusal::of_rust(refusal);
                    if python == rust {
                        both_refused += 1;
                        Ok(())
                    } else {
                        Err(format!(
                            "both refused, differently: transformers {python:?} ({error}), \
                             Rust {rust:?} ({refusal})"
                        ))
                    }
                }
                (Some(error), Ok(_)) => {
                    Err(format!("transformers raised {error} but Rust rendered"))
                }
                (None, Err(error)) => Err(format!("Rust raised: {error}")),
                (None, Ok((rendered_ids, rendered_text))) => {
                    let text = want["text"].as_str().unwrap_or_default();
                    let ids: Vec<u32> =
                        serde_json::from_value(want["ids"].clone()).unwrap_or_default();
                    if rendered_text != text {
                        Err(format!(
                            "text differs at {}",
                            first_difference(text, rendered_text)
                        ))
                    } else if *rendered_ids != ids {
                        Err("same text, different ids".to_owned())
                    } else {
                        Ok(())
                    }
                }
            };
            let key = format!("{family}/{}", case.name);
            match (verdict, explained.get(&key)) {
                (Ok(()), None) => passed += 1,
                (Ok(()), Some(_)) => {
                    passed += 1;
                    stale_explanations.push(key);
                }
                (Err(why), Some(reason)) => notes.push(format!(
                    "  - {} (explained: {}): {why}",
                    case.name,
                    reason.as_str().unwrap_or("")
                )),
                (Err(why), None) => {
                    notes.push(format!("  - {}: {why}", case.name));
                    unexplained.push(format!("{key}: {why}"));
                }
            }
        }
        total_pass += passed;
        let tokenizer_name = if std::ptr::eq(tokenizer, &llama31) {
            "llama3.1"
        } else {
            "qwen3"
        };
        let _ = writeln!(
            report,
            "{family} [{tokenizer_name} tokenizer]: {passed}/{}",
            cases.len()
        );
        for note in notes {
            let _ = writeln!(report, "{note}");
        }
    }
    let _ = writeln!(
        report,
        "parity: {total_pass}/{compared} renders identical to transformers {} (text and ids; {both_refused} of them cases the template refuses in both, the same way), {} unexplained mismatches",
        expected["generator"]["transformers"]
            .as_str()
            .unwrap_or("?"),
        unexplained.len()
    );
    #[allow(
        clippy::print_stdout,
        reason = "the report is what `cargo xtask parity` shows"
    )]
    {
        println!("{report}");
    }
    std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("parity-report.txt"),
        &report,
    )
    .expect("report written");
    assert!(
        stale_explanations.is_empty(),
        "these cases now match; remove them from `explained` in cases.json: {stale_explanations:?}"
    );
    assert!(
        unexplained.is_empty(),
        "{} mismatches:\n{}",
        unexplained.len(),
        unexplained.join("\n")
    );
    // Every case of every template in the fixture was rendered and compared (a template that
    // does not compile is an unexplained mismatch above).
    assert_eq!(
        compared, fixture_cases,
        "{compared} cases compared, but {expected_path:?} holds {fixture_cases}"
    );
}

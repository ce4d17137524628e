//! Append mode's token delta on real templates: what `IncrementalRender::delta` gives after an
//! assistant turn is the tail of the whole conversation's rendering, token for token, and the
//! appended prompt equals the re-rendered one whenever the template keeps history.

use std::sync::LazyLock;

use async_grpo_rollout_core::{
    ChatTemplate, ChatTokenizer, Message, NoExactDelta, ParsedCall, RenderOptions, RenderState,
};
use proptest::prelude::*;
use serde_json::{Value, json};

use crate::{fixture, llama31, quickstart, qwen3, qwen3_as_mistral, qwen3_with_template};

/// A chat template and tokenizer pair, and what the conversations must respect to render.
pub(crate) struct Family {
    pub(crate) name: &'static str,
    pub(crate) tokenizer: ChatTokenizer,
    /// Most tool calls in one assistant message (Llama 3.1 and gpt-oss take one).
    pub(crate) max_calls: usize,
    /// Whether the template writes a `reasoning_content` field (Qwen3's think blocks).
    pub(crate) reasoning: bool,
}

fn family(name: &'static str, tokenizer: ChatTokenizer) -> Family {
    Family {
        name,
        tokenizer,
        max_calls: 2,
        reasoning: false,
    }
}

/// Every family whose template has an exact delta, loaded once.
pub(crate) fn families() -> &'static [Family] {
    static FAMILIES: LazyLock<Vec<Family>> = LazyLock::new(|| {
        vec![
            Family {
                reasoning: true,
                ..family("qwen3", qwen3())
            },
            family("qwen3-coder", qwen3_with_template("Qwen3-Coder.jinja")),
            Family {
                max_calls: 1,
                ..family(
                    "llama3.1",
                    llama31()
                        .with_template_file(fixture(
                            "templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
                        ))
                        .expect("the template compiles"),
                )
            },
            family(
                "mistral-nemo",
                qwen3_as_mistral("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
            ),
            family(
                "mistral-small-3.2",
                qwen3_as_mistral("Mistral-Small-3.2-24B-Instruct-2506.jinja")
                    .with_frozen_clock(1_750_000_000),
            ),
            family("qwq", qwen3_with_template("Qwen-QwQ-32B.jinja")),
            family(
                "qwen2.5",
                qwen3_with_template("Qwen-Qwen2.5-7B-Instruct.jinja"),
            ),
            family("quickstart", quickstart()),
        ]
    });
    &FAMILIES
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "search", "description": "Search the notes", "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q"]}}}),
        json!({"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}),
    ]
}

pub(crate) fn options() -> RenderOptions {
    RenderOptions::generation().with_tools(tools())
}

/// One turn of a generated conversation: the assistant message, then either tool results
/// (one per call) or a user message.
#[derive(Debug, Clone)]
struct Turn {
    content: String,
    reasoning: Option<String>,
    calls: Vec<(String, i64)>,
    results: Vec<String>,
    user: String,
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            "[a-zA-Z0-9 ,.!?'\"]{1,30}",
            "[ \n]{1,3}",
            Just("déjà vu 🦀 数学".to_owned()),
            Just("<tool_call>".to_owned()),
        ],
        1..4,
    )
    .prop_map(|pieces| pieces.concat())
}

fn turn() -> impl Strategy<Value = Turn> {
    (
        prop_oneof![Just(String::new()), text()],
        prop::option::of(text()),
        prop::collection::vec(("[a-z ]{1,12}", 0..100i64), 0..3),
        prop::collection::vec(
            prop_oneof![text(), Just("<|im_end|> in a tool's output".to_owned())],
            3,
        ),
        text(),
    )
        .prop_map(|(content, reasoning, calls, results, user)| Turn {
            content,
            reasoning,
            calls,
            results,
            user,
        })
}

/// The messages of `turn` for `family`: the assistant message and what follows it.
fn messages(family: &Family, index: usize, turn: &Turn) -> (Message, Vec<Message>) {
    let calls: Vec<ParsedCall> = turn
        .calls
        .iter()
        .take(family.max_calls)
        .enumerate()
        .map(|(i, (q, n))| ParsedCall {
            // Mistral's templates take ids of 9 alphanumerics.
            id: format!("call{index:02}x{i:02}"),
            name: "search".to_owned(),
            arguments: json!({"q": q, "n": n}),
        })
        .collect();
    let mut assistant = Message::assistant(turn.content.trim());
    if family.reasoning
        && let Some(reasoning) = &turn.reasoning
    {
        assistant = assistant.with("reasoning_content", Value::from(reasoning.trim()));
    }
    if calls.is_empty() {
        // A plain answer: a user message follows.
        return (assistant, vec![Message::user(turn.user.trim())]);
    }
    let results = calls
        .iter()
        .zip(&turn.results)
        .map(|(call, result)| Message::tool(&call.id, result.trim()))
        .collect();
    (assistant.with_tool_calls(&calls), results)
}

/// The prompt of a conversation: a system message or not, and a question.
fn prompt(system: bool) -> Vec<Message> {
    let question = Message::user("Find the notes about Rust and count them.");
    if system {
        vec![Message::system("You answer with the tools."), question]
    } else {
        vec![question]
    }
}

/// Checks every turn of `turns` on `family`: the whole conversation's ids end with the stop
/// token and the delta; while the template keeps history, the appended prompt equals the
/// re-rendered one. Returns how many turns were compared whole.
fn check(family: &Family, system: bool, turns: &[Turn]) -> Result<usize, TestCaseError> {
    let tokenizer = &family.tokenizer;
    let options = options();
    let stop = tokenizer.eos_token_id().expect("an EOS");
    let mut history = prompt(system);
    let mut render = tokenizer.incremental(options.clone()).expect("a template");
    render.push(&history);
    render.prompt().expect("the prompt renders");
    let start: RenderState = render.state();
    let mut rerendered = start.ids().to_vec();
    let mut appended = Some(rerendered.clone());
    let mut compared = 0;
    for (index, turn) in turns.iter().enumerate() {
        let (assistant, new) = messages(family, index, turn);
        let at = history.len();
        history.push(assistant.clone());
        history.extend(new.iter().cloned());
        render.push(std::slice::from_ref(&assistant));
        render.push(&new);
        let next = tokenizer
            .apply_chat_template(&history, &options)
            .unwrap_or_else(|e| panic!("{}: {e}", family.name))
            .ids;
        let delta = render
            .delta(&start, at, stop)
            .unwrap_or_else(|e| panic!("{}: turn {index}: {e}", family.name));
        // The part the delta covers is the whole rendering's, token for token.
        let tail: Vec<u32> = std::iter::once(stop).chain(delta.iter().copied()).collect();
        prop_assert!(
            next.ends_with(&tail),
            "{}: turn {}: the delta {:?} is not the end of the rendering",
            family.name,
            index,
            tokenizer.tokenizer().decode(&delta, false)
        );
        // While history is kept, the model's answer is what the template renders up to its
        // stop token, and the appended prompt is the re-rendered one.
        appended = match appended.filter(|_| next.starts_with(&rerendered)) {
            Some(mut ids) => {
                let answer = next[rerendered.len()..]
                    .iter()
                    .position(|&id| id == stop)
                    .map(|end| &next[rerendered.len()..=rerendered.len() + end]);
                prop_assert!(answer.is_some(), "{}: no stop token", family.name);
                ids.extend_from_slice(answer.unwrap_or_default());
                ids.extend_from_slice(&delta);
                prop_assert_eq!(&ids, &next, "{}: turn {}", family.name, index);
                compared += 1;
                Some(ids)
            }
            None => None,
        };
        rerendered = next;
    }
    Ok(compared)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn the_appended_prompt_equals_the_rerendered_one_while_the_template_keeps_history(
        system in any::<bool>(),
        turns in prop::collection::vec(turn(), 1..5),
    ) {
        for family in families() {
            check(family, system, &turns)?;
        }
    }
}

#[test]
fn templates_that_keep_history_in_a_tool_loop_are_compared_at_every_turn() {
    // Deterministic: tool turns only, no system message (Mistral Nemo moves the system
    // message to the last user turn) and, for Qwen3, reasoning in every turn (it drops an
    // empty think block of an earlier turn, which the model sampled but the template does not
    // render: that is the reason append mode exists).
    let turns: Vec<Turn> = (0..4)
        .map(|i| Turn {
            content: if i % 2 == 0 {
                String::new()
            } else {
                format!("Looking up part {i}.")
            },
            reasoning: Some(format!("Step {i}: search again.")),
            calls: vec![(format!("rust part {i}"), i)],
            results: vec![format!("{i} notes found"); 3],
            user: String::new(),
        })
        .collect();
    let compared: Vec<(&str, usize)> = families()
        .iter()
        .map(|family| {
            let compared = check(family, false, &turns).unwrap_or_else(|e| panic!("{e}"));
            (family.name, compared)
        })
        .collect();
    // QwQ drops the reasoning of every assistant turn, the latest included: never compared.
    assert_eq!(
        compared,
        [
            ("qwen3", 4),
            ("qwen3-coder", 4),
            ("llama3.1", 4),
            ("mistral-nemo", 4),
            ("mistral-small-3.2", 4),
            ("qwq", 0),
            ("qwen2.5", 4),
            ("quickstart", 4),
        ]
    );
}

#[test]
fn qwen3_dropping_an_empty_think_block_leaves_the_delta_exact() {
    let tokenizer = qwen3();
    let options = options();
    let stop = tokenizer.eos_token_id().expect("an EOS");
    let mut render = tokenizer.incremental(options.clone()).expect("a template");
    let mut history = prompt(false);
    render.push(&history);
    let first = render.prompt().expect("renders").ids.to_vec();
    let start = render.state();
    // What a Qwen3 model samples: an empty think block, then the call.
    let sampled_text = "<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"rust\"}}\n</tool_call>";
    let mut sampled = tokenizer.encode(sampled_text).expect("encodes");
    sampled.push(stop);
    let call = ParsedCall {
        id: "call_0".into(),
        name: "search".into(),
        arguments: json!({"q": "rust"}),
    };
    let assistant = Message::assistant("")
        .with("reasoning_content", Value::from(""))
        .with_tool_calls(&[call]);
    let result = Message::tool("call_0", "3 notes");
    history.extend([assistant.clone(), result.clone()]);
    render.push(&[assistant, result]);
    let delta = render.delta(&start, 1, stop).expect("an exact delta");
    assert_eq!(
        tokenizer
            .tokenizer()
            .decode(&delta, false)
            .expect("decodes"),
        "\n<|im_start|>user\n<tool_response>\n3 notes\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
    let appended: Vec<u32> = [first.as_slice(), &sampled, &delta].concat();
    let rerendered = tokenizer
        .apply_chat_template(&history, &options)
        .expect("renders")
        .ids;
    // The re-rendered history lost the think block the model sampled; the appended prompt
    // kept it, and agrees with the rendering from the end of the answer on.
    assert!(!rerendered.starts_with(&[first.as_slice(), &sampled].concat()));
    assert!(rerendered.ends_with(&[&[stop][..], &delta].concat()));
    assert!(appended.starts_with(&[first.as_slice(), &sampled].concat()));
    assert_eq!(render.stats().deltas, 1);
}

#[test]
fn gpt_oss_with_a_tokenizer_whose_stop_token_it_never_writes_has_no_exact_delta() {
    let tokenizer = qwen3_with_template("openai-gpt-oss-120b.jinja");
    let stop = tokenizer.eos_token_id().expect("an EOS");
    let mut render = tokenizer.incremental(options()).expect("a template");
    render.push(&prompt(false));
    render.prompt().expect("renders");
    let start = render.state();
    let call = ParsedCall {
        id: "call_0".into(),
        name: "search".into(),
        arguments: json!({"q": "rust"}),
    };
    render.push(&[
        Message::assistant("").with_tool_calls(&[call]),
        Message::tool("call_0", "3 notes"),
    ]);
    let error = render.delta(&start, 1, stop).expect_err("no exact delta");
    assert_eq!(
        error,
        NoExactDelta::StopNotWritten {
            token: "<|im_end|>".into()
        }
    );
    assert_eq!(error.kind(), "stop_not_written");
}

#[test]
fn an_answer_ending_on_an_ordinary_token_has_no_exact_delta() {
    let tokenizer = qwen3();
    let mut render = tokenizer.incremental(options()).expect("a template");
    render.push(&prompt(false));
    render.prompt().expect("renders");
    let start = render.state();
    render.push(&[Message::assistant("Hi."), Message::user("And?")]);
    let ordinary = tokenizer.encode("Hi").expect("encodes")[0];
    assert_eq!(
        render.delta(&start, 1, ordinary),
        Err(NoExactDelta::NoStopToken {
            last: Some(ordinary)
        })
    );
    assert!(matches!(
        render.delta(&start, 0, tokenizer.eos_token_id().expect("an EOS")),
        Err(NoExactDelta::NoSuchMessage { index: 0, .. })
    ));
}

/// ChatML whose tool results carry a number counted over the whole conversation, as some
/// templates number tool calls: what follows an assistant turn depends on earlier turns.
const COUNTING: &str = r#"{%- set ns = namespace(n=0) %}
{%- for m in messages %}
{%- if m.role == "tool" %}{% set ns.n = ns.n + 1 %}<|im_start|>tool
[{{ ns.n }}] {{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

#[test]
fn a_template_numbering_tool_results_over_the_conversation_gets_its_delta_from_all_of_it() {
    let qwen = qwen3();
    let tokenizer = ChatTokenizer::new(
        qwen.tokenizer().clone(),
        ChatTemplate::new("counting", COUNTING).expect("compiles"),
        qwen.special_tokens().clone(),
    );
    let options = RenderOptions::generation();
    let stop = tokenizer.eos_token_id().expect("an EOS");
    let mut history = vec![Message::user("Count.")];
    let mut render = tokenizer.incremental(options.clone()).expect("a template");
    render.push(&history);
    let mut ids = render.prompt().expect("renders").ids.to_vec();
    let start = render.state();
    for turn in 0..3 {
        let assistant = Message::assistant(format!("call {turn}"));
        let mut sampled = tokenizer.encode(&format!("call {turn}")).expect("encodes");
        sampled.push(stop);
        let result = Message::tool("call_0", "ok");
        let at = history.len();
        history.extend([assistant.clone(), result.clone()]);
        render.push(&[assistant, result]);
        let delta = render.delta(&start, at, stop).expect("an exact delta");
        ids.extend(sampled);
        ids.extend(delta);
        let full = tokenizer
            .apply_chat_template(&history, &options)
            .expect("renders");
        assert_eq!(ids, full.ids, "turn {turn}");
    }
    // The first turn's window is the whole conversation; the later ones were not exact.
    assert_eq!(render.stats().wide_deltas, 2);
    assert_eq!(render.stats().deltas, 3);
}

/// ChatML that writes an assistant's reasoning as a turn of its own before its answer: the
/// stop token appears twice in one assistant message.
const REASONING_TURN: &str = r#"{%- for m in messages %}
{%- if m.role == "assistant" and m.reasoning_content %}<|im_start|>assistant
{{ m.reasoning_content }}<|im_end|>
{% endif %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

#[test]
fn a_template_writing_the_stop_token_twice_in_an_assistant_turn_has_no_exact_delta() {
    let qwen = qwen3();
    let tokenizer = ChatTokenizer::new(
        qwen.tokenizer().clone(),
        ChatTemplate::new("reasoning-turn", REASONING_TURN).expect("compiles"),
        qwen.special_tokens().clone(),
    );
    let stop = tokenizer.eos_token_id().expect("an EOS");
    let mut render = tokenizer
        .incremental(RenderOptions::generation())
        .expect("a template");
    render.push(&[Message::user("Count.")]);
    render.prompt().expect("renders");
    let start = render.state();
    render.push(&[
        Message::assistant("Two.").with("reasoning_content", Value::from("One, two.")),
        Message::user("Again."),
    ]);
    assert_eq!(
        render.delta(&start, 1, stop),
        Err(NoExactDelta::StopAmbiguous {
            token: "<|im_end|>".into(),
            count: 2
        })
    );
}

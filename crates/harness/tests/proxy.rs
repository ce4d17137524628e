//! The recording proxy over real HTTP, its turns answered by a scripted sampler: keys keep
//! rollouts apart, OpenAI's error shapes, limits answered as `length`, the SSE stream, and the
//! capture: an answer the agent wrote back its own way is continued with the sampled ids,
//! history the agent changed is rendered whole.

use std::time::Duration;

use async_grpo_harness::proxy::{Proxy, ProxyConfig, ProxySession};
use reqwest::StatusCode;
use rollout::{Finish, SampleRefused, SampleRequests, Sampled, Sampler};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::lifecycle::chat_tokenizer;

/// What the scripted model answers: text, or a refusal.
#[derive(Clone)]
enum Script {
    Say(&'static str),
    Refuse(SampleRefused),
}

/// A proxy, and a session whose turns are answered by `script` in order (the last answer
/// repeats); every prompt the session sent arrives on the returned channel.
async fn proxy() -> Proxy {
    proxy_with(ProxyConfig::new("policy")).await
}

async fn proxy_with(config: ProxyConfig) -> Proxy {
    Proxy::start(chat_tokenizer(), config)
        .await
        .expect("the proxy starts")
}

fn session(
    proxy: &Proxy,
    script: Vec<Script>,
) -> (ProxySession, mpsc::UnboundedReceiver<Vec<u32>>) {
    let (sampler, requests) = Sampler::channel();
    let (prompts, seen) = mpsc::unbounded_channel();
    tokio::spawn(answer(requests, script, prompts));
    (proxy.session(sampler), seen)
}

/// The ids of `text` followed by the end-of-answer token.
fn ids(text: &str) -> Vec<u32> {
    let tokenizer = chat_tokenizer();
    let mut ids = tokenizer
        .tokenizer()
        .encode(text, false)
        .expect("the text encodes")
        .get_ids()
        .to_vec();
    ids.push(tokenizer.eos_token_id().expect("an end-of-answer token"));
    ids
}

async fn answer(
    mut requests: SampleRequests,
    script: Vec<Script>,
    prompts: mpsc::UnboundedSender<Vec<u32>>,
) {
    let mut turn = 0;
    while let Some(request) = requests.next().await {
        let _ = prompts.send(request.prompt_ids().to_vec());
        let step = script[turn.min(script.len() - 1)].clone();
        request.answer(match step {
            Script::Say(text) => Ok(Sampled::new(ids(text), Finish::Stop)),
            Script::Refuse(refused) => Err(refused),
        });
        turn += 1;
    }
}

const CALL: &str = "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2 + 3\"}}\n</tool_call>";

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluates an expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }}])
}

fn question() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You calculate."}),
        json!({"role": "user", "content": "What is 2 + 3?"}),
    ]
}

async fn post(proxy: &Proxy, key: Option<&str>, path: &str, body: Value) -> (StatusCode, String) {
    let mut request = reqwest::Client::new()
        .post(format!("{}{path}", proxy.base_url()))
        .json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = tokio::time::timeout(Duration::from_secs(30), request.send())
        .await
        .expect("the proxy answers")
        .expect("an HTTP answer");
    let status = response.status();
    (status, response.text().await.expect("a body"))
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_rollout_s_own_key_reaches_its_turns() {
    let proxy = proxy().await;
    let (a, mut a_prompts) = session(&proxy, vec![Script::Say("Five.")]);
    let (b, mut b_prompts) = session(&proxy, vec![Script::Say("Five.")]);
    let chat = json!({"model": "policy", "messages": question()});
    for key in [None, Some("sk-not-a-rollout")] {
        let (status, body) = post(&proxy, key, "/chat/completions", chat.clone()).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        assert_eq!(json_of(&body)["error"]["type"], "authentication_error");
    }
    let (status, body) = post(&proxy, Some(b.key()), "/chat/completions", chat.clone()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(json_of(&body)["choices"][0]["message"]["content"], "Five.");
    assert!(b_prompts.try_recv().is_ok(), "B's turn went to B's sampler");
    assert!(a_prompts.try_recv().is_err(), "nothing reached A's sampler");
    // A finished rollout's key is refused from then on.
    let a_key = a.key().to_owned();
    let transcript = a.finish().await;
    assert!(transcript.completion.is_empty());
    let (status, _) = post(&proxy, Some(&a_key), "/chat/completions", chat).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let models = reqwest::Client::new()
        .get(format!("{}/models", proxy.base_url()))
        .bearer_auth(b.key())
        .send()
        .await
        .expect("an answer");
    assert_eq!(models.status(), StatusCode::OK);
    let models: Value = models.json().await.expect("JSON");
    assert_eq!(models["data"][0]["id"], "policy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_served_is_an_openai_shaped_400() {
    let proxy = proxy().await;
    let (s, mut prompts) = session(&proxy, vec![Script::Say("Five.")]);
    let cases = [
        json!({"messages": question(), "n": 2}),
        json!({"messages": []}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        json!({"no_messages": true}),
    ];
    for body in cases {
        let (status, text) = post(&proxy, Some(s.key()), "/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        let error = json_of(&text);
        assert_eq!(error["error"]["type"], "invalid_request_error", "{text}");
        assert!(error["error"]["message"].is_string());
    }
    assert!(
        prompts.try_recv().is_err(),
        "no refused request was sampled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_limit_is_answered_as_a_length_finish() {
    let proxy = proxy().await;
    let (s, _prompts) = session(&proxy, vec![Script::Refuse(SampleRefused::MaxTurns(4))]);
    let (status, body) = post(
        &proxy,
        Some(s.key()),
        "/chat/completions",
        json!({"messages": question()}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer = json_of(&body);
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(answer["choices"][0]["message"]["content"], "");
    assert_eq!(s.finish().await.stats.limited, 1);
}

/// The `data:` events of an SSE body, `[DONE]` last.
fn events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|event| !event.trim().is_empty())
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"))
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_tool_call_reassembles_from_its_deltas() {
    let proxy = proxy().await;
    let (s, _prompts) = session(&proxy, vec![Script::Say(CALL)]);
    let (status, body) = post(
        &proxy,
        Some(s.key()),
        "/chat/completions",
        json!({"messages": question(), "tools": tools(), "stream": true,
               "stream_options": {"include_usage": true}, "temperature": 0.3}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let events = events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .collect();
    let (mut name, mut arguments, mut finish) = (String::new(), String::new(), None);
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        for choice in chunk["choices"].as_array().expect("choices") {
            for call in choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                assert_eq!(call["index"], 0);
                name += call["function"]["name"].as_str().unwrap_or_default();
                arguments += call["function"]["arguments"].as_str().unwrap_or_default();
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = Some(reason.to_owned());
            }
        }
    }
    assert_eq!(name, "calculator");
    assert_eq!(json_of(&arguments), json!({"expression": "2 + 3"}));
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    let usage = chunks.last().expect("a usage chunk");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], ids(CALL).len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_written_back_differently_is_continued_with_its_sampled_ids() {
    let proxy = proxy().await;
    let (s, mut prompts) = session(&proxy, vec![Script::Say(CALL), Script::Say("It is 5.")]);
    let first = json!({"messages": question(), "tools": tools()});
    let (status, body) = post(&proxy, Some(s.key()), "/chat/completions", first).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer = json_of(&body);
    let call_id = answer["choices"][0]["message"]["tool_calls"][0]["id"].clone();
    let first_prompt = prompts.recv().await.expect("the first prompt");

    // The agent writes the answer back its own way: compact arguments, no content.
    let mut history = question();
    history.extend(call_written_back(&call_id, "{\"expression\":\"2 + 3\"}"));
    let second = json!({"messages": history.clone(), "tools": tools()});
    let (status, body) = post(&proxy, Some(s.key()), "/chat/completions", second).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let second_prompt = prompts.recv().await.expect("the second prompt");
    let mut continued = first_prompt.clone();
    continued.extend(ids(CALL));
    assert!(
        second_prompt.starts_with(&continued) && second_prompt.len() > continued.len(),
        "the second prompt is the first, the sampled ids, then what followed"
    );

    // History the agent changed (another question) is rendered whole.
    history[1] = json!({"role": "user", "content": "What is 3 + 4?"});
    let third = json!({"messages": history, "tools": tools()});
    let (status, _) = post(&proxy, Some(s.key()), "/chat/completions", third).await;
    assert_eq!(status, StatusCode::OK);
    let third_prompt = prompts.recv().await.expect("the third prompt");
    assert!(!third_prompt.starts_with(&continued));

    let transcript = s.finish().await;
    assert_eq!(transcript.stats.reused_turns, 1);
    assert_eq!(transcript.stats.rendered_turns, 2);
    assert_eq!(transcript.stats.tool_calls, 1);
    // The main conversation: the proxy's own answers, the last one's calls included.
    assert_eq!(transcript.prompt.len(), 2);
    let roles: Vec<&str> = transcript.completion.iter().map(|m| m.role()).collect();
    assert_eq!(roles, ["assistant", "tool", "assistant"]);
    assert!(transcript.completion[0].as_map().contains_key("tool_calls"));
}

/// The proxy's calculator call (`call_id`) as an agent writes it back, with `arguments` as
/// it serializes them and no content, then the call's result.
fn call_written_back(call_id: &Value, arguments: &str) -> [Value; 2] {
    [
        json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "calculator", "arguments": arguments},
        }]}),
        json!({"role": "tool", "tool_call_id": call_id, "content": "5"}),
    ]
}

/// A call as a model may sample it: compact JSON, where the template writes `": "`.
const COMPACT_CALL: &str =
    "<tool_call>\n{\"name\":\"calculator\",\"arguments\":{\"expression\":\"2 + 3\"}}\n</tool_call>";

/// Whether `needle` sits in `haystack` as it is, in one piece.
fn holds(haystack: &[u32], needle: &[u32]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_answer_is_sent_as_the_ids_sampled_not_as_the_template_writes_it() {
    let proxy = proxy().await;
    let (s, mut prompts) = session(
        &proxy,
        vec![Script::Say(COMPACT_CALL), Script::Say("It is 5.")],
    );
    let first = json!({"messages": question(), "tools": tools()});
    let (status, body) = post(&proxy, Some(s.key()), "/chat/completions", first).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let call_id = json_of(&body)["choices"][0]["message"]["tool_calls"][0]["id"].clone();
    let first_prompt = prompts.recv().await.expect("the first prompt");

    // The agent writes the call back as the template would (spaced JSON), then its result.
    let mut history = question();
    history.extend(call_written_back(&call_id, "{\"expression\": \"2 + 3\"}"));
    let second = json!({"messages": history, "tools": tools()});
    let (status, body) = post(&proxy, Some(s.key()), "/chat/completions", second).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let second_prompt = prompts.recv().await.expect("the second prompt");

    // The first prompt, the ids sampled (not the template's spaced rendering of the call),
    // then what the template writes for the tool's result up to the next answer.
    let tokenizer = chat_tokenizer();
    let mut expected = first_prompt;
    expected.extend(ids(COMPACT_CALL));
    expected.extend(
        tokenizer
            .encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
            .expect("the delta encodes"),
    );
    assert_eq!(
        second_prompt, expected,
        "the second prompt is the first, the sampled ids, then the template's delta"
    );
    let transcript = s.finish().await;
    assert_eq!(transcript.stats.reused_turns, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_written_back_beside_an_edited_message_is_put_back_as_its_sampled_ids() {
    let proxy = proxy().await;
    let (s, mut prompts) = session(&proxy, vec![Script::Say("Five."), Script::Say("Seven.")]);
    let (status, body) = post(
        &proxy,
        Some(s.key()),
        "/chat/completions",
        json!({"messages": question()}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let _ = prompts.recv().await.expect("the first prompt");

    // The agent edits its system message and writes the answer back with a newline of its
    // own: history rewritten, so the conversation is rendered whole.
    let mut history = question();
    history[0] = json!({"role": "system", "content": "You calculate, briefly."});
    history.push(json!({"role": "assistant", "content": "Five.\n"}));
    history.push(json!({"role": "user", "content": "And 3 + 4?"}));
    let (status, body) = post(
        &proxy,
        Some(s.key()),
        "/chat/completions",
        json!({"messages": history}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let second_prompt = prompts.recv().await.expect("the second prompt");

    let sampled = ids("Five.");
    assert!(
        holds(&second_prompt, &sampled),
        "the proxy's own answer is put back as the ids it sampled: {sampled:?} in {second_prompt:?}"
    );
    assert!(
        !holds(&second_prompt, &ids("Five.\n")),
        "the agent's copy of the answer is not what was rendered"
    );
    let transcript = s.finish().await;
    assert_eq!(transcript.stats.reused_turns, 0);
    assert_eq!(transcript.stats.rendered_turns, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_completion_samples_the_prompt_s_ids() {
    let proxy = proxy().await;
    let (s, mut prompts) = session(&proxy, vec![Script::Say("Five.")]);
    let (status, body) = post(
        &proxy,
        Some(s.key()),
        "/completions",
        json!({"prompt": "2 + 3 =", "max_tokens": 8}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer = json_of(&body);
    assert_eq!(answer["object"], "text_completion");
    assert_eq!(answer["choices"][0]["text"], "Five.");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    let sent = prompts.recv().await.expect("a prompt");
    let expected = chat_tokenizer()
        .tokenizer()
        .encode("2 + 3 =", true)
        .expect("encodes")
        .get_ids()
        .to_vec();
    assert_eq!(sent, expected, "the prompt's own ids, as vLLM tokenizes it");
    let (status, _) = post(
        &proxy,
        Some(s.key()),
        "/completions",
        json!({"prompt": ["a", "b"]}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_keeps_nothing_for_the_rollout() {
    let proxy = proxy().await;
    let (s, mut prompts) = session(
        &proxy,
        vec![
            Script::Say("Five."),
            Script::Refuse(SampleRefused::MaxTurns(1)),
        ],
    );
    let (status, body) = post(
        &proxy,
        Some(s.key()),
        "/chat/completions",
        json!({"messages": question()}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let mut answered = question();
    answered.push(json!({"role": "assistant", "content": "Five."}));
    answered.push(json!({"role": "user", "content": "And 3 + 4?"}));
    let refused = [
        (
            Some("sk-not-a-rollout"),
            json!({"messages": answered.clone()}),
        ),
        (Some(s.key()), json!({"messages": answered.clone(), "n": 3})),
        (Some(s.key()), json!({"messages": "not a list"})),
    ];
    for (key, body) in refused {
        let (status, text) = post(&proxy, key, "/chat/completions", body).await;
        assert!(status.is_client_error(), "{status}: {text}");
    }
    // Past max_turns: the continuation and a new conversation are answered `length`, and
    // neither is kept.
    let side = json!([{"role": "user", "content": "Write a title for this chat."}]);
    for messages in [json!(answered), side] {
        let (status, body) = post(
            &proxy,
            Some(s.key()),
            "/chat/completions",
            json!({"messages": messages}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(json_of(&body)["choices"][0]["finish_reason"], "length");
    }
    let transcript = s.finish().await;
    assert_eq!(transcript.stats.limited, 2);
    assert_eq!(
        transcript.stats.conversations, 1,
        "the refused ones kept none"
    );
    assert_eq!(transcript.stats.rendered_turns, 1);
    let roles: Vec<&str> = transcript.completion.iter().map(|m| m.role()).collect();
    assert_eq!(roles, ["assistant"], "the unanswered question was not kept");
    let mut sampled = 0;
    while prompts.try_recv().is_ok() {
        sampled += 1;
    }
    assert_eq!(
        sampled, 3,
        "only the answered and the limited requests were sampled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_past_max_conversations_are_refused_with_a_400() {
    let proxy = proxy_with(ProxyConfig::new("policy").max_conversations(2)).await;
    let (s, mut prompts) = session(&proxy, vec![Script::Say("Five.")]);
    let asks = |text: &str| json!({"messages": [{"role": "user", "content": text}]});
    for text in ["first", "second"] {
        let (status, body) = post(&proxy, Some(s.key()), "/chat/completions", asks(text)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let (status, body) = post(&proxy, Some(s.key()), "/chat/completions", asks("third")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let error = json_of(&body);
    assert_eq!(error["error"]["type"], "invalid_request_error");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("max_conversations"), "{message}");
    // A conversation held goes on.
    let go_on = json!({"messages": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "Five."},
        {"role": "user", "content": "again"},
    ]});
    let (status, body) = post(&proxy, Some(s.key()), "/chat/completions", go_on).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let transcript = s.finish().await;
    assert_eq!(transcript.stats.conversations, 2);
    let mut sampled = 0;
    while prompts.try_recv().is_ok() {
        sampled += 1;
    }
    assert_eq!(sampled, 3, "the refused conversation was never sampled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_outside_the_vocabulary_are_a_400_not_wrapped() {
    let proxy = proxy().await;
    let (s, mut prompts) = session(&proxy, vec![Script::Say("Five.")]);
    let vocab = chat_tokenizer().tokenizer().get_vocab_size(true) as u64;
    let bad = [
        json!([1, u64::from(u32::MAX) + 6]),
        json!([[1, u64::from(u32::MAX) + 1]]),
        json!([1, -1]),
        json!([-3]),
        json!([vocab]),
        json!([1.5]),
    ];
    for prompt in bad {
        let (status, body) = post(
            &proxy,
            Some(s.key()),
            "/completions",
            json!({"prompt": prompt.clone()}),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{prompt}: {body}");
        let error = json_of(&body);
        assert_eq!(error["error"]["param"], "prompt", "{body}");
    }
    assert!(prompts.try_recv().is_err(), "no refused prompt was sampled");
    let (status, body) = post(
        &proxy,
        Some(s.key()),
        "/completions",
        json!({"prompt": [1, vocab - 1]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        prompts.recv().await.expect("a prompt"),
        [1, vocab as u32 - 1]
    );
}

//! Rendering and tokenizing with real templates and the real Qwen3 tokenizer, incrementally
//! and whole; loading tokenizer folders; template errors.

use async_grpo_rollout_core::{
    ChatTemplate, ChatTokenizer, Message, ParsedCall, RenderError, RenderOptions,
};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

use crate::{fixture, llama31_with_its_template, qwen3, qwen25};

#[test]
fn qwen3_renders_and_tokenizes_a_conversation_as_transformers_does() {
    let tokenizer = qwen3();
    let rendered = tokenizer
        .apply_chat_template(&[Message::user("hi")], &RenderOptions::generation())
        .expect("renders");
    // Expected values printed by transformers 5.24 `apply_chat_template` on this tokenizer.
    assert_eq!(
        rendered.text,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        rendered.ids,
        [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
    );
    assert_eq!(tokenizer.eos_token_id(), Some(151645));
}

#[test]
fn qwen3_renders_tools_tool_calls_and_results() {
    let tokenizer = qwen3();
    let call = ParsedCall {
        id: "call_1".into(),
        name: "get_weather".into(),
        arguments: json!({"city": "Paris", "unit": "°C"}),
    };
    let messages = [
        Message::user("Weather in Paris?"),
        Message::assistant("").with_tool_calls(&[call]),
        Message::tool("call_1", "{\"temp\": 21}"),
    ];
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
    ];
    let text = tokenizer
        .render(&messages, &RenderOptions::generation().with_tools(tools))
        .expect("renders");
    assert!(
        text.contains("{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & later\""),
        "tojson must not HTML-escape and must use Python's separators:\n{text}"
    );
    assert!(
        text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}\n</tool_call>"),
        "{text}"
    );
    assert!(
        text.contains(
            "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>"
        ),
        "{text}"
    );
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
}

#[test]
fn enable_thinking_false_adds_an_empty_think_block() {
    let tokenizer = qwen3();
    let options = RenderOptions::generation().with_kwarg("enable_thinking", json!(false));
    let text = tokenizer
        .render(&[Message::user("hi")], &options)
        .expect("renders");
    assert!(
        text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{text}"
    );
}

#[test]
fn continue_final_message_ends_inside_the_last_message() {
    let tokenizer = qwen25();
    let options = RenderOptions {
        continue_final_message: true,
        ..RenderOptions::default()
    };
    let text = tokenizer
        .render(
            &[Message::user("2+2?"), Message::assistant("The answer is")],
            &options,
        )
        .expect("renders");
    assert!(
        text.ends_with("<|im_start|>assistant\nThe answer is"),
        "{text}"
    );
    let both = RenderOptions {
        add_generation_prompt: true,
        ..options
    };
    let error = tokenizer
        .render(&[Message::user("2+2?"), Message::assistant("The")], &both)
        .expect_err("incompatible options");
    assert!(
        matches!(error, RenderError::ContinueFinalMessage { .. }),
        "{error}"
    );
}

#[test]
fn a_template_error_names_the_template_the_line_and_the_message() {
    let template = ChatTemplate::new(
        "broken.jinja",
        "{% for m in messages %}\n{{ raise_exception('Conversation roles must alternate, got ' + m.role) }}\n{% endfor %}",
    )
    .expect("compiles");
    let error = template
        .render(
            &[Message::system("x")],
            &RenderOptions::default(),
            &Map::new(),
        )
        .expect_err("raises");
    assert_eq!(
        error.to_string(),
        "chat template broken.jinja, line 2: Conversation roles must alternate, got system"
    );
    let syntax = ChatTemplate::new("bad.jinja", "ok\n{% if %}").expect_err("does not compile");
    assert!(
        syntax
            .to_string()
            .starts_with("chat template bad.jinja, line 2: syntax error"),
        "{syntax}"
    );
}

#[test]
fn templates_print_values_and_json_the_python_way() {
    let template = ChatTemplate::new(
        "t",
        "{{ messages[0].x }}|{{ none }}|{{ true }}|{{ 4 / 2 }}|{{ messages[0].x | tojson(indent=2) }}|{{ 'a<b' | tojson }}|{{ messages[0].x | tojson(sort_keys=true, separators=(',', ':')) }}|{{ 'A b'.lower().split(' ') }}|{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    )
    .expect("compiles");
    let message = Message::user("u").with("x", json!({"b": [1, 2.5, null], "a": "é"}));
    let text = template
        .render(&[message], &RenderOptions::default(), &Map::new())
        .expect("renders");
    assert_eq!(
        text,
        "{'b': [1, 2.5, None], 'a': 'é'}|None|True|2.0|{\n  \"b\": [\n    1,\n    2.5,\n    null\n  ],\n  \"a\": \"é\"\n}|\"a<b\"|{\"a\":\"é\",\"b\":[1,2.5,null]}|['a', 'b']|02"
    );
}

#[test]
fn special_tokens_and_kwargs_reach_the_template_and_null_keys_are_dropped() {
    let template = ChatTemplate::new(
        "t",
        "{{ bos_token }}{{ eos_token }}{% for m in messages %}{{ m.content is defined }}{{ m.reasoning_content }}{{ m.thinking }}{% endfor %}",
    )
    .expect("compiles");
    let mut special = Map::new();
    special.insert("bos_token".into(), json!("<s>"));
    special.insert("eos_token".into(), json!("</s>"));
    let message = Message::assistant("x")
        .with("content", Value::Null)
        .with("reasoning", json!("r"));
    let options = RenderOptions::default().with_kwarg("eos_token", json!("<end>"));
    let text = template
        .render(&[message], &options, &special)
        .expect("renders");
    assert_eq!(text, "<s><end>Falserr");
}

#[test]
fn a_missing_or_broken_tokenizer_folder_is_an_error_naming_the_file() {
    let missing = ChatTokenizer::from_dir("/nonexistent/model").expect_err("no folder");
    assert_eq!(
        missing.to_string(),
        "/nonexistent/model: expected a Hugging Face tokenizer folder holding tokenizer.json"
    );
    let dir = tempdir("broken");
    std::fs::write(dir.join("tokenizer.json"), "{not json").expect("write");
    let broken = ChatTokenizer::from_dir(&dir).expect_err("bad json");
    assert!(
        broken
            .to_string()
            .contains("tokenizer.json: not a tokenizers tokenizer.json"),
        "{broken}"
    );
}

const TINY_TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
 "added_tokens":[{"id":0,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
                 {"id":1,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
 "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
 "model":{"type":"WordLevel","vocab":{"<s>":0,"</s>":1,"[UNK]":2,"hi":3,"tool":4,"default":5},"unk_token":"[UNK]"}}"#;

#[test]
fn named_templates_are_chosen_as_transformers_chooses_them() {
    let dir = tempdir("named");
    std::fs::write(dir.join("tokenizer.json"), TINY_TOKENIZER).expect("write");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({
            "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>",
            "chat_template": [
                {"name": "default", "template": "{{ bos_token }}default {{ messages[0].content }}"},
                {"name": "tool_use", "template": "{{ bos_token }}tool {{ messages[0].content }}{{ eos_token }}"}
            ]
        })
        .to_string(),
    )
    .expect("write");
    let tokenizer = ChatTokenizer::from_dir(&dir).expect("loads");
    assert_eq!(tokenizer.template_names(), ["default", "tool_use"]);
    let plain = tokenizer
        .apply_chat_template(&[Message::user("hi")], &RenderOptions::default())
        .expect("renders");
    assert_eq!(
        (plain.text.as_str(), plain.ids.as_slice()),
        ("<s>default hi", &[0, 5, 3][..])
    );
    let with_tools = tokenizer
        .apply_chat_template(
            &[Message::user("hi")],
            &RenderOptions::default().with_tools(vec![]),
        )
        .expect("renders");
    assert_eq!(with_tools.ids, [0, 4, 3, 1]);
    let unknown = tokenizer
        .render(
            &[Message::user("hi")],
            &RenderOptions {
                chat_template: Some("rag".into()),
                ..RenderOptions::default()
            },
        )
        .expect_err("no such template");
    assert_eq!(
        unknown.to_string(),
        "no chat template named \"rag\"; available: default, tool_use"
    );

    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ messages[0].content }}!\n",
    )
    .expect("write");
    let from_jinja = ChatTokenizer::from_dir(&dir).expect("loads");
    assert_eq!(
        from_jinja
            .render(&[Message::user("hi")], &RenderOptions::default())
            .expect("renders"),
        "hi!",
        "chat_template.jinja wins over tokenizer_config.json, and a single trailing newline is dropped as in Jinja2"
    );
}

/// A fixture folder's `tokenizer.json` text and `tokenizer_config.json` object, as
/// [`ChatTokenizer::from_parts`] takes them.
fn parts_of(name: &str) -> (String, Map<String, Value>) {
    let read = |file: &str| {
        std::fs::read_to_string(fixture(&format!("{name}/{file}"))).expect("the fixture reads")
    };
    let config = serde_json::from_str(&read("tokenizer_config.json")).expect("a JSON object");
    (read("tokenizer.json"), config)
}

#[test]
fn a_tokenizer_built_from_a_folder_s_parts_renders_as_the_folder_does() {
    let call = ParsedCall {
        id: "call_1".into(),
        name: "get_weather".into(),
        arguments: json!({"city": "Paris"}),
    };
    let conversation = [
        Message::system("Be brief."),
        Message::user("Weather in Paris?"),
        Message::assistant("").with_tool_calls(&[call]),
        Message::tool("call_1", "{\"temp\": 21}"),
    ];
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}),
    ];
    let cases = [
        RenderOptions::generation(),
        RenderOptions::generation().with_tools(tools),
        RenderOptions::default(),
    ];
    for name in ["qwen3", "llama31"] {
        let from_dir = ChatTokenizer::from_dir(fixture(name)).expect("the folder loads");
        let (tokenizer_json, config) = parts_of(name);
        let from_parts =
            ChatTokenizer::from_parts(&tokenizer_json, &config).expect("the parts load");
        assert_eq!(
            from_parts.special_tokens(),
            from_dir.special_tokens(),
            "{name}"
        );
        assert_eq!(
            from_parts.template_names(),
            from_dir.template_names(),
            "{name}"
        );
        assert_eq!(from_parts.eos_token_id(), from_dir.eos_token_id(), "{name}");
        assert_eq!(from_parts.bos_token_id(), from_dir.bos_token_id(), "{name}");
        for options in &cases {
            let expected = from_dir
                .apply_chat_template(&conversation[..2], options)
                .expect("renders");
            let rendered = from_parts
                .apply_chat_template(&conversation[..2], options)
                .expect("renders");
            assert_eq!(rendered, expected, "{name} {options:?}");
        }
        if name == "qwen3" {
            let options = RenderOptions::generation();
            assert_eq!(
                from_parts
                    .apply_chat_template(&conversation, &options)
                    .expect("renders"),
                from_dir
                    .apply_chat_template(&conversation, &options)
                    .expect("renders"),
                "tool calls and results"
            );
        }
    }
}

#[test]
fn an_edited_template_in_the_parts_is_the_one_used() {
    let (tokenizer_json, mut config) = parts_of("qwen3");
    let original = config["chat_template"].clone();
    config.insert(
        "chat_template".into(),
        json!(format!(
            // An expression: Qwen3's template starts with `{{%-`, which would trim a text.
            "{{{{ 'EDITED ' }}}}{}",
            original.as_str().expect("a string template")
        )),
    );
    let edited = ChatTokenizer::from_parts(&tokenizer_json, &config).expect("the parts load");
    let messages = [Message::user("hi")];
    let rendered = edited
        .apply_chat_template(&messages, &RenderOptions::generation())
        .expect("renders");
    let folder = qwen3()
        .apply_chat_template(&messages, &RenderOptions::generation())
        .expect("renders");
    assert_eq!(rendered.text, format!("EDITED {}", folder.text));
    assert_eq!(
        rendered.ids,
        [edited.encode("EDITED ").expect("encodes"), folder.ids].concat()
    );

    // Named templates, as tokenizer_config.json lists them: chosen as from a folder.
    config.insert(
        "chat_template".into(),
        json!([
            {"name": "default", "template": "default {{ messages[0].content }}"},
            {"name": "tool_use", "template": "tool_use {{ messages[0].content }}"}
        ]),
    );
    let named = ChatTokenizer::from_parts(&tokenizer_json, &config).expect("the parts load");
    assert_eq!(named.template_names(), ["default", "tool_use"]);
    let with_tools = RenderOptions::default().with_tools(vec![]);
    assert_eq!(
        named.render(&messages, &with_tools).expect("renders"),
        "tool_use hi"
    );
}

#[test]
fn parts_that_are_not_a_tokenizer_are_an_error_naming_the_part() {
    let mut config = Map::new();
    config.insert("chat_template".into(), json!("{{ messages[0].content }}"));
    let broken = ChatTokenizer::from_parts("{not json", &config).expect_err("bad json");
    assert_eq!(
        broken.to_string(),
        "tokenizer.json (in memory): not a tokenizers tokenizer.json"
    );
    config.insert("chat_template".into(), json!(42));
    let bad_template = ChatTokenizer::from_parts(TINY_TOKENIZER, &config).expect_err("a number");
    assert_eq!(
        bad_template.to_string(),
        "tokenizer_config (in memory): expected chat_template to be a string or a list of named templates"
    );
    config.insert("chat_template".into(), json!("{% if %}"));
    let uncompiled = ChatTokenizer::from_parts(TINY_TOKENIZER, &config).expect_err("no condition");
    assert!(
        uncompiled
            .to_string()
            .starts_with("chat template tokenizer_config (in memory)#chat_template"),
        "{uncompiled}"
    );
}

#[test]
fn parts_encode_without_the_truncation_a_tokenizer_in_memory_was_left_with() {
    // What `backend_tokenizer.to_str()` gives after a call with truncation=True, max_length=1.
    let truncated = TINY_TOKENIZER.replace(
        r#""truncation":null"#,
        r#""truncation":{"direction":"Right","max_length":1,"strategy":"LongestFirst","stride":0}"#,
    );
    let mut config = Map::new();
    config.insert(
        "chat_template".into(),
        json!("{{ messages[0].content }} hi"),
    );
    let tokenizer = ChatTokenizer::from_parts(&truncated, &config).expect("the parts load");
    let rendered = tokenizer
        .apply_chat_template(&[Message::user("hi")], &RenderOptions::default())
        .expect("renders");
    assert_eq!(rendered.ids, [3, 3]);
}

#[test]
fn the_template_s_bos_is_the_only_bos_even_when_the_tokenizer_would_add_one() {
    let dir = tempdir("bos");
    // A post-processor that prepends <s>, as Llama tokenizers have: encoding with special
    // tokens added would give two BOS; apply_chat_template encodes without.
    let tokenizer = TINY_TOKENIZER.replace(
        r#""post_processor":null"#,
        r#""post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}}],"special_tokens":{"<s>":{"id":"<s>","ids":[0],"tokens":["<s>"]}}}"#,
    );
    std::fs::write(dir.join("tokenizer.json"), tokenizer).expect("write");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<s>", "chat_template": "{{ bos_token }}{{ messages[0].content }}"})
            .to_string(),
    )
    .expect("write");
    let tokenizer = ChatTokenizer::from_dir(&dir).expect("loads");
    let with_post_processor = tokenizer
        .tokenizer()
        .encode("<s>hi", true)
        .expect("encodes");
    assert_eq!(
        with_post_processor.get_ids(),
        [0, 0, 3],
        "the post-processor adds a BOS"
    );
    let rendered = tokenizer
        .apply_chat_template(&[Message::user("hi")], &RenderOptions::default())
        .expect("renders");
    assert_eq!(rendered.ids, [0, 3]);
    assert_eq!(tokenizer.bos_token_id(), Some(0));
}

#[test]
fn incremental_rendering_detects_a_template_that_drops_earlier_reasoning() {
    let tokenizer = qwen3();
    let mut conversation = tokenizer
        .incremental(RenderOptions::default())
        .expect("template");
    conversation.push(&[
        Message::user("What is 2+2?"),
        Message::assistant("4").with("reasoning_content", json!("2+2 is 4.")),
    ]);
    conversation.conversation().expect("renders");
    assert!(conversation.text().contains("<think>\n2+2 is 4.\n</think>"));
    let first_encoded = conversation.stats().encoded_bytes;
    conversation.push(&[Message::user("And 3+3?")]);
    conversation.prompt().expect("renders");
    assert!(
        !conversation.text().contains("2+2 is 4."),
        "Qwen3 drops earlier reasoning"
    );
    let stats = conversation.stats();
    assert_eq!(
        (stats.renders, stats.rewrites, stats.full_encodes),
        (2, 1, 1),
        "the rewrite is counted and tokenization restarts at the last special token before it"
    );
    let second = stats.encoded_bytes - first_encoded;
    let unchanged = "<|im_start|>user\nWhat is 2+2?".len() as u64;
    assert!(
        second <= conversation.text().len() as u64 - unchanged,
        "the unchanged first message is not tokenized again: {second} bytes of {}",
        conversation.text().len()
    );
    assert_eq!(
        conversation.ids(),
        tokenizer.encode(conversation.text()).expect("encodes")
    );
}

#[test]
fn incremental_rendering_tokenizes_only_the_suffix_when_the_prefix_holds() {
    let tokenizer = qwen25();
    let mut conversation = tokenizer
        .incremental(RenderOptions::default())
        .expect("template");
    let long = "word ".repeat(2000);
    conversation.push(&[Message::system(long.clone()), Message::user("hi")]);
    conversation.prompt().expect("renders");
    let first = conversation.stats().encoded_bytes;
    conversation.push(&[Message::assistant("hello"), Message::user("again")]);
    let prompt = conversation.prompt().expect("renders");
    assert!(
        prompt
            .text
            .ends_with("again<|im_end|>\n<|im_start|>assistant\n")
    );
    let full = tokenizer
        .apply_chat_template(
            &[
                Message::system(long),
                Message::user("hi"),
                Message::assistant("hello"),
                Message::user("again"),
            ],
            &RenderOptions::generation(),
        )
        .expect("renders");
    assert_eq!(prompt.ids, full.ids);
    let stats = conversation.stats();
    assert_eq!(
        (stats.rewrites, stats.full_encodes, stats.incremental),
        (0, 1, 1)
    );
    assert!(
        stats.encoded_bytes - first < 100,
        "only the suffix was tokenized: {stats:?}"
    );
}

#[test]
fn a_failed_render_keeps_the_conversation_as_it_was() {
    let template = ChatTemplate::new(
        "strict",
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    )
    .expect("compiles");
    let tokenizer = ChatTokenizer::new(qwen25().tokenizer().clone(), template, Map::new());
    let mut conversation = tokenizer
        .incremental(RenderOptions::default())
        .expect("template");
    conversation.push(&[Message::user("a")]);
    let ids = conversation.conversation().expect("renders").ids.to_vec();
    conversation.push(&[Message::tool("x", "b")]);
    let error = conversation.conversation().expect_err("raises");
    assert_eq!(
        error.to_string(),
        "chat template strict, line 1: no tools here"
    );
    assert_eq!(conversation.ids(), ids);
}

fn text_piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9 ,.!?'\"\n]{0,40}",
        "[ \n\t]{1,4}",
        Just("<|im_end|>".to_owned()),
        Just("<tool_call>".to_owned()),
        Just("déjà vu 🦀 数学".to_owned()),
        Just("  leading and trailing  ".to_owned()),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    (0..4usize, prop::collection::vec(text_piece(), 1..4)).prop_map(|(role, pieces)| {
        let text = pieces.concat();
        match role {
            0 => Message::user(text),
            1 => Message::assistant(text),
            2 => Message::tool("call_0", text),
            _ => Message::assistant(text).with_tool_calls(&[ParsedCall {
                id: "call_0".into(),
                name: "f".into(),
                arguments: json!({"q": "x y", "n": 3}),
            }]),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn incremental_ids_equal_full_rendering_on_every_render(
        batches in prop::collection::vec(prop::collection::vec(message(), 1..4), 1..6),
    ) {
        let tokenizer = qwen25();
        let mut conversation = tokenizer.incremental(RenderOptions::default()).expect("template");
        let mut all = vec![Message::user("start")];
        conversation.push(&all);
        conversation.prompt().expect("renders");
        for batch in &batches {
            conversation.push(batch);
            all.extend(batch.iter().cloned());
            for generation in [false, true] {
                let before = conversation.text().to_owned();
                let rewrites = conversation.stats().rewrites;
                let rendered = if generation {
                    conversation.prompt()
                } else {
                    conversation.conversation()
                }
                .expect("renders");
                let (text, ids) = (rendered.text.to_owned(), rendered.ids.to_vec());
                let options = RenderOptions { add_generation_prompt: generation, ..RenderOptions::default() };
                let full = tokenizer.apply_chat_template(&all, &options).expect("renders");
                prop_assert_eq!(&text, &full.text);
                prop_assert_eq!(&ids, &full.ids);
                if full.text.starts_with(&before) {
                    // History kept: never counted as a rewrite, never tokenized whole.
                    prop_assert_eq!(conversation.stats().rewrites, rewrites);
                }
            }
        }
    }

    #[test]
    fn incremental_ids_equal_full_rendering_with_the_llama31_tokenizer_and_template(
        batches in prop::collection::vec(prop::collection::vec(message(), 1..4), 1..5),
    ) {
        let tokenizer = llama31_with_its_template();
        let options = RenderOptions::default().with_kwarg("date_string", json!("15 Jan 2026"));
        let mut conversation = tokenizer.incremental(options.clone()).expect("template");
        let mut all = vec![Message::system("Be brief."), Message::user("start")];
        conversation.push(&all);
        conversation.prompt().expect("renders");
        for batch in &batches {
            conversation.push(batch);
            all.extend(batch.iter().cloned());
            let ids = conversation.prompt().expect("renders").ids.to_vec();
            let full = tokenizer
                .apply_chat_template(&all, &RenderOptions { add_generation_prompt: true, ..options.clone() })
                .expect("renders");
            prop_assert_eq!(ids, full.ids);
        }
        // A tool result right after a prompt replaces its "assistant" header: counted as a
        // rewrite, re-tokenized from the header's first special token, never from the start.
        prop_assert_eq!(conversation.stats().full_encodes, 1);
    }

    #[test]
    fn without_consecutive_tool_messages_qwen25_never_rewrites_history(
        batches in prop::collection::vec(prop::collection::vec(message(), 1..4), 1..6),
    ) {
        let tokenizer = qwen25();
        let mut conversation = tokenizer.incremental(RenderOptions::default()).expect("template");
        let mut all = vec![Message::user("start")];
        conversation.push(&all);
        conversation.prompt().expect("renders");
        for batch in &batches {
            let batch: Vec<Message> = batch.iter().filter(|m| m.role() != "tool").cloned().collect();
            conversation.push(&batch);
            all.extend(batch);
            conversation.prompt().expect("renders");
        }
        let full = tokenizer.apply_chat_template(&all, &RenderOptions::generation()).expect("renders");
        prop_assert_eq!(conversation.ids(), full.ids.as_slice());
        let stats = conversation.stats();
        prop_assert_eq!(stats.rewrites, 0);
        prop_assert_eq!(stats.full_encodes, 1);
    }
}

/// A fresh directory, removed when the test passes.
fn tempdir(name: &str) -> test_support::ScratchDir {
    test_support::ScratchDir::new(&format!("rollout-core-{name}"))
}

#[test]
fn the_fixture_cache_holds_the_qwen3_tokenizer() {
    assert!(fixture("qwen3/tokenizer.json").is_file());
}

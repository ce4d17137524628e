//! Tool-call parsers: each format, content around calls, malformed calls, and fuzzing.

use async_grpo_rollout_core::{
    ParsedOutput, ToolCallParser,
    parse::{
        HermesParser, Llama3JsonParser, MistralParser, ParseTally, Qwen3CoderParser, detect_parser,
        parser_by_name,
    },
};
use proptest::prelude::*;
use serde_json::json;

fn names_and_arguments(output: &ParsedOutput) -> Vec<(String, serde_json::Value)> {
    output
        .tool_calls
        .iter()
        .map(|c| (c.name.clone(), c.arguments.clone()))
        .collect()
}

#[test]
fn hermes_reads_calls_and_keeps_the_text_before_them_as_content() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3, \"metric\": true, \"ratio\": 0.5}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
    let output = HermesParser.parse(text);
    assert_eq!(output.content, "Let me check.\n");
    assert_eq!(
        names_and_arguments(&output),
        [
            (
                "get_weather".to_owned(),
                json!({"city": "Paris", "days": 3, "metric": true, "ratio": 0.5})
            ),
            ("now".to_owned(), json!({})),
        ]
    );
    assert!(output.failures.is_empty());
    let id = &output.tool_calls[0].id;
    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
    assert_ne!(output.tool_calls[0].id, output.tool_calls[1].id);
}

#[test]
fn hermes_accepts_a_final_call_left_unclosed() {
    let output =
        HermesParser.parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}\n");
    assert_eq!(
        names_and_arguments(&output),
        [("f".to_owned(), json!({"x": [1, 2]}))]
    );
    assert_eq!(output.content, "");
}

#[test]
fn hermes_leaves_a_malformed_call_as_content_and_says_why() {
    let text = "Sure.<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": }</tool_call><tool_call>{\"name\": \"g\"}</tool_call>";
    let output = HermesParser.parse(text);
    assert_eq!(
        output.content,
        "Sure.<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": }</tool_call>"
    );
    assert_eq!(names_and_arguments(&output), [("g".to_owned(), json!({}))]);
    assert_eq!(output.failures.len(), 1);
    assert!(
        output.failures[0]
            .reason
            .starts_with("invalid JSON in <tool_call>"),
        "{:?}",
        output.failures
    );
    let mut tally = ParseTally::default();
    tally.record(&output);
    assert_eq!((tally.outputs, tally.calls, tally.failures), (1, 1, 1));
}

#[test]
fn hermes_reports_a_call_without_a_name() {
    let output = HermesParser.parse("<tool_call>{\"arguments\": {}}</tool_call>");
    assert!(output.tool_calls.is_empty());
    assert_eq!(output.failures[0].reason, "the call has no \"name\"");
    assert_eq!(output.content, "<tool_call>{\"arguments\": {}}</tool_call>");
}

#[test]
fn text_without_calls_is_content_for_every_parser() {
    for name in ["hermes", "qwen3_coder", "llama3_json", "mistral"] {
        let parser = parser_by_name(name).expect("a known parser");
        let output = parser.parse("The answer is 42.");
        assert_eq!(output.content, "The answer is 42.", "{name}");
        assert!(
            output.tool_calls.is_empty() && output.failures.is_empty(),
            "{name}"
        );
    }
}

#[test]
fn qwen3_coder_reads_xml_parameters_as_strings_without_schemas() {
    let text = "I'll run it.\n<tool_call>\n<function=run>\n<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>";
    let output = Qwen3CoderParser::default().parse(text);
    assert_eq!(output.content, "I'll run it.\n");
    assert_eq!(
        names_and_arguments(&output),
        [(
            "run".to_owned(),
            json!({"command": "ls -la", "timeout": "30"})
        )]
    );
}

#[test]
fn qwen3_coder_types_values_by_the_tool_schema() {
    let tools = vec![
        json!({"type": "function", "function": {"name": "run", "parameters": {
            "type": "object",
            "properties": {
                "timeout": {"type": "integer"}, "verbose": {"type": "boolean"},
                "env": {"type": "object"}, "ratio": {"type": "number"}, "note": {"type": "string"}
            }
        }}}),
    ];
    let text = "<tool_call>\n<function=run>\n<parameter=timeout>\n30\n</parameter>\n<parameter=verbose>\nTrue\n</parameter>\n<parameter=env>\n{\"A\": 1}\n</parameter>\n<parameter=ratio>\n0.25\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>";
    let output = Qwen3CoderParser::with_tools(tools).parse(text);
    assert_eq!(
        output.tool_calls[0].arguments,
        json!({"timeout": 30, "verbose": true, "env": {"A": 1}, "ratio": 0.25, "note": "42"})
    );
}

#[test]
fn qwen3_coder_reads_two_calls_and_reports_one_without_a_function() {
    let text = "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\noops\n</tool_call>\n<tool_call>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>";
    let output = Qwen3CoderParser::default().parse(text);
    assert_eq!(
        names_and_arguments(&output),
        [
            ("a".to_owned(), json!({})),
            ("b".to_owned(), json!({"x": "1"}))
        ]
    );
    assert_eq!(output.failures.len(), 1);
    assert_eq!(output.content, "<tool_call>\noops\n</tool_call>");
}

#[test]
fn llama3_reads_json_calls_alone_or_after_the_python_tag() {
    let alone = Llama3JsonParser
        .parse("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}");
    assert_eq!(
        names_and_arguments(&alone),
        [("get_weather".to_owned(), json!({"city": "Paris"}))]
    );
    assert_eq!(alone.content, "");

    let tagged = Llama3JsonParser.parse(
        "Checking.<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": {\"n\": 1}}",
    );
    assert_eq!(tagged.content, "Checking.");
    assert_eq!(
        names_and_arguments(&tagged),
        [
            ("a".to_owned(), json!({})),
            ("b".to_owned(), json!({"n": 1}))
        ]
    );
}

#[test]
fn llama3_leaves_broken_json_as_content() {
    let output = Llama3JsonParser.parse("{\"name\": \"a\", \"parameters\": {");
    assert!(output.tool_calls.is_empty());
    assert_eq!(output.content, "{\"name\": \"a\", \"parameters\": {");
    assert!(
        output.failures[0]
            .reason
            .starts_with("invalid JSON tool call")
    );
}

#[test]
fn mistral_reads_the_json_array_format_and_keeps_model_ids() {
    let output = MistralParser.parse(
        "Sure.[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"q\": \"x\"}, \"id\": \"abcDEF123\"}, {\"name\": \"b\", \"arguments\": {}}]",
    );
    assert_eq!(output.content, "Sure.");
    assert_eq!(
        names_and_arguments(&output),
        [
            ("a".to_owned(), json!({"q": "x"})),
            ("b".to_owned(), json!({}))
        ]
    );
    assert_eq!(output.tool_calls[0].id, "abcDEF123");
    let generated = &output.tool_calls[1].id;
    assert!(
        generated.len() == 9 && generated.chars().all(|c| c.is_ascii_alphanumeric()),
        "{generated}"
    );
}

#[test]
fn mistral_reads_the_name_args_format() {
    let output = MistralParser
        .parse("[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[CALL_ID]x1y2z3a4b[ARGS]{}");
    assert_eq!(
        names_and_arguments(&output),
        [
            ("get_weather".to_owned(), json!({"city": "Paris"})),
            ("now".to_owned(), json!({}))
        ]
    );
    assert_eq!(output.tool_calls[1].id, "x1y2z3a4b");
    assert!(output.failures.is_empty());
}

#[test]
fn mistral_leaves_a_malformed_call_as_content() {
    let output = MistralParser.parse("Hi[TOOL_CALLS][{\"name\": 3}]");
    assert!(output.tool_calls.is_empty());
    assert_eq!(output.content, "Hi[TOOL_CALLS][{\"name\": 3}]");
    assert_eq!(
        output.failures[0].reason,
        "the call's \"name\" is a number, not a string"
    );
}

#[test]
fn parsers_are_found_by_name_alias_or_template() {
    assert_eq!(parser_by_name("qwen3").expect("alias").name(), "hermes");
    assert_eq!(
        parser_by_name("llama3").expect("alias").name(),
        "llama3_json"
    );
    let unknown = parser_by_name("nope").expect_err("unknown");
    assert!(unknown.to_string().contains("known: hermes"), "{unknown}");
    let detected = |template: &str| detect_parser(template).map(|p| p.name());
    assert_eq!(detected("{{ '<tool_call>\\n' }}"), Some("hermes"));
    assert_eq!(
        detected("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"),
        Some("qwen3_coder")
    );
    assert_eq!(detected("[TOOL_CALLS]"), Some("mistral"));
    assert_eq!(detected("<|python_tag|>"), Some("llama3_json"));
    assert_eq!(detected("{{ messages }}"), None);
}

fn fragments() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "<|python_tag|>",
        "{",
        "}",
        "[",
        "]",
        "\"name\"",
        "\"arguments\"",
        ":",
        ",",
        ";",
        "\"f\"",
        "1",
        "\n",
        " ",
        ">",
        "é",
        "🦀",
        "null",
    ]);
    prop::collection::vec(prop_oneof![pieces.prop_map(str::to_owned), ".{0,4}"], 0..40)
        .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn no_parser_panics_and_failures_stay_in_the_content(text in fragments()) {
        let parsers: Vec<Box<dyn ToolCallParser>> = vec![
            Box::new(HermesParser),
            Box::new(Qwen3CoderParser::with_tools(vec![json!({"name": "f", "parameters": {"properties": {"x": {"type": "integer"}}}})])),
            Box::new(Llama3JsonParser),
            Box::new(MistralParser),
        ];
        for parser in &parsers {
            let output = parser.parse(&text);
            for failure in &output.failures {
                prop_assert!(output.content.contains(&failure.raw), "{}: {:?}", parser.name(), output);
                prop_assert!(!failure.reason.is_empty());
            }
            prop_assert!(output.content.len() <= text.len(), "{}: content grew", parser.name());
        }
    }

    #[test]
    fn any_string_parses_without_panic(text in any::<String>()) {
        for name in ["hermes", "qwen3_coder", "llama3_json", "mistral"] {
            let _ = parser_by_name(name).expect("known").parse(&text);
        }
    }

    #[test]
    fn hermes_round_trips_well_formed_calls(
        prefix in "[a-zA-Z .,!?]{0,30}",
        calls in prop::collection::vec(("[a-z_]{1,12}", prop::collection::btree_map("[a-z]{1,6}", -1000i64..1000, 0..4)), 1..4),
    ) {
        let mut text = prefix.clone();
        for (name, args) in &calls {
            text.push_str(&format!("<tool_call>\n{}\n</tool_call>\n", json!({"name": name, "arguments": args})));
        }
        let output = HermesParser.parse(&text);
        prop_assert_eq!(&output.content, &prefix);
        prop_assert!(output.failures.is_empty());
        let expected: Vec<(String, serde_json::Value)> = calls.iter().map(|(n, a)| (n.clone(), json!(a))).collect();
        prop_assert_eq!(names_and_arguments(&output), expected);
    }
}

//! `RewardTable`: one struct of settings per kind, read with its own keys only; what a table
//! gets wrong is refused by name when it is read, and a table written back reads the same.

use async_grpo_scoring::{RewardKind, RewardSource, RewardTable};
use serde_json::{Value, json};

fn read(table: Value) -> Result<RewardTable, String> {
    serde_json::from_value(table).map_err(|e| e.to_string())
}

#[track_caller]
fn refused(table: Value, expected: &str) {
    match read(table.clone()) {
        Err(error) => assert!(error.contains(expected), "{table}: {error}"),
        Ok(read) => panic!("{table} was read: {read:?}"),
    }
}

#[test]
fn each_kind_reads_its_own_settings_into_its_own_struct() {
    let table = read(json!({
        "kind": "judge", "url": "http://127.0.0.1:9/v1/chat/completions", "model": "m",
        "template": "Rate {completion}", "mode": "group", "concurrency": 2, "weight": 0.5,
    }))
    .expect("a judge table");
    let RewardSource::Kind(kind) = &table.source else {
        panic!("a kind: {table:?}");
    };
    let RewardKind::Judge(judge) = kind.as_ref() else {
        panic!("a judge: {kind:?}");
    };
    assert_eq!(judge.service.url, "http://127.0.0.1:9/v1/chat/completions");
    assert_eq!(judge.service.concurrency, Some(2));
    assert_eq!(judge.settings.model, "m");
    assert_eq!(judge.settings.mode.as_deref(), Some("group"));
    assert_eq!(table.weight, Some(0.5));
    assert_eq!(kind.name(), "judge");

    let spec = read(json!({"spec": "numeric:answer@2", "name": "n"})).expect("a spec");
    assert_eq!(spec.spec(), Some("numeric:answer@2"));
    assert_eq!(spec.name.as_deref(), Some("n"));
}

#[test]
fn a_key_of_another_kind_is_refused_with_the_keys_the_kind_takes() {
    refused(
        json!({"kind": "reward_model", "url": "http://x/classify", "model": "rm", "template": "t"}),
        "`template` is not a field of kind \"reward_model\" (it takes url, concurrency, \
         attempts, api_key_env, model, activation, class_index)",
    );
    refused(
        json!({"kind": "length", "max": 10, "column": "answer"}),
        "`column` is not a field of kind \"length\" (it takes max, buffer)",
    );
    // The sandbox keys are flattened into `command`'s settings, and listed with its own.
    refused(
        json!({"kind": "command", "program": ["./score.py"], "url": "http://x"}),
        "`url` is not a field of kind \"command\" (it takes program, sandbox, network, limits, home, read_only, \
         writable)",
    );
}

#[test]
fn a_key_of_no_kind_an_unknown_kind_and_a_missing_key_are_refused_by_name() {
    refused(
        json!({"kind": "http", "url": "http://x", "colour": "red"}),
        "unknown field `colour`",
    );
    refused(
        json!({"kind": "numerik", "column": "answer"}),
        "unknown kind 'numerik'; expected numeric, exact, regex, command, length, http, judge or \
         reward_model",
    );
    refused(
        json!({"kind": "judge", "url": "http://x", "model": "m"}),
        "kind \"judge\" needs `template`",
    );
    refused(json!({"kind": "http"}), "kind \"http\" needs `url`");
    refused(
        json!({"kind": "numeric"}),
        "kind \"numeric\" needs `column`",
    );
    refused(
        json!({"spec": "numeric:answer", "column": "answer"}),
        "`column` goes with `kind`, not with `spec`",
    );
    refused(
        json!({"spec": "numeric:answer", "kind": "numeric"}),
        "give `spec` or `kind`, not both",
    );
    refused(
        json!({"weight": 1.0}),
        "expected `spec = \"KIND:ARG\"` or `kind = \"...\"`",
    );
}

#[test]
fn a_value_of_the_wrong_type_names_its_key() {
    refused(
        json!({"kind": "http", "url": "http://x", "concurrency": "many"}),
        "concurrency: invalid type: string \"many\"",
    );
    refused(
        json!({"kind": "reward_model", "url": "http://x", "model": "rm", "class_index": -1}),
        "class_index: invalid value: integer `-1`, expected usize",
    );
    refused(
        json!({"spec": "numeric:answer", "weight": "heavy"}),
        "weight: invalid type",
    );
    // A sandbox key of a program's table names its key, though the keys are flattened.
    refused(
        json!({"kind": "command", "program": ["./score.py"], "limits": {"memory_mb": 1}}),
        "limits.memory_mb: unknown field `memory_mb`",
    );
}

#[test]
fn a_table_written_back_reads_the_same() {
    for table in [
        json!({"kind": "command", "program": ["./score.py", "--strict"], "sandbox": "bwrap", "network": false}),
        json!({"kind": "judge", "url": "http://x", "model": "m", "template": "{completion}", "labels": {"A": 1.0}, "score": "labels"}),
        json!({"kind": "exact", "column": "answer", "name": "e", "weight": 2.0}),
        json!({"spec": "length:100"}),
        json!({"kind": "http", "url": "http://x", "attempts": 5}),
    ] {
        let read_once = read(table.clone()).expect("the table reads");
        let written = serde_json::to_value(&read_once).expect("the table is written");
        assert_eq!(written, table, "written as given");
        assert_eq!(read(written).expect("it reads again"), read_once);
    }
}

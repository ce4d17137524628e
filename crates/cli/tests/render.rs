//! `async-grpo render`: a conversation through the real Qwen3 tokenizer, and bad inputs.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

use test_support::{ScratchDir, cache_dir};

fn qwen3() -> PathBuf {
    let dir = cache_dir().join("qwen3");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{} is missing: run `cargo xtask fixtures`",
        dir.display()
    );
    dir
}

fn workdir(name: &str) -> ScratchDir {
    ScratchDir::new(&format!("async-grpo-render-{name}"))
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path
}

/// Runs `async-grpo render ARGS`; returns success, stdout, stderr.
fn render(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .arg("render")
        .args(args)
        .output()
        .expect("the binary starts");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn render_prints_the_text_and_ids_transformers_gives() {
    let dir = workdir("ok");
    let messages = write(
        &dir,
        "messages.json",
        r#"[{"role": "user", "content": "hi"}]"#,
    );
    let tokenizer = qwen3();
    let (ok, stdout, stderr) = render(&[
        "--tokenizer",
        tokenizer.to_str().expect("utf-8 path"),
        "--messages",
        messages.to_str().expect("utf-8 path"),
    ]);
    assert!(ok, "{stderr}");
    let output: Value = serde_json::from_str(&stdout).expect("one JSON object");
    assert_eq!(
        output["text"],
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        output["ids"],
        serde_json::json!([151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198])
    );
    assert_eq!(stdout.lines().count(), 1);
}

#[test]
fn render_takes_tools_kwargs_a_template_and_no_generation_prompt() {
    let dir = workdir("options");
    let messages = write(
        &dir,
        "messages.json",
        r#"[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}]"#,
    );
    let tools = write(
        &dir,
        "tools.json",
        r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]"#,
    );
    let template = write(
        &dir,
        "t.jinja",
        "{% for m in messages %}[{{ m.role }}|{{ flavour }}|{{ tools | length }}]{% endfor %}{% if add_generation_prompt %}GO{% endif %}",
    );
    let tokenizer = qwen3();
    let (ok, stdout, stderr) = render(&[
        "--tokenizer",
        tokenizer.to_str().expect("utf-8 path"),
        "--messages",
        messages.to_str().expect("utf-8 path"),
        "--tools",
        tools.to_str().expect("utf-8 path"),
        "--template",
        template.to_str().expect("utf-8 path"),
        "--kwargs",
        r#"{"flavour": "x"}"#,
        "--no-generation-prompt",
    ]);
    assert!(ok, "{stderr}");
    let output: Value = serde_json::from_str(&stdout).expect("one JSON object");
    assert_eq!(output["text"], "[user|x|1][assistant|x|1]");
}

#[test]
fn bad_inputs_are_errors_that_name_the_file_and_what_was_expected() {
    let dir = workdir("bad");
    let tokenizer = qwen3();
    let tokenizer = tokenizer.to_str().expect("utf-8 path");
    let not_a_list = write(&dir, "object.json", r#"{"role": "user"}"#);
    let (ok, _, stderr) = render(&[
        "--tokenizer",
        tokenizer,
        "--messages",
        not_a_list.to_str().expect("utf-8"),
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("object.json: expected a JSON array of messages"),
        "{stderr}"
    );

    let no_role = write(&dir, "norole.json", r#"[{"content": "hi"}]"#);
    let (ok, _, stderr) = render(&[
        "--tokenizer",
        tokenizer,
        "--messages",
        no_role.to_str().expect("utf-8"),
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("norole.json: expected a JSON array of messages"),
        "{stderr}"
    );
    assert!(stderr.contains("a message needs a \"role\""), "{stderr}");

    let broken = write(&dir, "broken.json", "[{");
    let (ok, _, stderr) = render(&[
        "--tokenizer",
        tokenizer,
        "--messages",
        broken.to_str().expect("utf-8"),
    ]);
    assert!(!ok);
    assert!(stderr.contains("broken.json: not valid JSON"), "{stderr}");

    let messages = write(
        &dir,
        "messages.json",
        r#"[{"role": "user", "content": "hi"}]"#,
    );
    let messages = messages.to_str().expect("utf-8");
    let (ok, _, stderr) = render(&[
        "--tokenizer",
        tokenizer,
        "--messages",
        messages,
        "--kwargs",
        "[1]",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--kwargs: expected a JSON object, got an array"),
        "{stderr}"
    );

    let (ok, _, stderr) = render(&["--tokenizer", "/nonexistent", "--messages", messages]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "/nonexistent: expected a Hugging Face tokenizer folder holding tokenizer.json"
        ),
        "{stderr}"
    );

    let raising = write(
        &dir,
        "raise.jinja",
        "line one\n{{ raise_exception('only user messages') }}",
    );
    let (ok, _, stderr) = render(&[
        "--tokenizer",
        tokenizer,
        "--messages",
        messages,
        "--template",
        raising.to_str().expect("utf-8"),
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("raise.jinja, line 2: only user messages"),
        "{stderr}"
    );
}

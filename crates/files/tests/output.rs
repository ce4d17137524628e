//! What `async_grpo_files::output` says of an output it cannot continue: the file and the
//! line, in the words of its own inputs (no program's flag).

use async_grpo_files::output;

#[test]
fn resuming_a_file_the_engine_did_not_write_names_its_path_and_line_and_no_flag() {
    let path = std::env::temp_dir().join(format!("rollout-output-{}.jsonl", std::process::id()));
    std::fs::write(&path, "not a row\nnor this\n").expect("write the file");
    let error = output::resume(&path)
        .expect_err("a file of no training rows cannot be resumed")
        .to_string();
    let _ = std::fs::remove_file(&path);
    assert!(
        error.starts_with(&format!("{}:1: not a training row", path.display())),
        "{error}"
    );
    assert!(
        !error.contains("--"),
        "a library error names no flag: {error}"
    );
}

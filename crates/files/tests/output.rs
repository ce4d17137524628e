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

/// The row stream's acknowledgement record across a kill: a torn last line is no
/// acknowledgement, and is cut before the next run appends (else `1` and `3` would read `13`).
#[test]
fn a_torn_acknowledgement_is_dropped_and_cut_before_appending() {
    use std::io::Write as _;

    let dir = std::env::temp_dir().join(format!("rollout-acks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let out = dir.join("rows.jsonl");
    assert_eq!(
        output::acknowledged(&out),
        Ok(None),
        "no record: no earlier stream"
    );
    std::fs::write(output::acks_path(&out), "0\n2\n1").expect("a record");
    let acknowledged = output::acknowledged(&out).expect("read").expect("a record");
    assert_eq!(acknowledged, [0, 2].into_iter().collect());
    let mut file = output::open_acks(&out).expect("opened");
    file.write_all(b"3\n").expect("appended");
    drop(file);
    let acknowledged = output::acknowledged(&out).expect("read").expect("a record");
    assert_eq!(acknowledged, [0, 2, 3].into_iter().collect());
    std::fs::write(output::acks_path(&out), "0\nzero\n1\n").expect("a record");
    let error = output::acknowledged(&out)
        .expect_err("not a position")
        .to_string();
    assert!(error.contains("rows.jsonl.acks:2"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run that starts an output afresh drops the acknowledgements of the rows it replaces
/// (its positions are its own); one that resumes keeps them.
#[test]
fn a_fresh_output_drops_the_acknowledgements_of_the_rows_it_replaces() {
    let dir = std::env::temp_dir().join(format!("rollout-acks-fresh-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let out = dir.join("rows.jsonl");
    std::fs::write(&out, "").expect("an output");
    std::fs::write(output::acks_path(&out), "0\n1\n").expect("a record");
    let resumed = output::resume(&out).expect("resumable");
    drop(output::Output::open(&out, true, &resumed).expect("continued"));
    assert!(output::acks_path(&out).exists(), "a resume keeps them");
    drop(output::Output::open(&out, false, &output::Resumed::default()).expect("created"));
    assert_eq!(
        output::acknowledged(&out),
        Ok(None),
        "a fresh run drops them"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

//! Python sessions: one interpreter that keeps its state from cell to cell, in the real
//! sandbox, and the warm pool that starts them ahead of need.

use std::time::Duration;

use async_grpo_process::{Interpreter, InterpreterPool, InterpreterSpec, Limits};

use super::{left_with, sandbox};

fn spec() -> InterpreterSpec {
    InterpreterSpec::new("python3", sandbox())
}

async fn start() -> Interpreter {
    spec().start().await.expect("an interpreter starts")
}

/// The output of a cell that must not raise.
async fn cell(interpreter: &mut Interpreter, code: &str) -> String {
    let cell = interpreter
        .run(code, 64 * 1024)
        .await
        .unwrap_or_else(|lost| panic!("{code}: {lost}"));
    assert!(!cell.raised, "{code}: {}", cell.output);
    cell.output.trim_end_matches('\n').to_owned()
}

#[tokio::test]
async fn a_cell_sees_what_the_cells_before_it_defined_imported_and_wrote() {
    let mut python = start().await;
    assert_eq!(
        cell(
            &mut python,
            "import math\ndef area(r):\n    return math.pi * r * r\nopen('notes.txt', 'w').write('kept')"
        )
        .await,
        "4",
        "the last expression's value is shown, as a notebook shows it"
    );
    assert_eq!(
        cell(
            &mut python,
            "print(round(area(2), 3)); open('notes.txt').read()"
        )
        .await,
        "12.566\n'kept'"
    );
    assert_eq!(
        cell(&mut python, "import os; os.getcwd()").await,
        "'/tmp'",
        "its folder is its private /tmp"
    );
}

#[tokio::test]
async fn output_is_interleaved_as_written_capped_and_a_traceback_shows_the_cells_frames_only() {
    let mut python = start().await;
    let raised = python
        .run(
            "import sys, os\nprint('out')\nprint('err', file=sys.stderr)\nos.system('echo child')\ndef f():\n    return 1 / 0\nf()",
            64 * 1024,
        )
        .await
        .expect("the interpreter answers");
    assert!(raised.raised);
    assert!(
        raised.output.starts_with("out\nerr\nchild\nTraceback"),
        "{}",
        raised.output
    );
    assert!(
        raised.output.contains("File \"<cell>\", line 7")
            && raised
                .output
                .ends_with("ZeroDivisionError: division by zero\n"),
        "{}",
        raised.output
    );
    assert!(!raised.output.contains("driver"), "{}", raised.output);
    let capped = python
        .run("print('y' * 5000)", 10)
        .await
        .expect("the interpreter answers");
    assert_eq!(
        capped.output,
        "yyyyyyyyyy\n[output truncated: 4991 more bytes]"
    );
    assert_eq!(cell(&mut python, "'still here'").await, "'still here'");
}

#[tokio::test]
async fn two_sessions_share_no_variable_file_or_user() {
    let (mut one, mut two) = (start().await, start().await);
    cell(&mut one, "secret = 42\nopen('/tmp/mine', 'w').write('one')").await;
    let seen = cell(
        &mut two,
        "import os\n('secret' in globals(), os.path.exists('/tmp/mine'))",
    )
    .await;
    assert_eq!(seen, "(False, False)");
    if test_support::is_root() {
        let uid = "import os; os.getuid()";
        assert_ne!(cell(&mut one, uid).await, cell(&mut two, uid).await);
    }
}

#[tokio::test]
async fn an_interpreter_that_dies_or_breaks_its_protocol_is_lost_with_the_reason() {
    let mut python = start().await;
    let lost = python.run("import os; os._exit(3)", 1024).await.err();
    assert_eq!(
        lost.map(|lost| lost.0),
        Some("the interpreter exited with code 3".to_owned())
    );
    let mut forger = start().await;
    // A cell that writes on the driver's reply pipe: the engine reads a header it refuses.
    let lost = forger
        .run(
            "import os\nfor fd in range(3, 10):\n    try:\n        os.write(fd, b'ok 99999999 1\\n')\n    except OSError:\n        pass",
            1024,
        )
        .await
        .err();
    assert!(
        lost.as_ref()
            .is_some_and(|lost| lost.0.contains("protocol")),
        "{lost:?}"
    );
}

#[tokio::test]
async fn a_dropped_interpreter_leaves_nothing_running() {
    let marker = format!("4{}.5", std::process::id());
    let mut python = start().await;
    cell(
        &mut python,
        &format!("import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\nNone"),
    )
    .await;
    until_running(&marker).await;
    if !matches!(
        async_grpo_process::cgroup_support(),
        async_grpo_process::CgroupSupport::Unavailable(_)
    ) {
        assert!(!our_cgroups().is_empty(), "the session has a cgroup");
    }
    drop(python);
    let left = left_with(&marker).await;
    assert!(left.is_empty(), "outlived its session: {left:?}");
    for _ in 0..100 {
        if our_cgroups().is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("cgroups outlived their session: {:?}", our_cgroups());
}

/// The cgroups this test's process made (`async-grpo-<pid>-<n>`), anywhere under
/// `/sys/fs/cgroup`.
fn our_cgroups() -> Vec<std::path::PathBuf> {
    let prefix = format!("async-grpo-{}-", std::process::id());
    let mut found = Vec::new();
    let mut pending = vec![(std::path::PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                found.push(entry.path());
            } else if depth < 4 {
                pending.push((entry.path(), depth + 1));
            }
        }
    }
    found
}

#[tokio::test]
async fn a_memory_balloon_and_a_fork_bomb_are_bounded_and_the_session_goes_on() {
    let limits = Limits {
        memory_mib: 512,
        processes: 16,
        ..Limits::default()
    };
    let mut python = InterpreterSpec::new("python3", sandbox().limits(limits))
        .start()
        .await
        .expect("an interpreter starts");
    cell(&mut python, "kept = 'state'").await;
    let balloon = python
        .run("hog = bytearray(2 * 1024 ** 3)", 4096)
        .await
        .expect("the interpreter answers");
    assert!(
        balloon.raised && balloon.output.contains("MemoryError"),
        "{balloon:?}"
    );
    let marker = format!("5{}.5", std::process::id());
    let bomb = python
        .run(
            &format!("import os\nn = 0\nwhile n < 100:\n    try:\n        pid = os.fork()\n    except OSError as e:\n        print(n, e.errno)\n        break\n    if pid == 0:\n        os.execvp('sleep', ['sleep', '{marker}'])\n    n += 1"),
            4096,
        )
        .await
        .expect("the interpreter answers");
    let mut words = bomb.output.split_whitespace();
    let forked: usize = words.next().and_then(|n| n.parse().ok()).expect("a count");
    assert!(forked < 16, "{forked} processes past a limit of 16");
    assert_eq!(words.next(), Some("11"), "EAGAIN: {bomb:?}");
    assert_eq!(cell(&mut python, "kept").await, "'state'");
    drop(python);
    assert!(
        left_with(&marker).await.is_empty(),
        "the bomb outlived its session"
    );
}

/// Waits (bounded) until a process holds `marker`.
async fn until_running(marker: &str) {
    for _ in 0..200 {
        if !super::processes_with(marker).is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no process holds {marker}");
}

/// Interpreters the pool holds: lent out and waiting, as its stats count them.
fn held(pool: &InterpreterPool) -> usize {
    let stats = pool.stats();
    stats.warm + stats.lent
}

/// Waits (bounded) until the pool has `warm` interpreters waiting.
async fn until_warm(pool: &InterpreterPool, warm: usize) {
    for _ in 0..600 {
        if pool.stats().warm == warm {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the pool did not reach {warm} warm: {:?}", pool.stats());
}

#[tokio::test]
async fn the_pool_keeps_interpreters_warm_within_its_bound_and_kills_them_when_dropped() {
    let marker = format!("6{}.5", std::process::id());
    let pool = InterpreterPool::new(spec().arg(&marker), 2, 3);
    until_warm(&pool, 2).await;
    let mut first = pool.acquire().await.expect("a warm interpreter");
    assert_eq!(pool.stats().warm_hits, 1);
    assert_eq!(cell(&mut first, "1 + 1").await, "2");
    let second = pool.acquire().await.expect("a warm interpreter");
    // Two lent out, one more may wait: the bound is three in all.
    until_warm(&pool, 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(pool.stats().warm, 1, "{:?}", pool.stats());
    assert!(held(&pool) <= 3);
    let third = pool.acquire().await.expect("a warm interpreter");
    let fourth = pool.acquire().await.expect("one started on demand");
    assert_eq!(pool.stats().cold_starts, 1, "{:?}", pool.stats());
    drop((second, third, fourth));
    until_warm(&pool, 2).await;
    assert_eq!(pool.stats().lent, 1);
    // The marker is on every interpreter's command line: three now, one lent and two warm.
    assert_eq!(
        super::processes_with(&marker)
            .iter()
            .filter(|line| !line.starts_with("bwrap") && line.contains(" -I -u -c "))
            .count(),
        3
    );
    drop(first);
    drop(pool);
    let left = left_with(&marker).await;
    assert!(left.is_empty(), "outlived their pool: {left:?}");
}

#[tokio::test]
async fn a_balloon_spread_over_processes_is_bounded_by_the_session_s_cgroup_where_there_is_one() {
    // Each process may have 300 MiB; four children of 150 MiB each hold 600 MiB together.
    let limits = Limits {
        memory_mib: 300,
        processes: 16,
        ..Limits::default()
    };
    let mut python = InterpreterSpec::new("python3", sandbox().limits(limits))
        .start()
        .await
        .expect("an interpreter starts");
    let code = "import os, time, signal\n\
                children = []\n\
                for _ in range(4):\n\
                \x20   pid = os.fork()\n\
                \x20   if pid == 0:\n\
                \x20       hog = b'x' * (150 * 1024 * 1024)\n\
                \x20       time.sleep(2)\n\
                \x20       os._exit(0)\n\
                \x20   children.append(pid)\n\
                killed = 0\n\
                for pid in children:\n\
                \x20   _, status = os.waitpid(pid, 0)\n\
                \x20   killed += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL\n\
                print(4 - killed, killed)";
    let output = cell(&mut python, code).await;
    let counts: Vec<u32> = output
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    let &[survived, killed] = &counts[..] else {
        panic!("two counts: {output}");
    };
    match async_grpo_process::cgroup_support() {
        async_grpo_process::CgroupSupport::Unavailable(why) => {
            // The documented fallback: per-process limits, which this balloon stays within.
            eprintln!("no cgroup here ({why}): limits stay per process");
            assert_eq!((survived, killed), (4, 0), "{output}");
        }
        support => assert!(
            killed >= 2,
            "{support:?}: the session held {survived} x 150 MiB past its 300 MiB"
        ),
    }
    assert_eq!(cell(&mut python, "'alive'").await, "'alive'");
}

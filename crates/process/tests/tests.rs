//! The sandbox as a policy would attack it: each test runs a real program in a real
//! bubblewrap sandbox and checks that the attack's effect is absent. They need `bwrap` (`cargo
//! xtask ci` installs bubblewrap) and, unless they run as root, user namespaces; as root each
//! program runs as a uid of its own instead, and `cargo xtask sandbox-as-user` runs them again
//! as the unprivileged user `nobody`, the user-namespace path. Where the sandbox cannot be
//! had, the first test fails with [`Sandbox::check`]'s message, which says what is missing.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use async_grpo_process::{Finished, Limits, Program, SANDBOX_UIDS, Sandbox, tail};
use test_support::{PlantedInHome, is_root};

const TIMEOUT: Duration = Duration::from_secs(30);

fn sandbox() -> Sandbox {
    let sandbox = Sandbox::default();
    if let Err(error) = sandbox.check() {
        panic!("the sandbox cannot be had here: {error}");
    }
    sandbox
}

async fn sh(script: &str, sandbox: Sandbox) -> Finished {
    Program::new(["sh", "-c", script])
        .sandbox(sandbox)
        .run(Vec::new(), TIMEOUT, 64 * 1024)
        .await
        .unwrap_or_else(|e| panic!("{script}: {e}"))
}

async fn python(code: &str, sandbox: Sandbox) -> Finished {
    Program::new(["python3", "-I", "-"])
        .sandbox(sandbox)
        .run(code.as_bytes().to_vec(), TIMEOUT, 64 * 1024)
        .await
        .unwrap_or_else(|e| panic!("{code}: {e}"))
}

/// A fresh directory of this test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        // Not under /tmp, which is private in the sandbox anyway: what the sandbox hides
        // must be hidden by it. `ASYNC_GRPO_TEST_SCRATCH` for a user who cannot write the
        // target directory (`cargo xtask sandbox-as-user`).
        let parent = std::env::var_os("ASYNC_GRPO_TEST_SCRATCH")
            .map_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")), PathBuf::from);
        let dir = parent.join(format!("process-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Processes of this machine whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| std::fs::read(entry.path().join("cmdline")).ok())
        .map(|line| String::from_utf8_lossy(&line).replace('\0', " "))
        .filter(|line| line.contains(marker))
        .collect()
}

/// Waits (bounded) until no process holds `marker`; the processes left when it gives up.
async fn left_with(marker: &str) -> Vec<String> {
    for _ in 0..100 {
        let left = processes_with(marker);
        if left.is_empty() {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    processes_with(marker)
}

#[tokio::test]
async fn a_process_that_leaves_its_session_dies_with_the_sandbox() {
    let marker = format!("1{}.5", std::process::id());
    let finished = python(
        &format!(
            "import subprocess\n\
             subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n\
             subprocess.Popen(['setsid', '-f', 'sleep', '{marker}'])\n\
             print('left behind')"
        ),
        sandbox(),
    )
    .await;
    assert_eq!(finished.stdout.trim(), "left behind", "{finished:?}");
    let left = left_with(&marker).await;
    assert!(left.is_empty(), "outlived the sandbox: {left:?}");
}

#[tokio::test]
async fn the_engines_environment_is_not_inherited() {
    // The test runner's own variables stand for the engine's secrets.
    assert!(std::env::vars().any(|(k, _)| k.starts_with("CARGO")));
    let finished = sh("env", sandbox().network(false)).await;
    let names: Vec<&str> = finished
        .stdout
        .lines()
        .filter_map(|line| line.split('=').next())
        .collect();
    assert!(
        names.iter().all(|name| [
            "PATH", "HOME", "TMPDIR", "LANG", "LANGUAGE", "TZ", "TERM", "PWD", "SHLVL", "_"
        ]
        .contains(name)
            || name.starts_with("LC_")),
        "{names:?}"
    );
    let given = Program::new(["sh", "-c", "echo $OPENAI_API_KEY"])
        .env("OPENAI_API_KEY", "k-1")
        .sandbox(sandbox())
        .run(Vec::new(), TIMEOUT, 1024)
        .await
        .map(|f| f.stdout);
    assert_eq!(given.ok().as_deref(), Some("k-1\n"));
}

#[tokio::test]
async fn the_file_system_is_read_only_but_for_the_programs_own_directory() {
    let host = Scratch::new("host");
    let own = Scratch::new("own");
    let outside = host.0.join("written");
    let script = format!(
        "echo x > {outside}; echo x > /usr/written-{pid}; echo x > /tmp/private-{pid}; \
         echo ok > {own}/mine; pwd",
        outside = outside.display(),
        pid = std::process::id(),
        own = own.0.display()
    );
    let finished = Program::new(["sh", "-c", &script])
        .dir(&own.0)
        .sandbox(sandbox())
        .run(Vec::new(), TIMEOUT, 4096)
        .await
        .expect("runs");
    assert!(!outside.exists(), "wrote outside its directory");
    assert!(
        !Path::new(&format!("/tmp/private-{}", std::process::id())).exists(),
        "its /tmp is the host's"
    );
    assert_eq!(
        std::fs::read_to_string(own.0.join("mine")).ok().as_deref(),
        Some("ok\n")
    );
    assert_eq!(finished.stdout.trim(), own.0.display().to_string());
    assert!(
        !Path::new(&format!("/usr/written-{}", std::process::id())).exists(),
        "wrote into the system"
    );
    assert!(
        finished.stderr.contains("Read-only file system")
            && finished.stderr.contains("Directory nonexistent"),
        "the system is read-only, the rest of the host absent: {finished:?}"
    );
}

/// What `find` lists at depth `depth` under `root` in the default sandbox, run in `own`.
async fn listed(root: &str, depth: usize, own: &Path) -> Vec<String> {
    let script = format!("find {root} -mindepth 1 -maxdepth {depth} 2>/dev/null | sort");
    let finished = Program::new(["sh", "-c", &script])
        .dir(own)
        .sandbox(sandbox())
        .run(Vec::new(), TIMEOUT, 1 << 20)
        .await
        .expect("runs");
    finished.stdout.lines().map(str::to_owned).collect()
}

#[tokio::test]
async fn a_sandboxed_program_sees_the_system_s_runtime_its_own_directory_and_nothing_else() {
    let own = Scratch::new("sees");
    let top: Vec<String> = listed("/", 1, &own.0).await;
    // The checkout, the other top folders of the host (/work, /opt, /srv, /mnt, /home...)
    // are not there: only the runtime, the private folders and the ways to the own
    // directory and $HOME.
    let home = std::env::var("HOME").unwrap_or_default();
    let on_the_way = |path: &str| {
        own.0.starts_with(path) || (!home.is_empty() && Path::new(&home).starts_with(path))
    };
    let expected = [
        "/bin", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
        "/tmp", "/usr", "/var",
    ];
    for path in &top {
        assert!(
            expected.contains(&path.as_str()) || on_the_way(path),
            "{path} is visible: {top:?}"
        );
    }
    let etc: Vec<String> = listed("/etc", 1, &own.0).await;
    for secret in [
        "/etc/shadow",
        "/etc/pip.conf",
        "/etc/npmrc",
        "/etc/gitconfig",
        "/etc/ssh",
    ] {
        assert!(
            !etc.iter().any(|path| path == secret),
            "{secret} in {etc:?}"
        );
    }
    assert!(etc.iter().any(|path| path == "/etc/passwd"), "{etc:?}");
    // The checkout this test runs from: its manifest is not there.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let cat = sh(&format!("cat {}", manifest.display()), sandbox()).await;
    assert!(!cat.status.success() && cat.stdout.is_empty(), "{cat:?}");
    // What a setting names is seen, read-only or writable.
    let data = Scratch::new("data");
    std::fs::write(data.0.join("corpus.txt"), "shared").expect("written");
    let scratch = Scratch::new("writable");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&scratch.0, std::fs::Permissions::from_mode(0o777))
            .expect("chmod");
    }
    let script = format!(
        "cat {data}/corpus.txt; echo x > {data}/new; echo kept > {scratch}/out",
        data = data.0.display(),
        scratch = scratch.0.display()
    );
    let named = sh(&script, sandbox().see(&data.0).write(&scratch.0)).await;
    assert_eq!(named.stdout, "shared", "{named:?}");
    assert!(named.stderr.contains("Read-only file system"), "{named:?}");
    assert_eq!(
        std::fs::read_to_string(scratch.0.join("out"))
            .ok()
            .as_deref(),
        Some("kept\n")
    );
}

#[tokio::test]
async fn hidden_paths_and_other_directories_are_not_visible() {
    let secret_dir = Scratch::new("secret-dir");
    let secret_file = secret_dir.0.join("rows.jsonl");
    std::fs::write(&secret_file, "the engine's output").expect("written");
    let elsewhere = Scratch::new("elsewhere");
    let sibling = elsewhere.0.join("r2");
    std::fs::create_dir(&sibling).expect("made");
    std::fs::write(sibling.join("key"), "another rollout's").expect("written");
    let own = elsewhere.0.join("r1");
    std::fs::create_dir(&own).expect("made");
    let script = format!(
        "cat {file}; ls {sibling}; ls {parent}",
        file = secret_file.display(),
        sibling = sibling.display(),
        parent = elsewhere.0.display()
    );
    let finished = Program::new(["sh", "-c", &script])
        .dir(&own)
        .sandbox(sandbox().hide(&secret_file).hide(&elsewhere.0))
        .run(Vec::new(), TIMEOUT, 4096)
        .await
        .expect("runs");
    assert!(
        !finished.stdout.contains("the engine's output"),
        "{finished:?}"
    );
    assert!(!finished.stdout.contains("key"), "{finished:?}");
    assert_eq!(
        finished.stdout.trim(),
        "r1",
        "only its own directory: {finished:?}"
    );
}

#[tokio::test]
async fn there_is_no_network_unless_asked() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
    listener.set_nonblocking(true).expect("non-blocking");
    let port = listener.local_addr().expect("bound").port();
    let code = format!(
        "import socket\n\
         try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n    print('connected')\n\
         except OSError as e:\n    print('refused', e)"
    );
    let closed = python(&code, sandbox()).await;
    assert!(closed.stdout.starts_with("refused"), "{closed:?}");
    // The attempt is over once the program exited: a connection would be queued by now.
    assert!(listener.accept().is_err(), "a connection reached the host");

    let open = python(&code, sandbox().network(true)).await;
    assert!(open.stdout.starts_with("connected"), "{open:?}");
    assert!(listener.accept().is_ok());
}

#[tokio::test]
async fn other_processes_are_not_visible() {
    let finished = sh("ls /proc | grep -c '^[0-9]'", sandbox()).await;
    let count: usize = finished.stdout.trim().parse().unwrap_or(usize::MAX);
    // bwrap's init, sh, ls and grep at most.
    assert!(count <= 5, "{count} processes visible: {finished:?}");
}

#[tokio::test]
async fn limits_hold_and_are_settable() {
    let small = Limits {
        memory_mib: 64,
        ..Limits::default()
    };
    let finished = python(
        "try:\n    b = bytearray(256 * 1024 * 1024)\n    print('allocated')\nexcept MemoryError:\n    print('refused')",
        sandbox().limits(small),
    )
    .await;
    assert_eq!(finished.stdout.trim(), "refused", "{finished:?}");
    let files = sh(
        "ulimit -n; ulimit -f",
        sandbox().limits(Limits {
            open_files: 77,
            file_size_mib: 1,
            ..Limits::default()
        }),
    )
    .await;
    assert_eq!(
        files.stdout, "77\n2048\n",
        "ulimit -f counts 512-byte blocks"
    );
}

#[tokio::test]
async fn a_program_past_its_timeout_is_killed_with_its_descendants() {
    let marker = format!("2{}.5", std::process::id());
    let error = Program::new(["sh", "-c", &format!("sleep {marker} & sleep {marker}")])
        .sandbox(sandbox())
        .run(Vec::new(), Duration::from_millis(300), 1024)
        .await
        .err();
    assert!(
        error
            .as_ref()
            .is_some_and(async_grpo_process::Error::is_timeout),
        "{error:?}"
    );
    let left = left_with(&marker).await;
    assert!(left.is_empty(), "outlived the timeout: {left:?}");
}

#[tokio::test]
async fn output_is_capped_and_says_how_much_was_cut() {
    let finished = sh("yes | head -c 5000", sandbox()).await;
    assert_eq!(finished.stdout.len(), 5000);
    let capped = Program::new(["sh", "-c", "yes | head -c 5000"])
        .sandbox(sandbox())
        .run(Vec::new(), TIMEOUT, 10)
        .await
        .map(|f| f.stdout);
    assert_eq!(
        capped.ok().as_deref(),
        Some("y\ny\ny\ny\ny\n\n[output truncated: 4990 more bytes]")
    );
}

#[tokio::test]
async fn a_script_named_in_a_private_directory_is_seen_with_its_neighbours_but_not_what_is_hidden()
{
    let top = std::env::temp_dir().join(format!("process-test-named-{}", std::process::id()));
    let _scratch = Scratch(top.clone());
    // Two levels down: the folder between is made in the sandbox, readable by its user.
    let dir = top.join("inner");
    std::fs::create_dir_all(&dir).expect("made");
    let script = dir.join("script.sh");
    std::fs::write(
        &script,
        "cat \"$(dirname \"$0\")/beside\"; cat \"$(dirname \"$0\")/rows.jsonl\"",
    )
    .expect("written");
    std::fs::write(dir.join("beside"), "found beside\n").expect("written");
    std::fs::write(dir.join("rows.jsonl"), "the dataset\n").expect("written");
    let finished = Program::new(["sh".to_owned(), script.display().to_string()])
        .sandbox(sandbox().hide(dir.join("rows.jsonl")))
        .run(Vec::new(), TIMEOUT, 4096)
        .await
        .expect("runs");
    assert_eq!(finished.stdout, "found beside\n", "{finished:?}");
}

#[tokio::test]
async fn a_program_runs_as_a_user_of_its_own_and_root_only_files_stay_closed() {
    // Not shown by default: shown on purpose, its owner bits still keep it closed.
    let finished = sh(
        "id -u; id -g; id -G; cat /etc/shadow",
        sandbox().see("/etc/shadow"),
    )
    .await;
    let mut ids = finished.stdout.lines();
    let (uid, gid, groups) = (ids.next(), ids.next(), ids.next());
    assert!(!finished.stdout.contains("root:"), "{finished:?}");
    assert!(
        finished.stderr.contains("Permission denied"),
        "{finished:?}"
    );
    if is_root() {
        let uid: u32 = uid.and_then(|u| u.parse().ok()).expect("a uid");
        assert!(SANDBOX_UIDS.contains(&uid), "{finished:?}");
        assert_eq!(gid, Some(uid.to_string().as_str()), "{finished:?}");
        assert_eq!(
            groups,
            Some(uid.to_string().as_str()),
            "no other group: {finished:?}"
        );
        // Two programs never share a user: each one's process limit is its own.
        let other = sh("id -u", sandbox()).await;
        assert_ne!(other.stdout.trim(), uid.to_string());
    } else {
        // Not root: in a user namespace, as the engine's own user.
        eprintln!("the engine is not root: programs run as its user, in a user namespace");
    }
}

#[tokio::test]
async fn no_process_in_the_sandbox_holds_a_capability_it_could_use() {
    // Every process there: bubblewrap's init (pid 1, which runs no code of the program's)
    // holds at most what changes the user (CAP_SETGID, CAP_SETUID, CAP_SETPCAP: bits 6 to 8)
    // when the engine is root, none otherwise; the program holds none, in any set, nor can it
    // gain one (its bounding set is empty too).
    let finished = sh(
        "for s in /proc/[0-9]*/status; do grep -E '^(Name|CapEff|CapPrm|CapBnd|CapAmb|CapInh)' \
         \"$s\"; done",
        sandbox(),
    )
    .await;
    let allowed_to_init: u64 = if is_root() { 0x1c0 } else { 0 };
    let mut name = "";
    for line in finished.stdout.lines() {
        let (key, value) = line.split_once(':').expect("a status line");
        let value = value.trim();
        if key == "Name" {
            name = value;
            continue;
        }
        let caps = u64::from_str_radix(value, 16).expect("a capability mask");
        let allowed = match (name, key) {
            ("bwrap", "CapBnd") => continue,
            ("bwrap", _) => allowed_to_init,
            _ => 0,
        };
        assert_eq!(
            caps & !allowed,
            0,
            "{name} holds {key} {value}: {finished:?}"
        );
    }
    assert!(finished.stdout.contains("Name:\tsh"), "{finished:?}");
}

#[tokio::test]
async fn a_program_has_a_session_of_its_own_and_no_terminal_of_the_engine() {
    // Its session's leader is inside its PID namespace (outside, getsid would say 0): it
    // cannot reach the engine's terminal to push input into it (TIOCSTI).
    let finished = python(
        "import os\nprint(os.getsid(0))\ntry:\n    open('/dev/tty')\n    print('tty')\nexcept OSError:\n    print('no tty')",
        sandbox(),
    )
    .await;
    let mut lines = finished.stdout.lines();
    let sid: i64 = lines
        .next()
        .and_then(|s| s.parse().ok())
        .expect("a session id");
    assert_ne!(sid, 0, "its session is the engine's: {finished:?}");
    assert_eq!(lines.next(), Some("no tty"), "{finished:?}");
}

#[tokio::test]
async fn the_hosts_tmp_is_not_seen_and_the_private_one_is_bounded_in_total() {
    let host = std::env::temp_dir().join(format!("process-test-host-tmp-{}", std::process::id()));
    std::fs::write(&host, "the host's /tmp").expect("written");
    let _scratch = Scratch(host.clone());
    let seen = sh(&format!("cat {}", host.display()), sandbox()).await;
    assert!(!seen.stdout.contains("the host's"), "{seen:?}");
    // Three files of 1 MiB in a /tmp of 2 MiB: the third does not fit, though each is far
    // below the per-file limit; /dev/shm has 2 MiB of its own.
    let small = Limits {
        tmp_mib: 2,
        ..Limits::default()
    };
    let filled = sh(
        "for i in 1 2 3; do head -c 1048576 /dev/zero > /tmp/f$i && echo wrote $i; done; \
         head -c 1048576 /dev/zero > /dev/shm/g && echo wrote shm",
        sandbox().limits(small),
    )
    .await;
    assert_eq!(filled.stdout, "wrote 1\nwrote 2\nwrote shm\n", "{filled:?}");
    assert!(filled.stderr.contains("No space left"), "{filled:?}");
}

#[tokio::test]
async fn a_fork_bomb_stops_at_the_process_limit_and_is_gone_after() {
    let marker = format!("3{}.5", std::process::id());
    // Bounded in any case: at most 200 forks, each child sleeping on the marker.
    let code = format!(
        "import os\nn = 0\nerror = None\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError as e:\n        error = e.errno\n        break\n    if pid == 0:\n        os.execvp('sleep', ['sleep', '{marker}'])\n    n += 1\nprint(n, error)"
    );
    let limits = Limits {
        processes: 20,
        ..Limits::default()
    };
    let finished = python(&code, sandbox().limits(limits)).await;
    let mut words = finished.stdout.split_whitespace();
    let forked: usize = words.next().and_then(|n| n.parse().ok()).expect("a count");
    assert!(
        forked < 20,
        "{forked} processes past a limit of 20: {finished:?}"
    );
    assert_eq!(words.next(), Some("11"), "EAGAIN: {finished:?}");
    let left = left_with(&marker).await;
    assert!(left.is_empty(), "outlived the sandbox: {} left", left.len());
}

#[tokio::test]
async fn home_shows_only_what_path_and_the_settings_allow_and_never_credentials() {
    let planted = PlantedInHome::new("process-home", "token", "hf_secret");
    let name = planted.name().to_owned();
    let read = format!("cat \"$HOME/{name}/token\"; ls -A \"$HOME\"");
    let hidden = sh(&read, sandbox()).await;
    assert!(!hidden.stdout.contains("hf_secret"), "{hidden:?}");
    // What PATH needs under $HOME is there (the toolchain running this test is on it).
    let home = PathBuf::from(std::env::var_os("HOME").expect("HOME"));
    let on_path: Vec<String> = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .filter_map(|p| {
            p.strip_prefix(&home)
                .ok()?
                .components()
                .next()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
        })
        .collect();
    let listed: Vec<&str> = hidden.stdout.lines().collect();
    for top in &on_path {
        assert!(listed.contains(&top.as_str()), "{top} missing: {hidden:?}");
    }
    assert!(!listed.contains(&name.as_str()), "{hidden:?}");
    // Named by the settings, it is seen, read-only.
    let shown = sh(
        &format!("cat \"$HOME/{name}/token\"; echo x > \"$HOME/{name}/w\""),
        sandbox().see_in_home(&name),
    )
    .await;
    assert_eq!(shown.stdout, "hf_secret", "{shown:?}");
    assert!(!planted.file().with_file_name("w").exists());
    // Named deeper down, the folders above it are made for it, readable by its user.
    let deep = planted.file().with_file_name("deep");
    std::fs::create_dir_all(&deep).expect("made");
    std::fs::write(deep.join("token"), "deep_secret").expect("written");
    let deeper = sh(
        &format!("cat \"$HOME/{name}/deep/token\"; ls \"$HOME/{name}\""),
        sandbox().see_in_home(format!("{name}/deep")),
    )
    .await;
    assert_eq!(deeper.stdout, "deep_secretdeep\n", "{deeper:?}");
    // A program its command line names under $HOME is seen, with its folder.
    let script = planted.file().with_file_name("run.sh");
    std::fs::write(&script, "#!/bin/sh\ncat \"$(dirname \"$0\")/token\"\n").expect("written");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("executable");
    let named = Program::new([script.display().to_string()])
        .sandbox(sandbox())
        .run(Vec::new(), TIMEOUT, 4096)
        .await
        .expect("runs");
    assert_eq!(named.stdout, "hf_secret", "{named:?}");
    // Credentials stay hidden even when named.
    if let Some(kaggle) = PlantedInHome::at(".kaggle", "kaggle.json", "{\"key\": \"k\"}") {
        let named = sh(
            "cat \"$HOME/.kaggle/kaggle.json\"",
            sandbox().see_in_home(".kaggle"),
        )
        .await;
        assert!(!named.stdout.contains("key"), "{named:?}");
        drop(kaggle);
    } else {
        eprintln!("~/.kaggle exists here: left alone, not planted");
    }
}

#[test]
fn the_tail_of_an_output_counts_characters_not_bytes() {
    assert_eq!(tail("  line one\nétoile  \n", 6), "étoile");
    assert_eq!(tail("short", 100), "short");
    assert_eq!(tail("anything", 0), "");
}

mod sessions;

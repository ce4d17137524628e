//! The attack suite: what a policy in training drives (a tool call's code, an agent program)
//! tries against the engine that runs it, each attack scripted through the simulator and run
//! by the real `async-grpo rollout`. Each test checks that the run goes on to a clean exit and
//! that the attack had no effect: no crash, no process left behind, no secret read, no file of
//! the run read or written, no connection made, no other rollout's key or directory seen. The
//! runs' directories live under the target directory rather than `/tmp` (which the sandbox
//! replaces anyway), so that what hides the run's files is the engine's doing.

use std::{
    io::ErrorKind,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use rollout_core::TrainingSample;
use serde_json::json;
use test_support::ScratchDir;

use super::{
    reliability::kill_all,
    rollout::{Case, exit_within, runtime, simulator},
};

/// A fresh directory for one test under the target directory: readable in the sandbox like
/// the rest of the file system, so that only the engine's hiding keeps the run's files out.
fn case(name: &str) -> Case {
    Case {
        dir: ScratchDir::new_in(
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            &format!("untrusted-{name}"),
        ),
    }
}

/// A value no other test, file or process holds: for secrets and markers.
fn unique(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.subsec_nanos());
    format!("{what}{}x{nanos}", std::process::id())
}

/// `text` as a TOML basic string (JSON's escapes are TOML's).
fn toml_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// Writes a dataset of one question whose `note` column (never shown to the model) holds
/// `note`.
fn write_one_row(case: &Case, note: &str) {
    let row = json!({ "prompt": "What is 2 + 3?", "answer": "5", "note": note });
    std::fs::write(case.dataset(), format!("{row}\n")).expect("write the dataset");
}

/// Writes run.toml: one question, two rollouts whose first turn calls the `python` tool with
/// `code`; `table` adds keys to the tool's table.
fn write_python_config(case: &Case, code: &str, table: &str) {
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 3\nretries = 0\nmax_tokens = 2048\n\n\
         [[tools]]\nname = \"python\"\nkind = \"python\"\ntimeout = \"20s\"\n{table}\n\n\
         [simulator]\ntool_rounds = 1\nanswer_tokens = 4\ntool_arguments = {{ code = {} }}\n",
        toml_string(code)
    ));
}

/// What a run left: its exit code, its stderr, the text of its output file and its rows.
struct Ran {
    code: Option<i32>,
    stderr: String,
    out: String,
    rows: Vec<TrainingSample>,
}

impl Ran {
    /// The run exited 0 with a row per rollout (two); returns the text of each row's tool
    /// message (one per row).
    fn tool_results(&self) -> Vec<String> {
        assert_eq!(self.code, Some(0), "the run failed: {}", self.stderr);
        assert_eq!(self.rows.len(), 2, "a row per rollout: {}", self.stderr);
        self.rows
            .iter()
            .map(|row| {
                let tools: Vec<_> = row
                    .completion
                    .iter()
                    .filter(|m| m["role"] == "tool")
                    .collect();
                assert_eq!(tools.len(), 1, "one tool call: {:?}", row.completion);
                tools[0]["content"]
                    .as_str()
                    .expect("a text result")
                    .to_owned()
            })
            .collect()
    }
}

/// Runs `command` to its end (two minutes at most).
fn run(case: &Case, command: &mut Command) -> Ran {
    let stderr_path = case.dir.join("stderr.txt");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).expect("create the stderr file"))
        .spawn()
        .expect("the binary starts");
    let code = exit_within(
        &mut child,
        Duration::from_secs(120),
        "a run of two rollouts",
    );
    let out = std::fs::read_to_string(case.out()).unwrap_or_default();
    Ran {
        code,
        stderr: std::fs::read_to_string(&stderr_path).unwrap_or_default(),
        rows: if code == Some(0) {
            case.rows()
        } else {
            Vec::new()
        },
        out,
    }
}

/// Live processes (not zombies) whose command line holds `marker`, but this test's own.
fn processes_with(marker: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let alive = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next())
                .is_some_and(|state| state != 'Z');
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            alive && String::from_utf8_lossy(&cmdline).contains(marker)
        })
        .collect()
}

#[test]
fn a_calculator_call_nested_twenty_thousand_deep_is_an_error_the_model_reads() {
    let case = case("deep");
    write_one_row(&case, "deep");
    let expression = format!("{}1{}", "(".repeat(20_000), ")".repeat(20_000));
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 3\nretries = 0\n\
         max_tokens = 100000\n\n\
         [[tools]]\nname = \"calculator\"\nkind = \"calculator\"\n\n\
         [simulator]\ntool_rounds = 1\nanswer_tokens = 4\nmax_model_len = 262144\n\
         tool_arguments = {{ expression = {} }}\n",
        toml_string(&expression)
    ));
    let ran = run(&case, &mut case.command(&[]));
    for result in ran.tool_results() {
        assert!(
            result.contains("nested deeper"),
            "the model reads why its call failed: {}",
            &result[..result.len().min(500)]
        );
    }
}

#[test]
fn a_process_the_python_tool_starts_in_a_new_session_dies_with_the_call() {
    let case = case("setsid");
    write_one_row(&case, "setsid");
    // A duration `sleep` takes, and no other process's command line holds.
    let marker = format!("86400.{}", unique("0").replace('x', ""));
    write_python_config(
        &case,
        &format!(
            "import subprocess\n\
             subprocess.Popen(['sleep', '{marker}'], start_new_session=True,\n\
             \x20   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n\
             print('started')\n"
        ),
        "",
    );
    let ran = run(&case, &mut case.command(&[]));
    // Whatever the assertions say, leave nothing running on the machine.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut left = processes_with(&marker);
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        left = processes_with(&marker);
    }
    kill_all(&left);
    let results = ran.tool_results();
    assert!(
        results.iter().all(|result| result == "started"),
        "the code ran: {results:?}"
    );
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "`sleep {marker}` outlived the run by 10 s"
    );
}

#[test]
fn a_fork_bomb_in_the_python_tool_stops_at_its_process_limit_and_the_run_goes_on() {
    let case = case("fork-bomb");
    write_one_row(&case, "fork-bomb");
    // Every process forks until the kernel refuses, then says so and ends: unbounded but for
    // the limit (the sandbox's user is the tree's own, also when the engine is root).
    write_python_config(
        &case,
        "import os, sys\n\
         while True:\n\
         \x20   try:\n\
         \x20       os.fork()\n\
         \x20   except OSError as error:\n\
         \x20       if os.getpid() == 2 or error.errno != 11:\n\
         \x20           print('refused', error.errno)\n\
         \x20       sys.exit(0)\n",
        "limits = { processes = 32 }",
    );
    let started = Instant::now();
    let ran = run(&case, &mut case.command(&[]));
    let results = ran.tool_results();
    assert!(
        results.iter().all(|result| result.contains("refused 11")),
        "each bomb stopped at the limit (EAGAIN): {results:?}"
    );
    eprintln!("two fork bombs ran and stopped in {:?}", started.elapsed());
}

/// A run whose python tool (its table extended by `table`) prints the engine's `SECRET_X`
/// and `ASYNC_GRPO_LISTEN_TOKEN`, both set to fresh values; returns the run and the two values.
fn run_printing_the_environment(name: &str, table: &str) -> (Ran, String, String) {
    let case = case(name);
    write_one_row(&case, name);
    write_python_config(
        &case,
        "import os\nprint(os.environ.get('SECRET_X'), os.environ.get('ASYNC_GRPO_LISTEN_TOKEN'))\n",
        table,
    );
    let (secret, token) = (unique("secretx"), unique("token"));
    let ran = run(
        &case,
        case.command(&["--listen", "127.0.0.1:0"])
            .env("SECRET_X", &secret)
            .env("ASYNC_GRPO_LISTEN_TOKEN", &token),
    );
    (ran, secret, token)
}

#[test]
fn the_python_tool_sees_neither_the_engine_s_variables_nor_its_listen_token() {
    let (ran, secret, token) = run_printing_the_environment("environ", "");
    assert_eq!(ran.tool_results(), ["None None", "None None"]);
    assert!(!ran.out.contains(&secret), "SECRET_X leaked: {}", ran.out);
    assert!(
        !ran.out.contains(&token),
        "the listen token leaked: {}",
        ran.out
    );
}

#[test]
fn an_unsandboxed_python_tool_sees_the_engine_s_variables_but_not_its_listen_token() {
    let (ran, secret, token) = run_printing_the_environment("environ-none", "sandbox = \"none\"");
    let seen = format!("{secret} None");
    assert_eq!(ran.tool_results(), [seen.as_str(), seen.as_str()]);
    assert!(
        !ran.out.contains(&token),
        "the listen token leaked: {}",
        ran.out
    );
}

#[test]
fn the_python_tool_can_neither_write_the_run_s_files_nor_read_its_dataset() {
    let case = case("files");
    let note = unique("note");
    write_one_row(&case, &note);
    let dataset = std::fs::read(case.dataset()).expect("the dataset");
    let planted = case.dir.join("planted.txt");
    let path = |p: &Path| toml_string(&p.display().to_string());
    // What it writes is spelled so that its code (which the rows hold) does not hold it.
    write_python_config(
        &case,
        &format!(
            "import os\n\
             try:\n    print('read', open({dataset}).read())\n\
             except OSError as error:\n    print('unreadable', type(error).__name__)\n\
             for path in ({dataset}, {out}, {planted}, {config}):\n\
             \x20   try:\n\
             \x20       with open(path, 'a') as f:\n\
             \x20           f.write('PW' + 'NED\\n')\n\
             \x20       print('wrote', path)\n\
             \x20   except OSError as error:\n\
             \x20       print('refused', type(error).__name__)\n",
            dataset = path(&case.dataset()),
            out = path(&case.out()),
            planted = path(&planted),
            config = path(&case.config_file()),
        ),
        "",
    );
    let ran = run(&case, &mut case.command(&[]));
    let results = ran.tool_results();
    assert!(
        results
            .iter()
            .all(|result| result.matches("refused").count() == 4 && !result.contains("wrote")),
        "every write refused: {results:?}"
    );
    assert!(
        !ran.out.contains(&note),
        "the dataset was read: {results:?}"
    );
    assert!(
        !ran.out.contains("PWNED"),
        "the output was written: {results:?}"
    );
    assert!(
        !planted.exists(),
        "a file was written into the case's directory"
    );
    assert_eq!(
        std::fs::read(case.dataset()).expect("the dataset"),
        dataset,
        "the dataset changed"
    );
    let config = std::fs::read_to_string(case.config_file()).expect("the config");
    assert!(!config.contains("PWNED"), "the config changed");
}

#[test]
fn the_python_tool_reaches_neither_a_local_listener_nor_the_control_endpoint() {
    let case = case("network");
    write_one_row(&case, "network");
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let port = listener.local_addr().expect("an address").port();
    // A free port for the control endpoint: taken and given back.
    let control = TcpListener::bind("127.0.0.1:0")
        .and_then(|free| free.local_addr())
        .expect("a free port")
        .port();
    write_python_config(
        &case,
        &format!(
            "import socket\n\
             for name, port in (('listener', {port}), ('control', {control})):\n\
             \x20   s = socket.socket()\n\
             \x20   s.settimeout(5)\n\
             \x20   try:\n\
             \x20       s.connect(('127.0.0.1', port))\n\
             \x20       print(name, 'connected')\n\
             \x20   except OSError as error:\n\
             \x20       print(name, 'refused', type(error).__name__)\n\
             \x20   finally:\n\
             \x20       s.close()\n"
        ),
        "",
    );
    let ran = run(
        &case,
        &mut case.command(&["--listen", &format!("127.0.0.1:{control}")]),
    );
    let results = ran.tool_results();
    // The run is over: any connection the code made is in the listener's queue by now.
    listener.set_nonblocking(true).expect("non-blocking");
    match listener.accept() {
        Err(error) if error.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the tool's code connected to the listener: {other:?}, {results:?}"),
    }
    let refused = "listener refused ConnectionRefusedError\ncontrol refused ConnectionRefusedError";
    assert_eq!(results, [refused, refused]);
}

/// The Python interpreter itself (not a shim that needs more of `PATH`).
fn python_executable() -> PathBuf {
    let output = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 runs");
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// Where `program` is on `PATH`.
fn which(program: &str) -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{program} is not on PATH"))
}

#[test]
fn a_run_whose_sandbox_cannot_be_had_stops_at_the_checks_and_says_what_to_do() {
    let case = case("no-bwrap");
    write_one_row(&case, "no-bwrap");
    // A PATH with what the run's programs need, but no bubblewrap.
    let bin = case.dir.join("bin");
    std::fs::create_dir_all(&bin).expect("a bin directory");
    let mut linked = vec![("python3".to_owned(), python_executable())];
    linked.extend(["sh", "prlimit", "true", "sleep", "env"].map(|p| (p.to_owned(), which(p))));
    for (name, target) in &linked {
        std::os::unix::fs::symlink(target, bin.join(name)).expect("a symlink");
    }
    assert!(!bin.join("bwrap").exists());
    let code = "print(6 * 7)\n";
    write_python_config(&case, code, "");
    let ran = run(&case, case.command(&[]).env("PATH", &bin));
    assert_ne!(ran.code, Some(0), "the run started: {}", ran.stderr);
    for wanted in [
        "bubblewrap",
        "apt-get install bubblewrap",
        "sandbox = \"none\"",
    ] {
        assert!(ran.stderr.contains(wanted), "{wanted:?} in {}", ran.stderr);
    }
    assert!(!case.out().exists(), "rows were written: {}", ran.stderr);

    write_python_config(&case, code, "sandbox = \"none\"");
    let ran = run(&case, case.command(&[]).env("PATH", &bin));
    assert_eq!(ran.tool_results(), ["42", "42"]);
}

/// The agent: calls the model once, then, for its first 2 s (so that both agents of the run
/// are alive at once), looks for other rollouts' proxy keys in every process's environment
/// and for other directories next to its own; writes what it found to found.json.
const SNOOPING_AGENT: &str = r#"
import json, os, sys, time, urllib.request

start = time.monotonic()
own = os.environ["OPENAI_API_KEY"]
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + own},
)
with urllib.request.urlopen(request, timeout=60) as response:
    response.read()
here = os.getcwd()
keys, siblings = set(), set()
while time.monotonic() - start < 2.0:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                variables = f.read().split(b"\0")
        except OSError:
            continue
        for variable in variables:
            name, _, value = variable.partition(b"=")
            if name == b"OPENAI_API_KEY" and value.decode() != own:
                keys.add(value.decode())
    try:
        siblings |= set(os.listdir(os.path.dirname(here))) - {os.path.basename(here)}
    except OSError:
        pass
    time.sleep(0.05)
found = {"keys": sorted(keys), "siblings": sorted(siblings)}
with open("found.json", "w") as f:
    json.dump(found, f)
print(json.dumps(found))
"#;

/// verify: 1000 per other key found plus 1 per other directory seen; no found.json (the agent
/// did not get to the end) is unscorable.
const COUNTING_VERIFY: &str = r#"
import json, sys
try:
    with open("found.json") as f:
        found = json.load(f)
except OSError:
    sys.exit(3)
print(1000 * len(found["keys"]) + len(found["siblings"]))
"#;

#[test]
fn two_agents_in_flight_see_neither_each_other_s_key_nor_each_other_s_directory() {
    let case = case("agents");
    write_one_row(&case, "agents");
    // On each agent's command line, for the test to see both alive at once.
    let marker = unique("agent");
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 2\nretries = 0\n\n\
         [agent]\ncommand = [\"python3\", \"-c\", {agent}, \"{marker}\"]\n\
         verify = [\"python3\", \"-c\", {verify}]\ntimeout = \"60s\"\n",
        agent = toml_string(SNOOPING_AGENT),
        verify = toml_string(COUNTING_VERIFY),
    ));
    let runtime = runtime();
    let sim = simulator(&runtime, 0, "calculator");
    // The agents' private root outside `/tmp` (which the sandbox replaces anyway), as where
    // TMPDIR points elsewhere: only the engine's hiding keeps one agent from the other's.
    let tmp = case.dir.join("tmp");
    std::fs::create_dir_all(&tmp).expect("a TMPDIR");
    let stderr_path = case.dir.join("stderr.txt");
    let mut child = case
        .command(&["--server", &sim.url()])
        .env("TMPDIR", &tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).expect("create the stderr file"))
        .spawn()
        .expect("the binary starts");
    // The agents' interpreters (not bwrap or a shim in front of them) alive at once.
    let agents_alive = || {
        processes_with(&marker)
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .unwrap_or_default()
                    .split(|&b| b == 0)
                    .next()
                    .is_some_and(|argv0| {
                        Path::new(&*String::from_utf8_lossy(argv0))
                            .file_name()
                            .is_some_and(|name| name.to_string_lossy().starts_with("python"))
                    })
            })
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut most_at_once = 0;
    while child.try_wait().expect("wait for the run").is_none() && Instant::now() < deadline {
        most_at_once = most_at_once.max(agents_alive());
        std::thread::sleep(Duration::from_millis(20));
    }
    let code = exit_within(&mut child, Duration::from_secs(1), "two agents of 2 s");
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(most_at_once, 2, "the two agents ran at once: {stderr}");
    let rows = case.rows();
    assert_eq!(rows.len(), 2, "a row per rollout: {stderr}");
    let found: Vec<Option<f64>> = rows.iter().map(|row| row.rewards["env"].as_f64()).collect();
    assert_eq!(
        found,
        [Some(0.0); 2],
        "1000 per other key found plus 1 per other directory seen, by each agent"
    );
}

#[test]
fn a_command_reward_sandboxed_on_request_sees_neither_the_engine_s_variables_nor_the_dataset() {
    let case = case("reward");
    let note = unique("note");
    write_one_row(&case, &note);
    // 1 for each completion when the program sees neither SECRET_X nor the dataset's text.
    let script = "cat >/dev/null; if [ -z \"$SECRET_X\" ] && [ ! -s \"$1\" ]; \
                  then echo '[1, 1]'; else echo '[0, 0]'; fi";
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\n\n[[rewards]]\nkind = \"command\"\n\
         program = [\"sh\", \"-c\", {}, \"sh\", {}]\nsandbox = \"bwrap\"\n",
        toml_string(script),
        toml_string(&case.dataset().display().to_string()),
    ));
    let ran = run(&case, case.command(&[]).env("SECRET_X", unique("secretx")));
    assert_eq!(ran.code, Some(0), "the run failed: {}", ran.stderr);
    let scores: Vec<_> = ran
        .rows
        .iter()
        .map(|row| row.rewards["command_sh"].as_f64())
        .collect();
    assert_eq!(scores, [Some(1.0), Some(1.0)], "{}", ran.stderr);
}

/// `ask_proxy()`, in Python: an agent's one request to its proxy (the rollout's turn), for the
/// agents below to start with.
const ASK_PROXY: &str = r#"
import json, os, urllib.request
def ask_proxy():
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        json.load(response)
"#;

/// An agent (after [`ASK_PROXY`]) that tries to reach the local ports on its command line,
/// then asks its proxy for one answer; writes how many ports it reached to reached.json.
const KNOCKING_AGENT: &str = r#"
import socket, sys
reached = 0
for port in sys.argv[1:]:
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        reached += 1
    except OSError:
        pass
ask_proxy()
with open("reached.json", "w") as f:
    json.dump(reached, f)
"#;

/// verify: the number of ports the agent reached.
const REACHED_VERIFY: &str = r#"
import json, sys
try:
    with open("reached.json") as f:
        print(json.load(f))
except OSError:
    sys.exit(3)
"#;

#[test]
fn an_agent_reaches_its_proxy_and_no_other_local_port() {
    let case = case("agent-network");
    write_one_row(&case, "agent-network");
    let listener = TcpListener::bind("127.0.0.1:0").expect("a local port");
    listener.set_nonblocking(true).expect("non-blocking");
    let port = listener.local_addr().expect("bound").port();
    let runtime = runtime();
    let sim = simulator(&runtime, 0, "calculator");
    let sim_port = sim
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .expect("the simulator's port");
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 2\nretries = 0\n\n\
         [agent]\ncommand = [\"python3\", \"-c\", {agent}, \"{port}\", \"{sim_port}\"]\n\
         verify = [\"python3\", \"-c\", {verify}]\ntimeout = \"60s\"\n",
        agent = toml_string(&format!("{ASK_PROXY}{KNOCKING_AGENT}")),
        verify = toml_string(REACHED_VERIFY),
    ));
    let ran = run(&case, &mut case.command(&["--server", &sim.url()]));
    assert_eq!(ran.code, Some(0), "the run failed: {}", ran.stderr);
    // A row per rollout: each agent's request reached the proxy.
    let reached: Vec<Option<f64>> = ran
        .rows
        .iter()
        .map(|row| row.rewards["env"].as_f64())
        .collect();
    assert_eq!(
        reached,
        [Some(0.0); 2],
        "ports reached by each agent (the test's listener, the model server): {}",
        ran.stderr
    );
    assert!(
        listener.accept().is_err(),
        "an agent's connection reached the host"
    );
}

/// Reads `/etc/shadow` and the file `$PLANTED` names (not on its command line, whose files
/// the sandbox shows); prints what it read of each, or the error's name. For the python tool
/// (as its code) and for an agent (after [`ASK_PROXY`]: it also writes what it read to
/// read.txt, then asks its proxy for an answer, since a rollout needs a turn).
const READING_SECRETS: &str = r#"
import os
found = []
for path in ["/etc/shadow", os.environ["PLANTED"]]:
    try:
        with open(path) as f:
            found.append("read " + f.read(64))
    except OSError as error:
        found.append("closed " + type(error).__name__)
text = "; ".join(found)
print(text)
if "OPENAI_BASE_URL" in os.environ:
    # An agent: it writes what it read beside it, and asks its proxy for one answer.
    with open("read.txt", "w") as f:
        f.write(text)
    ask_proxy()
"#;

/// verify: 1 per secret (`/etc/shadow`'s `root:`, its argument) found in read.txt.
const SECRETS_VERIFY: &str = r#"
import sys
try:
    text = open("read.txt").read()
except OSError:
    sys.exit(3)
print(int("root:" in text) + int(sys.argv[1] in text))
"#;

#[test]
fn root_s_files_and_a_credential_under_home_stay_closed_to_the_python_tool_and_an_agent() {
    let secret = unique("hf_");
    let planted = test_support::PlantedInHome::new("untrusted", "token", &secret);
    let planted = planted.file().display().to_string();

    let tool = case("secrets-tool");
    write_one_row(&tool, "secrets");
    // The tool's code: the script, the planted file's path set first.
    write_python_config(
        &tool,
        &format!(
            "import os\nos.environ['PLANTED'] = {}\n{READING_SECRETS}",
            toml_string(&planted)
        ),
        "",
    );
    let ran = run(&tool, &mut tool.command(&[]));
    for result in ran.tool_results() {
        assert!(
            !result.contains("root:") && !result.contains(&secret),
            "{result}"
        );
        assert_eq!(result.matches("closed").count(), 2, "{result}");
    }

    let agent = case("secrets-agent");
    write_one_row(&agent, "secrets");
    agent.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 2\nretries = 0\n\n\
         [agent]\ncommand = [\"python3\", \"-c\", {agent}]\nenv = {{ PLANTED = {planted} }}\n\
         verify = [\"python3\", \"-c\", {verify}, {secret}]\ntimeout = \"60s\"\n",
        agent = toml_string(&format!("{ASK_PROXY}{READING_SECRETS}")),
        planted = toml_string(&planted),
        verify = toml_string(SECRETS_VERIFY),
        secret = toml_string(&secret),
    ));
    let runtime = runtime();
    let sim = simulator(&runtime, 0, "calculator");
    let ran = run(&agent, &mut agent.command(&["--server", &sim.url()]));
    assert_eq!(ran.code, Some(0), "the run failed: {}", ran.stderr);
    let found: Vec<Option<f64>> = ran
        .rows
        .iter()
        .map(|row| row.rewards["env"].as_f64())
        .collect();
    assert_eq!(
        found,
        [Some(0.0); 2],
        "secrets each agent read: {}",
        ran.stderr
    );
}

/// The code of each of a rollout's four `python` calls in a session: a memory balloon on the
/// first, a fork bomb on the second (its processes sleeping on `marker`), a busy loop on the
/// third; each says which call of its interpreter it is.
fn session_attacks(marker: &str) -> String {
    format!(
        "import os\n\
         n = globals().get('n', 0) + 1\n\
         if n == 1:\n\
         \x20   try:\n\
         \x20       hog = bytearray(3 * 1024 ** 3)\n\
         \x20   except MemoryError:\n\
         \x20       print('balloon refused')\n\
         elif n == 2:\n\
         \x20   forks = 0\n\
         \x20   while forks < 100:\n\
         \x20       try:\n\
         \x20           pid = os.fork()\n\
         \x20       except OSError as error:\n\
         \x20           print('forks refused', error.errno)\n\
         \x20           break\n\
         \x20       if pid == 0:\n\
         \x20           os.execvp('sleep', ['sleep', '{marker}'])\n\
         \x20       forks += 1\n\
         elif n == 3:\n\
         \x20   while True:\n\
         \x20       pass\n\
         print('call', n)\n"
    )
}

#[test]
fn a_python_session_keeps_its_rollout_s_state_and_a_balloon_a_fork_bomb_and_a_busy_loop_end_it_alone()
 {
    let case = case("python-session");
    write_one_row(&case, "session");
    let marker = format!("86400.{}", unique("0").replace('x', ""));
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nmax_turns = 5\nretries = 0\nmax_tokens = 4096\n\n\
         [[tools]]\nname = \"python\"\nkind = \"python\"\nsession = \"rollout\"\ntimeout = \"3s\"\n\
         limits = {{ memory_mib = 1024, processes = 32 }}\n\n\
         [simulator]\ntool_rounds = 4\nanswer_tokens = 4\ntool_arguments = {{ code = {} }}\n",
        toml_string(&session_attacks(&marker))
    ));
    let ran = run(&case, &mut case.command(&[]));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut left = processes_with(&marker);
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        left = processes_with(&marker);
    }
    kill_all(&left);
    assert_eq!(ran.code, Some(0), "the run failed: {}", ran.stderr);
    assert_eq!(ran.rows.len(), 2, "a row per rollout: {}", ran.stderr);
    let timed_out = serde_json::json!({
        "error": "tool 'python' failed: timed out after 3s: the interpreter was killed and the \
                  session's state is lost; the next call starts a new interpreter"
    })
    .to_string();
    for row in &ran.rows {
        let results: Vec<&str> = row
            .completion
            .iter()
            .filter(|m| m["role"] == "tool")
            .filter_map(|m| m["content"].as_str())
            .collect();
        // Each rollout counts its own calls: its sibling's never reach its interpreter.
        assert_eq!(
            results,
            [
                "balloon refused\ncall 1",
                "forks refused 11\ncall 2",
                &timed_out,
                "[a new Python interpreter: the previous call timed out after 3s, and what \
                 earlier calls defined is gone]\nballoon refused\ncall 1",
            ],
            "{}",
            ran.stderr
        );
    }
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "the fork bomb's processes outlived their session by 10 s"
    );
}

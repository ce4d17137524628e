//! [`Interpreter`]: one Python interpreter that keeps its state from cell to cell, in its
//! sandbox; [`InterpreterPool`]: interpreters started ahead of need, so that a rollout's first
//! cell does not wait for one.

use std::{
    collections::VecDeque,
    fmt,
    process::Stdio,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    process::{Child, ChildStdin, ChildStdout},
    sync::Notify,
};

use crate::{Error, ProcessGroup, Program, Sandbox, cgroup::Cgroup};

/// The driver each interpreter runs (`python3 -I -u -c DRIVER`): cells in one namespace.
const DRIVER: &str = include_str!("driver.py");

/// How long an interpreter may take to start and say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest header line the driver sends before a cell's output.
const MAX_HEADER: u64 = 64;

/// What starts an interpreter: the program (default `python3`) and its sandbox.
#[derive(Debug, Clone)]
pub struct InterpreterSpec {
    /// The Python interpreter to run.
    pub program: String,
    /// Where it runs. Its private `/tmp` is the session's folder: its files live as long as
    /// the interpreter.
    pub sandbox: Sandbox,
    /// What the cells see in `sys.argv[1:]`.
    pub args: Vec<String>,
}

impl InterpreterSpec {
    /// `program` in `sandbox`.
    pub fn new(program: impl Into<String>, sandbox: Sandbox) -> InterpreterSpec {
        InterpreterSpec {
            program: program.into(),
            sandbox,
            args: Vec::new(),
        }
    }

    /// With `arg` in the cells' `sys.argv`.
    pub fn arg(mut self, arg: impl Into<String>) -> InterpreterSpec {
        self.args.push(arg.into());
        self
    }

    /// Starts an interpreter and waits until it is ready for its first cell.
    pub async fn start(&self) -> Result<Interpreter, Error> {
        let program = Program::new(
            [self.program.as_str(), "-I", "-u", "-c", DRIVER]
                .into_iter()
                .chain(self.args.iter().map(String::as_str)),
        )
        .sandbox(self.sandbox.clone());
        let cgroup = program.cgroup();
        let mut command = program.command_in(cgroup.as_ref())?;
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().map_err(|source| Error::Start {
            program: self.program.clone(),
            source,
        })?;
        let group = ProcessGroup::new(child.id());
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(self.failed("its pipes could not be opened"));
        };
        // What the interpreter says on stderr before its driver starts (a missing program, a
        // sandbox that cannot be made), for the error; capped, then left to close.
        let stderr = child.stderr.take();
        let mut interpreter = Interpreter {
            child,
            group,
            cgroup,
            stdin,
            stdout: BufReader::new(stdout),
        };
        let ready = async {
            let mut line = String::new();
            (&mut interpreter.stdout)
                .take(MAX_HEADER)
                .read_line(&mut line)
                .await
                .map(|_| line)
        };
        match tokio::time::timeout(START_TIMEOUT, ready).await {
            Ok(Ok(line)) if line == "ready\n" => Ok(interpreter),
            Ok(_) => {
                let mut said = Vec::new();
                if let Some(stderr) = stderr {
                    let _ = stderr.take(4096).read_to_end(&mut said).await;
                }
                let status = interpreter.child.wait().await.ok();
                let status = status.map_or_else(|| "ended".to_owned(), |s| s.to_string());
                Err(self.failed(&format!(
                    "it {status} before it was ready: {}",
                    crate::tail(&String::from_utf8_lossy(&said), 1000)
                )))
            }
            Err(_) => Err(Error::Timeout {
                program: self.program.clone(),
                timeout: START_TIMEOUT,
            }),
        }
    }

    fn failed(&self, why: &str) -> Error {
        Error::Start {
            program: self.program.clone(),
            source: std::io::Error::other(format!("the Python session's interpreter: {why}")),
        }
    }
}

/// One Python interpreter in its sandbox that runs cells ([`Interpreter::run`]) in one
/// namespace: what a cell defines, imports or writes to its `/tmp` the next cell sees.
/// Dropped, it is killed with everything it started.
pub struct Interpreter {
    child: Child,
    /// Killed with the interpreter: a sandbox's PID namespace takes what it started with it.
    group: ProcessGroup,
    /// Its tree's memory and processes, where the machine lets the engine bound them.
    cgroup: Option<Cgroup>,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl fmt::Debug for Interpreter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Interpreter")
            .field("pid", &self.child.id())
            .finish_non_exhaustive()
    }
}

/// What a cell did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Cell {
    /// What it wrote to stdout and stderr, interleaved as written, then the value of its last
    /// expression when that is not `None` (as a notebook shows it), and its traceback when it
    /// raised; capped, saying how much was cut.
    pub output: String,
    /// Whether it raised.
    pub raised: bool,
}

/// Why an interpreter can run no more cells: it is to be dropped, and the next cell needs a
/// new one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Lost(pub String);

impl Interpreter {
    /// Runs `code` as one cell, keeping at most `max_output` bytes of its output. The caller
    /// bounds the time: a cell's future dropped part-way leaves the interpreter in the middle
    /// of it, so an interpreter whose `run` did not return must be dropped.
    pub async fn run(&mut self, code: &str, max_output: usize) -> Result<Cell, Lost> {
        let request = format!("{} {max_output}\n", code.len());
        let sent = async {
            self.stdin.write_all(request.as_bytes()).await?;
            self.stdin.write_all(code.as_bytes()).await?;
            self.stdin.flush().await
        };
        if sent.await.is_err() {
            return Err(self.ended().await);
        }
        let mut header = String::new();
        match (&mut self.stdout)
            .take(MAX_HEADER)
            .read_line(&mut header)
            .await
        {
            Ok(0) | Err(_) => return Err(self.ended().await),
            Ok(_) => {}
        }
        let broke = |what: &str| Lost(format!("the interpreter broke its protocol ({what})"));
        let fields: Vec<&str> = header.split_ascii_whitespace().collect();
        let [status, kept, total] = fields[..] else {
            return Err(broke("a malformed reply"));
        };
        let raised = match status {
            "ok" => false,
            "error" => true,
            _ => return Err(broke("an unknown status")),
        };
        let (Ok(kept), Ok(total)) = (kept.parse::<usize>(), total.parse::<u64>()) else {
            return Err(broke("a malformed length"));
        };
        if kept > max_output {
            return Err(broke("more output than asked for"));
        }
        let mut output = vec![0; kept];
        if self.stdout.read_exact(&mut output).await.is_err() {
            return Err(self.ended().await);
        }
        let mut output = String::from_utf8_lossy(&output).into_owned();
        let more = total.saturating_sub(kept as u64);
        if more > 0 {
            output.push_str(&format!("\n[output truncated: {more} more bytes]"));
        }
        Ok(Cell { output, raised })
    }

    /// Kills the interpreter and everything it started, now (dropping it does too).
    pub fn kill(&mut self) {
        self.group.kill();
        let _ = self.child.start_kill();
        self.cgroup.take();
    }

    /// Why the interpreter stopped answering: how it ended, when it has.
    async fn ended(&mut self) -> Lost {
        let status = tokio::time::timeout(Duration::from_secs(1), self.child.wait()).await;
        Lost(match status {
            Ok(Ok(status)) => match status.code() {
                Some(code) => format!("the interpreter exited with code {code}"),
                None => format!("the interpreter was killed ({status})"),
            },
            _ => "the interpreter stopped answering".to_owned(),
        })
    }
}

/// What an [`InterpreterPool`] did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Interpreters started, warm or on demand.
    pub started: u64,
    /// Sessions that found a warm interpreter.
    pub warm_hits: u64,
    /// Sessions that waited for one to start.
    pub cold_starts: u64,
    /// Interpreters that could not be started.
    pub start_failures: u64,
    /// Sessions that lost their interpreter part-way (a call timed out, the interpreter
    /// died), as their owners counted them ([`InterpreterPool::count_lost`]).
    pub lost: u64,
    /// Interpreters waiting, ready, now.
    pub warm: usize,
    /// Interpreters lent out now.
    pub lent: usize,
}

/// Interpreters started ahead of need: at most `warm` wait ready, and never more than
/// `max_total` exist at once, lent out ones included (the sessions a run can have: one per
/// rollout in flight), so that the pool never starts what no rollout could use. A background
/// task refills it as interpreters are lent out; an interpreter comes back to no pool (its
/// state is its session's): dropped, it is killed.
///
/// Dropping the pool kills the interpreters that wait and ends the task.
#[derive(Clone)]
pub struct InterpreterPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    spec: InterpreterSpec,
    warm_target: usize,
    max_total: usize,
    waiting: Mutex<VecDeque<Interpreter>>,
    /// Lent out and being started.
    busy: AtomicUsize,
    started: AtomicU64,
    warm_hits: AtomicU64,
    cold_starts: AtomicU64,
    start_failures: AtomicU64,
    lost: AtomicU64,
    /// Wakes the refill task. Its own `Arc`: the task holds the pool weakly.
    wake: Arc<Notify>,
    refilling: std::sync::Once,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // The task sees the pool gone and ends.
        self.wake.notify_one();
    }
}

impl fmt::Debug for InterpreterPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InterpreterPool")
            .field("program", &self.inner.spec.program)
            .field("warm", &self.inner.warm_target)
            .field("max_total", &self.inner.max_total)
            .field("stats", &self.stats())
            .finish()
    }
}

impl InterpreterPool {
    /// A pool of `spec`'s interpreters keeping `warm` ready, `max_total` at most in all. Its
    /// refill task starts at once on the current tokio runtime if there is one, else at the
    /// first [`acquire`](Self::acquire).
    pub fn new(spec: InterpreterSpec, warm: usize, max_total: usize) -> InterpreterPool {
        let pool = InterpreterPool {
            inner: Arc::new(PoolInner {
                spec,
                warm_target: warm.min(max_total),
                max_total: max_total.max(1),
                waiting: Mutex::new(VecDeque::new()),
                busy: AtomicUsize::new(0),
                started: AtomicU64::new(0),
                warm_hits: AtomicU64::new(0),
                cold_starts: AtomicU64::new(0),
                start_failures: AtomicU64::new(0),
                lost: AtomicU64::new(0),
                wake: Arc::new(Notify::new()),
                refilling: std::sync::Once::new(),
            }),
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            pool.refill();
        }
        pool
    }

    /// What starts the pool's interpreters.
    pub fn spec(&self) -> &InterpreterSpec {
        &self.inner.spec
    }

    /// The counts so far.
    pub fn stats(&self) -> PoolStats {
        let inner = &self.inner;
        PoolStats {
            started: inner.started.load(Ordering::Relaxed),
            warm_hits: inner.warm_hits.load(Ordering::Relaxed),
            cold_starts: inner.cold_starts.load(Ordering::Relaxed),
            start_failures: inner.start_failures.load(Ordering::Relaxed),
            lost: inner.lost.load(Ordering::Relaxed),
            warm: lock(&inner.waiting).len(),
            lent: inner.busy.load(Ordering::Relaxed),
        }
    }

    /// Counts a session that lost its interpreter part-way (in [`PoolStats::lost`]).
    pub fn count_lost(&self) {
        self.inner.lost.fetch_add(1, Ordering::Relaxed);
    }

    /// An interpreter for one session: a warm one when one waits, else one started now. It
    /// counts against `max_total` until dropped.
    pub async fn acquire(&self) -> Result<Lent, Error> {
        self.refill();
        let inner = &self.inner;
        let warm = lock(&inner.waiting).pop_front();
        let lent = |interpreter| {
            inner.busy.fetch_add(1, Ordering::Relaxed);
            inner.wake.notify_one();
            Lent {
                interpreter,
                pool: Arc::downgrade(inner),
            }
        };
        if let Some(interpreter) = warm {
            inner.warm_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(lent(interpreter));
        }
        inner.cold_starts.fetch_add(1, Ordering::Relaxed);
        let started = inner.spec.start().await;
        count_start(inner, &started);
        started.map(lent)
    }

    /// Starts the refill task, once.
    fn refill(&self) {
        let inner = &self.inner;
        inner.refilling.call_once(|| {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return;
            };
            runtime.spawn(refill(Arc::downgrade(inner), Arc::clone(&inner.wake)));
        });
    }
}

/// Keeps the pool's `warm_target` interpreters ready, within `max_total`, until the pool is
/// dropped. After a start fails it waits before trying again (a missing interpreter must not
/// spin).
async fn refill(pool: Weak<PoolInner>, wake: Arc<Notify>) {
    loop {
        let spec = {
            let Some(inner) = pool.upgrade() else { return };
            let waiting = lock(&inner.waiting).len();
            let total = waiting + inner.busy.load(Ordering::Relaxed);
            (waiting < inner.warm_target && total < inner.max_total).then(|| {
                // Counted as busy while it starts, so that the bound holds meanwhile.
                inner.busy.fetch_add(1, Ordering::Relaxed);
                inner.spec.clone()
            })
        };
        let Some(spec) = spec else {
            wake.notified().await;
            continue;
        };
        let started = spec.start().await;
        let Some(inner) = pool.upgrade() else { return };
        inner.busy.fetch_sub(1, Ordering::Relaxed);
        count_start(&inner, &started);
        match started {
            Ok(interpreter) => lock(&inner.waiting).push_back(interpreter),
            Err(error) => {
                tracing::warn!(%error, "a warm Python interpreter could not be started");
                drop(inner);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

fn count_start(inner: &PoolInner, started: &Result<Interpreter, Error>) {
    match started {
        Ok(_) => inner.started.fetch_add(1, Ordering::Relaxed),
        Err(_) => inner.start_failures.fetch_add(1, Ordering::Relaxed),
    };
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// An interpreter lent out of an [`InterpreterPool`]: a session's, until dropped (then it is
/// killed, and the pool may start another).
#[derive(Debug)]
pub struct Lent {
    interpreter: Interpreter,
    pool: Weak<PoolInner>,
}

impl std::ops::Deref for Lent {
    type Target = Interpreter;
    fn deref(&self) -> &Interpreter {
        &self.interpreter
    }
}

impl std::ops::DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut Interpreter {
        &mut self.interpreter
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        // Killed before it stops counting, so that the pool's bound holds.
        self.interpreter.kill();
        if let Some(pool) = self.pool.upgrade() {
            pool.busy.fetch_sub(1, Ordering::Relaxed);
            pool.wake.notify_one();
        }
    }
}

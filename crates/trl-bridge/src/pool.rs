//! [`Pool`]: worker processes where sync Python tools and reward functions run, each with a
//! GIL of its own, so that Python burning CPU there never stalls the trainer's threads.
//!
//! The Python side (`async_grpo._pool`) pickles the callables once, into the frame every
//! worker process starts from. This module starts the processes, sends them calls and reads
//! their answers, all without the trainer's GIL: a tool-dispatch or scoring thread that calls
//! [`Pool::call`] writes one frame to the least busy process's stdin and waits on a channel;
//! a reader thread per process reads the answers from its stdout and hands each to its
//! waiter.
//!
//! A process that dies (a tool called `os._exit`, or crashed the interpreter) fails the calls
//! it was running, naming how it ended; the next call to its slot starts a new one from the
//! same frame. [`Pool::close`] (at the worker's `stop()`) kills every process's group and
//! fails what is still waiting. A process whose stdin ends (the trainer died) exits by itself.

use std::{
    collections::HashMap,
    io::{self, BufReader, BufWriter, Read, Write},
    path::PathBuf,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc,
    },
    thread::JoinHandle,
};

use process::ProcessGroup;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::lock;

/// What a call returns: the text, or why it failed.
type Answer = Result<String, String>;

/// How to start the pool's processes.
#[derive(Debug, Clone)]
pub(crate) struct PoolSpec {
    /// The Python interpreter (the trainer's `sys.executable`).
    pub(crate) python: PathBuf,
    /// The first frame each process is sent (`async_grpo._pool.init_frame`).
    pub(crate) init: Vec<u8>,
    /// How many processes.
    pub(crate) processes: usize,
}

/// The largest answer a process may send: more is a broken process, not an answer.
const MAX_FRAME: usize = 1 << 30;

/// The worker processes.
#[derive(Debug)]
pub(crate) struct Pool {
    spec: PoolSpec,
    slots: Vec<Slot>,
    next_id: AtomicU64,
    closed: AtomicBool,
}

/// One process's place in the pool: empty until started, and again once it died.
#[derive(Debug)]
struct Slot {
    /// Calls sent to it and not yet answered, to pick the least busy.
    load: AtomicUsize,
    process: Mutex<Option<Process>>,
}

/// A running worker process.
#[derive(Debug)]
struct Process {
    calls: BufWriter<ChildStdin>,
    waiting: Arc<Mutex<Waiting>>,
    /// Kills the process and whatever it started when dropped.
    group: ProcessGroup,
    reader: Option<JoinHandle<()>>,
}

/// The calls a process has not answered yet, and, once it ended, how.
#[derive(Debug, Default)]
struct Waiting {
    calls: HashMap<u64, mpsc::Sender<Answer>>,
    ended: Option<String>,
}

#[derive(Deserialize)]
struct Reply {
    id: u64,
    ok: bool,
    text: String,
}

impl Pool {
    /// A pool of `spec.processes` processes, none started yet.
    pub(crate) fn new(spec: PoolSpec) -> Pool {
        let slots = (0..spec.processes.max(1))
            .map(|_| Slot {
                load: AtomicUsize::new(0),
                process: Mutex::new(None),
            })
            .collect();
        Pool {
            spec,
            slots,
            next_id: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        }
    }

    /// Starts every process (each loads the callables while the engine waits for its
    /// servers).
    pub(crate) fn start(&self) -> io::Result<()> {
        for (index, slot) in self.slots.iter().enumerate() {
            let mut process = lock(&slot.process);
            if process.is_none() {
                *process = Some(self.spawn(index)?);
            }
        }
        Ok(())
    }

    /// Runs callable `function` (its place in the init frame) with `args` (a tool's
    /// arguments, or a reward's group) in the least busy process; blocks until it answers.
    pub(crate) fn call(&self, function: usize, args: Value) -> Answer {
        let (index, slot) = self
            .slots
            .iter()
            .enumerate()
            .min_by_key(|(_, slot)| slot.load.load(Ordering::Relaxed))
            .expect("a pool has at least one process");
        slot.load.fetch_add(1, Ordering::Relaxed);
        let answer = self.send(index, slot, function, args);
        slot.load.fetch_sub(1, Ordering::Relaxed);
        answer
    }

    fn send(&self, index: usize, slot: &Slot, function: usize, args: Value) -> Answer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = json!({"id": id, "fn": function, "args": args}).to_string();
        let (sender, receiver) = mpsc::channel();
        {
            let mut guard = lock(&slot.process);
            if self.closed.load(Ordering::Acquire) {
                return Err("the worker processes were stopped".to_owned());
            }
            let ended = guard
                .as_ref()
                .is_none_or(|process| lock(&process.waiting).ended.is_some());
            if ended {
                // Not started, or it died: a new one, from the same frame.
                *guard = Some(
                    self.spawn(index)
                        .map_err(|e| format!("cannot start a Python worker process: {e}"))?,
                );
            }
            let process = guard.as_mut().expect("started above");
            {
                // Under the lock the reader fails waiters with: a process that ended since
                // the check above is seen here, never left with a waiter nobody answers.
                let mut waiting = lock(&process.waiting);
                if let Some(ended) = &waiting.ended {
                    return Err(ended.clone());
                }
                waiting.calls.insert(id, sender);
            }
            if let Err(error) = write_frame(&mut process.calls, frame.as_bytes()) {
                lock(&process.waiting).calls.remove(&id);
                return Err(format!(
                    "cannot send the call to its worker process: {error}"
                ));
            }
        }
        receiver
            .recv()
            .unwrap_or_else(|_| Err("the worker process went away before it answered".to_owned()))
    }

    fn spawn(&self, index: usize) -> io::Result<Process> {
        let mut command = Command::new(&self.spec.python);
        command
            .args(["-c", "from async_grpo._pool import serve; serve()"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // A group of its own: killed whole at close, and no Ctrl-C of the terminal's.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child = command.spawn()?;
        let group = ProcessGroup::new(Some(child.id()));
        let mut calls = BufWriter::new(child.stdin.take().expect("stdin is piped"));
        let answers = child.stdout.take().expect("stdout is piped");
        write_frame(&mut calls, &self.spec.init)?;
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        let reader = std::thread::Builder::new()
            .name(format!("async-grpo-pool-{index}"))
            .spawn({
                let waiting = Arc::clone(&waiting);
                move || read_answers(child, answers, &waiting)
            })?;
        Ok(Process {
            calls,
            waiting,
            group,
            reader: Some(reader),
        })
    }

    /// Kills every process (and what it started), fails the calls still waiting, and joins
    /// the reader threads. Later calls fail at once. Idempotent.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for slot in &self.slots {
            let process = lock(&slot.process).take();
            if let Some(mut process) = process {
                lock(&process.waiting).ended = Some("the worker processes were stopped".to_owned());
                process.group.kill();
                if let Some(reader) = process.reader.take() {
                    let _ = reader.join();
                }
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.close();
    }
}

/// The reader thread: hands each answer to its waiter; once the process's stdout ends, reaps
/// it and fails the calls still waiting with how it ended.
fn read_answers(mut child: Child, answers: ChildStdout, waiting: &Mutex<Waiting>) {
    let mut answers = BufReader::new(answers);
    let broken = loop {
        let frame = match read_frame(&mut answers) {
            Ok(Some(frame)) => frame,
            Ok(None) => break None,
            Err(error) => break Some(error.to_string()),
        };
        let reply: Reply = match serde_json::from_slice(&frame) {
            Ok(reply) => reply,
            Err(error) => break Some(format!("an answer that is not one: {error}")),
        };
        let waiter = lock(waiting).calls.remove(&reply.id);
        if let Some(waiter) = waiter {
            let _ = waiter.send(if reply.ok {
                Ok(reply.text)
            } else {
                Err(reply.text)
            });
        }
    };
    if broken.is_some() {
        let _ = child.kill();
    }
    let status = child.wait().map_or_else(
        |e| format!("could not be waited for: {e}"),
        |s| s.to_string(),
    );
    let mut waiting = lock(waiting);
    let ended = match (&waiting.ended, broken) {
        // Stopped by `Pool::close`: expected.
        (Some(stopped), _) => stopped.clone(),
        (None, Some(why)) => {
            format!("its Python worker process broke the pipe of answers ({why}) and was killed")
        }
        (None, None) => format!("its Python worker process exited ({status})"),
    };
    if waiting.ended.is_none() {
        tracing::warn!(%ended, "a Python worker process ended; the next call starts a new one");
    }
    for (_, waiter) in waiting.calls.drain() {
        let _ = waiter.send(Err(ended.clone()));
    }
    waiting.ended = Some(ended);
}

fn write_frame(to: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let size = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a frame over 4 GiB"))?;
    to.write_all(&size.to_le_bytes())?;
    to.write_all(body)?;
    to.flush()
}

/// One frame, or `None` at the end of the stream.
fn read_frame(from: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut head = [0; 4];
    match from.read_exact(&mut head) {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error),
    }
    let size = u32::from_le_bytes(head) as usize;
    if size > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {size} bytes"),
        ));
    }
    let mut body = vec![0; size];
    from.read_exact(&mut body)?;
    Ok(Some(body))
}

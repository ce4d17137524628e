//! The hand-off of `async def` Python calls (tools, rewards, agents) to the worker's asyncio
//! loop, without the GIL and without a thread.
//!
//! The engine's tasks push a call into the [`Inbox`] and, when it was empty, write a byte to
//! a socket the loop watches (`loop.add_reader`). The loop, woken, takes every call waiting
//! (`Inbox.take`, Python's side holding the GIL as it always does) and runs each as a task,
//! which reports through the call's [`Done`] when it ends. A call whose future is dropped
//! (its timeout, a cancelled rollout) pushes a cancellation the same way. So submitting costs
//! a runtime worker a lock and at most one `write`; the loop's thread, which holds the GIL
//! anyway, does the Python side.
//!
//! The inbox is open while the loop runs (`open` at its start, `close` at its end): a call
//! pushed while it is closed fails at once, and calls still waiting when it closes are told
//! the loop stopped (their `Done` is dropped).

use std::{
    io::{ErrorKind, Read, Write},
    os::{fd::AsRawFd, unix::net::UnixStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use pyo3::{exceptions::PyOSError, prelude::*};
use tokio::sync::oneshot;

use crate::lock;

/// What a call answers: `(ok, text)`.
pub(crate) type Answer = (bool, String);

/// Calls waiting for the asyncio loop, and the socket that wakes it.
#[pyclass(frozen, module = "async_grpo._native")]
pub(crate) struct Inbox {
    state: Mutex<State>,
    /// Written (one byte) when the first entry arrives in an empty inbox.
    wake: UnixStream,
    /// What the loop watches; read empty at each `take`.
    watched: UnixStream,
    next_id: AtomicU64,
}

#[derive(Default)]
struct State {
    open: bool,
    entries: Vec<Entry>,
}

enum Entry {
    Call {
        id: u64,
        kind: &'static str,
        function: Arc<Py<PyAny>>,
        name: Arc<str>,
        payload: String,
        done: Done,
    },
    Cancel(u64),
}

/// A call pushed into the inbox: its answer comes through `answer`; dropping it before the
/// answer came cancels the call.
pub(crate) struct Pending<'a> {
    inbox: &'a Inbox,
    id: u64,
    answer: Option<oneshot::Receiver<Answer>>,
}

impl Pending<'_> {
    /// The call's answer; `None` when the loop stopped (or was stopped) before it ended.
    pub(crate) async fn answer(mut self) -> Option<Answer> {
        let answer = self.answer.as_mut()?.await.ok();
        self.answer = None;
        answer
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.answer.is_some() {
            self.inbox.push(Entry::Cancel(self.id));
        }
    }
}

impl Inbox {
    /// Pushes `kind` (`tool`, `reward` or `agent`: the bridge's coroutine for it) with
    /// `function`, `name` and `payload`; an error when the loop is not running.
    pub(crate) fn submit(
        &self,
        kind: &'static str,
        function: Arc<Py<PyAny>>,
        name: Arc<str>,
        payload: String,
    ) -> Result<Pending<'_>, &'static str> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (sender, receiver) = oneshot::channel();
        let entry = Entry::Call {
            id,
            kind,
            function,
            name,
            payload,
            done: Done {
                sender: Mutex::new(Some(sender)),
            },
        };
        if !self.push(entry) {
            return Err("the worker's asyncio loop is not running");
        }
        Ok(Pending {
            inbox: self,
            id,
            answer: Some(receiver),
        })
    }

    /// Queues `entry` and wakes the loop when it is the first; false when closed.
    fn push(&self, entry: Entry) -> bool {
        let first = {
            let mut state = lock(&self.state);
            if !state.open {
                return false;
            }
            state.entries.push(entry);
            state.entries.len() == 1
        };
        if first {
            // A full socket is readable already: the loop will take this entry too.
            if let Err(error) = (&self.wake).write(&[1])
                && error.kind() != ErrorKind::WouldBlock
            {
                tracing::error!(%error, "could not wake the worker's asyncio loop");
            }
        }
        true
    }
}

#[pymethods]
impl Inbox {
    #[new]
    fn new() -> PyResult<Inbox> {
        let (wake, watched) = UnixStream::pair()
            .map_err(|e| PyOSError::new_err(format!("could not make the inbox's socket: {e}")))?;
        for socket in [&wake, &watched] {
            socket.set_nonblocking(true).map_err(|e| {
                PyOSError::new_err(format!(
                    "could not make the inbox's socket non-blocking: {e}"
                ))
            })?;
        }
        Ok(Inbox {
            state: Mutex::default(),
            wake,
            watched,
            next_id: AtomicU64::new(0),
        })
    }

    /// The descriptor the loop watches for reading.
    fn fileno(&self) -> i32 {
        self.watched.as_raw_fd()
    }

    /// Takes calls from now on (the loop is running).
    fn open(&self) {
        lock(&self.state).open = true;
    }

    /// Takes no more calls; those waiting are told the loop stopped.
    fn close(&self) {
        let entries = {
            let mut state = lock(&self.state);
            state.open = false;
            std::mem::take(&mut state.entries)
        };
        drop(entries);
    }

    /// Every entry waiting, in order: `("call", id, kind, function, name, payload, done)` or
    /// `("cancel", id)`.
    fn take(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        // Read the wake-ups first: an entry pushed after this read finds the inbox empty
        // (taken below) and wakes the loop again.
        let mut buffer = [0_u8; 64];
        loop {
            match (&self.watched).read(&mut buffer) {
                Ok(0) => break,
                Ok(_) => {}
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let entries = std::mem::take(&mut lock(&self.state).entries);
        entries
            .into_iter()
            .map(|entry| -> PyResult<Py<PyAny>> {
                Ok(match entry {
                    Entry::Call {
                        id,
                        kind,
                        function,
                        name,
                        payload,
                        done,
                    } => (
                        "call",
                        id,
                        kind,
                        function.clone_ref(py),
                        &*name,
                        payload,
                        Py::new(py, done)?,
                    )
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                    Entry::Cancel(id) => ("cancel", id).into_pyobject(py)?.into_any().unbind(),
                })
            })
            .collect()
    }
}

/// The callback a call's task calls with `(ok, text)` when it ends.
#[pyclass(frozen, module = "async_grpo._native")]
pub(crate) struct Done {
    sender: Mutex<Option<oneshot::Sender<Answer>>>,
}

#[pymethods]
impl Done {
    fn __call__(&self, ok: bool, text: String) {
        let sender = lock(&self.sender).take();
        if let Some(sender) = sender {
            // The waiter may have given up (a timeout): then nobody needs the answer.
            let _ = sender.send((ok, text));
        }
    }
}

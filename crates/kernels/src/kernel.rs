//! [`Kernel`]: one kernel of a gateway, its cells run over the Jupyter message protocol
//! (v5, JSON over the gateway's channels WebSocket).

use std::{
    fmt,
    hash::{BuildHasher, Hasher},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use crate::{
    KernelError,
    gateway::{Shared, Socket, http_client},
    output::{Output, strip_ansi},
};

/// The version of the message protocol the engine speaks.
const PROTOCOL_VERSION: &str = "5.3";
/// Messages of the current request the pump holds for the caller: past this it waits, and
/// so does the kernel's output.
const EVENTS: usize = 16;

/// What a cell did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Cell {
    /// What it wrote to stdout and stderr, interleaved as the kernel sent it, the plain-text
    /// form of the values it displayed and of its last expression when that is not `None`
    /// (as a notebook shows them, each followed by a line break), and its traceback when it
    /// raised (colour codes stripped); capped, saying how much was cut.
    pub output: String,
    /// Whether it raised.
    pub raised: bool,
}

/// One kernel of a gateway, the Python session of one rollout: what a cell defines, imports
/// or writes, the next cell sees. [`close`](Self::close) it when the rollout ends; dropped
/// without that, it is deleted in the background (on the current tokio runtime if there is
/// one, else on a thread of its own), so that no kernel outlives its rollout.
///
/// A task of its own reads the kernel's WebSocket all along, between calls too: it answers
/// the gateway's pings (a gateway closes a connection that has not answered for 90 s, and a
/// rollout's kernel waits that long while the model writes), drops what answers no request of
/// the current call, and sees a kernel that dies between calls.
pub struct Kernel {
    owned: Owned,
    /// Requests to the pump, which sends them.
    requests: mpsc::Sender<String>,
    /// The current request's messages, from the pump; or why the connection is gone.
    events: mpsc::Receiver<Event>,
    /// The `msg_id` whose answers the pump passes on.
    current: Arc<Mutex<Option<String>>>,
    /// The Jupyter session id of the engine's messages.
    session: String,
    sent: u64,
    /// Why the kernel can run no more cells, once it cannot.
    lost: Option<String>,
    /// A call is under way: a call that finds this set was preceded by one whose future was
    /// dropped part-way.
    busy: bool,
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernel")
            .field("id", &self.owned.id)
            .field("gateway", &self.owned.shared.shown)
            .field("lost", &self.lost)
            .finish_non_exhaustive()
    }
}

/// What the pump passes on.
enum Event {
    /// A message answering the current request.
    Message(Incoming),
    /// The connection is gone, for this reason; the pump has ended.
    Lost(String),
}

/// A message from the kernel, as far as the engine reads it.
#[derive(Deserialize)]
struct Incoming {
    #[serde(default)]
    channel: Option<String>,
    header: Header,
    #[serde(default)]
    parent_header: Option<ParentHeader>,
    #[serde(default)]
    content: Value,
}

#[derive(Deserialize)]
struct Header {
    #[serde(default)]
    msg_type: Option<String>,
}

#[derive(Deserialize)]
struct ParentHeader {
    #[serde(default)]
    msg_id: Option<String>,
}

impl Incoming {
    fn msg_type(&self) -> &str {
        self.header.msg_type.as_deref().unwrap_or_default()
    }

    fn answers(&self, msg_id: &str) -> bool {
        self.parent_header
            .as_ref()
            .and_then(|parent| parent.msg_id.as_deref())
            == Some(msg_id)
    }

    fn text(&self, field: &str) -> &str {
        self.content
            .get(field)
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// Why the kernel is gone, when this says so: a `status` of `dead` or `restarting`,
    /// whatever request it answers (the gateway sends these with no parent).
    fn death(&self) -> Option<&'static str> {
        if self.msg_type() != "status" {
            return None;
        }
        match self.text("execution_state") {
            "dead" => Some("it died (the gateway reports it dead)"),
            "restarting" => Some(
                "it died (its process ended, and the gateway is restarting it with nothing of \
                 its state)",
            ),
            _ => None,
        }
    }
}

impl Kernel {
    /// The kernel `owned` over `socket`, its pump started on the current runtime.
    pub(crate) fn new(owned: Owned, socket: Socket, session: String) -> Kernel {
        let (requests, to_send) = mpsc::channel(1);
        let (passed, events) = mpsc::channel(EVENTS);
        let current = Arc::new(Mutex::new(None));
        tokio::spawn(pump(socket, to_send, passed, Arc::clone(&current)));
        Kernel {
            owned,
            requests,
            events,
            current,
            session,
            sent: 0,
            lost: None,
            busy: false,
        }
    }

    /// The kernel's id on its gateway.
    pub fn id(&self) -> &str {
        &self.owned.id
    }

    /// Whether the kernel is lost: a call failed in a way that leaves its state gone or
    /// unknown, and every later call is an error.
    pub fn is_lost(&self) -> bool {
        self.lost.is_some() || self.busy
    }

    /// Runs `code` as one cell (an `execute_request`), keeping at most `max_output` bytes of
    /// its output, and returns when the kernel is idle again and has replied. A kernel that
    /// dies part-way, a closed connection or a message that breaks the protocol is
    /// [`KernelError::Lost`]: its session's state is gone.
    ///
    /// The caller bounds the time: a call whose future is dropped part-way leaves the kernel
    /// in the middle of the cell, and every later call on it is an error, so the caller drops
    /// the kernel (which deletes it).
    pub async fn execute(&mut self, code: &str, max_output: usize) -> Result<Cell, KernelError> {
        self.usable()?;
        self.busy = true;
        let msg_id = self
            .send(
                "execute_request",
                json!({
                    "code": code,
                    "silent": false,
                    "store_history": true,
                    "user_expressions": {},
                    "allow_stdin": false,
                    "stop_on_error": true,
                }),
            )
            .await?;
        let mut output = Output::new(max_output);
        let mut raised = false;
        let (mut idle, mut replied) = (false, false);
        while !(idle && replied) {
            let message = self.receive().await?;
            if !message.answers(&msg_id) {
                continue;
            }
            match message.msg_type() {
                "status" => idle |= message.text("execution_state") == "idle",
                "execute_reply" if message.channel.as_deref() != Some("iopub") => {
                    replied = true;
                    match message.text("status") {
                        "error" => raised = true,
                        "aborted" => {
                            raised = true;
                            output.push("[the kernel aborted the cell]\n");
                        }
                        _ => {}
                    }
                }
                "stream" => output.push(message.text("text")),
                "execute_result" | "display_data" => push_data(&mut output, &message.content),
                "error" => {
                    raised = true;
                    push_error(&mut output, &message.content);
                }
                _ => {}
            }
        }
        self.follow(None);
        self.busy = false;
        Ok(Cell {
            output: output.finish(),
            raised,
        })
    }

    /// Deletes the kernel (`DELETE /api/kernels/{id}`; one the gateway no longer has is
    /// deleted already) and removes it from the lease file. If the gateway cannot be told,
    /// the error says so and the lease stays, for [`crate::Gateway::reap_leases`].
    pub async fn close(mut self) -> Result<(), KernelError> {
        self.owned.delete().await.map(|_| ())
    }

    /// Waits until the kernel answers a `kernel_info_request`, within the start timeout.
    pub(crate) async fn ready(&mut self) -> Result<(), KernelError> {
        let timeout = self.owned.shared.start_timeout;
        let answered = async {
            let msg_id = self.send("kernel_info_request", json!({})).await?;
            loop {
                let message = self.receive().await?;
                if message.answers(&msg_id) && message.msg_type() == "kernel_info_reply" {
                    self.follow(None);
                    return Ok(());
                }
            }
        };
        match tokio::time::timeout(timeout, answered).await {
            Ok(answered) => answered,
            Err(_) => Err(KernelError::TimedOut {
                url: self.owned.shared.shown.clone(),
                request: format!("a kernel_info_request to kernel {}", self.owned.id),
                timeout,
            }),
        }
    }

    fn usable(&self) -> Result<(), KernelError> {
        let why = match (&self.lost, self.busy) {
            (Some(why), _) => why.clone(),
            (None, true) => "an earlier call on it was abandoned part-way (its future was \
                             dropped), so its state is unknown"
                .to_owned(),
            (None, false) => return Ok(()),
        };
        Err(KernelError::Lost {
            kernel: self.owned.id.clone(),
            why,
        })
    }

    /// Marks the kernel lost, for `why`.
    fn lose(&mut self, why: String) -> KernelError {
        self.lost = Some(why.clone());
        KernelError::Lost {
            kernel: self.owned.id.clone(),
            why,
        }
    }

    /// Passes on the answers to `msg_id` from now on (none: drop everything).
    fn follow(&self, msg_id: Option<&str>) {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = msg_id.map(str::to_owned);
    }

    /// Sends a request on the shell channel; returns its `msg_id`.
    async fn send(&mut self, msg_type: &str, content: Value) -> Result<String, KernelError> {
        self.sent += 1;
        let msg_id = format!("{}-{}", self.session, self.sent);
        let message = json!({
            "header": {
                "msg_id": msg_id,
                "msg_type": msg_type,
                "username": "async-grpo",
                "session": self.session,
                "date": now_iso8601(),
                "version": PROTOCOL_VERSION,
            },
            "parent_header": {},
            "metadata": {},
            "content": content,
            "buffers": [],
            "channel": "shell",
        });
        self.follow(Some(&msg_id));
        if self.requests.send(message.to_string()).await.is_err() {
            // The pump ended, after it said why (behind what it passed on before).
            loop {
                match self.events.recv().await {
                    Some(Event::Message(_)) => continue,
                    Some(Event::Lost(why)) => return Err(self.lose(why)),
                    None => return Err(self.lose("its connection ended".to_owned())),
                }
            }
        }
        Ok(msg_id)
    }

    /// The next message answering the current request.
    async fn receive(&mut self) -> Result<Incoming, KernelError> {
        match self.events.recv().await {
            Some(Event::Message(message)) => Ok(message),
            Some(Event::Lost(why)) => Err(self.lose(why)),
            None => Err(self.lose("its connection ended".to_owned())),
        }
    }
}

/// Reads the kernel's WebSocket until it closes or the kernel is dropped (answering pings as
/// it reads), sends the requests it is given, and passes on the messages that answer the
/// current request. It ends at the first sign that the kernel is lost, passing on why: the
/// socket closed or failed, a message that is not one, or a `status` of `dead` or
/// `restarting` (which the gateway sends with no parent).
async fn pump(
    mut socket: Socket,
    mut requests: mpsc::Receiver<String>,
    events: mpsc::Sender<Event>,
    current: Arc<Mutex<Option<String>>>,
) {
    let why = loop {
        tokio::select! {
            request = requests.recv() => {
                let Some(request) = request else {
                    // The kernel was dropped or closed.
                    return;
                };
                if let Err(error) = socket.send(Message::text(request)).await {
                    break format!("its WebSocket failed as a request was sent ({error})");
                }
            }
            frame = socket.next() => {
                let text = match frame {
                    None => break "its WebSocket closed".to_owned(),
                    Some(Err(error)) => break format!("its WebSocket failed ({error})"),
                    Some(Ok(Message::Text(text))) => text,
                    Some(Ok(Message::Close(frame))) => {
                        let said = frame
                            .map(|f| format!(": {} {}", u16::from(f.code), f.reason))
                            .unwrap_or_default();
                        break format!("the gateway closed its WebSocket{said}");
                    }
                    // Binary messages (the buffers of widget messages), pings, pongs.
                    Some(Ok(_)) => continue,
                };
                let message = match serde_json::from_str::<Incoming>(&text) {
                    Ok(message) => message,
                    Err(error) => {
                        break format!(
                            "it broke the Jupyter protocol (a message that is not one: {error})"
                        );
                    }
                };
                if let Some(why) = message.death() {
                    break why.to_owned();
                }
                let wanted = current
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_deref()
                    .is_some_and(|msg_id| message.answers(msg_id));
                if wanted && events.send(Event::Message(message)).await.is_err() {
                    return;
                }
            }
        }
    };
    let _ = events.send(Event::Lost(why)).await;
}

/// An `execute_result`'s or `display_data`'s plain-text form, else the kinds it has.
fn push_data(output: &mut Output, content: &Value) {
    let data = content.get("data");
    if let Some(text) = data
        .and_then(|d| d.get("text/plain"))
        .and_then(Value::as_str)
    {
        output.push(text);
        output.push("\n");
        return;
    }
    let kinds: Vec<&str> = data
        .and_then(Value::as_object)
        .map(|d| d.keys().map(String::as_str).take(8).collect())
        .unwrap_or_default();
    output.push(&format!("[a display with no text: {}]\n", kinds.join(", ")));
}

/// An `error`'s traceback, colour codes stripped; its name and value when it has none.
fn push_error(output: &mut Output, content: &Value) {
    let lines: Vec<&str> = content
        .get("traceback")
        .and_then(Value::as_array)
        .map(|lines| lines.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let text = if lines.is_empty() {
        let field = |name: &str| {
            content
                .get(name)
                .and_then(Value::as_str)
                .unwrap_or_default()
        };
        format!("{}: {}", field("ename"), field("evalue"))
    } else {
        lines.join("\n")
    };
    output.push(&strip_ansi(&text));
    output.push("\n");
}

/// A kernel the engine started: deleted when dropped unless [`Owned::delete`] ran.
pub(crate) struct Owned {
    pub(crate) shared: Arc<Shared>,
    id: String,
    /// In the lease file.
    pub(crate) leased: bool,
    /// Deleted, or being deleted by a caller that awaits it.
    done: bool,
}

impl Owned {
    pub(crate) fn new(shared: Arc<Shared>, id: String) -> Owned {
        Owned {
            shared,
            id,
            leased: false,
            done: false,
        }
    }

    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// Deletes the kernel now, then its lease. `Ok(false)`: the gateway no longer had it.
    pub(crate) async fn delete(&mut self) -> Result<bool, KernelError> {
        self.done = true;
        delete(&self.shared, &self.shared.http, &self.id, self.leased).await
    }
}

async fn delete(
    shared: &Shared,
    client: &reqwest::Client,
    id: &str,
    leased: bool,
) -> Result<bool, KernelError> {
    let had = shared.delete(client, id).await?;
    if leased
        && let Some(leases) = &shared.leases
        && let Err(error) = leases.release(id)
    {
        // The kernel is gone; a lease left behind only costs the next run one request.
        tracing::warn!(kernel = id, "{error}");
    }
    Ok(had)
}

impl Drop for Owned {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let id = std::mem::take(&mut self.id);
        let leased = self.leased;
        let deleting = self.shared.deleting.enter();
        let warn = |error: KernelError| {
            tracing::warn!("a kernel dropped without being closed could not be deleted: {error}");
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = delete(&shared, &shared.http, &id, leased).await {
                    warn(error);
                }
                drop(deleting);
            });
            return;
        }
        // No runtime: a thread of its own, with a client of its own (the shared one's
        // connections belong to a runtime that may be gone).
        let spawned = std::thread::Builder::new()
            .name("kernel-delete".to_owned())
            .spawn(move || {
                let deleted = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| KernelError::Invalid(format!("no runtime: {e}")))
                    .and_then(|runtime| {
                        let client = http_client()?;
                        runtime.block_on(delete(&shared, &client, &id, leased))
                    });
                if let Err(error) = deleted {
                    warn(error);
                }
                drop(deleting);
            });
        if let Err(error) = spawned {
            tracing::warn!("a kernel dropped without being closed could not be deleted: {error}");
        }
    }
}

/// A random id (128 bits, hex) for the engine's Jupyter session: from std's randomly keyed
/// hasher, the clock and the process.
pub(crate) fn random_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let half = |salt: u8| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(nanos);
        hasher.write_u32(std::process::id());
        hasher.write_u8(salt);
        hasher.finish()
    };
    format!("{:016x}{:016x}", half(0), half(1))
}

/// Now, as a message header's `date` (ISO 8601, UTC, microseconds).
fn now_iso8601() -> String {
    iso8601(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default(),
    )
}

fn iso8601(since_epoch: Duration) -> String {
    let secs = since_epoch.as_secs();
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since_epoch.subsec_micros()
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_iso8601() {
        assert_eq!(iso8601(Duration::ZERO), "1970-01-01T00:00:00.000000Z");
        assert_eq!(
            iso8601(Duration::from_micros(951_782_400_000_001)),
            "2000-02-29T00:00:00.000001Z"
        );
        assert_eq!(
            iso8601(Duration::from_secs(1_796_519_738)),
            "2026-12-06T01:15:38.000000Z"
        );
    }

    #[test]
    fn session_ids_differ() {
        assert_ne!(random_id(), random_id());
        assert_eq!(random_id().len(), 32);
    }

    #[test]
    fn a_display_without_text_names_its_kinds() {
        let mut output = Output::new(100);
        push_data(&mut output, &json!({"data": {"image/png": "…"}}));
        push_error(&mut output, &json!({"ename": "E", "evalue": "v"}));
        assert_eq!(
            output.finish(),
            "[a display with no text: image/png]\nE: v\n"
        );
    }
}

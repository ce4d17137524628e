//! [`Ledger`]: the groups of training rows an engine holds for its trainers until they are
//! acknowledged, the delivery core of a row stream (the transport, Arrow Flight, is built
//! on it).
//!
//! - **Positions.** Each group gets a position when it is pushed, `0, 1, 2, ...` in the
//!   order groups complete (from [`Ledger::starting_at`] for a run that resumes; the groups
//!   its earlier run delivered and no reader acknowledged come back with
//!   [`Ledger::restore`], at their positions, ahead of the new ones).
//! - **Each group to one reader.** Readers (a trainer's data-parallel ranks, or one trainer)
//!   take groups with [`Ledger::next`]; a group taken is leased to that reader, and no other
//!   reader gets it while the lease holds. The lowest position waiting is taken first.
//! - **Nothing lost.** A group stays the ledger's until its reader acknowledges it
//!   ([`Ledger::ack`], or [`Ledger::ack_through`] for every group it holds up to a position).
//!   A reader that goes away ([`Ledger::release`]: its connection closed) gives its leased
//!   groups back, and they are delivered again, first, to whoever reads next.
//! - **Nothing duplicated.** An acknowledged group is gone: no reader gets it again, and a
//!   second acknowledgement of it is an error, as is one from a reader that does not hold it.
//! - **Bounded.** At most `capacity` groups are held unacknowledged (waiting or leased);
//!   [`Ledger::push`] waits for room, so that when no one reads, the engine's admission
//!   stops (the same backpressure as a slow output file) and memory does not grow.
//! - **An end.** After [`Ledger::close`] no group is pushed; readers get what is left, then
//!   `None` once every group delivered is acknowledged (until then a group another reader
//!   holds may come back).
//!
//! ```
//! use async_grpo_stream::{Ledger, Reader};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let ledger = Ledger::new(8);
//! ledger.push("group a").await.unwrap();
//! ledger.push("group b").await.unwrap();
//! let (first, second) = (Reader(1), Reader(2));
//! let (position, group) = ledger.next(first).await.unwrap();
//! assert_eq!((position, group), (0, "group a"));
//! assert_eq!(ledger.next(second).await.unwrap(), (1, "group b"));
//! ledger.release(second); // rank 2's connection closed before it acknowledged
//! ledger.ack(first, 0).unwrap();
//! assert_eq!(ledger.next(first).await.unwrap(), (1, "group b")); // delivered again
//! # });
//! ```

#[cfg(feature = "flight")]
pub mod flight;

use std::{
    collections::{BTreeMap, VecDeque},
    sync::Mutex,
};

use tokio::sync::Notify;

/// A reader of the ledger: one connection of a trainer (a rank), named by whoever serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Reader(pub u64);

/// A group's place in the stream.
pub type Position = u64;

/// What the ledger refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The ledger is closed: no group is pushed any more.
    #[error("the row stream is closed")]
    Closed,
    /// An acknowledgement of a group the reader does not hold: acknowledged already, leased
    /// to another reader, never delivered, or given back when its reader went away.
    #[error("group {position} is not held by reader {reader}")]
    NotHeld {
        /// The reader that acknowledged.
        reader: u64,
        /// The group it named.
        position: Position,
    },
    /// A group restored at a position that is not an earlier run's, or that the ledger holds.
    #[error("group {position} cannot be restored: it is not an earlier group, or is held")]
    NotRestorable {
        /// The position given.
        position: Position,
    },
}

/// The groups held for the readers: see the [crate] documentation.
#[derive(Debug)]
pub struct Ledger<G> {
    state: Mutex<State<G>>,
    /// Signalled when a group is waiting, or the ledger closed.
    waiting: Notify,
    /// Signalled when a group is acknowledged (room for one more).
    room: Notify,
}

#[derive(Debug)]
struct State<G> {
    capacity: usize,
    /// The position the next group pushed gets.
    next: Position,
    /// Groups no reader holds, lowest position first.
    waiting: VecDeque<(Position, G)>,
    /// Groups delivered and not yet acknowledged.
    leased: BTreeMap<Position, (Reader, G)>,
    closed: bool,
}

impl<G> State<G> {
    fn held(&self) -> usize {
        self.waiting.len() + self.leased.len()
    }
}

/// How many groups a [`Ledger`] holds and where the stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LedgerStats {
    /// Groups pushed and not yet delivered (or given back).
    pub waiting: usize,
    /// Groups delivered and not yet acknowledged.
    pub leased: usize,
    /// The position the next group pushed gets.
    pub next: Position,
}

impl<G: Clone> Ledger<G> {
    /// A ledger holding at most `capacity` unacknowledged groups (at least 1), its first group
    /// at position 0.
    pub fn new(capacity: usize) -> Ledger<G> {
        Ledger::starting_at(capacity, 0)
    }

    /// A ledger whose first group gets position `next`: a resumed run's, whose earlier groups
    /// the trainer acknowledged.
    pub fn starting_at(capacity: usize, next: Position) -> Ledger<G> {
        Ledger {
            state: Mutex::new(State {
                capacity: capacity.max(1),
                next,
                waiting: VecDeque::new(),
                leased: BTreeMap::new(),
                closed: false,
            }),
            waiting: Notify::new(),
            room: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<G>> {
        // No code panics holding the lock; a poisoned one still holds consistent state.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds a group, waiting while `capacity` groups are held unacknowledged; its position.
    pub async fn push(&self, group: G) -> Result<Position, LedgerError> {
        self.admit(group, None).await
    }

    /// Gives back a group an earlier run of the stream delivered and no reader acknowledged,
    /// at its `position` (below the one [`Ledger::starting_at`] was given), waiting as
    /// [`Ledger::push`] does: a resumed run serves them again, lowest first, ahead of its own.
    /// A position pushed or restored already is refused.
    pub async fn restore(&self, position: Position, group: G) -> Result<(), LedgerError> {
        self.admit(group, Some(position)).await.map(|_| ())
    }

    async fn admit(&self, group: G, at: Option<Position>) -> Result<Position, LedgerError> {
        let mut group = Some(group);
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut state = self.lock();
                if state.closed {
                    return Err(LedgerError::Closed);
                }
                if let Some(position) = at {
                    let held = state.leased.contains_key(&position)
                        || state.waiting.iter().any(|(p, _)| *p == position);
                    if position >= state.next || held {
                        return Err(LedgerError::NotRestorable { position });
                    }
                }
                if state.held() < state.capacity {
                    let position = at.unwrap_or(state.next);
                    if at.is_none() {
                        state.next += 1;
                    }
                    if let Some(group) = group.take() {
                        // Waiting stays in position order: a restored group goes before
                        // every later one.
                        let index = state.waiting.partition_point(|(p, _)| *p < position);
                        state.waiting.insert(index, (position, group));
                    }
                    drop(state);
                    self.waiting.notify_waiters();
                    return Ok(position);
                }
            }
            room.await;
        }
    }

    /// The next group for `reader`, leased to it, waiting for one; `None` once the ledger is
    /// closed and every group is acknowledged.
    pub async fn next(&self, reader: Reader) -> Option<(Position, G)> {
        loop {
            let waiting = self.waiting.notified();
            tokio::pin!(waiting);
            waiting.as_mut().enable();
            {
                let mut state = self.lock();
                if let Some((position, group)) = state.waiting.pop_front() {
                    state.leased.insert(position, (reader, group.clone()));
                    return Some((position, group));
                }
                // Closed: the end only once every group is acknowledged, since a group another
                // reader holds comes back if that reader goes away.
                if state.closed && state.leased.is_empty() {
                    return None;
                }
            }
            waiting.await;
        }
    }

    /// Acknowledges the group at `position`, which `reader` holds: it is gone for good.
    pub fn ack(&self, reader: Reader, position: Position) -> Result<(), LedgerError> {
        let mut state = self.lock();
        match state.leased.get(&position) {
            Some((holder, _)) if *holder == reader => {
                state.leased.remove(&position);
                drop(state);
                self.acknowledged();
                Ok(())
            }
            _ => Err(LedgerError::NotHeld {
                reader: reader.0,
                position,
            }),
        }
    }

    /// Acknowledges every group `reader` holds up to `position` included; their positions,
    /// lowest first.
    pub fn ack_through(&self, reader: Reader, position: Position) -> Vec<Position> {
        let mut state = self.lock();
        let mine: Vec<Position> = state
            .leased
            .range(..=position)
            .filter(|(_, (holder, _))| *holder == reader)
            .map(|(position, _)| *position)
            .collect();
        for position in &mine {
            state.leased.remove(position);
        }
        drop(state);
        if !mine.is_empty() {
            self.acknowledged();
        }
        mine
    }

    /// `reader` went away: the groups it holds wait again, in position order, ahead of those
    /// never delivered; how many.
    pub fn release(&self, reader: Reader) -> usize {
        let mut state = self.lock();
        let given_back: Vec<Position> = state
            .leased
            .iter()
            .filter(|(_, (holder, _))| *holder == reader)
            .map(|(position, _)| *position)
            .collect();
        let mut back = Vec::with_capacity(given_back.len());
        for position in &given_back {
            if let Some((_, group)) = state.leased.remove(position) {
                back.push((*position, group));
            }
        }
        // The waiting queue stays in position order: a group given back is older than any
        // group never delivered, but may be younger than one given back before.
        let mut merged: Vec<(Position, G)> = state.waiting.drain(..).chain(back).collect();
        merged.sort_by_key(|(position, _)| *position);
        state.waiting = merged.into();
        drop(state);
        if !given_back.is_empty() {
            self.waiting.notify_waiters();
        }
        given_back.len()
    }

    /// A group was acknowledged: room for a push, and perhaps the end for readers of a
    /// closed ledger.
    fn acknowledged(&self) {
        self.room.notify_waiters();
        self.waiting.notify_waiters();
    }

    /// No group is pushed from now on; readers get what is left, then `None` once every
    /// group delivered is acknowledged.
    pub fn close(&self) {
        self.lock().closed = true;
        self.waiting.notify_waiters();
        self.room.notify_waiters();
    }

    /// Waits until the ledger holds no group: every group pushed is acknowledged (the end of
    /// a stream whose pushes are over; a push after it holds a group again).
    pub async fn settled(&self) {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.lock().held() == 0 {
                return;
            }
            room.await;
        }
    }

    /// What the ledger holds now.
    pub fn stats(&self) -> LedgerStats {
        let state = self.lock();
        LedgerStats {
            waiting: state.waiting.len(),
            leased: state.leased.len(),
            next: state.next,
        }
    }
}

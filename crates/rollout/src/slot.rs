//! The rollout task's slot for its open episode ([`EpisodeSlot`]), so that an episode is
//! closed exactly once whatever way its attempt ended.

use std::fmt;

use tokio::sync::{MappedMutexGuard, MutexGuard};

use crate::Episode;

/// The rollout task's slot for its open episode: the attempt borrows the episode in it
/// ([`Lease`]) and whatever way the attempt ends (the lease dropped, or unwound), the
/// episode is still there for the task to close.
#[derive(Default)]
pub(crate) struct EpisodeSlot(tokio::sync::Mutex<Option<Box<dyn Episode>>>);

impl fmt::Debug for EpisodeSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let open = match self.0.try_lock() {
            Ok(slot) => {
                if slot.is_some() {
                    "open"
                } else {
                    "empty"
                }
            }
            Err(_) => "leased",
        };
        f.debug_tuple("EpisodeSlot").field(&open).finish()
    }
}

impl EpisodeSlot {
    /// Puts `episode` in the slot and lends it to the attempt until the lease drops.
    pub(crate) async fn lease(&self, episode: Box<dyn Episode>) -> Lease<'_> {
        let slot = self.0.lock().await;
        Lease(MutexGuard::map(slot, |slot| slot.insert(episode)))
    }

    /// Closes the episode left in the slot, if any.
    pub(crate) async fn close(&self) {
        let episode = self.0.lock().await.take();
        if let Some(episode) = episode {
            episode.close().await;
        }
    }
}

/// An episode on loan from its [`EpisodeSlot`]: the slot's lock, held until the attempt ends
/// (returns, is dropped, or unwinds).
pub(crate) struct Lease<'a>(MappedMutexGuard<'a, Box<dyn Episode>>);

impl Lease<'_> {
    pub(crate) fn get(&self) -> &dyn Episode {
        self.0.as_ref()
    }

    pub(crate) fn get_mut(&mut self) -> &mut dyn Episode {
        self.0.as_mut()
    }
}

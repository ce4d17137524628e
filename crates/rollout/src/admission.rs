//! Admission: one group per dataset row while output slots, in-flight slots and rows last.

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use rollout_core::RolloutId;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::{
    DatasetError, Generator, ScoredGroup, conversation, group,
    group::GroupState,
    health::Counters,
    lock,
    shared::{ReadOk, ReadRow, Shared},
};

/// Admission: one group per row while output slots, in-flight slots and rows last.
pub(crate) async fn admit<G: Generator>(
    shared: Arc<Shared<G>>,
    mut rows: mpsc::Receiver<ReadRow>,
    output: mpsc::Sender<ScoredGroup>,
) {
    let config = &shared.config;
    let n = config.num_generations;
    let first_version = shared.control.model_version();
    let mut admitted = 0u64;
    loop {
        if config.max_groups.is_some_and(|max| admitted >= max) {
            break;
        }
        if !admission_open(&shared, admitted, first_version).await {
            break;
        }
        if !wait_for_generator(&shared).await {
            break;
        }
        // The group's output slot first: a consumer that falls behind holds admission here.
        let slot = tokio::select! {
            biased;
            () = shared.control.admission.cancelled() => break,
            slot = output.clone().reserve_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let Some((group_id, row, first)) = next_row(&shared, &mut rows).await else {
            break;
        };
        Counters::add(&shared.tallies.counters.groups_admitted, 1);
        let group = Arc::new(GroupState::new(group_id, row, first, n, slot));
        if !start_group(&shared, group).await {
            break;
        }
        admitted += 1;
    }
    shared
        .control
        .admission_closed
        .store(true, Ordering::Release);
}

/// Waits until a group may be admitted: admission not paused, and with `max_staleness` and
/// `groups_per_version`, AReaL's rule (the `admitted`-th group, from 0, could still be
/// trained on within the staleness bound: `admitted < (versions since the start +
/// max_staleness + 1) * groups_per_version`). False when admission closes meanwhile.
pub(crate) async fn admission_open<G>(
    shared: &Shared<G>,
    admitted: u64,
    first_version: u64,
) -> bool {
    let mut paused = shared.control.paused.subscribe();
    let mut versions = shared.control.versions.subscribe();
    loop {
        let held = *paused.borrow_and_update();
        let version = *versions.borrow_and_update();
        if !held && shared.fresh_enough(admitted, version.saturating_sub(first_version)) {
            return true;
        }
        // The senders live in `shared`: neither channel closes while this runs.
        tokio::select! {
            biased;
            () = shared.control.admission.cancelled() => return false,
            _ = paused.changed() => {}
            _ = versions.changed() => {}
        }
    }
}

/// `permits` in-flight slots, once admission is not paused; `None` when admission closes.
/// A pause that comes while it waits holds it again.
pub(crate) async fn acquire<G>(shared: &Shared<G>, permits: u32) -> Option<OwnedSemaphorePermit> {
    let mut paused = shared.control.paused.subscribe();
    loop {
        if *paused.borrow_and_update() {
            tokio::select! {
                biased;
                () = shared.control.admission.cancelled() => return None,
                _ = paused.changed() => continue,
            }
        }
        let closed = tokio::select! {
            biased;
            () = shared.control.admission.cancelled() => true,
            _ = paused.changed() => false,
            acquired = Arc::clone(&shared.control.in_flight).acquire_many_owned(permits) => return acquired.ok(),
        };
        // The acquire given up gave back what it held: tokio's semaphore hands a freed
        // permit to a queued waiter before making it available, so a group waiting for its
        // slots holds some while no rollout runs in them, and they count as in flight until
        // now. A pause waiting for the count to reach 0 must look again: the last rollout
        // may have ended (and notified) while its slot was held here.
        shared.control.slot_freed.notify_waiters();
        if closed {
            return None;
        }
    }
}

/// The next dataset row to admit, its prompt rendered; bad rows skipped with
/// `skip_bad_rows`. `None` at the end of the dataset, on an error (recorded) or when
/// admission closes.
pub(crate) async fn next_row<G>(
    shared: &Shared<G>,
    rows: &mut mpsc::Receiver<ReadRow>,
) -> Option<ReadOk> {
    loop {
        let next = tokio::select! {
            biased;
            () = shared.control.admission.cancelled() => return None,
            next = rows.recv() => next?,
        };
        match next {
            Ok(read) => return Some(read),
            Err(error)
                if shared.config.skip_bad_rows && matches!(error, DatasetError::Row { .. }) =>
            {
                Counters::add(&shared.tallies.counters.bad_rows, 1);
                tracing::warn!(%error, "skipping a bad dataset row");
                let mut bad = lock(&shared.tallies.bad_rows);
                if bad.len() < 100 {
                    bad.push(error.to_string());
                }
            }
            Err(error) => {
                tracing::error!(%error, "stopping admission");
                *lock(&shared.control.error) = Some(error.to_string());
                return None;
            }
        }
    }
}

/// Starts a group's rollouts as slots in flight free up. `false` when admission closed
/// before every rollout started (the rest are cancelled, and the group finished if none
/// runs).
pub(crate) async fn start_group<G: Generator>(
    shared: &Arc<Shared<G>>,
    group: Arc<GroupState>,
) -> bool {
    let n = shared.config.num_generations;
    let base = group.group_id * n as u64;
    shared.tallies.queued.fetch_add(n, Ordering::Relaxed);
    // A group that fits takes its slots all at once, so that a drain never finds it half
    // started (its started rollouts would be thrown away with it); a group larger than
    // `max_inflight` can only start rollout by rollout.
    let mut whole = None;
    if let Ok(count) = u32::try_from(n)
        && n <= shared.config.max_inflight
    {
        whole = acquire(shared, count).await;
    }
    for index in 0..n {
        let permit = match whole.as_mut() {
            Some(permits) if index + 1 < n => permits.split(1),
            Some(_) => whole.take(),
            None => acquire(shared, 1).await,
        };
        let Some(permit) = permit else {
            shared
                .tallies
                .queued
                .fetch_sub(n - index, Ordering::Relaxed);
            Counters::add(
                &shared.tallies.counters.rollouts_cancelled,
                (n - index) as u64,
            );
            // Even with no rollout started the group must be finished: that counts it as
            // cancelled, so admitted groups always add up.
            if group.abandon_from(index, base) {
                group::finish(shared, &group).await;
            }
            return false;
        };
        shared.tallies.queued.fetch_sub(1, Ordering::Relaxed);
        let rollout_shared = Arc::clone(shared);
        let group = Arc::clone(&group);
        shared.control.tracker.spawn(async move {
            let shared = rollout_shared;
            let rollout_id = RolloutId(base + index as u64);
            let outcome = conversation::run(&shared, &group, rollout_id).await;
            drop(permit);
            shared.control.slot_freed.notify_waiters();
            shared.wiring.generator.release(rollout_id);
            shared.rollout_ended(&outcome);
            if group.complete(index, outcome) {
                group::finish(&shared, &group).await;
            }
        });
    }
    true
}

/// Waits while the generator says no server can take requests, saying so every few seconds.
/// False when the run must stop: admission was cancelled, or the wait passed `server_wait`.
pub(crate) async fn wait_for_generator<G: Generator>(shared: &Shared<G>) -> bool {
    let Some(mut reason) = shared.wiring.generator.unavailable() else {
        return true;
    };
    let wait = shared.config.server_wait;
    let started = Instant::now();
    let mut said = started;
    tracing::warn!(%reason, ?wait, "no server can take requests: admission paused until one answers");
    loop {
        tokio::select! {
            biased;
            () = shared.control.admission.cancelled() => return false,
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        match shared.wiring.generator.unavailable() {
            None => {
                tracing::info!(waited = ?started.elapsed(), "a server answers again: admission resumes");
                return true;
            }
            Some(now) => reason = now,
        }
        if started.elapsed() >= wait {
            shared.control.stop_run(format!(
                "no server could take requests for {wait:?} (server_wait); the last error: {reason}"
            ));
            return false;
        }
        if said.elapsed() >= Duration::from_secs(5) {
            said = Instant::now();
            tracing::warn!(%reason, waited = ?started.elapsed(), ?wait, "still no server: admission paused");
        }
    }
}

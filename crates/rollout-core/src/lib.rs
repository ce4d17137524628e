//! Conversations for RL of language models: from messages to training rows.
//!
//! - **Turn records and the reconciler** ([`TurnRecord`], [`Reconciler`]): each model call is
//!   recorded as the exact prompt ids sent, the ids sampled, their log-probs and the model
//!   version. The reconciler turns a conversation's turns into [`TrainingRow`]s
//!   (`input_ids`, `completion_mask`, `old_log_probs`), classifying each turn boundary as
//!   clean, realigned or forked, and counting drift.

mod reconcile;
mod turn;

pub use crate::{
    reconcile::{
        ReconcileError, Reconciled, Reconciler, ReconcilerConfig, RolloutId, Tally, TrainingRow,
        Transition, reconcile,
    },
    turn::TurnRecord,
};

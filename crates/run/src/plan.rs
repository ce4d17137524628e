//! [`PlanSpec`]: which groups a run rolls out, by one rule for every adapter: passes over the
//! dataset (bounded, or until the run is stopped), shuffled or not, one shard or all, less
//! the groups a resumed output holds, at most `max_groups` of the whole run.

use std::collections::HashSet;

use files::{Shard, data::Plan};

/// What a run asks of its dataset: how many passes, in which order, which shard, how many
/// groups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanSpec {
    /// Passes over the dataset; `None` rolls out until the run is stopped (as many passes as
    /// group ids, `epoch * rows + position`, can number, which no run reaches).
    pub epochs: Option<u64>,
    /// The seed of the shuffle, when each pass takes the rows in an order of its own.
    pub shuffle: Option<u64>,
    /// The one shard rolled out, if not all.
    pub shard: Option<Shard>,
    /// At most this many groups in the whole run: those a resumed output holds count.
    pub max_groups: Option<u64>,
}

/// The groups a run rolls out: its [`Plan`], and how many.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// The passes, less the groups done.
    pub plan: Plan,
    /// `max_groups` less the groups done: what the loop may still admit.
    pub max_groups: Option<u64>,
    /// The groups this run will roll out, when the plan is bounded (`epochs` or
    /// `max_groups` given); `None` when it runs until stopped.
    pub total: Option<u64>,
}

/// A plan no run can roll out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The dataset holds no row.
    #[error("the dataset holds no row to roll out")]
    NoRows,
    /// No row of the dataset falls in the shard: every pass would be empty.
    #[error(
        "shard {shard} holds no row of a dataset of {rows} rows (it holds the rows whose index \
         modulo {} is {})",
        shard.count,
        shard.index
    )]
    EmptyShard {
        /// The shard asked for.
        shard: Shard,
        /// The rows the dataset holds.
        rows: u64,
    },
    /// Zero passes.
    #[error("epochs must be at least 1")]
    NoEpochs,
}

impl PlanSpec {
    /// The plan over a dataset of `rows` rows, less the groups `done` (what a resumed output
    /// holds).
    ///
    /// # Errors
    ///
    /// A dataset without rows, zero passes, or a shard that holds none of the rows.
    pub fn plan(&self, rows: u64, done: &HashSet<u64>) -> Result<RunPlan, PlanError> {
        if rows == 0 {
            return Err(PlanError::NoRows);
        }
        if self.epochs == Some(0) {
            return Err(PlanError::NoEpochs);
        }
        if let Some(shard) = self.shard
            && shard.index >= rows
        {
            return Err(PlanError::EmptyShard { shard, rows });
        }
        let max_groups = self.max_groups.map(|n| n.saturating_sub(done.len() as u64));
        let epochs = self.epochs.unwrap_or(u64::MAX / rows);
        let plan = Plan::new(rows, epochs, self.shuffle, self.shard, done.clone());
        // An unbounded plan is a lazy iterator: nothing counts its groups (that would go
        // through every pass).
        let total = match (self.epochs, max_groups) {
            (Some(_), max) => {
                let planned = plan.groups();
                Some(max.map_or(planned, |max| max.min(planned)))
            }
            (None, max) => max,
        };
        Ok(RunPlan {
            plan,
            max_groups,
            total,
        })
    }
}

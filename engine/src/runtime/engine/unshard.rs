//! The unshard schedule: before each stage of forward and backward (the plan's
//! `Schedule::forward` / `Schedule::backward` positions), the units the plan keeps alive are
//! made unsharded and the others resharded; the next units' all-gathers are started early
//! (prefetch) so they overlap this stage's compute.

use super::RankEngine;
use crate::error::Result;
use crate::runtime::staged::StagedModel;

impl<M: StagedModel + ?Sized> RankEngine<'_, M> {
    /// Makes exactly the units in `alive` unsharded (or unsharding): reshards the others first
    /// (so live bytes never exceed either position), makes `first` unsharded — waiting for its
    /// prefetched all-gather, or gathering it now — then starts the all-gathers of the other
    /// alive units, `prefetch` (the schedule's issue order) first; they run on the
    /// communicator's progress thread while `first` computes.
    pub(super) fn transition_to(
        &mut self,
        alive: &[usize],
        first: Option<usize>,
        prefetch: &[usize],
    ) -> Result<()> {
        for u in 0..self.units.len() {
            if !alive.contains(&u) {
                self.units[u].reshard(&mut self.comm, &mut self.ledger)?;
            }
        }
        if let Some(f) = first {
            let unit = &mut self.units[f];
            if unit.is_unsharding() {
                unit.finish_unshard(&mut self.comm)?;
            } else if !unit.is_unsharded() {
                unit.unshard(&mut self.comm, &mut self.ledger)?;
            }
        }
        let order = prefetch
            .iter()
            .chain(alive.iter())
            .copied()
            .filter(|&u| Some(u) != first);
        for u in order {
            let unit = &mut self.units[u];
            if !unit.is_unsharded() && !unit.is_unsharding() {
                unit.start_unshard(&mut self.comm, &mut self.ledger)?;
            }
        }
        Ok(())
    }
}

//! Ordered walks of the metadata table: a batch of ids is sorted once and the table walked once
//! per run of near ids, instead of searched once per id (block tables of long sequences are read
//! and touched every decode step).

use super::BlockStore;
use crate::block::{BlockId, Tier};
use crate::error::{KvError, KvResult};
use crate::metadata::BlockMeta;

impl BlockStore {
    /// The positions of `ids` sorted by id (ties in input order), once every id is checked
    /// live (and, unless `repeats`, distinct) by one ordered walk of the table. Errors as
    /// [`Self::lookup`] and `DuplicateBlock`.
    pub(super) fn sorted_live(&self, ids: &[BlockId], repeats: bool) -> KvResult<Vec<usize>> {
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&i| (ids[i], i));
        let mut prev = None;
        for run in id_runs(ids, &order) {
            let mut walk = self
                .meta
                .range(ids[order[run.start]], ids[order[run.end - 1]])
                .map(|(&id, _)| id)
                .peekable();
            for &i in &order[run] {
                let id = ids[i];
                if prev == Some(id) {
                    if repeats {
                        continue;
                    }
                    return Err(KvError::DuplicateBlock { id });
                }
                prev = Some(id);
                while walk.next_if(|&k| k < id).is_some() {}
                if walk.peek() != Some(&id) {
                    self.lookup(id)?;
                }
            }
        }
        Ok(order)
    }

    /// The slots of `ids`, which must all be live, distinct and in `tier`.
    pub(crate) fn slots_in(&self, ids: &[BlockId], tier: Tier) -> KvResult<Vec<u32>> {
        // Ordered walks over runs of near ids (block tables of long sequences are read every
        // decode step; a batch's tables interleave, see `id_runs`).
        let order = self.sorted_live(ids, false)?;
        let mut slots = vec![0u32; ids.len()];
        for run in id_runs(ids, &order) {
            let mut walk = self
                .meta
                .range(ids[order[run.start]], ids[order[run.end - 1]])
                .peekable();
            for &i in &order[run] {
                let id = ids[i];
                while walk.next_if(|(k, _)| **k < id).is_some() {}
                let meta = match walk.peek() {
                    Some((_, meta)) => *meta,
                    None => self.lookup(id)?,
                };
                if meta.tier != tier {
                    return Err(KvError::WrongTier {
                        id,
                        expected: tier,
                        actual: meta.tier,
                    });
                }
                slots[i] = meta.slot;
            }
        }
        Ok(slots)
    }

    /// Calls `f(i, meta)` for each index `i` of `order` (indices into `ids`, sorted by id, from
    /// `sorted_live`) with `ids[i]`'s metadata (`None` if it is not live), walking the table once
    /// per run of near ids (`id_runs`) instead of searching it once per id.
    pub(super) fn walk_sorted_mut(
        &mut self,
        ids: &[BlockId],
        order: &[usize],
        mut f: impl FnMut(usize, Option<&mut BlockMeta>) -> KvResult<()>,
    ) -> KvResult<()> {
        for run in id_runs(ids, order) {
            let mut walk = self
                .meta
                .range_mut(ids[order[run.start]], ids[order[run.end - 1]]);
            let mut cur = walk.next();
            for &i in &order[run] {
                while cur.as_ref().is_some_and(|(id, _)| **id < ids[i]) {
                    cur = walk.next();
                }
                let meta = cur
                    .as_mut()
                    .filter(|(id, _)| **id == ids[i])
                    .map(|(_, meta)| &mut **meta);
                f(i, meta)?;
            }
        }
        Ok(())
    }
}

/// Ids further apart than this start a new run in [`id_runs`].
const RUN_GAP: u64 = 64;

/// `order` (indices into `ids`, sorted by id) cut where two successive ids are more than
/// [`RUN_GAP`] apart: ranges of `order`, each walked through the metadata table on its own. A
/// sequence's table is its prompt's blocks (allocated together) and the blocks its decode steps
/// added one by one between other sequences' — one walk from its first id to its last would step
/// over every block allocated in between; a walk a run costs the run plus one tree descent.
fn id_runs(ids: &[BlockId], order: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    for k in 1..order.len() {
        if ids[order[k]].0.saturating_sub(ids[order[k - 1]].0) > RUN_GAP {
            runs.push(start..k);
            start = k;
        }
    }
    if !order.is_empty() {
        runs.push(start..order.len());
    }
    runs
}

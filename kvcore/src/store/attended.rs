//! What attention read: the blocks a step touched (`last_attended`, `attended`) and the
//! softmax mass it gave them (`mass`, `mass_at`), folded into their metadata.

use super::BlockStore;
use crate::block::BlockId;
use crate::error::{KvError, KvResult};

impl BlockStore {
    /// Marks blocks as just attended (eviction prefers older `last_attended`).
    pub fn touch(&mut self, ids: &[BlockId]) -> KvResult<()> {
        // One ordered walk of the table instead of a tree search per id (a decode step touches
        // every block of every running sequence): the ids sorted once, each occurrence keeping
        // the tick of its position in `ids`, as if they were touched one after another.
        let order = self.sorted_live(ids, true)?;
        let first = self.meta.ticks(ids.len() as u64);
        self.walk_sorted_mut(ids, &order, |i, meta| {
            if let Some(meta) = meta {
                meta.last_attended = first + i as u64;
                meta.attended = meta.attended.saturating_add(1);
            }
            Ok(())
        })
    }

    /// Folds one decode step's attention mass into the blocks' metadata: `mass[i]` (what
    /// [`Self::attention_mass`] gives `ids[i]`) into a decayed average with weight `weight`
    /// (`avg ← (1 − weight)·avg + weight·mass`), and the current tick as the block's `mass_at`
    /// when `mass[i] ≥ threshold` (with the step's number, [`crate::BlockMetadataTable::steps`],
    /// as its `read_step`).
    pub fn record_mass(
        &mut self,
        ids: &[BlockId],
        mass: &[f32],
        weight: f32,
        threshold: f32,
    ) -> KvResult<()> {
        if ids.len() != mass.len() {
            return Err(KvError::RowWidth {
                expected: ids.len(),
                got: mass.len(),
            });
        }
        // Every id checked first, so that an unknown one changes nothing.
        let order = self.sorted_live(ids, true)?;
        let now = self.meta.ticks(1);
        let step = self.meta.next_step();
        let weight = weight.clamp(0.0, 1.0);
        self.walk_sorted_mut(ids, &order, |i, meta| {
            let Some(meta) = meta else {
                return Err(KvError::UnknownBlock { id: ids[i] });
            };
            let m = mass[i];
            meta.mass = (1.0 - weight) * meta.mass + weight * m;
            if m >= threshold {
                meta.mass_at = now;
                meta.read_step = step;
                meta.reads = meta.reads.saturating_add(1);
            }
            Ok(())
        })
    }

    /// Halves every live block's `reads` and `attended` (rounding down): the counts' aging, so
    /// that what a block was used for long ago weighs half as much as what it is used for now
    /// after each halving. An engine halves them every so many forward steps; the order of the
    /// blocks' counts is kept (ties may appear), and uses after it weigh double against those
    /// before it. Masses, ticks and steps are untouched.
    pub fn halve_counts(&mut self) {
        for meta in self.meta.values_mut() {
            meta.reads /= 2;
            meta.attended /= 2;
        }
    }

    /// Adds earlier lives' counts to a live block's: `reads` to [`crate::BlockMeta::reads`]
    /// and `attended` to [`crate::BlockMeta::attended`]. A block recomputed with the same
    /// content (same chained hash) carries how often the model read that content, and how many
    /// steps it was attended at all, before it was dropped, so both frequencies survive a
    /// conversation's end and a cold-tier drop. Its mass, `mass_at`, `read_step` and
    /// `last_attended` are its own.
    pub fn carry_counts(&mut self, id: BlockId, reads: u32, attended: u32) -> KvResult<()> {
        let meta = self.meta.get_mut(id).ok_or(KvError::UnknownBlock { id })?;
        meta.reads = meta.reads.saturating_add(reads);
        meta.attended = meta.attended.saturating_add(attended);
        Ok(())
    }
}

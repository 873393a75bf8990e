//! Copying stored codes between positions of block tables (relocated segment reuse, issue 26).

use super::hot::HotStorage;
use crate::{BlockId, BlockStore, KvError, KvResult, Tier};

impl BlockStore {
    /// Copies the stored codes of `n` tokens — every layer, keys and values, bytes as written,
    /// nothing re-encoded — from positions `src_start..` of the block table `src` to positions
    /// `dst_start..` of `dst` (position `t` is row `t % block_size` of block
    /// `table[t / block_size]`), which is how a segment cached at one position is reused at
    /// another whose block alignment differs. `shift` (destination minus source position) is
    /// recorded on the destination blocks; each source block counts one relocation.
    ///
    /// Sources may be hot or cold, destinations must be writable by the CPU (the host hot tier
    /// or the cold tier); neither may be down-tiered, and no block may be on both sides.
    /// Nothing is written on error.
    pub fn copy_tokens(
        &mut self,
        src: &[BlockId],
        src_start: usize,
        dst: &[BlockId],
        dst_start: usize,
        n: usize,
        shift: i64,
    ) -> KvResult<()> {
        let bs = self.layout.shape.block_size;
        for (table, start) in [(src, src_start), (dst, dst_start)] {
            if n == 0 || start + n > table.len() * bs {
                return Err(KvError::TokenRange {
                    start,
                    end: start + n,
                    capacity: table.len() * bs,
                });
            }
        }
        let (src, dst) = (
            &src[src_start / bs..(src_start + n).div_ceil(bs)],
            &dst[dst_start / bs..(dst_start + n).div_ceil(bs)],
        );
        let both: Vec<BlockId> = src.iter().chain(dst).copied().collect();
        self.check_unique_live(&both)?;
        self.check_not_reduced(&both)?;
        let (from, to) = (self.resident(src)?, self.resident(dst)?);
        if to.iter().any(|&(t, _)| t == Tier::Hot) {
            self.hot.host_mut()?;
        }
        if from.iter().any(|&(t, _)| t == Tier::Hot) {
            self.hot.host()?;
        }
        // A staged copy of a destination would hold the bytes from before.
        self.unstage(dst);
        let shape = self.layout.shape;
        let (layers, kv_heads) = (shape.layers, shape.kv_heads);
        let (s0, d0) = (
            src_start - src_start / bs * bs,
            dst_start - dst_start / bs * bs,
        );
        let mut row: [Vec<u8>; 4] = Default::default();
        for layer in 0..layers {
            for t in 0..n {
                let (sb, si) = ((s0 + t) / bs, (s0 + t) % bs);
                let (db, di) = ((d0 + t) / bs, (d0 + t) % bs);
                for h in 0..kv_heads {
                    let (tier, slot) = from[sb];
                    let source = match tier {
                        Tier::Hot => self.hot.host()?,
                        _ => &self.cold,
                    };
                    for (buf, part) in
                        row.iter_mut()
                            .zip(source.row(layer, slot, shape.row_in_block(si, h)))
                    {
                        buf.clear();
                        buf.extend_from_slice(part);
                    }
                    let (tier, slot) = to[db];
                    let target = match tier {
                        Tier::Hot => self.hot.host_mut()?,
                        _ => &mut self.cold,
                    };
                    let (kc, vc, kn, vn) = target.row_mut(layer, slot, shape.row_in_block(di, h));
                    for (part, buf) in [kc, vc, kn, vn].into_iter().zip(&row) {
                        part.copy_from_slice(buf);
                    }
                }
            }
        }
        for &id in src {
            if let Some(m) = self.meta.get_mut(id) {
                m.relocations = m.relocations.saturating_add(1);
            }
        }
        for &id in dst {
            if let Some(m) = self.meta.get_mut(id) {
                m.shift = shift;
            }
        }
        Ok(())
    }
}

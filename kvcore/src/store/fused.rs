//! Block fusion: a cold pool where blocks of one tenant at the same token positions share their
//! row directions (the codes) and keep their own row norms.
//!
//! A TurboQuant row is a norm and the codes of its rotated unit direction, so a block whose rows
//! point where another block's rows point can be stored as that block's codes plus its own norms:
//! decoded, each row is the partner's direction scaled to its own length. [`BlockStore::fuse`]
//! moves cold blocks into the pool, freeing their cold slots:
//! - the partner, if it is not fused yet, founds a *group*: its codes (every layer) become the
//!   group's, and it keeps its norms — it decodes bit for bit as before;
//! - the member joins the group in the layers the caller names (its codes there are dropped) and
//!   keeps its own codes in the others, and its norms everywhere.
//!
//! Blocks are fused only with blocks of the same tenant and the same token range (so their keys
//! carry the same rotary phases), and only in layers whose key and value codecs are plain
//! TurboQuant (Q8's scale is an absmax, not a length; an outlier split stores values apart in the
//! codes; F16 and F32 have no norm). Which layers are close enough is the caller's decision
//! ([`BlockStore::fusion_similarity`] measures it); the store keeps the bytes straight.
//!
//! Warming a fused block expands it (group codes where shared, its own elsewhere, its norms) on
//! its way to the hot tier; a member comes back [`Precision::Restored`] (it carries the fusion's
//! error), a founder with the precision it had. A group lives while one of its blocks is in the
//! pool; freeing or warming the last one frees it. The pool is bounded in bytes.

use std::collections::HashMap;

use crate::block::{BlockId, Tier};
use crate::codec::{Codec, CodecKind};
use crate::error::{KvError, KvResult};
use crate::metadata::Precision;
use crate::store::{BlockPart, BlockStore};

/// Shared codes of a group.
#[derive(Debug, Clone, PartialEq)]
struct Group {
    /// Key and value codes of every layer, as they start a block's bytes.
    codes: Vec<u8>,
    /// Blocks in the pool that belong to the group.
    blocks: u32,
}

/// One block in the pool.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    group: u32,
    /// Per layer: whether the block's codes there are the group's.
    shared: Vec<bool>,
    /// The block's own bytes: its codes in the layers it does not share, then every norm, in the
    /// order of [`BlockStore::block_bytes_of`].
    own: Vec<u8>,
    /// Precision to come back with (a founder's own; `Restored` for a member).
    back: Precision,
}

/// The fused pool (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FusedPool {
    groups: HashMap<u32, Group>,
    entries: HashMap<u32, Entry>,
    next_entry: u32,
    next_group: u32,
    bytes: usize,
    capacity: usize,
}

impl FusedPool {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            groups: HashMap::new(),
            entries: HashMap::new(),
            next_entry: 0,
            next_group: 0,
            bytes: 0,
            capacity,
        }
    }

    /// Frees one block's entry (and its group with its last block).
    pub(crate) fn free(&mut self, slot: u32) {
        let Some(e) = self.entries.remove(&slot) else {
            return;
        };
        self.bytes -= e.own.len();
        if let Some(g) = self.groups.get_mut(&e.group) {
            g.blocks -= 1;
            if g.blocks == 0 {
                self.bytes -= g.codes.len();
                self.groups.remove(&e.group);
            }
        }
    }

    fn insert(&mut self, entry: Entry) -> u32 {
        let slot = self.next_entry;
        self.next_entry = self.next_entry.wrapping_add(1);
        self.bytes += entry.own.len();
        if let Some(g) = self.groups.get_mut(&entry.group) {
            g.blocks += 1;
        }
        self.entries.insert(slot, entry);
        slot
    }
}

/// What the pool holds (see [`BlockStore::fused_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FusedStats {
    /// Blocks in the pool.
    pub blocks: usize,
    /// Groups (shared directions) in the pool.
    pub groups: usize,
    /// Bytes the pool stores.
    pub bytes: usize,
    /// Bytes the same blocks would take in cold slots of their own.
    pub unfused_bytes: usize,
    /// The pool's bound in bytes.
    pub capacity: usize,
}

/// Block fusion's part of the store (see the module docs).
impl BlockStore {
    /// Adds a fused cold pool of at most `bytes` bytes (block fusion, see [`Self::fuse`]).
    pub fn with_fused_pool(mut self, bytes: usize) -> KvResult<Self> {
        if self.fused.is_some() {
            return Err(KvError::InvalidConfig {
                field: "fuse_pool_bytes",
                value: bytes as f64,
                reason: "the store has a fused pool already",
            });
        }
        if bytes == 0 {
            return Err(KvError::InvalidConfig {
                field: "fuse_pool_bytes",
                value: 0.0,
                reason: "the fused pool needs room for at least one block",
            });
        }
        self.fused = Some(FusedPool::new(bytes));
        Ok(self)
    }

    /// What the fused pool holds; `None` without one.
    pub fn fused_stats(&self) -> Option<FusedStats> {
        let pool = self.fused.as_ref()?;
        Some(FusedStats {
            blocks: pool.entries.len(),
            groups: pool.groups.len(),
            bytes: pool.bytes,
            unfused_bytes: pool.entries.len() * self.layout.block_bytes(),
            capacity: pool.capacity,
        })
    }

    /// Bytes of the key and value codes that start a block's bytes (every layer).
    fn code_bytes(&self) -> usize {
        self.block_parts()
            .iter()
            .filter(|p| p.stream.is_code())
            .map(BlockPart::len)
            .sum()
    }

    /// Layers whose key and value codecs can share directions (plain TurboQuant).
    pub fn fusable_layers(&self) -> Vec<bool> {
        let plain = |c: &Codec| matches!(c.kind(), CodecKind::TurboQuant { .. });
        self.k_codecs
            .iter()
            .zip(&self.v_codecs)
            .map(|(k, v)| plain(k) && plain(v))
            .collect()
    }

    /// The codes a block would share as a fusion partner: its group's for a fused block, its
    /// own otherwise (hot, cold or reduced blocks, expanded to the layer's codecs).
    fn directions(&self, id: BlockId) -> KvResult<Vec<u8>> {
        if self.lookup(id)?.precision == Precision::Fused {
            return Ok(self.entry_of(id)?.1.codes.clone());
        }
        let mut bytes = self.block_bytes_of(id)?;
        bytes.truncate(self.code_bytes());
        Ok(bytes)
    }

    /// Per layer, the mean cosine similarity of `member`'s key rows and of its value rows to
    /// the directions `partner` would share ([`Self::fuse`]): a fused partner's group's, the
    /// partner's own otherwise. `None` for a layer that cannot be fused. Rows are compared in
    /// the rotated space, where the rotation (orthogonal) leaves cosines as they are.
    pub fn fusion_similarity(
        &self,
        member: BlockId,
        partner: BlockId,
    ) -> KvResult<Vec<Option<(f32, f32)>>> {
        let a = self.directions(member)?;
        let b = self.directions(partner)?;
        let shape = self.layout.shape;
        let parts = self.block_parts();
        let (mut x, mut y) = (vec![0.0f32; shape.head_dim], vec![0.0f32; shape.head_dim]);
        let mut mean = |codec: &Codec, part: &BlockPart| {
            let [heads, pos, width] = part.shape;
            let rows = heads * pos;
            let mut sum = 0.0f64;
            for r in 0..rows {
                let span = part.offset + r * width..part.offset + (r + 1) * width;
                codec.expand(&a[span.clone()], &mut x);
                codec.expand(&b[span], &mut y);
                sum += f64::from(cosine(&x, &y));
            }
            (sum / rows as f64) as f32
        };
        // Key codes of every layer, then value codes (see [`Self::block_parts`]).
        let out = self
            .fusable_layers()
            .into_iter()
            .enumerate()
            .map(|(layer, ok)| {
                ok.then(|| {
                    (
                        mean(&self.k_codecs[layer], &parts[layer]),
                        mean(&self.v_codecs[layer], &parts[shape.layers + layer]),
                    )
                })
            })
            .collect();
        Ok(out)
    }

    /// Moves cold block `member` into the fused pool, sharing the directions of `partner` in
    /// the layers where `shared` is true (see the module docs); `partner`, if not fused yet,
    /// founds the group and moves into the pool too. Both must be cold, of one tenant, over the
    /// same token range; `member` must not be fused or down-tiered already (`partner` may be
    /// fused, not down-tiered); every shared layer must be fusable
    /// ([`Self::fusable_layers`]), at least one shared. Returns the cold slots freed (1 or 2).
    /// Nothing changes on error.
    pub fn fuse(&mut self, member: BlockId, partner: BlockId, shared: &[bool]) -> KvResult<usize> {
        let not = |reason| KvError::NotFusable {
            member,
            partner,
            reason,
        };
        if self.fused.is_none() {
            return Err(KvError::NoFusedPool);
        }
        if member == partner {
            return Err(not("a block cannot share its own directions"));
        }
        self.slots_in(&[member, partner], Tier::Cold)?;
        let (m, p) = (self.lookup(member)?.clone(), self.lookup(partner)?.clone());
        match m.precision {
            Precision::Fused => return Err(KvError::Fused { id: member }),
            Precision::Reduced => return Err(KvError::Reduced { id: member }),
            Precision::Full | Precision::Restored => {}
        }
        if p.precision == Precision::Reduced {
            return Err(KvError::Reduced { id: partner });
        }
        if m.tenant != p.tenant {
            return Err(not("blocks of two tenants never share directions"));
        }
        if m.tokens != p.tokens {
            return Err(not("the blocks cover different token positions"));
        }
        let layers = self.layout.shape.layers;
        if shared.len() != layers || !shared.iter().any(|&s| s) {
            return Err(not("name every layer, and share at least one"));
        }
        let fusable = self.fusable_layers();
        if shared.iter().zip(&fusable).any(|(&s, &f)| s && !f) {
            return Err(not("a shared layer's codecs are not plain TurboQuant"));
        }
        let codes = self.code_bytes();
        let member_own = self.own_bytes(&self.cold.block_bytes(m.slot), shared);
        let founding = p.precision != Precision::Fused;
        let founder = if founding {
            let bytes = self.cold.block_bytes(p.slot);
            Some((bytes[..codes].to_vec(), bytes[codes..].to_vec()))
        } else {
            None
        };
        let needed = member_own.len() + founder.as_ref().map_or(0, |(c, n)| c.len() + n.len());
        let Some(pool) = self.fused.as_mut() else {
            return Err(KvError::NoFusedPool);
        };
        let available = pool.capacity.saturating_sub(pool.bytes);
        if needed > available {
            return Err(KvError::FusedPoolFull { needed, available });
        }
        let group = match founder {
            Some((group_codes, norms)) => {
                let g = pool.next_group;
                pool.next_group = pool.next_group.wrapping_add(1);
                pool.bytes += group_codes.len();
                pool.groups.insert(
                    g,
                    Group {
                        codes: group_codes,
                        blocks: 0,
                    },
                );
                let slot = pool.insert(Entry {
                    group: g,
                    shared: vec![true; layers],
                    own: norms,
                    back: p.precision,
                });
                self.cold_free.give(p.slot);
                if let Some(meta) = self.meta.get_mut(partner) {
                    meta.precision = Precision::Fused;
                    meta.slot = slot;
                }
                self.meta.note_move(partner);
                g
            }
            None => {
                pool.entries
                    .get(&p.slot)
                    .ok_or(KvError::UnknownBlock { id: partner })?
                    .group
            }
        };
        let Some(pool) = self.fused.as_mut() else {
            return Err(KvError::NoFusedPool);
        };
        let slot = pool.insert(Entry {
            group,
            shared: shared.to_vec(),
            own: member_own,
            back: Precision::Restored,
        });
        self.cold_free.give(m.slot);
        if let Some(meta) = self.meta.get_mut(member) {
            meta.precision = Precision::Fused;
            meta.slot = slot;
            meta.fused_layers = shared.iter().filter(|&&s| s).count() as u16;
        }
        self.meta.note_move(member);
        Ok(if founding { 2 } else { 1 })
    }

    /// The bytes `member` would decode as once fused with `partner` sharing `shared` (a
    /// preview: nothing changes), laid out as [`Self::block_bytes_of`] returns them.
    pub fn fused_bytes(
        &self,
        member: BlockId,
        partner: BlockId,
        shared: &[bool],
    ) -> KvResult<Vec<u8>> {
        if shared.len() != self.layout.shape.layers {
            return Err(KvError::NotFusable {
                member,
                partner,
                reason: "name every layer, and share at least one",
            });
        }
        let mut bytes = self.block_bytes_of(member)?;
        let directions = self.directions(partner)?;
        for part in self.block_parts() {
            if part.stream.is_code() && shared[part.layer] {
                let span = part.offset..part.offset + part.len();
                bytes[span.clone()].copy_from_slice(&directions[span]);
            }
        }
        Ok(bytes)
    }

    /// A block's own part of its bytes when it shares `shared` (see [`Entry::own`]).
    fn own_bytes(&self, bytes: &[u8], shared: &[bool]) -> Vec<u8> {
        let mut own = Vec::with_capacity(bytes.len());
        for part in self.block_parts() {
            let len = part.len();
            let is_code = part.stream.is_code();
            if !(is_code && shared[part.layer]) {
                own.extend_from_slice(&bytes[part.offset..part.offset + len]);
            }
        }
        own
    }

    /// A fused block's entry and its group.
    fn entry_of(&self, id: BlockId) -> KvResult<(&Entry, &Group)> {
        let slot = self.lookup(id)?.slot;
        let pool = self.fused.as_ref().ok_or(KvError::NoFusedPool)?;
        let e = pool
            .entries
            .get(&slot)
            .ok_or(KvError::UnknownBlock { id })?;
        let g = pool
            .groups
            .get(&e.group)
            .ok_or(KvError::UnknownBlock { id })?;
        Ok((e, g))
    }

    /// A fused block's bytes, as [`Self::block_bytes_of`] lays them out.
    pub(crate) fn expand_fused_block(&self, id: BlockId) -> KvResult<Vec<u8>> {
        let (e, g) = self.entry_of(id)?;
        let mut out = Vec::with_capacity(self.layout.block_bytes());
        let mut at = 0;
        for part in self.block_parts() {
            let len = part.len();
            if part.stream.is_code() && e.shared[part.layer] {
                out.extend_from_slice(&g.codes[part.offset..part.offset + len]);
            } else {
                out.extend_from_slice(&e.own[at..at + len]);
                at += len;
            }
        }
        Ok(out)
    }

    /// The precision a fused block comes back with when warmed.
    pub(crate) fn fused_back(&self, slot: u32) -> Precision {
        self.fused
            .as_ref()
            .and_then(|p| p.entries.get(&slot))
            .map_or(Precision::Restored, |e| e.back)
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0.0f32, 0.0f32, 0.0f32);
    for (&x, &y) in a.iter().zip(b) {
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    let den = (aa * bb).sqrt();
    if den > 0.0 { ab / den } else { 0.0 }
}

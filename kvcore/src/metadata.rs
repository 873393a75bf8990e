//! The BlockMetadataTable: what every live block means and where it is.
//!
//! One entry per live block, keyed by [`BlockId`] in a `BTreeMap`, so every listing comes out in
//! id (= allocation) order and is deterministic. Queries scan the table: O(blocks), which at
//! the sizes of one node (≤ a few 10⁵ blocks) costs well under a millisecond per query.
//!
//! Invariants, kept by the store (the only writer of tier, slot, pin and reference count):
//! - `priority` is always the effective eviction priority: 999 when pinned, 100 when a pin was
//!   degraded by the soft cap, else the source layer's entry in the [`PriorityTable`];
//! - `ref_count ≥ 1` for every entry (a block whose count reaches 0 is removed);
//! - `created_at` and `last_attended` are ticks of the table's logical clock, strictly increasing
//!   per event, so orderings by them never tie between different events.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::block::{BlockId, BlockTags, SessionId, SourceLayer, TenantId, Tier, TokenRange};
use crate::error::{KvError, KvResult};

/// Eviction priority of a pinned block.
pub const PINNED_PRIORITY: u16 = 999;
/// Eviction priority of a pin over the soft cap.
pub const DEGRADED_PIN_PRIORITY: u16 = 100;

/// Source layer → eviction priority (higher survives longer).
///
/// Defaults: axioms 100, identity 90, rules 85, capabilities 80, soul 75, partner 55, neurons 40,
/// memories 35, affect 20, user_turn 15 (from the design), and for the layers it does not list:
/// assistant_turn 15 (a turn like the user's), awareness 20, system_state 10, current_time 5
/// (volatile layers are rebuilt every turn, so their blocks are worth least).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriorityTable([u16; SourceLayer::ALL.len()]);

impl Default for PriorityTable {
    fn default() -> Self {
        let mut t = [0u16; SourceLayer::ALL.len()];
        for source in SourceLayer::ALL {
            t[source.index()] = match source {
                SourceLayer::Axioms => 100,
                SourceLayer::Identity => 90,
                SourceLayer::Rules => 85,
                SourceLayer::Capabilities => 80,
                SourceLayer::Soul => 75,
                SourceLayer::Partner => 55,
                SourceLayer::Neurons => 40,
                SourceLayer::Memories => 35,
                SourceLayer::Affect => 20,
                SourceLayer::UserTurn => 15,
                SourceLayer::AssistantTurn => 15,
                SourceLayer::Awareness => 20,
                SourceLayer::SystemState => 10,
                SourceLayer::CurrentTime => 5,
            };
        }
        Self(t)
    }
}

impl PriorityTable {
    /// The priority of a source layer.
    pub fn get(&self, source: SourceLayer) -> u16 {
        self.0[source.index()]
    }

    /// Sets one layer's priority; it must stay below the pinned priority.
    pub fn set(&mut self, source: SourceLayer, priority: u16) -> KvResult<()> {
        if priority >= PINNED_PRIORITY {
            return Err(KvError::InvalidConfig {
                field: "priority",
                value: f64::from(priority),
                reason: "must be below the pinned priority 999",
            });
        }
        self.0[source.index()] = priority;
        Ok(())
    }
}

/// Whether a block is pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PinState {
    /// Evicted by priority.
    Unpinned,
    /// Priority 999: evicted only when no unpinned block is left.
    Pinned,
    /// Asked to be pinned over the soft cap: priority 100.
    Degraded,
}

/// How faithful a block's bytes are to what prefill computed.
///
/// Down-tiering ([`crate::BlockStore::reduce`]) re-encodes a cold block to a narrower codec
/// instead of dropping it; warming it re-encodes it back to the layer's codec. Its bytes then
/// carry the narrower codec's error until the block is recomputed, so the mark stays.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Encoded once, from what prefill computed, in the layer's codec.
    #[default]
    Full,
    /// In the reduced cold pool, in the narrower codecs.
    Reduced,
    /// Back in the layer's codec after a stay in the reduced pool (carries its error).
    Restored,
}

impl Precision {
    /// Whether a cold block's bytes live apart from the cold tier's slots (the reduced pool):
    /// reading them needs a re-encode.
    pub fn stored_apart(self) -> bool {
        matches!(self, Self::Reduced)
    }
}

/// Everything known about one live block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockMeta {
    pub(crate) id: BlockId,
    pub(crate) source: SourceLayer,
    pub(crate) importance: f32,
    pub(crate) tenant: TenantId,
    pub(crate) session: Option<SessionId>,
    pub(crate) tokens: TokenRange,
    pub(crate) created_at: u64,
    pub(crate) created_unix_ms: u64,
    pub(crate) last_attended: u64,
    /// Times attention read the block (allocation counts as one).
    #[serde(default)]
    pub(crate) attended: u32,
    /// Decayed average of the softmax mass decode steps gave the block
    /// ([`crate::BlockStore::record_mass`]); 0 until a step is sampled.
    #[serde(default)]
    pub(crate) mass: f32,
    /// The tick of the last sampled step whose mass on the block reached the threshold (0:
    /// none yet).
    #[serde(default)]
    pub(crate) mass_at: u64,
    /// The table's sampled-step count ([`BlockMetadataTable::steps`]) when a step last gave the
    /// block at least the threshold mass, or when it was allocated: how long the model has not
    /// read it, in decode steps, is `steps − read_step`.
    #[serde(default)]
    pub(crate) read_step: u64,
    /// Sampled steps that gave the block at least the threshold mass.
    #[serde(default)]
    pub(crate) reads: u32,
    pub(crate) priority: u16,
    pub(crate) pin: PinState,
    pub(crate) tier: Tier,
    /// Down-tiering history ([`Precision`]); `Reduced` blocks are `Cold` and their slot is one
    /// of the reduced pool's.
    #[serde(default)]
    pub(crate) precision: Precision,
    pub(crate) slot: u32,
    pub(crate) ref_count: u32,
    /// The table's epoch at the block's last tier move (its allocation counts as one); an
    /// engine sets the epoch to its tier-bridge cycle, so this is the cycle of the last move.
    #[serde(default)]
    pub(crate) moved_epoch: u64,
    /// Tier moves of the block (spill, warm, removal, readmission, down-tiering).
    #[serde(default)]
    pub(crate) moves: u32,
    /// Times the block's codes were copied to another position of another sequence (relocated
    /// segment reuse, [`crate::BlockStore::copy_tokens`]).
    #[serde(default)]
    pub(crate) relocations: u32,
    /// For a block filled by such a copy: where its tokens stand minus where their keys were
    /// computed (0: computed in place).
    #[serde(default)]
    pub(crate) shift: i64,
}

impl BlockMeta {
    /// The block's id.
    pub fn id(&self) -> BlockId {
        self.id
    }
    /// The prompt layer its tokens came from.
    pub fn source(&self) -> SourceLayer {
        self.source
    }
    /// Importance in 0..=1.
    pub fn importance(&self) -> f32 {
        self.importance
    }
    /// Owner.
    pub fn tenant(&self) -> TenantId {
        self.tenant
    }
    /// Session (None for a shared prefix block).
    pub fn session(&self) -> Option<SessionId> {
        self.session
    }
    /// Token positions held.
    pub fn tokens(&self) -> TokenRange {
        self.tokens
    }
    /// Logical tick of allocation.
    pub fn created_at(&self) -> u64 {
        self.created_at
    }
    /// Wall-clock time of allocation, ms since the Unix epoch (for display only).
    pub fn created_unix_ms(&self) -> u64 {
        self.created_unix_ms
    }
    /// Logical tick of the last attention read (allocation counts as one).
    pub fn last_attended(&self) -> u64 {
        self.last_attended
    }
    /// Times attention read the block (allocation counts as one): the tier bridge's frequency.
    pub fn attended(&self) -> u32 {
        self.attended
    }

    /// Decayed average of the attention mass sampled decode steps gave the block.
    pub fn mass(&self) -> f32 {
        self.mass
    }

    /// Tick of the last sampled step whose mass on the block reached the threshold (0: none).
    pub fn mass_at(&self) -> u64 {
        self.mass_at
    }

    /// The sampled step ([`BlockMetadataTable::steps`]) of the block's last read above the
    /// threshold, or of its allocation.
    pub fn read_step(&self) -> u64 {
        self.read_step
    }

    /// Sampled steps that gave the block at least the threshold mass (how often the model
    /// read it).
    pub fn reads(&self) -> u32 {
        self.reads
    }
    /// Effective eviction priority (see the module invariants).
    pub fn priority(&self) -> u16 {
        self.priority
    }
    /// Pin state.
    pub fn pin(&self) -> PinState {
        self.pin
    }
    /// Tier the bytes are in.
    pub fn tier(&self) -> Tier {
        self.tier
    }
    /// How faithful its bytes are (down-tiering).
    pub fn precision(&self) -> Precision {
        self.precision
    }
    /// Owners holding the block.
    pub fn ref_count(&self) -> u32 {
        self.ref_count
    }
    /// The epoch of its last tier move, or of its allocation ([`crate::BlockStore::set_epoch`]).
    pub fn moved_epoch(&self) -> u64 {
        self.moved_epoch
    }
    /// Tier moves of the block so far.
    pub fn moves(&self) -> u32 {
        self.moves
    }
    /// Times its codes were reused at another position (relocated segment reuse).
    pub fn relocations(&self) -> u32 {
        self.relocations
    }
    /// For a block filled with codes computed elsewhere: its position minus theirs (0 for a
    /// block computed in place).
    pub fn shift(&self) -> i64 {
        self.shift
    }
}

/// A conjunction of optional conditions; `BlockFilter::default()` matches every block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct BlockFilter {
    /// Only this tenant's blocks.
    pub tenant: Option<TenantId>,
    /// Only this session's blocks.
    pub session: Option<SessionId>,
    /// Only blocks from this layer.
    pub source: Option<SourceLayer>,
    /// Only blocks in this tier.
    pub tier: Option<Tier>,
    /// Only pinned (`true`: [`PinState::Pinned`]) or only not pinned (`false`) blocks.
    pub pinned: Option<bool>,
}

impl BlockFilter {
    /// True when `meta` satisfies every set condition.
    pub fn matches(&self, meta: &BlockMeta) -> bool {
        self.tenant.is_none_or(|t| meta.tenant == t)
            && self.session.is_none_or(|s| meta.session == Some(s))
            && self.source.is_none_or(|s| meta.source == s)
            && self.tier.is_none_or(|t| meta.tier == t)
            && self
                .pinned
                .is_none_or(|p| (meta.pin == PinState::Pinned) == p)
    }
}

/// The table of live blocks (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockMetadataTable {
    blocks: BTreeMap<BlockId, BlockMeta>,
    priorities: PriorityTable,
    clock: u64,
    /// Set by the owner (an engine's tier-bridge cycle); stamped on every tier move.
    epoch: u64,
    /// Tier moves of every block since the table was made (freed blocks' included).
    moves: u64,
    /// A move of a block within this many epochs of its previous move is a quick one.
    move_window: u64,
    /// Quick moves so far (a block flipping between tiers).
    quick_moves: u64,
    /// Decode steps sampled for attention mass so far (one per sequence and step).
    steps: u64,
}

impl BlockMetadataTable {
    pub(crate) fn new(priorities: PriorityTable) -> Self {
        Self {
            blocks: BTreeMap::new(),
            priorities,
            clock: 0,
            epoch: 0,
            moves: 0,
            move_window: 0,
            quick_moves: 0,
            steps: 0,
        }
    }

    /// Decode steps sampled for attention mass so far (one per sequence and step,
    /// [`crate::BlockStore::record_mass`]): the clock of [`BlockMeta::read_step`].
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Counts one more sampled step; returns its number.
    pub(crate) fn next_step(&mut self) -> u64 {
        self.steps += 1;
        self.steps
    }

    /// Live blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when no block is live.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// One block's metadata.
    pub fn get(&self, id: BlockId) -> Option<&BlockMeta> {
        self.blocks.get(&id)
    }

    /// All live blocks in id order.
    pub fn iter(&self) -> impl Iterator<Item = &BlockMeta> {
        self.blocks.values()
    }

    /// Ids of the blocks matching `filter`, in id order.
    pub fn query(&self, filter: &BlockFilter) -> Vec<BlockId> {
        self.blocks
            .values()
            .filter(|m| filter.matches(m))
            .map(|m| m.id)
            .collect()
    }

    /// Number of blocks matching `filter`.
    pub fn count(&self, filter: &BlockFilter) -> usize {
        self.blocks.values().filter(|m| filter.matches(m)).count()
    }

    /// The source → priority table in force.
    pub fn priorities(&self) -> &PriorityTable {
        &self.priorities
    }

    /// Replaces the priority table and recomputes every unpinned block's priority.
    pub fn set_priorities(&mut self, priorities: PriorityTable) {
        self.priorities = priorities;
        let table = &self.priorities;
        for meta in self.blocks.values_mut() {
            meta.priority = effective_priority(table, meta.source, meta.pin);
        }
    }

    /// The epoch stamped on tier moves now.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Tier moves of every block since the table was made.
    pub fn tier_moves(&self) -> u64 {
        self.moves
    }

    /// Moves of a block within `move_window` epochs of its previous move so far.
    pub fn quick_moves(&self) -> u64 {
        self.quick_moves
    }

    pub(crate) fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    pub(crate) fn set_move_window(&mut self, window: u64) {
        self.move_window = window;
    }

    /// Records a tier move of `id` (stamped with the epoch, counted).
    pub(crate) fn note_move(&mut self, id: BlockId) {
        if let Some(meta) = self.blocks.get_mut(&id) {
            if meta.moves > 0 && self.epoch.saturating_sub(meta.moved_epoch) < self.move_window {
                self.quick_moves += 1;
            }
            meta.moved_epoch = self.epoch;
            meta.moves = meta.moves.saturating_add(1);
            self.moves += 1;
        }
    }

    pub(crate) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub(crate) fn insert(&mut self, id: BlockId, tags: &BlockTags, tier: Tier, slot: u32) {
        let now = self.tick();
        let created_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let meta = BlockMeta {
            id,
            source: tags.source,
            importance: tags.importance,
            tenant: tags.tenant,
            session: tags.session,
            tokens: tags.tokens,
            created_at: now,
            created_unix_ms,
            last_attended: now,
            attended: 1,
            mass: 0.0,
            mass_at: 0,
            read_step: self.steps,
            reads: 0,
            priority: self.priorities.get(tags.source),
            pin: PinState::Unpinned,
            tier,
            precision: Precision::Full,
            slot,
            ref_count: 1,
            moved_epoch: self.epoch,
            moves: 0,
            relocations: 0,
            shift: 0,
        };
        self.blocks.insert(id, meta);
    }

    pub(crate) fn get_mut(&mut self, id: BlockId) -> Option<&mut BlockMeta> {
        self.blocks.get_mut(&id)
    }

    /// Every live block's metadata, mutably.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut BlockMeta> {
        self.blocks.values_mut()
    }

    /// Live blocks with ids in `lo..=hi`, in id order.
    pub(crate) fn range(
        &self,
        lo: BlockId,
        hi: BlockId,
    ) -> impl Iterator<Item = (&BlockId, &BlockMeta)> {
        self.blocks.range(lo..=hi)
    }

    /// Live blocks with ids in `lo..=hi`, in id order, to update.
    pub(crate) fn range_mut(
        &mut self,
        lo: BlockId,
        hi: BlockId,
    ) -> impl Iterator<Item = (&BlockId, &mut BlockMeta)> {
        self.blocks.range_mut(lo..=hi)
    }

    /// Advances the clock by `n` ticks; returns the first of them.
    pub(crate) fn ticks(&mut self, n: u64) -> u64 {
        let first = self.clock + 1;
        self.clock += n;
        first
    }

    pub(crate) fn remove(&mut self, id: BlockId) -> Option<BlockMeta> {
        self.blocks.remove(&id)
    }

    /// Sets a block's pin state and its effective priority with it.
    pub(crate) fn set_pin(&mut self, id: BlockId, pin: PinState) {
        let table = &self.priorities;
        if let Some(meta) = self.blocks.get_mut(&id) {
            meta.pin = pin;
            meta.priority = effective_priority(table, meta.source, pin);
        }
    }
}

fn effective_priority(table: &PriorityTable, source: SourceLayer, pin: PinState) -> u16 {
    match pin {
        PinState::Pinned => PINNED_PRIORITY,
        PinState::Degraded => DEGRADED_PIN_PRIORITY,
        PinState::Unpinned => table.get(source),
    }
}

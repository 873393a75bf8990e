//! Cold-tier reservations: the KV of a prompt part that a later turn is expected to use (a
//! memory-graph neighbourhood), computed ahead of time and held in the cold tier until a turn
//! uses it or it expires.
//!
//! Life of a reservation:
//! 1. [`EngineCore::reserve`] is given a prompt that ends with the reserved segment (the stable
//!    prefix, the slow layers before it, then the segment: blocks hash over everything before
//!    them, so the prompt must be the one the turn will build). It counts the full blocks that
//!    overlap the segment, checks that the cold tier can hold them beside every block it may not
//!    drop, frees that room, and admits the prompt as a background sequence. The reservation is
//!    `pending`.
//! 2. When the sequence's prefill is done, [`EngineCore::complete_reservation`] takes one
//!    reference on each cached block of the segment (so neither cold trimming nor tenant quotas
//!    drop it), moves the hot ones to the cold tier and ends the sequence: `ready`.
//! 3. A turn whose prompt reuses any of those blocks ([`EngineCore::start`]) claims the
//!    reservation: its references go back, the reused blocks are warmed like any cold hit, and it
//!    is `warmed`. [`EngineCore::warm_reservation`] promotes a ready reservation to the hot tier
//!    on request (a turn that is about to use it).
//! 4. [`EngineCore::expire_reservations`] drops the references of reservations past their expiry
//!    and removes their blocks from the cache (unless a sequence uses them or they are pinned):
//!    `expired`, the cold slots are free.
//!
//! The engine knows nothing of graphs: a reservation carries the caller's labels (node ids) and
//! reports them back.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use engram_kvcore::{BlockId, PinState, SourceLayer, TenantId, Tier};
use serde::{Deserialize, Serialize};

use super::{EngineCore, SeqId, SequenceSpec};
use crate::error::{EngineError, EngineResult};

/// A reservation's id (unique for the engine's life).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReservationId(pub u64);

/// Where a reservation is in its life (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ReservationState {
    /// Admitted; its blocks are being computed.
    Pending,
    /// Its blocks are computed and held in the cold tier.
    Ready,
    /// A turn used it.
    Warmed,
    /// Nobody used it before its expiry; its blocks were freed.
    Expired,
    /// Its computation failed.
    Failed,
}

/// What to reserve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReserveRequest {
    /// The prompt up to and including the reserved segment.
    pub spec: SequenceSpec,
    /// Index in `spec.segments` of the reserved segment.
    pub segment: usize,
    /// The caller's labels (memory-graph node ids).
    pub labels: Vec<u64>,
    /// How long the reservation lives unused.
    pub ttl: Duration,
}

/// A reservation as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReservationInfo {
    /// Its id.
    pub id: ReservationId,
    /// Owner (the cache salt).
    pub tenant: u64,
    /// Source layer of the reserved segment.
    pub source: SourceLayer,
    /// The caller's labels (memory-graph node ids).
    pub labels: Vec<u64>,
    /// Where it is.
    pub state: ReservationState,
    /// Token range `[start, end)` of the reserved segment in its prompt.
    pub tokens: [usize; 2],
    /// Full blocks overlapping the segment (the estimate the cold room was checked against).
    pub blocks: usize,
    /// Blocks it holds now (ready: in the cold tier unless a sequence uses them).
    pub held: usize,
    /// Of its blocks, how many a turn reused when it was claimed.
    pub used_blocks: usize,
    /// Unix milliseconds when it was made.
    pub created_unix_ms: u64,
    /// Unix milliseconds when it expires (unused).
    pub expires_unix_ms: u64,
}

/// Reservation totals (for `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReservationCounters {
    /// Reservations made.
    pub made: u64,
    /// Refused: the cold tier could not hold them.
    pub refused: u64,
    /// Used by a turn.
    pub warmed: u64,
    /// Expired unused.
    pub expired: u64,
    /// Failed while computing.
    pub failed: u64,
    /// Blocks turns reused from reservations.
    pub blocks_served: u64,
}

impl ReservationCounters {
    /// Used reservations over those that ended (used or expired); `None` before any ended.
    pub fn hit_rate(&self) -> Option<f64> {
        let ended = self.warmed + self.expired;
        (ended > 0).then(|| self.warmed as f64 / ended as f64)
    }
}

#[derive(Debug)]
struct Reservation {
    info: ReservationInfo,
    seq: Option<SeqId>,
    /// Blocks this reservation holds a reference on.
    held: Vec<BlockId>,
    /// Block indices (in its prompt) of the reserved segment.
    first_block: usize,
    last_block: usize,
    expires: Instant,
}

/// Finished reservations kept for the listing.
const HISTORY: usize = 256;

/// The reservations of one engine.
#[derive(Debug, Default)]
pub struct Reservations {
    live: BTreeMap<ReservationId, Reservation>,
    by_block: HashMap<BlockId, ReservationId>,
    by_seq: HashMap<SeqId, ReservationId>,
    history: VecDeque<ReservationInfo>,
    next: u64,
    /// Key of the id hash (drawn at the first reservation).
    id_key: Option<[u8; 32]>,
    counters: ReservationCounters,
    /// Set while a reservation's own sequence is admitted: it must not claim others.
    admitting: bool,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Reservations {
    /// A new reservation id: SHA-256 of a per-engine random key and a counter, cut to 53 bits
    /// (exact in JSON), never one in use. Ids reveal neither the order nor the number of other
    /// tenants' reservations.
    fn fresh_id(&mut self) -> ReservationId {
        use sha2::{Digest, Sha256};
        let key = *self.id_key.get_or_insert_with(|| {
            let mut k = [0u8; 32];
            let read = std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut k));
            if read.is_err() {
                let t = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                k = Sha256::digest(format!("{t}/{}", std::process::id())).into();
            }
            k
        });
        loop {
            self.next += 1;
            let mut h = Sha256::new();
            h.update(key);
            h.update(self.next.to_le_bytes());
            let d = h.finalize();
            let mut b = [0u8; 8];
            b.copy_from_slice(&d[..8]);
            let id = ReservationId((u64::from_le_bytes(b) & ((1 << 53) - 1)).max(1));
            if !self.live.contains_key(&id) && !self.history.iter().any(|i| i.id == id) {
                return id;
            }
        }
    }

    /// Reservations not yet warmed, expired or failed.
    pub(super) fn live_count(&self) -> usize {
        self.live.len()
    }

    fn finish(&mut self, id: ReservationId, state: ReservationState) -> Option<Reservation> {
        let mut r = self.live.remove(&id)?;
        for b in &r.held {
            self.by_block.remove(b);
        }
        if let Some(s) = r.seq.take() {
            self.by_seq.remove(&s);
        }
        r.info.state = state;
        r.info.held = 0;
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(r.info.clone());
        Some(r)
    }
}

impl EngineCore {
    /// Makes a reservation (step 1 of the module docs): checks and frees the cold room, admits
    /// `req.spec` as a background sequence and answers the reservation and that sequence (the
    /// caller prefills it, then calls [`Self::complete_reservation`]).
    ///
    /// Errors: `InvalidConfig` for a segment index outside the prompt or a segment with no full
    /// block, `NoColdRoom` when the cold tier cannot hold the blocks, and whatever
    /// [`Self::start`] answers.
    pub fn reserve(&mut self, req: ReserveRequest) -> EngineResult<(ReservationId, SeqId)> {
        let Some(seg) = req.spec.segments.get(req.segment) else {
            return Err(EngineError::InvalidConfig {
                field: "segment",
                reason: format!(
                    "segment {} of a prompt with {} segments",
                    req.segment,
                    req.spec.segments.len()
                ),
            });
        };
        let source = seg.source;
        let start: usize = req.spec.segments[..req.segment]
            .iter()
            .map(|s| s.tokens.len())
            .sum();
        let end = start + seg.tokens.len();
        let total: usize = req.spec.segments.iter().map(|s| s.tokens.len()).sum();
        let bs = self.config.block_size;
        // Full blocks the computed prompt leaves in the cache, overlapping the segment.
        let full = total / bs;
        let (first, last) = (start / bs, end.div_ceil(bs).min(full));
        if first >= last {
            return Err(EngineError::InvalidConfig {
                field: "segment",
                reason: format!(
                    "tokens {start}..{end} span no full block of {bs} tokens in a prompt of {total}"
                ),
            });
        }
        let blocks = last - first;
        // Cold room: free slots plus the cached blocks this tenant's room may come out of (its
        // own, or over-quota tenants'), within its cold quota.
        let tenant = req.spec.tenant;
        if let Some(quota) = req.spec.cold_block_quota {
            self.cold_quotas.insert(tenant, quota);
        }
        // Down-tiered victims hold no cold slot: dropping them makes no room.
        let droppable = self
            .cold_victims(Some(&[tenant]))
            .into_iter()
            .filter(|&id| {
                !self
                    .store
                    .metadata()
                    .get(id)
                    .is_some_and(|m| m.precision().stored_apart())
            })
            .count();
        let available = (self.store.free_blocks(Tier::Cold) + droppable)
            .min(self.cold_room_of(tenant).saturating_add(droppable));
        if blocks > available {
            self.reservations.counters.refused += 1;
            return Err(EngineError::NoColdRoom {
                needed: blocks,
                available,
            });
        }
        self.trim_cold_for(blocks, Some(&[tenant]))?;
        self.reservations.admitting = true;
        let started = self.start(req.spec);
        self.reservations.admitting = false;
        let (seq, _) = started?;
        let r = &mut self.reservations;
        let id = r.fresh_id();
        r.counters.made += 1;
        let now = SystemTime::now();
        r.live.insert(
            id,
            Reservation {
                info: ReservationInfo {
                    id,
                    tenant: tenant.0,
                    source,
                    labels: req.labels,
                    state: ReservationState::Pending,
                    tokens: [start, end],
                    blocks,
                    held: 0,
                    used_blocks: 0,
                    created_unix_ms: unix_ms(now),
                    expires_unix_ms: unix_ms(now + req.ttl),
                },
                seq: Some(seq),
                held: Vec::new(),
                first_block: first,
                last_block: last,
                expires: Instant::now() + req.ttl,
            },
        );
        r.by_seq.insert(seq, id);
        Ok((id, seq))
    }

    /// The reservation a background sequence computes, if any.
    pub fn reservation_of(&self, seq: SeqId) -> Option<ReservationId> {
        self.reservations.by_seq.get(&seq).copied()
    }

    /// Ends a reservation's sequence once its prompt is computed (or failed, with `failed`):
    /// holds the segment's cached blocks in the cold tier (see the module docs).
    pub fn complete_reservation(&mut self, id: ReservationId, failed: bool) -> EngineResult<()> {
        let Some(r) = self.reservations.live.get_mut(&id) else {
            return Ok(());
        };
        let seq = r.seq.take();
        let (first, last) = (r.first_block, r.last_block);
        if let Some(s) = seq {
            self.reservations.by_seq.remove(&s);
        }
        let hashes = seq
            .and_then(|s| self.seqs.get(&s))
            .map(|s| s.hashes.clone())
            .unwrap_or_default();
        let mut held = Vec::new();
        if !failed && hashes.len() >= last {
            for h in &hashes[first..last] {
                if let Some(b) = self.cache.get(h)
                    && !self.reservations.by_block.contains_key(&b)
                {
                    held.push(b);
                }
            }
        }
        held.sort_unstable();
        held.dedup();
        self.store.retain(&held)?;
        if let Some(s) = seq {
            self.drop_sequence(s)?;
        }
        if failed || hashes.len() < last {
            self.store.release(&held)?;
            self.reservations.counters.failed += 1;
            self.reservations.finish(id, ReservationState::Failed);
            return Ok(());
        }
        // Hot blocks no running sequence attends go to the cold tier now (as far as it has room).
        let busy: std::collections::HashSet<BlockId> = self
            .seqs
            .values()
            .flat_map(|s| s.blocks.iter().copied())
            .collect();
        let hot: Vec<BlockId> = held
            .iter()
            .copied()
            .filter(|b| !busy.contains(b))
            .filter(|&b| self.store.metadata().get(b).map(|m| m.tier()) == Some(Tier::Hot))
            .collect();
        let room = self.store.free_blocks(Tier::Cold).min(hot.len());
        self.store.spill(&hot[..room])?;
        for &b in &hot[..room] {
            if let Some(m) = self.store.metadata().get(b) {
                *self.counters.spilled.entry(m.source()).or_default() += 1;
            }
        }
        let r = &mut self.reservations;
        for &b in &held {
            r.by_block.insert(b, id);
        }
        if let Some(res) = r.live.get_mut(&id) {
            res.info.state = ReservationState::Ready;
            res.info.held = held.len();
            res.held = held;
        }
        Ok(())
    }

    /// Claims the reservations that own any of `hits` (blocks a turn is reusing): their
    /// references go back and they count as warmed. Answers how many of `hits` they held.
    /// The caller must already hold its own references on `hits`.
    pub(super) fn claim_reservations(&mut self, hits: &[BlockId]) -> EngineResult<usize> {
        if self.reservations.admitting {
            return Ok(0);
        }
        let mut used: BTreeMap<ReservationId, usize> = BTreeMap::new();
        for b in hits {
            if let Some(&id) = self.reservations.by_block.get(b) {
                *used.entry(id).or_default() += 1;
            }
        }
        let served: usize = used.values().sum();
        for (id, n) in used {
            if let Some(r) = self.reservations.live.get_mut(&id) {
                r.info.used_blocks = n;
            }
            if let Some(r) = self.reservations.finish(id, ReservationState::Warmed) {
                self.store.release(&r.held)?;
                self.reservations.counters.warmed += 1;
            }
        }
        self.reservations.counters.blocks_served += served as u64;
        Ok(served)
    }

    /// Promotes a ready reservation's blocks to the hot tier (a turn is about to use them); they
    /// stay held until a turn claims them or the reservation expires. Answers how many blocks
    /// moved. `UnknownReservation` for an id that is not live.
    pub fn warm_reservation(&mut self, id: ReservationId) -> EngineResult<usize> {
        let Some(r) = self.reservations.live.get(&id) else {
            return Err(EngineError::UnknownReservation { id: id.0 });
        };
        let cold: Vec<BlockId> = r
            .held
            .iter()
            .copied()
            .filter(|&b| self.store.metadata().get(b).map(|m| m.tier()) == Some(Tier::Cold))
            .collect();
        let tenant = TenantId(r.info.tenant);
        self.make_hot_room(cold.len(), &[tenant])?;
        self.store.warm(&cold)?;
        Ok(cold.len())
    }

    /// Expires the live reservations whose time is up at `now`: their references go back and
    /// their blocks leave the cache (unless a sequence uses them or they are pinned). Answers
    /// how many expired.
    pub fn expire_reservations(&mut self, now: Instant) -> EngineResult<usize> {
        self.expire_where(|r| r.expires <= now)
    }

    /// Expires every ready reservation (a cache clear).
    pub(super) fn expire_all_reservations(&mut self) -> EngineResult<usize> {
        self.expire_where(|_| true)
    }

    /// Expires every ready reservation of `tenant` (its data is being deleted) and forgets
    /// its finished ones.
    pub(super) fn expire_reservations_of(&mut self, tenant: TenantId) -> EngineResult<usize> {
        let n = self.expire_where(|r| r.info.tenant == tenant.0)?;
        self.reservations.history.retain(|i| i.tenant != tenant.0);
        Ok(n)
    }

    fn expire_where(&mut self, due: impl Fn(&Reservation) -> bool) -> EngineResult<usize> {
        let due: Vec<ReservationId> = self
            .reservations
            .live
            .iter()
            .filter(|(_, r)| r.seq.is_none() && due(r))
            .map(|(&id, _)| id)
            .collect();
        for &id in &due {
            let Some(r) = self.reservations.finish(id, ReservationState::Expired) else {
                continue;
            };
            self.store.release(&r.held)?;
            for b in r.held {
                let free = self
                    .store
                    .metadata()
                    .get(b)
                    .is_some_and(|m| m.ref_count() == 1 && m.pin() != PinState::Pinned);
                if free {
                    self.drop_cached(b)?;
                }
            }
            self.reservations.counters.expired += 1;
        }
        Ok(due.len())
    }

    /// When the next live reservation expires, if any is ready.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.reservations
            .live
            .values()
            .filter(|r| r.seq.is_none())
            .map(|r| r.expires)
            .min()
    }

    /// Live reservations (optionally of one tenant), then the most recent finished ones.
    pub fn reservations(&self, tenant: Option<TenantId>) -> Vec<ReservationInfo> {
        let of = |i: &ReservationInfo| tenant.is_none_or(|t| t.0 == i.tenant);
        self.reservations
            .live
            .values()
            .map(|r| &r.info)
            .filter(|i| of(i))
            .cloned()
            .chain(
                self.reservations
                    .history
                    .iter()
                    .rev()
                    .filter(|i| of(i))
                    .cloned(),
            )
            .collect()
    }

    /// Reservation totals.
    pub fn reservation_counters(&self) -> ReservationCounters {
        self.reservations.counters
    }
}

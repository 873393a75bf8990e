//! The shadow: the cache on disk, so that it survives a restart.
//!
//! **Layout** under the shadow directory:
//! - `index.json` — every entry (id, kind, tenant, session, blocks, bytes, last update);
//! - `entries/<id>/manifest.json` — one entry: its blocks in chain order (hash, tokens, source
//!   layer, importance, pin state, the segment and row holding its bytes, CRC-32C of the bytes),
//!   the engine's KV fingerprint, shape, codecs and byte layout;
//! - `entries/<id>/seg-*.safetensors` — block bytes (see `engram_kvcore::shadow`).
//!
//! A session's chain is split in two entries: its leading stable-prefix blocks go to a prefix
//! entry (`p-<hash of the last prefix block>`, shared by every session with that prefix and
//! written once), the rest to the session's entry (`s-<tenant>-<session>`), which names its
//! prefix entry.
//!
//! **Writes** are incremental and atomic. A flush asks the engine for the chains that changed
//! since it last wrote them, with the bytes of blocks the shadow does not hold yet; per entry it
//! writes the new blocks as one new segment, then the manifest (each file: temp file, fsync,
//! rename, directory fsync), then deletes segments the manifest no longer names, and finally
//! rewrites the index. A crash at any point leaves every manifest naming only complete files:
//! the old manifest with its old segments, or the new one.
//!
//! **Recovery** at start reads the index (and any entry directory the index missed), removes
//! temp files and unreferenced segments, validates each manifest (its own checksum, format,
//! fingerprint, shape, codecs, layout), then entry by entry decodes its segments, checks every
//! block's CRC and hands the chain to the engine, which recomputes each block hash before it
//! loads anything. Once the cold tier is full the rest stay on disk (`on_disk`), read on a
//! session's miss.
//! A damaged or mismatched entry is skipped with a logged, counted reason; its session's next
//! turn prefills from the turn log (the database), so wrong KV is never served.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use engram_engine::{
    ChainKey, CollectRequest, Engine, EngineError, KvFormat, RestoreChain, RestoreReport,
    ShadowBlock,
};
use engram_kvcore::shadow::{checksum, decode_segment};
use engram_kvcore::{SessionId, TenantId};
use serde::{Deserialize, Serialize};

mod archive;
mod budget;
mod error;
mod manifest;
mod offline;
mod storage;
mod writer;

pub use archive::{ARCHIVE_FORMAT, ArchiveMarker};
use error::invalid;
pub use error::{Result, ShadowError};
pub use manifest::{
    EntryKind, FORMAT, FormatInfo, IndexEntry, Manifest, ManifestBlock, PartInfo, PrefixRef,
    session_entry_id,
};
use manifest::{Index, entry_files, entry_key, now_ms, read_checked_json};
pub use offline::{
    AGENT_EXPORT_KEY, AgentExportFile, AgentExportHeader, AgentExportSession, AgentExportWriter,
    AgentImportFile, AgentSession, EXPORT_KEY, ExportBlock, ExportHeader, MAX_AGENT_SESSIONS,
    VerifyReport, export_file, import_file, open_agent_import, verify,
};
#[cfg(feature = "s3")]
pub use storage::ObjectStorage;
pub use storage::{LocalStorage, Object, S3Settings, Storage, is_temp, open_storage};
pub use writer::FlushReport;
use writer::{State, forget_entries, write_chains};

/// Blocks of a chain in order, each with its bytes.
pub type ChainBlocks = Vec<(ShadowBlock, Vec<u8>)>;

/// How the recovery at start ended for one entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RecoveryEntry {
    /// Entry id.
    pub id: String,
    /// Session or prefix.
    pub kind: EntryKind,
    /// Tenant salt.
    pub tenant: u64,
    /// Session key.
    pub session: Option<u64>,
    /// `recovered`, or the reason it was skipped (`checksum`, `format`, `missing_segment`,
    /// `model_mismatch`, `shape_mismatch`, `codec_mismatch`, `layout_mismatch`,
    /// `hash_mismatch`, `prefix_unusable`, `unknown_tenant`, `io`).
    pub outcome: String,
    /// Blocks loaded into the cold tier.
    pub loaded: usize,
    /// Tokens the recovered chain covers.
    pub tokens: usize,
    /// CRC-32C of each recovered block of the entry, in chain order.
    pub crc32c: Vec<u32>,
}

/// The shadow's state, for the admin endpoint and `/metrics`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ShadowStatus {
    /// Shadow directory.
    pub dir: String,
    /// Seconds between flushes.
    pub interval_ms: u64,
    /// Last successful flush, ms since the Unix epoch.
    pub last_write_unix_ms: Option<u64>,
    /// Its duration.
    pub last_write_ms: Option<f64>,
    /// Flushes that succeeded.
    pub writes: u64,
    /// Flushes that failed.
    pub failures: u64,
    /// The last failure.
    pub last_error: Option<String>,
    /// Bytes written to segment files so far.
    pub bytes_written: u64,
    /// Blocks written so far.
    pub blocks_written: u64,
    /// Session entries on disk.
    pub sessions: usize,
    /// Prefix entries on disk.
    pub prefixes: usize,
    /// Bytes of all segment files on disk.
    pub bytes_on_disk: u64,
    /// Sessions in the tokens-only archive (their KV deleted, their chain kept).
    #[serde(default)]
    pub archived_sessions: usize,
    /// What the recovery at start did, entry by entry.
    pub recovery: Vec<RecoveryEntry>,
    /// Recovery outcomes counted by result.
    pub recovery_counts: BTreeMap<String, u64>,
    /// Temp files and unreferenced segments removed at start.
    pub cleaned_files: usize,
    /// Recovery duration.
    pub recovery_ms: f64,
}

/// The shadow writer and reader (see the module docs).
#[derive(Debug)]
pub struct Shadow {
    store: Arc<dyn Storage>,
    /// Other nodes' shadows, read on a miss (see [`Shadow::read_peer_session`]).
    peers: Vec<Arc<dyn Storage>>,
    state: tokio::sync::Mutex<State>,
    status: Mutex<ShadowStatus>,
    /// Sessions with an archive marker (see [`archive`]).
    archived: Mutex<HashSet<ChainKey>>,
}

/// A session found in another node's shadow.
#[derive(Debug, Clone)]
pub struct PeerSession {
    /// Which peer (index into the configured peers).
    pub peer: usize,
    /// Where that peer's shadow lives.
    pub location: String,
    /// The session's manifest there.
    pub manifest: Manifest,
    /// Its chain with bytes (the prefix entry's share first), every block CRC checked.
    pub blocks: ChainBlocks,
}

impl Shadow {
    /// A shadow over `store` writing at most `max_mib_per_sec` MiB/s (0: unlimited).
    pub fn open(store: Arc<dyn Storage>, interval_ms: u64, max_mib_per_sec: u64) -> Result<Self> {
        let location = store.location();
        let archived = archive::list_markers(store.as_ref())?;
        Ok(Self {
            archived: Mutex::new(archived),
            store,
            peers: Vec::new(),
            state: tokio::sync::Mutex::new(State {
                throttle: max_mib_per_sec << 20,
                ..State::default()
            }),
            status: Mutex::new(ShadowStatus {
                dir: location,
                interval_ms,
                ..ShadowStatus::default()
            }),
        })
    }

    /// The same shadow reading `peers` (other nodes' shadows) on a miss.
    pub fn with_peers(mut self, peers: Vec<Arc<dyn Storage>>) -> Self {
        self.peers = peers;
        self
    }

    /// Whether other nodes' shadows are configured.
    pub fn has_peers(&self) -> bool {
        !self.peers.is_empty()
    }

    /// Looks a session up in the peers' shadows, in order: the first that holds its entry
    /// answers, its manifest checked as at recovery (checksum, format, KV format), its prefix
    /// entry's share and its own blocks read and CRC checked (the engine then recomputes every
    /// hash). `None` when no peer holds the session.
    pub async fn read_peer_session(
        &self,
        kv: &KvFormat,
        key: ChainKey,
    ) -> Result<Option<PeerSession>> {
        let id = session_entry_id(key.0, key.1);
        for (i, peer) in self.peers.iter().enumerate() {
            let store = peer.clone();
            let (id, kv) = (id.clone(), kv.clone());
            let found = tokio::task::spawn_blocking(move || -> Result<Option<_>> {
                let Some(m) = read_manifest(store.as_ref(), &id, &kv)? else {
                    return Ok(None);
                };
                let mut blocks = Vec::new();
                if let Some(p) = &m.prefix {
                    let pm = read_manifest(store.as_ref(), &p.id, &kv)?
                        .ok_or_else(|| invalid(&p.id, "prefix_unusable"))?;
                    let pb = read_blocks(store.as_ref(), &pm, &kv)?;
                    if pb.len() < p.blocks {
                        return Err(invalid(&id, "prefix_unusable"));
                    }
                    blocks.extend(pb.into_iter().take(p.blocks));
                }
                blocks.extend(read_blocks(store.as_ref(), &m, &kv)?);
                Ok(Some((m, blocks, store.location())))
            })
            .await
            .map_err(|e| invalid("peer", e.to_string()))??;
            if let Some((manifest, blocks, location)) = found {
                return Ok(Some(PeerSession {
                    peer: i,
                    location,
                    manifest,
                    blocks,
                }));
            }
        }
        Ok(None)
    }

    /// Deletes an adopted session's entry from the peer that held it, manifest first (a crash
    /// half-way leaves segments without a manifest, which that peer's recovery removes). The
    /// peer's prefix entry stays: other sessions there may name it.
    pub async fn release_peer_session(&self, peer: usize, key: ChainKey) -> Result<()> {
        let Some(store) = self.peers.get(peer).cloned() else {
            return Ok(());
        };
        let id = session_entry_id(key.0, key.1);
        tokio::task::spawn_blocking(move || {
            store.delete(&entry_key(&id, "manifest.json"))?;
            store.delete_prefix(&entry_key(&id, ""))
        })
        .await
        .map_err(|e| invalid("peer", e.to_string()))?
    }

    /// A copy of the status.
    pub fn status(&self) -> ShadowStatus {
        let mut s = self.status.lock().map(|s| s.clone()).unwrap_or_default();
        s.archived_sessions = self.archived_count();
        s
    }

    /// Whether a session is in the tokens-only archive.
    pub fn is_archived(&self, key: ChainKey) -> bool {
        self.archived.lock().is_ok_and(|a| a.contains(&key))
    }

    /// Sessions in the archive.
    pub fn archived_count(&self) -> usize {
        self.archived.lock().map_or(0, |a| a.len())
    }

    /// A session's archive marker, when it has one.
    pub async fn archive_marker(&self, key: ChainKey) -> Result<Option<ArchiveMarker>> {
        if !self.is_archived(key) {
            return Ok(None);
        }
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || archive::read_marker(store.as_ref(), key))
            .await
            .map_err(|e| invalid("archive", e.to_string()))?
    }

    /// Archives a session (see [`archive`]): writes its marker, then deletes its entry (the
    /// KV bytes; its prefix entry stays while another session uses it). Answers the marker
    /// and its size in bytes; `None` when the shadow holds no entry of the session. The engine
    /// must have dropped the session's blocks and chain record first
    /// (`Engine::archive_session`), or the next flush writes it again.
    pub async fn archive(&self, key: ChainKey) -> Result<Option<(ArchiveMarker, u64)>> {
        let mut state = self.state.lock().await;
        let id = session_entry_id(key.0, key.1);
        let Some(m) = state.manifests.get(&id) else {
            return Ok(None);
        };
        let Some(marker) = ArchiveMarker::of(m, entry_bytes(&state, m)) else {
            return Ok(None);
        };
        let store = self.store.clone();
        let mut taken = std::mem::take(&mut *state);
        let written = marker.clone();
        let (taken, result) = tokio::task::spawn_blocking(move || {
            let r = archive::write_marker(store.as_ref(), &written).and_then(|size| {
                let gone = move |m: &Manifest| m.session == Some(key.1.0);
                forget_entries(store.as_ref(), &mut taken, key.0.0, &gone).map(|_| size)
            });
            (taken, r)
        })
        .await
        .map_err(|e| invalid("archive", e.to_string()))?;
        *state = taken;
        let size = result?;
        if let Ok(mut a) = self.archived.lock() {
            a.insert(key);
        }
        let (sessions, prefixes, bytes) = totals(&state);
        self.update_status(|s| {
            s.sessions = sessions;
            s.prefixes = prefixes;
            s.bytes_on_disk = bytes;
        });
        Ok(Some((marker, size)))
    }

    /// A session's thaw: its next turn replayed it, so its marker goes (the next flush writes
    /// it again). Answers whether it was archived.
    pub async fn thawed(&self, key: ChainKey) -> Result<bool> {
        if !self.is_archived(key) {
            return Ok(false);
        }
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.delete(&archive::marker_key(key)))
            .await
            .map_err(|e| invalid("archive", e.to_string()))??;
        Ok(self.archived.lock().is_ok_and(|mut a| a.remove(&key)))
    }

    fn update_status(&self, f: impl FnOnce(&mut ShadowStatus)) {
        if let Ok(mut s) = self.status.lock() {
            f(&mut s);
        }
    }

    /// Writes every chain that changed (or only `only`, whatever its generation); records the
    /// outcome in the status.
    pub async fn flush(&self, engine: &Engine, only: Option<ChainKey>) -> Result<FlushReport> {
        let started = Instant::now();
        let result = self.flush_inner(engine, only).await;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match &result {
            Ok(r) => self.update_status(|s| {
                s.writes += 1;
                s.last_write_unix_ms = Some(now_ms());
                s.last_write_ms = Some(ms);
                s.bytes_written += r.bytes;
                s.blocks_written += r.blocks as u64;
            }),
            Err(e) => self.update_status(|s| {
                s.failures += 1;
                s.last_error = Some(e.to_string());
            }),
        }
        result.map(|r| FlushReport { ms, ..r })
    }

    async fn flush_inner(&self, engine: &Engine, only: Option<ChainKey>) -> Result<FlushReport> {
        let mut state = self.state.lock().await;
        let known: HashSet<[u8; 32]> = state
            .manifests
            .values()
            .flat_map(|m| m.blocks.iter().map(|b| b.block.hash.0))
            .collect();
        let req = CollectRequest {
            written: state.written.clone(),
            known,
            only,
        };
        let chains = engine
            .shadow_collect(req)?
            .recv_async()
            .await
            .map_err(|_| EngineError::Stopped)??;
        if chains.is_empty() {
            return Ok(FlushReport::default());
        }
        let kv = FormatInfo::of(engine.kv_format());
        let store = self.store.clone();
        let taken = std::mem::take(&mut *state);
        let (new_state, report) = tokio::task::spawn_blocking(move || {
            let mut st = taken;
            let r = write_chains(store.as_ref(), &kv, &mut st, chains);
            (st, r)
        })
        .await
        .map_err(|e| invalid("flush", e.to_string()))?;
        *state = new_state;
        let report = report?;
        let (sessions, prefixes, bytes) = totals(&state);
        self.update_status(|s| {
            s.sessions = sessions;
            s.prefixes = prefixes;
            s.bytes_on_disk = bytes;
        });
        Ok(report)
    }

    /// Recovers the entries into the engine (see the module docs), one at a time: prefix
    /// entries first, then sessions, the most recently written first; each entry's segments are
    /// read, checked, handed to the engine and dropped before the next one is read, so memory
    /// stays flat whatever the shadow's size. Once the cold tier is full, the remaining entries
    /// are not read (`on_disk`): their manifests are kept, so a session's next turn reads its
    /// blocks on the miss and later flushes build on them. Returns the per-entry outcomes (also
    /// kept in the status).
    ///
    /// `quotas` maps each tenant's cache salt to its cold-tier quota: an entry of a salt not in
    /// it (a tenant that no longer exists) is skipped (`unknown_tenant`); public prefixes
    /// (salt 0) have no quota.
    pub async fn recover(
        &self,
        engine: &Engine,
        quotas: &HashMap<u64, usize>,
    ) -> Result<Vec<RecoveryEntry>> {
        let started = Instant::now();
        let store = self.store.clone();
        let kv = engine.kv_format().clone();
        let (found, cleaned, sizes) = {
            let kv = kv.clone();
            tokio::task::spawn_blocking(move || scan(store.as_ref(), &kv))
                .await
                .map_err(|e| invalid("recover", e.to_string()))??
        };
        let mut state = self.state.lock().await;
        state.sizes = sizes;
        let mut outcomes = Vec::new();
        let mut good_prefix: HashMap<String, ChainBlocks> = HashMap::new();
        // Prefixes first (sessions chain onto them), then the sessions written last first.
        let (prefixes, mut sessions): (Vec<_>, Vec<_>) =
            found.into_iter().partition(|e| e.kind == EntryKind::Prefix);
        sessions.sort_by_key(|e| {
            std::cmp::Reverse(e.manifest.as_ref().map_or(0, |m| m.updated_unix_ms))
        });
        for entry in prefixes.into_iter().chain(sessions) {
            let mut out = RecoveryEntry {
                id: entry.id.clone(),
                kind: entry.kind,
                tenant: entry.tenant,
                session: entry.session,
                outcome: String::new(),
                loaded: 0,
                tokens: 0,
                crc32c: Vec::new(),
            };
            let manifest = match entry.manifest {
                Ok(m) => m,
                Err(reason) => {
                    tracing_skip(&entry.id, &reason);
                    out.outcome = reason;
                    outcomes.push(out);
                    continue;
                }
            };
            let cold_quota = quotas.get(&manifest.tenant).copied();
            if cold_quota.is_none() && manifest.tenant != 0 {
                tracing_skip(&entry.id, "unknown_tenant");
                out.outcome = "unknown_tenant".into();
                outcomes.push(out);
                continue;
            }
            if cold_room(engine).await? == 0 {
                // Left on disk, readable on a miss.
                out.outcome = "on_disk".into();
                outcomes.push(out);
                state.manifests.insert(manifest.id.clone(), manifest);
                continue;
            }
            let mut chain_blocks = Vec::new();
            if let Some(p) = &manifest.prefix {
                match good_prefix.get(&p.id) {
                    Some(pb) if pb.len() >= p.blocks => {
                        chain_blocks.extend(pb[..p.blocks].iter().cloned());
                    }
                    _ => {
                        tracing_skip(&entry.id, "prefix_unusable");
                        out.outcome = "prefix_unusable".into();
                        outcomes.push(out);
                        continue;
                    }
                }
            }
            let store = self.store.clone();
            let read = {
                let (m, kv) = (manifest.clone(), kv.clone());
                tokio::task::spawn_blocking(move || read_blocks(store.as_ref(), &m, &kv))
                    .await
                    .map_err(|e| invalid("recover", e.to_string()))?
            };
            match read {
                Ok(blocks) => chain_blocks.extend(blocks),
                Err(e) => {
                    let reason = reason_of(&e);
                    tracing_skip(&entry.id, &reason);
                    out.outcome = reason;
                    outcomes.push(out);
                    continue;
                }
            }
            let chain = RestoreChain {
                // A recovery fills the free room; it never drops what it loaded for a session
                // written later (the rest of this chain is read on the session's miss).
                make_room: false,
                tenant: TenantId(manifest.tenant),
                session: manifest.session.map(SessionId),
                stable_blocks: manifest.stable_blocks,
                pin_key: manifest.pin_key,
                public_pin_key: manifest.public_pin_key,
                cold_quota,
                blocks: chain_blocks,
            };
            // A prefix on its own is loaded too (its sessions then find it present).
            let is_prefix = manifest.kind == EntryKind::Prefix;
            let kept = is_prefix.then(|| chain.blocks.clone());
            let restored = engine_restore(engine, chain).await;
            match restored {
                Ok(report) => {
                    out.outcome = "recovered".into();
                    out.loaded = report.loaded;
                    out.tokens = report.tokens;
                    out.crc32c = manifest.blocks.iter().map(|b| b.crc32c).collect();
                    if let Some(blocks) = kept {
                        good_prefix.insert(manifest.id.clone(), blocks);
                    } else if report.generation > 0 {
                        state.written.insert(
                            (
                                TenantId(manifest.tenant),
                                SessionId(manifest.session.unwrap_or(0)),
                            ),
                            report.generation,
                        );
                    }
                    state.manifests.insert(manifest.id.clone(), manifest);
                }
                Err(ShadowError::Engine(EngineError::ShadowMismatch { reason, .. })) => {
                    tracing_skip(&entry.id, reason);
                    out.outcome = "hash_mismatch".into();
                }
                Err(e) => {
                    tracing_skip(&entry.id, &e.to_string());
                    out.outcome = "engine".into();
                }
            }
            outcomes.push(out);
        }
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for o in &outcomes {
            *counts.entry(o.outcome.clone()).or_default() += 1;
        }
        let (sessions, prefixes, bytes) = totals(&state);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.update_status(|s| {
            s.recovery = outcomes.clone();
            s.recovery_counts = counts;
            s.cleaned_files = cleaned;
            s.recovery_ms = ms;
            s.sessions = sessions;
            s.prefixes = prefixes;
            s.bytes_on_disk = bytes;
        });
        Ok(outcomes)
    }

    /// Reads every readable manifest without loading blocks (`shadow.recover` off): the
    /// entries stay on disk for `cache/load`, and later flushes build on them.
    pub async fn index(&self) -> Result<usize> {
        let store = self.store.clone();
        let (manifests, sizes) = tokio::task::spawn_blocking(move || {
            let objects = store.list("entries/")?;
            let mut out = Vec::new();
            for id in entry_files(&objects).keys() {
                if let Ok(m) =
                    read_checked_json::<Manifest>(store.as_ref(), &entry_key(id, "manifest.json"))
                    && m.format == FORMAT
                    && &m.id == id
                {
                    out.push(m);
                }
            }
            let sizes = objects.into_iter().map(|o| (o.key, o.size)).collect();
            Ok::<_, ShadowError>((out, sizes))
        })
        .await
        .map_err(|e| invalid("index", e.to_string()))??;
        let n = manifests.len();
        let mut state = self.state.lock().await;
        state.sizes = sizes;
        for m in manifests {
            state.manifests.insert(m.id.clone(), m);
        }
        let (sessions, prefixes, bytes) = totals(&state);
        self.update_status(|s| {
            s.sessions = sessions;
            s.prefixes = prefixes;
            s.bytes_on_disk = bytes;
        });
        Ok(n)
    }

    /// Blocks of one session's chain the shadow holds (its prefix entry's share first), from
    /// the manifests in memory; `None` when it holds no entry of the session.
    pub async fn session_blocks(&self, key: ChainKey) -> Option<usize> {
        let state = self.state.lock().await;
        let m = state.manifests.get(&session_entry_id(key.0, key.1))?;
        Some(m.blocks.len() + m.prefix.as_ref().map_or(0, |p| p.blocks))
    }

    /// The chain of one session as the shadow holds it (prefix blocks first), with bytes.
    pub async fn read_session(
        &self,
        kv: &KvFormat,
        key: ChainKey,
    ) -> Result<(Manifest, ChainBlocks)> {
        let state = self.state.lock().await;
        let id = session_entry_id(key.0, key.1);
        let manifest = state
            .manifests
            .get(&id)
            .cloned()
            .ok_or(ShadowError::NotFound)?;
        let prefix = manifest
            .prefix
            .as_ref()
            .and_then(|p| state.manifests.get(&p.id).cloned());
        drop(state);
        let store = self.store.clone();
        let kv = kv.clone();
        tokio::task::spawn_blocking(move || {
            let mut blocks = Vec::new();
            if let (Some(p), Some(r)) = (prefix, manifest.prefix.as_ref()) {
                let pb = read_blocks(store.as_ref(), &p, &kv)?;
                blocks.extend(pb.into_iter().take(r.blocks));
            }
            blocks.extend(read_blocks(store.as_ref(), &manifest, &kv)?);
            Ok((manifest, blocks))
        })
        .await
        .map_err(|e| invalid("read", e.to_string()))?
    }
}

fn tracing_skip(id: &str, reason: &str) {
    tracing::warn!("shadow: skipped entry {id}: {reason} (its session recomputes)");
}

pub async fn engine_restore(engine: &Engine, chain: RestoreChain) -> Result<RestoreReport> {
    Ok(engine
        .shadow_restore(chain)?
        .recv_async()
        .await
        .map_err(|_| EngineError::Stopped)??)
}

/// Counts of entries and bytes on disk.
/// Bytes of an entry's segments.
fn entry_bytes(state: &State, m: &Manifest) -> u64 {
    m.segments()
        .into_iter()
        .map(|seg| {
            state
                .sizes
                .get(&entry_key(&m.id, seg))
                .copied()
                .unwrap_or(0)
        })
        .sum()
}

fn totals(state: &State) -> (usize, usize, u64) {
    let mut sessions = 0;
    let mut prefixes = 0;
    let mut bytes = 0;
    for m in state.manifests.values() {
        match m.kind {
            EntryKind::Session => sessions += 1,
            EntryKind::Prefix => prefixes += 1,
        }
        for seg in m.segments() {
            bytes += state
                .sizes
                .get(&entry_key(&m.id, seg))
                .copied()
                .unwrap_or(0);
        }
    }
    (sessions, prefixes, bytes)
}

/// An entry's manifest, checked (its own checksum, format, id, KV format); `None` when the
/// store holds no such entry.
fn read_manifest(store: &dyn Storage, id: &str, kv: &KvFormat) -> Result<Option<Manifest>> {
    let m = match read_checked_json::<Manifest>(store, &entry_key(id, "manifest.json")) {
        Ok(m) => m,
        Err(e) if reason_of(&e) == "missing" => return Ok(None),
        Err(e) => return Err(e),
    };
    if m.format != FORMAT || m.id != id {
        return Err(invalid(id, "format"));
    }
    if let Some(reason) = m.kv.mismatch(kv) {
        return Err(invalid(id, reason));
    }
    Ok(Some(m))
}

/// Decodes every segment a manifest names (`missing_segment`, `format` on failure).
fn read_segments(
    store: &dyn Storage,
    m: &Manifest,
    bytes_read: &mut u64,
) -> Result<HashMap<String, Vec<Vec<u8>>>> {
    let parts = m.kv.parts();
    let mut segments = HashMap::new();
    for seg in m.segments() {
        let bytes = store
            .get(&entry_key(&m.id, seg))?
            .ok_or_else(|| invalid(&m.id, "missing_segment"))?;
        *bytes_read += bytes.len() as u64;
        let decoded = decode_segment(&parts, &bytes).map_err(|_| invalid(&m.id, "format"))?;
        segments.insert(seg.to_string(), decoded.blocks);
    }
    Ok(segments)
}

/// The bytes of one block of a manifest, CRC checked.
fn block_bytes<'a>(
    segments: &'a HashMap<String, Vec<Vec<u8>>>,
    m: &Manifest,
    b: &ManifestBlock,
) -> Result<&'a Vec<u8>> {
    let bytes = segments
        .get(b.segment.as_str())
        .and_then(|s| s.get(b.row))
        .ok_or_else(|| invalid(&m.id, "missing_segment"))?;
    if checksum(bytes) != b.crc32c {
        return Err(invalid(&m.id, "checksum"));
    }
    Ok(bytes)
}

/// Reads and checks every block of a manifest (CRC of each block).
fn read_blocks(store: &dyn Storage, m: &Manifest, kv: &KvFormat) -> Result<ChainBlocks> {
    if let Some(reason) = m.kv.mismatch(kv) {
        return Err(invalid(&m.id, reason));
    }
    let segments = read_segments(store, m, &mut 0)?;
    m.blocks
        .iter()
        .map(|b| Ok((b.block.clone(), block_bytes(&segments, m, b)?.clone())))
        .collect()
}

/// An entry as found on disk: its manifest (format, id and KV format checked), or the reason
/// it is unusable.
struct FoundEntry {
    id: String,
    kind: EntryKind,
    tenant: u64,
    session: Option<u64>,
    manifest: std::result::Result<Manifest, String>,
}

/// What [`scan`] found: the entries, the files it cleaned, and the size of every object left.
type Scanned = (Vec<FoundEntry>, usize, HashMap<String, u64>);

/// Lists every entry (index ∪ entry prefixes) and reads its manifest — not its segments —
/// cleaning temp files, unreferenced segments and entries with segments but no manifest (a
/// crash before the entry's first manifest).
fn scan(store: &dyn Storage, kv: &KvFormat) -> Result<Scanned> {
    let mut cleaned = 0;
    let mut objects = Vec::new();
    for o in store.list("")? {
        if is_temp(&o.key) {
            store.delete(&o.key)?;
            cleaned += 1;
        } else {
            objects.push(o);
        }
    }
    let files = entry_files(&objects);
    let mut ids: Vec<String> = files.keys().cloned().collect();
    if let Ok(index) = read_checked_json::<Index>(store, "index.json") {
        for e in index.entries {
            if !ids.contains(&e.id) {
                ids.push(e.id);
            }
        }
    }
    ids.sort();
    let mut out = Vec::new();
    let mut removed: HashSet<String> = HashSet::new();
    for id in ids {
        let Some(own) = files.get(&id) else {
            // In the index, but nothing is stored.
            out.push(FoundEntry {
                kind: if id.starts_with("p-") {
                    EntryKind::Prefix
                } else {
                    EntryKind::Session
                },
                id,
                tenant: 0,
                session: None,
                manifest: Err("missing_segment".into()),
            });
            continue;
        };
        if !own.contains_key("manifest.json") {
            for name in own.keys().filter(|n| n.starts_with("seg-")) {
                let key = entry_key(&id, name);
                store.delete(&key)?;
                removed.insert(key);
                cleaned += 1;
            }
            continue;
        }
        let manifest = read_checked_json::<Manifest>(store, &entry_key(&id, "manifest.json"));
        // Segments the manifest does not name (a crash between a segment and its manifest).
        if let Ok(m) = &manifest {
            let keep = m.segments();
            for name in own.keys() {
                if name.starts_with("seg-") && !keep.contains(name.as_str()) {
                    let key = entry_key(&id, name);
                    store.delete(&key)?;
                    removed.insert(key);
                    cleaned += 1;
                }
            }
        }
        let (kind, tenant, session) = match &manifest {
            Ok(m) => (m.kind, m.tenant, m.session),
            Err(_) if id.starts_with("p-") => (EntryKind::Prefix, 0, None),
            Err(_) => (EntryKind::Session, 0, None),
        };
        let manifest = manifest.map_err(|e| reason_of(&e)).and_then(|m| {
            if m.format != FORMAT || m.id != id {
                return Err("format".to_string());
            }
            if let Some(reason) = m.kv.mismatch(kv) {
                return Err(reason.to_string());
            }
            let named = m.segments();
            if named.iter().any(|seg| !own.contains_key(*seg)) {
                return Err("missing_segment".to_string());
            }
            Ok(m)
        });
        out.push(FoundEntry {
            id,
            kind,
            tenant,
            session,
            manifest,
        });
    }
    let sizes = objects
        .into_iter()
        .filter(|o| !removed.contains(&o.key))
        .map(|o| (o.key, o.size))
        .collect();
    Ok((out, cleaned, sizes))
}

/// Blocks the cold tier can still take.
async fn cold_room(engine: &Engine) -> Result<usize> {
    let snapshot = engine
        .snapshot()?
        .recv_async()
        .await
        .map_err(|_| EngineError::Stopped)?;
    let o = snapshot.occupancy;
    Ok(o.cold_capacity.saturating_sub(o.cold_used))
}

fn reason_of(e: &ShadowError) -> String {
    match e {
        ShadowError::Invalid { reason, .. } => reason
            .split(':')
            .next()
            .unwrap_or("format")
            .trim()
            .to_string(),
        ShadowError::Io { .. } | ShadowError::Store { .. } => "io".into(),
        _ => "format".into(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::manifest::write_checked_json;

    fn dir(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("engram-shadow-unit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_checked_json_file_detects_any_flipped_byte() {
        let d = dir("json");
        let store = LocalStorage::open(&d).unwrap();
        let index = Index {
            format: FORMAT,
            entries: vec![IndexEntry {
                id: "s-1-2".into(),
                kind: EntryKind::Session,
                tenant: 1,
                session: Some(2),
                blocks: 3,
                bytes: 300,
                updated_unix_ms: 5,
            }],
        };
        write_checked_json(&store, "index.json", &index, 0).unwrap();
        let back: Index = read_checked_json(&store, "index.json").unwrap();
        assert_eq!(back.entries, index.entries);
        let good = store.get("index.json").unwrap().unwrap();
        for at in [0, 9, good.len() / 2, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x04;
            store.put("index.json", &bad, 0).unwrap();
            let err = read_checked_json::<Index>(&store, "index.json").unwrap_err();
            assert_eq!(reason_of(&err), "checksum", "byte {at}: {err}");
        }
        let err = read_checked_json::<Index>(&store, "missing.json").unwrap_err();
        assert_eq!(reason_of(&err), "missing");
        let _ = std::fs::remove_dir_all(&d);
    }
}

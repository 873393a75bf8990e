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
//! fingerprint, shape, codecs, layout), decodes its segments, checks every block's CRC and
//! hands the chain to the engine, which recomputes each block hash before it loads anything.
//! A damaged or mismatched entry is skipped with a logged, counted reason; its session's next
//! turn prefills from the turn log (the database), so wrong KV is never served.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use engram_engine::{
    ChainKey, CollectRequest, Engine, EngineError, Hex32, KvFormat, RestoreChain, RestoreReport,
    ShadowBlock,
};
use engram_kvcore::shadow::{checksum, decode_segment};
use engram_kvcore::{BlockPart, BlockStream, CodecKind, KvError, SessionId, TenantId};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Version of the manifest and index format.
pub const FORMAT: u32 = 1;

/// Why the shadow failed.
#[derive(Debug, thiserror::Error)]
pub enum ShadowError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A segment could not be encoded or decoded.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A file is not a valid shadow file.
    #[error("{what}: {reason}")]
    Invalid {
        /// The file or entry.
        what: String,
        /// What is wrong (a stable reason code first).
        reason: String,
    },
    /// The object store failed (network, credentials, server).
    #[error("shadow store, {key}: {reason}")]
    Store {
        /// The object.
        key: String,
        /// The store's error.
        reason: String,
    },
    /// The session has no shadow entry.
    #[error("no shadowed cache for this session")]
    NotFound,
}

type Result<T> = std::result::Result<T, ShadowError>;

/// Blocks of a chain in order, each with its bytes.
pub type ChainBlocks = Vec<(ShadowBlock, Vec<u8>)>;

fn invalid(what: impl Into<String>, reason: impl Into<String>) -> ShadowError {
    ShadowError::Invalid {
        what: what.into(),
        reason: reason.into(),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A file with a CRC-32C line in front of its JSON body.
fn write_checked_json<T: Serialize>(
    store: &dyn Storage,
    key: &str,
    value: &T,
    bytes_per_sec: u64,
) -> Result<()> {
    let body = serde_json::to_vec(value).map_err(|e| invalid(key, e.to_string()))?;
    let mut out = format!("{:08x}\n", checksum(&body)).into_bytes();
    out.extend_from_slice(&body);
    store.put(key, &out, bytes_per_sec)
}

/// Reads a file [`write_checked_json`] wrote; a missing file is `Invalid` with reason `missing`.
fn read_checked_json<T: for<'de> Deserialize<'de>>(store: &dyn Storage, key: &str) -> Result<T> {
    let bytes = store.get(key)?.ok_or_else(|| invalid(key, "missing"))?;
    let nl = bytes
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| invalid(key, "checksum: no checksum line"))?;
    let crc = std::str::from_utf8(&bytes[..nl])
        .ok()
        .and_then(|s| u32::from_str_radix(s, 16).ok())
        .ok_or_else(|| invalid(key, "checksum: unreadable checksum line"))?;
    let body = &bytes[nl + 1..];
    if checksum(body) != crc {
        return Err(invalid(key, "checksum: the file is damaged"));
    }
    serde_json::from_slice(body).map_err(|e| invalid(key, format!("format: {e}")))
}

/// The key of a file of an entry.
fn entry_key(id: &str, file: &str) -> String {
    format!("entries/{id}/{file}")
}

/// The entry ids under `entries/` and, per id, its files (name → size).
fn entry_files(objects: &[Object]) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for o in objects {
        let mut parts = o.key.splitn(3, '/');
        if let (Some("entries"), Some(id), Some(file)) = (parts.next(), parts.next(), parts.next())
        {
            out.entry(id.to_string())
                .or_default()
                .insert(file.to_string(), o.size);
        }
    }
    out
}

/// A block part as the manifest records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartInfo {
    /// Stream.
    pub stream: BlockStream,
    /// Layer.
    pub layer: usize,
    /// Offset in a block's bytes.
    pub offset: usize,
    /// `[pos, kv_head, bytes]`.
    pub shape: [usize; 3],
}

impl From<&BlockPart> for PartInfo {
    fn from(p: &BlockPart) -> Self {
        Self {
            stream: p.stream,
            layer: p.layer,
            offset: p.offset,
            shape: p.shape,
        }
    }
}

impl From<&PartInfo> for BlockPart {
    fn from(p: &PartInfo) -> Self {
        Self {
            stream: p.stream,
            layer: p.layer,
            offset: p.offset,
            shape: p.shape,
        }
    }
}

/// The KV format a manifest was written with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FormatInfo {
    /// The engine's KV fingerprint.
    pub fingerprint: Hex32,
    /// `[layers, kv_heads, head_dim, block_size]`.
    pub shape: [usize; 4],
    /// Codec per layer.
    pub codecs: Vec<CodecKind>,
    /// Bytes of one block.
    pub block_bytes: usize,
    /// Byte layout of one block.
    pub parts: Vec<PartInfo>,
}

impl FormatInfo {
    fn of(kv: &KvFormat) -> Self {
        Self {
            fingerprint: Hex32(kv.fingerprint),
            shape: [
                kv.shape.layers,
                kv.shape.kv_heads,
                kv.shape.head_dim,
                kv.shape.block_size,
            ],
            codecs: kv.codecs.clone(),
            block_bytes: kv.block_bytes,
            parts: kv.parts.iter().map(PartInfo::from).collect(),
        }
    }

    /// `None` when `self` matches `kv`; otherwise the reason code of the first difference.
    fn mismatch(&self, kv: &KvFormat) -> Option<&'static str> {
        let own = Self::of(kv);
        if self.shape != own.shape {
            Some("shape_mismatch")
        } else if self.codecs != own.codecs {
            Some("codec_mismatch")
        } else if self.block_bytes != own.block_bytes || self.parts != own.parts {
            Some("layout_mismatch")
        } else if self.fingerprint != own.fingerprint {
            Some("model_mismatch")
        } else {
            None
        }
    }

    fn parts(&self) -> Vec<BlockPart> {
        self.parts.iter().map(BlockPart::from).collect()
    }
}

/// Whether an entry is a session or a shared prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// A session's blocks after its prefix.
    Session,
    /// Leading stable-prefix blocks shared by sessions.
    Prefix,
}

/// One block in a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestBlock {
    /// What the block is.
    #[serde(flatten)]
    pub block: ShadowBlock,
    /// Segment file holding its bytes.
    pub segment: String,
    /// Row in that segment.
    pub row: usize,
    /// CRC-32C of its bytes.
    pub crc32c: u32,
}

/// A session entry's reference to its prefix entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixRef {
    /// The prefix entry's id.
    pub id: String,
    /// Its blocks.
    pub blocks: usize,
}

/// One entry's manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// Entry id.
    pub id: String,
    /// Session or prefix.
    pub kind: EntryKind,
    /// Tenant salt.
    pub tenant: u64,
    /// Session key (session entries).
    pub session: Option<u64>,
    /// The KV format.
    pub kv: FormatInfo,
    /// The prefix entry (session entries with a stable prefix).
    pub prefix: Option<PrefixRef>,
    /// Leading blocks of the whole chain (prefix included) that are stable.
    pub stable_blocks: usize,
    /// Pin key of the tenant's stable blocks.
    pub pin_key: Option<Hex32>,
    /// Pin key of public blocks.
    pub public_pin_key: Option<Hex32>,
    /// Last update, ms since the Unix epoch.
    pub updated_unix_ms: u64,
    /// Blocks in chain order.
    pub blocks: Vec<ManifestBlock>,
}

impl Manifest {
    fn segments(&self) -> HashSet<&str> {
        self.blocks.iter().map(|b| b.segment.as_str()).collect()
    }
}

/// One row of the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IndexEntry {
    /// Entry id.
    pub id: String,
    /// Session or prefix.
    pub kind: EntryKind,
    /// Tenant salt.
    pub tenant: u64,
    /// Session key.
    pub session: Option<u64>,
    /// Blocks.
    pub blocks: usize,
    /// Bytes of its segments.
    pub bytes: u64,
    /// Last update, ms since the Unix epoch.
    pub updated_unix_ms: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Index {
    format: u32,
    entries: Vec<IndexEntry>,
}

/// How the recovery at start ended for one entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
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
    /// What the recovery at start did, entry by entry.
    pub recovery: Vec<RecoveryEntry>,
    /// Recovery outcomes counted by result.
    pub recovery_counts: BTreeMap<String, u64>,
    /// Temp files and unreferenced segments removed at start.
    pub cleaned_files: usize,
    /// Recovery duration.
    pub recovery_ms: f64,
}

/// What one flush wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FlushReport {
    /// Chains the engine reported changed.
    pub chains: usize,
    /// Entries whose manifest was rewritten.
    pub entries: usize,
    /// New blocks written.
    pub blocks: usize,
    /// Bytes of new segment files.
    pub bytes: u64,
    /// Wall time, ms.
    pub ms: f64,
}

#[derive(Debug, Default)]
struct State {
    manifests: HashMap<String, Manifest>,
    written: HashMap<ChainKey, u64>,
    segment_seq: u64,
    /// Write rate limit, bytes/s (0: unlimited).
    throttle: u64,
    /// Size of each segment the shadow holds, by key.
    sizes: HashMap<String, u64>,
}

/// The shadow writer and reader (see the module docs).
#[derive(Debug)]
pub struct Shadow {
    store: Arc<dyn Storage>,
    state: tokio::sync::Mutex<State>,
    status: Mutex<ShadowStatus>,
}

/// The id of a session's entry.
pub fn session_entry_id(tenant: TenantId, session: SessionId) -> String {
    format!("s-{:016x}-{:016x}", tenant.0, session.0)
}

fn prefix_entry_id(last: &Hex32) -> String {
    format!("p-{}", last.to_hex())
}

impl Shadow {
    /// A shadow over `store` writing at most `max_mib_per_sec` MiB/s (0: unlimited).
    pub fn open(store: Arc<dyn Storage>, interval_ms: u64, max_mib_per_sec: u64) -> Result<Self> {
        let location = store.location();
        Ok(Self {
            store,
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

    /// A copy of the status.
    pub fn status(&self) -> ShadowStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
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

    /// Recovers every entry into the engine (see the module docs); returns the per-entry
    /// outcomes (also kept in the status).
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
        let (loaded, cleaned, sizes) =
            tokio::task::spawn_blocking(move || load_all(store.as_ref(), &kv))
                .await
                .map_err(|e| invalid("recover", e.to_string()))??;
        let mut state = self.state.lock().await;
        state.sizes = sizes;
        let mut outcomes = Vec::new();
        let mut good_prefix: HashMap<String, ChainBlocks> = HashMap::new();
        // Prefixes first: sessions chain onto them.
        let (prefixes, sessions): (Vec<_>, Vec<_>) = loaded
            .into_iter()
            .partition(|e| e.kind == EntryKind::Prefix);
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
            let manifest = match entry.result {
                Ok(m) => m,
                Err(reason) => {
                    tracing_skip(&entry.id, &reason);
                    out.outcome = reason;
                    outcomes.push(out);
                    continue;
                }
            };
            let (manifest, blocks) = manifest;
            let cold_quota = quotas.get(&manifest.tenant).copied();
            if cold_quota.is_none() && manifest.tenant != 0 {
                tracing_skip(&entry.id, "unknown_tenant");
                out.outcome = "unknown_tenant".into();
                outcomes.push(out);
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
            chain_blocks.extend(
                manifest
                    .blocks
                    .iter()
                    .map(|b| b.block.clone())
                    .zip(blocks.iter().cloned()),
            );
            let chain = RestoreChain {
                tenant: TenantId(manifest.tenant),
                session: manifest.session.map(SessionId),
                stable_blocks: manifest.stable_blocks,
                pin_key: manifest.pin_key,
                public_pin_key: manifest.public_pin_key,
                cold_quota,
                blocks: chain_blocks.clone(),
            };
            // A prefix on its own is loaded too (its sessions then find it present).
            let restored = engine_restore(engine, chain).await;
            match restored {
                Ok(report) => {
                    out.outcome = "recovered".into();
                    out.loaded = report.loaded;
                    out.tokens = report.tokens;
                    out.crc32c = manifest.blocks.iter().map(|b| b.crc32c).collect();
                    if manifest.kind == EntryKind::Prefix {
                        good_prefix.insert(manifest.id.clone(), chain_blocks);
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
    eprintln!("engram: shadow: skipped entry {id}: {reason} (its session recomputes)");
}

pub(crate) async fn engine_restore(engine: &Engine, chain: RestoreChain) -> Result<RestoreReport> {
    Ok(engine
        .shadow_restore(chain)?
        .recv_async()
        .await
        .map_err(|_| EngineError::Stopped)??)
}

/// Counts of entries and bytes on disk.
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

/// An entry as read from disk: its manifest and blocks, or the reason it is unusable.
struct LoadedEntry {
    id: String,
    kind: EntryKind,
    tenant: u64,
    session: Option<u64>,
    result: std::result::Result<(Manifest, Vec<Vec<u8>>), String>,
}

/// What [`load_all`] found: the entries, the files it cleaned, and the size of every object
/// left.
type Loaded = (Vec<LoadedEntry>, usize, HashMap<String, u64>);

/// Reads every entry (index ∪ entry prefixes), cleaning temp files, unreferenced segments and
/// entries with segments but no manifest (a crash before the entry's first manifest).
fn load_all(store: &dyn Storage, kv: &KvFormat) -> Result<Loaded> {
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
            out.push(LoadedEntry {
                kind: if id.starts_with("p-") {
                    EntryKind::Prefix
                } else {
                    EntryKind::Session
                },
                id,
                tenant: 0,
                session: None,
                result: Err("missing_segment".into()),
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
        let result = manifest.map_err(|e| reason_of(&e)).and_then(|m| {
            if m.format != FORMAT || m.id != id {
                return Err("format".to_string());
            }
            let blocks = read_blocks(store, &m, kv).map_err(|e| reason_of(&e))?;
            Ok((m, blocks.into_iter().map(|(_, b)| b).collect()))
        });
        out.push(LoadedEntry {
            id,
            kind,
            tenant,
            session,
            result,
        });
    }
    let sizes = objects
        .into_iter()
        .filter(|o| !removed.contains(&o.key))
        .map(|o| (o.key, o.size))
        .collect();
    Ok((out, cleaned, sizes))
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

mod offline;
mod storage;
mod writer;

pub use offline::{
    EXPORT_KEY, ExportBlock, ExportHeader, VerifyReport, export_file, import_file, verify,
};
#[cfg(feature = "s3")]
pub use storage::ObjectStorage;
pub use storage::{LocalStorage, Object, S3Settings, Storage, is_temp};
use writer::write_chains;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn dir(name: &str) -> PathBuf {
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

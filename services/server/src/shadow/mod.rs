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
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
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
    /// The session has no shadow entry.
    #[error("no shadowed cache for this session")]
    NotFound,
}

type Result<T> = std::result::Result<T, ShadowError>;

/// Blocks of a chain in order, each with its bytes.
pub type ChainBlocks = Vec<(ShadowBlock, Vec<u8>)>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ShadowError + '_ {
    move |source| ShadowError::Io {
        path: path.to_path_buf(),
        source,
    }
}

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

/// Writes `bytes` to `path` atomically and durably: temp file, fsync, rename, directory fsync.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_at(path, bytes, 0)
}

/// [`write_atomic`] at no more than `bytes_per_sec` (0: unlimited), in 256 KiB writes, so that
/// the shadow never takes the disk from the turn log.
fn write_atomic_at(path: &Path, bytes: &[u8], bytes_per_sec: u64) -> Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| invalid(path.display().to_string(), "no parent directory"))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    {
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        let started = Instant::now();
        let mut written = 0u64;
        for chunk in bytes.chunks(256 << 10) {
            f.write_all(chunk).map_err(io(&tmp))?;
            written += chunk.len() as u64;
            if bytes_per_sec > 0 {
                let due = std::time::Duration::from_secs_f64(written as f64 / bytes_per_sec as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        f.sync_all().map_err(io(&tmp))?;
    }
    fs::rename(&tmp, path).map_err(io(path))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    Ok(())
}

/// A file with a CRC-32C line in front of its JSON body.
fn write_checked_json<T: Serialize>(path: &Path, value: &T, bytes_per_sec: u64) -> Result<()> {
    let body = serde_json::to_vec(value)
        .map_err(|e| invalid(path.display().to_string(), e.to_string()))?;
    let mut out = format!("{:08x}\n", checksum(&body)).into_bytes();
    out.extend_from_slice(&body);
    write_atomic_at(path, &out, bytes_per_sec)
}

fn read_checked_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let bytes = fs::read(path).map_err(io(path))?;
    let what = || path.display().to_string();
    let nl = bytes
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| invalid(what(), "checksum: no checksum line"))?;
    let crc = std::str::from_utf8(&bytes[..nl])
        .ok()
        .and_then(|s| u32::from_str_radix(s, 16).ok())
        .ok_or_else(|| invalid(what(), "checksum: unreadable checksum line"))?;
    let body = &bytes[nl + 1..];
    if checksum(body) != crc {
        return Err(invalid(what(), "checksum: the file is damaged"));
    }
    serde_json::from_slice(body).map_err(|e| invalid(what(), format!("format: {e}")))
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
    /// `hash_mismatch`, `prefix_unusable`, `io`).
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
}

/// The shadow writer and reader (see the module docs).
#[derive(Debug)]
pub struct Shadow {
    root: PathBuf,
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
    /// A shadow rooted at `root` (created if missing) writing at most `max_mib_per_sec` MiB/s
    /// (0: unlimited).
    pub fn open(root: &Path, interval_ms: u64, max_mib_per_sec: u64) -> Result<Self> {
        fs::create_dir_all(root.join("entries")).map_err(io(root))?;
        Ok(Self {
            root: root.to_path_buf(),
            state: tokio::sync::Mutex::new(State {
                throttle: max_mib_per_sec << 20,
                ..State::default()
            }),
            status: Mutex::new(ShadowStatus {
                dir: root.display().to_string(),
                interval_ms,
                ..ShadowStatus::default()
            }),
        })
    }

    /// The shadow directory.
    pub fn root(&self) -> &Path {
        &self.root
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
        let root = self.root.clone();
        let taken = std::mem::take(&mut *state);
        let (new_state, report) = tokio::task::spawn_blocking(move || {
            let mut st = taken;
            let r = write_chains(&root, &kv, &mut st, chains);
            (st, r)
        })
        .await
        .map_err(|e| invalid("flush", e.to_string()))?;
        *state = new_state;
        let report = report?;
        let (sessions, prefixes, bytes) = totals(&self.root, &state);
        self.update_status(|s| {
            s.sessions = sessions;
            s.prefixes = prefixes;
            s.bytes_on_disk = bytes;
        });
        Ok(report)
    }

    /// Recovers every entry into the engine (see the module docs); returns the per-entry
    /// outcomes (also kept in the status).
    pub async fn recover(&self, engine: &Engine) -> Result<Vec<RecoveryEntry>> {
        let started = Instant::now();
        let root = self.root.clone();
        let kv = engine.kv_format().clone();
        let (loaded, cleaned) = tokio::task::spawn_blocking(move || load_all(&root, &kv))
            .await
            .map_err(|e| invalid("recover", e.to_string()))??;
        let mut state = self.state.lock().await;
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
        let (sessions, prefixes, bytes) = totals(&self.root, &state);
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
        let root = self.root.clone();
        let manifests = tokio::task::spawn_blocking(move || {
            let dir = root.join("entries");
            let mut out = Vec::new();
            for d in fs::read_dir(&dir).map_err(io(&dir))?.flatten() {
                let id = d.file_name().to_string_lossy().into_owned();
                if let Ok(m) = read_checked_json::<Manifest>(&d.path().join("manifest.json"))
                    && m.format == FORMAT
                    && m.id == id
                {
                    out.push(m);
                }
            }
            Ok::<_, ShadowError>(out)
        })
        .await
        .map_err(|e| invalid("index", e.to_string()))??;
        let n = manifests.len();
        let mut state = self.state.lock().await;
        for m in manifests {
            state.manifests.insert(m.id.clone(), m);
        }
        let (sessions, prefixes, bytes) = totals(&self.root, &state);
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
        let root = self.root.clone();
        let kv = kv.clone();
        tokio::task::spawn_blocking(move || {
            let mut blocks = Vec::new();
            if let (Some(p), Some(r)) = (prefix, manifest.prefix.as_ref()) {
                let pb = read_blocks(&root, &p, &kv)?;
                blocks.extend(pb.into_iter().take(r.blocks));
            }
            blocks.extend(read_blocks(&root, &manifest, &kv)?);
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
fn totals(root: &Path, state: &State) -> (usize, usize, u64) {
    let mut sessions = 0;
    let mut prefixes = 0;
    let mut bytes = 0;
    for m in state.manifests.values() {
        match m.kind {
            EntryKind::Session => sessions += 1,
            EntryKind::Prefix => prefixes += 1,
        }
        for seg in m.segments() {
            bytes += fs::metadata(root.join("entries").join(&m.id).join(seg))
                .map(|md| md.len())
                .unwrap_or(0);
        }
    }
    (sessions, prefixes, bytes)
}

/// Reads and checks every block of a manifest (CRC of each block).
fn read_blocks(root: &Path, m: &Manifest, kv: &KvFormat) -> Result<ChainBlocks> {
    if let Some(reason) = m.kv.mismatch(kv) {
        return Err(invalid(&m.id, reason));
    }
    let parts = m.kv.parts();
    let dir = root.join("entries").join(&m.id);
    let mut segments: HashMap<&str, Vec<Vec<u8>>> = HashMap::new();
    for seg in m.segments() {
        let path = dir.join(seg);
        let bytes = fs::read(&path).map_err(|_| invalid(&m.id, "missing_segment"))?;
        let decoded = decode_segment(&parts, &bytes).map_err(|_| invalid(&m.id, "format"))?;
        segments.insert(seg, decoded.blocks);
    }
    m.blocks
        .iter()
        .map(|b| {
            let bytes = segments
                .get(b.segment.as_str())
                .and_then(|s| s.get(b.row))
                .ok_or_else(|| invalid(&m.id, "missing_segment"))?;
            if checksum(bytes) != b.crc32c {
                return Err(invalid(&m.id, "checksum"));
            }
            Ok((b.block.clone(), bytes.clone()))
        })
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

/// Reads every entry (index ∪ entry directories), cleaning temp files and orphan segments.
fn load_all(root: &Path, kv: &KvFormat) -> Result<(Vec<LoadedEntry>, usize)> {
    let entries_dir = root.join("entries");
    let mut ids: Vec<String> = Vec::new();
    let mut cleaned = 0;
    if let Ok(index) = read_checked_json::<Index>(&root.join("index.json")) {
        ids.extend(index.entries.into_iter().map(|e| e.id));
    }
    for dirent in fs::read_dir(&entries_dir).map_err(io(&entries_dir))? {
        let dirent = dirent.map_err(io(&entries_dir))?;
        let name = dirent.file_name().to_string_lossy().into_owned();
        if dirent.path().is_dir() && !ids.contains(&name) {
            ids.push(name);
        }
    }
    for tmp in [root.join(".index.json.tmp")] {
        if fs::remove_file(&tmp).is_ok() {
            cleaned += 1;
        }
    }
    ids.sort();
    let mut out = Vec::new();
    for id in ids {
        let dir = entries_dir.join(&id);
        if !dir.is_dir() {
            continue;
        }
        let manifest = read_checked_json::<Manifest>(&dir.join("manifest.json"));
        // Remove temp files, and segments the manifest does not name (a crash between a
        // segment and its manifest).
        let keep: HashSet<String> = manifest
            .as_ref()
            .map(|m| m.segments().into_iter().map(String::from).collect())
            .unwrap_or_default();
        if let Ok(rd) = fs::read_dir(&dir) {
            for f in rd.flatten() {
                let name = f.file_name().to_string_lossy().into_owned();
                let orphan = name.ends_with(".tmp")
                    || (manifest.is_ok() && name.starts_with("seg-") && !keep.contains(&name));
                if orphan && fs::remove_file(f.path()).is_ok() {
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
            let blocks = read_blocks(root, &m, kv).map_err(|e| reason_of(&e))?;
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
    Ok((out, cleaned))
}

fn reason_of(e: &ShadowError) -> String {
    match e {
        ShadowError::Invalid { reason, .. } => reason
            .split(':')
            .next()
            .unwrap_or("format")
            .trim()
            .to_string(),
        ShadowError::Io { .. } => "io".into(),
        _ => "format".into(),
    }
}

mod offline;
mod writer;

pub use offline::{
    EXPORT_KEY, ExportBlock, ExportHeader, VerifyReport, export_file, import_file, verify,
};
use writer::write_chains;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("engram-shadow-unit-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn atomic_writes_replace_whole_files_and_leave_no_temp() {
        let d = dir("atomic");
        let p = d.join("f.bin");
        write_atomic(&p, b"first").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"second");
        let names: Vec<String> = fs::read_dir(&d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["f.bin".to_string()]);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_checked_json_file_detects_any_flipped_byte() {
        let d = dir("json");
        let p = d.join("index.json");
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
        write_checked_json(&p, &index, 0).unwrap();
        let back: Index = read_checked_json(&p).unwrap();
        assert_eq!(back.entries, index.entries);
        let good = fs::read(&p).unwrap();
        for at in [0, 9, good.len() / 2, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x04;
            fs::write(&p, &bad).unwrap();
            let err = read_checked_json::<Index>(&p).unwrap_err();
            assert_eq!(reason_of(&err), "checksum", "byte {at}: {err}");
        }
        let _ = fs::remove_dir_all(&d);
    }
}

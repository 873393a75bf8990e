//! The on-disk format: manifests, the index, entry ids and keys, and JSON files with a CRC-32C
//! line in front. Everything here is data; reading and writing chains is the writer's and the
//! reader's (`writer.rs`, `lib.rs`).

use std::collections::{BTreeMap, HashSet};
use std::time::{SystemTime, UNIX_EPOCH};

use engram_engine::{Hex32, KvFormat, ShadowBlock};
use engram_kvcore::shadow::checksum;
use engram_kvcore::{BlockPart, BlockStream, LayerCodecs, SessionId, TenantId};
use serde::{Deserialize, Serialize};

use crate::error::{Result, invalid};
use crate::storage::{Object, Storage};

/// Version of the manifest and index format. 2: codecs per layer and stream (keys and values
/// apart); entries of format 1 are skipped (reason `format`) and their sessions prefilled again.
pub const FORMAT: u32 = 2;

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A file with a CRC-32C line in front of its JSON body.
pub(crate) fn write_checked_json<T: Serialize>(
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
pub(crate) fn read_checked_json<T: for<'de> Deserialize<'de>>(
    store: &dyn Storage,
    key: &str,
) -> Result<T> {
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
pub(crate) fn entry_key(id: &str, file: &str) -> String {
    format!("entries/{id}/{file}")
}

/// The entry ids under `entries/` and, per id, its files (name → size).
pub(crate) fn entry_files(objects: &[Object]) -> BTreeMap<String, BTreeMap<String, u64>> {
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
    /// `[kv_head, pos, bytes]` (`engram_kvcore::LAYOUT`).
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
    /// Codec per layer and stream.
    pub codecs: LayerCodecs,
    /// Bytes of one block.
    pub block_bytes: usize,
    /// Byte layout of one block.
    pub parts: Vec<PartInfo>,
}

impl FormatInfo {
    pub(crate) fn of(kv: &KvFormat) -> Self {
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
    pub(crate) fn mismatch(&self, kv: &KvFormat) -> Option<&'static str> {
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

    pub(crate) fn parts(&self) -> Vec<BlockPart> {
        self.parts.iter().map(BlockPart::from).collect()
    }
}

/// Whether an entry is a session or a shared prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    pub(crate) fn segments(&self) -> HashSet<&str> {
        self.blocks.iter().map(|b| b.segment.as_str()).collect()
    }
}

/// One row of the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
pub(crate) struct Index {
    pub(crate) format: u32,
    pub(crate) entries: Vec<IndexEntry>,
}

/// The id of a session's entry.
pub fn session_entry_id(tenant: TenantId, session: SessionId) -> String {
    format!("s-{:016x}-{:016x}", tenant.0, session.0)
}

pub(crate) fn prefix_entry_id(last: &Hex32) -> String {
    format!("p-{}", last.to_hex())
}

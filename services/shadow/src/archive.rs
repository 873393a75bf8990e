//! The tokens-only archive tier: a session's KV bytes deleted from the shadow, its chain kept.
//!
//! Tokens are the sufficient statistic for KV given the weights: a session's turn log (in the
//! database) rebuilds its blocks by replaying its prefills in their original order. When the
//! shadow is over its byte budget, the least recently written sessions are archived — their
//! entry (manifest and segments) is deleted and a marker `archive/<entry id>.json` keeps the
//! chain: the hashes of its blocks in order and the tokens they covered. The marker is tiny
//! (about 70 bytes per 16-token block, against the block's KV bytes); the session's next turn
//! finds neither memory nor the shadow holding it and replays it (the thaw), and the marker then
//! goes: the next flush writes the session again.

use std::collections::HashSet;

use engram_engine::{ChainKey, Hex32};
use engram_kvcore::{SessionId, TenantId};
use serde::{Deserialize, Serialize};

use crate::error::{Result, invalid};
use crate::manifest::{EntryKind, Manifest, now_ms, session_entry_id};
use crate::storage::Storage;

/// Format of an archive marker.
pub const ARCHIVE_FORMAT: u32 = 1;

/// Where archive markers live.
pub(crate) const ARCHIVE_DIR: &str = "archive/";

/// What is left of an archived session (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ArchiveMarker {
    /// [`ARCHIVE_FORMAT`].
    pub format: u32,
    /// Tenant salt.
    pub tenant: u64,
    /// Session key.
    pub session: u64,
    /// The prefix entry its chain starts with (kept in the shadow: other sessions share it).
    pub prefix: Option<String>,
    /// Hashes of the session entry's blocks, in chain order.
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<String>))]
    pub hashes: Vec<Hex32>,
    /// Tokens those blocks covered.
    pub tokens: usize,
    /// Bytes of the entry's segments the archive deleted.
    pub entry_bytes: u64,
    /// When it was archived, ms since the Unix epoch.
    pub archived_unix_ms: u64,
}

impl ArchiveMarker {
    /// The marker of a session entry whose segments held `entry_bytes`.
    pub(crate) fn of(m: &Manifest, entry_bytes: u64) -> Option<Self> {
        if m.kind != EntryKind::Session {
            return None;
        }
        Some(Self {
            format: ARCHIVE_FORMAT,
            tenant: m.tenant,
            session: m.session?,
            prefix: m.prefix.as_ref().map(|p| p.id.clone()),
            hashes: m.blocks.iter().map(|b| b.block.hash).collect(),
            tokens: m.blocks.iter().map(|b| b.block.tokens.len()).sum(),
            entry_bytes,
            archived_unix_ms: now_ms(),
        })
    }

    /// The session it belongs to.
    pub fn key(&self) -> ChainKey {
        (TenantId(self.tenant), SessionId(self.session))
    }
}

/// The storage key of a session's marker.
pub(crate) fn marker_key(key: ChainKey) -> String {
    format!("{ARCHIVE_DIR}{}.json", session_entry_id(key.0, key.1))
}

/// Writes a marker (atomically, like every shadow file); returns its size.
pub(crate) fn write_marker(store: &dyn Storage, marker: &ArchiveMarker) -> Result<u64> {
    let bytes = serde_json::to_vec(marker).map_err(|e| invalid("archive", e.to_string()))?;
    store.put(&marker_key(marker.key()), &bytes, 0)?;
    Ok(bytes.len() as u64)
}

/// Reads a session's marker; `None` when it has none.
pub(crate) fn read_marker(store: &dyn Storage, key: ChainKey) -> Result<Option<ArchiveMarker>> {
    let Some(bytes) = store.get(&marker_key(key))? else {
        return Ok(None);
    };
    let marker: ArchiveMarker =
        serde_json::from_slice(&bytes).map_err(|e| invalid("archive", e.to_string()))?;
    if marker.format != ARCHIVE_FORMAT || marker.key() != key {
        return Err(invalid("archive", "a marker of another format or session"));
    }
    Ok(Some(marker))
}

/// The sessions the markers under `archive/` name (a name that does not parse is skipped).
pub(crate) fn list_markers(store: &dyn Storage) -> Result<HashSet<ChainKey>> {
    Ok(store
        .list(ARCHIVE_DIR)?
        .iter()
        .filter_map(|o| {
            let id = o.key.strip_prefix(ARCHIVE_DIR)?.strip_suffix(".json")?;
            let mut parts = id.strip_prefix("s-")?.split('-');
            let tenant = u64::from_str_radix(parts.next()?, 16).ok()?;
            let session = u64::from_str_radix(parts.next()?, 16).ok()?;
            Some((TenantId(tenant), SessionId(session)))
        })
        .collect())
}

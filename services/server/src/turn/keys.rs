//! The identity conversions a turn and the handlers share: names, a session's cache key, the
//! keys prefixes are pinned under.

use engram_context::BuiltContext;
use engram_kvcore::SessionId;
use engram_store::{Agent, Tenant};
use sha2::{Digest, Sha256};

use super::{Answer, TurnError};
use crate::state::AppState;

/// Checks a tenant, agent or session name: 1–64 characters of letters, digits, `-`, `_`.
pub fn check_name(what: &'static str, name: &str) -> Result<(), TurnError> {
    let ok = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(TurnError::InvalidName { what })
    }
}

/// A session's cache key: the agent's 32 bits (see [`agent_bits`]) over 32 bits of the
/// session's name, so that every cached block and shadow entry of an agent can be found (and
/// deleted) by its upper half.
pub fn session_key(agent: &Agent, session: &str) -> SessionId {
    let h = Sha256::digest(format!("{}/{session}", agent.id).as_bytes());
    let mut b = [0u8; 4];
    b.copy_from_slice(&h[..4]);
    SessionId(agent_bits(agent) | u64::from(u32::from_le_bytes(b)))
}

/// Mask of the agent's part of a session key.
pub const AGENT_MASK: u64 = 0xFFFF_FFFF_0000_0000;

/// The agent's part of its sessions' keys.
pub fn agent_bits(agent: &Agent) -> u64 {
    let h = Sha256::digest(format!("engram-agent\0{}", agent.id).as_bytes());
    let mut b = [0u8; 4];
    b.copy_from_slice(&h[..4]);
    u64::from(u32::from_le_bytes(b)) << 32
}

/// The key public blocks are pinned under: SHA-256 of the public segments' text (no tenant),
/// or `None` when the prompt has no public part.
pub fn public_pin_key(built: &BuiltContext) -> Option<[u8; 32]> {
    let n = built.public_segments();
    if n == 0 {
        return None;
    }
    let mut h = Sha256::new();
    h.update(b"engram-public\0");
    built.segments[..n]
        .iter()
        .for_each(|s| h.update(s.text.as_bytes()));
    Some(h.finalize().into())
}

/// The key a tenant's stable prefix is pinned under: SHA-256 of the tenant and the prefix hash.
pub fn pin_key(tenant: &Tenant, built: &BuiltContext) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(tenant.id.as_bytes());
    h.update(built.stable_prefix_hash);
    h.finalize().into()
}

/// Releases the pins under `key`; answers how many blocks were unpinned (0 without a model).
pub async fn unpin(state: &AppState, key: Option<[u8; 32]>) -> Result<usize, TurnError> {
    let (Some(engine), Some(key)) = (&state.engine, key) else {
        return Ok(0);
    };
    Ok(engine.unpin_prefix(key)?.answer().await??)
}

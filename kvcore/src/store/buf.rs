//! The byte buffers of a host tier: process memory, or page-locked memory (feature `cuda`) that
//! a device reads and writes with DMA. Both read as plain `[u8]`; a clone is always process
//! memory (the bytes are what a tier compares and clones, not where they live).

use std::ops::{Deref, DerefMut};

/// One tensor of a host tier.
pub(crate) enum HostBuf {
    /// Process memory.
    Heap(Vec<u8>),
    /// Page-locked memory mapped into the device's address space.
    #[cfg(feature = "cuda")]
    Pinned(crate::store::pinned::PinnedBuf),
}

impl HostBuf {
    /// `len` zero bytes of process memory.
    pub(crate) fn heap(len: usize) -> Self {
        Self::Heap(vec![0; len])
    }

    /// Whether the buffer is page-locked.
    pub(crate) fn is_pinned(&self) -> bool {
        match self {
            Self::Heap(_) => false,
            #[cfg(feature = "cuda")]
            Self::Pinned(_) => true,
        }
    }

    /// The address a device kernel uses for this buffer, when it has one.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_address(&self) -> Option<u64> {
        match self {
            Self::Heap(_) => None,
            Self::Pinned(p) => Some(p.device_address()),
        }
    }
}

impl Deref for HostBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            #[cfg(feature = "cuda")]
            Self::Pinned(p) => p,
        }
    }
}

impl DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(v) => v,
            #[cfg(feature = "cuda")]
            Self::Pinned(p) => p,
        }
    }
}

impl Clone for HostBuf {
    fn clone(&self) -> Self {
        Self::Heap(self.to_vec())
    }
}

impl PartialEq for HostBuf {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for HostBuf {}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuf")
            .field("len", &self.len())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

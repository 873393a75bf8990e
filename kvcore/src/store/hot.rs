//! The hot tier: the blocks attention reads. A trait names what every backend must do; an enum
//! holds the backend chosen at start, so the rest of the crate has no `#[cfg]`.
//!
//! - `Host`: process memory ([`HostTier`]), the CPU engine's hot tier.
//! - `Cuda`: device memory. Without the `cuda` feature this is a stub whose constructor returns
//!   [`crate::KvError::CudaNotCompiled`], so no value of it ever exists.

use crate::error::KvResult;
use crate::store::host::{HostTier, Layout};

#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
#[allow(unsafe_code)]
pub(crate) mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub(crate) mod cuda;

#[cfg(feature = "cuda")]
pub use cuda::CudaLayer;
pub use cuda::CudaTier;

/// Which backend holds the hot tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum HotTierKind {
    /// Process memory (the CPU engine).
    #[default]
    Host,
    /// VRAM of one CUDA device.
    Cuda {
        /// Device ordinal.
        device: usize,
    },
}

/// What a hot-tier backend provides. Slot bookkeeping lives in the store; a backend only holds
/// bytes in the shared layout and moves them to and from the host cold tier.
pub trait HotStorage {
    /// Blocks the tier holds.
    fn capacity(&self) -> u32;
    /// Bytes the tier occupies.
    fn bytes(&self) -> usize;
    /// Copies hot slots to cold slots (`(hot, cold)` pairs), every layer and stream.
    fn spill_to(&self, cold: &mut HostTier, pairs: &[(u32, u32)]) -> KvResult<()>;
    /// Copies cold slots to hot slots (`(cold, hot)` pairs), every layer and stream.
    fn warm_from(&mut self, cold: &HostTier, pairs: &[(u32, u32)]) -> KvResult<()>;
    /// The bytes, when the CPU can read them.
    fn host(&self) -> KvResult<&HostTier>;
    /// The bytes, mutable, when the CPU can write them.
    fn host_mut(&mut self) -> KvResult<&mut HostTier>;
}

impl HotStorage for HostTier {
    fn capacity(&self) -> u32 {
        HostTier::capacity(self)
    }
    fn bytes(&self) -> usize {
        HostTier::bytes(self)
    }
    fn spill_to(&self, cold: &mut HostTier, pairs: &[(u32, u32)]) -> KvResult<()> {
        cold.copy_from(self, pairs);
        Ok(())
    }
    fn warm_from(&mut self, cold: &HostTier, pairs: &[(u32, u32)]) -> KvResult<()> {
        self.copy_from(cold, pairs);
        Ok(())
    }
    fn host(&self) -> KvResult<&HostTier> {
        Ok(self)
    }
    fn host_mut(&mut self) -> KvResult<&mut HostTier> {
        Ok(self)
    }
}

/// The hot tier in use.
// One value per store; boxing the host variant would only add an indirection on every read.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq)]
pub enum HotTier {
    /// Process memory.
    Host(HostTier),
    /// Device memory.
    Cuda(CudaTier),
}

impl HotTier {
    pub(crate) fn new(kind: HotTierKind, layout: Layout, capacity: u32) -> KvResult<Self> {
        match kind {
            HotTierKind::Host => Ok(Self::Host(HostTier::new(layout, capacity)?)),
            HotTierKind::Cuda { device } => {
                Ok(Self::Cuda(CudaTier::new(device, layout, capacity)?))
            }
        }
    }

    /// A copy of the tier and its bytes (device memory is copied on the device).
    pub fn try_clone(&self) -> KvResult<Self> {
        Ok(match self {
            Self::Host(h) => Self::Host(h.clone()),
            Self::Cuda(c) => Self::Cuda(c.try_clone()?),
        })
    }

    /// The CUDA tier, when the hot tier is on a device.
    pub fn cuda(&self) -> Option<&CudaTier> {
        match self {
            Self::Host(_) => None,
            Self::Cuda(c) => Some(c),
        }
    }

    /// The CUDA tier, mutable.
    pub fn cuda_mut(&mut self) -> Option<&mut CudaTier> {
        match self {
            Self::Host(_) => None,
            Self::Cuda(c) => Some(c),
        }
    }

    /// A cold tier that suits this hot tier: page-locked memory for a device.
    pub(crate) fn cold_tier(&self, layout: Layout, capacity: u32) -> KvResult<HostTier> {
        match self {
            Self::Host(_) => HostTier::new(layout, capacity),
            Self::Cuda(c) => c.cold_tier(capacity),
        }
    }

    fn backend(&self) -> &dyn HotStorage {
        match self {
            Self::Host(h) => h,
            Self::Cuda(c) => c,
        }
    }

    fn backend_mut(&mut self) -> &mut dyn HotStorage {
        match self {
            Self::Host(h) => h,
            Self::Cuda(c) => c,
        }
    }
}

impl HotStorage for HotTier {
    fn capacity(&self) -> u32 {
        self.backend().capacity()
    }
    fn bytes(&self) -> usize {
        self.backend().bytes()
    }
    fn spill_to(&self, cold: &mut HostTier, pairs: &[(u32, u32)]) -> KvResult<()> {
        self.backend().spill_to(cold, pairs)
    }
    fn warm_from(&mut self, cold: &HostTier, pairs: &[(u32, u32)]) -> KvResult<()> {
        self.backend_mut().warm_from(cold, pairs)
    }
    fn host(&self) -> KvResult<&HostTier> {
        self.backend().host()
    }
    fn host_mut(&mut self) -> KvResult<&mut HostTier> {
        self.backend_mut().host_mut()
    }
}

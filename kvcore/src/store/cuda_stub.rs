//! Stand-in for the CUDA hot tier when the crate is built without the `cuda` feature.
//! [`CudaTier::new`] always fails with [`KvError::CudaNotCompiled`], so no value exists and the
//! trait methods below are never reached; they still answer with the same typed error.

use crate::error::{KvError, KvResult};
use crate::store::host::{HostTier, Layout};
use crate::store::hot::HotStorage;

/// The CUDA hot tier (not compiled in).
#[derive(Debug, PartialEq)]
pub struct CudaTier {
    _not_constructible: (),
}

impl CudaTier {
    pub(crate) fn new(_device: usize, _layout: Layout, _capacity: u32) -> KvResult<Self> {
        Err(KvError::CudaNotCompiled)
    }

    pub(crate) fn cold_tier(&self, _capacity: u32) -> KvResult<HostTier> {
        Err(KvError::CudaNotCompiled)
    }

    /// Never reached: no value exists.
    pub fn try_clone(&self) -> KvResult<Self> {
        Err(KvError::CudaNotCompiled)
    }

    /// Never reached: no value exists.
    pub fn block_bytes(&self, _slot: u32) -> KvResult<Vec<u8>> {
        Err(KvError::CudaNotCompiled)
    }
}

impl HotStorage for CudaTier {
    fn capacity(&self) -> u32 {
        0
    }
    fn bytes(&self) -> usize {
        0
    }
    fn spill_to(&self, _cold: &mut HostTier, _pairs: &[(u32, u32)]) -> KvResult<()> {
        Err(KvError::CudaNotCompiled)
    }
    fn warm_from(&mut self, _cold: &HostTier, _pairs: &[(u32, u32)]) -> KvResult<()> {
        Err(KvError::CudaNotCompiled)
    }
    fn host(&self) -> KvResult<&HostTier> {
        Err(KvError::CudaNotCompiled)
    }
    fn host_mut(&mut self) -> KvResult<&mut HostTier> {
        Err(KvError::CudaNotCompiled)
    }
}

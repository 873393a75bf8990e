//! Page-locked host memory (feature `cuda`): the buffers of a cold tier that a device reads and
//! writes with DMA, and that kernels address directly (mapped into the device's address space).

use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use crate::error::{KvError, KvResult};

fn cuda(e: impl std::fmt::Display) -> KvError {
    KvError::Cuda(e.to_string())
}

/// Page-locked host memory, mapped into the device's address space.
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    device: u64,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain bytes owned by this value alone; the raw pointer is only an
// address of memory that stays valid until `drop`, and `&`/`&mut` access follows Rust's rules.
unsafe impl Send for PinnedBuf {}
// SAFETY: as above; shared access only hands out `&[u8]`.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// `len` zero bytes of page-locked memory.
    pub(crate) fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> KvResult<Self> {
        ctx.bind_to_thread().map_err(cuda)?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of at least one byte; its bytes are zeroed before any read.
        let ptr = unsafe { result::malloc_host(len.max(1), flags) }.map_err(cuda)? as *mut u8;
        // SAFETY: `ptr` points to `len.max(1)` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was returned by `cuMemHostAlloc` with DEVICEMAP in this context.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, ptr.cast(), 0) };
        let buf = Self {
            ptr,
            len,
            device,
            ctx: ctx.clone(),
        };
        mapped.result().map_err(cuda)?;
        Ok(buf)
    }

    /// The buffer's address for device kernels.
    pub(crate) fn device_address(&self) -> u64 {
        self.device
    }
}

impl std::ops::Deref for PinnedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // A copy may still read or write the buffer only if its call failed half-way; wait for
        // the context before giving the memory back. Errors cannot be reported from drop.
        let _ = self.ctx.synchronize();
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once, here.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

impl std::fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuf").field("len", &self.len).finish()
    }
}

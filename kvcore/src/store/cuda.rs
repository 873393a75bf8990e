//! The CUDA hot tier (feature `cuda`): the four tensors of the shared layout in device memory,
//! and the cold tier it pairs with in page-locked host memory.
//!
//! - **Bytes.** Device tensors have exactly the layout of [`HostTier`] (same strides for the same
//!   capacity), so a spill or a warm copies bytes and never re-encodes them.
//! - **Copies.** Spills and warms run on a dedicated copy stream, so they overlap the kernels
//!   already queued on the compute stream. Runs of consecutive slots are copied with one
//!   `cuMemcpyAsync` per (tensor, layer, run); a scattered set (more than
//!   [`MEMCPY_RUN_LIMIT`] copies) is moved by one launch of a copy kernel that reads or writes the
//!   mapped host memory directly.
//! - **Ordering.** A spill, a warm or a read-back first waits for the whole context (every
//!   stream, whichever thread queued its work), so kernels queued earlier that write or read the
//!   slots have finished; it returns when its own bytes have landed, so later kernels see them and
//!   the CPU may read or rewrite the cold tier at once. The tier does not rely on cudarc's
//!   per-slice events: the engine turns them off (each kernel argument would otherwise cost an
//!   event wait and record on the host).
//! - **Cold tier.** Page-locked with `cuMemHostAlloc(PORTABLE | DEVICEMAP)`: not write-combined,
//!   so CPU reads (the shadow, checksums) stay fast.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg, result,
};

use crate::error::{KvError, KvResult};
use crate::store::buf::HostBuf;
use crate::store::host::{HostTier, Layout, Strides, runs};
use crate::store::hot::HotStorage;
use crate::store::pinned::PinnedBuf;

/// Above this many `cuMemcpyAsync` calls a transfer goes through the copy kernel instead.
pub const MEMCPY_RUN_LIMIT: usize = 256;

const COPY_SOURCE: &str = include_str!("tier_copy.cu");

fn cuda(e: impl std::fmt::Display) -> KvError {
    KvError::Cuda(e.to_string())
}

/// Blocks in device memory (see the module docs).
#[derive(Debug)]
pub struct CudaTier {
    layout: Layout,
    capacity: u32,
    /// K codes, V codes, K norms, V norms.
    strides: [Strides; 4],
    stream: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    copy_kernel: CudaFunction,
    /// K codes, V codes, K norms, V norms.
    bufs: [CudaSlice<u8>; 4],
}

/// One layer's device tensors, as the attention kernels read them.
#[derive(Debug)]
pub struct CudaLayer<'a> {
    /// `[slots, kv_heads, block_size, code_row]` ([`crate::LAYOUT`]).
    pub k_codes: CudaView<'a, u8>,
    /// As `k_codes`.
    pub v_codes: CudaView<'a, u8>,
    /// `[slots, kv_heads, block_size]` f16 bits.
    pub k_norms: CudaView<'a, u8>,
    /// As `k_norms`.
    pub v_norms: CudaView<'a, u8>,
}

impl CudaTier {
    pub(crate) fn new(device: usize, layout: Layout, capacity: u32) -> KvResult<Self> {
        let ctx = CudaContext::new(device).map_err(cuda)?;
        let stream = ctx.default_stream();
        Self::on_stream(stream, layout, capacity)
    }

    /// A tier whose compute work (writes and reads by kernels) runs on `stream`.
    pub(crate) fn on_stream(
        stream: Arc<CudaStream>,
        layout: Layout,
        capacity: u32,
    ) -> KvResult<Self> {
        let ctx = stream.context().clone();
        let strides = layout.strides(capacity)?;
        let copy = ctx.new_stream().map_err(cuda)?;
        let ptx = cudarc::nvrtc::compile_ptx(COPY_SOURCE).map_err(cuda)?;
        let module = ctx.load_module(ptx).map_err(cuda)?;
        let copy_kernel = module.load_function("tier_copy").map_err(cuda)?;
        let alloc = |n: usize| stream.alloc_zeros::<u8>(n.max(1)).map_err(cuda);
        let bufs = [
            alloc(strides[0].total())?,
            alloc(strides[1].total())?,
            alloc(strides[2].total())?,
            alloc(strides[3].total())?,
        ];
        stream.synchronize().map_err(cuda)?;
        Ok(Self {
            layout,
            capacity,
            strides,
            stream,
            copy,
            copy_kernel,
            bufs,
        })
    }

    /// A cold tier for this device: page-locked host memory in the same layout.
    pub(crate) fn cold_tier(&self, capacity: u32) -> KvResult<HostTier> {
        let ctx = self.stream.context().clone();
        HostTier::with_alloc(self.layout.clone(), capacity, |n| {
            Ok(HostBuf::Pinned(PinnedBuf::zeroed(&ctx, n)?))
        })
    }

    /// The compute stream (kernels that write and read the tier).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The copy stream (spills and warms).
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// Turns cudarc's per-slice event tracking off for the tier's context (see the module docs on
    /// ordering): kernel launches and allocations then cost no event calls on the host. The
    /// tier's own copies stay ordered (they settle the context first); whoever calls this keeps
    /// every other use of the context's memory on the compute stream, or orders it by hand.
    pub fn untrack_events(&self) {
        // SAFETY: cudarc's obligations without tracking are that no slice is freed, read or
        // written on one stream while another still uses it. The tier's copy stream touches its
        // tensors only after `settle` (every stream idle) and is synchronized before the call
        // returns; the rest is the caller's, as documented above.
        unsafe { self.stream.context().disable_event_tracking() }
    }

    /// Waits for every stream of the context: the work that touched the tier before a copy (see
    /// the module docs on ordering).
    fn settle(&self) -> KvResult<()> {
        self.stream.context().synchronize().map_err(cuda)
    }

    fn strides(&self, plane: usize) -> &Strides {
        &self.strides[plane]
    }

    /// One layer's tensors.
    pub fn layer(&self, layer: usize) -> KvResult<CudaLayer<'_>> {
        if layer >= self.layout.shape.layers {
            return Err(KvError::UnknownLayer {
                layer,
                layers: self.layout.shape.layers,
            });
        }
        let view = |plane: usize| {
            let s = self.strides(plane);
            self.bufs[plane].slice(s.layer[layer]..s.layer[layer + 1])
        };
        Ok(CudaLayer {
            k_codes: view(0),
            v_codes: view(1),
            k_norms: view(2),
            v_norms: view(3),
        })
    }

    /// The K and V code and norm tensors of one layer, mutable, for the encode kernel:
    /// `(k_codes, v_codes, k_norms, v_norms)`.
    pub fn layer_mut(
        &mut self,
        layer: usize,
    ) -> KvResult<[cudarc::driver::CudaViewMut<'_, u8>; 4]> {
        if layer >= self.layout.shape.layers {
            return Err(KvError::UnknownLayer {
                layer,
                layers: self.layout.shape.layers,
            });
        }
        let span = |p: usize| self.strides[p].layer[layer]..self.strides[p].layer[layer + 1];
        let (s0, s1, s2, s3) = (span(0), span(1), span(2), span(3));
        let [kc, vc, kn, vn] = &mut self.bufs;
        Ok([
            kc.slice_mut(s0),
            vc.slice_mut(s1),
            kn.slice_mut(s2),
            vn.slice_mut(s3),
        ])
    }

    /// All bytes of one block, in [`HostTier::block_bytes`] order (read back from the device).
    pub fn block_bytes(&self, slot: u32) -> KvResult<Vec<u8>> {
        self.settle()?;
        let mut out = Vec::with_capacity(self.layout.block_bytes());
        for plane in 0..4 {
            let s = self.strides(plane);
            for layer in 0..self.layout.shape.layers {
                let view = self.bufs[plane].slice(s.range(layer, slot, 1));
                out.extend(self.copy.clone_dtoh(&view).map_err(cuda)?);
            }
        }
        Ok(out)
    }

    /// Every byte of the tier (for equality of whole stores in tests).
    fn download(&self) -> KvResult<Vec<Vec<u8>>> {
        self.settle()?;
        self.bufs
            .iter()
            .map(|b| self.copy.clone_dtoh(b).map_err(cuda))
            .collect()
    }

    /// A copy of the tier in fresh device memory (same streams).
    pub fn try_clone(&self) -> KvResult<Self> {
        self.settle()?;
        let mut bufs = Vec::with_capacity(4);
        for b in &self.bufs {
            let mut dst = self.stream.alloc_zeros::<u8>(b.len()).map_err(cuda)?;
            self.stream.memcpy_dtod(b, &mut dst).map_err(cuda)?;
            bufs.push(dst);
        }
        self.stream.synchronize().map_err(cuda)?;
        let bufs: [CudaSlice<u8>; 4] = bufs
            .try_into()
            .map_err(|_| KvError::Cuda("four tensors expected".into()))?;
        Ok(Self {
            layout: self.layout.clone(),
            capacity: self.capacity,
            strides: self.strides.clone(),
            stream: self.stream.clone(),
            copy: self.copy.clone(),
            copy_kernel: self.copy_kernel.clone(),
            bufs,
        })
    }

    fn check_cold(&self, cold: &HostTier) -> KvResult<()> {
        if cold.is_pinned() {
            Ok(())
        } else {
            Err(KvError::Cuda(
                "the cold tier of a device store must be page-locked".into(),
            ))
        }
    }
}

impl PartialEq for CudaTier {
    /// Same geometry and the same bytes (read back from the device); `false` if they cannot be
    /// read.
    fn eq(&self, other: &Self) -> bool {
        self.layout == other.layout
            && self.capacity == other.capacity
            && matches!((self.download(), other.download()), (Ok(a), Ok(b)) if a == b)
    }
}

impl HotStorage for CudaTier {
    fn capacity(&self) -> u32 {
        self.capacity
    }

    fn bytes(&self) -> usize {
        self.strides.iter().map(Strides::total).sum()
    }

    fn spill_to(&self, cold: &mut HostTier, pairs: &[(u32, u32)]) -> KvResult<()> {
        self.check_cold(cold)?;
        let runs = runs(pairs);
        let layers = self.layout.shape.layers;
        let copy = &self.copy;
        copy.context().bind_to_thread().map_err(cuda)?;
        self.settle()?;
        if runs.len() * layers * 4 <= MEMCPY_RUN_LIMIT {
            for (plane, (dst, dst_strides)) in cold.planes_mut().into_iter().enumerate() {
                let (src, _read) = self.bufs[plane].device_ptr(copy);
                let src_strides = self.strides(plane);
                for layer in 0..layers {
                    for &(s, d, n) in &runs {
                        let from = src_strides.range(layer, s, n);
                        let to = dst_strides.range(layer, d, n);
                        // SAFETY: `from` lies inside the device tensor and `to` inside the
                        // page-locked host tensor (slots checked by the store); the copy stream
                        // is synchronized below, before the host bytes can be touched.
                        unsafe {
                            result::memcpy_dtoh_async(
                                &mut dst[to],
                                src + from.start as u64,
                                copy.cu_stream(),
                            )
                        }
                        .map_err(cuda)?;
                    }
                }
            }
        } else {
            let mut planes = Vec::with_capacity(3 * 4 * layers);
            let mut guards = Vec::with_capacity(4);
            for (plane, (dst, dst_strides)) in cold.planes().into_iter().enumerate() {
                let (src, read) = self.bufs[plane].device_ptr(copy);
                guards.push(read);
                let dst = dst.device_address().unwrap_or(0);
                let src_strides = self.strides(plane);
                for layer in 0..layers {
                    planes.extend([
                        src + src_strides.layer[layer] as u64,
                        dst + dst_strides.layer[layer] as u64,
                        src_strides.block[layer] as u64,
                    ]);
                }
            }
            launch_copy(&self.copy, &self.copy_kernel, &planes, pairs)?;
            drop(guards);
        }
        copy.synchronize().map_err(cuda)
    }

    fn warm_from(&mut self, cold: &HostTier, pairs: &[(u32, u32)]) -> KvResult<()> {
        self.check_cold(cold)?;
        let runs = runs(pairs);
        let layers = self.layout.shape.layers;
        let copy = self.copy.clone();
        copy.context().bind_to_thread().map_err(cuda)?;
        self.settle()?;
        let strides = self.strides.clone();
        let kernel = self.copy_kernel.clone();
        if runs.len() * layers * 4 <= MEMCPY_RUN_LIMIT {
            for (plane, (src, src_strides)) in cold.planes().into_iter().enumerate() {
                let dst_strides = &strides[plane];
                let (dst, _write) = self.bufs[plane].device_ptr_mut(&copy);
                for layer in 0..layers {
                    for &(s, d, n) in &runs {
                        let from = src_strides.range(layer, s, n);
                        let to = dst_strides.range(layer, d, n);
                        // SAFETY: `to` lies inside the device tensor and `from` inside the
                        // page-locked host tensor, which is not written before the copy stream
                        // is synchronized below.
                        unsafe {
                            result::memcpy_htod_async(
                                dst + to.start as u64,
                                &src[from],
                                copy.cu_stream(),
                            )
                        }
                        .map_err(cuda)?;
                    }
                }
            }
        } else {
            let mut planes = Vec::with_capacity(3 * 4 * layers);
            let cold_planes = cold.planes();
            let [b0, b1, b2, b3] = &mut self.bufs;
            let mut guards = Vec::with_capacity(4);
            for (plane, buf) in [b0, b1, b2, b3].into_iter().enumerate() {
                let (src, src_strides) = cold_planes[plane];
                let dst_strides = &strides[plane];
                let (dst, write) = buf.device_ptr_mut(&copy);
                guards.push(write);
                let src = src.device_address().unwrap_or(0);
                for layer in 0..layers {
                    planes.extend([
                        src + src_strides.layer[layer] as u64,
                        dst + dst_strides.layer[layer] as u64,
                        dst_strides.block[layer] as u64,
                    ]);
                }
            }
            launch_copy(&copy, &kernel, &planes, pairs)?;
            drop(guards);
        }
        copy.synchronize().map_err(cuda)
    }

    fn host(&self) -> KvResult<&HostTier> {
        Err(KvError::HostAccessRequired)
    }

    fn host_mut(&mut self) -> KvResult<&mut HostTier> {
        Err(KvError::HostAccessRequired)
    }
}

/// Launches the copy kernel for `pairs` (`(src slot, dst slot)`) over every plane and layer,
/// with the per-plane source and destination layer addresses given.
fn launch_copy(
    copy: &Arc<CudaStream>,
    kernel: &CudaFunction,
    planes: &[u64],
    pairs: &[(u32, u32)],
) -> KvResult<()> {
    let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
    let planes_dev = copy.clone_htod(planes).map_err(cuda)?;
    let pairs_dev = copy.clone_htod(&flat).map_err(cuda)?;
    let n = i32::try_from(pairs.len())
        .map_err(|_| KvError::Cuda(format!("{} blocks in one copy", pairs.len())))?;
    let cfg = LaunchConfig {
        grid_dim: (pairs.len().min(65_535) as u32, (planes.len() / 3) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = copy.launch_builder(kernel);
    launch.arg(&planes_dev).arg(&pairs_dev).arg(&n);
    // SAFETY: `tier_copy(const Plane*, const unsigned*, int)` with `Plane` = three u64s;
    // every slot in `pairs` was checked against both tiers' capacities by the store, so each
    // block lies inside its plane's layer slab, whose addresses are live allocations.
    unsafe { launch.launch(cfg) }.map_err(cuda)?;
    Ok(())
}

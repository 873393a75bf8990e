//! The tensor-core decode attention's host side: the work-item plan and its partials on the
//! device ([`MmaWork`]), the CTA form of a launch, the attention launches (plain, mass, bf16
//! output) and the combine.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{ActBuf, DecodeBatch, Tq4Kernels, driver, glue, int, push_batch};
use crate::mma::{
    MMA_CTAS_PER_SM, MMA_STAGES, MMA_WARPS, MMA_WIDE_WARPS, MmaShape, mma_cta, mma_shape,
    mma_shared_bytes,
};
use crate::{ItemPlan, KernelError, PAGE, PageLayout};

/// The pipeline depth an NVRTC option list asks for (`-DMMA_TMA=stages`, an experiment), else
/// [`MMA_STAGES`].
pub(super) fn mma_stages_of(options: &[String]) -> Result<usize, KernelError> {
    match options.iter().find_map(|o| o.strip_prefix("-DMMA_TMA=")) {
        None => Ok(MMA_STAGES),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (2..=4).contains(&n) => Ok(n),
            _ => Err(KernelError::Unsupported(format!(
                "MMA_TMA={v} (2..=4 stages)"
            ))),
        },
    }
}

/// A batch's work-item plan on the device and the partials it needs (tensor-core kernel).
#[derive(Debug)]
pub struct MmaWork {
    plan: ItemPlan,
    kv_heads: usize,
    items: CudaSlice<i32>,
    seq_first: CudaSlice<i32>,
    acc: CudaSlice<f32>,
    m: CudaSlice<f32>,
    l: CudaSlice<f32>,
    /// The tiles' records of the mass variant (running max, added normalizer), allocated by
    /// the first [`Tq4Kernels::decode_attention_mma_mass`] on this work.
    tiles: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

impl MmaWork {
    /// The plan it was built from.
    pub fn plan(&self) -> &ItemPlan {
        &self.plan
    }
}

impl Tq4Kernels {
    /// Items the card works on at once with the tensor-core kernel (two CTAs per SM): the
    /// `slots` of [`ItemPlan::new`].
    pub fn mma_slots(&self, kv_heads: usize) -> usize {
        let (ipc, wpi) = mma_cta(kv_heads, MMA_WARPS);
        (self.sms * MMA_CTAS_PER_SM * ipc / kv_heads.div_ceil(wpi).max(1)).max(1)
    }

    /// The CTA form [`Self::decode_attention_mma`] takes for `work` on `layout` pages
    /// ([`mma_shape`] on this card).
    pub fn mma_form(&self, work: &MmaWork, kv_heads: usize, layout: PageLayout) -> MmaShape {
        mma_shape(work.plan.len(), work.plan.chunk, kv_heads, self.sms, layout)
    }

    /// Shared memory of a CTA of [`mma_shape`]'s form.
    fn mma_shared(&self, warps: usize, layout: PageLayout) -> usize {
        let stages = if layout == PageLayout::HeadMajor {
            self.mma_stages
        } else {
            0
        };
        mma_shared_bytes(warps, self.group, self.head_dim, stages)
    }

    /// The work-item plan for sequences of `lens` positions (`chunk` overrides the plan's) and
    /// its partials, uploaded.
    pub fn mma_work(
        &self,
        lens: &[usize],
        kv_heads: usize,
        chunk: Option<usize>,
    ) -> Result<MmaWork, KernelError> {
        let need = [
            (MMA_WARPS, PageLayout::TokenMajor),
            (MMA_WARPS, PageLayout::HeadMajor),
            (MMA_WIDE_WARPS, PageLayout::HeadMajor),
        ]
        .into_iter()
        .map(|(warps, layout)| {
            let (ipc, wpi) = mma_cta(kv_heads, warps);
            self.mma_shared(ipc * wpi, layout)
        })
        .max()
        .unwrap_or(0);
        if need > self.max_shared {
            return Err(KernelError::Unsupported(format!(
                "the tensor-core kernel needs {need} bytes of shared memory; the card has {}",
                self.max_shared
            )));
        }
        let plan = ItemPlan::new(lens, self.mma_slots(kv_heads), chunk)?;
        let parts = plan.len().max(1) * kv_heads * self.group;
        let items = if plan.items.is_empty() {
            vec![0i32; 3]
        } else {
            plan.items.clone()
        };
        Ok(MmaWork {
            items: self.stream.clone_htod(&items).map_err(driver)?,
            seq_first: self.stream.clone_htod(&plan.seq_first).map_err(driver)?,
            acc: self
                .stream
                .alloc_zeros(parts * self.head_dim)
                .map_err(driver)?,
            m: self.stream.alloc_zeros(parts).map_err(driver)?,
            l: self.stream.alloc_zeros(parts).map_err(driver)?,
            tiles: None,
            kv_heads,
            plan,
        })
    }

    /// [`Self::decode_attention`] on tensor cores (`tq4_decode_mma` + `tq4_combine_items`):
    /// 16-position pages only; `layout` says how a page orders its rows (kvcore's is
    /// [`PageLayout::HeadMajor`]). `work` must come from [`Self::mma_work`] for this batch's
    /// lengths.
    pub fn decode_attention_mma(
        &self,
        a: &DecodeBatch<'_>,
        layout: PageLayout,
        work: &mut MmaWork,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        use cudarc::driver::DevicePtrMut;
        self.check_batch(a, out.len())?;
        self.mma_items(a, layout, work, false)?;
        let (o, _o) = out.device_ptr_mut(&self.stream);
        self.combine_items_pdl(work, a, o, false)
    }

    /// [`Self::decode_attention_mma_out`] that also measures the attention mass each page of
    /// every sequence receives from its query, averaged over the query heads
    /// (`tq4_decode_mma_mass`, then `tq4_block_mass`): `[batch, max_blocks]`, a sequence's
    /// first `⌈len/16⌉` entries written (they sum to 1), the rest zero. The output is
    /// `tq4_decode_mma`'s bit for bit; the records cost one f32 pair per (item, head, page).
    pub fn decode_attention_mma_mass(
        &self,
        a: &DecodeBatch<'_>,
        layout: PageLayout,
        work: &mut MmaWork,
        bf16: bool,
    ) -> Result<(ActBuf, CudaSlice<f32>), KernelError> {
        let len = a.batch * a.heads * self.head_dim;
        self.check_batch(a, len)?;
        let tstride = work.plan.chunk / PAGE;
        let records = work.plan.len().max(1) * a.kv_heads * self.group * tstride;
        if work.tiles.as_ref().is_none_or(|(m, _)| m.len() < records) {
            work.tiles = Some((
                self.stream.alloc_zeros(records).map_err(driver)?,
                self.stream.alloc_zeros(records).map_err(driver)?,
            ));
        }
        let out = self.items_and_combine(a, layout, work, true, len, bf16)?;
        let mut mass = self
            .stream
            .alloc_zeros::<f32>((a.batch * a.max_blocks).max(1))
            .map_err(driver)?;
        let Some((tile_m, tile_a)) = work.tiles.as_ref() else {
            return Err(KernelError::Invalid(
                "the mass records were not allocated".into(),
            ));
        };
        if !work.plan.is_empty() {
            let (heads, kv_heads) = (int(a.heads, "heads")?, int(a.kv_heads, "kv_heads")?);
            let (tstride, max_blocks) = (int(tstride, "tiles")?, int(a.max_blocks, "max_blocks")?);
            let cfg = LaunchConfig {
                grid_dim: (
                    a.max_blocks.div_ceil(256).max(1) as u32,
                    u32::try_from(a.batch)
                        .map_err(|_| KernelError::Invalid("batch over u32".into()))?,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: (2 * a.heads * 4) as u32,
            };
            let mut launch = self.stream.launch_builder(&self.block_mass);
            launch
                .arg(&work.m)
                .arg(&work.l)
                .arg(tile_m)
                .arg(tile_a)
                .arg(&work.items)
                .arg(&work.seq_first)
                .arg(&heads)
                .arg(&kv_heads)
                .arg(&tstride)
                .arg(&max_blocks)
                .arg(&mut mass);
            // SAFETY: the arguments match `tq4_block_mass`; the partials and records were
            // written for this plan's items by the launch above (same stream), `mass` holds
            // `batch × max_blocks` floats and a sequence's pages are at most `max_blocks`
            // (check_batch), and the shared memory holds 2 · heads floats.
            unsafe { launch.launch(cfg) }.map_err(driver)?;
        }
        Ok((out, mass))
    }

    /// The attention launch of [`Self::decode_attention_mma`] (checked by the caller): the
    /// plan's items into the partials.
    fn mma_items(
        &self,
        a: &DecodeBatch<'_>,
        layout: PageLayout,
        work: &mut MmaWork,
        mass: bool,
    ) -> Result<(), KernelError> {
        if a.kv_heads != work.kv_heads || work.plan.seq_first.len() != a.batch + 1 {
            return Err(KernelError::Invalid(format!(
                "the plan is for {} KV heads and {} sequences, the batch has {} and {}",
                work.kv_heads,
                work.plan.seq_first.len().saturating_sub(1),
                a.kv_heads,
                a.batch
            )));
        }
        if a.block_size != PAGE {
            return Err(KernelError::Unsupported(format!(
                "block size {} (the tensor-core kernel reads {PAGE}-position pages)",
                a.block_size
            )));
        }
        if layout == PageLayout::HeadMajor {
            // The copy engine reads a head's rows of a page as one run: 16-byte aligned.
            use cudarc::driver::DevicePtr;
            let p = &a.planes;
            let ptrs = [
                p.k_codes.device_ptr(&self.stream).0,
                p.k_norms.device_ptr(&self.stream).0,
                p.v_codes.device_ptr(&self.stream).0,
                p.v_norms.device_ptr(&self.stream).0,
            ];
            if ptrs.iter().any(|&ptr| ptr % 16 != 0) {
                return Err(KernelError::Invalid(
                    "a plane of the layer does not start on a 16-byte boundary".into(),
                ));
            }
        }
        let (heads, kv_heads) = (int(a.heads, "heads")?, int(a.kv_heads, "kv_heads")?);
        let max_blocks = int(a.max_blocks, "max_blocks")?;
        let (ps, hs) = layout.strides(a.kv_heads);
        let (ps, hs) = (int(ps, "pos stride")?, int(hs, "head stride")?);
        let qscale = self.rot_scale * a.scale * std::f32::consts::LOG2_E;
        if !work.plan.is_empty() {
            let MmaShape { wide, ipc, wpi } = self.mma_form(work, a.kv_heads, layout);
            let cfg = LaunchConfig {
                grid_dim: (
                    u32::try_from(work.plan.len().div_ceil(ipc))
                        .map_err(|_| KernelError::Invalid("items over u32".into()))?,
                    a.kv_heads.div_ceil(wpi) as u32,
                    1,
                ),
                block_dim: (32 * (ipc * wpi) as u32, 1, 1),
                shared_mem_bytes: self.mma_shared(ipc * wpi, layout) as u32,
            };
            let n_items = int(work.plan.len(), "items")?;
            let (ipc, wpi) = (int(ipc, "ipc")?, int(wpi, "wpi")?);
            let tstride = int(work.plan.chunk / PAGE, "tiles")?;
            let f = match (mass, layout, wide) {
                (false, PageLayout::HeadMajor, false) => &self.mma_hm,
                (true, PageLayout::HeadMajor, false) => &self.mma_mass_hm,
                (false, PageLayout::HeadMajor, true) => &self.mma_hm_wide,
                (true, PageLayout::HeadMajor, true) => &self.mma_mass_hm_wide,
                (false, _, _) => &self.mma,
                (true, _, _) => &self.mma_mass,
            };
            let mut launch = self.stream.launch_builder(f);
            push_batch(&mut launch, a, &heads, &kv_heads, &max_blocks);
            launch
                .arg(&ps)
                .arg(&hs)
                .arg(&work.items)
                .arg(&n_items)
                .arg(&ipc)
                .arg(&wpi)
                .arg(&self.signs)
                .arg(&self.codebook)
                .arg(&qscale)
                .arg(&mut work.acc)
                .arg(&mut work.m)
                .arg(&mut work.l);
            if mass {
                let (tm, ta) = work
                    .tiles
                    .as_mut()
                    .ok_or_else(|| KernelError::Invalid("no mass records".into()))?;
                launch.arg(tm).arg(ta).arg(&tstride);
            }
            // SAFETY: the arguments match `tq4_decode_mma` (and, with `mass`, the three more of
            // `tq4_decode_mma_mass`: records sized for the plan's items × heads × chunk/16); the sizes were checked above, the
            // partials were sized for this plan's items, and every block-table entry of a
            // sequence's first ⌈len/16⌉ pages must name a slot of the planes (the block store
            // hands out only such slots).
            unsafe { launch.launch(cfg) }.map_err(driver)?;
        }
        Ok(())
    }

    /// The attention launch (with `mass`, the mass variant's) and the combine into a fresh
    /// output of `len` values, f32 or bf16: the body both decode entry points share.
    fn items_and_combine(
        &self,
        a: &DecodeBatch<'_>,
        layout: PageLayout,
        work: &mut MmaWork,
        mass: bool,
        len: usize,
        bf16: bool,
    ) -> Result<ActBuf, KernelError> {
        use cudarc::driver::DevicePtrMut;
        let mut out = glue::alloc_act(&self.stream, len, bf16)?;
        self.mma_items(a, layout, work, mass)?;
        match &mut out {
            ActBuf::F32(o) => {
                let (p, _p) = o.device_ptr_mut(&self.stream);
                self.combine_items_pdl(work, a, p, false)?;
            }
            ActBuf::Bf16(o) => {
                let (p, _p) = o.device_ptr_mut(&self.stream);
                self.combine_items_pdl(work, a, p, true)?;
            }
        }
        Ok(out)
    }

    /// [`Self::decode_attention_mma`] into a fresh output `[batch, heads, head_dim]`, f32 or
    /// bf16 (rounded to nearest even: the output projection's operand). It is uninitialized
    /// before the launch (the combine writes every row, zeros for a sequence without items), so
    /// no memset is launched for it.
    pub fn decode_attention_mma_out(
        &self,
        a: &DecodeBatch<'_>,
        layout: PageLayout,
        work: &mut MmaWork,
        bf16: bool,
    ) -> Result<ActBuf, KernelError> {
        let len = a.batch * a.heads * self.head_dim;
        self.check_batch(a, len)?;
        let out = self.items_and_combine(a, layout, work, false, len, bf16)?;
        Ok(out)
    }

    /// Launches `tq4_combine_items` as a programmatic dependent of the attention launch before
    /// it on the stream (`cuLaunchKernelEx` with programmatic stream serialization): its CTAs
    /// are scheduled while the attention grid drains and wait in `griddepcontrol.wait`.
    /// `o` is the output's device address (`batch × heads × head_dim` elements, f32 or bf16 as
    /// `bf16` says), its guard held by the caller across the call.
    fn combine_items_pdl(
        &self,
        work: &MmaWork,
        a: &DecodeBatch<'_>,
        o: cudarc::driver::sys::CUdeviceptr,
        bf16: bool,
    ) -> Result<(), KernelError> {
        use cudarc::driver::{DevicePtr, sys};
        use std::ffi::c_void;
        let (heads, kv_heads) = (int(a.heads, "heads")?, int(a.kv_heads, "kv_heads")?);
        let batch = a.batch;
        let out_bf16 = i32::from(bf16);
        let s = &self.stream;
        let (acc, _acc) = work.acc.device_ptr(s);
        let (m, _m) = work.m.device_ptr(s);
        let (l, _l) = work.l.device_ptr(s);
        let (first, _first) = work.seq_first.device_ptr(s);
        let (signs, _signs) = self.signs.device_ptr(s);
        let rot = self.rot_scale;
        let mut args: [*mut c_void; 10] = [
            (&raw const acc).cast_mut().cast(),
            (&raw const m).cast_mut().cast(),
            (&raw const l).cast_mut().cast(),
            (&raw const heads).cast_mut().cast(),
            (&raw const kv_heads).cast_mut().cast(),
            (&raw const first).cast_mut().cast(),
            (&raw const signs).cast_mut().cast(),
            (&raw const rot).cast_mut().cast(),
            (&raw const o).cast_mut().cast(),
            (&raw const out_bf16).cast_mut().cast(),
        ];
        // SAFETY: an all-zero launch attribute value is valid (a union of plain integers).
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: u32::try_from(heads).map_err(|_| KernelError::Invalid("heads".into()))?,
            gridDimY: u32::try_from(batch).map_err(|_| KernelError::Invalid("batch".into()))?,
            gridDimZ: 1,
            blockDimX: 256,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: s.cu_stream(),
            attrs: &raw mut attr,
            numAttrs: 1,
        };
        self.stream.context().bind_to_thread().map_err(driver)?;
        // SAFETY: `args` points at one value per parameter of `tq4_combine_items`, in order and
        // of its types (device pointers as CUdeviceptr, i32, f32; the output `batch × heads ×
        // head_dim` elements of the flagged type, checked by the callers), alive until the call returns
        // (the driver copies them); `seq_first` has batch + 1 entries naming items of the plan
        // the partials were sized for; the device pointers' guards above record the launch on
        // the stream for cudarc's read/write tracking.
        unsafe {
            sys::cuLaunchKernelEx(
                &raw const cfg,
                self.combine_items.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(driver)?;
        Ok(())
    }
}

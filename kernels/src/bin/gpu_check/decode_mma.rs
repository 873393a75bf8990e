//! The tensor-core decode checks (`tq4_decode_mma` and its forms): against the dense float64
//! reference, the CPU emulation of the fragment arithmetic, and across page layouts.

use std::sync::Arc;

use anyhow::Result;
use cudarc::driver::{CudaSlice, CudaStream};
use engram_kernels::DEFAULT_CHUNK;
use engram_kernels::glue;
use engram_kernels::gpu::{DecodeBatch, MmaWork, Tq4Kernels, plane_views};
use engram_kernels::mma::mma_decode_mass;
use engram_kernels::reference::{EncodedPlanes, rel_l2};
use engram_kernels::{PAGE, PageLayout, to_token_major};
use engram_kvcore::{Codec, CodecKind, CudaLayer, DEFAULT_ROTATION_SEED, SplitMix64};

use super::{act_to_host, variant_defines};

/// Every slot of a pool of `slots` pages once, in random order (a sequence's pages scattered
/// over the pool, as the block store hands them out after churn).
pub(crate) fn shuffled_slots(slots: usize, rng: &mut SplitMix64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..slots as u32).collect();
    for i in (1..slots).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    order
}

/// A layer's four planes on the device in kvcore's head-major pages and rewritten token-major.
pub(crate) type DevicePlanes = [CudaSlice<u8>; 4];
pub(crate) fn upload_both_layouts(
    stream: &Arc<CudaStream>,
    data: &EncodedPlanes,
    kv_heads: usize,
) -> Result<(DevicePlanes, DevicePlanes)> {
    let cb = data.k_codes.len() / data.k_norms.len() * 2;
    let [kc, kn, vc, vn] = [&data.k_codes, &data.k_norms, &data.v_codes, &data.v_norms];
    let head = [
        stream.clone_htod(kc)?,
        stream.clone_htod(kn)?,
        stream.clone_htod(vc)?,
        stream.clone_htod(vn)?,
    ];
    let token = [
        stream.clone_htod(&to_token_major(kc, cb, kv_heads))?,
        stream.clone_htod(&to_token_major(kn, 2, kv_heads))?,
        stream.clone_htod(&to_token_major(vc, cb, kv_heads))?,
        stream.clone_htod(&to_token_major(vn, 2, kv_heads))?,
    ];
    Ok((head, token))
}

/// The mass variant on head-major planes: whether its attention equals `plain` (the plain
/// kernel's output) bit for bit, and each sequence's page masses `[batch, max_blocks]`.
fn mass_run(
    stream: &Arc<CudaStream>,
    k: &Tq4Kernels,
    batch: &DecodeBatch<'_>,
    work: &mut MmaWork,
    plain: &[f32],
) -> Result<(bool, Vec<f32>)> {
    let (out, mass) = k.decode_attention_mma_mass(batch, PageLayout::HeadMajor, work, false)?;
    Ok((
        act_to_host(stream, Some(&out))? == plain,
        stream.clone_dtoh(&mass)?,
    ))
}

/// Tensor-core decode attention of one batch (`n` output floats, NaN-filled before) on
/// head-major planes, then on token-major ones.
fn decode_both_layouts<'a>(
    stream: &Arc<CudaStream>,
    k: &Tq4Kernels,
    work: &mut MmaWork,
    [head, token]: [&'a DevicePlanes; 2],
    batch: &dyn Fn(CudaLayer<'a>) -> DecodeBatch<'a>,
    n: usize,
) -> Result<[Vec<f32>; 2]> {
    let mut run = |layout, p: &'a DevicePlanes| -> Result<Vec<f32>> {
        let mut out_d = stream.clone_htod(&vec![f32::NAN; n])?;
        k.decode_attention_mma(&batch(plane_views(p.each_ref())), layout, work, &mut out_d)?;
        Ok(stream.clone_dtoh(&out_d)?)
    };
    Ok([
        run(PageLayout::HeadMajor, head)?,
        run(PageLayout::TokenMajor, token)?,
    ])
}

/// The tensor-core kernel against the dense reference, its CPU emulation and itself across
/// page layouts.
pub(crate) fn check_mma(stream: &Arc<CudaStream>, rng: &mut SplitMix64) -> Result<bool> {
    let mut ok = true;
    let lens = [1usize, 16, 37, 1000, 2085, 4611];
    let max_len = *lens.iter().max().unwrap_or(&1);
    let max_blocks = max_len.div_ceil(PAGE);
    for (head_dim, kv_heads) in [(64usize, 3usize), (128, 8)] {
        let codec = Codec::new(
            CodecKind::TurboQuant { bits: 4 },
            head_dim,
            DEFAULT_ROTATION_SEED,
        )?;
        let slots = lens.len() * max_blocks;
        let data = EncodedPlanes::random(&codec, slots, kv_heads, PAGE, rng, 1.0)?;
        let order = shuffled_slots(slots, rng);
        let tables: Vec<i32> = order.iter().map(|&s| s as i32).collect();
        let planes = data.planes();
        let (head, token) = upload_both_layouts(stream, &data, kv_heads)?;
        let tables_d = stream.clone_htod(&tables)?;
        let lens_i: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let lens_d = stream.clone_htod(&lens_i)?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        for group in [1usize, 3, 4, 8] {
            let heads = kv_heads * group;
            let k = Tq4Kernels::with_defines(
                stream.clone(),
                &codec,
                group,
                DEFAULT_CHUNK,
                &variant_defines(),
            )?;
            let q = rng.gaussian_vec(lens.len() * heads * head_dim);
            let q_d = stream.clone_htod(&q)?;
            let n = heads * head_dim;
            let want: Vec<Vec<f32>> = lens
                .iter()
                .enumerate()
                .map(|(b, &len)| {
                    let table = &order[b * max_blocks..][..max_blocks];
                    data.attend_dense(table, len, &q[b * n..][..n], heads)
                })
                .collect::<Result<_, _>>()?;
            for chunk in [None, Some(64), Some(8192)] {
                let mut work = k.mma_work(&lens, kv_heads, chunk)?;
                let mut emulated = vec![0f32; q.len()];
                let emulated_mass = mma_decode_mass(
                    &codec,
                    group,
                    work.plan(),
                    PageLayout::HeadMajor,
                    &q,
                    &planes,
                    &order,
                    max_blocks,
                    &lens,
                    scale,
                    &mut emulated,
                )?;
                let batch = |planes| DecodeBatch {
                    q: q_d.as_view(),
                    heads,
                    kv_heads,
                    planes,
                    block_tables: &tables_d,
                    max_blocks,
                    seq_lens: &lens_d,
                    batch: lens.len(),
                    max_len,
                    block_size: PAGE,
                    scale,
                };
                let outs =
                    decode_both_layouts(stream, &k, &mut work, [&head, &token], &batch, q.len())?;
                let same_layouts = outs[0] == outs[1];
                let no_nan = outs[0].iter().all(|v| v.is_finite());
                // The bf16 output (the engine's operand for the output projection): the f32
                // output rounded to nearest even, bit for bit.
                let bf16_out = k.decode_attention_mma_out(
                    &batch(plane_views(head.each_ref())),
                    PageLayout::HeadMajor,
                    &mut work,
                    true,
                )?;
                let bf16_rounded = act_to_host(stream, Some(&bf16_out))?
                    .iter()
                    .zip(&outs[0])
                    .all(|(g, f)| g.to_bits() == glue::round_bf16(*f).to_bits());
                // The mass variant: the same attention bit for bit, and each page's mass
                // against the dense softmax weights and the emulation.
                let (mass_same_output, mass) = mass_run(
                    stream,
                    &k,
                    &batch(plane_views(head.each_ref())),
                    &mut work,
                    &outs[0],
                )?;
                let chunk_used = work.plan().chunk;
                for (b, &len) in lens.iter().enumerate() {
                    let table = &order[b * max_blocks..][..max_blocks];
                    let dense = data.mass_dense(table, len, &q[b * n..][..n], heads);
                    let pages = len.div_ceil(PAGE);
                    let got: Vec<f32> = mass[b * max_blocks..][..pages].to_vec();
                    let dense32: Vec<f32> = dense.iter().map(|&x| x as f32).collect();
                    let err = rel_l2(&got, &dense32);
                    let emu = rel_l2(&got, &emulated_mass[b * max_blocks..][..pages]);
                    let sum: f64 = got.iter().map(|&x| f64::from(x)).sum();
                    let pass =
                        err <= 1e-3 && emu <= 1e-4 && (sum - 1.0).abs() < 1e-4 && mass_same_output;
                    ok &= pass;
                    println!(
                        "{{\"check\":\"tq4_decode_mma_mass\",\"head_dim\":{head_dim},\"group\":{group},\"kv_heads\":{kv_heads},\"tokens\":{len},\"chunk\":{chunk_used},\"mass_rel_l2\":{err:.3e},\"bound\":1e-3,\"rel_l2_vs_emulation\":{emu:.3e},\"emulation_bound\":1e-4,\"sum\":{sum:.6},\"output_identical\":{mass_same_output},\"pass\":{pass}}}"
                    );
                }
                for (b, &len) in lens.iter().enumerate() {
                    let got = &outs[0][b * n..][..n];
                    let err = rel_l2(got, &want[b]);
                    let emu = rel_l2(got, &emulated[b * n..][..n]);
                    let pass = err <= 2e-3 && emu <= 5e-4 && same_layouts && no_nan && bf16_rounded;
                    ok &= pass;
                    println!(
                        "{{\"check\":\"tq4_decode_mma\",\"head_dim\":{head_dim},\"group\":{group},\"kv_heads\":{kv_heads},\"tokens\":{len},\"chunk\":{chunk_used},\"rel_l2\":{err:.3e},\"bound\":2e-3,\"rel_l2_vs_emulation\":{emu:.3e},\"emulation_bound\":5e-4,\"layouts_identical\":{same_layouts},\"finite\":{no_nan},\"bf16_output_is_f32_rounded\":{bf16_rounded},\"pass\":{pass}}}"
                    );
                }
            }
        }
    }
    Ok(ok)
}

/// The wide head-major form (16-warp CTAs), which only a batch of long items over the whole card
/// takes: 16 sequences of 16,384 positions (8B shape), bitwise against token-major pages through
/// registers, the first sequence against the dense reference, the mass variant's output and
/// masses.
pub(crate) fn check_mma_wide(stream: &Arc<CudaStream>, rng: &mut SplitMix64) -> Result<bool> {
    let (head_dim, kv_heads, group, batch, len) = (128usize, 8usize, 4usize, 16usize, 16_384usize);
    let heads = kv_heads * group;
    let codec = Codec::new(
        CodecKind::TurboQuant { bits: 4 },
        head_dim,
        DEFAULT_ROTATION_SEED,
    )?;
    let max_blocks = len / PAGE;
    let slots = batch * max_blocks;
    let data = EncodedPlanes::random(&codec, slots, kv_heads, PAGE, rng, 1.0)?;
    let order = shuffled_slots(slots, rng);
    let tables: Vec<i32> = order.iter().map(|&s| s as i32).collect();
    let (head, token) = upload_both_layouts(stream, &data, kv_heads)?;
    let tables_d = stream.clone_htod(&tables)?;
    let lens = vec![len; batch];
    let lens_d = stream.clone_htod(&vec![len as i32; batch])?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let k = Tq4Kernels::with_defines(
        stream.clone(),
        &codec,
        group,
        DEFAULT_CHUNK,
        &variant_defines(),
    )?;
    let q = rng.gaussian_vec(batch * heads * head_dim);
    let q_d = stream.clone_htod(&q)?;
    let mut work = k.mma_work(&lens, kv_heads, None)?;
    let form = k.mma_form(&work, kv_heads, PageLayout::HeadMajor);
    let batch_of = |planes| DecodeBatch {
        q: q_d.as_view(),
        heads,
        kv_heads,
        planes,
        block_tables: &tables_d,
        max_blocks,
        seq_lens: &lens_d,
        batch,
        max_len: len,
        block_size: PAGE,
        scale,
    };
    let outs = decode_both_layouts(stream, &k, &mut work, [&head, &token], &batch_of, q.len())?;
    let same_layouts = outs[0] == outs[1];
    let (mass_same_output, mass) = mass_run(
        stream,
        &k,
        &batch_of(plane_views(head.each_ref())),
        &mut work,
        &outs[0],
    )?;
    let worst_sum = (0..batch)
        .map(|b| {
            let s: f64 = mass[b * max_blocks..][..max_blocks]
                .iter()
                .map(|&x| f64::from(x))
                .sum();
            (s - 1.0).abs()
        })
        .fold(0.0f64, f64::max);
    let n = heads * head_dim;
    let want = data.attend_dense(&order[..max_blocks], len, &q[..n], heads)?;
    let err = rel_l2(&outs[0][..n], &want);
    let finite = outs[0].iter().all(|v| v.is_finite());
    let pass =
        form.wide && same_layouts && mass_same_output && worst_sum < 1e-4 && err <= 2e-3 && finite;
    println!(
        "{{\"check\":\"tq4_decode_mma_wide\",\"head_dim\":{head_dim},\"group\":{group},\"kv_heads\":{kv_heads},\"batch\":{batch},\"tokens\":{len},\"chunk\":{},\"items\":{},\"wide\":{},\"layouts_identical\":{same_layouts},\"mass_output_identical\":{mass_same_output},\"worst_mass_sum_error\":{worst_sum:.2e},\"rel_l2_first\":{err:.3e},\"bound\":2e-3,\"finite\":{finite},\"pass\":{pass}}}",
        work.plan().chunk,
        work.plan().len(),
        form.wide
    );
    Ok(pass)
}

// Engram TurboQuant-4 kernels, compiled by NVRTC at run time with
//   -DHEAD_DIM=<64|128> -DGROUP=<query heads per KV head> -DCHUNK=<positions per split>
// Their CPU references are in engram-kvcore (Codec::encode, BlockStore::attend); the layout is
// kvcore's (engram_kvcore::LAYOUT, head-major blocks): per layer, codes [slot, kv_head, pos,
// HEAD_DIM/2] bytes (code i of a row in bits 4i..4i+4, least significant first) and norms
// [slot, kv_head, pos] as f16 bits. The tensor-core kernels also read token-major pages
// ([slot, pos, kv_head]; PageLayout::TokenMajor), which the bench and the checks compare.

#define WARP 32
#define CODE_BYTES (HEAD_DIM / 2)
#define THREADS 128
#define WARPS (THREADS / WARP)
#ifndef PPT
#define PPT 4  // positions per thread in the score phase
#endif
#ifndef VBYTES
#define VBYTES 8  // value-code bytes per lane in the value phase (4 or 8)
#endif
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}

// Round to nearest even (as candle's casts).
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// In-place fast Walsh-Hadamard transform of HEAD_DIM floats in shared memory by one warp; the
// butterflies pair exactly the elements kvcore's CPU transform pairs, in the same order.
__device__ __forceinline__ void fwht_warp(float* b, int lane) {
    for (int h = 1; h < HEAD_DIM; h <<= 1) {
        for (int i = lane; i < HEAD_DIM / 2; i += WARP) {
            int j = (i / h) * 2 * h + (i % h);
            float a = b[j], c = b[j + h];
            b[j] = a + c;
            b[j + h] = a - c;
        }
        __syncwarp();
    }
}

// Encodes the row in b (HEAD_DIM floats in shared memory, written by this lane's own indices
// i = lane, lane + 32, ...; overwritten) into row `out` of a code and norm plane, by one warp:
// norm, signs, Hadamard, scale, 15 thresholds, pack. tq4_encode and the fused layer glue
// (glue.cu) share it, so both write the same bytes as kvcore's Codec::encode.
__device__ __forceinline__ void encode_warp(float* b, int lane, const float* th,
                                            const float* __restrict__ signs, float rot_scale,
                                            size_t out, unsigned char* __restrict__ codes,
                                            unsigned short* __restrict__ norms) {
    float ss = 0.0f;
    for (int i = lane; i < HEAD_DIM; i += WARP) {
        float v = b[i];
        ss += v * v;
        b[i] = v * signs[i];
    }
    for (int o = WARP / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float n = sqrtf(ss);
    unsigned short nh = f32_to_f16(n);
    bool zero = f16_to_f32(nh) == 0.0f;
    __syncwarp();
    fwht_warp(b, lane);
    if (lane == 0) norms[out] = nh;
    float inv = 1.0f / n;
    for (int i = lane; i < CODE_BYTES; i += WARP) {
        unsigned int byte = 0;
        for (int k = 0; k < 2; k++) {
            float y = b[2 * i + k] * rot_scale;
            y = y * inv;
            unsigned int idx = 0;
            for (int t = 0; t < 15; t++) idx += th[t] < y ? 1u : 0u;
            byte |= idx << (4 * k);
        }
        codes[out * CODE_BYTES + i] = zero ? 0 : (unsigned char)byte;
    }
}

// Encodes `rows` rows of x (f32, HEAD_DIM each): row r goes to row dst[r] of the layer's code
// and norm planes. One warp per row (encode_warp).
extern "C" __global__ void tq4_encode(
    const float* __restrict__ x, int rows, const int* __restrict__ dst,
    const float* __restrict__ signs, const float* __restrict__ thresholds, float rot_scale,
    unsigned char* __restrict__ codes, unsigned short* __restrict__ norms) {
    __shared__ float buf[WARPS][HEAD_DIM];
    __shared__ float th[15];
    if (threadIdx.x < 15) th[threadIdx.x] = thresholds[threadIdx.x];
    __syncthreads();
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int r = blockIdx.x * WARPS + warp;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * HEAD_DIM;
    float* b = buf[warp];
    for (int i = lane; i < HEAD_DIM; i += WARP) b[i] = xr[i];
    encode_warp(b, lane, th, signs, rot_scale, (size_t)dst[r], codes, norms);
}

// Split-K paged decode attention over TQ4 codes, one CTA per (split, kv_head, sequence):
// the GROUP query heads of the KV head are rotated into shared memory once, then
// phase 1 scores CHUNK positions straight from the key codes (PPT positions per thread, the
// query read once per PPT positions; the value norms are read there too), phase 2 sums the
// value codes weighted by exp(s - m)·‖v‖ (CODE_BYTES/VBYTES lanes a row, 2·VBYTES dims a lane,
// several rows per warp pass, summed with shuffles at the end), and the CTA writes its
// (max, normalizer, rotated accumulator) per head for tq4_combine. PROFILE_SKIP_SCORES and
// PROFILE_SKIP_VALUES drop a phase (timing experiments only: the results are wrong).
extern "C" __global__ void __launch_bounds__(THREADS) tq4_decode_attention(
    const float* __restrict__ q, int heads, int kv_heads,
    const unsigned char* __restrict__ k_codes, const unsigned short* __restrict__ k_norms,
    const unsigned char* __restrict__ v_codes, const unsigned short* __restrict__ v_norms,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ seq_lens,
    int block_size, int splits,
    const float* __restrict__ signs, float rot_scale, const float* __restrict__ codebook,
    float scale,
    float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l) {
    __shared__ float qs[GROUP][HEAD_DIM];
    __shared__ float cb[16];
    __shared__ float p[GROUP][CHUNK];
    __shared__ float vns[CHUNK];
    __shared__ float red[GROUP][WARPS];
    __shared__ float accs[WARPS][GROUP][HEAD_DIM];
    int split = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
    int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    int len = seq_lens[b];
    int start = split * CHUNK;
    int end = min(start + CHUNK, len);
    size_t part = ((size_t)(b * kv_heads + g) * splits + split) * GROUP;
    if (start >= end) {
        for (int i = tid; i < GROUP * HEAD_DIM; i += THREADS) part_acc[part * HEAD_DIM + i] = 0.0f;
        if (tid < GROUP) {
            part_m[part + tid] = NEG_INF;
            part_l[part + tid] = 0.0f;
        }
        return;
    }
    if (tid < 16) cb[tid] = codebook[tid];
    // Rotate the group's queries: one warp per head.
    for (int h = warp; h < GROUP; h += WARPS) {
        const float* qh = q + ((size_t)b * heads + g * GROUP + h) * HEAD_DIM;
        for (int i = lane; i < HEAD_DIM; i += WARP) qs[h][i] = qh[i] * signs[i];
        __syncwarp();
        fwht_warp(qs[h], lane);
        for (int i = lane; i < HEAD_DIM; i += WARP) qs[h][i] *= rot_scale;
    }
    __syncthreads();
    const int* table = block_tables + (size_t)b * max_blocks;
    int n = end - start;

    // Phase 1: scores. Thread t takes positions t, t + THREADS, ... PPT at a time.
#ifdef PROFILE_SKIP_SCORES
    for (int t = tid; t < n; t += THREADS) {
        vns[t] = 1.0f;
        for (int h = 0; h < GROUP; h++) p[h][t] = 0.0f;
    }
    if (n < 0)
#endif
    for (int base = tid; base < n; base += PPT * THREADS) {
        const uint4* rows[PPT];
        float kn[PPT];
        bool live[PPT];
#pragma unroll
        for (int j = 0; j < PPT; j++) {
            int t = base + j * THREADS;
            live[j] = t < n;
            int pos = start + (live[j] ? t : 0);
            size_t row = ((size_t)table[pos / block_size] * kv_heads + g) * block_size + pos % block_size;
            rows[j] = (const uint4*)(k_codes + row * CODE_BYTES);
            kn[j] = f16_to_f32(k_norms[row]);
            if (live[j]) vns[t] = f16_to_f32(v_norms[row]);
        }
        float acc[PPT][GROUP];
#pragma unroll
        for (int j = 0; j < PPT; j++)
#pragma unroll
            for (int h = 0; h < GROUP; h++) acc[j][h] = 0.0f;
        for (int w4 = 0; w4 < CODE_BYTES / 16; w4++) {
            uint4 c[PPT];
#pragma unroll
            for (int j = 0; j < PPT; j++) c[j] = rows[j][w4];
#pragma unroll
            for (int wi = 0; wi < 4; wi++) {
                unsigned int word[PPT];
#pragma unroll
                for (int j = 0; j < PPT; j++)
                    word[j] = wi == 0 ? c[j].x : wi == 1 ? c[j].y : wi == 2 ? c[j].z : c[j].w;
                int d0 = (w4 * 4 + wi) * 8;
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    float kv[PPT];
#pragma unroll
                    for (int j = 0; j < PPT; j++) kv[j] = cb[(word[j] >> (4 * k)) & 15u];
#pragma unroll
                    for (int h = 0; h < GROUP; h++) {
                        float qv = qs[h][d0 + k];
#pragma unroll
                        for (int j = 0; j < PPT; j++) acc[j][h] = fmaf(qv, kv[j], acc[j][h]);
                    }
                }
            }
        }
        for (int j = 0; j < PPT; j++) {
            if (!live[j]) continue;
            for (int h = 0; h < GROUP; h++) p[h][base + j * THREADS] = acc[j][h] * kn[j] * scale;
        }
    }
    __syncthreads();
    // Max and normalizer per head (block reductions).
    float m[GROUP], l[GROUP];
    for (int h = 0; h < GROUP; h++) {
        float v = NEG_INF;
        for (int t = tid; t < n; t += THREADS) v = fmaxf(v, p[h][t]);
        for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) red[h][warp] = v;
    }
    __syncthreads();
    for (int h = 0; h < GROUP; h++) {
        float v = red[h][0];
        for (int w = 1; w < WARPS; w++) v = fmaxf(v, red[h][w]);
        m[h] = v;
    }
    __syncthreads();
    for (int h = 0; h < GROUP; h++) {
        float s = 0.0f;
        for (int t = tid; t < n; t += THREADS) {
            float e = __expf(p[h][t] - m[h]);
            p[h][t] = e * vns[t];  // the value row's norm folded into its weight
            s += e;
        }
        for (int o = WARP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) red[h][warp] = s;
    }
    __syncthreads();
    for (int h = 0; h < GROUP; h++) {
        float s = 0.0f;
        for (int w = 0; w < WARPS; w++) s += red[h][w];
        l[h] = s;
    }

    // Phase 2: values. LPR lanes share a row, VBYTES code bytes (2·VBYTES dims) each, so a warp
    // covers RPW rows per pass; two passes are loaded before the arithmetic. The weights carry
    // the value norm (folded in above); the RPW row slots are summed with shuffles at the end.
#define LPR (CODE_BYTES / VBYTES)
#define RPW (WARP / LPR)
#define VD (2 * VBYTES)
    __syncthreads();
    int slot = lane / LPR, lw = lane % LPR;
    float acc[GROUP][VD];
#pragma unroll
    for (int h = 0; h < GROUP; h++)
#pragma unroll
        for (int i = 0; i < VD; i++) acc[h][i] = 0.0f;
#ifdef PROFILE_SKIP_VALUES
    if (n > 0) {} else
#endif
    for (int t0 = warp * 2 * RPW; t0 < n; t0 += WARPS * 2 * RPW) {
        unsigned int cw[2][VBYTES / 4];
        int tt[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int t = t0 + u * RPW + slot;
            tt[u] = t;
            int pos = start + min(t, n - 1);
            size_t row = ((size_t)table[pos / block_size] * kv_heads + g) * block_size + pos % block_size;
            const unsigned int* src = (const unsigned int*)(v_codes + row * CODE_BYTES) + lw * (VBYTES / 4);
#pragma unroll
            for (int x = 0; x < VBYTES / 4; x++) cw[u][x] = t < n ? src[x] : 0u;
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            float w[GROUP];
#pragma unroll
            for (int h = 0; h < GROUP; h++) w[h] = tt[u] < n ? p[h][tt[u]] : 0.0f;
#pragma unroll
            for (int i = 0; i < VD; i++) {
                float c = cb[(cw[u][i / 8] >> (4 * (i % 8))) & 15u];
#pragma unroll
                for (int h = 0; h < GROUP; h++) acc[h][i] = fmaf(w[h], c, acc[h][i]);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < GROUP; h++)
#pragma unroll
        for (int i = 0; i < VD; i++) {
            float v = acc[h][i];
            for (int o = LPR; o < WARP; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (slot == 0) accs[warp][h][lw * VD + i] = v;
        }
    __syncthreads();
    for (int i = tid; i < GROUP * HEAD_DIM; i += THREADS) {
        int h = i / HEAD_DIM, d = i % HEAD_DIM;
        float s = 0.0f;
        for (int w = 0; w < WARPS; w++) s += accs[w][h][d];
        part_acc[part * HEAD_DIM + i] = s;
    }
#pragma unroll
    for (int h = 0; h < GROUP; h++) {
        if (tid == h) {
            part_m[part + h] = m[h];
            part_l[part + h] = l[h];
        }
    }
}

// Merges the splits of each (sequence, head) and rotates the result back to model space:
// out = signs ⊙ (H · acc / l) · rot_scale. One warp per (sequence, head).
extern "C" __global__ void tq4_combine(
    const float* __restrict__ part_acc, const float* __restrict__ part_m,
    const float* __restrict__ part_l, int heads, int kv_heads, int splits,
    const float* __restrict__ signs, float rot_scale, float* __restrict__ out) {
    __shared__ float buf[WARPS][HEAD_DIM];
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int bh = blockIdx.x * WARPS + warp;
    int b = blockIdx.y;
    if (bh >= heads) return;
    int h = bh, g = h / GROUP, gh = h % GROUP;
    size_t base = (size_t)(b * kv_heads + g) * splits;
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_m[(base + s) * GROUP + gh]);
    float total = 0.0f;
    float* y = buf[warp];
    for (int i = lane; i < HEAD_DIM; i += WARP) y[i] = 0.0f;
    for (int s = 0; s < splits; s++) {
        size_t k = (base + s) * GROUP + gh;
        float l = part_l[k];
        if (l == 0.0f) continue;
        float f = __expf(part_m[k] - mx);
        total += l * f;
        for (int i = lane; i < HEAD_DIM; i += WARP) y[i] += part_acc[k * HEAD_DIM + i] * f;
    }
    float inv = 1.0f / total;
    for (int i = lane; i < HEAD_DIM; i += WARP) y[i] *= inv;
    __syncwarp();
    fwht_warp(y, lane);
    float* o = out + ((size_t)b * heads + h) * HEAD_DIM;
    for (int i = lane; i < HEAD_DIM; i += WARP) o[i] = y[i] * signs[i] * rot_scale;
}

// Decodes rows of a layer's planes back to model space (kvcore's Codec::decode_rows):
// out row r = signs ⊙ (H · (codebook[codes] · norm)) · rot_scale for plane row src[r].
// One warp per row. Prefill attention reads the blocks of a chunk's context this way.
extern "C" __global__ void tq4_decode_rows(
    const unsigned char* __restrict__ codes, const unsigned short* __restrict__ norms,
    const int* __restrict__ src, int rows, const float* __restrict__ signs, float rot_scale,
    const float* __restrict__ codebook, float* __restrict__ out) {
    __shared__ float buf[WARPS][HEAD_DIM];
    __shared__ float cb[16];
    if (threadIdx.x < 16) cb[threadIdx.x] = codebook[threadIdx.x];
    __syncthreads();
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int r = blockIdx.x * WARPS + warp;
    if (r >= rows) return;
    size_t s = (size_t)src[r];
    float n = f16_to_f32(norms[s]);
    float* b = buf[warp];
    for (int i = lane; i < CODE_BYTES; i += WARP) {
        unsigned int c = codes[s * CODE_BYTES + i];
        b[2 * i] = cb[c & 15u] * n;
        b[2 * i + 1] = cb[c >> 4] * n;
    }
    __syncwarp();
    fwht_warp(b, lane);
    float* o = out + (size_t)r * HEAD_DIM;
    for (int i = lane; i < HEAD_DIM; i += WARP) o[i] = b[i] * signs[i] * rot_scale;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core decode attention: tq4_decode_mma + tq4_combine_items.
//
// Work items (sequence b, first position) come from the host plan (kernels/src/lib.rs,
// `ItemPlan`): every item covers `chunk` positions (a multiple of the 16-position page) of one
// sequence. A CTA of up to 8 warps (two an SM) or, on head-major pages for long items over the
// whole card, 16 warps (one an SM) holds `ipc` items of `wpi` = min(kv_heads, warps) warps, one
// warp per (item, KV head); the warp walks the item's pages one 16-position tile at a time:
//   scores  S^T[16 pos x 8] = K[16 x HEAD_DIM] . Q^T[HEAD_DIM x 8]   (mma.m16n8k16, f16 in, f32 acc)
//   values  O^T[HEAD_DIM x 8] += V^T[HEAD_DIM x 16] . P^T[16 x 8]
// with the GROUP query heads of the KV head in N = 8 (columns GROUP..7 are zero). Codes become
// f16 operands through a shared-memory pair table: entry `byte` = half2(codebook[byte & 15],
// codebook[byte >> 4]), one copy per bank (word address byte * 64 + lane), so a lookup is one
// PRMT + one conflict-free LDS per two values. The softmax runs in the log2 domain (the query is
// pre-scaled by rot_scale . scale . log2 e) and rescales lazily: the running max moves only when
// a tile's score passes it by more than LAZY, so P <= 2^LAZY; the value norm (times VSCALE, a
// power of two keeping P . |v| inside f16) folds into P before P is rounded to f16.
// Lane (r = lane / 4, c = lane % 4) of a warp:
// (positions inside a page below are MMA rows; MMA row m holds page position perm16(m))
//   keys:   bytes [BPL c, BPL c + BPL) of positions r and r + 8; k-step j reads bytes 2j, 2j+1
//           (dims 2 BPL c + 4j + {0,1} and + {2,3}); its Q fragment is the same dims of head r;
//   values: bytes [VB r, VB r + VB) of positions 2c, 2c+1, 2c+8, 2c+9; two positions' words are
//           interleaved nibble-wise so that one table entry is (V[p][d], V[p+1][d]); m-tile i
//           covers dims 2 VB r + 2i (row r) and 2 VB r + 2i + 1 (row r + 8);
//   output: m-tile i, heads 2c and 2c+1, dims 2 VB r + 2i + {0, 1}.
// The CPU emulation of exactly this fragment arithmetic is `mma::mma_decode`; CI runs it. The
// combine is launched as a programmatic dependent (PDL) of the attention grid.
// Page layout: row of (slot, pos, kv head) = slot . 16 . kv_heads + pos . pos_stride +
// head . head_stride (kvcore's head-major pages: pos_stride = 1, head_stride = 16; token-major
// pages: pos_stride = kv_heads, head_stride = 1).
#define BPL (HEAD_DIM / 8)
#define KSTEPS (HEAD_DIM / 16)
#define VB (HEAD_DIM / 16)
#define PAGE 16
#define LUT_WORDS (256 * 64)
#ifndef LAZY
#define LAZY 8.0f
#endif
#ifndef MMA_TMA
#define MMA_TMA 2  // pages of a warp's ring on head-major pages (the host's MMA_STAGES)
#endif
#define VSCALE 0.015625f
#define INV_VSCALE 64.0f

__device__ __forceinline__ unsigned int pack_half2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma16816(float* d, unsigned int a0, unsigned int a1,
                                         unsigned int a2, unsigned int a3, unsigned int b0,
                                         unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two f16 products, each rounded once (round to nearest even).
__device__ __forceinline__ unsigned int hmul2(unsigned int a, unsigned int b) {
    unsigned int r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ unsigned int movmatrix_t(unsigned int x) {
    unsigned int r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}


// Fills the pair table (LUT_WORDS words of shared memory at `lut`) by the CTA's threads: word
// byte . 64 + lane = half2(codebook[byte & 15], codebook[byte >> 4]), one copy per lane (words
// 0-31 of each 64-word row), so that a lookup is conflict-free.
__device__ __forceinline__ void fill_pair_table(unsigned int* lut,
                                                const float* __restrict__ codebook, int tid) {
    for (int i = tid; i < LUT_WORDS / 8; i += blockDim.x) {
        const int idx = i >> 3;
        const unsigned int v = pack_half2(codebook[idx & 15], codebook[idx >> 4]);
        *(uint4*)(lut + idx * 64 + (i & 7) * 4) = make_uint4(v, v, v, v);
    }
}

// Byte k of `word` looked up in the lane's copy of the pair table.
#define PAIR(lut, word, k, lane4) \
    (*(const unsigned int*)((lut) + __byte_perm((word), (lane4), 0x5504 | ((k) << 4))))

__device__ __forceinline__ unsigned int ldg_u32(const void* p) {
    unsigned int r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ uint2 ldg_u64(const void* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ uint4 ldg_u128(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ unsigned short ldg_u16(const void* p) {
    unsigned short r;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// The position inside a page that MMA row (score row, value k-index) m holds: rows 2, 3 (6, 7,
// ...) trade places, so that the positions of k-indices 2c (c = 0..3), which one value load of
// a warp reads, alternate between the two halves of the banks in a page staged in shared
// memory (`mma::perm` on the CPU).
__device__ __forceinline__ int perm16(int m) { return m ^ ((m >> 1) & 1); }

// One tile's bytes for one lane: loaded straight into registers by decode_mma (any page
// layout), read from a page staged in shared memory by decode_mma_tma (head-major pages; a copy
// ring filled by cp.async, LDGSTS, was measured slower: its traffic competes with the pair-table
// lookups for the L1 pipe, which the copy engine's does not).
struct MmaTile {
    unsigned int k0[BPL / 4], k1[BPL / 4];  // rows r, r + 8
    unsigned int v[4][VB / 4];              // positions 2c, 2c+1, 2c+8, 2c+9
    unsigned short kn0, kn1, vn0, vn1;      // norms of positions r, r + 8
};

// Loads tile bytes from per-lane bases (plane + this lane's offset inside a page) plus the
// page's first row; every other address is a fixed offset from those (an immediate when the
// strides are compile-time constants, MMA_KV_HEADS).
__device__ __forceinline__ void mma_load(MmaTile& t, const unsigned char* kb,
                                         const unsigned char* vb, const unsigned short* knb,
                                         const unsigned short* vnb, size_t page_row,
                                         int pos_stride, int vstep) {
    const unsigned char* kp = kb + page_row * CODE_BYTES;
    const unsigned char* vp = vb + page_row * CODE_BYTES;
    const unsigned short* knp = knb + page_row;
    const unsigned short* vnp = vnb + page_row;
    const int r8 = 8 * pos_stride * CODE_BYTES;
#if HEAD_DIM == 128
    const uint4 a = ldg_u128(kp), b = ldg_u128(kp + r8);
    t.k0[0] = a.x; t.k0[1] = a.y; t.k0[2] = a.z; t.k0[3] = a.w;
    t.k1[0] = b.x; t.k1[1] = b.y; t.k1[2] = b.z; t.k1[3] = b.w;
    uint2 w;
    w = ldg_u64(vp); t.v[0][0] = w.x; t.v[0][1] = w.y;
    w = ldg_u64(vp + vstep); t.v[1][0] = w.x; t.v[1][1] = w.y;
    w = ldg_u64(vp + r8); t.v[2][0] = w.x; t.v[2][1] = w.y;
    w = ldg_u64(vp + r8 + vstep); t.v[3][0] = w.x; t.v[3][1] = w.y;
#else
    const uint2 a = ldg_u64(kp), b = ldg_u64(kp + r8);
    t.k0[0] = a.x; t.k0[1] = a.y;
    t.k1[0] = b.x; t.k1[1] = b.y;
    t.v[0][0] = ldg_u32(vp);
    t.v[1][0] = ldg_u32(vp + vstep);
    t.v[2][0] = ldg_u32(vp + r8);
    t.v[3][0] = ldg_u32(vp + r8 + vstep);
#endif
    t.kn0 = ldg_u16(knp);
    t.kn1 = ldg_u16(knp + 8 * pos_stride);
    t.vn0 = ldg_u16(vnp);
    t.vn1 = ldg_u16(vnp + 8 * pos_stride);
}

// The softmax and accumulator state of one warp over one item.
struct MmaState {
    float o[KSTEPS][4];
    float m0, m1, l0, l1;
};

// Item `item` of the host plan (`ItemPlan`): (sequence, first position, end).
__device__ __forceinline__ int3 plan_item(const int* __restrict__ items, int item) {
    return make_int3(items[3 * item], items[3 * item + 1], items[3 * item + 2]);
}

// The block-table window of a warp's item: the entries of pages t_first + 32 blk .. + 32, one
// per lane (now), and of the 32 after (next, in flight), so that no load waits on another; a
// tile's slot reaches every lane through a shuffle.
struct PageWindow {
    const int* table;
    int t_first, t_end, lane, now, next, blk;
    __device__ __forceinline__ void open(const int* tab, int first, int end, int ln) {
        table = tab;
        t_first = first;
        t_end = end;
        lane = ln;
        blk = 0;
        now = first + ln < end ? tab[first + ln] : 0;
        next = first + 32 + ln < end ? tab[first + 32 + ln] : 0;
    }
    // The slot of tile u, moving the window when u enters the next block (calls in tile order,
    // u at most 32 pages past the block of the previous call; all lanes).
    __device__ __forceinline__ unsigned int slot(int u) {
        const int k = u - t_first;
        if ((k >> 5) != blk) {
            blk++;
            now = next;
            const int n = t_first + 32 * (blk + 1) + lane;
            next = n < t_end ? table[n] : 0;
        }
        return (unsigned int)__shfl_sync(0xffffffffu, now, k & 31);
    }
};

// The GROUP query heads of KV head g of sequence b, sign-flipped and rotated (the codes' basis)
// into the warp's `qs` (GROUP x HEAD_DIM floats).
__device__ __forceinline__ void rotate_queries(float* qs, const float* __restrict__ q, int b,
                                               int heads, int g,
                                               const float* __restrict__ signs, int lane) {
    for (int h = 0; h < GROUP; h++) {
        const float* qh = q + ((size_t)b * heads + g * GROUP + h) * HEAD_DIM;
        for (int i = lane; i < HEAD_DIM; i += WARP) qs[h * HEAD_DIM + i] = qh[i] * signs[i];
        __syncwarp();
        fwht_warp(qs + h * HEAD_DIM, lane);
    }
}

// The rotated queries of the lane's head r (fragment columns), scaled into f16 B fragments;
// zeros for r >= GROUP.
__device__ __forceinline__ void q_fragments(unsigned int (&qf)[KSTEPS][2], const float* qs, int r,
                                            int c, float qscale) {
#pragma unroll
    for (int j = 0; j < KSTEPS; j++) {
        if (r < GROUP) {
            const float* qr = qs + r * HEAD_DIM + (HEAD_DIM / 4) * c + 4 * j;
            qf[j][0] = pack_half2(qr[0] * qscale, qr[1] * qscale);
            qf[j][1] = pack_half2(qr[2] * qscale, qr[3] * qscale);
        } else {
            qf[j][0] = 0u;
            qf[j][1] = 0u;
        }
    }
}

__device__ __forceinline__ void mma_state_init(MmaState& st) {
#pragma unroll
    for (int i = 0; i < KSTEPS; i++) st.o[i][0] = st.o[i][1] = st.o[i][2] = st.o[i][3] = 0.0f;
    st.m0 = st.m1 = NEG_INF;
    st.l0 = st.l1 = 0.0f;
}

// The warp's partial of (item, KV head g): the accumulator at dims 2 VB r + 2i (+1) for heads
// 2c, 2c + 1, and per head the running max and the normalizer summed over the column's lanes.
__device__ __forceinline__ void mma_write_partial(const MmaState& st, int item, int kv_heads,
                                                  int g, int r, int c,
                                                  float* __restrict__ part_acc,
                                                  float* __restrict__ part_m,
                                                  float* __restrict__ part_l) {
    float l0 = st.l0, l1 = st.l1;
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const size_t part = ((size_t)item * kv_heads + g) * GROUP;
    const int h0 = 2 * c, h1 = 2 * c + 1;
#pragma unroll
    for (int i = 0; i < KSTEPS; i++) {
        const int dim = 2 * VB * r + 2 * i;
        if (h0 < GROUP)
            *(float2*)(part_acc + (part + h0) * HEAD_DIM + dim) =
                make_float2(st.o[i][0] * INV_VSCALE, st.o[i][2] * INV_VSCALE);
        if (h1 < GROUP)
            *(float2*)(part_acc + (part + h1) * HEAD_DIM + dim) =
                make_float2(st.o[i][1] * INV_VSCALE, st.o[i][3] * INV_VSCALE);
    }
    if (r == 0) {
        if (h0 < GROUP) {
            part_m[part + h0] = st.m0;
            part_l[part + h0] = l0;
        }
        if (h1 < GROUP) {
            part_m[part + h1] = st.m1;
            part_l[part + h1] = l1;
        }
    }
}

// Scores, lazy softmax and values of one 16-position tile (page index t) for one lane. With
// MASS, the tile's record for the attention mass: per query head of the lane's column pair, the
// running max after the tile (`tm[t]`, `tm[t + tstride]`) and what the tile added to the
// normalizer (`ta[...]`, summed over the 16 positions), written by the lanes of row 0.
template <bool MASS>
__device__ __forceinline__ void mma_tile(MmaState& st, const MmaTile& cur, int t, int start,
                                         int end, int r, const char* lut, unsigned int lane4,
                                         const unsigned int (&qf)[KSTEPS][2], float* tm,
                                         float* ta, int tstride, bool col0, bool col1,
                                         int pr) {
    float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef MMA_PROFILE_NO_QK  // timing experiments only: the results are wrong
    sa[0] = __int_as_float(cur.k0[0] & 0x3f000000u);
    sa[1] = __int_as_float(cur.k1[1] & 0x3f000000u);
    sa[2] = __int_as_float(cur.k0[2] & 0x3f000000u);
    sa[3] = __int_as_float(cur.k1[3] & 0x3f000000u);
#else
#pragma unroll
    for (int j = 0; j < KSTEPS; j++) {
        const unsigned int w0 = cur.k0[j >> 1], w1 = cur.k1[j >> 1];
        const int kb = (2 * j) & 3;
        const unsigned int q0 = qf[j][0], q1 = qf[j][1];
        mma16816(j & 1 ? sb : sa, PAIR(lut, w0, kb, lane4), PAIR(lut, w1, kb, lane4),
                 PAIR(lut, w0, kb + 1, lane4), PAIR(lut, w1, kb + 1, lane4), q0, q1);
    }
#endif
    const unsigned int span = (unsigned int)(end - start);
    const unsigned int p0 = (unsigned int)(t * PAGE + pr - start), p1 = p0 + 8u;
    const bool ok0 = p0 < span, ok1 = p1 < span;
    const float kn0 = f16_to_f32(cur.kn0), kn1 = f16_to_f32(cur.kn1);
    const float s0 = ok0 ? (sa[0] + sb[0]) * kn0 : NEG_INF;
    const float s1 = ok0 ? (sa[1] + sb[1]) * kn0 : NEG_INF;
    const float s2 = ok1 ? (sa[2] + sb[2]) * kn1 : NEG_INF;
    const float s3 = ok1 ? (sa[3] + sb[3]) * kn1 : NEG_INF;
    float x0 = fmaxf(s0, s2), x1 = fmaxf(s1, s3);
    if (__any_sync(0xffffffffu, x0 > st.m0 + LAZY || x1 > st.m1 + LAZY)) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
        }
        const float n0 = fmaxf(st.m0, x0), n1 = fmaxf(st.m1, x1);
        const float f0 = fast_exp2(st.m0 - n0), f1 = fast_exp2(st.m1 - n1);
        st.m0 = n0;
        st.m1 = n1;
        st.l0 *= f0;
        st.l1 *= f1;
#pragma unroll
        for (int i = 0; i < KSTEPS; i++) {
            st.o[i][0] *= f0;
            st.o[i][1] *= f1;
            st.o[i][2] *= f0;
            st.o[i][3] *= f1;
        }
    }
    const float e0 = fast_exp2(s0 - st.m0), e1 = fast_exp2(s1 - st.m1);
    const float e2 = fast_exp2(s2 - st.m0), e3 = fast_exp2(s3 - st.m1);
    st.l0 += e0 + e2;
    st.l1 += e1 + e3;
    if (MASS) {
        float a0 = e0 + e2, a1 = e1 + e3;
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            a0 += __shfl_xor_sync(0xffffffffu, a0, off);
            a1 += __shfl_xor_sync(0xffffffffu, a1, off);
        }
        if (r == 0) {
            if (col0) {
                tm[t] = st.m0;
                ta[t] = a0;
            }
            if (col1) {
                tm[t + tstride] = st.m1;
                ta[t + tstride] = a1;
            }
        }
    }
    const float vn0 = ok0 ? f16_to_f32(cur.vn0) * VSCALE : 0.0f;
    const float vn1 = ok1 ? f16_to_f32(cur.vn1) * VSCALE : 0.0f;
    const unsigned int pb0 = movmatrix_t(pack_half2(e0 * vn0, e1 * vn0));
    const unsigned int pb1 = movmatrix_t(pack_half2(e2 * vn1, e3 * vn1));
#pragma unroll
    for (int w = 0; w < VB / 4; w++) {
        const unsigned int A = cur.v[0][w], B = cur.v[1][w], C = cur.v[2][w], D = cur.v[3][w];
        const unsigned int elo = (A & 0x0F0F0F0Fu) | ((B << 4) & 0xF0F0F0F0u);
        const unsigned int olo = ((A >> 4) & 0x0F0F0F0Fu) | (B & 0xF0F0F0F0u);
        const unsigned int ehi = (C & 0x0F0F0F0Fu) | ((D << 4) & 0xF0F0F0F0u);
        const unsigned int ohi = ((C >> 4) & 0x0F0F0F0Fu) | (D & 0xF0F0F0F0u);
#ifdef MMA_PROFILE_NO_PV  // timing experiments only: the results are wrong
        st.o[w][0] += __int_as_float((elo ^ olo ^ ehi ^ ohi ^ pb0 ^ pb1) & 0x3f00ffffu);
#else
#pragma unroll
        for (int k = 0; k < 4; k++)
            mma16816(st.o[4 * w + k], PAIR(lut, elo, k, lane4), PAIR(lut, olo, k, lane4),
                     PAIR(lut, ehi, k, lane4), PAIR(lut, ohi, k, lane4), pb0, pb1);
#endif
    }
}

// Tensor-core decode attention on pages of any strides (the head-major form is decode_mma_tma
// below). A CTA holds `ipc` items of `wpi` warps (one KV head each):
// warp w works on item blockIdx.x . ipc + w / wpi of the host plan (`ItemPlan`: (sequence,
// start, end) triples), KV head blockIdx.y . wpi + w % wpi, and writes the partial of its
// (item, KV head); tq4_combine_items merges them. Dynamic shared memory: the 64 KB pair table,
// then each warp's rotated queries. The item's block-table entries and first tile are in flight
// while the CTA fills the pair table and rotates the queries; a warp loads tile t + 1 into
// registers while it computes tile t (two buffers, the loop unrolled by two); the block-table
// entries of 32 pages at a time sit one per lane (the next 32 in flight) and reach the loads
// through a shuffle, so no load waits on another.
// Measured and not kept (benches/results/2026-11-26-h100-decode/): a persistent form, warps
// walking several items with the pipeline running across them, 2-8 % slower (with the item loop
// ptxas no longer folds the pair table's base into the lookups: ~50 more integer instructions a
// tile); the combine folded into this kernel for sequences of few items (the last warp of a
// (sequence, KV head) merging, through a counter), 4-5 us slower than the PDL-launched combine.
// The body of tq4_decode_mma and tq4_decode_mma_mass; MASS adds the tiles' records (see
// mma_tile) at tile_m / tile_a [(item . kv_heads + g) . GROUP + h][tile of the item], `tstride`
// tiles a row.
template <bool MASS>
__device__ __forceinline__ void decode_mma(
    const float* __restrict__ q, int heads, int kv_heads,
    const unsigned char* __restrict__ k_codes, const unsigned short* __restrict__ k_norms,
    const unsigned char* __restrict__ v_codes, const unsigned short* __restrict__ v_norms,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ seq_lens,
    int pos_stride, int head_stride, const int* __restrict__ items, int n_items, int ipc,
    int wpi, const float* __restrict__ signs, const float* __restrict__ codebook, float qscale,
    float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l,
    float* __restrict__ tile_m, float* __restrict__ tile_a, int tstride) {
    extern __shared__ __align__(16) unsigned int smem[];
    (void)seq_lens;  // the plan's item ends already respect the lengths
#ifdef MMA_KV_HEADS
    // Strides fixed at compile time (the host checks they match the arguments).
    kv_heads = MMA_KV_HEADS;
#ifdef MMA_HEAD_MAJOR
    pos_stride = 1;
    head_stride = PAGE;
#else
    pos_stride = MMA_KV_HEADS;
    head_stride = 1;
#endif
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int item = blockIdx.x * ipc + warp / wpi;
    const int g = blockIdx.y * wpi + warp % wpi;
    const bool live = item < n_items && g < kv_heads && warp / wpi < ipc;
    const int r = lane >> 2, c = lane & 3, pr = perm16(r);
    const unsigned int lane4 = (unsigned int)lane << 2;
    // Per-lane offsets inside a page (rows of the planes, then bytes): keys and norms of
    // positions pr, pr + 8; values of positions perm16(2c) (+ 8) and, vstep bytes away,
    // perm16(2c + 1) (+ 8).
    const int hrow = g * head_stride;
    const int noff0 = pr * pos_stride + hrow;
    const int koff0 = noff0 * CODE_BYTES + BPL * c;
    const int voff0 = (perm16(2 * c) * pos_stride + hrow) * CODE_BYTES + VB * r;
    const int vstep = (c & 1 ? -pos_stride : pos_stride) * CODE_BYTES;
    const unsigned char* kb = k_codes + koff0;
    const unsigned char* vb = v_codes + voff0;
    const unsigned short* knb = k_norms + noff0;
    const unsigned short* vnb = v_norms + noff0;
    const size_t page_rows = (size_t)PAGE * kv_heads;
    float* qs = (float*)(smem + LUT_WORDS) + warp * GROUP * HEAD_DIM;
    const char* lut = (const char*)smem;

    const int3 it = live ? plan_item(items, item) : make_int3(0, 0, 0);
    const int b = it.x, start = it.y, end = it.z;
    const int t_first = start / PAGE, t_end = (end + PAGE - 1) / PAGE;
    PageWindow win;
    auto load = [&](MmaTile& buf, int u) {
        mma_load(buf, kb, vb, knb, vnb, (size_t)win.slot(u) * page_rows, pos_stride, vstep);
    };
    MmaTile ta, tb;
    if (live) {
        win.open(block_tables + (size_t)b * max_blocks, t_first, t_end, lane);
        load(ta, t_first);
    }
    fill_pair_table(smem, codebook, tid);
    if (live) rotate_queries(qs, q, b, heads, g, signs, lane);
    __syncthreads();
    if (!live) return;
    unsigned int qf[KSTEPS][2];
    q_fragments(qf, qs, r, c, qscale);

    MmaState st;
    mma_state_init(st);
    // The lane's records (MASS): its column pair's heads 2c, 2c + 1, indexed by page t.
    float *tm = nullptr, *tr = nullptr;
    const bool col0 = 2 * c < GROUP, col1 = 2 * c + 1 < GROUP;
    if (MASS) {
        const size_t row = (((size_t)item * kv_heads + g) * GROUP + 2 * c) * tstride;
        tm = tile_m + row - t_first;
        tr = tile_a + row - t_first;
    }
    for (int t = t_first; t < t_end; t += 2) {
        if (t + 1 < t_end) load(tb, t + 1);
        mma_tile<MASS>(st, ta, t, start, end, r, lut, lane4, qf, tm, tr, tstride, col0, col1, pr);
        if (t + 1 >= t_end) break;
        if (t + 2 < t_end) load(ta, t + 2);
        mma_tile<MASS>(st, tb, t + 1, start, end, r, lut, lane4, qf, tm, tr, tstride, col0, col1, pr);
    }
    // The combine (launched with programmatic dependent launch) may start its prologue now; it
    // waits for this grid's completion before it reads a partial.
    asm volatile("griddepcontrol.launch_dependents;");
    mma_write_partial(st, item, kv_heads, g, r, c, part_acc, part_m, part_l);
}

// Head-major pages staged through shared memory: each warp keeps a ring of MMA_TMA pages of its
// KV head (keys 16 x CODE_BYTES, values the same, then the two 16-entry norm runs: one head's
// rows of a page are contiguous in every plane), filled by the copy engine (cp.async.bulk, one
// lane issuing four copies a page, completion on the stage's mbarrier), so that MMA_TMA - 1
// pages are in flight while the warp computes one, without holding them in registers. The
// warp reads a page with conflict-free LDS (keys) and 2-way ones (values: the rows of k-indices
// 2c alternate between bank halves through perm16). The arithmetic is decode_mma's, operand for
// operand (the two agree bit for bit). Measured on an H200 at 32K batch 16
// (benches/results/2026-11-28-h200-diet/): 165 us in 16-warp CTAs against 180-192 us for the
// register double buffering, which holds one tile in flight a warp (the loads alone, without
// lookups or MMAs, took 144 us there: latency-bound); 2 stages beat 3 and 4 (166.7, 169.4 us).
#define TMA_STAGES MMA_TMA
#define STAGE_BYTES (2 * PAGE * CODE_BYTES + 4 * PAGE)
// The rotated queries live in the warp's ring until the fragments are built: in stages 1..
// when they fit there (the first page is then requested before the prologue), else from stage
// 0 on (every page requested after it).
#define QS_AFTER_STAGE0 (GROUP * HEAD_DIM * 4 <= (TMA_STAGES - 1) * STAGE_BYTES)
static_assert(TMA_STAGES >= 2 && GROUP * HEAD_DIM * 4 <= TMA_STAGES * STAGE_BYTES,
              "the rotated queries live in a warp's ring");

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(unsigned int bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
}
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int phase) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra WAIT;\n}" ::"r"(bar),
        "r"(phase)
        : "memory");
}
// Lane 0 of the warp: the four copies of page `slot` (head-row offset `hrow`) into stage `dst`.
__device__ __forceinline__ void stage_page(unsigned int dst, unsigned int bar,
                                           const unsigned char* k_codes,
                                           const unsigned char* v_codes,
                                           const unsigned short* k_norms,
                                           const unsigned short* v_norms, unsigned int slot,
                                           int kv_heads, int hrow) {
    const size_t row = (size_t)slot * PAGE * kv_heads + hrow;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"(STAGE_BYTES)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
        "l"(k_codes + row * CODE_BYTES), "r"(PAGE * CODE_BYTES), "r"(bar)
        : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst + PAGE * CODE_BYTES),
        "l"(v_codes + row * CODE_BYTES), "r"(PAGE * CODE_BYTES), "r"(bar)
        : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst + 2 * PAGE * CODE_BYTES),
        "l"(k_norms + row), "r"(2 * PAGE), "r"(bar)
        : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst + 2 * PAGE * CODE_BYTES + 2 * PAGE),
        "l"(v_norms + row), "r"(2 * PAGE), "r"(bar)
        : "memory");
}

template <bool MASS>
__device__ __forceinline__ void decode_mma_tma(
    const float* __restrict__ q, int heads, int kv_heads,
    const unsigned char* __restrict__ k_codes, const unsigned short* __restrict__ k_norms,
    const unsigned char* __restrict__ v_codes, const unsigned short* __restrict__ v_norms,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ seq_lens,
    int pos_stride, int head_stride, const int* __restrict__ items, int n_items, int ipc,
    int wpi, const float* __restrict__ signs, const float* __restrict__ codebook, float qscale,
    float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l,
    float* __restrict__ tile_m, float* __restrict__ tile_a, int tstride) {
    extern __shared__ __align__(128) unsigned int smem[];
    (void)seq_lens;
    (void)pos_stride;
    (void)head_stride;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int item = blockIdx.x * ipc + warp / wpi;
    const int g = blockIdx.y * wpi + warp % wpi;
    const bool live = item < n_items && g < kv_heads && warp / wpi < ipc;
    const int r = lane >> 2, c = lane & 3, pr = perm16(r);
    const unsigned int lane4 = (unsigned int)lane << 2;
    const int hrow = g * PAGE;
    const char* lut = (const char*)smem;
    // This warp's ring, then the CTA's mbarriers (one a stage and warp).
    unsigned char* ring = (unsigned char*)(smem + LUT_WORDS) + warp * TMA_STAGES * STAGE_BYTES;
    const unsigned int ring_s = smem_addr(ring);
    unsigned long long* bars =
        (unsigned long long*)((unsigned char*)(smem + LUT_WORDS) +
                              blockDim.x / WARP * TMA_STAGES * STAGE_BYTES) +
        warp * TMA_STAGES;
    const unsigned int bar_s = smem_addr(bars);
    float* qs = (float*)(ring + (QS_AFTER_STAGE0 ? STAGE_BYTES : 0));
    // Per-lane byte offsets inside a stage: keys of positions pr, pr + 8 (the second 8 rows
    // on), values of perm16(2c) and perm16(2c + 1) (+ 8 rows), norms of pr, pr + 8.
    const int koff = pr * CODE_BYTES + BPL * c;
    const int voffa = PAGE * CODE_BYTES + perm16(2 * c) * CODE_BYTES + VB * r;
    const int voffb = PAGE * CODE_BYTES + perm16(2 * c + 1) * CODE_BYTES + VB * r;
    const int noff = 2 * PAGE * CODE_BYTES + 2 * pr;

    const int3 it = live ? plan_item(items, item) : make_int3(0, 0, 0);
    const int b = it.x, start = it.y, end = it.z;
    const int t_first = start / PAGE, t_end = (end + PAGE - 1) / PAGE;
    PageWindow win;
    if (live) {
        if (lane == 0) {
            for (int s = 0; s < TMA_STAGES; s++) mbar_init(bar_s + 8 * s);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
        win.open(block_tables + (size_t)b * max_blocks, t_first, t_end, lane);
        if (QS_AFTER_STAGE0) {
            const unsigned int slot = win.slot(t_first);
            if (lane == 0 && t_first < t_end)
                stage_page(ring_s, bar_s, k_codes, v_codes, k_norms, v_norms, slot, kv_heads,
                           hrow);
        }
    }
    fill_pair_table(smem, codebook, tid);
    if (live) rotate_queries(qs, q, b, heads, g, signs, lane);
    __syncthreads();
    if (!live) return;
    unsigned int qf[KSTEPS][2];
    q_fragments(qf, qs, r, c, qscale);
    // The other stages now: the queries' shared memory is free (the copy engine's writes are
    // ordered after every lane's accesses by the proxy fence and the warp barrier).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    for (int s = QS_AFTER_STAGE0 ? 1 : 0; s < TMA_STAGES && t_first + s < t_end; s++) {
        const unsigned int slot = win.slot(t_first + s);
        if (lane == 0)
            stage_page(ring_s + s * STAGE_BYTES, bar_s + 8 * s, k_codes, v_codes, k_norms,
                       v_norms, slot, kv_heads, hrow);
    }

    MmaState st;
    mma_state_init(st);
    float *tm = nullptr, *tr = nullptr;
    const bool col0 = 2 * c < GROUP, col1 = 2 * c + 1 < GROUP;
    if (MASS) {
        const size_t row = (((size_t)item * kv_heads + g) * GROUP + 2 * c) * tstride;
        tm = tile_m + row - t_first;
        tr = tile_a + row - t_first;
    }
    int s = 0;
    unsigned int phase = 0;
    for (int t = t_first; t < t_end; t++) {
        mbar_wait(bar_s + 8 * s, phase);
        const unsigned char* pg = ring + s * STAGE_BYTES;
        MmaTile cur;
#if HEAD_DIM == 128
        const uint4 ka = *(const uint4*)(pg + koff), kb = *(const uint4*)(pg + koff + 8 * CODE_BYTES);
        cur.k0[0] = ka.x; cur.k0[1] = ka.y; cur.k0[2] = ka.z; cur.k0[3] = ka.w;
        cur.k1[0] = kb.x; cur.k1[1] = kb.y; cur.k1[2] = kb.z; cur.k1[3] = kb.w;
        uint2 w;
        w = *(const uint2*)(pg + voffa); cur.v[0][0] = w.x; cur.v[0][1] = w.y;
        w = *(const uint2*)(pg + voffb); cur.v[1][0] = w.x; cur.v[1][1] = w.y;
        w = *(const uint2*)(pg + voffa + 8 * CODE_BYTES); cur.v[2][0] = w.x; cur.v[2][1] = w.y;
        w = *(const uint2*)(pg + voffb + 8 * CODE_BYTES); cur.v[3][0] = w.x; cur.v[3][1] = w.y;
#else
        const uint2 ka = *(const uint2*)(pg + koff), kb = *(const uint2*)(pg + koff + 8 * CODE_BYTES);
        cur.k0[0] = ka.x; cur.k0[1] = ka.y;
        cur.k1[0] = kb.x; cur.k1[1] = kb.y;
        cur.v[0][0] = *(const unsigned int*)(pg + voffa);
        cur.v[1][0] = *(const unsigned int*)(pg + voffb);
        cur.v[2][0] = *(const unsigned int*)(pg + voffa + 8 * CODE_BYTES);
        cur.v[3][0] = *(const unsigned int*)(pg + voffb + 8 * CODE_BYTES);
#endif
        cur.kn0 = *(const unsigned short*)(pg + noff);
        cur.kn1 = *(const unsigned short*)(pg + noff + 16);
        cur.vn0 = *(const unsigned short*)(pg + noff + 2 * PAGE);
        cur.vn1 = *(const unsigned short*)(pg + noff + 2 * PAGE + 16);
        mma_tile<MASS>(st, cur, t, start, end, r, lut, lane4, qf, tm, tr, tstride, col0, col1, pr);
        // Every lane's reads of this stage are done (their values were used): refill it.
        __syncwarp();
        if (t + TMA_STAGES < t_end) {
            const unsigned int slot = win.slot(t + TMA_STAGES);
            if (lane == 0)
                stage_page(ring_s + s * STAGE_BYTES, bar_s + 8 * s, k_codes, v_codes, k_norms,
                           v_norms, slot, kv_heads, hrow);
        }
        if (++s == TMA_STAGES) {
            s = 0;
            phase ^= 1u;
        }
    }
    asm volatile("griddepcontrol.launch_dependents;");
    mma_write_partial(st, item, kv_heads, g, r, c, part_acc, part_m, part_l);
}

// The entry points: tq4_decode_mma reads pages of any strides through registers (token-major
// pages: the benches' and checks' comparison); tq4_decode_mma_hm reads kvcore's head-major
// pages (it does not read the strides from its arguments) staged through shared memory, in
// CTAs of up to 8 warps, two an SM, or (_wide) of up to 16 warps, one an SM, sharing one pair
// table: the host takes the wide form when its CTAs fill the card. The _mass forms also record,
// per (item, query head, page), the tile's running max and what it added to the normalizer
// (tile_m, tile_a: `tstride` pages a row, the plan's chunk / 16), which tq4_block_mass turns
// into each page's attention mass; their attention is the plain form's, bit for bit.
#define MMA_PARAMS                                                                              \
    const float* __restrict__ q, int heads, int kv_heads,                                       \
        const unsigned char* __restrict__ k_codes, const unsigned short* __restrict__ k_norms,  \
        const unsigned char* __restrict__ v_codes, const unsigned short* __restrict__ v_norms,  \
        const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ seq_lens, \
        int pos_stride, int head_stride, const int* __restrict__ items, int n_items, int ipc,   \
        int wpi, const float* __restrict__ signs, const float* __restrict__ codebook,           \
        float qscale, float* __restrict__ part_acc, float* __restrict__ part_m,                 \
        float* __restrict__ part_l
#define MASS_PARAMS float *__restrict__ tile_m, float *__restrict__ tile_a, int tstride
#define MMA_ARGS                                                                              \
    q, heads, kv_heads, k_codes, k_norms, v_codes, v_norms, block_tables, max_blocks, seq_lens, \
        pos_stride, head_stride, items, n_items, ipc, wpi, signs, codebook, qscale, part_acc,   \
        part_m, part_l
#define NARROW __launch_bounds__(256, 2)
#define WIDE __launch_bounds__(512, 1)
extern "C" __global__ void NARROW tq4_decode_mma(MMA_PARAMS) {
    decode_mma<false>(MMA_ARGS, nullptr, nullptr, 0);
}
extern "C" __global__ void NARROW tq4_decode_mma_mass(MMA_PARAMS, MASS_PARAMS) {
    decode_mma<true>(MMA_ARGS, tile_m, tile_a, tstride);
}
extern "C" __global__ void NARROW tq4_decode_mma_hm(MMA_PARAMS) {
    decode_mma_tma<false>(MMA_ARGS, nullptr, nullptr, 0);
}
extern "C" __global__ void NARROW tq4_decode_mma_mass_hm(MMA_PARAMS, MASS_PARAMS) {
    decode_mma_tma<true>(MMA_ARGS, tile_m, tile_a, tstride);
}
extern "C" __global__ void WIDE tq4_decode_mma_hm_wide(MMA_PARAMS) {
    decode_mma_tma<false>(MMA_ARGS, nullptr, nullptr, 0);
}
extern "C" __global__ void WIDE tq4_decode_mma_mass_hm_wide(MMA_PARAMS, MASS_PARAMS) {
    decode_mma_tma<true>(MMA_ARGS, tile_m, tile_a, tstride);
}

// The attention mass each page of a sequence receives from its decode query, averaged over the
// query heads (the masses of a sequence sum to 1): page j of item i (tile k = j - first page of
// i) gets (1 / heads) . sum_h a[h][k] . 2^(m[h][k] - M_h) / L_h, where M_h and L_h merge the
// items' partial maxima and normalizers as tq4_combine_items does. Grid (pages / 256, batch):
// each CTA merges every head's partials (a warp per head, its lanes over the items; into
// dynamic shared memory, 2 . heads floats), then a thread per page sums over the heads in
// order (loads of consecutive pages coalesce). Writes mass[b . max_blocks + j] for the
// sequence's pages (kvcore's BlockStore::attend_with_mass on the CPU).
extern "C" __global__ void __launch_bounds__(256) tq4_block_mass(
    const float* __restrict__ part_m, const float* __restrict__ part_l,
    const float* __restrict__ tile_m, const float* __restrict__ tile_a,
    const int* __restrict__ items, const int* __restrict__ seq_first, int heads, int kv_heads,
    int tstride, int max_blocks, float* __restrict__ mass) {
    extern __shared__ float mass_s[];
    float* mx_s = mass_s;
    float* inv_s = mass_s + heads;
    const int b = blockIdx.y;
    const int first = seq_first[b], last = seq_first[b + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int h = warp; h < heads; h += warps) {
        const int g = h / GROUP, gh = h % GROUP;
        float mx = NEG_INF;
        for (int i = first + lane; i < last; i += WARP)
            mx = fmaxf(mx, part_m[((size_t)i * kv_heads + g) * GROUP + gh]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float total = 0.0f;
        for (int i = first + lane; i < last; i += WARP) {
            const size_t p = ((size_t)i * kv_heads + g) * GROUP + gh;
            if (part_l[p] > 0.0f) total += part_l[p] * exp2f(part_m[p] - mx);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        if (lane == 0) {
            mx_s[h] = mx;
            inv_s[h] = total > 0.0f ? 1.0f / total : 0.0f;
        }
    }
    __syncthreads();
    if (last <= first) return;
    const int pages = (items[3 * (last - 1) + 2] + PAGE - 1) / PAGE;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= pages) return;
    const int i = first + j / tstride, k = j % tstride;
    const size_t row0 = (size_t)i * kv_heads * GROUP * tstride + k;
    float sum = 0.0f;
#pragma unroll 8
    for (int h = 0; h < heads; h++) {
        const float a = tile_a[row0 + (size_t)h * tstride];
        const float m = tile_m[row0 + (size_t)h * tstride];
        if (a > 0.0f) sum += a * exp2f(m - mx_s[h]) * inv_s[h];
    }
    mass[(size_t)b * max_blocks + j] = sum * (1.0f / (float)heads);
}

// Merges the items of each (sequence, head) (`seq_first[b] .. seq_first[b + 1]`, maxima in the
// log2 domain) and rotates the result back: out = signs . (H . acc / l) . rot_scale. One CTA of
// COMBINE_WARPS warps per (head, sequence): the warps stride over the items (independent loads,
// several in flight), each lane HEAD_DIM / 32 dims; warp 0 merges the warps' sums through shared
// memory, normalizes and rotates. A sequence without items gets zeros. The output is f32, or
// bf16 (rounded to nearest even) when out_bf16 is set: the output projection's operand.
#define COMBINE_WARPS 8
#define DPL (HEAD_DIM / WARP)
extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * WARP) tq4_combine_items(
    const float* __restrict__ part_acc, const float* __restrict__ part_m,
    const float* __restrict__ part_l, int heads, int kv_heads, const int* __restrict__ seq_first,
    const float* __restrict__ signs, float rot_scale, void* __restrict__ out, int out_bf16) {
    __shared__ float ys[COMBINE_WARPS][HEAD_DIM];
    __shared__ float ms[COMBINE_WARPS], ls[COMBINE_WARPS];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int h = blockIdx.x, b = blockIdx.y;
    const int g = h / GROUP, gh = h % GROUP;
    const int first = seq_first[b], last = seq_first[b + 1];
    // Launched as a programmatic dependent of tq4_decode_mma: wait for its partials (a no-op
    // when launched plainly).
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // Each warp's own max and sums (online over its items), merged below.
    float mx = NEG_INF;
    for (int s = first + warp; s < last; s += COMBINE_WARPS)
        mx = fmaxf(mx, part_m[((size_t)s * kv_heads + g) * GROUP + gh]);
    float y[DPL], total = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++) y[i] = 0.0f;
#pragma unroll 4
    for (int s = first + warp; s < last; s += COMBINE_WARPS) {
        const size_t k = ((size_t)s * kv_heads + g) * GROUP + gh;
        const float f = fast_exp2(part_m[k] - mx);  // 0 for an empty partial (m = -inf)
        total += part_l[k] * f;
        const float* a = part_acc + k * HEAD_DIM + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; i++) y[i] += a[i] * f;
    }
#pragma unroll
    for (int i = 0; i < DPL; i++) ys[warp][lane * DPL + i] = y[i];
    if (lane == 0) {
        ms[warp] = mx;
        ls[warp] = total;
    }
    __syncthreads();
    if (warp != 0) return;
    float gm = NEG_INF;
    for (int w = 0; w < COMBINE_WARPS; w++) gm = fmaxf(gm, ms[w]);
    float sum = 0.0f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[i] = 0.0f;
    for (int w = 0; w < COMBINE_WARPS; w++) {
        const float f = ms[w] == NEG_INF ? 0.0f : fast_exp2(ms[w] - gm);
        sum += ls[w] * f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] += ys[w][lane * DPL + i] * f;
    }
    __syncwarp();
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    float* yv = ys[0];
#pragma unroll
    for (int i = 0; i < DPL; i++) yv[lane * DPL + i] = acc[i] * inv;
    __syncwarp();
    fwht_warp(yv, lane);
    const size_t o = ((size_t)b * heads + h) * HEAD_DIM;
    for (int i = lane; i < HEAD_DIM; i += WARP) {
        const float v = yv[i] * signs[i] * rot_scale;
        if (out_bf16)
            ((unsigned short*)out)[o + i] = f32_to_bf16(v);
        else
            ((float*)out)[o + i] = v;
    }
}

// Reads n 16-byte words once (grid-stride, four loads in flight per thread) and keeps the XOR
// of all of them, one word per CTA: the read-bandwidth ceiling of the benches.
extern "C" __global__ void read_stream(const uint4* __restrict__ p, unsigned long long n,
                                       unsigned int* __restrict__ sink) {
    unsigned int x = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = ldg_u128(p + i), b = ldg_u128(p + i + stride);
        uint4 c = ldg_u128(p + i + 2 * stride), d = ldg_u128(p + i + 3 * stride);
        x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
             d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        uint4 v = ldg_u128(p + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    for (int o = 16; o > 0; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
    __shared__ unsigned int part[32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) x ^= part[w];
        sink[blockIdx.x] = x;
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core prefill attention over TQ4 codes: tq4_prefill_mma.
//
// Causal attention of one sequence's m new queries (positions start .. start + m) over its
// pages, flash-attention style. A CTA takes 16 . qtiles query positions of one KV head:
// GROUP . qtiles warps (the host's choice: 8 / GROUP, at least 1, so 6 to 8 warps and 96 to
// 128 query rows), warp w holding the 16 positions of query tile w / GROUP for query head
// w % GROUP (its rows, the A operand). Key/value positions go through shared memory PF_KT at a
// time: the tile's raw codes arrive by cp.async two tiles ahead, then all warps dequantize it
// once into one of two sets of f16 tiles (warps that finish computing tile t dequantize tile
// t + 1 while others still compute; one barrier a tile): each code byte through the pair table
// of tq4_decode_mma (two f16 centroids), value pairs times f16(norm . VSCALE) (one rounding),
// key norms kept apart in f32, into row-major [pos][dim] tiles whose 16-byte chunks are
// XOR-swizzled by the row, so that every ldmatrix is conflict-free; then every warp computes
//   S[16 x PF_KT] = Q[16 x HEAD_DIM] . K^T     (B fragments by ldmatrix from [pos][dim])
//   O[16 x HEAD_DIM] += P[16 x PF_KT] . V       (B fragments by ldmatrix.trans; P straight from
//                                                the S accumulators, rounded to f16)
// with an online softmax in the log2 domain (queries pre-scaled by rot_scale . scale . log2 e,
// S columns times their key norm, the causal mask only on tiles that reach the warp's rows, the
// accumulators rescaled only when a row's maximum moves). Queries are rotated into the
// codebook's space on entry and outputs rotated back on exit through shared memory that
// aliases the tiles. The CPU emulation of this tile formulation (same roundings, same tile
// order) is `prefill::prefill_tiles`; CI runs it against kvcore's dense reference.
#define PF_KT 64
#define PF_ROW_BYTES (HEAD_DIM * 2)
#define PF_CHUNKS (HEAD_DIM / 8)
#define PF_TILE_BYTES (PF_KT * PF_ROW_BYTES)

// Byte offset of (row, 16-byte chunk) in a swizzled tile.
__device__ __forceinline__ int pf_off(int row, int chunk) {
    return row * PF_ROW_BYTES + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ unsigned int smem_u32(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldsm_x4(unsigned int addr, unsigned int (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned int addr, unsigned int (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

extern "C" __global__ void __launch_bounds__(256) tq4_prefill_mma(
    const float* __restrict__ q, int m, int start, int heads, int kv_heads,
    const unsigned char* __restrict__ k_codes, const unsigned short* __restrict__ k_norms,
    const unsigned char* __restrict__ v_codes, const unsigned short* __restrict__ v_norms,
    const int* __restrict__ table, int pos_stride, int head_stride,
    int qtiles, const float* __restrict__ signs, const float* __restrict__ codebook,
    float qscale, float rot_scale, float* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char sm[];
    const int n_warps = blockDim.x >> 5;
    const int pf_qp = 16 * qtiles;
    // Two sets of f16 tiles (tile t in set t % 2), or (aliasing them) each warp's 16 rotated
    // rows; then three sets of norms (keys, then values; tile t in set t % 3), two sets of raw
    // codes (keys, then values; tile t in set t % 2) staged by cp.async two tiles ahead, and
    // the 64 KB pair table.
    const int rot_bytes = n_warps * 16 * HEAD_DIM * 4;
    const int main_bytes = 4 * PF_TILE_BYTES > rot_bytes ? 4 * PF_TILE_BYTES : rot_bytes;
    float* norms_s = (float*)(sm + main_bytes);
    unsigned char* raws_s = (unsigned char*)(norms_s + 3 * 2 * PF_KT);
    const char* lut = (const char*)(raws_s + 2 * 2 * PF_KT * CODE_BYTES);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int r = lane >> 2, c = lane & 3;
    const int g = blockIdx.y;
    const int hh = warp % GROUP, qt = warp / GROUP;
    const int head = g * GROUP + hh;
    const int i0 = blockIdx.x * pf_qp + qt * 16;  // the warp's first query (index in the chunk)
    const int cta_last = min(m, (int)(blockIdx.x + 1) * pf_qp);
    const int kend = start + cta_last;  // keys 0 .. kend
    // The pair table, as tq4_decode_mma's.
    fill_pair_table((unsigned int*)(raws_s + 2 * 2 * PF_KT * CODE_BYTES), codebook, tid);
    const unsigned int lane4 = (unsigned int)lane << 2;

    // Rotate the warp's 16 query rows into the codebook's space (shared memory aliasing the
    // tiles), then keep them as A fragments, scaled and rounded to f16.
    float* rot = (float*)sm + warp * 16 * HEAD_DIM;
    for (int row = 0; row < 16; row++) {
        const int i = i0 + row;
        float* b = rot + row * HEAD_DIM;
        if (i < m) {
            const float* qr = q + ((size_t)i * heads + head) * HEAD_DIM;
            for (int d = lane; d < HEAD_DIM; d += WARP) b[d] = qr[d] * signs[d];
        } else {
            for (int d = lane; d < HEAD_DIM; d += WARP) b[d] = 0.0f;
        }
        __syncwarp();
        fwht_warp(b, lane);
    }
    unsigned int qa[KSTEPS][4];
#pragma unroll
    for (int s = 0; s < KSTEPS; s++) {
        const float* x0 = rot + r * HEAD_DIM + 16 * s + 2 * c;
        const float* x1 = rot + (r + 8) * HEAD_DIM + 16 * s + 2 * c;
        qa[s][0] = pack_half2(x0[0] * qscale, x0[1] * qscale);
        qa[s][1] = pack_half2(x1[0] * qscale, x1[1] * qscale);
        qa[s][2] = pack_half2(x0[8] * qscale, x0[9] * qscale);
        qa[s][3] = pack_half2(x1[8] * qscale, x1[9] * qscale);
    }
    __syncthreads();

    const int qp0 = start + i0 + r, qp1 = qp0 + 8;  // positions of the lane's two rows
    const int warp_last = start + i0 + 15;
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const size_t page_rows = (size_t)PAGE * kv_heads;
    const int hrow = g * head_stride;

    // Stages tile t0 into raw set `set`: its raw key and value codes by cp.async (16 bytes a
    // copy, one group), its norms' bits into `pend` (one per thread of the first 2 . PF_KT; the
    // host keeps >= 4 warps), converted only when stored, so no thread waits on the load here.
    unsigned short pend = 0;
    const int n_threads = n_warps * WARP;
    auto stage = [&](int t0, int set) {
        unsigned char* raw_s = raws_s + set * 2 * PF_KT * CODE_BYTES;
        for (unsigned int e = tid; e < PF_KT * (CODE_BYTES / 16); e += n_threads) {
            const unsigned int j = e / (CODE_BYTES / 16), c16 = e % (CODE_BYTES / 16);
            const int p = t0 + (int)j;
            if (p < kend) {
                const size_t row = (size_t)table[p / PAGE] * page_rows + (p % PAGE) * pos_stride + hrow;
                const size_t src = row * CODE_BYTES + 16 * c16;
                const unsigned int dst = smem_u32(raw_s + j * CODE_BYTES + 16 * c16);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(k_codes + src));
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + PF_KT * CODE_BYTES),
                             "l"(v_codes + src));
            }
        }
        asm volatile("cp.async.commit_group;");
        if (tid < 2 * PF_KT) {
            const int j = tid % PF_KT, p = t0 + j;
            pend = 0;
            if (p < kend) {
                const size_t row = (size_t)table[p / PAGE] * page_rows + (p % PAGE) * pos_stride + hrow;
                pend = tid < PF_KT ? k_norms[row] : v_norms[row];
            }
        }
    };
    // Dequantizes tile t (starting at position t1) from its raw set into its f16 tiles, a key
    // chunk and the value chunk at the same place per step: each code byte through the pair
    // table (two f16 centroids), value pairs times f16(norm . VSCALE) (one rounding).
    auto dequant = [&](int t, int t1) {
        const unsigned char* raw_s = raws_s + (t & 1) * 2 * PF_KT * CODE_BYTES;
        const float* nrm = norms_s + (t % 3) * 2 * PF_KT;
        unsigned char* kt_s = sm + (t & 1) * 2 * PF_TILE_BYTES;
        unsigned char* vt_s = kt_s + PF_TILE_BYTES;
#pragma unroll 4
        for (unsigned int e = tid; e < PF_KT * PF_CHUNKS; e += n_threads) {
            const unsigned int j = e / PF_CHUNKS, ch = e % PF_CHUNKS;
            uint4 wk = make_uint4(0u, 0u, 0u, 0u), wv = wk;
            if (t1 + (int)j < kend) {
                const unsigned int kb = *(const unsigned int*)(raw_s + j * CODE_BYTES + 4 * ch);
                const unsigned int vb =
                    *(const unsigned int*)(raw_s + PF_KT * CODE_BYTES + j * CODE_BYTES + 4 * ch);
                const float f = nrm[PF_KT + j] * VSCALE;
                const unsigned int f2 = pack_half2(f, f);
                wk.x = PAIR(lut, kb, 0, lane4);
                wk.y = PAIR(lut, kb, 1, lane4);
                wk.z = PAIR(lut, kb, 2, lane4);
                wk.w = PAIR(lut, kb, 3, lane4);
                wv.x = hmul2(PAIR(lut, vb, 0, lane4), f2);
                wv.y = hmul2(PAIR(lut, vb, 1, lane4), f2);
                wv.z = hmul2(PAIR(lut, vb, 2, lane4), f2);
                wv.w = hmul2(PAIR(lut, vb, 3, lane4), f2);
            }
            const int off = pf_off((int)j, (int)ch);
            *(uint4*)(kt_s + off) = wk;
            *(uint4*)(vt_s + off) = wv;
        }
    };
    // One barrier a tile: in iteration t every warp computes tile t, then dequantizes tile
    // t + 1 into the other set while slower warps still compute (tile t + 2's codes are in
    // flight meanwhile); the barrier at the top of iteration t + 1 orders both.
    stage(0, 0);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    if (tid < 2 * PF_KT) norms_s[tid] = f16_to_f32(pend);
    __syncthreads();
    if (PF_KT < kend) stage(PF_KT, 1);
    dequant(0, 0);
    for (int t = 0, t0 = 0; t0 < kend; t++, t0 += PF_KT) {
        // Tile t + 1's codes (this thread's copies) and norms.
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        if (tid < 2 * PF_KT) norms_s[((t + 1) % 3) * 2 * PF_KT + tid] = f16_to_f32(pend);
        __syncthreads();
        // Tile t's raw set is free (dequantized before the barrier): stage tile t + 2 there.
        if (t0 + 2 * PF_KT < kend) stage(t0 + 2 * PF_KT, t & 1);
        const float* kn_s = norms_s + (t % 3) * 2 * PF_KT;
        const unsigned int k_base = smem_u32(sm + (t & 1) * 2 * PF_TILE_BYTES);
        const unsigned int v_base = k_base + PF_TILE_BYTES;
        if (t0 <= warp_last) {
            float s[PF_KT / 8][4];
#pragma unroll
            for (int n = 0; n < PF_KT / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks += 2) {
#pragma unroll
                for (int n = 0; n < PF_KT / 8; n++) {
                    unsigned int b[4];
                    ldsm_x4(k_base + pf_off(n * 8 + (lane & 7), 2 * ks + (lane >> 3)), b);
                    mma16816(s[n], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b[0], b[1]);
                    mma16816(s[n], qa[ks + 1][0], qa[ks + 1][1], qa[ks + 1][2], qa[ks + 1][3],
                             b[2], b[3]);
                }
            }
            // A tile wholly before the warp's first row (every key precedes every query of the
            // warp) needs no causal mask, and its rows' maxima are finite: no -inf guards.
            const bool full = t0 + PF_KT - 1 <= start + i0;
            float x0 = NEG_INF, x1 = NEG_INF;
            if (full) {
#pragma unroll
                for (int n = 0; n < PF_KT / 8; n++) {
                    const float2 kk2 = *(const float2*)(kn_s + n * 8 + 2 * c);
                    s[n][0] *= kk2.x;
                    s[n][1] *= kk2.y;
                    s[n][2] *= kk2.x;
                    s[n][3] *= kk2.y;
                    x0 = fmaxf(x0, fmaxf(s[n][0], s[n][1]));
                    x1 = fmaxf(x1, fmaxf(s[n][2], s[n][3]));
                }
            } else {
#pragma unroll
                for (int n = 0; n < PF_KT / 8; n++) {
                    const int pa = t0 + n * 8 + 2 * c, pb = pa + 1;
                    const float2 kk2 = *(const float2*)(kn_s + n * 8 + 2 * c);
                    s[n][0] = pa <= qp0 ? s[n][0] * kk2.x : NEG_INF;
                    s[n][1] = pb <= qp0 ? s[n][1] * kk2.y : NEG_INF;
                    s[n][2] = pa <= qp1 ? s[n][2] * kk2.x : NEG_INF;
                    s[n][3] = pb <= qp1 ? s[n][3] * kk2.y : NEG_INF;
                    x0 = fmaxf(x0, fmaxf(s[n][0], s[n][1]));
                    x1 = fmaxf(x1, fmaxf(s[n][2], s[n][3]));
                }
            }
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
                x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
            }
            const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
            // The accumulators are rescaled only when some row's maximum moved (a factor of
            // exactly 1 otherwise: skipping it changes no bit).
            if (!__all_sync(0xffffffffu, n0 == m0 && n1 == m1)) {
                // A row with nothing valid yet keeps m = -inf: its factors and weights are 0.
                const float f0 = n0 == NEG_INF ? 1.0f : fast_exp2(m0 - n0);
                const float f1 = n1 == NEG_INF ? 1.0f : fast_exp2(m1 - n1);
                l0 *= f0;
                l1 *= f1;
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; n++) {
                    o[n][0] *= f0;
                    o[n][1] *= f0;
                    o[n][2] *= f1;
                    o[n][3] *= f1;
                }
            }
            m0 = n0;
            m1 = n1;
            unsigned int pa[PF_KT / 16][4];
            if (full) {
#pragma unroll
                for (int n = 0; n < PF_KT / 8; n++) {
                    const float e0 = fast_exp2(s[n][0] - n0), e1 = fast_exp2(s[n][1] - n0);
                    const float e2 = fast_exp2(s[n][2] - n1), e3 = fast_exp2(s[n][3] - n1);
                    l0 += e0 + e1;
                    l1 += e2 + e3;
                    pa[n >> 1][(n & 1) * 2] = pack_half2(e0, e1);
                    pa[n >> 1][(n & 1) * 2 + 1] = pack_half2(e2, e3);
                }
            } else {
#pragma unroll
                for (int n = 0; n < PF_KT / 8; n++) {
                    const float e0 = n0 == NEG_INF ? 0.0f : fast_exp2(s[n][0] - n0);
                    const float e1 = n0 == NEG_INF ? 0.0f : fast_exp2(s[n][1] - n0);
                    const float e2 = n1 == NEG_INF ? 0.0f : fast_exp2(s[n][2] - n1);
                    const float e3 = n1 == NEG_INF ? 0.0f : fast_exp2(s[n][3] - n1);
                    l0 += e0 + e1;
                    l1 += e2 + e3;
                    pa[n >> 1][(n & 1) * 2] = pack_half2(e0, e1);
                    pa[n >> 1][(n & 1) * 2 + 1] = pack_half2(e2, e3);
                }
            }
#pragma unroll
            for (int kk = 0; kk < PF_KT / 16; kk++) {
#pragma unroll
                for (int dn = 0; dn < HEAD_DIM / 8; dn += 2) {
                    unsigned int b[4];
                    const int mat = lane >> 3;
                    ldsm_x4_t(v_base + pf_off(16 * kk + (mat & 1) * 8 + (lane & 7), dn + (mat >> 1)), b);
                    mma16816(o[dn], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[0], b[1]);
                    mma16816(o[dn + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[2], b[3]);
                }
            }
        }
        if (t0 + PF_KT < kend) dequant(t + 1, t0 + PF_KT);
    }
    __syncthreads();

    // Normalize, rotate back, write.
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const float inv0 = l0 > 0.0f ? INV_VSCALE / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? INV_VSCALE / l1 : 0.0f;
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; n++) {
        const int d = n * 8 + 2 * c;
        rot[r * HEAD_DIM + d] = o[n][0] * inv0;
        rot[r * HEAD_DIM + d + 1] = o[n][1] * inv0;
        rot[(r + 8) * HEAD_DIM + d] = o[n][2] * inv1;
        rot[(r + 8) * HEAD_DIM + d + 1] = o[n][3] * inv1;
    }
    __syncwarp();
    for (int row = 0; row < 16; row++) {
        const int i = i0 + row;
        if (i >= m) break;
        float* b = rot + row * HEAD_DIM;
        fwht_warp(b, lane);
        float* dst = out + ((size_t)i * heads + head) * HEAD_DIM;
        for (int d = lane; d < HEAD_DIM; d += WARP) dst[d] = b[d] * signs[d] * rot_scale;
    }
}

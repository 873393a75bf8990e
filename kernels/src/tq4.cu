// Engram TurboQuant-4 kernels, compiled by NVRTC at run time with
//   -DHEAD_DIM=<64|128> -DGROUP=<query heads per KV head> -DCHUNK=<positions per split>
// Their CPU references are in engram-kvcore (Codec::encode, BlockStore::attend); the layout is
// kvcore's: per layer, codes [slot, pos, kv_head, HEAD_DIM/2] bytes (code i of a row in bits
// 4i..4i+4, least significant first) and norms [slot, pos, kv_head] as f16 bits.

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

// Encodes `rows` rows of x (f32, HEAD_DIM each): row r goes to row dst[r] of the layer's code
// and norm planes. One warp per row: norm, signs, Hadamard, scale, 15 thresholds, pack.
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
    float ss = 0.0f;
    for (int i = lane; i < HEAD_DIM; i += WARP) {
        float v = xr[i];
        ss += v * v;
        b[i] = v * signs[i];
    }
    for (int o = WARP / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float n = sqrtf(ss);
    unsigned short nh = f32_to_f16(n);
    bool zero = f16_to_f32(nh) == 0.0f;
    __syncwarp();
    fwht_warp(b, lane);
    size_t out = (size_t)dst[r];
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
            size_t row = ((size_t)table[pos / block_size] * block_size + pos % block_size) * kv_heads + g;
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
            size_t row = ((size_t)table[pos / block_size] * block_size + pos % block_size) * kv_heads + g;
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

// Layer glue of the CUDA forward, fused: what candle did in ~28 launches a decoder layer
// (norms, casts, RoPE, key centering, encode, SwiGLU, residuals) in four; and the few-row bf16
// product of decode steps (gemv_bf16). Compiled in one NVRTC
// module with tq4.cu (same defines; encode_warp, fwht_warp and the f16/bf16 helpers come from
// there).
// Activations that feed a matrix product (and the products' outputs) are f32 or bf16: a flag per
// pointer, uniform over the launch. The arithmetic is the CPU engine's, in f32: bf16 values are
// widened exactly and rounded to nearest even on the way out, as candle's casts do.

__device__ __forceinline__ float load_act(const void* p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const unsigned short*)p)[i]) : ((const float*)p)[i];
}

__device__ __forceinline__ void store_act(void* p, size_t i, float v, int bf16) {
    if (bf16)
        ((unsigned short*)p)[i] = f32_to_bf16(v);
    else
        ((float*)p)[i] = v;
}

#define NORM_THREADS 1024
#define NORM_VEC 4  // float4 words a thread holds: rows of up to 4 . 4 . 1024 = 16384 values

// Residual and RMSNorm of one row per CTA: x[r] += delta[r] when delta is given, then
// out[r] = x[r] · rsqrt(mean(x[r]²) + eps) · w when w is given. Rows are read once into
// registers as float4 words (when dim is a multiple of 4 and every pointer 16-byte aligned;
// a scalar loop otherwise): at batch 1 this is one CTA, so the row's latency is the launch's.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) glue_add_rms_norm(
    float* __restrict__ x, const void* __restrict__ delta, int delta_bf16,
    const float* __restrict__ w, int dim, float eps, void* __restrict__ out, int out_bf16) {
    __shared__ float red[NORM_THREADS / WARP];
    const size_t row = (size_t)blockIdx.x * dim;
    float* xr = x + row;
    const int tid = threadIdx.x;
    const bool vec = dim % 4 == 0 && dim <= 4 * NORM_VEC * NORM_THREADS &&
                     ((size_t)x & 15) == 0 && ((size_t)w & 15) == 0 &&
                     ((size_t)delta & (delta_bf16 ? 7 : 15)) == 0 &&
                     ((size_t)out & (out_bf16 ? 7 : 15)) == 0;
    float ss = 0.0f;
    float4 v[NORM_VEC];
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (vec) {
        const int nv = dim / 4;
#pragma unroll
        for (int k = 0; k < NORM_VEC; k++) {
            const int i = tid + k * NORM_THREADS;
            if (i < nv) {
                float4 a = ((const float4*)xr)[i];
                if (delta != nullptr) {
                    float4 d;
                    if (delta_bf16) {
                        const uint2 b = ((const uint2*)delta)[row / 4 + i];
                        d = make_float4(bf16_to_f32(b.x & 0xffffu), bf16_to_f32(b.x >> 16),
                                        bf16_to_f32(b.y & 0xffffu), bf16_to_f32(b.y >> 16));
                    } else {
                        d = ((const float4*)delta)[row / 4 + i];
                    }
                    a.x += d.x;
                    a.y += d.y;
                    a.z += d.z;
                    a.w += d.w;
                    ((float4*)xr)[i] = a;
                }
                ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
                v[k] = a;
            }
        }
    } else {
        for (int i = tid; i < dim; i += NORM_THREADS) {
            float a = xr[i];
            if (delta != nullptr) {
                a += load_act(delta, row + i, delta_bf16);
                xr[i] = a;
            }
            ss += a * a;
        }
    }
    if (w == nullptr) return;
    for (int o = WARP / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const int warp = tid / WARP, lane = tid % WARP;
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_THREADS / WARP; k++) total += red[k];
    const float s = rsqrtf(total / (float)dim + eps);
    if (vec) {
        const int nv = dim / 4;
#pragma unroll
        for (int k = 0; k < NORM_VEC; k++) {
            const int i = tid + k * NORM_THREADS;
            if (i < nv) {
                const float4 g = ((const float4*)w)[i];
                const float4 a = v[k];
                const float4 y = make_float4(a.x * s * g.x, a.y * s * g.y, a.z * s * g.z,
                                             a.w * s * g.w);
                if (out_bf16) {
                    ((uint2*)out)[row / 4 + i] = make_uint2(
                        (unsigned int)f32_to_bf16(y.x) | ((unsigned int)f32_to_bf16(y.y) << 16),
                        (unsigned int)f32_to_bf16(y.z) | ((unsigned int)f32_to_bf16(y.w) << 16));
                } else {
                    ((float4*)out)[row / 4 + i] = y;
                }
            }
        }
    } else {
        for (int i = tid; i < dim; i += NORM_THREADS)
            store_act(out, row + i, xr[i] * s * w[i], out_bf16);
    }
}

// One warp per (token, head row) of qkv [n, (heads + 2·kv_heads)·HEAD_DIM] (the stacked q/k/v
// product): query heads are rotated by half-split RoPE at the token's position (cos and sin
// tables [positions, HEAD_DIM/2]) and written to q [n, heads, HEAD_DIM] (f32); key heads are
// rotated, centred by key_mean[kv_head] when given, and encoded into row
// dst[token · kv_heads + head] of the key planes; value heads are encoded into the value planes.
// RoPE and centering round each step as the CPU engine does, so the codes are the bytes
// kvcore's encode gives the CPU engine's rotated keys.
extern "C" __global__ void __launch_bounds__(THREADS) glue_qkv_rope_encode(
    const void* __restrict__ qkv, int qkv_bf16, int n, int heads, int kv_heads,
    const int* __restrict__ pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    const float* __restrict__ key_mean, const int* __restrict__ dst,
    const float* __restrict__ signs, const float* __restrict__ thresholds, float rot_scale,
    unsigned char* __restrict__ k_codes, unsigned short* __restrict__ k_norms,
    unsigned char* __restrict__ v_codes, unsigned short* __restrict__ v_norms,
    float* __restrict__ q) {
    __shared__ float buf[WARPS][HEAD_DIM];
    __shared__ float th[15];
    if (threadIdx.x < 15) th[threadIdx.x] = thresholds[threadIdx.x];
    __syncthreads();
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int per = heads + 2 * kv_heads;
    const int r = blockIdx.x * WARPS + warp;
    if (r >= n * per) return;
    const int t = r / per, c = r % per;
    const size_t src = (size_t)r * HEAD_DIM;
    float* b = buf[warp];
    for (int i = lane; i < HEAD_DIM; i += WARP) b[i] = load_act(qkv, src + i, qkv_bf16);
    __syncwarp();
    if (c < heads + kv_heads) {
        const size_t tab = (size_t)pos[t] * (HEAD_DIM / 2);
        const bool centre = c >= heads && key_mean != nullptr;
        const float* mean = key_mean + (size_t)(c - heads) * HEAD_DIM;
        for (int i = lane; i < HEAD_DIM / 2; i += WARP) {
            const float x1 = b[i], x2 = b[i + HEAD_DIM / 2];
            const float co = cos_t[tab + i], si = sin_t[tab + i];
            // Rounded step by step (no fused multiply-add), as the CPU engine computes it.
            float y1 = __fsub_rn(__fmul_rn(x1, co), __fmul_rn(x2, si));
            float y2 = __fadd_rn(__fmul_rn(x1, si), __fmul_rn(x2, co));
            if (centre) {
                y1 = __fsub_rn(y1, mean[i]);
                y2 = __fsub_rn(y2, mean[i + HEAD_DIM / 2]);
            }
            b[i] = y1;
            b[i + HEAD_DIM / 2] = y2;
        }
        __syncwarp();
        if (c < heads) {
            float* qr = q + ((size_t)t * heads + c) * HEAD_DIM;
            for (int i = lane; i < HEAD_DIM; i += WARP) qr[i] = b[i];
            return;
        }
    }
    const bool key = c < heads + kv_heads;
    const int h = key ? c - heads : c - heads - kv_heads;
    encode_warp(b, lane, th, signs, rot_scale, (size_t)dst[(size_t)t * kv_heads + h],
                key ? k_codes : v_codes, key ? k_norms : v_norms);
}

// act[r, i] = silu(gu[r, i]) · gu[r, ff + i] for gu [n, 2·ff] (the stacked gate/up product);
// grid (⌈ff / 256⌉, n), one element a thread.
extern "C" __global__ void __launch_bounds__(256) glue_swiglu(
    const void* __restrict__ gu, int gu_bf16, int n, int ff, void* __restrict__ act,
    int act_bf16) {
    const int j = blockIdx.x * 256 + threadIdx.x;
    if (j >= ff) return;
    const size_t r = blockIdx.y;
    const float g = load_act(gu, r * 2 * ff + j, gu_bf16);
    const float u = load_act(gu, r * 2 * ff + ff + j, gu_bf16);
    store_act(act, r * ff + j, g / (1.0f + expf(-g)) * u, act_bf16);
}

// y[r, j] = sum_i x[r, i] . w[j, i] for the few rows of a decode step (n <= GEMV_ROWS): the
// products' weights read once at the memory's pace, where cuBLAS's small-N kernels reach
// 2.5–3.9 TB/s of the H200's 4.5. bf16 in (x [n, k], w [m, k], both row-major), products exact
// in f32, sums in f32, y [n, m] rounded to bf16 (nearest even). One warp per output column j,
// GEMV_WARPS a CTA; each lane reads 16-byte words of w's row (8 values) four at a time, so that
// 2 KB per warp are in flight (a scalar loop instead when k is not a multiple of 8 or a pointer
// not 16-byte aligned); x comes through the read-only cache (every warp of the grid reads it).
#define GEMV_ROWS 4
#define GEMV_WARPS 8

__device__ __forceinline__ float dot8_bf16(uint4 a, uint4 b, float acc) {
    const unsigned int aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc = fmaf(__uint_as_float(aw[i] << 16), __uint_as_float(bw[i] << 16), acc);
        acc = fmaf(__uint_as_float(aw[i] & 0xffff0000u), __uint_as_float(bw[i] & 0xffff0000u), acc);
    }
    return acc;
}

// gemv_bf16's 16-byte path: lane's share of row j of w against the n rows of x, into acc.
__device__ __forceinline__ void gemv_words(const unsigned short* __restrict__ x, int n, int k,
                                           const unsigned short* __restrict__ w, int j, int lane,
                                           float (&acc)[GEMV_ROWS]) {
    const int words = k >> 3;
    const uint4* wr = (const uint4*)(w + (size_t)j * k);
    const uint4* xr = (const uint4*)x;
    int i = lane;
    for (; i + 3 * WARP < words; i += 4 * WARP) {
        uint4 wv[4];
#pragma unroll
        for (int u = 0; u < 4; u++) wv[u] = ldg_u128(wr + i + u * WARP);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            if (r < n) {
#pragma unroll
                for (int u = 0; u < 4; u++)
                    acc[r] = dot8_bf16(wv[u], __ldg(xr + (size_t)r * words + i + u * WARP), acc[r]);
            }
        }
    }
    for (; i < words; i += WARP) {
        const uint4 wv = ldg_u128(wr + i);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++)
            if (r < n) acc[r] = dot8_bf16(wv, __ldg(xr + (size_t)r * words + i), acc[r]);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP) gemv_bf16(
    const unsigned short* __restrict__ x, int n, int k, const unsigned short* __restrict__ w,
    int m, unsigned short* __restrict__ y) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= m) return;
    float acc[GEMV_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (((k & 7) | (int)(((size_t)x | (size_t)w) & 15)) != 0) {
        for (int i = lane; i < k; i += WARP) {
            const float wv = bf16_to_f32(w[(size_t)j * k + i]);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++)
                if (r < n) acc[r] = fmaf(bf16_to_f32(x[(size_t)r * k + i]), wv, acc[r]);
        }
    } else {
        gemv_words(x, n, k, w, j, lane, acc);
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        if (r < n) {
            float v = acc[r];
            for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) y[(size_t)r * m + j] = f32_to_bf16(v);
        }
    }
}

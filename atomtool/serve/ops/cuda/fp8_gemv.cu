// W8A8 FP8 block-scaled GEMV / skinny GEMM for decode (sm_90a), with the split-K reduced inside a thread-block
// cluster (no second kernel, no global partials).
//
// y[m, n] = sum_kb (q[m, kb] . w[n, kb]) * s_a[m, kb] * s_w[n / 128, kb]   (DeepSeek-V3 fp8_gemm after act_quant)
//
// Work split: a CTA owns 64 weight rows (4 warps x 16) of one K range and up to ROWS activation rows; the
// CLUSTER CTAs of a cluster own the same rows and consecutive K ranges. Each CTA quantizes its activation slice
// into shared memory once (per row and 128-wide group: s = max(amax, 1e-4) / 448, a power of two under
// ROUND_SCALE, q = e4m3_rn(a * (1 / s)): the Triton kernel's and torch_ref.act_quant_fp8's formula), then each
// warp streams its 16 weight rows with 16-byte loads kept DEPTH groups ahead in registers and multiplies them on
// the FP8 tensor cores (mma.sync m16n8k32 e4m3, weights as the 16-row A operand, activations as B: the "swap
// AB" of small-M FP8 GEMMs). Each 128-wide K group's product starts from zero and is promoted to the float32
// accumulator with its two scales (promotion every 128 elements, DeepSeek-V3 report section 3.3.2). The
// partials of the cluster's CTAs are summed in rank order through distributed shared memory (Hopper), so a
// row's bits depend on (N, K, the split) only, never on M or the other rows.
//
// K permutation: a thread (group g = lane / 4, t = lane % 4) loads 16 contiguous bytes of its rows per 64-wide
// chunk; the mma reads bytes [8h, 8h + 8) of them as its logical k = {4t..4t+3, 16+4t..16+4t+3}. The
// activation fragment is read with the same mapping, so every product pairs the same k; only the order of the
// sum inside one instruction differs from the plain layout.
//
// Compiled at first use by atomtool.serve.ops.cuda.build with -DROWS=.. -DDEPTH=.. (no headers needed).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef ROWS
#define ROWS 8
#endif
#ifndef DEPTH
#define DEPTH 4
#endif
#define NT (ROWS / 8)
#define WARPS 4
#define BLOCK_N (WARPS * 16)

struct __align__(16) V4 { u32 x, y, z, w; };

__device__ __forceinline__ V4 ldg_stream(const u8* p) {
    V4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ V4 lds128(u32 addr) {
    V4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(static_cast<u32>(b) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// two floats -> two e4m3 bytes (lo from a, hi from b), round to nearest even, saturating
__device__ __forceinline__ u16 f32x2_to_e4m3x2(float a, float b) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
    return r;
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ float ld_dsmem(u32 local_addr, u32 rank) {
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// the 4 x 16 bytes of one 128-wide K group a thread streams: rows g and g + 8, chunks 0 and 1
__device__ __forceinline__ void load_group(V4 (&b)[4], const u8* ra, const u8* rb, int off, bool oka, bool okb) {
    const V4 z = {0u, 0u, 0u, 0u};
    b[0] = oka ? ldg_stream(ra + off) : z;
    b[1] = oka ? ldg_stream(ra + off + 64) : z;
    b[2] = okb ? ldg_stream(rb + off) : z;
    b[3] = okb ? ldg_stream(rb + off + 64) : z;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
fp8_gemv_w8a8(const u16* __restrict__ x, long long s_xm, const u8* __restrict__ w, const float* __restrict__ ws,
              int s_wsn, const u16* __restrict__ bias, u16* __restrict__ out, long long s_om, int M, int N, int K,
              int k_chunk, int round_scale, int early_weights) {
    extern __shared__ __align__(16) u8 smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.y * BLOCK_N, m0 = blockIdx.z * ROWS;
    const int k0 = blockIdx.x * k_chunk;
    const int kc = min(K, k0 + k_chunk) - k0;  // multiple of 128 (checked by the host)
    const int G = kc >> 7;
    const int q_stride = k_chunk + 16;        // bytes per activation row in shared memory (+16: bank spread)
    u8* q_s = smem;                                                   // [ROWS][q_stride] e4m3
    float* sa_s = reinterpret_cast<float*>(smem + ROWS * q_stride);   // [ROWS][k_chunk / 128]
    float* red_s = sa_s + ROWS * (k_chunk >> 7);                      // [ROWS][BLOCK_N] float32 partials
    float* sw_s = red_s + ROWS * BLOCK_N;                             // [k_chunk / 128] weight block scales
    const int gpr = k_chunk >> 7;

    const int ra = n0 + warp * 16 + g, rb = ra + 8;
    const bool oka = ra < N, okb = rb < N;
    const u8* wa = w + static_cast<long long>(oka ? ra : 0) * K + k0 + t * 16;
    const u8* wb = w + static_cast<long long>(okb ? rb : 0) * K + k0 + t * 16;
    // the 64-row tile lies inside one 128-row scale block: one scale per K group for the whole CTA
    const float* ws_row = ws + static_cast<long long>(n0 >> 7) * s_wsn + (k0 >> 7);

    V4 buf[DEPTH][4];
    if (early_weights) {  // weights are immutable: start streaming them before the previous kernel finishes
#pragma unroll
        for (int d = 0; d < DEPTH; d++)
            if (d < G) load_group(buf[d], wa, wb, d << 7, oka, okb);
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!early_weights) {
#pragma unroll
        for (int d = 0; d < DEPTH; d++)
            if (d < G) load_group(buf[d], wa, wb, d << 7, oka, okb);
    }
    for (int i = tid; i < G; i += WARPS * 32) sw_s[i] = ws_row[i];

    // activation quantization: half a warp per (row, group), 8 values per lane
    const int rows = min(ROWS, M - m0);
    {
        const int half = lane >> 4, l16 = lane & 15;
        // U items per half-warp per pass, all loads issued before any is used (one memory round trip per pass,
        // not per item); the loop runs the same number of times on every lane (the shuffles need all 32)
        constexpr int U = 4;
        const int items = rows * G;
        for (int base = (warp * 2 + half) * U; base - half * U < items; base += WARPS * 2 * U) {
            V4 raw[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int it = base + u;
                if (it < items) {
                    const int r = it / G, gi = it - r * G;
                    raw[u] = *reinterpret_cast<const V4*>(x + static_cast<long long>(m0 + r) * s_xm + k0 + (gi << 7) +
                                                          l16 * 8);
                } else {
                    raw[u] = V4{0u, 0u, 0u, 0u};
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int it = base + u;
                const u32 wd[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
                float v[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    v[2 * i] = __uint_as_float(wd[i] << 16);
                    v[2 * i + 1] = __uint_as_float(wd[i] & 0xFFFF0000u);
                }
                float amax = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                amax = fmaxf(amax, 1e-4f);
                float s = __fdiv_rn(amax, 448.0f);
                if (round_scale) s = __uint_as_float((__float_as_uint(s) + 0x7FFFFFu) & 0x7F800000u);
                const float inv = __fdiv_rn(1.0f, s);
                const u32 p0 = f32x2_to_e4m3x2(v[0] * inv, v[1] * inv) |
                               (static_cast<u32>(f32x2_to_e4m3x2(v[2] * inv, v[3] * inv)) << 16);
                const u32 p1 = f32x2_to_e4m3x2(v[4] * inv, v[5] * inv) |
                               (static_cast<u32>(f32x2_to_e4m3x2(v[6] * inv, v[7] * inv)) << 16);
                if (it < items) {
                    const int r = it / G, gi = it - r * G;
                    *reinterpret_cast<u64*>(q_s + r * q_stride + (gi << 7) + l16 * 8) =
                        static_cast<u64>(p0) | (static_cast<u64>(p1) << 32);
                    if (l16 == 0) sa_s[r * gpr + gi] = s;
                }
            }
        }
    }
    __syncthreads();

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;

    const u32 q_base = smem_addr(q_s) + t * 16;
    for (int g0 = 0; g0 < G; g0 += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; d++) {
            const int gi = g0 + d;
            if (gi < G) {
                float part[NT][4];
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) part[j][i] = 0.f;
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const V4 A = buf[d][c], B = buf[d][2 + c];
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        const V4 q = lds128(q_base + (j * 8 + g) * q_stride + (gi << 7) + c * 64);
                        mma_e4m3(part[j], A.x, B.x, A.y, B.y, q.x, q.y);
                        mma_e4m3(part[j], A.z, B.z, A.w, B.w, q.z, q.w);
                    }
                }
                if (gi + DEPTH < G) load_group(buf[d], wa, wb, (gi + DEPTH) << 7, oka, okb);
                const float sw = sw_s[gi];
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const float s0 = sw * sa_s[(j * 8 + t * 2) * gpr + gi];
                    const float s1 = sw * sa_s[(j * 8 + t * 2 + 1) * gpr + gi];
                    acc[j][0] += part[j][0] * s0;
                    acc[j][1] += part[j][1] * s1;
                    acc[j][2] += part[j][2] * s0;
                    acc[j][3] += part[j][3] * s1;
                }
            }
        }
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

    // partials to shared memory as [activation row][weight row]; c0/c1: weight row g, activation rows 2t, 2t + 1
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int wr = warp * 16 + g, ar = j * 8 + t * 2;
        red_s[ar * BLOCK_N + wr] = acc[j][0];
        red_s[(ar + 1) * BLOCK_N + wr] = acc[j][1];
        red_s[ar * BLOCK_N + wr + 8] = acc[j][2];
        red_s[(ar + 1) * BLOCK_N + wr + 8] = acc[j][3];
    }
    cluster_sync();
    const u32 rank = cluster_rank(), csize = gridDim.x;
    const u32 red_base = smem_addr(red_s);
    for (int e = rank * (WARPS * 32) + tid; e < rows * BLOCK_N; e += csize * (WARPS * 32)) {
        const int ar = e / BLOCK_N, wr = e - ar * BLOCK_N;
        if (n0 + wr >= N) continue;
        float sum = ld_dsmem(red_base + e * 4, 0);
        for (u32 p = 1; p < csize; p++) sum += ld_dsmem(red_base + e * 4, p);
        if (bias) sum += bf16_to_f32(bias[n0 + wr]);
        out[static_cast<long long>(m0 + ar) * s_om + n0 + wr] = f32_to_bf16(sum);
    }
    cluster_sync();  // keep this CTA's partials alive until every peer has read them
}

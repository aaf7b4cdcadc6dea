// Sparse/dense MLA decode, second half: merge each decode row's split-KV chunk partials and multiply the merged
// latent row by W_UV, per head (the absorbed form's value up-projection, DeepSeek-V2 section 2.1), for sm_80+.
// The contract of _mla_merge_uv_kernel in atomtool/serve/ops/triton/mla.py, for kv_lora_rank R = 512,
// v_head_dim DV = 128, bf16 outputs, W_UV FP8 with per-row block scales or bf16.
//
// For decode row b (cu_q[b + 1] - cu_q[b] == 1) and head h, with the row's n_row chunks (from its own key count):
//   m = max_c m_c, w_c = exp2(m_c - m), L = sum_c w_c l_c (chunk order),
//   o_lat[r] = bf16(sum_c w_c acc_c[r] / L) (chunk order), out[q_start, h, v] = bf16(sum_r o_lat[r] W_UV[h, v, r]).
//
// Why CUDA: at batch 1 the Triton kernel's 16-row tile keeps 16 chunk partials x 128 latent features x 16 rows in
// registers per step, so its four latent steps are four dependent L2 round trips, each followed by W_UV's widening
// and layout shuffles; the merge took ~13 us after the split kernel ended (docs/PERFORMANCE.md). Here:
//   * before the PDL wait (while the split kernel runs): W_UV[h] is read once and widened into shared memory as
//     bf16 (fp8 * scale rounded once from float32, the dequant_fp8_block formula), rows padded for ldmatrix;
//   * after it: each thread loads every chunk's (m, l) and its four latent features of every chunk for one row in
//     one round trip (two rows per pass, only the tile's rows below B), merges them in registers, and writes the
//     bf16 row to shared memory;
//   * the [16 rows x 512] x [512 x 128] product on the tensor cores (mma.sync m16n8k16 bf16, float32 accumulate,
//     32 k-steps in latent order), 8 warps x 16 output features.
// A row's bits depend only on its own partials: the same at every batch size.
//
// Compiled at first use by atomtool.serve.ops.cuda.build with -DN_CHUNKS=.. (no headers needed).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#ifndef N_CHUNKS
#define N_CHUNKS 16
#endif
#define R 512
#define DV 128
#define ROWS 16
#define THREADS 256
#define SPAN_ALIGN 64
#define W_STRIDE (R + 8)   // bf16 elements per shared W row: +16 bytes so ldmatrix's 8 rows hit 8 bank groups
#define O_STRIDE (R + 8)

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// two e4m3 bytes (lo, hi of a u16) -> two floats, exactly (e4m3 values are f16 values)
__device__ __forceinline__ void e4m3x2_to_f32(u16 v, float& lo, float& hi) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    u16 l16 = static_cast<u16>(h2 & 0xffffu), h16 = static_cast<u16>(h2 >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(l16));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h16));
}

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& a0, u32& a1, u32& a2, u32& a3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// grid (ceil(B / ROWS), H), THREADS threads, dynamic shared memory (DV * W_STRIDE + ROWS * O_STRIDE) * 2 bytes.
// ws_acc [B, N_CHUNKS, H, R] f32, ws_ml [B, N_CHUNKS, H, 2] f32; w: W_UV [H, DV, R] (fp8 bytes when has_scale, else
// bf16) with element strides (s_wh, s_wv, 1); sc: [H, DV, ceil(R / bk)] f32 with strides (s_sh, s_sv, 1); out: bf16
// with strides (s_ot, s_oh, 1); n_keys of a row: K (sparse) or seq_lens[b].
extern "C" __global__ void __launch_bounds__(THREADS, 1)
mla_merge_uv(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml, const u8* __restrict__ w,
             const float* __restrict__ sc, u16* __restrict__ out, const int* __restrict__ cu_q,
             const int* __restrict__ seq_lens, int B, int H, int K, int bk, long long s_wh, long long s_wv,
             long long s_sh, long long s_sv, long long s_ot, long long s_oh, int sparse, int span_min,
             int has_scale, int use_pdl) {
    extern __shared__ __align__(16) u16 smem[];
    u16* w_s = smem;                       // [DV][W_STRIDE] bf16
    u16* o_s = smem + DV * W_STRIDE;       // [ROWS][O_STRIDE] bf16
    __shared__ int q_start_s[ROWS];
    __shared__ int dec_s[ROWS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.y, b0 = blockIdx.x * ROWS;

    // 1. W_UV[h] widened into shared memory (immutable: before the PDL wait), 16 latent features per piece. Every
    //    piece's load is issued before any is converted: a CTA that starts only when the split kernel frees its SM
    //    (at batch 1 the split's CTAs fill 32 SMs) then waits one memory round trip for W_UV, not one per piece.
    constexpr int PIECES = DV * (R / 16) / THREADS;
    static_assert(DV * (R / 16) % THREADS == 0, "W_UV pieces per thread");
    uint4 raw[PIECES];
    float s[PIECES];
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
        const int i = tid + j * THREADS, v = i / (R / 16), r0 = (i % (R / 16)) * 16;
        if (has_scale) {
            raw[j] = *reinterpret_cast<const uint4*>(w + h * s_wh + v * s_wv + r0);
            s[j] = sc[h * s_sh + v * s_sv + r0 / bk];
        } else {
            raw[j] = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(w) + h * s_wh + v * s_wv + r0);
            s[j] = 0.f;
        }
    }
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
        const int i = tid + j * THREADS, v = i / (R / 16), r0 = (i % (R / 16)) * 16;
        uint4* dst = reinterpret_cast<uint4*>(w_s + v * W_STRIDE + r0);
        if (has_scale) {
            const u32 words[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
            u32 packed[8];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float f0, f1, f2, f3;
                e4m3x2_to_f32(static_cast<u16>(words[q] & 0xffffu), f0, f1);
                e4m3x2_to_f32(static_cast<u16>(words[q] >> 16), f2, f3);
                packed[2 * q] = pack_bf16x2(f0 * s[j], f1 * s[j]);
                packed[2 * q + 1] = pack_bf16x2(f2 * s[j], f3 * s[j]);
            }
            dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
        } else {  // bf16: 16 features are 32 bytes, the second half loaded here
            dst[0] = raw[j];
            dst[1] = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(w) + h * s_wh + v * s_wv + r0 + 8);
        }
    }

#if __CUDA_ARCH__ >= 900
    if (use_pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
#endif

    // 2. merge: thread -> (row slot tid / 128, latent features 4 * (tid % 128) .. + 4), two rows per pass
    const int n_rows = min(ROWS, B - b0);
    const int slot = tid >> 7, r0 = (tid & 127) * 4;
    for (int i = 0; i < n_rows; i += 2) {
        const int ri = i + slot;
        if (ri < n_rows) {
            const int b = b0 + ri;
            const int qs = cu_q[b];
            const bool dec = cu_q[b + 1] - qs == 1;
            const int n_keys = sparse ? K : seq_lens[b];
            int per = (n_keys + N_CHUNKS - 1) / N_CHUNKS;
            per = (per + SPAN_ALIGN - 1) / SPAN_ALIGN * SPAN_ALIGN;
            const int span = max(per, span_min);
            const int n_row = dec ? (n_keys + span - 1) / span : 0;
            const long long row0 = static_cast<long long>(b) * N_CHUNKS * H + h;
            float2 ml[N_CHUNKS];
            float4 p[N_CHUNKS];
#pragma unroll
            for (int c = 0; c < N_CHUNKS; ++c) {  // every load in flight at once (chunks past n_row masked below)
                ml[c] = *reinterpret_cast<const float2*>(ws_ml + (row0 + c * H) * 2);
                p[c] = *reinterpret_cast<const float4*>(ws_acc + (row0 + c * H) * R + r0);
            }
            float m = -INFINITY;
#pragma unroll
            for (int c = 0; c < N_CHUNKS; ++c)
                if (c < n_row) m = fmaxf(m, ml[c].x);
            const float m_safe = m == -INFINITY ? 0.f : m;
            float l = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
            for (int c = 0; c < N_CHUNKS; ++c) {
                if (c < n_row) {
                    const float wc = exp2f(ml[c].x - m_safe);
                    l += wc * ml[c].y;
                    a0 += wc * p[c].x, a1 += wc * p[c].y, a2 += wc * p[c].z, a3 += wc * p[c].w;
                }
            }
            if (!dec) l = 1.f;
            u32* dst = reinterpret_cast<u32*>(o_s + ri * O_STRIDE + r0);
            dst[0] = dec ? pack_bf16x2(a0 / l, a1 / l) : 0u;
            dst[1] = dec ? pack_bf16x2(a2 / l, a3 / l) : 0u;
            if ((tid & 127) == 0) {
                q_start_s[ri] = qs;
                dec_s[ri] = dec;
            }
        }
    }
    __syncthreads();

    // 3. out[16 rows, 128] = o_lat[16, 512] . W_UV[h]^T: warp w owns features 16w .. 16w + 15 (two n-tiles of 8)
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const int mi = lane >> 3, mr = lane & 7;
    // A (16 x 16 of o_lat): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15); B: (n-tile 0 | 1) x (k 0-7 | 8-15)
    const u32 a_base = smem_addr(o_s + (mr + (mi & 1) * 8) * O_STRIDE + (mi >> 1) * 8);
    const u32 b_base = smem_addr(w_s + (warp * 16 + (mi >> 1) * 8 + mr) * W_STRIDE + (mi & 1) * 8);
#pragma unroll 8
    for (int k = 0; k < R; k += 16) {
        u32 a[4], bb[4];
        ldmatrix_x4(a_base + k * 2, a[0], a[1], a[2], a[3]);
        ldmatrix_x4(b_base + k * 2, bb[0], bb[1], bb[2], bb[3]);
        mma_bf16(acc[0], a[0], a[1], a[2], a[3], bb[0], bb[1]);
        mma_bf16(acc[1], a[0], a[1], a[2], a[3], bb[2], bb[3]);
    }
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int ri = g + half * 8;
        if (ri < n_rows && dec_s[ri]) {
            u16* o_row = out + q_start_s[ri] * s_ot + h * s_oh;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int v = warp * 16 + nt * 8 + 2 * t;
                *reinterpret_cast<u32*>(o_row + v) = pack_bf16x2(acc[nt][2 * half], acc[nt][2 * half + 1]);
            }
        }
    }
}

// Sparse/dense MLA decode, first half: one split-KV chunk of a decode row's keys for a block of query heads,
// reduced to (max, sum, unnormalized latent output) partials, for sm_80+ (absorbed MLA, DeepSeek-V2 section 2.1;
// DeepSeek-V3.2's sparse attention reads only the indexer's top-k positions, research/dsa.md section 5).
// The contract of _mla_split_kernel in atomtool/serve/ops/triton/mla.py for kv_lora_rank R = 512, rope dim P = 64,
// bf16 queries and latent cache, heads a multiple of HEADS (32 or 64, a -D define):
//   program (b, head block hb, chunk c) of decode row b (cu_q[b + 1] - cu_q[b] == 1): keys j in [c * span,
//   min(n_keys, (c + 1) * span)) of the row's key list (top-k entry j, or position j when dense; entries < 0 or
//   past the row's position masked), logit = qk_scale * (q_nope_abs . c_kv + q_pe . k_pe) in log2 units,
//   ws_ml[b, c, h] = (max, sum of 2^(logit - max)), ws_acc[b, c, h, :] = sum_j 2^(logit_j - max) c_kv[j].
//
// Why CUDA: at batch 1 the Triton kernel's ~20 us per program were a dependent chain (query, indices, block
// table, latent gather, then ~4 us of dots per 64-key block at ~28% of the SM's tensor rate; docs/PERFORMANCE.md
// step 60). Here the query's cp.async loads are in flight while the chunk's key offsets are computed, both
// 64-key blocks of a 128-key chunk are gathered at once (cp.async, zero-filled where masked), and the dots run on
// the tensor cores from XOR-swizzled shared memory (ldmatrix, mma.sync m16n8k16 bf16, float32 accumulate):
//   * scores: warp (m-tile mt = warp % MT, key group kg = warp / MT) computes 16 heads x 64 / KW keys over the
//     576 dims; the KW warps of a head tile exchange their row maxima through shared memory (online softmax,
//     base 2);
//   * the bf16 probabilities go to shared memory; warp w then accumulates all BH heads x latent features
//     64w .. 64w + 63 (the latent is also the value), so the value rows are read once per block.
// At batch 1 a CTA's time is mostly its bytes through one SM (query, key rows, partials; docs/PERFORMANCE.md
// session 15), hence 32 heads per CTA while the grid fits one wave of SMs (twice the CTAs, each with half the query
// and partials), 64 beyond it; the wrapper picks per launch (mla_split.heads_for), and both give a row the same bits.
// Longer (dense) chunks loop over 64-key blocks, two stages, the next block's gather in flight during the dots.
// A program's result depends only on its own row: the same at every batch size.
//
// Compiled at first use by atomtool.serve.ops.cuda.build with -DHEADS=.. (no headers).

typedef unsigned short u16;
typedef unsigned int u32;

#define R 512
#define P 64
#define CH ((R + P) / 8)   // 16-byte chunks per latent / query row: 72
#define ROW_BYTES ((R + P) * 2)
#ifndef HEADS
#define HEADS 32
#endif
#define BH HEADS           // heads per program: 32 or 64
#define MT (BH / 16)       // m-tiles of 16 heads
#define KW (8 / MT)        // score warps per m-tile: each takes BN / KW keys
#define NT (BN / KW / 8)   // n-tiles of 8 keys per score warp
#define BN 64              // keys per block
#define THREADS 256
#define SPAN_ALIGN 64
#define PS_STRIDE (BN + 8) // bf16 per probability row: +16 bytes so ldmatrix's 8 rows hit 8 bank groups

// shared memory (bytes): query [BH][CH] swizzled, two key stages [BN][CH] swizzled, probabilities, exchanges
#define Q_BYTES (BH * ROW_BYTES)
#define KV_BYTES (BN * ROW_BYTES)
#define P_OFF (Q_BYTES + 2 * KV_BYTES)
#define RED_OFF (P_OFF + BH * PS_STRIDE * 2)
#define ALPHA_OFF (RED_OFF + KW * BH * 4)
#define OFFS_OFF (ALPHA_OFF + BH * 4)
#define SMEM_BYTES (OFFS_OFF + 2 * BN * 8)

// STAMPS builds (benchmarks/mla_split_stamps.py --cuda) record thread 0's %clock64 after each stage into
// stamps[program][slot]; ``dep`` is a value the stage produced, so the stamp cannot be taken before it is known
#ifdef STAMPS
#define STAMP(i, dep)                                                                                      \
    do {                                                                                                   \
        if (tid == 0) {                                                                                    \
            long long clk;                                                                                 \
            asm volatile("mov.u64 %0, %%clock64; // %1" : "=l"(clk) : "f"(static_cast<float>(dep)));        \
            stamps[((static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) *     \
                   STAMP_SLOTS + (i)] = clk;                                                                   \
        }                                                                                                  \
    } while (0)
#define STAMP_SLOTS 16
#define STAMPS_PARAM , long long* __restrict__ stamps
#else
#define STAMP(i, dep)
#define STAMPS_PARAM
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// byte offset of 16-byte chunk ``chunk`` of row ``row`` (72 chunks per row): the chunk index XOR row % 8 keeps
// ldmatrix's 8 rows of one column in 8 different bank groups (1152-byte rows all start in the same bank)
__device__ __forceinline__ u32 swz(int row, int chunk) { return row * ROW_BYTES + ((chunk ^ (row & 7)) << 4); }

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32 (&a)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32 (&a)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct Row {  // what a program knows of its decode row
    const int* topk;      // the row's top-k list (sparse)
    const int* bt;        // the row's block-table row
    int qpos, end, sparse, block_size;
    long long s_lb, s_ls;
};

// key j's position: top-k entry j (sparse) or j; -1 past the chunk (a load issued early, used by key_offset)
__device__ __forceinline__ int key_position(const Row& row, int j) {
    return j >= row.end ? -1 : row.sparse ? row.topk[j] : j;
}

// element offset of the latent row of position s, or -1 for padding (s < 0) or past the query's position
__device__ __forceinline__ long long key_offset(const Row& row, int s) {
    if (s < 0 || s > row.qpos) return -1;
    return static_cast<long long>(row.bt[s / row.block_size]) * row.s_lb +
           static_cast<long long>(s % row.block_size) * row.s_ls;
}

// cp.async of the BN latent rows whose offsets are offs[0 .. BN) into stage ``dst`` (masked rows zero-filled)
__device__ __forceinline__ void gather(u32 dst, const long long* offs, const u16* lat, int tid) {
#pragma unroll 2
    for (int i = tid; i < BN * CH; i += THREADS) {
        const int key = i / CH, cc = i % CH;
        const long long off = offs[key];
        cp_async16(dst + swz(key, cc), off >= 0 ? lat + off + cc * 8 : lat, off >= 0 ? 16 : 0);
    }
}

// grid (H / BH, B, n_chunks), THREADS threads, SMEM_BYTES of dynamic shared memory (a chunk's head blocks are
// neighbours in launch order, so the key rows the first reads are still in L2 for the others). qn [T, H, R] /
// qp [T, H, P] bf16 with strides (s_qnt, s_qnh, 1) / (s_qpt, s_qph, 1); lat: [blocks, block_size, R + P] bf16,
// strides (s_lb, s_ls, 1); bt [B, *] int32 (row stride s_bt); topk [T, K] int32 (row stride s_tk); ws_acc
// [B, n_chunks, H, R] / ws_ml [B, n_chunks, H, 2] float32; qk_scale: softmax scale * log2(e).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
mla_split(const u16* __restrict__ qn, const u16* __restrict__ qp, const u16* __restrict__ lat,
          float* __restrict__ ws_acc, float* __restrict__ ws_ml, const int* __restrict__ cu_q,
          const int* __restrict__ seq_lens, const int* __restrict__ bt, const int* __restrict__ topk, int H, int K,
          int block_size, float qk_scale, int n_chunks, long long s_qnt, long long s_qnh, long long s_qpt,
          long long s_qph, long long s_lb, long long s_ls, long long s_bt, long long s_tk, int sparse,
          int span_min, int use_pdl STAMPS_PARAM) {
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 q_s = smem_addr(smem), kv_s = q_s + Q_BYTES, p_s = q_s + P_OFF;
    float* red_s = reinterpret_cast<float*>(smem + RED_OFF);      // [KW key groups][BH] row maxima
    float* alpha_s = reinterpret_cast<float*>(smem + ALPHA_OFF);  // [BH] this block's rescale factors
    long long* offs_s = reinterpret_cast<long long*>(smem + OFFS_OFF);  // [2 stages][BN] latent row offsets
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h0 = blockIdx.x * BH, b = blockIdx.y, c = blockIdx.z;
    STAMP(0, 0);

#if __CUDA_ARCH__ >= 900
    if (use_pdl) {  // everything read here is written by the kernels before this one
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
#endif
    const int qs = cu_q[b];
    if (cu_q[b + 1] - qs != 1) return;  // not a decode row: the one-program kernel owns it
    Row row;
    row.qpos = seq_lens[b] - 1;
    const int n_keys = sparse ? K : row.qpos + 1;
    int per = (n_keys + n_chunks - 1) / n_chunks;
    per = (per + SPAN_ALIGN - 1) / SPAN_ALIGN * SPAN_ALIGN;
    const int span = max(per, span_min), start = c * span;
    if (start >= n_keys) return;  // past this row's last chunk: the merge never reads it
    row.end = min(n_keys, start + span);
    row.topk = topk + static_cast<long long>(qs) * s_tk;
    row.bt = bt + static_cast<long long>(b) * s_bt;
    row.sparse = sparse, row.block_size = block_size, row.s_lb = s_lb, row.s_ls = s_ls;
    const int n_blocks = (row.end - start + BN - 1) / BN;
    STAMP(1, n_blocks);

    // 1. the first two blocks' top-k entries requested first, then the query's cp.async loads (BH heads x 576
    //    dims), then the entries' block-table rows; the key rows' gathers once every offset is known
    const int pos = tid < 2 * BN ? key_position(row, start + tid) : -1;
    for (int i = tid; i < BH * CH; i += THREADS) {
        const int hr = i / CH, cc = i % CH;
        const u16* src = cc < R / 8 ? qn + qs * s_qnt + (h0 + hr) * s_qnh + cc * 8
                                    : qp + qs * s_qpt + (h0 + hr) * s_qph + (cc - R / 8) * 8;
        cp_async16(q_s + swz(hr, cc), src, 16);
    }
    if (tid < 2 * BN) offs_s[tid] = key_offset(row, pos);
    __syncthreads();
    STAMP(2, offs_s[0]);
    gather(kv_s, offs_s, lat, tid);
    cp_async_commit();  // group 0: query + block 0
    if (n_blocks > 1) gather(kv_s + KV_BYTES, offs_s + BN, lat, tid);
    cp_async_commit();  // group 1: block 1 (maybe empty)

    // score warp (m-tile mt, key group kg): heads 16 mt .. + 15 x keys NT * 8 * kg .. ; value warp: every head x
    // latent features 64 warp .. + 63
    const int g = lane >> 2, t = lane & 3, mt = warp % MT, kg = warp / MT;
    // score warp: rows 16 mt + g, + 8: running max, and running sums per 16-key group of the block (NT / 2 groups
    // per warp), so the sums are added in the same order whatever HEADS is: a row's bits do not depend on it
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2][NT / 2];
#pragma unroll
    for (int q = 0; q < NT / 2; ++q) l_run[0][q] = l_run[1][q] = 0.f;
    float o[MT][8][4];                                                 // value warp: [m-tile][n-tile][fragment]
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
    // ldmatrix lane roles: A tiles (rows 0-7 | 8-15) x (k 0-7 | 8-15); B (keys 0-7 | 8-15) x (k 0-7 | 8-15)
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_k = lane >> 4;
    const int b_key = (lane & 7) + (lane >> 4) * 8, b_k = (lane >> 3) & 1;
    const int key0 = kg * NT * 8;

    for (int blk = 0; blk < n_blocks; ++blk) {
        const int st = blk & 1;
        const u32 kv = kv_s + st * KV_BYTES;
        // a later block's top-k entry (or block-table row when dense), loaded now, used after the dots (chunks
        // longer than two blocks: dense rows' spans of 256 keys and more)
        const int j2 = start + (blk + 2) * BN + tid;
        int pre = -1;
        if (tid < BN && blk + 2 < n_blocks && j2 < row.end) pre = sparse ? row.topk[j2] : row.bt[j2 / block_size];
        cp_async_wait<1>();
        __syncthreads();
        if (blk < 2) STAMP(3 + 4 * blk, blk);

        // 2. scores of heads 16 mt .. + 15 x the warp's NT * 8 keys over the 576 dims
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 4
        for (int ks = 0; ks < CH / 2; ++ks) {
            u32 a[4];
            ldmatrix_x4(q_s + swz(16 * mt + a_row, 2 * ks + a_k), a);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 bb[4];
                ldmatrix_x4(kv + swz(key0 + 16 * np + b_key, 2 * ks + b_k), bb);
                mma_bf16(s[2 * np], a, bb[0], bb[1]);
                mma_bf16(s[2 * np + 1], a, bb[2], bb[3]);
            }
        }
        if (blk < 2) STAMP(4 + 4 * blk, s[0][0] + s[NT - 1][3]);
        // 3. online softmax (base 2): thread holds rows g, g + 8 x keys key0 + 8 n + 2 t + {0, 1}
        const long long* offs = offs_s + st * BN;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int key = key0 + 8 * n + 2 * t;
            const bool v0 = offs[key] >= 0, v1 = offs[key + 1] >= 0;
            s[n][0] = v0 ? s[n][0] * qk_scale : -INFINITY;
            s[n][1] = v1 ? s[n][1] * qk_scale : -INFINITY;
            s[n][2] = v0 ? s[n][2] * qk_scale : -INFINITY;
            s[n][3] = v1 ? s[n][3] * qk_scale : -INFINITY;
            mx[0] = fmaxf(mx[0], fmaxf(s[n][0], s[n][1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[n][2], s[n][3]));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        if (t == 0) {
            red_s[kg * BH + 16 * mt + g] = mx[0];
            red_s[kg * BH + 16 * mt + g + 8] = mx[1];
        }
        __syncthreads();
        float alpha[2], m_safe[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int hr = 16 * mt + g + 8 * r;
            float m_new = m_run[r];
#pragma unroll
            for (int k = 0; k < KW; ++k) m_new = fmaxf(m_new, red_s[k * BH + hr]);
            m_safe[r] = m_new == -INFINITY ? 0.f : m_new;
            alpha[r] = exp2f(m_run[r] - m_safe[r]);
            m_run[r] = m_new;
#pragma unroll
            for (int q = 0; q < NT / 2; ++q) l_run[r][q] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float p0 = exp2f(s[n][0] - m_safe[0]), p1 = exp2f(s[n][1] - m_safe[0]);
            const float p2 = exp2f(s[n][2] - m_safe[1]), p3 = exp2f(s[n][3] - m_safe[1]);
            l_run[0][n / 2] += p0 + p1;
            l_run[1][n / 2] += p2 + p3;
            const int col = key0 + 8 * n + 2 * t;
            *reinterpret_cast<u32*>(smem + P_OFF + ((16 * mt + g) * PS_STRIDE + col) * 2) = pack_bf16x2(p0, p1);
            *reinterpret_cast<u32*>(smem + P_OFF + ((16 * mt + g + 8) * PS_STRIDE + col) * 2) = pack_bf16x2(p2, p3);
        }
        if (kg == 0 && t == 0) {
            alpha_s[16 * mt + g] = alpha[0];
            alpha_s[16 * mt + g + 8] = alpha[1];
        }
        __syncthreads();
        if (blk < 2) STAMP(5 + 4 * blk, l_run[0][0]);

        // 4. o[BH heads, features 64 warp .. + 63] = o * alpha + P[BH x 64] . latent[64 keys x features]
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const float a0 = alpha_s[16 * i + g], a1 = alpha_s[16 * i + g + 8];
#pragma unroll
            for (int j = 0; j < 8; ++j) o[i][j][0] *= a0, o[i][j][1] *= a0, o[i][j][2] *= a1, o[i][j][3] *= a1;
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
                ldmatrix_x4(p_s + ((16 * i + a_row) * PS_STRIDE + 16 * kk + a_k * 8) * 2, a[i]);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 v[4];  // (keys 0-7 | 8-15) x (features 0-7 | 8-15), transposed: the B fragments of 2 n-tiles
                ldmatrix_x4_trans(kv + swz(16 * kk + a_row, 8 * warp + 2 * np + a_k), v);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    mma_bf16(o[i][2 * np], a[i], v[0], v[1]);
                    mma_bf16(o[i][2 * np + 1], a[i], v[2], v[3]);
                }
            }
        }
        if (blk < 2) STAMP(6 + 4 * blk, o[0][0][0] + o[MT - 1][7][3]);

        // 5. refill this stage with block blk + 2 (dense chunks longer than two blocks)
        if (blk + 2 < n_blocks) {
            __syncthreads();  // every warp is done with this stage's rows and offsets
            if (tid < BN) {
                long long off = -1;
                if (pre >= 0) {
                    if (sparse) off = key_offset(row, pre);
                    else off = static_cast<long long>(pre) * s_lb + static_cast<long long>(j2 % block_size) * s_ls;
                }
                offs_s[st * BN + tid] = off;
            }
            __syncthreads();
            gather(kv, offs_s + st * BN, lat, tid);
        }
        cp_async_commit();  // one group per block (maybe empty): wait_group 1 above stays exact
    }
    cp_async_wait<0>();

    // 6. partials: (max, sum) per head from the score warps, the unnormalized rows from the value warps. The sums:
    //    each 16-key group's over its 4 lanes, then the 4 groups in key order (the probability rows' space).
    float* sum_s = reinterpret_cast<float*>(smem + P_OFF);  // [BN / 16 groups][BH]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int q = 0; q < NT / 2; ++q) {
            l_run[r][q] += __shfl_xor_sync(0xffffffffu, l_run[r][q], 1);
            l_run[r][q] += __shfl_xor_sync(0xffffffffu, l_run[r][q], 2);
        }
    }
    __syncthreads();  // every warp is done reading the probabilities
    if (t == 0) {
#pragma unroll
        for (int q = 0; q < NT / 2; ++q) {
            sum_s[(kg * NT / 2 + q) * BH + 16 * mt + g] = l_run[0][q];
            sum_s[(kg * NT / 2 + q) * BH + 16 * mt + g + 8] = l_run[1][q];
        }
    }
    __syncthreads();
    const long long base = (static_cast<long long>(b) * n_chunks + c) * H + h0;
    if (kg == 0 && t == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int hr = 16 * mt + g + 8 * r;
            float l = 0.f;
#pragma unroll
            for (int q = 0; q < BN / 16; ++q) l += sum_s[q * BH + hr];
            *reinterpret_cast<float2*>(ws_ml + (base + hr) * 2) = make_float2(m_run[r], l);
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int f = 64 * warp + 8 * j + 2 * t;
            *reinterpret_cast<float2*>(ws_acc + (base + 16 * i + g) * R + f) = make_float2(o[i][j][0], o[i][j][1]);
            *reinterpret_cast<float2*>(ws_acc + (base + 16 * i + g + 8) * R + f) = make_float2(o[i][j][2], o[i][j][3]);
        }
    }
    STAMP(11, o[0][0][0]);
}

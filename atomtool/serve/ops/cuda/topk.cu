// Exact per-row top-k *positions* over 32-bit order keys, one CTA per row with the whole row in registers
// (DSA lightning-indexer selection at decode; the contract of atomtool/serve/ops/triton/topk.py, whose
// one-program mode this replaces for rows up to THREADS * ITEMS keys).
//
// Per row r (query row t = row0 + r): the K largest uint32 keys (stored as int32) among the row's first n
// positions, ties to the lowest position, written in ascending position order; a row with n <= K takes every
// valid position and pads with -1. The result is defined by the keys alone, so it is bitwise the Triton
// kernel's whatever the algorithm.
//
// Algorithm (why CUDA: the selection is a chain of dependent block-wide steps, and shared-memory atomics,
// warp shuffles and __syncthreads_count make each step a few hundred nanoseconds, where the Triton version
// pays a ballot histogram, a cumsum and several reductions per step):
//   1. thread i holds keys [i * ITEMS, (i + 1) * ITEMS) of the row (16-byte loads), so a block scan in thread
//      order is a scan in position order;
//   2. the key range [lo, hi]: given by the keys' producer (a row of the range buffer, zeroed here for the
//      next call) or reduced here;
//   3. adaptive-range radix rounds: a 2048-bucket shared histogram of (u - lo) >> shift over the live keys,
//      the bucket holding the remaining-th largest (a suffix scan), that bucket's exact min / max as the next
//      range, until lo == hi; then Tk = lo and `need` keys equal to Tk are taken (usually two rounds);
//   4. one packed block scan of (u > Tk) + ((u == Tk) << 16) gives every taken key its output slot.
//
// Compiled at first use by atomtool.serve.ops.cuda.build with -DTHREADS=.. -DITEMS=.. (no headers needed).

typedef unsigned int u32;

#ifndef THREADS
#define THREADS 1024
#endif
#ifndef ITEMS
#define ITEMS 4
#endif
#define WARPS (THREADS / 32)
#define LOG2_BINS 11
#define BINS (1 << LOG2_BINS)
#define BINS_PER_THREAD (BINS / THREADS)

static_assert(THREADS % 32 == 0 && WARPS <= 32, "THREADS: a multiple of 32, at most 1024");
static_assert(BINS % THREADS == 0, "BINS must be a multiple of THREADS");
static_assert(THREADS * ITEMS < 65536, "the packed scan counts in 16-bit halves");

// Inclusive scan of v over the CTA in thread order. Every thread must call it; `sums` (WARPS words of shared
// memory) must not be in use by another scan until a __syncthreads after this one returns.
__device__ __forceinline__ u32 block_inclusive_scan(u32 v, u32* sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const u32 o = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += o;
    }
    if (lane == 31) sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        u32 s = lane < WARPS ? sums[lane] : 0u;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u32 o = __shfl_up_sync(0xffffffffu, s, d);
            if (lane >= d) s += o;
        }
        if (lane < WARPS) sums[lane] = s;
    }
    __syncthreads();
    return warp > 0 ? v + sums[warp - 1] : v;
}

// keys: [R, s_key] int32; rng: [R, s_rng] int32 (~min, max as uint32) when range_given; out: [T, s_out] int32;
// the row length n: lens[t] (row_lens) or the query position + 1 from cu_q [num_seqs + 1] / seq_lens [num_seqs].
extern "C" __global__ void __launch_bounds__(THREADS, 1)
topk_rows(const int* __restrict__ keys, int* __restrict__ rng, int* __restrict__ out, const int* __restrict__ lens,
          const int* __restrict__ cu_q, const int* __restrict__ seq_lens, int num_seqs, int row0, int S, int K,
          long long s_key, long long s_rng, long long s_out, int row_lens, int range_given, int use_pdl) {
    __shared__ u32 hist[BINS];
    __shared__ u32 sums[WARPS];
    // [0..3]: two (min, max) buffers alternating by round; [4]: picked bucket; [5]: keys left to take in it;
    // [6], [7]: the row's min / max when not given
    __shared__ u32 bc[8];
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        bc[6] = 0xffffffffu;
        bc[7] = 0u;
    }
#if __CUDA_ARCH__ >= 900
    if (use_pdl) {  // everything below reads what the previous kernels wrote
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
#endif
    const int r = blockIdx.x, t = row0 + r;
    int n;
    if (row_lens) {
        n = lens[t];
    } else {  // sequence b owning row t: the count of sequence ends at or before t
        int b = 0;
        for (int i0 = 0; i0 < num_seqs; i0 += THREADS)
            b += __syncthreads_count(i0 + tid < num_seqs && cu_q[1 + i0 + tid] <= t);
        n = seq_lens[b] - (cu_q[b + 1] - t) + 1;
    }
    n = min(max(n, 0), S);
    u32 lo = 0u, hi = 0u;
    if (range_given) {  // this CTA is the range's only reader: zero it for the next call once all have read it
        u32* rr = reinterpret_cast<u32*>(rng + r * s_rng);
        lo = ~rr[0];
        hi = rr[1];
        __syncthreads();
        if (tid == 0) {
            rr[0] = 0u;
            rr[1] = 0u;
        }
    }
    int* out_row = out + t * s_out;
    if (n <= K) {
        for (int s = tid; s < K; s += THREADS) out_row[s] = s < n ? s : -1;
        return;
    }

    const int* key_row = keys + r * s_key;
    const int p0 = tid * ITEMS;
    u32 u[ITEMS];
    bool vectorized = false;
#if ITEMS % 4 == 0
    if (p0 + ITEMS <= n && (reinterpret_cast<unsigned long long>(key_row) & 15ull) == 0) {
        vectorized = true;
#pragma unroll
        for (int j = 0; j < ITEMS; j += 4) {
            const int4 v = *reinterpret_cast<const int4*>(key_row + p0 + j);
            u[j] = v.x, u[j + 1] = v.y, u[j + 2] = v.z, u[j + 3] = v.w;
        }
    }
#endif
    if (!vectorized) {
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) u[j] = p0 + j < n ? static_cast<u32>(key_row[p0 + j]) : 0u;
    }
    // valid lanes: p0 + j < n

    if (!range_given) {
        u32 mn = 0xffffffffu, mx = 0u;
#pragma unroll
        for (int j = 0; j < ITEMS; ++j)
            if (p0 + j < n) mn = min(mn, u[j]), mx = max(mx, u[j]);
        mn = __reduce_min_sync(0xffffffffu, mn);
        mx = __reduce_max_sync(0xffffffffu, mx);
        __syncthreads();  // bc[6], bc[7] initialized
        if (lane == 0) {
            atomicMin(&bc[6], mn);
            atomicMax(&bc[7], mx);
        }
        __syncthreads();
        lo = bc[6];
        hi = bc[7];
    }

    u32 remaining = static_cast<u32>(K);  // keys still to take at or below the current range
    for (int round = 0; lo < hi; ++round) {  // lo, hi are the same in every thread
        const int shift = max(0, 32 - __clz(hi - lo) - LOG2_BINS);  // (hi - lo) >> shift < BINS
        u32* mm = bc + 2 * (round & 1);  // last read two rounds ago: every thread has passed a barrier since
#pragma unroll
        for (int k = 0; k < BINS_PER_THREAD; ++k) hist[tid + k * THREADS] = 0u;
        if (tid == 0) {
            mm[0] = 0xffffffffu;
            mm[1] = 0u;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < ITEMS; ++j)
            if (p0 + j < n && u[j] >= lo && u[j] <= hi) atomicAdd(&hist[(u[j] - lo) >> shift], 1u);
        __syncthreads();
        // thread i owns buckets BINS-1-i*BPT .. downwards, so the scan counts keys in higher buckets
        u32 c[BINS_PER_THREAD], local = 0u;
#pragma unroll
        for (int k = 0; k < BINS_PER_THREAD; ++k) {
            c[k] = hist[BINS - 1 - (tid * BINS_PER_THREAD + k)];
            local += c[k];
        }
        u32 above = block_inclusive_scan(local, sums) - local;
#pragma unroll
        for (int k = 0; k < BINS_PER_THREAD; ++k) {
            if (above < remaining && above + c[k] >= remaining) {  // exactly one bucket in the CTA
                bc[4] = BINS - 1 - (tid * BINS_PER_THREAD + k);
                bc[5] = remaining - above;
            }
            above += c[k];
        }
        __syncthreads();
        const u32 pick = bc[4];
        remaining = bc[5];
        u32 mn = 0xffffffffu, mx = 0u;
#pragma unroll
        for (int j = 0; j < ITEMS; ++j)
            if (p0 + j < n && u[j] >= lo && u[j] <= hi && ((u[j] - lo) >> shift) == pick)
                mn = min(mn, u[j]), mx = max(mx, u[j]);
        mn = __reduce_min_sync(0xffffffffu, mn);
        mx = __reduce_max_sync(0xffffffffu, mx);
        if (lane == 0 && mn <= mx) {
            atomicMin(&mm[0], mn);
            atomicMax(&mm[1], mx);
        }
        __syncthreads();
        lo = mm[0];
        hi = mm[1];
    }
    const u32 tk = lo, need = remaining;

    // every key above Tk and the first `need` keys equal to it, each to its rank among the taken
    u32 local = 0u;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j)
        if (p0 + j < n) local += (u[j] > tk ? 1u : 0u) + (u[j] == tk ? 0x10000u : 0u);
    u32 run = block_inclusive_scan(local, sums) - local;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        if (p0 + j >= n) break;
        const bool gt = u[j] > tk, eq = u[j] == tk;
        run += (gt ? 1u : 0u) + (eq ? 0x10000u : 0u);
        const u32 c_gt = run & 0xffffu, c_eq = run >> 16;
        if (gt || (eq && c_eq <= need)) out_row[c_gt + min(c_eq, need) - 1] = p0 + j;
    }
}

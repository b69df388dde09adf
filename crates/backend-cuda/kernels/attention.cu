// Fused scaled dot-product attention in the flash-attention manner (FlashAttention-2's
// algorithm, f32 FMA on CUDA cores; attention_tc.cu is its tensor-core version for f16/bf16 on
// sm_80+). The Tq x Tk matrix of scores is never stored: each block holds tiles of ATT_B queries
// and ATT_B keys in shared memory.
//
// Forward (`attn_fwd`): one block per (batch entry, tile of queries). It loads its Q tile once,
// then for each K/V tile computes S = Q K^T (scaled, in base 2), masks it (keys past Tk;
// causal: key j > query i, top-left aligned; in the KEEP instances, a boolean mask's zeros),
// and keeps per row a running max m and a running
// sum l of exp2(s - m), rescaling the output accumulator by exp2(m_old - m_new) whenever the
// max grows (the online softmax). Causal blocks stop at the last key tile any of their queries
// sees. It writes O = acc / l in the storage type and the row's natural log-sum-exp
// lse = (m + log2 l) ln 2 in f32 (+inf for a row with no key, so exp(s - lse) = 0 there).
//
// Dropout on the weights (p > 0): the forward multiplies each weight by its mask value z
// (0 or 1/(1-p), att_drop: Philox regenerated from the weight's index, so nothing is stored)
// in the product with V but not in the normalizer; the backward uses P z for dV, dP z in dS,
// and Dr = rowsum(dO O) is still sum_j P dP z.
//
// Backward by recomputation, deterministic (no atomics), three kernels:
//   attn_bwd_pre:  Dr[i] = sum_n dO[i][n] O[i][n]            (one warp per 16 rows)
//   attn_bwd_dkdv: one block per (batch, tile of keys), over the query tiles that see it:
//                  P^T = exp(S^T - lse), dV += P^T dO, dP^T = V dO^T,
//                  dS^T = P^T (dP^T - Dr), dK += dS^T Q · scale
//   attn_bwd_dq:   one block per (batch, tile of queries), over its key tiles:
//                  the same P and dS, dQ += dS K · scale
// Recomputing S in both kernels costs one more pass of products than atomics would, and keeps
// dQ bit-reproducible.
//
// Storage `S`: float, f16 or bf16 (loads widen, stores round once); all math and shared tiles
// are f32. `DT` is the head size the kernel is compiled for (64 or 128: two instances per dtype
// keep a fresh machine's first compile short): the host picks the smallest DT >= max(d, dv)
// and the tiles are zero-padded to it. Q/K/V/dO rows need a
// unit stride along the head axis; rows and batch entries may have any strides (a head view
// of a packed qkv projection is read in place). The batch index is decomposed by `bd` and each
// operand's `Strides` (common.cuh's offset1). O, dQ, dK and dV are written through their own
// batch `Strides` and row strides (`AttnShape::o_rs` ..., unit head stride): the host lays them
// out `[.., T, H, d]` when the operand they mirror is a head view of such a buffer. The
// backward reads O the same way; lse and Dr are contiguous `[batch, Tq]`.
//
// Thread layout (ATT_NT = 128 threads): tx = tid % 16, ty = tid / 16. In a tile product a
// thread owns rows ty*ATT_RM .. +ATT_RM and columns tx + 16 j: the 16 lanes sharing a row are
// one half-warp, so row maxima and sums are xor-shuffles over offsets 8, 4, 2, 1. Shared tiles
// have row pitch DT + 1 (and ATT_B + 1) so the column-wise reads of the K^T products fall in
// distinct banks.

#define ATT_B 32
#define ATT_NT 128
#define ATT_RM 4  // ATT_B / (ATT_NT / 16)
#define ATT_CN 2  // ATT_B / 16
#define ATT_LP (ATT_B + 1)
#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.6931471805599453f

// ---- BEGIN same in attention.cu and attention_tc.cu ----
// Sizes and scalars of one call (mirrored by `ops/attention.rs`'s `AttnShape`).
struct AttnShape {
    u64 tq, tk, d, dv;
    u64 q_rs, k_rs, v_rs, g_rs;  // row strides of q, k, v, dO (elements)
    u64 o_rs, dq_rs, dk_rs, dv_rs;  // row strides of O, dQ, dK, dV (elements)
    u64 batch;                   // number of batch entries
    u64 key;                     // Philox key of the dropout mask
    u64 mask;                    // where the forward keeps its dropout bits for the backward
                                 // (tensor-core kernels; 0: none, the backward draws again)
    float scale;                 // scale of the scores
    float scale2;                // scale * log2(e)
    float drop_p;                // dropout probability (0: no dropout)
    float drop_scale;            // 1 / (1 - drop_p)
    int causal;
    int dropout;                 // drop_p > 0
    u64 keep;                    // a boolean mask (u8, nonzero: query i may see key j) of the
                                 // scores' shape, read by the KEEP instances only; its batch
    Strides keep_bs;             // entry b starts at keep + offset1(b, bd, keep_bs)
    u64 keep_rs, keep_cs;        // its strides over queries and keys (0 where broadcast), bytes
    u64 keep_tiles;              // its summary per 16 x 16 block (attn_keep_tiles), or 0
    u64 bias;                    // nonzero: `keep` is an additive mask of the storage type,
                                 // added to the scaled scores (-inf hides a pair)
};

__device__ __forceinline__ float att_inf() { return __int_as_float(0x7f800000); }
// ---- END same ----

// Rows r0 .. r0+ATT_B of a [nrows, ncols] matrix (row stride rs, unit column stride) into a
// shared [ATT_B][DT + 1] f32 tile, zeros outside the matrix.
template <typename S, int DT>
__device__ __forceinline__ void att_load(float* dst, const S* __restrict__ src, u64 rs, u64 r0,
                                         u64 nrows, u64 ncols) {
    for (int idx = threadIdx.x; idx < ATT_B * DT; idx += ATT_NT) {
        int r = idx / DT, c = idx - (idx / DT) * DT;
        u64 gr = r0 + (u64)r;
        float x = 0.f;
        if (gr < nrows && (u64)c < ncols) x = wide(src[gr * rs + (u64)c]);
        dst[r * (DT + 1) + c] = x;
    }
}

// acc[i][j] = sum_k A[ty*RM + i][k] * B[tx + 16 j][k] over k < DT (A, B: [ATT_B][DT + 1]).
template <int DT>
__device__ __forceinline__ void att_mm_nt(float acc[ATT_RM][ATT_CN], const float* A,
                                          const float* B, int ty, int tx) {
#pragma unroll
    for (int i = 0; i < ATT_RM; ++i)
#pragma unroll
        for (int j = 0; j < ATT_CN; ++j) acc[i][j] = 0.f;
#pragma unroll 8
    for (int k = 0; k < DT; ++k) {
        float a[ATT_RM], b[ATT_CN];
#pragma unroll
        for (int i = 0; i < ATT_RM; ++i) a[i] = A[(ty * ATT_RM + i) * (DT + 1) + k];
#pragma unroll
        for (int j = 0; j < ATT_CN; ++j) b[j] = B[(tx + 16 * j) * (DT + 1) + k];
#pragma unroll
        for (int i = 0; i < ATT_RM; ++i)
#pragma unroll
            for (int j = 0; j < ATT_CN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
}

// acc[i][n] += sum_c P[ty*RM + i][c] * V[c][tx + 16 n] over c < ATT_B (P: [ATT_B][ATT_LP],
// V: [ATT_B][DT + 1]).
template <int DT>
__device__ __forceinline__ void att_mm_nn(float acc[ATT_RM][DT / 16], const float* P,
                                          const float* V, int ty, int tx) {
#pragma unroll 4
    for (int c = 0; c < ATT_B; ++c) {
        float p[ATT_RM];
#pragma unroll
        for (int i = 0; i < ATT_RM; ++i) p[i] = P[(ty * ATT_RM + i) * ATT_LP + c];
#pragma unroll
        for (int n = 0; n < DT / 16; ++n) {
            float x = V[c * (DT + 1) + tx + 16 * n];
#pragma unroll
            for (int i = 0; i < ATT_RM; ++i) acc[i][n] = fmaf(p[i], x, acc[i][n]);
        }
    }
}

// Max and sum over the 16 lanes of a half-warp (every lane gets the result).
__device__ __forceinline__ float att_max16(float x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float att_sum16(float x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---- BEGIN same in attention.cu and attention_tc.cu ----
// Batch entry b's boolean mask (AttnShape::keep) in a KEEP instance, else null.
template <bool KEEP>
__device__ __forceinline__ const unsigned char* att_keep_base(const AttnShape& a, u64 b,
                                                              const Dims& bd) {
    return KEEP ? (const unsigned char*)a.keep + offset1<u64>(b, bd, a.keep_bs) : nullptr;
}

// The bits of attn_keep_tiles' summary of a block of the mask.
#define ATT_SEES 1u   // some pair of the block is kept (an additive mask's: is not -inf)
#define ATT_HIDES 2u  // some pair of the block is masked (an additive mask's: is not 0)

// Whether query qi may see key kj (km: the batch entry's boolean mask, read when KEEP; an
// additive mask hides by its -inf, added by att_bias). The instances without a mask (KEEP
// false) compile to the bounds and causal tests alone.
template <bool KEEP>
__device__ __forceinline__ bool att_keep(const AttnShape& a, const unsigned char* km, u64 qi,
                                         u64 kj) {
    return qi < a.tq && kj < a.tk && (!a.causal || kj <= qi) &&
           (!KEEP || a.bias || km[qi * a.keep_rs + kj * a.keep_cs]);
}

// An additive mask's value for a pair att_keep sees, times log2(e) (the scores' domain), or 0
// (no additive mask). S: the storage type, the mask's.
template <typename S, bool KEEP>
__device__ __forceinline__ float att_bias(const AttnShape& a, const unsigned char* km, u64 qi,
                                          u64 kj) {
    return KEEP && a.bias
               ? wide(*(const S*)(km + qi * a.keep_rs + kj * a.keep_cs)) * 1.4426950408889634f
               : 0.f;
}

// Dropout's multiplier of one Philox word: 0 or 1/(1-p). The mask is the composed path's, bit
// for bit: a uniform f32 `(w >> 8) 2^-24`, kept when >= p (rand.cu's uniform_of and a
// `compare_scalar(Ge, p)` in f32).
__device__ __forceinline__ float att_drop_of(const AttnShape& a, u32 w) {
    const float u = __fmul_rn((float)(w >> 8), 5.9604644775390625e-8f);
    return u >= a.drop_p ? a.drop_scale : 0.f;
}

// Dropout's multiplier of weight (b, i, j), whose row-major index n = (b Tq + i) Tk + j draws
// word n % 4 of counter n / 4 under the draw's key (kiln_core::philox::uniform_f32).
__device__ __forceinline__ float att_drop(const AttnShape& a, u64 b, u64 i, u64 j) {
    const u64 n = (b * a.tq + i) * a.tk + j;
    u32 w[4];
    philox(n >> 2, a.key, w);
    const u32 x = (n & 2) ? ((n & 1) ? w[3] : w[2]) : ((n & 1) ? w[1] : w[0]);
    return att_drop_of(a, x);
}
// ---- END same ----

// The key tiles a tile of queries starting at q0 needs: keys 0 .. att_kend.
__device__ __forceinline__ u64 att_kend(const AttnShape& a, u64 q0) {
    u64 e = a.tk;
    if (a.causal && q0 + ATT_B < e) e = q0 + ATT_B;
    return e;
}

template <typename S, int DT, bool KEEP>
__device__ void attn_fwd(const S* __restrict__ q, const S* __restrict__ k,
                         const S* __restrict__ v, S* __restrict__ o, float* __restrict__ lse,
                         const AttnShape& a, const Dims& bd, const Strides& sq,
                         const Strides& sk, const Strides& sv, const Strides& so) {
    extern __shared__ __align__(16) float att_smem[];
    float* sQ = att_smem;
    float* sK = sQ + ATT_B * (DT + 1);
    float* sV = sK + ATT_B * (DT + 1);
    float* sP = sV + ATT_B * (DT + 1);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const u64 b = blockIdx.x;
    const unsigned char* km = att_keep_base<KEEP>(a, b, bd);
    // The longest (causal) tiles first.
    const u64 q0 = (u64)(gridDim.y - 1 - blockIdx.y) * ATT_B;
    const S* qb = q + offset1<u64>(b, bd, sq);
    const S* kb = k + offset1<u64>(b, bd, sk);
    const S* vb = v + offset1<u64>(b, bd, sv);
    att_load<S, DT>(sQ, qb, a.q_rs, q0, a.tq, a.d);

    float m[ATT_RM], l[ATT_RM], acc[ATT_RM][DT / 16];
#pragma unroll
    for (int i = 0; i < ATT_RM; ++i) {
        m[i] = -att_inf();
        l[i] = 0.f;
#pragma unroll
        for (int n = 0; n < DT / 16; ++n) acc[i][n] = 0.f;
    }
    const u64 kend = att_kend(a, q0);
    for (u64 k0 = 0; k0 < kend; k0 += ATT_B) {
        __syncthreads();  // the previous tile's products are done with sK, sV, sP
        att_load<S, DT>(sK, kb, a.k_rs, k0, a.tk, a.d);
        att_load<S, DT>(sV, vb, a.v_rs, k0, a.tk, a.dv);
        __syncthreads();
        float s[ATT_RM][ATT_CN];
        att_mm_nt<DT>(s, sQ, sK, ty, tx);
#pragma unroll
        for (int i = 0; i < ATT_RM; ++i) {
            const u64 qi = q0 + ty * ATT_RM + i;
            float mx = -att_inf();
#pragma unroll
            for (int j = 0; j < ATT_CN; ++j) {
                const u64 kj = k0 + tx + 16 * j;
                s[i][j] = att_keep<KEEP>(a, km, qi, kj)
                              ? (KEEP ? s[i][j] * a.scale2 + att_bias<S, KEEP>(a, km, qi, kj)
                                      : s[i][j] * a.scale2)
                              : -att_inf();
                mx = fmaxf(mx, s[i][j]);
            }
            const float mnew = fmaxf(m[i], att_max16(mx));
            // A row with no key yet keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
            const float base = mnew == -att_inf() ? 0.f : mnew;
            const float alpha = exp2f(m[i] - base);
            float rs = 0.f;
#pragma unroll
            for (int j = 0; j < ATT_CN; ++j) {
                const float p = exp2f(s[i][j] - base);
                rs += p;  // the normalizer counts every weight; dropout scales the product only
                const u64 kj = k0 + tx + 16 * j;
                const float pd = a.dropout && p > 0.f ? p * att_drop(a, b, qi, kj) : p;
                sP[(ty * ATT_RM + i) * ATT_LP + tx + 16 * j] = pd;
            }
            l[i] = l[i] * alpha + att_sum16(rs);
            m[i] = mnew;
#pragma unroll
            for (int n = 0; n < DT / 16; ++n) acc[i][n] *= alpha;
        }
        __syncthreads();
        att_mm_nn<DT>(acc, sP, sV, ty, tx);
    }
#pragma unroll
    for (int i = 0; i < ATT_RM; ++i) {
        const u64 qi = q0 + ty * ATT_RM + i;
        if (qi >= a.tq) continue;
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        S* orow = o + offset1<u64>(b, bd, so) + qi * a.o_rs;
#pragma unroll
        for (int n = 0; n < DT / 16; ++n) {
            const u64 c = tx + 16 * n;
            if (c < a.dv) orow[c] = narrow<S>(acc[i][n] * inv);
        }
        if (tx == 0) lse[b * a.tq + qi] = l[i] > 0.f ? (m[i] + log2f(l[i])) * ATT_LN2 : att_inf();
    }
}

// Dr[b, i] = sum_n dO[b, i, n] * O[b, i, n]: one warp per chunk of ATT_PRE_ROWS rows of one
// batch entry, grid-stride over chunks. A chunk decomposes its batch index once (u64 divisions
// by run-time sizes: done per row they took most of the kernel's time, 45 us at the GPT shape
// on an H200). Per 64 columns a lane loads its two columns of every row of the chunk before any
// product (ncu found the warps waiting on their loads two thirds of the time when each load
// fed its product at once: 1.3 TB/s), then the 16 row sums are reduce-scattered across the warp
// (16 shuffles, not 16 full reductions' 80): after the halving steps at offsets 16, 8, 4, 2,
// lane L holds half of row 8 b4 + 4 b3 + 2 b2 + b1's sum (b_k: bit k of L), and offset 1
// completes it.
#define ATT_PRE_ROWS 16
template <typename S>
__device__ void attn_bwd_pre(const S* __restrict__ o, const S* __restrict__ g,
                             float* __restrict__ dr, const AttnShape& a, const Dims& bd,
                             const Strides& sg, const Strides& so) {
    static_assert(ATT_PRE_ROWS == 16, "the reduce-scatter below halves 16 rows over 32 lanes");
    const u64 per = (a.tq + ATT_PRE_ROWS - 1) / ATT_PRE_ROWS;  // chunks per batch entry
    const u64 chunks = a.batch * per;
    const int lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 c = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); c < chunks; c += warps) {
        const u64 b = c / per, i0 = (c - b * per) * ATT_PRE_ROWS;
        const int nr = (int)(a.tq - i0 < ATT_PRE_ROWS ? a.tq - i0 : ATT_PRE_ROWS);
        const S* gr = g + offset1<u64>(b, bd, sg) + i0 * a.g_rs;
        const S* orow = o + offset1<u64>(b, bd, so) + i0 * a.o_rs;
        float s[ATT_PRE_ROWS];
#pragma unroll
        for (int j = 0; j < ATT_PRE_ROWS; ++j) s[j] = 0.f;
        for (u64 n0 = 0; n0 < a.dv; n0 += 64) {
            float gv[ATT_PRE_ROWS][2], ov[ATT_PRE_ROWS][2];
#pragma unroll
            for (int j = 0; j < ATT_PRE_ROWS; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u64 n = n0 + lane + 32 * h;
                    const bool in = j < nr && n < a.dv;
                    gv[j][h] = in ? wide(gr[j * a.g_rs + n]) : 0.f;
                    ov[j][h] = in ? wide(orow[j * a.o_rs + n]) : 0.f;
                }
#pragma unroll
            for (int j = 0; j < ATT_PRE_ROWS; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) s[j] = fmaf(gv[j][h], ov[j][h], s[j]);
        }
#pragma unroll
        for (int off = 16, half = ATT_PRE_ROWS / 2; off > 1; off >>= 1, half >>= 1) {
            const bool upper = (lane & off) != 0;
#pragma unroll
            for (int j = 0; j < half; ++j) {
                const float send = upper ? s[j] : s[j + half];
                const float keep = upper ? s[j + half] : s[j];
                s[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
            }
        }
        const float sum = s[0] + __shfl_xor_sync(0xffffffffu, s[0], 1);
        const int row = ((lane >> 4) & 1) * 8 + ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 +
                        ((lane >> 1) & 1);
        if ((lane & 1) == 0 && row < nr) dr[b * a.tq + i0 + row] = sum;
    }
}

template <typename S, int DT, bool KEEP>
__device__ void attn_bwd_dkdv(const S* __restrict__ q, const S* __restrict__ k,
                              const S* __restrict__ v, const S* __restrict__ g,
                              const float* __restrict__ lse, const float* __restrict__ dr,
                              S* __restrict__ dk, S* __restrict__ dv, const AttnShape& a,
                              const Dims& bd, const Strides& sq, const Strides& sk,
                              const Strides& sv, const Strides& sg, const Strides& sdk,
                              const Strides& sdv) {
    extern __shared__ __align__(16) float att_smem[];
    float* sK = att_smem;
    float* sV = sK + ATT_B * (DT + 1);
    float* sQ = sV + ATT_B * (DT + 1);
    float* sG = sQ + ATT_B * (DT + 1);
    float* sP = sG + ATT_B * (DT + 1);  // P^T  [key][query]
    float* sS = sP + ATT_B * ATT_LP;    // dS^T [key][query]
    float* sL = sS + ATT_B * ATT_LP;    // lse of the tile's queries, base 2
    float* sD = sL + ATT_B;             // Dr of the tile's queries
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const u64 b = blockIdx.x;
    const unsigned char* km = att_keep_base<KEEP>(a, b, bd);
    const u64 k0 = (u64)blockIdx.y * ATT_B;
    const S* qb = q + offset1<u64>(b, bd, sq);
    const S* gb = g + offset1<u64>(b, bd, sg);
    att_load<S, DT>(sK, k + offset1<u64>(b, bd, sk), a.k_rs, k0, a.tk, a.d);
    att_load<S, DT>(sV, v + offset1<u64>(b, bd, sv), a.v_rs, k0, a.tk, a.dv);

    float adk[ATT_RM][DT / 16], adv[ATT_RM][DT / 16];
#pragma unroll
    for (int i = 0; i < ATT_RM; ++i)
#pragma unroll
        for (int n = 0; n < DT / 16; ++n) adk[i][n] = adv[i][n] = 0.f;
    // Causal: only queries i >= k0 see a key of this tile.
    for (u64 q0 = a.causal ? k0 : 0; q0 < a.tq; q0 += ATT_B) {
        __syncthreads();  // the previous tile's products are done with sQ, sG, sP, sS
        att_load<S, DT>(sQ, qb, a.q_rs, q0, a.tq, a.d);
        att_load<S, DT>(sG, gb, a.g_rs, q0, a.tq, a.dv);
        if (threadIdx.x < ATT_B) {
            const u64 qi = q0 + threadIdx.x;
            sL[threadIdx.x] = qi < a.tq ? lse[b * a.tq + qi] * ATT_LOG2E : att_inf();
            sD[threadIdx.x] = qi < a.tq ? dr[b * a.tq + qi] : 0.f;
        }
        __syncthreads();
        float st[ATT_RM][ATT_CN], dpt[ATT_RM][ATT_CN];
        att_mm_nt<DT>(st, sK, sQ, ty, tx);   // S^T: rows keys, columns queries
        att_mm_nt<DT>(dpt, sV, sG, ty, tx);  // dP^T
#pragma unroll
        for (int i = 0; i < ATT_RM; ++i) {
            const u64 kj = k0 + ty * ATT_RM + i;
#pragma unroll
            for (int j = 0; j < ATT_CN; ++j) {
                const int c = tx + 16 * j;
                const bool ok = att_keep<KEEP>(a, km, q0 + c, kj);
                const float x = KEEP && ok
                                    ? st[i][j] * a.scale2 + att_bias<S, KEEP>(a, km, q0 + c, kj)
                                    : st[i][j] * a.scale2;
                const float p = ok ? exp2f(x - sL[c]) : 0.f;
                const float z = a.dropout && ok ? att_drop(a, b, q0 + c, kj) : 1.f;
                sP[(ty * ATT_RM + i) * ATT_LP + c] = p * z;
                sS[(ty * ATT_RM + i) * ATT_LP + c] = p * (dpt[i][j] * z - sD[c]);
            }
        }
        __syncthreads();
        att_mm_nn<DT>(adv, sP, sG, ty, tx);  // dV += P^T dO
        att_mm_nn<DT>(adk, sS, sQ, ty, tx);  // dK += dS^T Q
    }
    S* dkb = dk + offset1<u64>(b, bd, sdk);
    S* dvb = dv + offset1<u64>(b, bd, sdv);
#pragma unroll
    for (int i = 0; i < ATT_RM; ++i) {
        const u64 kj = k0 + ty * ATT_RM + i;
        if (kj >= a.tk) continue;
#pragma unroll
        for (int n = 0; n < DT / 16; ++n) {
            const u64 c = tx + 16 * n;
            if (c < a.d) dkb[kj * a.dk_rs + c] = narrow<S>(adk[i][n] * a.scale);
            if (c < a.dv) dvb[kj * a.dv_rs + c] = narrow<S>(adv[i][n]);
        }
    }
}

template <typename S, int DT, bool KEEP>
__device__ void attn_bwd_dq(const S* __restrict__ q, const S* __restrict__ k,
                            const S* __restrict__ v, const S* __restrict__ g,
                            const float* __restrict__ lse, const float* __restrict__ dr,
                            S* __restrict__ dq, const AttnShape& a, const Dims& bd,
                            const Strides& sq, const Strides& sk, const Strides& sv,
                            const Strides& sg, const Strides& sdq) {
    extern __shared__ __align__(16) float att_smem[];
    float* sQ = att_smem;
    float* sG = sQ + ATT_B * (DT + 1);
    float* sK = sG + ATT_B * (DT + 1);
    float* sV = sK + ATT_B * (DT + 1);
    float* sS = sV + ATT_B * (DT + 1);  // dS [query][key]
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const u64 b = blockIdx.x;
    const unsigned char* km = att_keep_base<KEEP>(a, b, bd);
    const u64 q0 = (u64)(gridDim.y - 1 - blockIdx.y) * ATT_B;
    const S* kb = k + offset1<u64>(b, bd, sk);
    const S* vb = v + offset1<u64>(b, bd, sv);
    att_load<S, DT>(sQ, q + offset1<u64>(b, bd, sq), a.q_rs, q0, a.tq, a.d);
    att_load<S, DT>(sG, g + offset1<u64>(b, bd, sg), a.g_rs, q0, a.tq, a.dv);
    float l2[ATT_RM], dri[ATT_RM], adq[ATT_RM][DT / 16];
#pragma unroll
    for (int i = 0; i < ATT_RM; ++i) {
        const u64 qi = q0 + ty * ATT_RM + i;
        l2[i] = qi < a.tq ? lse[b * a.tq + qi] * ATT_LOG2E : att_inf();
        dri[i] = qi < a.tq ? dr[b * a.tq + qi] : 0.f;
#pragma unroll
        for (int n = 0; n < DT / 16; ++n) adq[i][n] = 0.f;
    }
    const u64 kend = att_kend(a, q0);
    for (u64 k0 = 0; k0 < kend; k0 += ATT_B) {
        __syncthreads();  // the previous tile's product is done with sK, sS
        att_load<S, DT>(sK, kb, a.k_rs, k0, a.tk, a.d);
        att_load<S, DT>(sV, vb, a.v_rs, k0, a.tk, a.dv);
        __syncthreads();
        float s[ATT_RM][ATT_CN], dp[ATT_RM][ATT_CN];
        att_mm_nt<DT>(s, sQ, sK, ty, tx);
        att_mm_nt<DT>(dp, sG, sV, ty, tx);
#pragma unroll
        for (int i = 0; i < ATT_RM; ++i) {
            const u64 qi = q0 + ty * ATT_RM + i;
#pragma unroll
            for (int j = 0; j < ATT_CN; ++j) {
                const int c = tx + 16 * j;
                const bool ok = att_keep<KEEP>(a, km, qi, k0 + c);
                const float x = KEEP && ok ? s[i][j] * a.scale2 + att_bias<S, KEEP>(a, km, qi, k0 + c)
                                           : s[i][j] * a.scale2;
                const float p = ok ? exp2f(x - l2[i]) : 0.f;
                const float z = a.dropout && ok ? att_drop(a, b, qi, k0 + c) : 1.f;
                sS[(ty * ATT_RM + i) * ATT_LP + c] = p * (dp[i][j] * z - dri[i]);
            }
        }
        __syncthreads();
        att_mm_nn<DT>(adq, sS, sK, ty, tx);  // dQ += dS K
    }
    S* dqb = dq + offset1<u64>(b, bd, sdq);
#pragma unroll
    for (int i = 0; i < ATT_RM; ++i) {
        const u64 qi = q0 + ty * ATT_RM + i;
        if (qi >= a.tq) continue;
#pragma unroll
        for (int n = 0; n < DT / 16; ++n) {
            const u64 c = tx + 16 * n;
            if (c < a.d) dqb[qi * a.dq_rs + c] = narrow<S>(adq[i][n] * a.scale);
        }
    }
}

// The kernels of storage S, head size DT; TAG names them (attn_fwd_TAG_DT ...): S, or for
// the instances that read a boolean mask (KEEP) S_keep, a group of its own (kernel_files.rs),
// loaded only by a program that passes a mask.
#define ATTN_DT_(S, TAG, DT, KEEP)                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_NT) attn_fwd_##TAG##_##DT(                \
        const S* q, const S* k, const S* v, S* o, float* lse, AttnShape a, Dims bd,           \
        Strides sq, Strides sk, Strides sv, Strides so) {                                      \
        attn_fwd<S, DT, KEEP>(q, k, v, o, lse, a, bd, sq, sk, sv, so);                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_NT) attn_bwd_dkdv_##TAG##_##DT(           \
        const S* q, const S* k, const S* v, const S* g, const float* lse, const float* dr,    \
        S* dk, S* dv, AttnShape a, Dims bd, Strides sq, Strides sk, Strides sv, Strides sg,    \
        Strides sdk, Strides sdv) {                                                            \
        attn_bwd_dkdv<S, DT, KEEP>(q, k, v, g, lse, dr, dk, dv, a, bd, sq, sk, sv, sg, sdk,    \
                                   sdv);                                                       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_NT) attn_bwd_dq_##TAG##_##DT(             \
        const S* q, const S* k, const S* v, const S* g, const float* lse, const float* dr,    \
        S* dq, AttnShape a, Dims bd, Strides sq, Strides sk, Strides sv, Strides sg,           \
        Strides sdq) {                                                                         \
        attn_bwd_dq<S, DT, KEEP>(q, k, v, g, lse, dr, dq, a, bd, sq, sk, sv, sg, sdq);         \
    }
#define ATTN(S)                                                                                \
    ATTN_DT_(S, S, 64, false)                                                                  \
    ATTN_DT_(S, S, 128, false)                                                                 \
    extern "C" __global__ void attn_bwd_pre_##S(const S* o, const S* g, float* dr,            \
                                                AttnShape a, Dims bd, Strides sg, Strides so) { \
        attn_bwd_pre<S>(o, g, dr, a, bd, sg, so);                                              \
    }
// The KEEP instances of storage KILN_KEEP_S_TAG (the line names the tag alone, so that it
// joins the tag's group only). f32 only: 16-bit attention with a mask runs on the tensor-core
// kernels, or composes where those do not run.
#define KILN_KEEP_S_float_keep float
#define ATTN_KEEP(TAG)                                                                         \
    ATTN_DT_(KILN_KEEP_S_##TAG, TAG, 64, true)                                                 \
    ATTN_DT_(KILN_KEEP_S_##TAG, TAG, 128, true)
// The mask's summary per 16 x 16 block of the scores, entry (b, i, j) of
// [batch, ceil(Tq / 16), ceil(Tk / 16)]: ATT_SEES where some pair of the block is kept,
// ATT_HIDES where some is masked (pairs past Tq or Tk count as neither). The tensor-core KEEP
// instances read it to skip a warp's tile that sees nothing and to take the unmasked path
// through one that sees everything (a padding mask's blocks are nearly all one or the other).
// An additive mask (a.bias) is read as the bits of its nbytes-byte elements: a pair is seen
// unless it is neg_inf, and masked (the tile must add it) unless it is +-0.
// One warp per block: lane l reads row l / 2, keys (l % 2) 8 .. + 8.
#define ATTN_KEEP_TILES(T)                                                                     \
    extern "C" __global__ void attn_keep_tiles_##T(const T* keep, T* tiles, AttnShape a,       \
                                                   Dims bd, u32 nbytes, u32 neg_inf) {         \
        const u64 ntq = (a.tq + 15) / 16, ntk = (a.tk + 15) / 16, n = a.batch * ntq * ntk;    \
        const int lane = threadIdx.x & 31;                                                     \
        const u64 step = ((u64)gridDim.x * blockDim.x) >> 5;                                   \
        for (u64 t = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; t < n; t += step) {    \
            const u64 b = t / (ntq * ntk), r = t - b * ntq * ntk;                              \
            const u64 i = (r / ntk) * 16 + lane / 2, j0 = (r % ntk) * 16 + (lane & 1) * 8;    \
            const T* km = keep + offset1<u64>(b, bd, a.keep_bs);                               \
            bool sees = false, hides = false;                                                  \
            for (u64 j = j0; i < a.tq && j < j0 + 8 && j < a.tk; ++j) {                        \
                const T* e = km + i * a.keep_rs + j * a.keep_cs;                               \
                if (a.bias) {                                                                  \
                    const u32 x = nbytes == 2 ? (u32) * (const unsigned short*)e               \
                                              : *(const u32*)e;                                \
                    const u32 magnitude = nbytes == 2 ? 0x7fffu : 0x7fffffffu;                 \
                    if (x != neg_inf) sees = true;                                             \
                    if (x & magnitude) hides = true;                                           \
                } else if (*e) {                                                               \
                    sees = true;                                                               \
                } else {                                                                       \
                    hides = true;                                                              \
                }                                                                              \
            }                                                                                  \
            const unsigned v = (__any_sync(0xffffffffu, sees) ? ATT_SEES : 0u) |               \
                               (__any_sync(0xffffffffu, hides) ? ATT_HIDES : 0u);              \
            if (lane == 0) tiles[t] = (T)v;                                                    \
        }                                                                                      \
    }
// For cuDNN's graph (cudnn/sdpa.rs), which takes a mask as a bias added to the scores: a
// boolean mask (contiguous rows of tk) as the bit patterns of a 16-bit float bias (rows of
// stride tk8), 0 where kept and neg_inf (the type's -inf) where masked; and the log-sum-exps
// of the rows no key remains in, which cuDNN's engines write as -inf, set to +inf (kiln's
// convention: exp(s - lse) is then 0 in the backward). In T's group: they run where masks do.
#define ATTN_MASK_BIAS(T)                                                                      \
    extern "C" __global__ void attn_keep_bias_##T(const T* keep, unsigned short* bias,         \
                                                  u64 rows, u64 tk, u64 tk8,                   \
                                                  unsigned short neg_inf) {                    \
        const u64 n = rows * tk, step = (u64)gridDim.x * blockDim.x;                           \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)             \
            bias[(i / tk) * tk8 + i % tk] = keep[i] ? (unsigned short)0 : neg_inf;             \
    }                                                                                          \
    extern "C" __global__ void attn_lse_inf_##T(float* lse, u64 n) {                           \
        const u64 step = (u64)gridDim.x * blockDim.x;                                          \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)             \
            if (lse[i] == -att_inf()) lse[i] = att_inf();                                      \
    }
// (An instance line names its storage type only: the host compiles a dtype's lines alone.)
ATTN_KEEP_TILES(u8)
ATTN_MASK_BIAS(u8)
ATTN(float)
ATTN(f16)
ATTN(bf16)
ATTN_KEEP(float_keep)

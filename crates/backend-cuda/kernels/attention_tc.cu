// Fused attention on tensor cores (sm_80+), for f16/bf16 and for f32: attention.cu's algorithm
// and semantics (FlashAttention-2 forward with an online softmax; backward by recomputation
// from the saved log-sum-exp in deterministic passes; dropout by the same regenerated Philox
// mask), with every tile product an `mma.sync`: m16n8k16 on 16-bit inputs, or m16n8k8 on TF32
// inputs for f32 storage; f32 accumulation in both.
//
// Why a file of its own: it compiles only on sm_80+ (the host never launches it below; there
// the kernels compile to a trap), and its tiles, fragments and block shapes have nothing in
// common with the FMA kernels but the problem's description, which is copied verbatim between
// `BEGIN same` / `END same` markers (a Rust test in kernel_files.rs keeps the copies equal).
//
// Why f16/bf16 and f32 share one file: the kernels differ only in their operand format (the
// shared-memory element, and the fragment loads and mma of a tile product); masking, the
// online softmax, dropout, the loads' double buffering and the stores are the same code. So
// the kernel bodies are templates over an operand format `O` (TcHalf<S> or TcTf32<SPLIT>,
// below), each of which gives the two tile products `O::nt` and `O::rn`.
//
// Layout (as FlashAttention-2): TC_NT = 128 threads = 4 warps; a warp owns 16 rows of the
// block's stationary tile (queries in the forward and dQ, keys in dK/dV) and loops over tiles
// of the other side held in shared memory. Shared tiles hold the storage type (16-bit, or
// f32), row pitch DT plus 16 bytes (DT + 8 halves, DT + 4 floats: see the formats for the
// banks). Products:
//   nt: C[16][N] += A[16][K] B[N][K]^T, A and B from shared memory;
//   rn: C[16][N] += A[16][K] B[K][N], A an f32 accumulator of the previous product (the
//       weights P or dS: its m16n8 layout serves as the A operand), B from shared memory.
// An m16n8 accumulator fragment c[4] of lane (g = lane / 4, t = lane % 4) holds row g,
// columns 2t and 2t+1 (c[0], c[1]) and row g + 8, the same columns (c[2], c[3]); a row's
// max and sum are xor-shuffles over the four lanes of a quad.
//
// 16-bit formats (TcHalf): fragments by `ldmatrix` (.trans for rn's B); the weights P (forward,
// dV) and dS (dK, dQ) enter the second product rounded to the storage type, as in
// FlashAttention-2; everything else (scores, softmax, accumulators) is f32.
//
// f32 (TcTf32<SPLIT>): `mma.m16n8k8.tf32` with operands split by rounding to TF32 (tf_round:
//   `cvt.rna.tf32.f32`'s result in two integer instructions; the conversion itself made the
//   f32 kernels 20% slower).
//   SPLIT 3 (the default, "3xTF32"): x = big + small, big = tf32(x), small = tf32(x - big);
//     a b ~ big_a big_b + big_a small_b + small_a big_b (small_a small_b, ~2^-22 relative, is
//     dropped): three mmas per tile, results of near-f32 accuracy. This is what PyTorch's f32
//     `scaled_dot_product_attention` does on sm_80+: its memory-efficient kernel (xformers,
//     CUTLASS) takes its GEMMs' math from `DefaultGemmType<ArchTag, float>` in
//     aten/src/ATen/native/transformers/cuda/mem_eff_attention/gemm_kernel_utils.h, which for
//     compute capability >= 80 is `OpClassTensorOp`, `InstructionShape 16x8x8`,
//     `OpMultiplyAddFastF32` (CUTLASS's 3xTF32) — for both of its products, the weights
//     included. So SPLIT 3 matches the precision kiln's f32 users compare against.
//   SPLIT 1 ("1xTF32", when the host's allow_tf32() is on): one mma on tf32(x), ~10-bit
//     mantissas, as cuBLAS's TF32 GEMMs.
//   The weights P and dS enter rn unrounded (f32, split like any operand).
//   Fragments come by plain 32-bit `ld.shared` (ldmatrix moves b16 pairs). With a pitch of
//   DT + 4 floats (= 4 mod 32 banks) the 32 lanes of every load hit 32 distinct banks: nt's
//   A and B elements (row g, column t (+4)) at bank 4g + t (+4); rn's B elements (row 2t
//   (+1), column g) at 8t (+4) + g. rn's A needs columns t and t + 4 of its k-step where the
//   accumulator's lane holds columns 2t and 2t + 1: k is a summed index, so rn permutes it
//   (A's column t <-> 2t, t + 4 <-> 2t + 1, and B's rows alike) and takes c[] as it lies, with
//   no shuffle.
//
// Outputs: O, dQ, dK, dV are stored through batch `Strides` and row strides (attention.cu's
// header: heads-last buffers when the operands are head views); lse stays contiguous.
//
// Backward: attention.cu's `attn_bwd_pre` computes Dr = rowsum(dO O) first; then
//   attn_tc_dkdv: one block per (batch, 64 keys), over the query tiles that see them:
//                 S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T - lse), dV += (P^T z) dO,
//                 dS^T = P^T (dP^T z - Dr), dK += dS^T Q · scale
//   attn_tc_dq:   one block per (batch, 64 queries), over its key tiles: dQ += dS K · scale
// dQ is a pass of its own rather than f32 atomics from the dK/dV kernel: it recomputes S and
// dP once more, but it is bit-reproducible (as attention.cu's) and needs no f32 scratch and
// cast.
//
// Loads: the tiles a block loops over are double-buffered (tile t + 1 is fetched while tile t
// computes): 16-byte `cp.async` copies when the operand's base, row stride and width allow,
// else plain element loads; rows and columns outside the matrix are zeros (a head narrower
// than DT is zero-padded).
//
// tests/attention_tc_emulation.py replays the 16-bit kernels' index arithmetic lane by lane on
// the CPU (ldmatrix and mma emulated from the PTX ISA's layouts), and tests/attention_tf32_
// emulation.py the f32 format's fragments; keep them in step.

#define TC_NT 128
#define TC_BQ 64  // queries per block (forward, dQ) and keys per block (dK/dV): 4 warps x 16
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f

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

#if __CUDA_ARCH__ >= 800

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 tc_saddr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// ldmatrix from a shared-memory byte address (the callers compute a lane's address once and
// add constants in their unrolled loops: converting a generic pointer per load cost several
// integer instructions per ldmatrix).
__device__ __forceinline__ void tc_ldsm(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void tc_ldsm_t(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 2^x by the special-function unit, subnormal results flushed to zero (a softmax weight below
// 2^-126 of the row's largest adds nothing an f32 sum can hold): one instruction, where
// exp2f adds its subnormal scaling around it.
__device__ __forceinline__ float tc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// c += a b for one m16n8k16 tile (`S` picks the 16-bit input format).
template <typename S> __device__ __forceinline__ void tc_mma(float c[4], const u32 a[4], u32 b0, u32 b1);
template <> __device__ __forceinline__ void tc_mma<bf16>(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void tc_mma<f16>(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 rounded to a pair of `S` (lo in the low half: the lower column of a fragment).
template <typename S> __device__ __forceinline__ u32 tc_pack(float lo, float hi);
template <> __device__ __forceinline__ u32 tc_pack<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 tc_pack<f16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 16 bytes from global `src` to shared `dst` without waiting (zeros instead when !ok).
__device__ __forceinline__ void tc_cp16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are in flight.
template <int N> __device__ __forceinline__ void tc_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The row pitch (elements) of a shared tile of head size DT and element E: a row and 16
// bytes (DT + 8 halves, DT + 4 floats), which spreads the rows of a fragment load over the
// banks (the header).
template <typename E, int DT> struct TcPitch { static constexpr int P = DT + 16 / (int)sizeof(E); };
// (The kernels' dynamic shared memory is declared u16 whatever E is, and cast: declared as
// bytes, ptxas gave the 16-bit dQ kernels ~40 registers more, NVRTC 13.0, sm_90.)

template <int ROWS, int DT, typename E>
__device__ __noinline__ void tc_load_elements(E* dst, const E* __restrict__ src, u64 rs, u64 r0,
                                              u64 nrows, u64 ncols);

// Rows r0 .. r0+ROWS of a [nrows, ncols] matrix (row stride rs, unit column stride) into a
// shared [ROWS][TcPitch] tile of E, zeros outside the matrix. 16-byte vectors go by cp.async
// (they land after the caller's tc_commit, tc_wait and __syncthreads), anything else by
// plain stores (visible after the __syncthreads).
template <int ROWS, int DT, typename E>
__device__ __forceinline__ void tc_load(E* dst, const E* __restrict__ src, u64 rs, u64 r0,
                                        u64 nrows, u64 ncols) {
    constexpr int P = TcPitch<E, DT>::P, V = 16 / (int)sizeof(E);  // V: elements per vector
    // A thread copies the same column of rows r, r + STEP, r + 2 STEP, ...: its first source
    // address and its bounds are computed once, then advanced by a constant.
    constexpr int PER_ROW = DT / V, STEP = TC_NT / PER_ROW, PASSES = ROWS / STEP;
    static_assert(TC_NT % PER_ROW == 0 && ROWS % STEP == 0, "tile rows per pass");
    if (((u64)src & 15) == 0 && rs % V == 0 && ncols % V == 0) {
        const int r = threadIdx.x / PER_ROW, c = (threadIdx.x % PER_ROW) * V;
        const u64 gr = r0 + (u64)r;
        // This thread's rows left in the matrix (at most ROWS; none past a narrow head).
        const int left = (u64)c >= ncols || gr >= nrows ? 0
                         : nrows - gr >= (u64)ROWS  ? ROWS
                                                    : (int)(nrows - gr);
        const E* s = src + gr * rs + (u64)c;
        const u64 step = (u64)STEP * rs;
        const u32 d = tc_saddr(dst + r * P + c);
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const bool ok = i * STEP < left;
            tc_cp16(d + (u32)(i * STEP * P * (int)sizeof(E)), ok ? s : src, ok);
            s += step;
        }
    } else {
        tc_load_elements<ROWS, DT>(dst, src, rs, r0, nrows, ncols);
    }
}

// tc_load's element by element path (operands not aligned for 16-byte vectors), out of line:
// inlined, its index arithmetic was scheduled ahead of the vector path's branch.
template <int ROWS, int DT, typename E>
__device__ __noinline__ void tc_load_elements(E* dst, const E* __restrict__ src, u64 rs, u64 r0,
                                              u64 nrows, u64 ncols) {
    constexpr int P = TcPitch<E, DT>::P;
    for (int idx = threadIdx.x; idx < ROWS * DT; idx += TC_NT) {
        const int r = idx / DT, c = idx % DT;
        const u64 gr = r0 + (u64)r;
        dst[r * P + c] = gr < nrows && (u64)c < ncols ? src[gr * rs + (u64)c] : (E)0;
    }
}

// acc[n] += A[16][K] B[8n .. 8n+8][K]^T: A rows at `A` (the warp's 16), B at `B`, both with
// row pitch DT + 8. K and 8 NT multiples of 16.
template <typename S, int K, int NT, int DT>
__device__ __forceinline__ void tc_mm_nt(float acc[NT][4], const u16* A, const u16* B) {
    constexpr int P = DT + 8;
    const int lane = threadIdx.x & 31;
    // The lane's element (row, column) at kk = n = 0, as byte addresses; the loops add
    // constants: A (row lane % 16, column (lane / 16) 8 + 16 kk), B (row 16 n + lane % 8 +
    // (lane / 16) 8, column ((lane / 8) % 2) 8 + 16 kk).
    const u32 a0 = tc_saddr(A + (lane & 15) * P + (lane >> 4) * 8);
    const u32 b0 = tc_saddr(B + ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 a[4];
        tc_ldsm(a, a0 + kk * 32);
#pragma unroll
        for (int n = 0; n < NT / 2; ++n) {
            u32 b[4];
            tc_ldsm(b, b0 + (n * 16 * P + kk * 16) * 2);
            tc_mma<S>(acc[2 * n], a, b[0], b[1]);
            tc_mma<S>(acc[2 * n + 1], a, b[2], b[3]);
        }
    }
}

// acc[n] += A[16][K] B[K][8n .. 8n+8]: A as fragments (tc_frag), B at `B` with row pitch DT + 8.
template <typename S, int K, int NT, int DT>
__device__ __forceinline__ void tc_mm_rn(float acc[NT][4], const u32 a[K / 16][4], const u16* B) {
    constexpr int P = DT + 8;
    const int lane = threadIdx.x & 31;
    // The lane's element at kk = n = 0 (row lane % 8 + ((lane / 8) % 2) 8 + 16 kk, column
    // (lane / 16) 8 + 16 n) as a byte address; the loops add constants.
    const u32 b0 = tc_saddr(B + ((lane & 7) + ((lane >> 3) & 1) * 8) * P + (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
        for (int n = 0; n < NT / 2; ++n) {
            u32 b[4];
            tc_ldsm_t(b, b0 + (kk * 16 * P + n * 16) * 2);
            tc_mma<S>(acc[2 * n], a[kk], b[0], b[1]);
            tc_mma<S>(acc[2 * n + 1], a[kk], b[2], b[3]);
        }
    }
}

// An f32 accumulator [16][8 NC] rounded to `S` as the A fragments of the next product
// (k = its columns): k-step kk takes n-tiles 2kk and 2kk + 1.
template <typename S, int NC>
__device__ __forceinline__ void tc_frag(u32 a[NC / 2][4], const float c[NC][4]) {
#pragma unroll
    for (int kk = 0; kk < NC / 2; ++kk) {
        a[kk][0] = tc_pack<S>(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = tc_pack<S>(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = tc_pack<S>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = tc_pack<S>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

// ---- TF32 (f32 storage) ----

// x rounded to TF32 (nearest, ties away: CUTLASS's and cuBLAS's rounding), in an f32 register
// with the low 13 mantissa bits zero: half a TF32 unit added to the magnitude's bits, then the
// 13 bits cleared, which is `cvt.rna.tf32.f32`'s result for every finite x (a carry moves into
// the exponent as rounding up does; past the largest TF32 it gives infinity, as cvt does) in
// two full-rate integer instructions instead of a conversion.
__device__ __forceinline__ u32 tf_round(float x) {
    return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

// x as `big` (and, for SPLIT 3, `small` = the rounded remainder; else 0).
template <int SPLIT> __device__ __forceinline__ void tf_split(float x, u32& big, u32& small) {
    big = tf_round(x);
    small = SPLIT == 3 ? tf_round(x - __uint_as_float(big)) : 0u;
}

// c += a b for one m16n8k8 TF32 tile.
__device__ __forceinline__ void tf_mma1(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b from split operands: the two cross terms first (the small ones, as CUTLASS's
// FastF32), then big x big; SPLIT 1: big x big only.
template <int SPLIT>
__device__ __forceinline__ void tf_mma(float c[4], const u32 ab[4], const u32 as[4],
                                       const u32 bb[2], const u32 bs[2]) {
    if (SPLIT == 3) {
        tf_mma1(c, as, bb[0], bb[1]);
        tf_mma1(c, ab, bs[0], bs[1]);
    }
    tf_mma1(c, ab, bb[0], bb[1]);
}

// acc[n] += A[16][K] B[8n .. 8n+8][K]^T in TF32: A rows at `A` (the warp's 16), B at `B`, both
// f32 with row pitch DT + 4. K and 8 NT multiples of 8. A fragment (m16n8k8 .row): a0 (g, t),
// a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); B (.col): b0 (k t, n g), b1 (k t + 4, n g).
template <int SPLIT, int K, int NT, int DT>
__device__ __forceinline__ void tf_mm_nt(float acc[NT][4], const float* A, const float* B) {
    constexpr int P = DT + 4;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < K / 8; ++kk) {
        u32 ab[4], as[4];
        const float* ap = A + g * P + kk * 8 + t;
        tf_split<SPLIT>(ap[0], ab[0], as[0]);
        tf_split<SPLIT>(ap[8 * P], ab[1], as[1]);
        tf_split<SPLIT>(ap[4], ab[2], as[2]);
        tf_split<SPLIT>(ap[8 * P + 4], ab[3], as[3]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            u32 bb[2], bs[2];
            const float* bp = B + (n * 8 + g) * P + kk * 8 + t;
            tf_split<SPLIT>(bp[0], bb[0], bs[0]);
            tf_split<SPLIT>(bp[4], bb[1], bs[1]);
            tf_mma<SPLIT>(acc[n], ab, as, bb, bs);
        }
    }
}

// acc[n] += A[16][K] B[K][8n .. 8n+8] in TF32: A the f32 accumulator p (n-tile kk is k-step
// kk), B at `B` (f32, row pitch DT + 4). The k index is permuted within a step (the header):
// A's column t is p's column 2t (p[kk][0], p[kk][2]), column t + 4 is 2t + 1 (p[kk][1],
// p[kk][3]); B's rows t and t + 4 are rows 2t and 2t + 1 of the step.
template <int SPLIT, int K, int NT, int DT>
__device__ __forceinline__ void tf_mm_rn(float acc[NT][4], const float p[K / 8][4], const float* B) {
    constexpr int P = DT + 4;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < K / 8; ++kk) {
        u32 ab[4], as[4];
        tf_split<SPLIT>(p[kk][0], ab[0], as[0]);
        tf_split<SPLIT>(p[kk][2], ab[1], as[1]);
        tf_split<SPLIT>(p[kk][1], ab[2], as[2]);
        tf_split<SPLIT>(p[kk][3], ab[3], as[3]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            u32 bb[2], bs[2];
            const float* bp = B + (kk * 8 + 2 * t) * P + n * 8 + g;
            tf_split<SPLIT>(bp[0], bb[0], bs[0]);
            tf_split<SPLIT>(bp[P], bb[1], bs[1]);
            tf_mma<SPLIT>(acc[n], ab, as, bb, bs);
        }
    }
}

// ---- Operand formats: what the kernel bodies are templated over ----
// S: the storage type of the operands and outputs; E: the shared tiles' element; nt and rn:
// the two tile products (header); SIDE<DT>: rows of the tiles a block loops over.

// f16/bf16 on m16n8k16. Side tiles: 64 at head size 64, 32 at 128 (so that a warp's f32
// fragments stay in registers without spills).
template <typename S_> struct TcHalf {
    typedef S_ S;
    typedef u16 E;
    template <int DT> struct Side { static constexpr int T = DT == 64 ? 64 : 32; };
    template <int K, int NT, int DT>
    static __device__ __forceinline__ void nt(float acc[NT][4], const E* A, const E* B) {
        tc_mm_nt<S, K, NT, DT>(acc, A, B);
    }
    template <int K, int NT, int DT>
    static __device__ __forceinline__ void rn(float acc[NT][4], const float p[K / 8][4], const E* B) {
        u32 f[K / 16][4];
        tc_frag<S, K / 8>(f, p);
        tc_mm_rn<S, K, NT, DT>(acc, f, B);
    }
};

// f32 on m16n8k8 TF32, SPLIT 3 (3xTF32) or 1. Side tiles of 32 rows at both head sizes: f32
// tiles take twice the bytes of 16-bit ones, and 32 keeps the forward at head size 64 at
// 51 KiB of shared memory (four blocks, 16 warps, per H100 SM; 64 would allow two).
template <int SPLIT> struct TcTf32 {
    typedef float S;
    typedef float E;
    template <int DT> struct Side { static constexpr int T = 32; };
    template <int K, int NT, int DT>
    static __device__ __forceinline__ void nt(float acc[NT][4], const E* A, const E* B) {
        tf_mm_nt<SPLIT, K, NT, DT>(acc, A, B);
    }
    template <int K, int NT, int DT>
    static __device__ __forceinline__ void rn(float acc[NT][4], const float p[K / 8][4], const E* B) {
        tf_mm_rn<SPLIT, K, NT, DT>(acc, p, B);
    }
};

template <int NT> __device__ __forceinline__ void tc_zero(float c[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

__device__ __forceinline__ float tc_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float tc_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Element e of n-tile n of a lane's fragment: its row (0 .. 16) and column (0 .. 8 NT).
__device__ __forceinline__ int tc_row(int e) { return ((threadIdx.x & 31) >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int tc_col(int n, int e) { return n * 8 + (threadIdx.x & 3) * 2 + (e & 1); }

// The boolean mask's summary (attn_keep_tiles in attention.cu) over queries [q0, q0 + nq) and
// keys [k0, k0 + nk) of batch entry b: the OR of its blocks' ATT_SEES / ATT_HIDES bits.
// Without a mask (KEEP false), every pair is seen.
template <bool KEEP>
__device__ __forceinline__ unsigned tc_keep_tiles(const AttnShape& a, u64 b, u64 q0, u64 nq,
                                                  u64 k0, u64 nk) {
    if (!KEEP) return ATT_SEES;
    const u64 ntq = (a.tq + 15) / 16, ntk = (a.tk + 15) / 16;
    const unsigned char* t = (const unsigned char*)a.keep_tiles + b * ntq * ntk;
    unsigned v = 0;
    for (u64 i = q0 / 16; i < ntq && i * 16 < q0 + nq; ++i)
        for (u64 j = k0 / 16; j < ntk && j * 16 < k0 + nk; ++j) v |= t[i * ntk + j];
    return v;
}

// Whether every query of [q0, q0 + nq) sees every key of [k0, k0 + nk) (no element of the
// tile needs its mask: the warp skips att_keep). With a boolean mask (KEEP), only where its
// summary kv of the tile (tc_keep_tiles) has no masked pair.
template <bool KEEP>
__device__ __forceinline__ bool tc_full(const AttnShape& a, u64 q0, u64 nq, u64 k0, u64 nk,
                                        unsigned kv) {
    return (!KEEP || !(kv & ATT_HIDES)) && q0 + nq <= a.tq && k0 + nk <= a.tk &&
           (!a.causal || k0 + nk <= q0 + 1);
}

// Whether no query of [q0, q0 + nq) sees a key of [k0, k0 + nk) (causal: every key after
// every query; the whole tile is masked).
__device__ __forceinline__ bool tc_none(const AttnShape& a, u64 q0, u64 nq, u64 k0, u64 nk) {
    return a.causal && k0 > q0 + nq - 1;
}

// Scales NT m16n8 fragments x of raw scores by scale2 and adds an additive mask's values
// (times log2(e)), as the per-element path computes `s * scale2 + att_bias(..)`, for a tile that
// lies inside the matrix: `base` addresses the value of fragment row tc_row(0) and column
// tc_col(0, 0), fragment rows are rstride bytes apart and columns cstride. The addresses step
// from that one base, where att_keep and att_bias would compute each from its indices (an
// additive mask hides nothing the tile skips: every element reads its value).
template <typename S, int NT>
__device__ __forceinline__ void tc_add_bias(float x[NT][4], float scale2,
                                            const unsigned char* base, u64 rstride,
                                            u64 cstride) {
    const u64 r8 = 8 * rstride, c8 = 8 * cstride;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            x[n][e] = x[n][e] * scale2 +
                      wide(*(const S*)(base + (e >> 1) * r8 + n * c8 + (e & 1) * cstride)) *
                          1.4426950408889634f;
}

// An accumulator [16][DT] of rows r0 + tc_row(..) (those < nrows) times `mul` into the
// [nrows, ncols] output `out` of row stride `rs` (columns < ncols; unit column stride).
// ---- Dropout bits kept by the forward for the backward (AttnShape::mask) ----
// Where the host gives `mask`, the forward keeps each weight's keep/drop bit there and the
// backward kernels read it instead of drawing Philox again: two of the three draws per weight
// saved. One 32-bit word holds 8 queries x 4 keys of one parity, laid out like the forward's
// m16n8 accumulators: word
//   ((((b nqb + qi / 64) 4 + (qi % 64) / 16) nkt + kj / BK) (BK / 8) + (kj % BK) / 8) 4
//     + ((qi % 16) / 8) 2 + kj % 2,  bit (qi % 8) 4 + (kj % 8) / 2,
// with nqb = ceil(tq / 64), nkt = ceil(tk / BK) and BK the forward's key tile (its format's
// Side). A forward warp's ballot over element e of n-tile n of key tile t is then word n 4 + e
// from its tile's first, at bit `lane`; dQ (the same query blocks and key tiles) has lane j
// load word j and shuffles it to the lanes; a dK/dV lane loads the 2 (BQ / 8) words its weights'
// bits lie in (tc_drop_bit). Both load before the tile's products. Words of tiles a forward
// warp skips (every weight masked) are never written: the backward may load them, but their
// weights are 0 and a weight's multiplier does not change a zero weight's terms.
template <int BK>
__device__ __forceinline__ u64 tc_mask_word(const AttnShape& a, u64 b, u64 qi, u64 kj) {
    const u64 nqb = (a.tq + TC_BQ - 1) / TC_BQ, nkt = (a.tk + BK - 1) / BK;
    return ((((b * nqb + qi / TC_BQ) * 4 + (qi % TC_BQ) / 16) * nkt + kj / BK) * (BK / 8) +
            (kj % BK) / 8) * 4 + ((qi % 16) / 8) * 2 + (kj & 1);
}

// Dropout's multiplier (att_drop's value) of element e of a dK/dV lane's n-tile, whose weight
// is query qi = q0 + tc_col(n, e), key kj = w0 + tc_row(e), from `w`: the word of its queries'
// 8-row group and keys' 8-column group of the lane's key parity (tc_mask_word(qi - qi % 8,
// kj - kj % 8) + kj % 2). Its bit is (qi % 8) 4 + (kj % 8) / 2 with qi % 8 = 2 (lane % 4) +
// e % 2 and kj % 8 = lane / 4.
__device__ __forceinline__ float tc_drop_bit(const AttnShape& a, u32 w, int e) {
    const int lane = threadIdx.x & 31;
    return (w >> ((lane & 3) * 8 + (e & 1) * 4 + (lane >> 3))) & 1u ? a.drop_scale : 0.f;
}

template <typename S> struct TcPair;  // two S as one aligned vector
template <> struct TcPair<float> { typedef float2 T; };
template <> struct TcPair<f16> { typedef u32 T; };
template <> struct TcPair<bf16> { typedef u32 T; };
__device__ __forceinline__ float2 tc_pair(float lo, float hi, float*) { return make_float2(lo, hi); }
// (16-bit pairs through `narrow`, as the element stores: the same rounding and NaN payloads.)
__device__ __forceinline__ u32 tc_pair(float lo, float hi, f16*) {
    return (u32)narrow<f16>(lo).x | ((u32)narrow<f16>(hi).x << 16);
}
__device__ __forceinline__ u32 tc_pair(float lo, float hi, bf16*) {
    return (u32)narrow<bf16>(lo).x | ((u32)narrow<bf16>(hi).x << 16);
}

template <typename S, int DT>
__device__ __forceinline__ void tc_store(S* out, const float c[DT / 8][4], u64 r0, u64 nrows,
                                         u64 rs, u64 ncols, float mul0, float mul1) {
    // A lane's elements e = 0, 1 (and 2, 3) are columns 2t, 2t + 1 of one row: one vector
    // store when the pair is aligned (even row stride and width, aligned base), else two.
    typedef typename TcPair<S>::T V;
    const bool pairs = ((u64)out % sizeof(V)) == 0 && rs % 2 == 0 && ncols % 2 == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u64 r = r0 + tc_row(2 * h);
        if (r >= nrows) continue;
        S* row = out + r * rs;
        const float mul = h == 0 ? mul0 : mul1;
#pragma unroll
        for (int n = 0; n < DT / 8; ++n) {
            const u64 col = tc_col(n, 0);
            if (col >= ncols) continue;
            const float lo = c[n][2 * h] * mul, hi = c[n][2 * h + 1] * mul;
            if (pairs) {
                *(V*)(row + col) = tc_pair(lo, hi, (S*)nullptr);
            } else {
                row[col] = narrow<S>(lo);
                if (col + 1 < ncols) row[col + 1] = narrow<S>(hi);
            }
        }
    }
}


template <typename O, int DT, bool KEEP, typename S = typename O::S>
__device__ void attn_tc_fwd(const S* __restrict__ q, const S* __restrict__ k,
                            const S* __restrict__ v, S* __restrict__ o, float* __restrict__ lse,
                            const AttnShape& a, const Dims& bd, const Strides& sq,
                            const Strides& sk, const Strides& sv, const Strides& so) {
    typedef typename O::E E;
    constexpr int P = TcPitch<E, DT>::P, BK = O::template Side<DT>::T;
    extern __shared__ __align__(16) u16 tc_smem[];  // (see TcPitch)
    E* sQ = (E*)tc_smem;
    E* sK = sQ + TC_BQ * P;   // two buffers of BK rows (tile t in buffer t % 2)
    E* sV = sK + 2 * BK * P;  // the same
    const int warp = threadIdx.x >> 5;
    const u64 b = blockIdx.x;
    const unsigned char* km = att_keep_base<KEEP>(a, b, bd);
    const u64 q0 = (u64)(gridDim.y - 1 - blockIdx.y) * TC_BQ;  // the longest (causal) first
    const u64 w0 = q0 + warp * 16;                              // the warp's first query
    const E* kb = (const E*)(k + offset1<u64>(b, bd, sk));
    const E* vb = (const E*)(v + offset1<u64>(b, bd, sv));
    tc_load<TC_BQ, DT>(sQ, (const E*)(q + offset1<u64>(b, bd, sq)), a.q_rs, q0, a.tq, a.d);

    float m[2] = {-att_inf(), -att_inf()}, l[2] = {0.f, 0.f};
    float acc[DT / 8][4];
    tc_zero<DT / 8>(acc);
    u64 kend = a.tk;
    if (a.causal && q0 + TC_BQ < kend) kend = q0 + TC_BQ;
    const int nt = (int)((kend + BK - 1) / BK);
    auto fetch = [&](int t) {
        tc_load<BK, DT>(sK + (t & 1) * BK * P, kb, a.k_rs, (u64)t * BK, a.tk, a.d);
        tc_load<BK, DT>(sV + (t & 1) * BK * P, vb, a.v_rs, (u64)t * BK, a.tk, a.dv);
        tc_commit();
    };
    fetch(0);  // one group with the Q tile
    for (int t = 0; t < nt; ++t) {
        const u64 k0 = (u64)t * BK;
        if (t + 1 < nt) {
            fetch(t + 1);  // in flight while this tile computes
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();  // tile t is in shared memory for every thread
        // (Causal: a warp whose rows see no key of the tile skips it; its product would add
        // zeros. The barriers stay, and no tile is fully masked for the whole block.)
        // (A boolean mask's summary: a warp whose rows see no key of the tile skips it too.)
        const unsigned kv = tc_keep_tiles<KEEP>(a, b, w0, 16, k0, BK);
        if (!tc_none(a, w0, 16, k0, BK) && (kv & ATT_SEES)) {
            const E* cK = sK + (t & 1) * BK * P;
            const E* cV = sV + (t & 1) * BK * P;
            float s[BK / 8][4];
            tc_zero<BK / 8>(s);
            O::template nt<DT, BK / 8, DT>(s, sQ + warp * 16 * P, cK);
            // Scaled scores, the masked ones -inf. Only a tile that crosses the mask or the
            // matrix's edge tests its elements (the loops below stay free of branches: a
            // per-element test cost a branch and its convergence barrier per element).
            if (tc_full<KEEP>(a, w0, 16, k0, BK, kv)) {
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) s[n][e] *= a.scale2;
            } else if (KEEP && a.bias && tc_full<false>(a, w0, 16, k0, BK, kv)) {
                tc_add_bias<S, BK / 8>(
                    s, a.scale2,
                    km + (w0 + tc_row(0)) * a.keep_rs + (k0 + tc_col(0, 0)) * a.keep_cs,
                    a.keep_rs, a.keep_cs);
            } else {
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u64 qi = w0 + tc_row(e), kj = k0 + tc_col(n, e);
                        s[n][e] = att_keep<KEEP>(a, km, qi, kj)
                                      ? (KEEP ? s[n][e] * a.scale2 + att_bias<S, KEEP>(a, km, qi, kj)
                                              : s[n][e] * a.scale2)
                                      : -att_inf();
                    }
            }
            float mx[2] = {-att_inf(), -att_inf()};
    #pragma unroll
            for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
            float base[2];
    #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float mnew = fmaxf(m[h], tc_quad_max(mx[h]));
                // A row with no key yet keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
                base[h] = mnew == -att_inf() ? 0.f : mnew;
                const float alpha = tc_exp2(m[h] - base[h]);
                m[h] = mnew;
                l[h] *= alpha;  // the lane's partial sum; the quad's are added at the end
    #pragma unroll
                for (int n = 0; n < DT / 8; ++n) {
                    acc[n][2 * h] *= alpha;
                    acc[n][2 * h + 1] *= alpha;
                }
            }
    #pragma unroll
            for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[n][e] = tc_exp2(s[n][e] - base[e >> 1]);
                    l[e >> 1] += s[n][e];  // the normalizer counts every weight
                }
            if (a.dropout && a.mask) {  // dropout scales the product; bits kept for the backward
                // Every visible weight draws (not only the nonzero ones: the backward may find
                // a weight this forward rounded to 0 above 0), and each bit goes to its word
                // (tc_mask_word): lane n 4 + e writes the ballot of element e of n-tile n.
                const bool full = tc_full<KEEP>(a, w0, 16, k0, BK, kv);
                // With Tk a multiple of 4 a row's four weights of one counter (att_drop) lie in
                // lanes L and L ^ 1: the even lane draws its first row's counter, the odd lane
                // its second row's, and each hands the other the two words it needs (one
                // Philox call per four weights instead of one per weight).
                const bool grouped = (a.tk & 3) == 0;
                const int lane = threadIdx.x & 31, odd = lane & 1;
                u32 mine = 0;
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n) {
                    u32 x[4];
                    if (grouped) {
                        const u64 qi = w0 + tc_row(2 * odd), c = k0 + n * 8 + (lane & 2) * 2;
                        u32 w[4];
                        philox(((b * a.tq + qi) * a.tk + c) >> 2, a.key, w);
                        const u32 r0 = __shfl_xor_sync(0xffffffffu, odd ? w[0] : w[2], 1);
                        const u32 r1 = __shfl_xor_sync(0xffffffffu, odd ? w[1] : w[3], 1);
                        x[0] = odd ? r0 : w[0];
                        x[1] = odd ? r1 : w[1];
                        x[2] = odd ? w[2] : r0;
                        x[3] = odd ? w[3] : r1;
                    }
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u64 qi = w0 + tc_row(e), kj = k0 + tc_col(n, e);
                        const float z = !(full || att_keep<KEEP>(a, km, qi, kj)) ? 0.f
                                        : grouped ? att_drop_of(a, x[e])
                                                  : att_drop(a, b, qi, kj);
                        s[n][e] *= z;
                        const u32 word = __ballot_sync(0xffffffffu, z != 0.f);
                        if (lane == n * 4 + e) mine = word;
                    }
                }
                if ((threadIdx.x & 31) < BK / 2)
                    ((u32*)a.mask)[tc_mask_word<BK>(a, b, w0, k0) + (threadIdx.x & 31)] = mine;
            } else if (a.dropout) {
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (s[n][e] > 0.f) s[n][e] *= att_drop(a, b, w0 + tc_row(e), k0 + tc_col(n, e));
            }
            O::template rn<BK, DT / 8, DT>(acc, s, cV);
        }
        __syncthreads();  // every warp is done with buffer t % 2 before fetch(t + 2) refills it
    }
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] = tc_quad_sum(l[h]);
        inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    }
    tc_store<S, DT>(o + offset1<u64>(b, bd, so), acc, w0, a.tq, a.o_rs, a.dv, inv[0], inv[1]);
    if ((threadIdx.x & 3) == 0)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u64 qi = w0 + tc_row(2 * h);
            if (qi < a.tq)
                lse[b * a.tq + qi] = l[h] > 0.f ? (m[h] + log2f(l[h])) * TC_LN2 : att_inf();
        }
}

template <typename O, int DT, bool KEEP, typename S = typename O::S>
__device__ void attn_tc_dkdv(const S* __restrict__ q, const S* __restrict__ k,
                             const S* __restrict__ v, const S* __restrict__ g,
                             const float* __restrict__ lse, const float* __restrict__ dr,
                             S* __restrict__ dk, S* __restrict__ dv, const AttnShape& a,
                             const Dims& bd, const Strides& sq, const Strides& sk,
                             const Strides& sv, const Strides& sg, const Strides& sdk,
                             const Strides& sdv) {
    typedef typename O::E E;
    constexpr int P = TcPitch<E, DT>::P, BQ = O::template Side<DT>::T;
    extern __shared__ __align__(16) u16 tc_smem[];  // (see TcPitch)
    E* sK = (E*)tc_smem;
    E* sV = sK + TC_BQ * P;
    E* sQ = sV + TC_BQ * P;               // two buffers of BQ rows (tile t in buffer t % 2)
    E* sG = sQ + 2 * BQ * P;              // the same
    float* sL = (float*)(sG + 2 * BQ * P);  // lse of the tiles' queries, base 2 (two buffers)
    float* sD = sL + 2 * BQ;                // Dr of the tiles' queries (two buffers)
    const int warp = threadIdx.x >> 5;
    const u64 b = blockIdx.x;
    const unsigned char* km = att_keep_base<KEEP>(a, b, bd);
    const u64 k0 = (u64)blockIdx.y * TC_BQ;
    const u64 w0 = k0 + warp * 16;  // the warp's first key
    const E* qb = (const E*)(q + offset1<u64>(b, bd, sq));
    const E* gb = (const E*)(g + offset1<u64>(b, bd, sg));
    tc_load<TC_BQ, DT>(sK, (const E*)(k + offset1<u64>(b, bd, sk)), a.k_rs, k0, a.tk, a.d);
    tc_load<TC_BQ, DT>(sV, (const E*)(v + offset1<u64>(b, bd, sv)), a.v_rs, k0, a.tk, a.dv);

    float adk[DT / 8][4], adv[DT / 8][4];
    tc_zero<DT / 8>(adk);
    tc_zero<DT / 8>(adv);
    // Causal: only queries i >= k0 see a key of this tile (k0 is a multiple of BQ).
    const u64 qs = a.causal ? k0 : 0;
    const int nt = a.tq > qs ? (int)((a.tq - qs + BQ - 1) / BQ) : 0;
    auto fetch = [&](int t) {
        const u64 q0 = qs + (u64)t * BQ;
        const int o = t & 1;
        tc_load<BQ, DT>(sQ + o * BQ * P, qb, a.q_rs, q0, a.tq, a.d);
        tc_load<BQ, DT>(sG + o * BQ * P, gb, a.g_rs, q0, a.tq, a.dv);
        if (threadIdx.x < BQ) {
            const u64 qi = q0 + threadIdx.x;
            sL[o * BQ + threadIdx.x] = qi < a.tq ? lse[b * a.tq + qi] * TC_LOG2E : att_inf();
            sD[o * BQ + threadIdx.x] = qi < a.tq ? dr[b * a.tq + qi] : 0.f;
        }
        tc_commit();
    };
    if (nt > 0) fetch(0);  // one group with the K and V tiles
    for (int t = 0; t < nt; ++t) {
        const u64 q0 = qs + (u64)t * BQ;
        if (t + 1 < nt) {
            fetch(t + 1);  // in flight while this tile computes
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();  // tile t is in shared memory for every thread
        const unsigned kv = tc_keep_tiles<KEEP>(a, b, q0, BQ, w0, 16);
        if (!tc_none(a, q0, BQ, w0, 16) && (kv & ATT_SEES)) {
            const E* cQ = sQ + (t & 1) * BQ * P;
            const E* cG = sG + (t & 1) * BQ * P;
            const float* cL = sL + (t & 1) * BQ;
            const float* cD = sD + (t & 1) * BQ;
            // The forward's dropout bits of this lane's weights (a.mask), loaded before the
            // products so that their latency hides behind them: words[n][h] holds the bits of
            // queries q0 + 8n .. + 8 and keys w0 + 8h .. + 8 of the lane's parity (tc_mask_word;
            // tc_drop_bit picks a weight's bit). Words past the matrix stay 0 (never read: their
            // weights are 0).
            u32 words[BQ / 8][2];
            if (a.dropout && a.mask) {
                const u32 par = ((threadIdx.x & 31) >> 2) & 1u;
    #pragma unroll
                for (int n = 0; n < BQ / 8; ++n)
    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u64 qi = q0 + 8 * n, kj = w0 + 8 * h;
                        words[n][h] = qi < a.tq && kj < a.tk
                                          ? ((const u32*)a.mask)[tc_mask_word<BQ>(a, b, qi, kj) + par]
                                          : 0u;
                    }
            }
            float st[BQ / 8][4], dpt[BQ / 8][4];  // S^T, dP^T: rows keys, columns queries
            tc_zero<BQ / 8>(st);
            tc_zero<BQ / 8>(dpt);
            O::template nt<DT, BQ / 8, DT>(st, sK + warp * 16 * P, cQ);
            O::template nt<DT, BQ / 8, DT>(dpt, sV + warp * 16 * P, cG);
            // P^T, then dS^T; masked weights 0 (tested only in tiles that cross the mask or
            // the edge), dropout's multiplier z drawn only where a weight is nonzero (z does
            // not change a zero weight's terms).
            if (KEEP && a.bias && !tc_full<KEEP>(a, q0, BQ, w0, 16, kv) &&
                tc_full<false>(a, q0, BQ, w0, 16, kv)) {
                // An additive mask's values go in before the exponential (rows keys, columns
                // queries here).
                tc_add_bias<S, BQ / 8>(
                    st, a.scale2,
                    km + (q0 + tc_col(0, 0)) * a.keep_rs + (w0 + tc_row(0)) * a.keep_cs,
                    a.keep_cs, a.keep_rs);
    #pragma unroll
                for (int n = 0; n < BQ / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) st[n][e] = tc_exp2(st[n][e] - cL[tc_col(n, e)]);
            } else if (KEEP && a.bias && !tc_full<KEEP>(a, q0, BQ, w0, 16, kv)) {
                // The same across the matrix's edge or the causal diagonal, element by element.
    #pragma unroll
                for (int n = 0; n < BQ / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u64 qi = q0 + tc_col(n, e), kj = w0 + tc_row(e);
                        st[n][e] = att_keep<KEEP>(a, km, qi, kj)
                                       ? tc_exp2(st[n][e] * a.scale2 + att_bias<S, KEEP>(a, km, qi, kj) -
                                                 cL[tc_col(n, e)])
                                       : 0.f;
                    }
            } else {
    #pragma unroll
                for (int n = 0; n < BQ / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) st[n][e] = tc_exp2(st[n][e] * a.scale2 - cL[tc_col(n, e)]);
                if (!tc_full<KEEP>(a, q0, BQ, w0, 16, kv))
    #pragma unroll
                    for (int n = 0; n < BQ / 8; ++n)
    #pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (!att_keep<KEEP>(a, km, q0 + tc_col(n, e), w0 + tc_row(e))) st[n][e] = 0.f;
            }
            if (a.dropout) {
    #pragma unroll
                for (int n = 0; n < BQ / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int c = tc_col(n, e);
                        const float p = st[n][e];
                        const u64 qi = q0 + c, kj = w0 + tc_row(e);
                        const float z = a.mask  ? tc_drop_bit(a, words[n][e >> 1], e)
                                        : p > 0.f ? att_drop(a, b, qi, kj)
                                                  : 1.f;
                        st[n][e] = p * z;
                        dpt[n][e] = p * (dpt[n][e] * z - cD[c]);
                    }
            } else {
    #pragma unroll
                for (int n = 0; n < BQ / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) dpt[n][e] = st[n][e] * (dpt[n][e] - cD[tc_col(n, e)]);
            }
            O::template rn<BQ, DT / 8, DT>(adv, st, cG);   // dV += (P^T z) dO
            O::template rn<BQ, DT / 8, DT>(adk, dpt, cQ);  // dK += dS^T Q
        }
        __syncthreads();  // every warp is done with buffer t % 2 before fetch(t + 2) refills it
    }
    // With no query tile (causal, keys past the last query) the K and V copies are uncommitted.
    tc_commit();
    tc_wait<0>();
    tc_store<S, DT>(dk + offset1<u64>(b, bd, sdk), adk, w0, a.tk, a.dk_rs, a.d, a.scale, a.scale);
    tc_store<S, DT>(dv + offset1<u64>(b, bd, sdv), adv, w0, a.tk, a.dv_rs, a.dv, 1.f, 1.f);
}

template <typename O, int DT, bool KEEP, typename S = typename O::S>
__device__ void attn_tc_dq(const S* __restrict__ q, const S* __restrict__ k,
                           const S* __restrict__ v, const S* __restrict__ g,
                           const float* __restrict__ lse, const float* __restrict__ dr,
                           S* __restrict__ dq, const AttnShape& a, const Dims& bd,
                           const Strides& sq, const Strides& sk, const Strides& sv,
                           const Strides& sg, const Strides& sdq) {
    typedef typename O::E E;
    constexpr int P = TcPitch<E, DT>::P, BK = O::template Side<DT>::T;
    extern __shared__ __align__(16) u16 tc_smem[];  // (see TcPitch)
    E* sQ = (E*)tc_smem;
    E* sG = sQ + TC_BQ * P;
    E* sK = sG + TC_BQ * P;   // two buffers of BK rows (tile t in buffer t % 2)
    E* sV = sK + 2 * BK * P;  // the same
    const int warp = threadIdx.x >> 5;
    const u64 b = blockIdx.x;
    const unsigned char* km = att_keep_base<KEEP>(a, b, bd);
    const u64 q0 = (u64)(gridDim.y - 1 - blockIdx.y) * TC_BQ;
    const u64 w0 = q0 + warp * 16;
    const E* kb = (const E*)(k + offset1<u64>(b, bd, sk));
    const E* vb = (const E*)(v + offset1<u64>(b, bd, sv));
    tc_load<TC_BQ, DT>(sQ, (const E*)(q + offset1<u64>(b, bd, sq)), a.q_rs, q0, a.tq, a.d);
    tc_load<TC_BQ, DT>(sG, (const E*)(g + offset1<u64>(b, bd, sg)), a.g_rs, q0, a.tq, a.dv);
    float l2[2], dri[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u64 qi = w0 + tc_row(2 * h);
        l2[h] = qi < a.tq ? lse[b * a.tq + qi] * TC_LOG2E : att_inf();
        dri[h] = qi < a.tq ? dr[b * a.tq + qi] : 0.f;
    }
    float adq[DT / 8][4];
    tc_zero<DT / 8>(adq);
    u64 kend = a.tk;
    if (a.causal && q0 + TC_BQ < kend) kend = q0 + TC_BQ;
    const int nt = (int)((kend + BK - 1) / BK);
    auto fetch = [&](int t) {
        tc_load<BK, DT>(sK + (t & 1) * BK * P, kb, a.k_rs, (u64)t * BK, a.tk, a.d);
        tc_load<BK, DT>(sV + (t & 1) * BK * P, vb, a.v_rs, (u64)t * BK, a.tk, a.dv);
        tc_commit();
    };
    fetch(0);  // one group with the Q and dO tiles
    for (int t = 0; t < nt; ++t) {
        const u64 k0 = (u64)t * BK;
        if (t + 1 < nt) {
            fetch(t + 1);  // in flight while this tile computes
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();  // tile t is in shared memory for every thread
        const unsigned kv = tc_keep_tiles<KEEP>(a, b, w0, 16, k0, BK);
        if (!tc_none(a, w0, 16, k0, BK) && (kv & ATT_SEES)) {
            const E* cK = sK + (t & 1) * BK * P;
            const E* cV = sV + (t & 1) * BK * P;
            // The forward's dropout words of this warp and key tile (tc_mask_word), if kept:
            // lane j loads word j (n-tile j / 4, element j % 4) before the products, so that
            // the load's latency hides behind them; element (n, e) then takes its bit `lane`
            // from lane n 4 + e by a shuffle. Past the matrix: 0 (those weights are 0).
            u32 mword = 0;
            if (a.dropout && a.mask && (threadIdx.x & 31) < BK / 2 && w0 < a.tq)
                mword = ((const u32*)a.mask)[tc_mask_word<BK>(a, b, w0, k0) + (threadIdx.x & 31)];
            float s[BK / 8][4], dp[BK / 8][4];
            tc_zero<BK / 8>(s);
            tc_zero<BK / 8>(dp);
            O::template nt<DT, BK / 8, DT>(s, sQ + warp * 16 * P, cK);
            O::template nt<DT, BK / 8, DT>(dp, sG + warp * 16 * P, cV);
            // P, then dS (as in attn_tc_dkdv).
            if (KEEP && a.bias && !tc_full<KEEP>(a, w0, 16, k0, BK, kv) &&
                tc_full<false>(a, w0, 16, k0, BK, kv)) {
                // An additive mask's values go in before the exponential.
                tc_add_bias<S, BK / 8>(
                    s, a.scale2,
                    km + (w0 + tc_row(0)) * a.keep_rs + (k0 + tc_col(0, 0)) * a.keep_cs,
                    a.keep_rs, a.keep_cs);
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) s[n][e] = tc_exp2(s[n][e] - l2[e >> 1]);
            } else if (KEEP && a.bias && !tc_full<KEEP>(a, w0, 16, k0, BK, kv)) {
                // The same across the matrix's edge or the causal diagonal, element by element.
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u64 qi = w0 + tc_row(e), kj = k0 + tc_col(n, e);
                        s[n][e] = att_keep<KEEP>(a, km, qi, kj)
                                      ? tc_exp2(s[n][e] * a.scale2 + att_bias<S, KEEP>(a, km, qi, kj) -
                                                l2[e >> 1])
                                      : 0.f;
                    }
            } else {
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) s[n][e] = tc_exp2(s[n][e] * a.scale2 - l2[e >> 1]);
                if (!tc_full<KEEP>(a, w0, 16, k0, BK, kv))
    #pragma unroll
                    for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (!att_keep<KEEP>(a, km, w0 + tc_row(e), k0 + tc_col(n, e))) s[n][e] = 0.f;
            }
            if (a.dropout) {
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float p = s[n][e];
                        float z = 1.f;
                        if (a.mask) {  // every lane shuffles (outside any test of p)
                            const u32 w = __shfl_sync(0xffffffffu, mword, n * 4 + e);
                            z = (w >> (threadIdx.x & 31)) & 1u ? a.drop_scale : 0.f;
                        } else if (p > 0.f) {
                            z = att_drop(a, b, w0 + tc_row(e), k0 + tc_col(n, e));
                        }
                        dp[n][e] = p * (dp[n][e] * z - dri[e >> 1]);
                    }
            } else {
    #pragma unroll
                for (int n = 0; n < BK / 8; ++n)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - dri[e >> 1]);
            }
            O::template rn<BK, DT / 8, DT>(adq, dp, cK);  // dQ += dS K
        }
        __syncthreads();  // every warp is done with buffer t % 2 before fetch(t + 2) refills it
    }
    tc_store<S, DT>(dq + offset1<u64>(b, bd, sdq), adq, w0, a.tq, a.dq_rs, a.d, a.scale, a.scale);
}

#define TC_BODY(call) call
#else
// Below sm_80 there is no bf16 mma: the host never launches these (ops/attention.rs).
#define TC_BODY(call) __trap()
#endif

// The forward's blocks per SM that the register budget must allow: with head size 64, four (at
// most 128 registers; ptxas then spills ~50 bytes a thread). Without the bound ptxas gave the
// 16-bit forward 166 registers once its stores went through output strides: three blocks per
// SM instead of four, and 1.14 ms instead of 0.69 at (8, 16, 2048, 64) on an H100 (ncu,
// 2026-11-27).
// (An explicit minimum of 1 for head size 128 made ptxas take 182 registers instead of 138.)
#define TC_FWD_BOUNDS_64 __launch_bounds__(TC_NT, 4)
#define TC_FWD_BOUNDS_128 __launch_bounds__(TC_NT)
// The f32 dK/dV kernels at head size 64: three blocks per SM (at most 168 registers; their
// 70 KB of shared memory allows three). Unbounded, ptxas gave them 222 registers: two blocks,
// and 269 instead of 248 us for the GPT's 64 x 6 x 256 x 64 with dropout (ncu, H200,
// 2026-11-29). The 16-bit ones and head size 128 (135 KB of shared memory: one block) keep
// the compiler's choice.
#define TC_DKDV_BOUNDS_tf32x3_64 __launch_bounds__(TC_NT, 3)
#define TC_DKDV_BOUNDS_tf32_64 __launch_bounds__(TC_NT, 3)
#define TC_DKDV_BOUNDS_tc_64 __launch_bounds__(TC_NT)
#define TC_DKDV_BOUNDS_tf32x3_128 __launch_bounds__(TC_NT)
#define TC_DKDV_BOUNDS_tf32_128 __launch_bounds__(TC_NT)
#define TC_DKDV_BOUNDS_tc_128 __launch_bounds__(TC_NT)

// NAME: the kernels' prefix (attn_NAME_fwd_TAG_DT ...); O: the operand format; S: storage
// type; TAG: S, or for the instances that read a boolean mask (KEEP) S_keep, a group of its own
// (kernel_files.rs), loaded only by a program that passes a mask.
#define ATTN_TC_DT(NAME, O, S, TAG, DT, KEEP)                                                  \
    extern "C" __global__ void TC_FWD_BOUNDS_##DT attn_##NAME##_fwd_##TAG##_##DT(              \
        const S* q, const S* k, const S* v, S* o, float* lse, AttnShape a, Dims bd,           \
        Strides sq, Strides sk, Strides sv, Strides so) {                                      \
        TC_BODY((attn_tc_fwd<O, DT, KEEP>(q, k, v, o, lse, a, bd, sq, sk, sv, so)));           \
    }                                                                                          \
    extern "C" __global__ void TC_DKDV_BOUNDS_##NAME##_##DT attn_##NAME##_dkdv_##TAG##_##DT(   \
        const S* q, const S* k, const S* v, const S* g, const float* lse, const float* dr,    \
        S* dk, S* dv, AttnShape a, Dims bd, Strides sq, Strides sk, Strides sv, Strides sg,    \
        Strides sdk, Strides sdv) {                                                            \
        TC_BODY((attn_tc_dkdv<O, DT, KEEP>(q, k, v, g, lse, dr, dk, dv, a, bd, sq, sk, sv, sg, \
                                           sdk, sdv)));                                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(TC_NT) attn_##NAME##_dq_##TAG##_##DT(         \
        const S* q, const S* k, const S* v, const S* g, const float* lse, const float* dr,    \
        S* dq, AttnShape a, Dims bd, Strides sq, Strides sk, Strides sv, Strides sg,           \
        Strides sdq) {                                                                         \
        TC_BODY((attn_tc_dq<O, DT, KEEP>(q, k, v, g, lse, dr, dq, a, bd, sq, sk, sv, sg,       \
                                         sdq)));                                               \
    }
#define ATTN_TC(NAME, O, S)                                                                    \
    ATTN_TC_DT(NAME, O, S, S, 64, false)                                                       \
    ATTN_TC_DT(NAME, O, S, S, 128, false)
// The KEEP instances of tag TAG (float_keep, f16_keep, bf16_keep; the line names the tag
// alone, so that it joins the tag's group only); O: the operand format of the tag's type. f32
// with a mask runs 3xTF32 only (also under allow_tf32): 1xTF32 instances would add their
// CUBIN to every binary (kernel_files.rs prebuilds every group) for a rare combination.
#define KILN_TC_S_float_keep float
#define KILN_TC_S_f16_keep f16
#define KILN_TC_S_bf16_keep bf16
#define ATTN_TC_KEEP(NAME, O, TAG)                                                             \
    ATTN_TC_DT(NAME, O, KILN_TC_S_##TAG, TAG, 64, true)                                        \
    ATTN_TC_DT(NAME, O, KILN_TC_S_##TAG, TAG, 128, true)
// (An instance line names its storage type only: the host compiles a dtype's lines alone.)
// f16/bf16: attn_tc_*; f32: attn_tf32x3_* (3xTF32, the default) and attn_tf32_* (1xTF32).
ATTN_TC(tc, TcHalf<f16>, f16)
ATTN_TC(tc, TcHalf<bf16>, bf16)
ATTN_TC(tf32x3, TcTf32<3>, float)
ATTN_TC(tf32, TcTf32<1>, float)
ATTN_TC_KEEP(tc, TcHalf<KILN_TC_S_f16_keep>, f16_keep)
ATTN_TC_KEEP(tc, TcHalf<KILN_TC_S_bf16_keep>, bf16_keep)
ATTN_TC_KEEP(tf32x3, TcTf32<3>, float_keep)

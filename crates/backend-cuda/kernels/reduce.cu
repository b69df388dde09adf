// Reductions over any set of axes. The host splits the input's dimensions into kept ones
// (`kd`/`ks`: one output element each, output contiguous) and reduced ones (`rd`/`rs`, offset
// 0), and picks one of two kernels:
//
//   row  one block per output (grid.x strides over outputs), its threads stride over the
//        reduced elements; with grid.y = S > 1, block (o, s) reduces chunk s of `chunk`
//        elements and writes partial y[o * S + s], which a second row launch combines. When
//        the reduced elements are one contiguous run (`contig`), loads are 16-byte vectors.
//   col  32 outputs per block, one per lane, 8 warps sharing the reduced elements (and grid.y
//        splits as above); used when the kept axes are the innermost in memory (e.g. summing
//        the rows of a [n, c] matrix), so that neighbouring threads read neighbouring addresses.
//
// The reduction tree depends only on the shape and the launch, never on timing: sums are
// deterministic. Arg reductions write i64 indices into the single reduced axis.

template <typename T> __device__ __forceinline__ void store(T* y, u64 i, T v) { y[i] = v; }
// The 16-bit floats: an f32 accumulator, rounded once on store.
__device__ __forceinline__ void store(f16* y, u64 i, float v) { y[i] = narrow<f16>(v); }
__device__ __forceinline__ void store(bf16* y, u64 i, float v) { y[i] = narrow<bf16>(v); }
template <typename T> __device__ __forceinline__ void store(i64* y, u64 i, ArgAcc<T> a) { y[i] = a.i; }

template <typename T, typename Op, typename O>
__device__ void reduce_row(const T* __restrict__ x, O* __restrict__ y, u64 nout, Dims kd, Strides ks,
                           Dims rd, Strides rs, u64 inner, int contig, u64 chunk) {
    __shared__ typename Op::Acc scratch[32];
    const int N = 16 / sizeof(T);
    u64 r0 = (u64)blockIdx.y * chunk;
    u64 r1 = r0 + chunk < inner ? r0 + chunk : inner;
    for (u64 o = blockIdx.x; o < nout; o += gridDim.x) {
        u64 base = offset1<u64>(o, kd, ks);
        typename Op::Acc acc = Op::init();
        if (contig) {
            const T* p = x + base;
            // Vector loads over the aligned middle of [r0, r1).
            u64 mis = ((u64)(p + r0) / sizeof(T)) % N;
            u64 va = r0 + (mis ? N - mis : 0);
            if (va > r1) va = r1;
            u64 nvec = (r1 - va) / N;
            for (u64 r = r0 + threadIdx.x; r < va; r += blockDim.x) acc = Op::combine(acc, Op::lift(p[r], (i64)r));
            const Vec<T, N>* pv = (const Vec<T, N>*)(p + va);
            const u64 bd = blockDim.x;
            u64 v = threadIdx.x;
            // Four independent 16-byte loads in flight per thread, combined in a fixed order.
            for (; v + 3 * bd < nvec; v += 4 * bd) {
                Vec<T, N> w[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) w[u] = pv[v + u * bd];
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int j = 0; j < N; ++j)
                        acc = Op::combine(acc, Op::lift(w[u].v[j], (i64)(va + (v + u * bd) * N + j)));
            }
            for (; v < nvec; v += bd) {
                Vec<T, N> w = pv[v];
#pragma unroll
                for (int j = 0; j < N; ++j) acc = Op::combine(acc, Op::lift(w.v[j], (i64)(va + v * N + j)));
            }
            for (u64 r = va + nvec * N + threadIdx.x; r < r1; r += blockDim.x)
                acc = Op::combine(acc, Op::lift(p[r], (i64)r));
        } else {
            for (u64 r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
                acc = Op::combine(acc, Op::lift(x[base + offset1<u64>(r, rd, rs)], (i64)r));
            }
        }
        acc = block_reduce<Op>(acc, scratch);
        if (threadIdx.x == 0) store(y, o * gridDim.y + blockIdx.y, acc);
    }
}

// Column mode, for blocks of 256 threads: a block owns 32 neighbouring outputs (lane = output,
// so loads are coalesced) and its 8 warps take every 8th reduced element of rows [r0, r1); the 8
// partial results are combined through shared memory in a fixed order. With grid.y = S > 1,
// block (o, s) reduces chunk s and writes partial y[o * S + s] for a second (row) launch.
template <typename T, typename Op, typename O>
__device__ void reduce_col(const T* __restrict__ x, O* __restrict__ y, u64 nout, Dims kd, Strides ks,
                           Dims rd, Strides rs, u64 inner, u64 chunk) {
    __shared__ typename Op::Acc tile[8][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    u64 r0 = (u64)blockIdx.y * chunk;
    u64 r1 = r0 + chunk < inner ? r0 + chunk : inner;
    for (u64 ob = (u64)blockIdx.x * 32; ob < nout; ob += (u64)gridDim.x * 32) {
        u64 o = ob + tx;
        typename Op::Acc acc = Op::init();
        if (o < nout) {
            u64 base = offset1<u64>(o, kd, ks);
            u64 r = r0 + ty;
            if (rd.rank == 1) {
                // One reduced axis (the usual case after collapsing): a plain stride, no index
                // division per element, and four loads in flight per step. The same
                // combination order as the general loop below.
                const T* p = x + base;
                const u64 st = rs.s[0];
                for (; r + 24 < r1; r += 32) {
                    T a0 = p[r * st], a1 = p[(r + 8) * st], a2 = p[(r + 16) * st],
                      a3 = p[(r + 24) * st];
                    acc = Op::combine(acc, Op::lift(a0, (i64)r));
                    acc = Op::combine(acc, Op::lift(a1, (i64)(r + 8)));
                    acc = Op::combine(acc, Op::lift(a2, (i64)(r + 16)));
                    acc = Op::combine(acc, Op::lift(a3, (i64)(r + 24)));
                }
                for (; r < r1; r += 8) acc = Op::combine(acc, Op::lift(p[r * st], (i64)r));
            } else {
                for (; r < r1; r += 8)
                    acc = Op::combine(acc, Op::lift(x[base + offset1<u64>(r, rd, rs)], (i64)r));
            }
        }
        tile[ty][tx] = acc;
        __syncthreads();
        if (ty == 0 && o < nout) {
#pragma unroll
            for (int k = 1; k < 8; ++k) acc = Op::combine(acc, tile[k][tx]);
            store(y, o * gridDim.y + blockIdx.y, acc);
        }
        __syncthreads();
    }
}


#define REDUCE(NAME, OPT, T, O)                                                                \
    extern "C" __global__ void reduce_row_##NAME##_##T(const T* x, O* y, u64 nout, Dims kd,    \
                                                       Strides ks, Dims rd, Strides rs,        \
                                                       u64 inner, int contig, u64 chunk) {     \
        reduce_row<T, OPT, O>(x, y, nout, kd, ks, rd, rs, inner, contig, chunk);               \
    }                                                                                          \
    extern "C" __global__ void reduce_col_##NAME##_##T(const T* x, O* y, u64 nout, Dims kd,    \
                                                       Strides ks, Dims rd, Strides rs,        \
                                                       u64 inner, u64 chunk) {                 \
        reduce_col<T, OPT, O>(x, y, nout, kd, ks, rd, rs, inner, chunk);                       \
    }

#define REDUCE_ALL(T)                                                                          \
    typedef MaxOp<T> max_##T;                                                                  \
    typedef MinOp<T> min_##T;                                                                  \
    typedef ArgOp<T, true> argmax_##T;                                                         \
    typedef ArgOp<T, false> argmin_##T;                                                        \
    REDUCE(max, max_##T, T, T)                                                                 \
    REDUCE(min, min_##T, T, T)                                                                 \
    REDUCE(argmax, argmax_##T, T, i64)                                                         \
    REDUCE(argmin, argmin_##T, T, i64)
typedef SumOp<float> sum_float;
typedef SumOp<double> sum_double;
typedef SumOp<i64> sum_i64;
REDUCE(sum, sum_float, float, float)
REDUCE(sum, sum_double, double, double)
REDUCE(sum, sum_i64, i64, i64)
REDUCE_ALL(float)
REDUCE_ALL(double)
REDUCE_ALL(i64)
REDUCE_ALL(u8)

// The 16-bit floats: elements widened to f32 as they are loaded (`lift`), f32 accumulators
// (sums, max/min, arg values), one rounding on store. A split reduction keeps its partial
// results in f32: `_part` kernels write them, the `_fin` row kernel folds them and rounds.
template <typename T, typename B> struct WideOp : B {
    static __device__ __forceinline__ typename B::Acc lift(T v, i64 i) { return B::lift(wide(v), i); }
};
#define REDUCE_PART(NAME, OPT, T)                                                              \
    extern "C" __global__ void reduce_row_##NAME##_##T##_part(const T* x, float* y, u64 nout,  \
                                                              Dims kd, Strides ks, Dims rd,    \
                                                              Strides rs, u64 inner,           \
                                                              int contig, u64 chunk) {         \
        reduce_row<T, OPT, float>(x, y, nout, kd, ks, rd, rs, inner, contig, chunk);           \
    }                                                                                          \
    extern "C" __global__ void reduce_col_##NAME##_##T##_part(const T* x, float* y, u64 nout,  \
                                                              Dims kd, Strides ks, Dims rd,    \
                                                              Strides rs, u64 inner,           \
                                                              u64 chunk) {                     \
        reduce_col<T, OPT, float>(x, y, nout, kd, ks, rd, rs, inner, chunk);                   \
    }                                                                                          \
    extern "C" __global__ void reduce_row_##NAME##_##T##_fin(const float* x, T* y, u64 nout,   \
                                                             Dims kd, Strides ks, Dims rd,     \
                                                             Strides rs, u64 inner,            \
                                                             int contig, u64 chunk) {          \
        reduce_row<float, NAME##_float, T>(x, y, nout, kd, ks, rd, rs, inner, contig, chunk);  \
    }
typedef MaxOp<float> max_float;
typedef MinOp<float> min_float;
#define REDUCE_HALF(T)                                                                         \
    typedef WideOp<T, SumOp<float> > sum_w_##T;                                                \
    typedef WideOp<T, MaxOp<float> > max_w_##T;                                                \
    typedef WideOp<T, MinOp<float> > min_w_##T;                                                \
    typedef WideOp<T, ArgOp<float, true> > argmax_w_##T;                                       \
    typedef WideOp<T, ArgOp<float, false> > argmin_w_##T;                                      \
    REDUCE(sum, sum_w_##T, T, T)                                                               \
    REDUCE(max, max_w_##T, T, T)                                                               \
    REDUCE(min, min_w_##T, T, T)                                                               \
    REDUCE(argmax, argmax_w_##T, T, i64)                                                       \
    REDUCE(argmin, argmin_w_##T, T, i64)                                                       \
    REDUCE_PART(sum, sum_w_##T, T)                                                             \
    REDUCE_PART(max, max_w_##T, T)                                                             \
    REDUCE_PART(min, min_w_##T, T)
REDUCE_HALF(f16)
REDUCE_HALF(bf16)

// ---- matrix-vector products ------------------------------------------------------------------
//
// y[i] = sum_j A[i*rs + j*cs] * x[j*xs] for i < rows (pointers already offset). A product
// with one output row or column is a reduction, and these run it in one launch without
// cuBLAS's per-call host work (what a host-bound loop such as logistic regression pays for).
// The summation order depends only on the shape: deterministic, as the other reductions.
//
//   rows  one warp per output, lanes stride over j, then a shuffle tree (for cs == 1, each
//         row of A contiguous, or few outputs);
//   cols  any strides (e.g. a transposed A, rs == 1): 32 outputs per block, one per lane so
//         neighbouring threads read neighbouring addresses, 16 warps (a 512-thread block) sharing j; the 16
//         partial sums are added in a fixed order.

#define MATVEC(T)                                                                              \
    extern "C" __global__ void matvec_rows_##T(const T* __restrict__ a, u64 rs, u64 cs,       \
                                               const T* __restrict__ x, u64 xs,                \
                                               T* __restrict__ y, u64 rows, u64 k) {           \
        u64 warp = KILN_TID / 32, nwarps = KILN_NTHREADS / 32;                                 \
        int lane = threadIdx.x % 32;                                                           \
        for (u64 i = warp; i < rows; i += nwarps) {                                            \
            const T* r = a + i * rs;                                                           \
            T acc = (T)0;                                                                      \
            for (u64 j = lane; j < k; j += 32) acc += r[j * cs] * x[j * xs];                   \
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);    \
            if (lane == 0) y[i] = acc;                                                         \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void matvec_cols_##T(const T* __restrict__ a, u64 rs, u64 cs,        \
                                               const T* __restrict__ x, u64 xs,                \
                                               T* __restrict__ y, u64 rows, u64 k) {           \
        __shared__ T part[16][33];                                                             \
        int tx = threadIdx.x % 32, ty = threadIdx.x / 32; /* blockDim.x == 512 */              \
        u64 i = (u64)blockIdx.x * 32 + tx;                                                     \
        T acc = (T)0;                                                                          \
        if (i < rows)                                                                          \
            for (u64 j = ty; j < k; j += 16) acc += a[i * rs + j * cs] * x[j * xs];            \
        part[ty][tx] = acc;                                                                    \
        __syncthreads();                                                                       \
        if (ty == 0 && i < rows) {                                                             \
            T t = (T)0;                                                                        \
            for (int q = 0; q < 16; ++q) t += part[q][tx];                                     \
            y[i] = t;                                                                          \
        }                                                                                      \
    }
MATVEC(float)
MATVEC(double)

// ---- small matrix products -------------------------------------------------------------------
//
// C[z] = A[z] . B[z] for products too small to fill the GPU (m*n*k up to about 128^3), where
// cuBLAS's host work per call (~10 us) is several times the device time: one launch of 16x16
// output tiles, A and B read through any strides (transposed, sliced, broadcast batches), C
// contiguous [batch, m, n]. blockIdx.y runs over batch * tiles_m. Each output is one FMA chain
// over k in order: deterministic, no TF32 (what cuBLAS's default math gives in f32).

#define GEMM_SMALL(T)                                                                          \
    extern "C" __global__ void gemm_small_##T(                                                 \
        const T* __restrict__ a, u64 ars, u64 acs, u64 azs, const T* __restrict__ b, u64 brs,  \
        u64 bcs, u64 bzs, T* __restrict__ c, u64 m, u64 n, u64 k, u64 tiles_m) {               \
        __shared__ T ta[16][17];                                                               \
        __shared__ T tb[16][17];                                                               \
        int tx = threadIdx.x % 16, ty = threadIdx.x / 16; /* blockDim.x == 256 */              \
        u64 z = blockIdx.y / tiles_m;                                                          \
        u64 row = (blockIdx.y % tiles_m) * 16 + ty, col = (u64)blockIdx.x * 16 + tx;           \
        a += z * azs;                                                                          \
        b += z * bzs;                                                                          \
        c += z * m * n;                                                                        \
        T acc = (T)0;                                                                          \
        for (u64 k0 = 0; k0 < k; k0 += 16) {                                                   \
            u64 ka = k0 + tx, kb = k0 + ty;                                                    \
            ta[ty][tx] = (row < m && ka < k) ? a[row * ars + ka * acs] : (T)0;                 \
            tb[ty][tx] = (kb < k && col < n) ? b[kb * brs + col * bcs] : (T)0;                 \
            __syncthreads();                                                                   \
            _Pragma("unroll") for (int q = 0; q < 16; ++q) acc += ta[ty][q] * tb[q][tx];       \
            __syncthreads();                                                                   \
        }                                                                                      \
        if (row < m && col < n) c[row * n + col] = acc;                                        \
    }
GEMM_SMALL(float)
GEMM_SMALL(double)

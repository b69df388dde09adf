// Row kernels over the last axis: softmax / log-softmax, softmax cross-entropy and its
// gradient. One block per row (grid.x strides over rows); the row's base comes from the
// strided description of the leading dims (`rd`/`rs`), `cs` is the stride of the last axis.
//
// Softmax reads each row from global memory once: the row is cached in shared memory
// (`smem` = 1, when it fits) while the max is found, then the sum of exponentials and the
// output come from that copy. Rows too long for shared memory are read three times.

__device__ __forceinline__ float k_expf(float x) { return expf(x); }
__device__ __forceinline__ double k_expf(double x) { return exp(x); }
__device__ __forceinline__ float k_logf(float x) { return logf(x); }
__device__ __forceinline__ double k_logf(double x) { return log(x); }

// `S` is the storage type of x and y, `T` the compute type (f32 for the 16-bit floats, whose
// rows are cached in shared memory as f32: the host sizes `smem` by T).
template <typename S, typename T>
__device__ void softmax_row(const S* __restrict__ x, S* __restrict__ y, u64 rows, u64 cols,
                            Dims rd, Strides rs, u64 cs, int log, int smem) {
    extern __shared__ __align__(16) unsigned char dyn[];
    __shared__ T scratch[32];
    T* row = (T*)dyn;
    const int N = 16 / sizeof(S);
    const bool same = sizeof(S) == sizeof(T);  // S is T
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        u64 base = offset1<u64>(r, rd, rs);
        const S* p = x + base;
        S* q = y + r * cols;
        T m = lowest<T>();
        bool vec = cs == 1 && cols % N == 0 && ((u64)p % 16) == 0;
        if (smem) {
            if (vec) {
#pragma unroll 4
                for (u64 v = threadIdx.x; v < cols / N; v += blockDim.x) {
                    Vec<S, N> w = ((const Vec<S, N>*)p)[v];
                    if (same) {
                        ((Vec<S, N>*)row)[v] = w;
                    } else {
#pragma unroll
                        for (int j = 0; j < N; ++j) row[v * N + j] = wide(w.v[j]);
                    }
#pragma unroll
                    for (int j = 0; j < N; ++j) m = MaxOp<T>::combine(m, wide(w.v[j]));
                }
            } else {
                for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
                    T v = wide(p[c * cs]);
                    row[c] = v;
                    m = MaxOp<T>::combine(m, v);
                }
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) m = MaxOp<T>::combine(m, wide(p[c * cs]));
        }
        m = block_reduce<MaxOp<T> >(m, scratch);
        T s = 0;
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            T e = k_expf((smem ? row[c] : wide(p[c * cs])) - m);
            if (smem && !log) row[c] = e;
            s += e;
        }
        s = block_reduce<SumOp<T> >(s, scratch);
        if (log) {
            T ls = k_logf(s);
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x)
                q[c] = narrow<S>((smem ? row[c] : wide(p[c * cs])) - m - ls);
        } else if (smem && vec && ((u64)q % 16) == 0) {
            for (u64 v = threadIdx.x; v < cols / N; v += blockDim.x) {
                Vec<S, N> w;
                if (same) {
                    Vec<T, N> t = ((const Vec<T, N>*)row)[v];
#pragma unroll
                    for (int j = 0; j < N; ++j) w.v[j] = narrow<S>(t.v[j] / s);
                } else {
#pragma unroll
                    for (int j = 0; j < N; ++j) w.v[j] = narrow<S>(row[v * N + j] / s);
                }
                ((Vec<S, N>*)q)[v] = w;
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x)
                q[c] = narrow<S>((smem ? row[c] : k_expf(wide(p[c * cs]) - m)) / s);
        }
        __syncthreads();  // the next row reuses the shared copy
    }
}

// Per-row max and sum of exp(x - max) (two reads of the row), in the compute type T.
template <typename S, typename T>
__device__ __forceinline__ void row_stats(const S* p, u64 cols, u64 cs, T* scratch, T& m, T& s) {
    m = lowest<T>();
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) m = MaxOp<T>::combine(m, wide(p[c * cs]));
    m = block_reduce<MaxOp<T> >(m, scratch);
    s = 0;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) s += k_expf(wide(p[c * cs]) - m);
    s = block_reduce<SumOp<T> >(s, scratch);
}

// loss[r] = logsumexp(row) - row[label]; a label outside 0..cols raises error code 1 and gives NaN.
template <typename S, typename T>
__device__ void xent_row(const S* __restrict__ x, const i64* __restrict__ lab, S* __restrict__ y,
                         u64 rows, u64 cols, Dims rd, Strides rs, u64 cs, u64 lo, u64 ls,
                         u32* flag) {
    __shared__ T scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* p = x + offset1<u64>(r, rd, rs);
        T m, s;
        row_stats(p, cols, cs, scratch, m, s);
        if (threadIdx.x == 0) {
            i64 l = lab[lo + r * ls];
            if (l < 0 || (u64)l >= cols) {
                raise_error(flag, 1, l);
                y[r] = narrow<S>(lowest<T>() - lowest<T>());  // NaN
            } else {
                y[r] = narrow<S>(m + k_logf(s) - wide(p[(u64)l * cs]));
            }
        }
    }
}

// dx[r, c] = (softmax(row)[c] - (c == label)) * g[r]
template <typename S, typename T>
__device__ void xent_bwd_row(const S* __restrict__ x, const i64* __restrict__ lab,
                             const S* __restrict__ g, S* __restrict__ y, u64 rows, u64 cols,
                             Dims rd, Strides rs, u64 cs, u64 lo, u64 ls, u64 go, u64 gs,
                             u32* flag) {
    __shared__ T scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* p = x + offset1<u64>(r, rd, rs);
        T m, s;
        row_stats(p, cols, cs, scratch, m, s);
        i64 l = lab[lo + r * ls];
        if ((l < 0 || (u64)l >= cols) && threadIdx.x == 0) raise_error(flag, 1, l);
        T gr = wide(g[go + r * gs]);
        S* q = y + r * cols;
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            T sm = k_expf(wide(p[c * cs]) - m) / s;
            q[c] = narrow<S>((sm - ((i64)c == l ? (T)1 : (T)0)) * gr);
        }
    }
}

// Storage type S, compute type T (the kernels are named by S).
#define ROWS(S, T)                                                                             \
    extern "C" __global__ void softmax_##S(const S* x, S* y, u64 rows, u64 cols, Dims rd,      \
                                           Strides rs, u64 cs, int log, int smem) {            \
        softmax_row<S, T>(x, y, rows, cols, rd, rs, cs, log, smem);                            \
    }                                                                                          \
    extern "C" __global__ void xent_##S(const S* x, const i64* lab, S* y, u64 rows, u64 cols,  \
                                        Dims rd, Strides rs, u64 cs, u64 lo, u64 ls,           \
                                        u32* flag) {                                           \
        xent_row<S, T>(x, lab, y, rows, cols, rd, rs, cs, lo, ls, flag);                       \
    }                                                                                          \
    extern "C" __global__ void xent_bwd_##S(const S* x, const i64* lab, const S* g, S* y,      \
                                            u64 rows, u64 cols, Dims rd, Strides rs, u64 cs,   \
                                            u64 lo, u64 ls, u64 go, u64 gs, u32* flag) {       \
        xent_bwd_row<S, T>(x, lab, g, y, rows, cols, rd, rs, cs, lo, ls, go, gs, flag);        \
    }
// (An instance line names its storage type only: the host compiles a dtype's lines alone.)
#define ROWS_SAME(T) ROWS(T, T)
#define ROWS_HALF(S) ROWS(S, float)
ROWS_SAME(float)
ROWS_SAME(double)
ROWS_HALF(f16)
ROWS_HALF(bf16)

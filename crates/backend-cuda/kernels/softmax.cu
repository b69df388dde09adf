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

template <typename T>
__device__ void softmax_row(const T* __restrict__ x, T* __restrict__ y, u64 rows, u64 cols,
                            Dims rd, Strides rs, u64 cs, int log, int smem) {
    extern __shared__ __align__(16) unsigned char dyn[];
    __shared__ T scratch[32];
    T* row = (T*)dyn;
    const int N = 16 / sizeof(T);
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        u64 base = offset1<u64>(r, rd, rs);
        const T* p = x + base;
        T* q = y + r * cols;
        T m = lowest<T>();
        bool vec = cs == 1 && cols % N == 0 && ((u64)p % 16) == 0;
        if (smem) {
            if (vec) {
#pragma unroll 4
                for (u64 v = threadIdx.x; v < cols / N; v += blockDim.x) {
                    Vec<T, N> w = ((const Vec<T, N>*)p)[v];
                    ((Vec<T, N>*)row)[v] = w;
#pragma unroll
                    for (int j = 0; j < N; ++j) m = MaxOp<T>::combine(m, w.v[j]);
                }
            } else {
                for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
                    T v = p[c * cs];
                    row[c] = v;
                    m = MaxOp<T>::combine(m, v);
                }
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) m = MaxOp<T>::combine(m, p[c * cs]);
        }
        m = block_reduce<MaxOp<T> >(m, scratch);
        T s = 0;
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            T e = k_expf((smem ? row[c] : p[c * cs]) - m);
            if (smem && !log) row[c] = e;
            s += e;
        }
        s = block_reduce<SumOp<T> >(s, scratch);
        if (log) {
            T ls = k_logf(s);
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) q[c] = (smem ? row[c] : p[c * cs]) - m - ls;
        } else if (smem && vec && ((u64)q % 16) == 0) {
            for (u64 v = threadIdx.x; v < cols / N; v += blockDim.x) {
                Vec<T, N> w = ((const Vec<T, N>*)row)[v];
#pragma unroll
                for (int j = 0; j < N; ++j) w.v[j] = w.v[j] / s;
                ((Vec<T, N>*)q)[v] = w;
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x)
                q[c] = (smem ? row[c] : k_expf(p[c * cs] - m)) / s;
        }
        __syncthreads();  // the next row reuses the shared copy
    }
}

// Per-row max and sum of exp(x - max) (two reads of the row).
template <typename T>
__device__ __forceinline__ void row_stats(const T* p, u64 cols, u64 cs, T* scratch, T& m, T& s) {
    m = lowest<T>();
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) m = MaxOp<T>::combine(m, p[c * cs]);
    m = block_reduce<MaxOp<T> >(m, scratch);
    s = 0;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) s += k_expf(p[c * cs] - m);
    s = block_reduce<SumOp<T> >(s, scratch);
}

// loss[r] = logsumexp(row) - row[label]; a label outside 0..cols raises error code 1 and gives NaN.
template <typename T>
__device__ void xent_row(const T* __restrict__ x, const i64* __restrict__ lab, T* __restrict__ y,
                         u64 rows, u64 cols, Dims rd, Strides rs, u64 cs, u64 lo, u64 ls,
                         u32* flag) {
    __shared__ T scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* p = x + offset1<u64>(r, rd, rs);
        T m, s;
        row_stats(p, cols, cs, scratch, m, s);
        if (threadIdx.x == 0) {
            i64 l = lab[lo + r * ls];
            if (l < 0 || (u64)l >= cols) {
                raise_error(flag, 1, l);
                y[r] = lowest<T>() - lowest<T>();  // NaN
            } else {
                y[r] = m + k_logf(s) - p[(u64)l * cs];
            }
        }
    }
}

// dx[r, c] = (softmax(row)[c] - (c == label)) * g[r]
template <typename T>
__device__ void xent_bwd_row(const T* __restrict__ x, const i64* __restrict__ lab,
                             const T* __restrict__ g, T* __restrict__ y, u64 rows, u64 cols,
                             Dims rd, Strides rs, u64 cs, u64 lo, u64 ls, u64 go, u64 gs,
                             u32* flag) {
    __shared__ T scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* p = x + offset1<u64>(r, rd, rs);
        T m, s;
        row_stats(p, cols, cs, scratch, m, s);
        i64 l = lab[lo + r * ls];
        if ((l < 0 || (u64)l >= cols) && threadIdx.x == 0) raise_error(flag, 1, l);
        T gr = g[go + r * gs];
        T* q = y + r * cols;
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            T sm = k_expf(p[c * cs] - m) / s;
            q[c] = (sm - ((i64)c == l ? (T)1 : (T)0)) * gr;
        }
    }
}

#define ROWS(T)                                                                                \
    extern "C" __global__ void softmax_##T(const T* x, T* y, u64 rows, u64 cols, Dims rd,      \
                                           Strides rs, u64 cs, int log, int smem) {            \
        softmax_row<T>(x, y, rows, cols, rd, rs, cs, log, smem);                               \
    }                                                                                          \
    extern "C" __global__ void xent_##T(const T* x, const i64* lab, T* y, u64 rows, u64 cols,  \
                                        Dims rd, Strides rs, u64 cs, u64 lo, u64 ls,           \
                                        u32* flag) {                                           \
        xent_row<T>(x, lab, y, rows, cols, rd, rs, cs, lo, ls, flag);                          \
    }                                                                                          \
    extern "C" __global__ void xent_bwd_##T(const T* x, const i64* lab, const T* g, T* y,      \
                                            u64 rows, u64 cols, Dims rd, Strides rs, u64 cs,   \
                                            u64 lo, u64 ls, u64 go, u64 gs, u32* flag) {       \
        xent_bwd_row<T>(x, lab, g, y, rows, cols, rd, rs, cs, lo, ls, go, gs, flag);           \
    }
ROWS(float)
ROWS(double)

// Elementwise kernels: binary (broadcast through stride-0 layouts), binary with a scalar
// kernel argument, comparisons, where, casts. (Unary ops have no kernel here: they are generated
// from kiln-core's op table, src/expr_run.rs `run_single`.)
//
// Each op comes in three flavours, named `<kind>_<op>_<dtype>_<flavour>`:
//   c    contiguous operands (offsets applied by the host), 16-byte vector loads and stores;
//   s32  strided operands, 32-bit index arithmetic (< 2^31 elements and storage extent);
//   s64  strided operands, 64-bit index arithmetic.
// Integer arithmetic wraps (as Rust's wrapping ops); an integer division by zero gives 0.
// The scalar functions (`op_<name><T>`) are in scalar_ops.cuh, prepended by the host.

// ---- kernel bodies ---------------------------------------------------------------------------

// Binary ops and comparisons: `O` is the output type.
#define BINARY(KIND, NAME, T, O)                                                               \
    extern "C" __global__ void KIND##_##NAME##_##T##_c(const T* __restrict__ a,                \
                                                       const T* __restrict__ b,                \
                                                       O* __restrict__ y, u64 n) {             \
        const int N = 16 / sizeof(T);                                                          \
        u64 nv = n / N;                                                                        \
        const Vec<T, N>* av = (const Vec<T, N>*)a;                                             \
        const Vec<T, N>* bv = (const Vec<T, N>*)b;                                             \
        Vec<O, N>* yv = (Vec<O, N>*)y;                                                         \
        for (u64 i = KILN_TID; i < nv; i += KILN_NTHREADS) {                                   \
            Vec<T, N> p = av[i];                                                               \
            Vec<T, N> q = bv[i];                                                               \
            Vec<O, N> r;                                                                       \
            _Pragma("unroll") for (int j = 0; j < N; ++j) r.v[j] = op_##NAME<T>(p.v[j], q.v[j]); \
            yv[i] = r;                                                                         \
        }                                                                                      \
        for (u64 i = nv * N + KILN_TID; i < n; i += KILN_NTHREADS) y[i] = op_##NAME<T>(a[i], b[i]); \
    }                                                                                          \
    template <typename I>                                                                      \
    __device__ void KIND##_##NAME##_##T##_strided(const T* a, const T* b, O* y, u64 n, Dims d, \
                                                  Strides sa, Strides sb) {                    \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            I oa, ob;                                                                          \
            offset2<I>((I)i, d, sa, sb, oa, ob);                                               \
            y[i] = op_##NAME<T>(a[oa], b[ob]);                                                 \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void KIND##_##NAME##_##T##_s32(const T* a, const T* b, O* y, u64 n,  \
                                                         Dims d, Strides sa, Strides sb) {     \
        KIND##_##NAME##_##T##_strided<u32>(a, b, y, n, d, sa, sb);                             \
    }                                                                                          \
    extern "C" __global__ void KIND##_##NAME##_##T##_s64(const T* a, const T* b, O* y, u64 n,  \
                                                         Dims d, Strides sa, Strides sb) {     \
        KIND##_##NAME##_##T##_strided<u64>(a, b, y, n, d, sa, sb);                             \
    }

// `op(x, s)`, or `op(s, x)` when `lhs` is nonzero; the scalar `s` is a kernel argument.
#define SCALAR(NAME, T)                                                                        \
    extern "C" __global__ void scalar_##NAME##_##T##_c(const T* __restrict__ x, T* __restrict__ y, \
                                                       u64 n, T s, int lhs) {                  \
        const int N = 16 / sizeof(T);                                                          \
        u64 nv = n / N;                                                                        \
        const Vec<T, N>* xv = (const Vec<T, N>*)x;                                             \
        Vec<T, N>* yv = (Vec<T, N>*)y;                                                         \
        for (u64 i = KILN_TID; i < nv; i += KILN_NTHREADS) {                                   \
            Vec<T, N> a = xv[i];                                                               \
            Vec<T, N> r;                                                                       \
            if (lhs) {                                                                         \
                _Pragma("unroll") for (int j = 0; j < N; ++j) r.v[j] = op_##NAME<T>(s, a.v[j]); \
            } else {                                                                           \
                _Pragma("unroll") for (int j = 0; j < N; ++j) r.v[j] = op_##NAME<T>(a.v[j], s); \
            }                                                                                  \
            yv[i] = r;                                                                         \
        }                                                                                      \
        for (u64 i = nv * N + KILN_TID; i < n; i += KILN_NTHREADS)                            \
            y[i] = lhs ? op_##NAME<T>(s, x[i]) : op_##NAME<T>(x[i], s);                        \
    }                                                                                          \
    template <typename I>                                                                      \
    __device__ void scalar_##NAME##_##T##_strided(const T* x, T* y, u64 n, T s, int lhs, Dims d, \
                                                  Strides sx) {                                \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            T v = x[offset1<I>((I)i, d, sx)];                                                  \
            y[i] = lhs ? op_##NAME<T>(s, v) : op_##NAME<T>(v, s);                              \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void scalar_##NAME##_##T##_s32(const T* x, T* y, u64 n, T s, int lhs, \
                                                         Dims d, Strides sx) {                 \
        scalar_##NAME##_##T##_strided<u32>(x, y, n, s, lhs, d, sx);                            \
    }                                                                                          \
    extern "C" __global__ void scalar_##NAME##_##T##_s64(const T* x, T* y, u64 n, T s, int lhs, \
                                                         Dims d, Strides sx) {                 \
        scalar_##NAME##_##T##_strided<u64>(x, y, n, s, lhs, d, sx);                            \
    }

#define ARITH(KINDM, T)                                                                        \
    KINDM(add, T) KINDM(sub, T) KINDM(mul, T) KINDM(div, T) KINDM(maximum, T) KINDM(minimum, T)
#define BIN_SAME(NAME, T) BINARY(binary, NAME, T, T)
ARITH(BIN_SAME, float)
ARITH(BIN_SAME, double)
ARITH(BIN_SAME, i64)
BIN_SAME(pow, float)
BIN_SAME(pow, double)
BIN_SAME(maximum, u8)
BIN_SAME(minimum, u8)
ARITH(SCALAR, float)
ARITH(SCALAR, double)
ARITH(SCALAR, i64)
SCALAR(pow, float)
SCALAR(pow, double)
SCALAR(maximum, u8)
SCALAR(minimum, u8)

#define CMP_ALL(T)                                                                             \
    BINARY(cmp, eq, T, u8) BINARY(cmp, ne, T, u8) BINARY(cmp, lt, T, u8)                       \
    BINARY(cmp, le, T, u8) BINARY(cmp, gt, T, u8) BINARY(cmp, ge, T, u8)
CMP_ALL(float)
CMP_ALL(double)
CMP_ALL(i64)
CMP_ALL(u8)

// ---- where -----------------------------------------------------------------------------------

#define WHERE(T)                                                                               \
    template <typename I>                                                                      \
    __device__ void where_##T##_impl(const u8* c, const T* a, const T* b, T* y, u64 n, Dims d, \
                                     Strides sc, Strides sa, Strides sb) {                     \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            I oc, oa, ob;                                                                      \
            offset3<I>((I)i, d, sc, sa, sb, oc, oa, ob);                                       \
            y[i] = c[oc] ? a[oa] : b[ob];                                                      \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void where_##T##_s32(const u8* c, const T* a, const T* b, T* y,     \
                                               u64 n, Dims d, Strides sc, Strides sa,          \
                                               Strides sb) {                                   \
        where_##T##_impl<u32>(c, a, b, y, n, d, sc, sa, sb);                                   \
    }                                                                                          \
    extern "C" __global__ void where_##T##_s64(const u8* c, const T* a, const T* b, T* y,     \
                                               u64 n, Dims d, Strides sc, Strides sa,          \
                                               Strides sb) {                                   \
        where_##T##_impl<u64>(c, a, b, y, n, d, sc, sa, sb);                                   \
    }
WHERE(u8)
WHERE(u32)
WHERE(u64)

// ---- casts (Rust `as` semantics: float to int truncates, saturates, NaN gives 0) -------------

// (`cast_to<F, T>` is in scalar_ops.cuh.)

#define CAST(F, T)                                                                             \
    template <typename I>                                                                      \
    __device__ void cast_##F##_##T##_impl(const F* x, T* y, u64 n, Dims d, Strides sx) {       \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            y[i] = cast_to<F, T>(x[offset1<I>((I)i, d, sx)]);                                  \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void cast_##F##_##T##_s32(const F* x, T* y, u64 n, Dims d,           \
                                                    Strides sx) {                              \
        cast_##F##_##T##_impl<u32>(x, y, n, d, sx);                                            \
    }                                                                                          \
    extern "C" __global__ void cast_##F##_##T##_s64(const F* x, T* y, u64 n, Dims d,           \
                                                    Strides sx) {                              \
        cast_##F##_##T##_impl<u64>(x, y, n, d, sx);                                            \
    }
#define CAST_FROM(F) CAST(F, float) CAST(F, double) CAST(F, i64) CAST(F, u8)
CAST_FROM(float)
CAST_FROM(double)
CAST_FROM(i64)
CAST_FROM(u8)

// Scalar functions of the elementwise ops (`op_<name><T>`, `op_bwd_<name><T>`), shared by
// elementwise.cu and the fused kernels the host generates for chains of elementwise ops
// (src/lazy.rs), so that a fused chain computes exactly what the single-op kernels do.

// ---- scalar functions ------------------------------------------------------------------------

__device__ __forceinline__ float k_exp(float x) { return expf(x); }
__device__ __forceinline__ double k_exp(double x) { return exp(x); }
__device__ __forceinline__ float k_log(float x) { return logf(x); }
__device__ __forceinline__ double k_log(double x) { return log(x); }
__device__ __forceinline__ float k_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double k_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float k_sin(float x) { return sinf(x); }
__device__ __forceinline__ double k_sin(double x) { return sin(x); }
__device__ __forceinline__ float k_cos(float x) { return cosf(x); }
__device__ __forceinline__ double k_cos(double x) { return cos(x); }
__device__ __forceinline__ float k_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double k_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float k_erf(float x) { return erff(x); }
__device__ __forceinline__ double k_erf(double x) { return erf(x); }
__device__ __forceinline__ float k_floor(float x) { return floorf(x); }
__device__ __forceinline__ double k_floor(double x) { return floor(x); }
__device__ __forceinline__ float k_ceil(float x) { return ceilf(x); }
__device__ __forceinline__ double k_ceil(double x) { return ceil(x); }
__device__ __forceinline__ float k_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double k_pow(double x, double y) { return pow(x, y); }

template <typename T> __device__ __forceinline__ T op_neg(T x) { return -x; }
template <> __device__ __forceinline__ i64 op_neg(i64 x) { return (i64)(0ull - (u64)x); }
template <typename T> __device__ __forceinline__ T op_abs(T x) { return x < (T)0 ? -x : (x == (T)0 ? (T)0 : x); }
template <> __device__ __forceinline__ i64 op_abs(i64 x) { return x < 0 ? (i64)(0ull - (u64)x) : x; }
template <typename T> __device__ __forceinline__ T op_exp(T x) { return k_exp(x); }
template <typename T> __device__ __forceinline__ T op_log(T x) { return k_log(x); }
template <typename T> __device__ __forceinline__ T op_sqrt(T x) { return k_sqrt(x); }
template <typename T> __device__ __forceinline__ T op_square(T x) { return x * x; }
template <> __device__ __forceinline__ i64 op_square(i64 x) { return (i64)((u64)x * (u64)x); }
template <typename T> __device__ __forceinline__ T op_recip(T x) { return (T)1 / x; }
template <typename T> __device__ __forceinline__ T op_sin(T x) { return k_sin(x); }
template <typename T> __device__ __forceinline__ T op_cos(T x) { return k_cos(x); }
template <typename T> __device__ __forceinline__ T op_tanh(T x) { return k_tanh(x); }
template <typename T> __device__ __forceinline__ T op_sigmoid(T x) { return (T)1 / ((T)1 + k_exp(-x)); }
template <typename T> __device__ __forceinline__ T op_relu(T x) { return is_nan(x) ? x : (x > (T)0 ? x : (T)0); }
template <typename T> __device__ __forceinline__ T op_gelu(T x) {
    return (T)0.5 * x * ((T)1 + k_erf(x * (T)0.70710678118654752440));
}
template <typename T> __device__ __forceinline__ T op_sign(T x) {
    return x > (T)0 ? (T)1 : (x < (T)0 ? (T)-1 : (is_nan(x) ? x : (T)0));
}
template <typename T> __device__ __forceinline__ T op_floor(T x) { return k_floor(x); }
template <typename T> __device__ __forceinline__ T op_ceil(T x) { return k_ceil(x); }

template <typename T> __device__ __forceinline__ T op_add(T a, T b) { return a + b; }
template <> __device__ __forceinline__ i64 op_add(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
template <typename T> __device__ __forceinline__ T op_sub(T a, T b) { return a - b; }
template <> __device__ __forceinline__ i64 op_sub(i64 a, i64 b) { return (i64)((u64)a - (u64)b); }
template <typename T> __device__ __forceinline__ T op_mul(T a, T b) { return a * b; }
template <> __device__ __forceinline__ i64 op_mul(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }
template <typename T> __device__ __forceinline__ T op_div(T a, T b) { return a / b; }
template <> __device__ __forceinline__ i64 op_div(i64 a, i64 b) {
    if (b == 0) return 0;
    if (b == -1) return (i64)(0ull - (u64)a);  // i64::MIN / -1 wraps
    return a / b;
}
template <typename T> __device__ __forceinline__ T op_pow(T a, T b) { return k_pow(a, b); }
template <typename T> __device__ __forceinline__ T op_maximum(T a, T b) {
    return is_nan(a) ? a : (is_nan(b) ? b : (a > b ? a : b));
}
template <typename T> __device__ __forceinline__ T op_minimum(T a, T b) {
    return is_nan(a) ? a : (is_nan(b) ? b : (a < b ? a : b));
}

template <typename T> __device__ __forceinline__ u8 op_eq(T a, T b) { return a == b; }
template <typename T> __device__ __forceinline__ u8 op_ne(T a, T b) { return a != b; }
template <typename T> __device__ __forceinline__ u8 op_lt(T a, T b) { return a < b; }
template <typename T> __device__ __forceinline__ u8 op_le(T a, T b) { return a <= b; }
template <typename T> __device__ __forceinline__ u8 op_gt(T a, T b) { return a > b; }
template <typename T> __device__ __forceinline__ u8 op_ge(T a, T b) { return a >= b; }

// Unary backward, `g * op'(x)` from the saved `s` (x or y): the arithmetic, and its order, of
// kiln_core::backend::composed_unary_backward.
template <typename T> __device__ __forceinline__ T op_bwd_exp(T s, T g) { return g * s; }
template <typename T> __device__ __forceinline__ T op_bwd_log(T s, T g) { return g / s; }
template <typename T> __device__ __forceinline__ T op_bwd_sqrt(T s, T g) { return g / (s * (T)2); }
template <typename T> __device__ __forceinline__ T op_bwd_square(T s, T g) { return g * (s * (T)2); }
template <typename T> __device__ __forceinline__ T op_bwd_recip(T s, T g) { return -(g * (s * s)); }
template <typename T> __device__ __forceinline__ T op_bwd_sin(T s, T g) { return g * k_cos(s); }
template <typename T> __device__ __forceinline__ T op_bwd_cos(T s, T g) { return -(g * k_sin(s)); }
template <typename T> __device__ __forceinline__ T op_bwd_tanh(T s, T g) { return g * ((T)1 - s * s); }
template <typename T> __device__ __forceinline__ T op_bwd_sigmoid(T s, T g) { return g * (s * ((T)1 - s)); }
template <typename T> __device__ __forceinline__ T op_bwd_relu(T s, T g) { return g * op_sign<T>(s); }
template <typename T> __device__ __forceinline__ T op_bwd_abs(T s, T g) { return g * op_sign<T>(s); }

// Casts, Rust `as` semantics: float to int truncates, saturates, NaN gives 0.
template <typename F, typename T> __device__ __forceinline__ T cast_to(F x) { return (T)x; }
template <> __device__ __forceinline__ i64 cast_to(float x) {
    if (x != x) return 0;
    if (x >= 9223372036854775807.0f) return 9223372036854775807ll;
    if (x <= -9223372036854775808.0f) return (-9223372036854775807ll - 1);
    return (i64)x;
}
template <> __device__ __forceinline__ i64 cast_to(double x) {
    if (x != x) return 0;
    if (x >= 9223372036854775807.0) return 9223372036854775807ll;
    if (x <= -9223372036854775808.0) return (-9223372036854775807ll - 1);
    return (i64)x;
}
template <> __device__ __forceinline__ u8 cast_to(float x) {
    if (!(x > 0.0f)) return 0;
    if (x >= 255.0f) return 255;
    return (u8)(u32)x;
}
template <> __device__ __forceinline__ u8 cast_to(double x) {
    if (!(x > 0.0)) return 0;
    if (x >= 255.0) return 255;
    return (u8)(u32)x;
}
template <> __device__ __forceinline__ u8 cast_to(i64 x) { return (u8)(u64)x; }
template <> __device__ __forceinline__ float cast_to(i64 x) { return __ll2float_rn(x); }
template <> __device__ __forceinline__ double cast_to(i64 x) { return __ll2double_rn(x); }
template <> __device__ __forceinline__ float cast_to(double x) { return __double2float_rn(x); }

// Scalar functions of the elementwise ops, prepended to every kernel the host generates
// (src/codegen/), so that a fused chain computes exactly what a lone op does. The
// ops' `op_<name><T>` (unary, binary, comparisons) are appended at run time from kiln-core's op
// tables (src/sources.rs, `scalar_ops`); they call the `k_<fn>` math functions below.

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
__device__ __forceinline__ float k_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double k_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float k_expm1(float x) { return expm1f(x); }
__device__ __forceinline__ double k_expm1(double x) { return expm1(x); }
__device__ __forceinline__ float k_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double k_rsqrt(double x) { return rsqrt(x); }
__device__ __forceinline__ float k_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double k_pow(double x, double y) { return pow(x, y); }

// A program's float constants (src/codegen's `literal`) pass through these: NVRTC cannot see
// the value, so it cannot fold a math function of a constant at compile time, which it did with
// the host's math (`tanhf(1.1738222f)`, `rsqrtf(0.6763806f)`) to other bits than the device's
// functions give the interpreter running the same program (tier.rs) at run time.
__device__ __forceinline__ float k_opaque(float x) {
    float r;
    asm("mov.b32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ double k_opaque(double x) {
    double r;
    asm("mov.b64 %0, %1;" : "=d"(r) : "d"(x));
    return r;
}

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

// The 16-bit floats (storage types, see common.cuh): a widened program only loads them, casts
// them to f32 (exact) and rounds to them once from any dtype (an i64 through f64, as the CPU).
template <> __device__ __forceinline__ float cast_to(f16 x) { return wide(x); }
template <> __device__ __forceinline__ float cast_to(bf16 x) { return wide(x); }
template <> __device__ __forceinline__ f16 cast_to(float x) { return narrow<f16>(x); }
template <> __device__ __forceinline__ bf16 cast_to(float x) { return narrow<bf16>(x); }
template <> __device__ __forceinline__ f16 cast_to(double x) { return narrow<f16>(f32_round_to_odd(x)); }
template <> __device__ __forceinline__ bf16 cast_to(double x) { return narrow<bf16>(f32_round_to_odd(x)); }
template <> __device__ __forceinline__ f16 cast_to(i64 x) { return cast_to<double, f16>(__ll2double_rn(x)); }
template <> __device__ __forceinline__ bf16 cast_to(i64 x) { return cast_to<double, bf16>(__ll2double_rn(x)); }
template <> __device__ __forceinline__ f16 cast_to(u8 x) { return narrow<f16>((float)x); }
template <> __device__ __forceinline__ bf16 cast_to(u8 x) { return narrow<bf16>((float)x); }

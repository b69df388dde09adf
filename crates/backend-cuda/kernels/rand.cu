// Philox4x32-10 random numbers, bit for bit the scheme of kiln_core::philox: key
// [seed_lo, seed_hi]; an f32 (or 16-bit) uniform `i` is word i % 4 of counter i / 4, an f64
// uniform or any normal `i` takes counter i. The affine maps use explicit round-to-nearest
// intrinsics so that no FMA contraction changes the uniforms' last bit.

// (`philox` itself lives in common.cuh: fused attention draws its dropout mask with it.)

extern "C" __global__ void rand_uniform_double(double* y, u64 n, u64 seed, double low,
                                               double high) {
    for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {
        u32 w[4];
        philox(i, seed, w);
        u64 bits = (((u64)w[0] << 32) | (u64)w[1]) >> 11;
        double u = __dmul_rn((double)bits, 1.1102230246251565404236316680908203125e-16);  // 2^-53
        y[i] = __dadd_rn(low, __dmul_rn(__dsub_rn(high, low), u));
    }
}

extern "C" __global__ void rand_normal_double(double* y, u64 n, u64 seed, double mean,
                                              double std) {
    for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {
        u32 w[4];
        philox(i, seed, w);
        u64 b1 = ((((u64)w[0] << 32) | (u64)w[1]) >> 11) + 1;
        u64 b2 = (((u64)w[2] << 32) | (u64)w[3]) >> 11;
        double u1 = __dmul_rn((double)b1, 1.1102230246251565404236316680908203125e-16);
        double u2 = __dmul_rn((double)b2, 1.1102230246251565404236316680908203125e-16);
        double z = __dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))),
                             cos(__dmul_rn(6.283185307179586476925286766559, u2)));
        y[i] = __dadd_rn(mean, __dmul_rn(std, z));
    }
}

// f32 draws, stored as `S`: f32 itself, or rounded once to a 16-bit float (as the CPU backend
// and the reference do), so the 16-bit streams are the f32 streams rounded.
__device__ __forceinline__ float uniform_of(u32 w, float low, float high) {
    float u = __fmul_rn((float)(w >> 8), 5.9604644775390625e-8f);  // 2^-24
    return __fadd_rn(low, __fmul_rn(__fsub_rn(high, low), u));
}

__device__ __forceinline__ float normal_f32(u64 i, u64 seed, float mean, float std) {
    u32 w[4];
    philox(i, seed, w);
    float u1 = __fmul_rn((float)((w[0] >> 8) + 1), 5.9604644775390625e-8f);
    float u2 = __fmul_rn((float)(w[1] >> 8), 5.9604644775390625e-8f);
    float z = __fmul_rn(sqrtf(__fmul_rn(-2.0f, logf(u1))),
                        cosf(__fmul_rn(6.28318530717958647692f, u2)));
    return __fadd_rn(mean, __fmul_rn(std, z));
}

// Uniforms 4 g .. 4 g + 3 from counter g, one thread each group: whole groups in one vector
// store (`y` is a fresh allocation, so 4 g elements in is aligned), the last one element-wise.
template <typename S>
__device__ void rand_uniform4(S* __restrict__ y, u64 n, u64 seed, float low, float high) {
    for (u64 g = KILN_TID; 4 * g < n; g += KILN_NTHREADS) {
        u32 w[4];
        philox(g, seed, w);
        Vec<S, 4> o;
#pragma unroll
        for (int k = 0; k < 4; ++k) o.v[k] = narrow<S>(uniform_of(w[k], low, high));
        if (4 * g + 4 <= n) {
            ((Vec<S, 4>*)y)[g] = o;
        } else {
            for (u64 k = 0; 4 * g + k < n; ++k) y[4 * g + k] = o.v[k];
        }
    }
}

// Dropout's keep mask (RandDist::Keep): byte i is 1 where uniform i on [0, 1) is >= p (in f32,
// as a `compare_scalar(Ge, p)` on the f32 draw and att_drop do). Four bytes from one Philox
// call, one 4-byte store (`y` is a fresh allocation); the uniforms never reach memory.
extern "C" __global__ void rand_keep_float(u8* __restrict__ y, u64 n, u64 seed, float p) {
    for (u64 g = KILN_TID; 4 * g < n; g += KILN_NTHREADS) {
        u32 w[4];
        philox(g, seed, w);
        u32 bits = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) bits |= (u32)(uniform_of(w[k], 0.0f, 1.0f) >= p) << (8 * k);
        if (4 * g + 4 <= n) {
            ((u32*)y)[g] = bits;
        } else {
            for (u64 k = 0; 4 * g + k < n; ++k) y[4 * g + k] = (u8)(bits >> (8 * k));
        }
    }
}

#define RAND_F32(S)                                                                            \
    extern "C" __global__ void rand_uniform_##S(S* y, u64 n, u64 seed, float low, float high) { \
        rand_uniform4<S>(y, n, seed, low, high);                                               \
    }                                                                                          \
    extern "C" __global__ void rand_normal_##S(S* y, u64 n, u64 seed, float mean, float std) { \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS)                                      \
            y[i] = narrow<S>(normal_f32(i, seed, mean, std));                                \
    }
RAND_F32(float)
RAND_F32(f16)
RAND_F32(bf16)

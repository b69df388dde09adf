// Shared definitions, prepended by the host to every kernel source before NVRTC compiles it
// (NVRTC has no system headers; we need none).
//
// Shapes and strides travel by value as kernel arguments (`Dims`, `Strides`): up to
// KILN_MAX_DIMS dimensions after the host has merged the dimensions that are contiguous among
// themselves. `I` is the index type: u32 when every index fits (the common, faster case), u64
// beyond 2^31 elements.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define KILN_MAX_DIMS 8

struct Dims {
    u64 d[KILN_MAX_DIMS];
    int rank;
};

struct Strides {
    u64 s[KILN_MAX_DIMS];
    u64 offset;
};

// Storage offset of logical (row-major) index `i`.
template <typename I>
__device__ __forceinline__ I offset1(I i, const Dims& d, const Strides& a) {
    I oa = (I)a.offset;
#pragma unroll
    for (int k = KILN_MAX_DIMS - 1; k >= 0; --k) {
        if (k < d.rank) {
            I dk = (I)d.d[k];
            I q = i / dk;
            I r = i - q * dk;
            oa += r * (I)a.s[k];
            i = q;
        }
    }
    return oa;
}

// Offsets of logical index `i` in two layouts sharing one shape (one set of divisions).
template <typename I>
__device__ __forceinline__ void offset2(I i, const Dims& d, const Strides& a, const Strides& b,
                                        I& oa, I& ob) {
    oa = (I)a.offset;
    ob = (I)b.offset;
#pragma unroll
    for (int k = KILN_MAX_DIMS - 1; k >= 0; --k) {
        if (k < d.rank) {
            I dk = (I)d.d[k];
            I q = i / dk;
            I r = i - q * dk;
            oa += r * (I)a.s[k];
            ob += r * (I)b.s[k];
            i = q;
        }
    }
}

template <typename I>
__device__ __forceinline__ void offset3(I i, const Dims& d, const Strides& a, const Strides& b,
                                        const Strides& c, I& oa, I& ob, I& oc) {
    oa = (I)a.offset;
    ob = (I)b.offset;
    oc = (I)c.offset;
#pragma unroll
    for (int k = KILN_MAX_DIMS - 1; k >= 0; --k) {
        if (k < d.rank) {
            I dk = (I)d.d[k];
            I q = i / dk;
            I r = i - q * dk;
            oa += r * (I)a.s[k];
            ob += r * (I)b.s[k];
            oc += r * (I)c.s[k];
            i = q;
        }
    }
}

// N consecutive elements moved as one 16-byte (or smaller, for narrow outputs) access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

// ---- 16-bit floats ---------------------------------------------------------------------------
// f16 and bf16 are storage types only: kernels load them, compute in f32 and round once on
// store (kiln_core's `Program::widened`; the hand-written kernels instantiate with an f32
// accumulator). Two distinct structs (not `u16`), so that overloads and `cast_to` tell them
// apart. Conversions match the `half` crate and kiln_core::halfround bit for bit, NaN payloads
// included: f32 -> 16 bits rounds to nearest even; f64 -> 16 bits rounds once (through f32
// rounded to odd, as `halfround` does).
struct f16 { u16 x; };
struct bf16 { u16 x; };

// One name each way: `wide` loads (f32/f64/integers unchanged; the 16-bit floats to f32, exact)
// and `narrow<S>` stores (to the storage type `S`: unchanged, or f32 rounded to 16 bits). The
// hand-written kernels templated on a storage type `S` and a compute type `T` (the same for
// f32/f64; f32 for the 16-bit floats) use them, and so do `cast_to`'s 16-bit cases.
template <typename T> __device__ __forceinline__ T wide(T v) { return v; }
__device__ __forceinline__ float wide(f16 h) {
    if ((h.x & 0x7fffu) > 0x7c00u)
        return __uint_as_float(((u32)(h.x & 0x8000u) << 16) | 0x7fc00000u | ((u32)(h.x & 0x3ffu) << 13));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
    return f;
}
__device__ __forceinline__ float wide(bf16 h) { return __uint_as_float(((u32)h.x) << 16); }

template <typename S, typename T> __device__ __forceinline__ S narrow(T v) { return v; }
template <> __device__ __forceinline__ f16 narrow<f16, float>(float f) {
    f16 h;
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.x = (u16)(((u >> 16) & 0x8000u) | 0x7e00u | ((u & 0x7fffffu) >> 13));
        return h;
    }
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
    return h;
}
template <> __device__ __forceinline__ bf16 narrow<bf16, float>(float f) {
    bf16 h;
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.x = (u16)((u >> 16) | 0x40u);
        return h;
    }
#if __CUDA_ARCH__ >= 800
    // One conversion instruction instead of five integer ones: a widened 16-bit program rounds
    // after every operation, and the integer form made bf16 chains compute-bound.
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
#else
    u += 0x7fffu + ((u >> 16) & 1u);
    h.x = (u16)(u >> 16);
#endif
    return h;
}
// `d` rounded to f32 toward zero with the last bit set when inexact (round to odd): a later
// rounding to 11 or 8 significant bits is then the correct rounding of `d`.
__device__ __forceinline__ float f32_round_to_odd(double d) {
    float r = __double2float_rz(d);
    if (r != r || (double)r == d) return r;
    return __uint_as_float(__float_as_uint(r) | 1u);
}

__device__ __forceinline__ bool is_nan(float x) { return x != x; }
__device__ __forceinline__ bool is_nan(double x) { return x != x; }
__device__ __forceinline__ bool is_nan(i64) { return false; }
__device__ __forceinline__ bool is_nan(u8) { return false; }

// The device-wide error record {code, pad, value_lo, value_hi}: the first failing thread stores
// its code and the offending value (e.g. the bad index); the host reads it back.
__device__ __forceinline__ void raise_error(u32* flag, u32 code, i64 value) {
    if (atomicCAS(flag, 0u, code) == 0u) *(i64*)(flag + 2) = value;
}

// Philox4x32-10, bit for bit kiln_core::philox: element `i` of a draw uses counter
// [i_lo, i_hi, 0, 0] and key [seed_lo, seed_hi] (rand.cu's draws, attention.cu's dropout).
__device__ __forceinline__ void philox(u64 i, u64 seed, u32 out[4]) {
    u32 c0 = (u32)i, c1 = (u32)(i >> 32), c2 = 0, c3 = 0;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

// Grid-stride loop bounds for 1-d launches.
#define KILN_TID ((u64)blockIdx.x * blockDim.x + threadIdx.x)
#define KILN_NTHREADS ((u64)gridDim.x * blockDim.x)

// ---- warp and block reductions ---------------------------------------------------------------
// Butterfly (xor) shuffles: every lane ends with the same, bit-identical result, and the tree is
// fixed by the launch shape, so sums are deterministic (no atomics).

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ double shfl_xor(double v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ i64 shfl_xor(i64 v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ u8 shfl_xor(u8 v, int o) { return (u8)__shfl_xor_sync(0xffffffffu, (int)v, o); }

template <typename T> __device__ __forceinline__ T lowest();
template <> __device__ __forceinline__ float lowest<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double lowest<double>() { return -__longlong_as_double(0x7ff0000000000000ll); }
template <> __device__ __forceinline__ i64 lowest<i64>() { return (-9223372036854775807ll - 1); }
template <> __device__ __forceinline__ u8 lowest<u8>() { return 0; }
template <typename T> __device__ __forceinline__ T highest();
template <> __device__ __forceinline__ float highest<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double highest<double>() { return __longlong_as_double(0x7ff0000000000000ll); }
template <> __device__ __forceinline__ i64 highest<i64>() { return 9223372036854775807ll; }
template <> __device__ __forceinline__ u8 highest<u8>() { return 255; }

template <typename T> __device__ __forceinline__ T wrap_add(T a, T b) { return a + b; }
template <> __device__ __forceinline__ i64 wrap_add(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }

template <typename T> struct SumOp {
    typedef T Acc;
    static __device__ __forceinline__ Acc init() { return (T)0; }
    static __device__ __forceinline__ Acc lift(T v, i64) { return v; }
    static __device__ __forceinline__ Acc combine(Acc a, Acc b) { return wrap_add(a, b); }
    static __device__ __forceinline__ Acc shfl(Acc a, int o) { return shfl_xor(a, o); }
};
// Max and Min propagate NaN.
template <typename T> struct MaxOp {
    typedef T Acc;
    static __device__ __forceinline__ Acc init() { return lowest<T>(); }
    static __device__ __forceinline__ Acc lift(T v, i64) { return v; }
    static __device__ __forceinline__ Acc combine(Acc a, Acc b) {
        return is_nan(a) ? a : (is_nan(b) ? b : (b > a ? b : a));
    }
    static __device__ __forceinline__ Acc shfl(Acc a, int o) { return shfl_xor(a, o); }
};
template <typename T> struct MinOp {
    typedef T Acc;
    static __device__ __forceinline__ Acc init() { return highest<T>(); }
    static __device__ __forceinline__ Acc lift(T v, i64) { return v; }
    static __device__ __forceinline__ Acc combine(Acc a, Acc b) {
        return is_nan(a) ? a : (is_nan(b) ? b : (b < a ? b : a));
    }
    static __device__ __forceinline__ Acc shfl(Acc a, int o) { return shfl_xor(a, o); }
};

// Arg reductions: (value, index); ties pick the smaller index; NaN counts as the largest for
// ArgMax and the smallest for ArgMin (numpy). Index -1 marks "nothing seen yet".
template <typename T> struct ArgAcc {
    T v;
    i64 i;
};
template <typename T, bool MAX> struct ArgOp {
    typedef ArgAcc<T> Acc;
    static __device__ __forceinline__ Acc init() { Acc a; a.v = (T)0; a.i = -1; return a; }
    static __device__ __forceinline__ Acc lift(T v, i64 i) { Acc a; a.v = v; a.i = i; return a; }
    // true when b should replace a
    static __device__ __forceinline__ bool better(Acc a, Acc b) {
        if (b.i < 0) return false;
        if (a.i < 0) return true;
        bool an = is_nan(a.v), bn = is_nan(b.v);
        if (an || bn) return (an && bn) ? b.i < a.i : bn;
        if (b.v == a.v) return b.i < a.i;
        return MAX ? (b.v > a.v) : (b.v < a.v);
    }
    static __device__ __forceinline__ Acc combine(Acc a, Acc b) { return better(a, b) ? b : a; }
    static __device__ __forceinline__ Acc shfl(Acc a, int o) {
        Acc r;
        r.v = shfl_xor(a.v, o);
        r.i = shfl_xor(a.i, o);
        return r;
    }
};

template <typename Op>
__device__ __forceinline__ typename Op::Acc warp_reduce(typename Op::Acc a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = Op::combine(a, Op::shfl(a, o));
    return a;
}

// Reduces over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` holds 32 Accs in shared memory.
template <typename Op>
__device__ __forceinline__ typename Op::Acc block_reduce(typename Op::Acc a,
                                                         typename Op::Acc* scratch) {
    a = warp_reduce<Op>(a);
    if (blockDim.x <= 32) return a;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();  // a previous call may still read scratch
    if (lane == 0) scratch[w] = a;
    __syncthreads();
    int nw = blockDim.x >> 5;
    a = lane < nw ? scratch[lane] : Op::init();
    return warp_reduce<Op>(a);
}

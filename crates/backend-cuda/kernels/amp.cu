// Mixed-precision training: the GradScaler's gradient unscale and inf/NaN check in one pass
// (PyTorch's `_amp_foreach_non_finite_check_and_unscale_`; host code amp.rs).
//
// One launch takes up to UNSCALE_MAX gradients of one dtype as one virtual concatenation:
// `start` holds the prefix offsets (start[count] elements in all) and each thread finds its
// gradient by binary search over them, as the generated multi-tensor kernels do
// (codegen/multi_tensor.rs). Every pointer travels in the by-value `UnscaleArgs` (3 KB of
// the 4 KB of kernel parameters; no per-launch upload, so a captured CUDA graph replays it as
// is). Each element is loaded, multiplied by `inv` in the compute type (f32 for the 16-bit
// floats), rounded once to its dtype and stored to `y`; a thread that stored a non-finite
// value writes 1 to `found`, which the host zeroed before the launch. Set-only, so no atomics:
// racing writers all write the same value.

#define UNSCALE_MAX 128

struct UnscaleArgs {
    u64 start[UNSCALE_MAX + 1];
    u64 count;
    u64 x[UNSCALE_MAX];
    u64 y[UNSCALE_MAX];
};

// Whether `v` is inf or NaN: the exponent bits all set (a bit test, immune to any
// floating-point contraction of `v - v`).
__device__ __forceinline__ bool non_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool non_finite(double v) {
    return ((u64)__double_as_longlong(v) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// S: the storage type; T: the compute type (S itself for float and double, float for f16/bf16).
template <typename S, typename T>
__device__ __forceinline__ void unscale_check(const UnscaleArgs& a, T inv, float* found) {
    const u64 total = a.start[a.count];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    bool bad = false;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int lo = 0, hi = (int)a.count - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (a.start[mid] <= i) lo = mid; else hi = mid - 1;
        }
        const u64 e = i - a.start[lo];
        const S v = narrow<S>(wide(((const S*)a.x[lo])[e]) * inv);
        ((S*)a.y[lo])[e] = v;
        // Widening is exact: the check sees the stored value (an f16 overflow included).
        bad |= non_finite(wide(v));
    }
    if (bad) *found = 1.0f;
}

#define UNSCALE_CHECK(S, T)                                                                    \
    extern "C" __global__ void unscale_check_##S(UnscaleArgs a, T inv, float* found) {         \
        unscale_check<S, T>(a, inv, found);                                                    \
    }
#define UNSCALE_CHECK_SAME(T) UNSCALE_CHECK(T, T)
#define UNSCALE_CHECK_HALF(S) UNSCALE_CHECK(S, float)
UNSCALE_CHECK_SAME(float)
UNSCALE_CHECK_SAME(double)
UNSCALE_CHECK_HALF(f16)
UNSCALE_CHECK_HALF(bf16)

// Gradient clipping's global norm, squared (PyTorch's `_foreach_norm` and the sum of its
// results; host code amp.rs): the sum of the squares of every element of up to UNSCALE_MAX
// tensors (the same `UnscaleArgs`, outputs unused), accumulated in double. sq_sum_<S>: each
// block sums one contiguous range of the tensors' concatenation (by 16-byte vectors, several a
// thread in flight; a grid-stride share of each tensor in turn paid one memory round trip per
// tensor: 50 us for a GPT's 10.75M f32 gradients in ~40 tensors on an H200) and writes its
// total, reduced by a fixed tree, to part[blockIdx.x]; sq_sum_fold (one
// block) adds `n` parts in a fixed order into out[0], plus out[0] itself when `acc` (a later
// launch of more than UNSCALE_MAX tensors). The grid depends only on the device and the
// launch's element count, so a call gives the same bits every time (no atomics).
template <typename S>
__device__ __forceinline__ void sq_sum(const UnscaleArgs& a, double* part) {
    __shared__ double scratch[32];
    const int N = 16 / sizeof(S);
    const u64 total = a.start[a.count];
    // Block b's range of the concatenation: `per` elements (a multiple of 64) from b * per.
    const u64 per = ((total + gridDim.x - 1) / gridDim.x + 63) & ~(u64)63;
    const u64 lo = min((u64)blockIdx.x * per, total), hi = min(lo + per, total);
    double s = 0.0, s2 = 0.0;
    int t = 0;
    for (u64 p = lo; p < hi;) {
        while (a.start[t + 1] <= p) ++t;
        const u64 end = min(hi, a.start[t + 1]);
        const S* x = (const S*)a.x[t] + (p - a.start[t]);
        const u64 n = end - p;
        // Elements up to the first 16-byte boundary, then vectors (four a thread in flight),
        // then the rest.
        const u64 head = min(n, (u64)((16 - ((u64)x & 15)) & 15) / sizeof(S));
        for (u64 i = threadIdx.x; i < head; i += blockDim.x) {
            const double v = (double)wide(x[i]);
            s = fma(v, v, s);
        }
        const Vec<S, N>* xv = (const Vec<S, N>*)(x + head);
        const u64 nv = (n - head) / N, bs = blockDim.x;
        u64 e = threadIdx.x;
        for (; e + 3 * bs < nv; e += 4 * bs) {
            Vec<S, N> q[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) q[k] = xv[e + k * bs];
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const double v = (double)wide(q[k].v[j]);
                    if (k & 1) s2 = fma(v, v, s2); else s = fma(v, v, s);
                }
        }
        for (; e < nv; e += bs)
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const double v = (double)wide(xv[e].v[j]);
                s = fma(v, v, s);
            }
        for (u64 i = head + nv * N + threadIdx.x; i < n; i += bs) {
            const double v = (double)wide(x[i]);
            s = fma(v, v, s);
        }
        p = end;
    }
    s = block_reduce<SumOp<double>>(s + s2, scratch);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

extern "C" __global__ void sq_sum_fold(const double* part, u64 n, double* out, int acc) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) s += part[i];
    s = block_reduce<SumOp<double>>(s, scratch);
    if (threadIdx.x == 0) out[0] = acc ? out[0] + s : s;
}

#define SQ_SUM(S)                                                                              \
    extern "C" __global__ void sq_sum_##S(UnscaleArgs a, double* part) { sq_sum<S>(a, part); }
SQ_SUM(float)
SQ_SUM(double)
SQ_SUM(f16)
SQ_SUM(bf16)

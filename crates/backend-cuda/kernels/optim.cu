// Multi-tensor optimizer updates: one launch updates up to KILN_MT_MAX parameters (PyTorch's
// multi_tensor_apply idea). The parameters form one virtual concatenation; `start` holds the
// prefix offsets, and each thread finds its tensor by binary search over them. Every pointer
// travels in the by-value `MtArgs` struct: no per-launch upload.
//
// The formulas are kiln_core::UpdateRule's (PyTorch's SGD / Adam / AdamW). Math runs in the
// parameter's dtype; hyperparameters arrive as doubles.

#define KILN_MT_MAX 24

struct MtArgs {
    u64 param[KILN_MT_MAX];
    u64 grad[KILN_MT_MAX];
    u64 s0[KILN_MT_MAX];
    u64 s1[KILN_MT_MAX];
    u64 out_param[KILN_MT_MAX];
    u64 out_s0[KILN_MT_MAX];
    u64 out_s1[KILN_MT_MAX];
    u64 start[KILN_MT_MAX + 1];
    int count;
};

__device__ __forceinline__ int mt_find(const MtArgs& a, u64 i) {
    int lo = 0, hi = a.count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (a.start[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ __forceinline__ void sgd_body(const MtArgs& a, T lr, T momentum, T dampening,
                                         int nesterov, T wd, int first_step) {
    u64 total = a.start[a.count];
    u64 stride = (u64)blockDim.x * gridDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int t = mt_find(a, i);
        u64 j = i - a.start[t];
        const T* p = (const T*)a.param[t];
        const T* g = (const T*)a.grad[t];
        T pv = p[j];
        T gv = g[j];
        if (wd != (T)0) gv = gv + wd * pv;
        T d = gv;
        if (momentum != (T)0) {
            T m = first_step ? gv : momentum * ((const T*)a.s0[t])[j] + ((T)1 - dampening) * gv;
            ((T*)a.out_s0[t])[j] = m;
            d = nesterov ? gv + momentum * m : m;
        }
        ((T*)a.out_param[t])[j] = pv - lr * d;
    }
}

template <typename T>
__device__ __forceinline__ void adam_body(const MtArgs& a, T lr, T beta1, T beta2, T eps, T wd,
                                          int decoupled, T bc1, T bc2) {
    u64 total = a.start[a.count];
    u64 stride = (u64)blockDim.x * gridDim.x;
    T step = lr / bc1;
    T inv_sqrt_bc2 = (T)1 / sqrt(bc2);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int t = mt_find(a, i);
        u64 j = i - a.start[t];
        T pv = ((const T*)a.param[t])[j];
        T gv = ((const T*)a.grad[t])[j];
        if (wd != (T)0) {
            if (decoupled) pv = pv * ((T)1 - lr * wd);
            else gv = gv + wd * pv;
        }
        T m = beta1 * ((const T*)a.s0[t])[j] + ((T)1 - beta1) * gv;
        T v = beta2 * ((const T*)a.s1[t])[j] + ((T)1 - beta2) * gv * gv;
        ((T*)a.out_s0[t])[j] = m;
        ((T*)a.out_s1[t])[j] = v;
        ((T*)a.out_param[t])[j] = pv - step * (m / (sqrt(v) * inv_sqrt_bc2 + eps));
    }
}

#define KILN_OPTIM(T, NAME)                                                                      \
    extern "C" __global__ void sgd_##NAME(MtArgs a, double lr, double momentum,                 \
                                          double dampening, int nesterov, double wd,            \
                                          int first_step) {                                      \
        sgd_body<T>(a, (T)lr, (T)momentum, (T)dampening, nesterov, (T)wd, first_step);           \
    }                                                                                            \
    extern "C" __global__ void adam_##NAME(MtArgs a, double lr, double beta1, double beta2,     \
                                           double eps, double wd, int decoupled, double bc1,    \
                                           double bc2) {                                         \
        adam_body<T>(a, (T)lr, (T)beta1, (T)beta2, (T)eps, (T)wd, decoupled, (T)bc1, (T)bc2);   \
    }

KILN_OPTIM(float, f32)
KILN_OPTIM(double, f64)

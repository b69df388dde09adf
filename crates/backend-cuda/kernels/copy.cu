// Data movement by element size (1, 4 or 8 bytes; the dtype does not matter): strided copies
// (contiguous, copy_into, cross-device staging) and fills.

#define COPY(T)                                                                                \
    template <typename I>                                                                      \
    __device__ void copy_##T##_impl(const T* x, T* y, u64 n, Dims d, Strides sx, Strides sy) { \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            I ox, oy;                                                                          \
            offset2<I>((I)i, d, sx, sy, ox, oy);                                               \
            y[oy] = x[ox];                                                                     \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void copy_##T##_s32(const T* x, T* y, u64 n, Dims d, Strides sx,     \
                                              Strides sy) {                                    \
        copy_##T##_impl<u32>(x, y, n, d, sx, sy);                                              \
    }                                                                                          \
    extern "C" __global__ void copy_##T##_s64(const T* x, T* y, u64 n, Dims d, Strides sx,     \
                                              Strides sy) {                                    \
        copy_##T##_impl<u64>(x, y, n, d, sx, sy);                                              \
    }                                                                                          \
    extern "C" __global__ void fill_##T(T* y, u64 n, T v) {                                    \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) y[i] = v;                            \
    }
COPY(u8)
COPY(u16)
COPY(u32)
COPY(u64)

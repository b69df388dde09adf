// Utility kernels that are not tensor ops.

// Keeps one thread busy for `ns` nanoseconds of the GPU's global timer: a kernel of known
// length that occupies almost nothing, for tests and benchmarks of stream concurrency and
// ordering (CUDA samples' `clock_block`).
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

// Rows of page-locked host arrays gathered into device memory by the GPU itself: the
// DataLoader's path for a pinned dataset (host_gather.rs). Each array's `src` is host memory,
// read over the bus (unified addressing gives page-locked host memory the same address on the
// device); `rows` (the row numbers) and `dst` are device memory. An array moves in words of
// `word` bytes (16, 8, 4 or 1: the largest that divides its row size and alignments); the
// grid strides over all the words, each thread keeping GATHER_UNROLL reads in flight, since a
// read over the bus takes microseconds. No shared memory and no barrier: the kernel runs
// beside the training step's kernels, and a block that needs shared memory can hold a
// multiprocessor in a configuration that theirs do not fit. blockIdx.y picks the array.
// With `decode`, the array holds bytes that become `byte / div` in f32 (`word` is then 16, 4
// or 1 bytes read at a time, written as four float4s, one float4 or one float), rounded as
// the host's division rounds, so the result is the same bits.
struct GatherArray {
    const unsigned char* src;
    unsigned char* dst;
    unsigned long long row_words;
    unsigned int word;
    unsigned int decode;
    float div;
    unsigned int pad;
};

#define GATHER_UNROLL 4

__device__ __forceinline__ float decode_byte(unsigned char b, float d) {
    return __fdiv_rn((float)b, d);
}
__device__ __forceinline__ float4 decode_byte(uchar4 b, float d) {
    return make_float4(decode_byte(b.x, d), decode_byte(b.y, d), decode_byte(b.z, d),
                       decode_byte(b.w, d));
}
// Four bytes of a little-endian word, lowest first.
__device__ __forceinline__ float4 decode_word(unsigned int w, float d) {
    return make_float4(decode_byte(w & 0xff, d), decode_byte((w >> 8) & 0xff, d),
                       decode_byte((w >> 16) & 0xff, d), decode_byte(w >> 24, d));
}
__device__ __forceinline__ void store_decoded(float* dst, unsigned long long k, unsigned char v,
                                              float d) {
    dst[k] = decode_byte(v, d);
}
__device__ __forceinline__ void store_decoded(float4* dst, unsigned long long k, uchar4 v,
                                              float d) {
    dst[k] = decode_byte(v, d);
}
__device__ __forceinline__ void store_decoded(float4* dst, unsigned long long k, uint4 v,
                                              float d) {
    dst[4 * k] = decode_word(v.x, d);
    dst[4 * k + 1] = decode_word(v.y, d);
    dst[4 * k + 2] = decode_word(v.z, d);
    dst[4 * k + 3] = decode_word(v.w, d);
}

// `W` words read, `O` words written: copied, or with DECODE converted by `decode_byte`.
template <typename W, typename O = W, bool DECODE = false>
__device__ void gather_words(const unsigned int* __restrict__ rows, unsigned int n,
                             const GatherArray& a) {
    const W* __restrict__ src = (const W*)a.src;
    O* __restrict__ dst = (O*)a.dst;
    const unsigned long long rw = a.row_words;
    const unsigned long long words = (unsigned long long)n * rw;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k0 = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k0 < words; k0 += stride * GATHER_UNROLL) {
        W v[GATHER_UNROLL];
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; ++u) {
            const unsigned long long k = k0 + u * stride;
            if (k < words) {
                const unsigned long long r = k / rw, c = k - r * rw;
                v[u] = src[(unsigned long long)__ldg(rows + r) * rw + c];
            }
        }
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; ++u) {
            const unsigned long long k = k0 + u * stride;
            if (k < words) {
                if constexpr (DECODE) {
                    store_decoded(dst, k, v[u], a.div);
                } else {
                    dst[k] = v[u];
                }
            }
        }
    }
}

extern "C" __global__ void gather_rows(const unsigned int* rows, unsigned int n, GatherArray a0,
                                       GatherArray a1) {
    const GatherArray a = blockIdx.y == 0 ? a0 : a1;
    if (a.row_words == 0) return;
    if (a.decode) {
        if (a.word == 16) {
            gather_words<uint4, float4, true>(rows, n, a);
        } else if (a.word == 4) {
            gather_words<uchar4, float4, true>(rows, n, a);
        } else {
            gather_words<unsigned char, float, true>(rows, n, a);
        }
        return;
    }
    switch (a.word) {
        case 16: gather_words<uint4>(rows, n, a); break;
        case 8: gather_words<unsigned long long>(rows, n, a); break;
        case 4: gather_words<unsigned int>(rows, n, a); break;
        default: gather_words<unsigned char>(rows, n, a); break;
    }
}

// Bytes in device memory decoded to f32 (`byte / div`, as the gather decodes): the second half
// of a copy of consecutive pinned rows (host_gather.rs), queued on the copy stream after the
// DMA that brought the bytes. The first `words` groups of 16 bytes go a uint4 at a time (both
// addresses 16-byte aligned), the rest of the `n` bytes one at a time; a grid-stride loop over
// few blocks, like the gather, so the training step keeps the multiprocessors.
extern "C" __global__ void decode_bytes(const unsigned char* __restrict__ src,
                                        float* __restrict__ dst, unsigned long long n,
                                        unsigned long long words, float div) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4* __restrict__ s16 = (const uint4*)src;
    float4* __restrict__ d16 = (float4*)dst;
    // GATHER_UNROLL loads in flight a thread (a 12-batch group of MNIST pixels: ~190 us on an
    // H200 with 16 blocks, ~218 us with one load at a time).
    for (unsigned long long k0 = t; k0 < words; k0 += stride * GATHER_UNROLL) {
        uint4 v[GATHER_UNROLL];
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; ++u) {
            const unsigned long long k = k0 + u * stride;
            if (k < words) v[u] = s16[k];
        }
#pragma unroll
        for (int u = 0; u < GATHER_UNROLL; ++u) {
            const unsigned long long k = k0 + u * stride;
            if (k < words) store_decoded(d16, k, v[u], div);
        }
    }
    for (unsigned long long k = 16 * words + t; k < n; k += stride) {
        dst[k] = decode_byte(src[k], div);
    }
}

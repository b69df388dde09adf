// Indexing: index_select, gather, scatter_add. An index outside its axis raises error code 2
// in the device's error flag (read back by the host, which turns it into a typed error) and
// the element is skipped (zero in the output); no out-of-bounds access ever happens, so the
// device stays usable.

// out[..., j, ...] = x[..., ids[j], ...]; `sx` are x's strides over the output's dims with the
// selected axis' stride set to 0; `post` is the product of the output dims after the axis.
#define INDEX_SELECT(T)                                                                        \
    extern "C" __global__ void index_select_##T(const T* x, const i64* ids, T* y, u64 n,       \
                                                Dims d, Strides sx, u64 ax_stride,             \
                                                u64 ax_size, u64 post, u64 nids, u64 io,       \
                                                u64 is, u32* flag) {                           \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            u64 j = (i / post) % nids;                                                         \
            i64 id = ids[io + j * is];                                                         \
            if (id < 0 || (u64)id >= ax_size) {                                                \
                raise_error(flag, 2, id);                                                          \
                y[i] = 0;                                                                      \
                continue;                                                                      \
            }                                                                                  \
            y[i] = x[offset1<u64>(i, d, sx) + (u64)id * ax_stride];                            \
        }                                                                                      \
    }

// The same for a contiguous x whose rows after the axis are whole 16-byte vectors (an
// embedding lookup): out row r (of pre * nids rows of `vecs` vectors) is x's row
// (r / nids) * ax_size + ids[r % nids], a warp per row, 16 bytes a lane. The per-element
// kernel above decomposes every index with 64-bit divisions: 45 us for a GPT's 16384 x 384
// f32 lookup on an H200, ~0.5 TB/s. (Any T: the instance name only joins its dtype's group.)
#define INDEX_SELECT_ROWS(T)                                                                   \
    extern "C" __global__ void index_select_rows_##T(const uint4* x, const i64* ids, uint4* y, \
                                                     u64 rows, u64 vecs, u64 ax_size,          \
                                                     u64 nids, u64 io, u64 is, u32* flag) {    \
        const u64 lane = threadIdx.x & 31, per_block = blockDim.x >> 5;                        \
        const u64 warps = (u64)gridDim.x * per_block;                                          \
        for (u64 r = blockIdx.x * per_block + (threadIdx.x >> 5); r < rows; r += warps) {      \
            const u64 pre = r / nids, j = r - pre * nids;                                      \
            const i64 id = ids[io + j * is];                                                   \
            uint4* dst = y + r * vecs;                                                         \
            if (id < 0 || (u64)id >= ax_size) {                                                \
                if (lane == 0) raise_error(flag, 2, id);                                       \
                for (u64 c = lane; c < vecs; c += 32) dst[c] = make_uint4(0, 0, 0, 0);         \
                continue;                                                                      \
            }                                                                                  \
            const uint4* src = x + (pre * ax_size + (u64)id) * vecs;                           \
            for (u64 c = lane; c < vecs; c += 32) dst[c] = src[c];                             \
        }                                                                                      \
    }

// out[i] = x[i with axis coordinate replaced by ids[i]]; dims `d` are the ids' (= output) dims.
#define GATHER(T)                                                                              \
    extern "C" __global__ void gather_##T(const T* x, const i64* ids, T* y, u64 n, Dims d,     \
                                          Strides sx, Strides si, u64 ax_stride, u64 ax_size,  \
                                          u32* flag) {                                         \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            u64 ox, oi;                                                                        \
            offset2<u64>(i, d, sx, si, ox, oi);                                                \
            i64 id = ids[oi];                                                                  \
            if (id < 0 || (u64)id >= ax_size) {                                                \
                raise_error(flag, 2, id);                                                          \
                y[i] = 0;                                                                      \
                continue;                                                                      \
            }                                                                                  \
            y[i] = x[ox + (u64)id * ax_stride];                                                \
        }                                                                                      \
    }

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(i64* p, i64 v) { atomicAdd((u64*)p, (u64)v); }
__device__ __forceinline__ void atomic_add(u8* p, u8 v) {
    u32* w = (u32*)((u64)p & ~(u64)3);
    u32 shift = ((u64)p & 3) * 8;
    u32 old = *w, assumed;
    do {
        assumed = old;
        u32 b = ((assumed >> shift) + v) & 0xffu;
        old = atomicCAS(w, assumed, (assumed & ~(0xffu << shift)) | (b << shift));
    } while (old != assumed);
}

// y (already a contiguous copy of base) += src at ids along the axis; `sy` are y's strides over
// the ids' dims with the axis stride set to 0.
#define SCATTER_ADD(T)                                                                         \
    extern "C" __global__ void scatter_add_##T(const i64* ids, const T* src, T* y, u64 n,      \
                                               Dims d, Strides sy, Strides si, Strides ss,     \
                                               u64 ax_stride, u64 ax_size, u32* flag) {        \
        for (u64 i = KILN_TID; i < n; i += KILN_NTHREADS) {                                    \
            u64 oy, oi, os;                                                                    \
            offset3<u64>(i, d, sy, si, ss, oy, oi, os);                                        \
            i64 id = ids[oi];                                                                  \
            if (id < 0 || (u64)id >= ax_size) {                                                \
                raise_error(flag, 2, id);                                                          \
                continue;                                                                      \
            }                                                                                  \
            atomic_add(y + oy + (u64)id * ax_stride, src[os]);                                 \
        }                                                                                      \
    }

// An embedding's backward: f32 rows of `vecs` 16-byte vectors of a contiguous `src` added into
// the rows of y (contiguous) named by ids[io + r * is], a warp per source row. One 16-byte atomic
// a lane where the GPU has them (sm_90): the per-element kernel above spent 41 us on a GPT's
// 16384 x 384 rows into a 65-row table (H200), bound by the L2's atomic rate on the few rows.
extern "C" __global__ void scatter_add_rows_float(const i64* ids, const float4* src, float4* y,
                                                  u64 rows, u64 vecs, u64 ax_size, u64 io,
                                                  u64 is, u32* flag) {
    const u64 lane = threadIdx.x & 31, per_block = blockDim.x >> 5;
    const u64 warps = (u64)gridDim.x * per_block;
    for (u64 r = blockIdx.x * per_block + (threadIdx.x >> 5); r < rows; r += warps) {
        const i64 id = ids[io + r * is];
        if (id < 0 || (u64)id >= ax_size) {
            if (lane == 0) raise_error(flag, 2, id);
            continue;
        }
        float4* dst = y + (u64)id * vecs;
        const float4* row = src + r * vecs;
        for (u64 c = lane; c < vecs; c += 32) {
            const float4 v = row[c];
#if __CUDA_ARCH__ >= 900
            atomicAdd(dst + c, v);
#else
            float* d = (float*)(dst + c);
            atomicAdd(d, v.x);
            atomicAdd(d + 1, v.y);
            atomicAdd(d + 2, v.z);
            atomicAdd(d + 3, v.w);
#endif
        }
    }
}

#define INDEXING(T) INDEX_SELECT(T) INDEX_SELECT_ROWS(T) GATHER(T) SCATTER_ADD(T)
INDEXING(float)
INDEXING(double)
INDEXING(i64)
INDEXING(u8)
// The 16-bit floats move as bits (`u16`); their scatter_add runs in f32 (lib.rs).
INDEX_SELECT(u16)
INDEX_SELECT_ROWS(u16)
GATHER(u16)

// Fused layer norm and RMS norm (`Backend::layer_norm_forward` / `layer_norm_backward`, host
// side in `src/ops/norm.rs`) over contiguous rows of `cols` elements, storage type S (f32, f16,
// bf16), statistics and arithmetic in f32.
//
// Forward (`ln_fwd_S`): one block per row (grid-stride over rows). The row is read from global
// memory once into shared memory as f32, then its statistics are computed in two passes over
// that copy (the mean, then the mean of squared deviations): exact two-pass, as the composed
// path computes them, with no Welford divisions, and the second pass costs no global traffic.
// Then y = (x - mean) * rstd * w + b is written, and mean/rstd (f32) by thread 0.
//
// Each thread touches only its own elements of the shared copy (vector `v` of N elements for
// v = threadIdx.x mod blockDim.x with `vec`, element `c` likewise without), the same ones in
// every pass and every row, so the copy needs no barrier of its own: the only ones are in the
// block reductions. The host picks `vec` once per launch (every row base aligned to 16 bytes,
// cols a multiple of N).
//
// Backward: `ln_bwd_dx_S`, one block per row: ĝ = g * w and x̂ = (x - mean) * rstd (cached as
// f32 pairs in shared memory when `cache`), the row sums Σĝ and Σĝx̂ by block reduction, then
// dx = rstd * (ĝ - Σĝ/n - x̂ Σĝx̂/n) (no Σĝ term for RMS norm), plus `acc` where given (the
// gradient already accumulated for x, added in f32 before dx's one rounding). `ln_bwd_cols_S`
// sums g x̂ and g per column over a chunk of rows (block 32 columns x 8 row lanes, a fixed
// order), writing f32 partials [chunks, cols]; `ln_bwd_cols_sum_S` adds a column's partials
// in a fixed order (32 row lanes, then their sums) and rounds once into dw/db. No atomics: the
// sums are deterministic.
//
// Short vectorized rows (at most LN_WARP_VECS * 32 vectors) take `ln_fwd_warp_S` and
// `ln_bwd_warp_S` instead (below): a warp per row, and the backward's dx and column partials in
// one pass over g and x.

// Row r's statistics and normalized output.
template <typename S>
__device__ void ln_fwd_rows(const S* __restrict__ x, const S* __restrict__ w,
                            const S* __restrict__ b, S* __restrict__ y, float* __restrict__ mean_out,
                            float* __restrict__ rstd_out, u64 rows, u64 cols, float eps,
                            int centered, int vec) {
    extern __shared__ __align__(16) unsigned char dyn[];
    __shared__ float scratch[32];
    float* row = (float*)dyn;
    const int N = 16 / sizeof(S);
    const float inv_n = 1.0f / (float)cols;
    const u64 nv = cols / N;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* p = x + r * cols;
        S* q = y + r * cols;
        float s = 0.0f;
        if (vec) {
            for (u64 v = threadIdx.x; v < nv; v += blockDim.x) {
                Vec<S, N> t = ((const Vec<S, N>*)p)[v];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float f = wide(t.v[j]);
                    row[v * N + j] = f;
                    s += f;
                }
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float f = wide(p[c]);
                row[c] = f;
                s += f;
            }
        }
        float mean = 0.0f;
        if (centered) mean = block_reduce<SumOp<float> >(s, scratch) * inv_n;
        // The second pass over the thread's own elements of the copy.
        float ss = 0.0f;
        if (vec) {
            for (u64 v = threadIdx.x; v < nv; v += blockDim.x) {
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float d = row[v * N + j] - mean;
                    ss += d * d;
                }
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float d = row[c] - mean;
                ss += d * d;
            }
        }
        const float rstd = rsqrtf(block_reduce<SumOp<float> >(ss, scratch) * inv_n + eps);
        if (threadIdx.x == 0) {
            if (centered) mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
        if (vec) {
            for (u64 v = threadIdx.x; v < nv; v += blockDim.x) {
                Vec<S, N> o, wv, bv;
                if (w) wv = ((const Vec<S, N>*)w)[v];
                if (b) bv = ((const Vec<S, N>*)b)[v];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float f = (row[v * N + j] - mean) * rstd;
                    if (w) f *= wide(wv.v[j]);
                    if (b) f += wide(bv.v[j]);
                    o.v[j] = narrow<S>(f);
                }
                ((Vec<S, N>*)q)[v] = o;
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float f = (row[c] - mean) * rstd;
                if (w) f *= wide(w[c]);
                if (b) f += wide(b[c]);
                q[c] = narrow<S>(f);
            }
        }
    }
}

// dx of row r (see the file's comment). `cache` holds (ĝ, x̂) pairs when the row fits in shared
// memory; otherwise the second pass reads g, x and w again (from L1/L2).
template <typename S>
__device__ void ln_bwd_dx_rows(const S* __restrict__ x, const float* __restrict__ mean_in,
                               const float* __restrict__ rstd_in, const S* __restrict__ w,
                               const S* __restrict__ g, const S* __restrict__ acc,
                               S* __restrict__ dx, u64 rows, u64 cols, int centered, int vec,
                               int cache) {
    extern __shared__ __align__(16) unsigned char dyn[];
    __shared__ float scratch[32];
    float2* pair = (float2*)dyn;
    const int N = 16 / sizeof(S);
    const float inv_n = 1.0f / (float)cols;
    const u64 nv = cols / N;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S* px = x + r * cols;
        const S* pg = g + r * cols;
        const S* pa = acc ? acc + r * cols : nullptr;
        S* q = dx + r * cols;
        const float mean = centered ? mean_in[r] : 0.0f;
        const float rstd = rstd_in[r];
        float sg = 0.0f, sgx = 0.0f;
        if (vec) {
            for (u64 v = threadIdx.x; v < nv; v += blockDim.x) {
                Vec<S, N> xv = ((const Vec<S, N>*)px)[v], gv = ((const Vec<S, N>*)pg)[v], wv;
                if (w) wv = ((const Vec<S, N>*)w)[v];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float gh = wide(gv.v[j]);
                    if (w) gh *= wide(wv.v[j]);
                    float xh = (wide(xv.v[j]) - mean) * rstd;
                    sg += gh;
                    sgx += gh * xh;
                    if (cache) pair[v * N + j] = make_float2(gh, xh);
                }
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float gh = wide(pg[c]);
                if (w) gh *= wide(w[c]);
                float xh = (wide(px[c]) - mean) * rstd;
                sg += gh;
                sgx += gh * xh;
                if (cache) pair[c] = make_float2(gh, xh);
            }
        }
        const float a = centered ? block_reduce<SumOp<float> >(sg, scratch) * inv_n : 0.0f;
        const float m = block_reduce<SumOp<float> >(sgx, scratch) * inv_n;
        if (vec) {
            for (u64 v = threadIdx.x; v < nv; v += blockDim.x) {
                Vec<S, N> o, xv, gv, wv, av;
                if (pa) av = ((const Vec<S, N>*)pa)[v];
                if (!cache) {
                    xv = ((const Vec<S, N>*)px)[v];
                    gv = ((const Vec<S, N>*)pg)[v];
                    if (w) wv = ((const Vec<S, N>*)w)[v];
                }
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float gh, xh;
                    if (cache) {
                        float2 t = pair[v * N + j];
                        gh = t.x;
                        xh = t.y;
                    } else {
                        gh = wide(gv.v[j]);
                        if (w) gh *= wide(wv.v[j]);
                        xh = (wide(xv.v[j]) - mean) * rstd;
                    }
                    const float d = rstd * (gh - a - xh * m);
                    o.v[j] = narrow<S>(pa ? wide(av.v[j]) + d : d);
                }
                ((Vec<S, N>*)q)[v] = o;
            }
        } else {
            for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float gh, xh;
                if (cache) {
                    float2 t = pair[c];
                    gh = t.x;
                    xh = t.y;
                } else {
                    gh = wide(pg[c]);
                    if (w) gh *= wide(w[c]);
                    xh = (wide(px[c]) - mean) * rstd;
                }
                const float d = rstd * (gh - a - xh * m);
                q[c] = narrow<S>(pa ? wide(pa[c]) + d : d);
            }
        }
    }
}

// Column partials over rows [blockIdx.y * chunk, +chunk): block (32, 8), 32 columns per block.
// part_w[blockIdx.y * cols + c] = Σ g x̂, part_b likewise Σ g (when `bias`).
template <typename S>
__device__ void ln_bwd_cols_part(const S* __restrict__ x, const float* __restrict__ mean_in,
                                 const float* __restrict__ rstd_in, const S* __restrict__ g,
                                 float* __restrict__ part_w, float* __restrict__ part_b,
                                 u64 rows, u64 cols, u64 chunk, int centered, int bias) {
    __shared__ float sw[8][33];
    __shared__ float sb[8][33];
    const u64 c = (u64)blockIdx.x * 32 + threadIdx.x;
    const u64 r0 = (u64)blockIdx.y * chunk;
    const u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
    float aw = 0.0f, ab = 0.0f;
    if (c < cols) {
        for (u64 r = r0 + threadIdx.y; r < r1; r += 8) {
            const float mean = centered ? mean_in[r] : 0.0f;
            const float gv = wide(g[r * cols + c]);
            aw += gv * ((wide(x[r * cols + c]) - mean) * rstd_in[r]);
            ab += gv;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        float tw = 0.0f, tb = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            tw += sw[k][threadIdx.x];
            tb += sb[k][threadIdx.x];
        }
        part_w[(u64)blockIdx.y * cols + c] = tw;
        if (bias) part_b[(u64)blockIdx.y * cols + c] = tb;
    }
}

// dw[c] = Σ_k part_w[k, c] (and db), rounded once to S: block (32, 32), 32 columns per block;
// row lane y adds partials k = y, y + 32, ... in order, then lane 0 adds the 32 lane sums in
// order (a fixed tree: deterministic). One thread per column adding all `chunks` partials in a
// row took 32 us at the GPT's 16384 rows (256 chunks; ncu, H200), more than the partials.
template <typename S>
__device__ void ln_bwd_cols_sum(const float* __restrict__ part_w, const float* __restrict__ part_b,
                                S* __restrict__ dw, S* __restrict__ db, u64 chunks, u64 cols) {
    __shared__ float sw[32][33];
    __shared__ float sb[32][33];
    const u64 c = (u64)blockIdx.x * 32 + threadIdx.x;
    float tw = 0.0f, tb = 0.0f;
    if (c < cols) {
        for (u64 k = threadIdx.y; k < chunks; k += 32) {
            if (dw) tw += part_w[k * cols + c];
            if (db) tb += part_b[k * cols + c];
        }
    }
    sw[threadIdx.y][threadIdx.x] = tw;
    sb[threadIdx.y][threadIdx.x] = tb;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        float w = 0.0f, b = 0.0f;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            w += sw[k][threadIdx.x];
            b += sb[k][threadIdx.x];
        }
        if (dw) dw[c] = narrow<S>(w);
        if (db) db[c] = narrow<S>(b);
    }
}

// ---- Rows of at most LN_WARP_VECS * 32 vectors: one warp per row ----------------------------
// With one block per row a short row (the GPT's 384 f32: 96 vectors) left most of a block idle
// and paid two block barriers a row: ~2.2 TB/s. Here a warp holds its row in registers (lane
// `l` vectors l, l + 32, ...), reduces by shuffles (every lane gets the same sum) and has no
// barrier; 8 warps a block. The host takes these kernels for vectorized rows that fit.
#define LN_WARP_VECS 4

template <typename S>
__device__ void ln_fwd_warp_rows(const S* __restrict__ x, const S* __restrict__ w,
                                 const S* __restrict__ b, S* __restrict__ y,
                                 float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                 u64 rows, u64 cols, float eps, int centered) {
    const int N = 16 / sizeof(S);
    const int lane = threadIdx.x & 31;
    const u64 nv = cols / N;
    const float inv_n = 1.0f / (float)cols;
    const u64 step = (u64)gridDim.x * (blockDim.x >> 5);
    // The next row's vectors are requested before this row's reductions (as in the backward
    // below), so a warp keeps loads in flight while it reduces.
    Vec<S, N> cur[LN_WARP_VECS], nxt[LN_WARP_VECS];
    u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
#pragma unroll
    for (int k = 0; k < LN_WARP_VECS; ++k) {
        const u64 v = lane + 32 * k;
        if (r < rows && v < nv) cur[k] = ((const Vec<S, N>*)(x + r * cols))[v];
    }
    for (; r < rows; r += step) {
        if (r + step < rows) {
            const Vec<S, N>* pn = (const Vec<S, N>*)(x + (r + step) * cols);
#pragma unroll
            for (int k = 0; k < LN_WARP_VECS; ++k) {
                const u64 v = lane + 32 * k;
                if (v < nv) nxt[k] = pn[v];
            }
        }
        float f[LN_WARP_VECS][N];
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < LN_WARP_VECS; ++k) {
            const u64 v = lane + 32 * k;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                f[k][j] = v < nv ? wide(cur[k].v[j]) : 0.0f;
                s += f[k][j];
            }
        }
        const float mean = centered ? warp_reduce<SumOp<float> >(s) * inv_n : 0.0f;
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < LN_WARP_VECS; ++k) {
            if (lane + 32 * k < nv) {
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float d = f[k][j] - mean;
                    ss += d * d;
                }
            }
        }
        const float rstd = rsqrtf(warp_reduce<SumOp<float> >(ss) * inv_n + eps);
        if (lane == 0) {
            if (centered) mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
        Vec<S, N>* q = (Vec<S, N>*)(y + r * cols);
#pragma unroll
        for (int k = 0; k < LN_WARP_VECS; ++k) {
            const u64 v = lane + 32 * k;
            if (v < nv) {
                Vec<S, N> o, wv, bv;
                if (w) wv = ((const Vec<S, N>*)w)[v];
                if (b) bv = ((const Vec<S, N>*)b)[v];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float t = (f[k][j] - mean) * rstd;
                    if (w) t *= wide(wv.v[j]);
                    if (b) t += wide(bv.v[j]);
                    o.v[j] = narrow<S>(t);
                }
                q[v] = o;
            }
        }
#pragma unroll
        for (int k = 0; k < LN_WARP_VECS; ++k) cur[k] = nxt[k];
    }
}

// One row's operands as a lane holds them in the warp backward: its vectors of x and g, and the
// row's statistics.
template <typename S, int V>
struct LnBwdRow {
    Vec<S, 16 / sizeof(S)> x[V], g[V];
    float mean, rstd;
};

template <typename S, int V>
__device__ __forceinline__ void ln_bwd_load(LnBwdRow<S, V>& t, const S* __restrict__ x,
                                            const S* __restrict__ g,
                                            const float* __restrict__ mean_in,
                                            const float* __restrict__ rstd_in, u64 r, u64 cols,
                                            u64 nv, int lane, int centered) {
    const int N = 16 / sizeof(S);
    const Vec<S, N>* px = (const Vec<S, N>*)(x + r * cols);
    const Vec<S, N>* pg = (const Vec<S, N>*)(g + r * cols);
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const u64 v = lane + 32 * k;
        if (v < nv) {
            t.x[k] = px[v];
            t.g[k] = pg[v];
        }
    }
    t.mean = centered ? mean_in[r] : 0.0f;
    t.rstd = rstd_in[r];
}

// The whole backward of short rows in one pass over g and x: block `b` takes rows
// [b * chunk, (b + 1) * chunk), its warp `k` rows k, k + 8, ... of them in order. A warp writes
// each row's dx (when `dx`) and adds g x̂ and g into per-lane column sums in registers; then the
// block adds its 8 warps' sums in warp order (dynamic shared memory, 8 x cols f32) into the
// chunk's partials `part_w` / `part_b` (when given), which `ln_bwd_cols_sum` folds. A fixed
// order everywhere: deterministic. Replaces `ln_bwd_dx` + `ln_bwd_cols`, which read g and x twice.
// A lane holds V vectors of a row (rows of at most 32 V vectors).
template <typename S, int V>
__device__ void ln_bwd_warp_rows(const S* __restrict__ x, const float* __restrict__ mean_in,
                                 const float* __restrict__ rstd_in, const S* __restrict__ w,
                                 const S* __restrict__ g, const S* __restrict__ acc,
                                 S* __restrict__ dx, float* __restrict__ part_w,
                                 float* __restrict__ part_b, u64 rows,
                                 u64 cols, u64 chunk, int centered) {
    extern __shared__ __align__(16) unsigned char dyn[];
    float* red = (float*)dyn;
    const int N = 16 / sizeof(S);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u64 nv = cols / N;
    const float inv_n = 1.0f / (float)cols;
    const u64 r0 = (u64)blockIdx.x * chunk;
    const u64 r1 = r0 + chunk < rows ? r0 + chunk : rows;
    float aw[V][N], ab[V][N];
#pragma unroll
    for (int k = 0; k < V; ++k)
#pragma unroll
        for (int j = 0; j < N; ++j) aw[k][j] = ab[k][j] = 0.0f;
    const Vec<S, N>* pw = (const Vec<S, N>*)w;
    // Software-pipelined: the next row's x and g are requested before this row's sums, and this
    // row's acc before its shuffles, so a warp keeps loads in flight while it reduces (one row
    // at a time left the memory idle during the reductions: ~2.7 TB/s on an H200).
    LnBwdRow<S, V> cur, nxt;
    u64 r = r0 + warp;
    if (r < r1) ln_bwd_load<S, V>(cur, x, g, mean_in, rstd_in, r, cols, nv, lane, centered);
    for (; r < r1; r += warps) {
        if (r + warps < r1)
            ln_bwd_load<S, V>(nxt, x, g, mean_in, rstd_in, r + warps, cols, nv, lane, centered);
        const float mean = cur.mean, rstd = cur.rstd;
        float sg = 0.0f, sgx = 0.0f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const bool in = lane + 32 * k < nv;
            Vec<S, N> wv;
            if (w && in) wv = pw[lane + 32 * k];
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float gr = in ? wide(cur.g[k].v[j]) : 0.0f;
                const float xh = in ? (wide(cur.x[k].v[j]) - mean) * rstd : 0.0f;
                const float gh = w && in ? gr * wide(wv.v[j]) : gr;
                aw[k][j] += gr * xh;
                ab[k][j] += gr;
                sg += gh;
                sgx += gh * xh;
            }
        }
        if (dx) {
            const Vec<S, N>* pa = acc ? (const Vec<S, N>*)(acc + r * cols) : nullptr;
            Vec<S, N> av[V];
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const u64 v = lane + 32 * k;
                if (pa && v < nv) av[k] = pa[v];
            }
            const float a = centered ? warp_reduce<SumOp<float> >(sg) * inv_n : 0.0f;
            const float m = warp_reduce<SumOp<float> >(sgx) * inv_n;
            Vec<S, N>* q = (Vec<S, N>*)(dx + r * cols);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const u64 v = lane + 32 * k;
                if (v < nv) {
                    Vec<S, N> o, wv;
                    if (w) wv = pw[v];
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        float gh = wide(cur.g[k].v[j]);
                        if (w) gh *= wide(wv.v[j]);
                        const float xh = (wide(cur.x[k].v[j]) - mean) * rstd;
                        const float d = rstd * (gh - a - xh * m);
                        o.v[j] = narrow<S>(pa ? wide(av[k].v[j]) + d : d);
                    }
                    q[v] = o;
                }
            }
        }
        cur = nxt;
    }
    // The block's column sums, warp by warp in order; g x̂ first, then g.
    for (int pass = 0; pass < 2; ++pass) {
        float* part = pass == 0 ? part_w : part_b;
        if (!part) continue;  // uniform over the block
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const u64 v = lane + 32 * k;
            if (v < nv) {
#pragma unroll
                for (int j = 0; j < N; ++j) red[warp * cols + v * N + j] = pass == 0 ? aw[k][j] : ab[k][j];
            }
        }
        __syncthreads();
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float t = 0.0f;
            for (int k = 0; k < warps; ++k) t += red[k * cols + c];
            part[(u64)blockIdx.x * cols + c] = t;
        }
        __syncthreads();
    }
}

// The warp backward for rows of at most V vectors a lane (V = 1 .. LN_WARP_VECS): a lane's
// registers hold exactly what its row needs (at the GPT's 96 vectors, 3), which leaves room for
// more warps an SM than the widest instance.
#define LN_BWD_MIN_BLOCKS(S, V) (sizeof(S) == 4 && (V) <= 3 ? 2 : 1)
#define NORM_BWD_WARP(S, V)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, LN_BWD_MIN_BLOCKS(S, V))                   \
        ln_bwd_warp##V##_##S(const S* x, const float* mean, const float* rstd, const S* w,       \
                             const S* g, const S* acc, S* dx, float* part_w, float* part_b,      \
                             u64 rows, u64 cols, u64 chunk, int centered) {                      \
        ln_bwd_warp_rows<S, V>(x, mean, rstd, w, g, acc, dx, part_w, part_b, rows, cols, chunk,  \
                               centered);                                                        \
    }

#define NORM(S)                                                                                  \
    extern "C" __global__ void ln_fwd_##S(const S* x, const S* w, const S* b, S* y, float* mean, \
                                          float* rstd, u64 rows, u64 cols, float eps,            \
                                          int centered, int vec) {                               \
        ln_fwd_rows<S>(x, w, b, y, mean, rstd, rows, cols, eps, centered, vec);                  \
    }                                                                                            \
    extern "C" __global__ void ln_bwd_dx_##S(const S* x, const float* mean, const float* rstd,   \
                                             const S* w, const S* g, const S* acc, S* dx,        \
                                             u64 rows, u64 cols, int centered, int vec,          \
                                             int cache) {                                        \
        ln_bwd_dx_rows<S>(x, mean, rstd, w, g, acc, dx, rows, cols, centered, vec, cache);       \
    }                                                                                            \
    extern "C" __global__ void ln_bwd_cols_##S(const S* x, const float* mean, const float* rstd, \
                                               const S* g, float* part_w, float* part_b,         \
                                               u64 rows, u64 cols, u64 chunk, int centered,      \
                                               int bias) {                                       \
        ln_bwd_cols_part<S>(x, mean, rstd, g, part_w, part_b, rows, cols, chunk, centered,       \
                            bias);                                                               \
    }                                                                                            \
    extern "C" __global__ void ln_bwd_cols_sum_##S(const float* part_w, const float* part_b,     \
                                                   S* dw, S* db, u64 chunks, u64 cols) {         \
        ln_bwd_cols_sum<S>(part_w, part_b, dw, db, chunks, cols);                                \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                            \
        ln_fwd_warp_##S(const S* x, const S* w, const S* b, S* y, float* mean, float* rstd,      \
                        u64 rows, u64 cols, float eps, int centered) {                           \
        ln_fwd_warp_rows<S>(x, w, b, y, mean, rstd, rows, cols, eps, centered);                  \
    }                                                                                            \
    NORM_BWD_WARP(S, 1)                                                                          \
    NORM_BWD_WARP(S, 2)                                                                          \
    NORM_BWD_WARP(S, 3)                                                                          \
    NORM_BWD_WARP(S, 4)
NORM(float)
NORM(f16)
NORM(bf16)

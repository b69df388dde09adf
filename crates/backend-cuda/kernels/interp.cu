// The interpreter of elementwise expression programs: runs a program the code generator has
// not compiled yet, so that its first run does not wait for NVRTC (src/tier.rs; the program
// compiles on a background thread meanwhile, and later runs take the compiled kernel).
//
// Values are f32 (comparison results and u8 inputs held as 0/1 or 0..255 in f32, exactly);
// every instruction calls the same `op_<name><float>` a compiled program calls (the
// `interp_*` dispatch of interp_ops.cuh), and this file and the generated elementwise
// programs both compile with `--fmad=false`, so an interpreted run and a compiled run give the
// same bits.
//
// One instruction is two words: `kind | op << 4` and its operands (`a | b << 8 | c << 16`,
// value numbers), or a constant's bits, or an input's / parameter's number.

#define INTERP_MAX_IN 12
#define INTERP_MAX_OUT 5
#define INTERP_MAX_PARAMS 64
#define INTERP_MAX_CODE 128

#define INTERP_INPUT 0
#define INTERP_PARAM 1
#define INTERP_CONST 2
#define INTERP_UNARY 3
#define INTERP_BINARY 4
#define INTERP_CMP 5
#define INTERP_WHERE 6
#define INTERP_COPY 7  // a cast to f32 of a u8 or f32 value: the value itself

// Input access (low bits) and dtype (INTERP_U8 set: u8 storage).
#define INTERP_CONTIG 0
#define INTERP_BCAST 1
#define INTERP_STRIDED 2
#define INTERP_U8 4

struct InterpArgs {
    u64 n;
    Dims d;
    u64 x[INTERP_MAX_IN];
    u64 y[INTERP_MAX_OUT];
    Strides s[INTERP_MAX_IN];
    u32 n_code;
    u32 n_out;
    u32 access[INTERP_MAX_IN];
    u32 out_val[INTERP_MAX_OUT];
    u32 out_u8;
    float params[INTERP_MAX_PARAMS];
    u32 code[2 * INTERP_MAX_CODE];
};
static_assert(sizeof(InterpArgs) == 2440, "InterpArgs must match src/tier.rs");

__device__ __forceinline__ float interp_load(const InterpArgs& a, u32 k, u64 i) {
    u32 acc = a.access[k];
    u64 off = (acc & 3) == INTERP_CONTIG ? i : (acc & 3) == INTERP_BCAST ? 0 : offset1<u64>(i, a.d, a.s[k]);
    if (acc & INTERP_U8) {
        return (float)((const u8*)a.x[k])[off];
    }
    return ((const float*)a.x[k])[off];
}

extern "C" __global__ void interp_f32(const __grid_constant__ InterpArgs a) {
    float r[INTERP_MAX_CODE];
    for (u64 i = KILN_TID; i < a.n; i += KILN_NTHREADS) {
        for (u32 j = 0; j < a.n_code; ++j) {
            const u32 w = a.code[2 * j], o = a.code[2 * j + 1];
            const u32 op = w >> 4;
            // Operands are read per kind: a constant's word is its bits, not value numbers.
#define X r[o & 255]
#define Y r[(o >> 8) & 255]
#define Z r[(o >> 16) & 255]
            float v;
            switch (w & 15) {
            case INTERP_INPUT: v = interp_load(a, o, i); break;
            case INTERP_PARAM: v = a.params[o]; break;
            case INTERP_CONST: v = __int_as_float((int)o); break;
            case INTERP_UNARY: v = interp_unary(op, X); break;
            case INTERP_BINARY: v = interp_binary(op, X, Y); break;
            case INTERP_CMP: v = interp_cmp(op, X, Y) ? 1.0f : 0.0f; break;
            case INTERP_WHERE: v = X != 0.0f ? Y : Z; break;
            default: v = X; break;  // INTERP_COPY
            }
#undef X
#undef Y
#undef Z
            r[j] = v;
        }
        for (u32 k = 0; k < a.n_out; ++k) {
            const float v = r[a.out_val[k]];
            if (a.out_u8 & (1u << k)) {
                ((u8*)a.y[k])[i] = cast_to<float, u8>(v);
            } else {
                ((float*)a.y[k])[i] = v;
            }
        }
    }
}

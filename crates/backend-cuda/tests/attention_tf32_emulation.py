"""Lane-level CPU emulation of kernels/attention_tc.cu's f32 operand format (TcTf32: the TF32
tile products tf_mm_nt and tf_mm_rn, 3xTF32 and 1xTF32).

Run: python3 crates/backend-cuda/tests/attention_tf32_emulation.py (needs numpy; ~10 s).

Why: the f32 kernels share their bodies (masking, softmax, dropout, loops) with the 16-bit ones,
which tests/attention_tc_emulation.py replays; what is theirs alone is how a lane gathers its
m16n8k8 fragments from shared memory and from the previous product's accumulator (with rn's
permuted k index), and the big/small split. This script executes that arithmetic as the kernel file
writes it, with `mma.sync.m16n8k8.tf32` emulated from the PTX ISA's fragment layouts and the
kernel's tf_round (`cvt.rna.tf32.f32`'s result, computed the same way) bit for bit (f32 values,
products summed in f64: the hardware's f32 accumulation is not modelled), and checks a forward tile
chain S = Q K^T, O = S V against f64: 3xTF32 near f32 (relative error below 1e-6), 1xTF32 within
TF32's (below 2e-3, and above 2e-5, so a split that does nothing fails the first check). It also
checks that every fragment load of both products touches 32 distinct banks at the pitch DT + 4.
Swapping a2 and a1 in either product, or dropping the small terms of SPLIT 3, makes it fail.
"""
import numpy as np

rng = np.random.default_rng(0)


def rna_tf32(x):
    """tf_round (cvt.rna.tf32.f32): an f32 to 10 explicit mantissa bits, ties away from zero."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x1000) & 0xFFFFE000  # add half an ulp of tf32 to the magnitude, truncate
    return b.astype(np.uint32).view(np.float32)


def split(x, SPLIT):
    big = rna_tf32(np.float32(x))
    small = rna_tf32(np.float32(np.float32(x) - big)) if SPLIT == 3 else np.float32(0)
    return big, small


def mma(c, A, B0, B1):
    """c[lane] (4 floats) += A B: A[lane] = 4 tf32, B0/B1[lane] = tf32 (PTX m16n8k8 .tf32)."""
    a = np.zeros((16, 8)); b = np.zeros((8, 8)); acc = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4] = A[lane]
        b[t, g], b[t + 4, g] = B0[lane], B1[lane]
        acc[g, 2 * t:2 * t + 2] = c[lane][0:2]; acc[g + 8, 2 * t:2 * t + 2] = c[lane][2:4]
    d = acc + a @ b
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane][0:2] = d[g, 2 * t:2 * t + 2]; c[lane][2:4] = d[g + 8, 2 * t:2 * t + 2]


def mma_split(c, ab, as_, bb, bs, SPLIT):
    if SPLIT == 3:
        mma(c, as_, [x[0] for x in bb], [x[1] for x in bb])
        mma(c, ab, [x[0] for x in bs], [x[1] for x in bs])
    mma(c, ab, [x[0] for x in bb], [x[1] for x in bb])


BANKS = []


def ld(smem, P, r, cidx):
    BANKS.append((r * P + cidx) % 32)
    return smem[r, cidx]


def check_banks():
    global BANKS
    for i in range(0, len(BANKS), 32):
        assert len(set(BANKS[i:i + 32])) == 32, "bank conflict"
    BANKS = []


def tf_mm_nt(acc, sA, a0, sB, K, NT, DT, SPLIT):
    """acc[lane][n] += A[16][K] B[N][K]^T, as tf_mm_nt: A rows a0.., B rows 0.."""
    P = DT + 4
    for kk in range(K // 8):
        ab, as_ = [None] * 32, [None] * 32
        loads = [(0, 0), (8, 0), (0, 4), (8, 4)]  # ap[0], ap[8P], ap[4], ap[8P + 4]
        vals = [[None] * 4 for _ in range(32)]
        for j, (dr, dc) in enumerate(loads):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                vals[lane][j] = ld(sA, P, a0 + g + dr, kk * 8 + t + dc)
            check_banks()
        for lane in range(32):
            s = [split(v, SPLIT) for v in vals[lane]]
            ab[lane] = [x[0] for x in s]; as_[lane] = [x[1] for x in s]
        for n in range(NT):
            bv = [[None] * 2 for _ in range(32)]
            for j, dc in enumerate([0, 4]):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    bv[lane][j] = ld(sB, P, n * 8 + g, kk * 8 + t + dc)
                check_banks()
            bb = [[split(v, SPLIT)[0] for v in bv[l]] for l in range(32)]
            bs = [[split(v, SPLIT)[1] for v in bv[l]] for l in range(32)]
            mma_split([acc[l][n] for l in range(32)], ab, as_, bb, bs, SPLIT)


def tf_mm_rn(acc, p, sB, K, NT, DT, SPLIT):
    """acc[lane][n] += A[16][K] B[K][N], as tf_mm_rn: A = p[lane][kk] (accumulator layout)."""
    P = DT + 4
    for kk in range(K // 8):
        ab, as_ = [None] * 32, [None] * 32
        for lane in range(32):
            s = [split(p[lane][kk][e], SPLIT) for e in (0, 2, 1, 3)]
            ab[lane] = [x[0] for x in s]; as_[lane] = [x[1] for x in s]
        for n in range(NT):
            bv = [[None] * 2 for _ in range(32)]
            for j in range(2):  # bp[0], bp[P]
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    bv[lane][j] = ld(sB, P, kk * 8 + 2 * t + j, n * 8 + g)
                check_banks()
            bb = [[split(v, SPLIT)[0] for v in bv[l]] for l in range(32)]
            bs = [[split(v, SPLIT)[1] for v in bv[l]] for l in range(32)]
            mma_split([acc[l][n] for l in range(32)], ab, as_, bb, bs, SPLIT)


def tile(x, rows, DT):
    t = np.zeros((rows, DT + 4), dtype=np.float32)
    t[:x.shape[0], :x.shape[1]] = x
    return t


def case(DT, BK, d, SPLIT):
    """One warp (rows 16..32 of a 32-row Q tile) against a BK-key tile: S = Q K^T, O = S V."""
    q = rng.standard_normal((32, d)).astype(np.float32)
    k = rng.standard_normal((BK, d)).astype(np.float32)
    v = rng.standard_normal((BK, d)).astype(np.float32)
    sQ, sK, sV = tile(q, 32, DT), tile(k, BK, DT), tile(v, BK, DT)
    s = [[np.zeros(4) for _ in range(BK // 8)] for _ in range(32)]
    tf_mm_nt(s, sQ, 16, sK, DT, BK // 8, DT, SPLIT)
    S = np.zeros((16, BK))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for n in range(BK // 8):
            S[g, n * 8 + 2 * t:n * 8 + 2 * t + 2] = s[lane][n][0:2]
            S[g + 8, n * 8 + 2 * t:n * 8 + 2 * t + 2] = s[lane][n][2:4]
            s[lane][n] = np.float32(s[lane][n] * 0.125)  # the weights, f32
    want_s = q[16:].astype(np.float64) @ k.astype(np.float64).T
    o = [[np.zeros(4) for _ in range(DT // 8)] for _ in range(32)]
    tf_mm_rn(o, s, sV, BK, DT // 8, DT, SPLIT)
    O = np.zeros((16, DT))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for n in range(DT // 8):
            O[g, n * 8 + 2 * t:n * 8 + 2 * t + 2] = o[lane][n][0:2]
            O[g + 8, n * 8 + 2 * t:n * 8 + 2 * t + 2] = o[lane][n][2:4]
    sw = np.array([[np.float32(x * 0.125) for x in r] for r in S]).astype(np.float64)
    want_o = sw @ v.astype(np.float64)
    es = np.abs(S - want_s).max() / np.abs(want_s).max()
    eo = np.abs(O[:, :d] - want_o).max() / np.abs(want_o).max()
    assert np.all(O[:, d:] == 0), "padding columns"
    return es, eo


def main():
    for DT, BK, d in [(64, 32, 64), (64, 32, 48), (128, 32, 128), (128, 32, 80)]:
        for SPLIT in (3, 1):
            es, eo = case(DT, BK, d, SPLIT)
            print(f"DT {DT} BK {BK} d {d} {SPLIT}xTF32: rel err S {es:.2e}, O {eo:.2e}")
            if SPLIT == 3:
                assert es < 1e-6 and eo < 1e-6, "3xTF32 not near f32"
            else:
                assert 2e-5 < es < 2e-3 and 2e-5 < eo < 2e-3, "1xTF32 outside TF32's error"
    print("ok")


if __name__ == "__main__":
    main()

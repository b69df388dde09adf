"""Lane-level CPU emulation of kernels/attention_tc.cu (the tensor-core attention kernels).

Run: python3 crates/backend-cuda/tests/attention_tc_emulation.py (needs numpy; ~30 s).

Why: the kernels' correctness rests on index arithmetic no CPU test of kiln exercises (which
lane's ldmatrix address is which row, which accumulator element is which query and key, the
accumulator-to-A-fragment reuse, the tile loops and causal bounds). This script executes that
arithmetic as the kernel file writes it, with `ldmatrix` (plain and .trans) and
`mma.sync.m16n8k16` emulated from the PTX ISA's fragment layouts, in f64 (no 16-bit rounding:
it checks indexing, not precision), and compares forward, dQ, dK and dV with a dense reference,
for shapes off the tiles, Tq != Tk, head sizes 48/64/128, causal and dropout (a stand-in mask:
the Philox mask itself is shared verbatim with attention.cu). Keep it in step with the kernel
file. Swapping two registers of `frag` makes every case fail by O(1). Not replayed: the
double buffering (which buffer a tile lands in, cp.async groups and barriers) and the 16-bit
rounding; the GPU tests (crates/autograd/tests/cuda_attention.rs) cover those.
"""
import sys
import numpy as np
rng = np.random.default_rng(0)

def ldsm(smem, addrs, trans=False):
    # addrs[lane] = (row, col) element index into smem 2-D array; returns regs[lane][4] as pairs
    out = [[None]*4 for _ in range(32)]
    for m in range(4):
        M = np.array([smem[addrs[m*8+r][0], addrs[m*8+r][1]:addrs[m*8+r][1]+8] for r in range(8)])
        if trans: M = M.T
        for lane in range(32):
            g, t = lane // 4, lane % 4
            out[lane][m] = (M[g, 2*t], M[g, 2*t+1])
    return out

def mma(C, A, B0, B1):
    # C[lane] = 4 floats; A[lane] = 4 pairs; B0/B1[lane] = pair
    a = np.zeros((16, 16)); b = np.zeros((16, 8)); c = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        r = A[lane]
        a[g, 2*t:2*t+2] = r[0]; a[g+8, 2*t:2*t+2] = r[1]
        a[g, 2*t+8:2*t+10] = r[2]; a[g+8, 2*t+8:2*t+10] = r[3]
        b[2*t:2*t+2, g] = B0[lane]; b[2*t+8:2*t+10, g] = B1[lane]
        c[g, 2*t:2*t+2] = C[lane][0:2]; c[g+8, 2*t:2*t+2] = C[lane][2:4]
    d = c + a @ b
    for lane in range(32):
        g, t = lane // 4, lane % 4
        C[lane][0:2] = d[g, 2*t:2*t+2]; C[lane][2:4] = d[g+8, 2*t:2*t+2]

def mm_nt(acc, sA, a_row0, sB, b_row0, K, NT):
    for kk in range(K // 16):
        a = ldsm(sA, [(a_row0 + (l & 15), kk*16 + (l >> 4)*8) for l in range(32)])
        for n in range(NT // 2):
            b = ldsm(sB, [(b_row0 + n*16 + (l & 7) + (l >> 4)*8, kk*16 + ((l >> 3) & 1)*8) for l in range(32)])
            mma([acc[l][2*n] for l in range(32)], [a[l] for l in range(32)], [b[l][0] for l in range(32)], [b[l][1] for l in range(32)])
            mma([acc[l][2*n+1] for l in range(32)], [a[l] for l in range(32)], [b[l][2] for l in range(32)], [b[l][3] for l in range(32)])

def mm_rn(acc, afr, sB, K, NT):
    for kk in range(K // 16):
        for n in range(NT // 2):
            b = ldsm(sB, [(kk*16 + (l & 7) + ((l >> 3) & 1)*8, n*16 + (l >> 4)*8) for l in range(32)], trans=True)
            A = [afr[l][kk] for l in range(32)]
            mma([acc[l][2*n] for l in range(32)], A, [b[l][0] for l in range(32)], [b[l][1] for l in range(32)])
            mma([acc[l][2*n+1] for l in range(32)], A, [b[l][2] for l in range(32)], [b[l][3] for l in range(32)])

def frag(c, NC):  # c[NC][4] of one lane -> [NC/2][4] pairs
    return [[(c[2*kk][0], c[2*kk][1]), (c[2*kk][2], c[2*kk][3]), (c[2*kk+1][0], c[2*kk+1][1]), (c[2*kk+1][2], c[2*kk+1][3])] for kk in range(NC // 2)]

def row(lane, e): return lane // 4 + (e >> 1) * 8
def col(lane, n, e): return n*8 + (lane & 3)*2 + (e & 1)

def load(src, r0, rows, DT):
    t = np.zeros((rows, DT + 8))
    nr, nc = src.shape
    for r in range(rows):
        if r0 + r < nr: t[r, :nc] = src[r0 + r]
    return t

class A_: pass
def keep(a, qi, kj): return qi < a.tq and kj < a.tk and (not a.causal or kj <= qi)
def full(a, q0, nq, k0, nk): return q0 + nq <= a.tq and k0 + nk <= a.tk and (not a.causal or k0 + nk <= q0 + 1)
def drop(a, i, j): return 0.0 if ((i * 7 + j * 13) % 5 == 0) else 1.25

def fwd(a, q, k, v, DT):
    BK = 64 if DT == 64 else 32
    O = np.zeros((a.tq, a.dv)); L = np.zeros(a.tq)
    for by in range((a.tq + 63) // 64):
        q0 = by * 64
        sQ = load(q, q0, 64, DT)
        kend = a.tk
        if a.causal and q0 + 64 < kend: kend = q0 + 64
        for warp in range(4):
            w0 = q0 + warp*16
            m = [[-np.inf]*2 for _ in range(32)]; l = [[0.0]*2 for _ in range(32)]
            acc = [[[0.0]*4 for _ in range(DT//8)] for _ in range(32)]
            for k0 in range(0, kend, BK):
                sK = load(k, k0, BK, DT); sV = load(v, k0, BK, DT)
                s = [[[0.0]*4 for _ in range(BK//8)] for _ in range(32)]
                mm_nt(s, sQ, warp*16, sK, 0, DT, BK//8)
                fl = full(a, w0, 16, k0, BK)
                mx = [[-np.inf]*2 for _ in range(32)]
                for ln in range(32):
                    for n in range(BK//8):
                        for e in range(4):
                            ok = fl or keep(a, w0 + row(ln, e), k0 + col(ln, n, e))
                            s[ln][n][e] = s[ln][n][e]*a.scale2 if ok else -np.inf
                            mx[ln][e>>1] = max(mx[ln][e>>1], s[ln][n][e])
                base = [[0, 0] for _ in range(32)]
                for ln in range(32):
                    for h in range(2):
                        qm = max(mx[(ln & ~3) + i][h] for i in range(4))
                        mnew = max(m[ln][h], qm)
                        base[ln][h] = 0.0 if mnew == -np.inf else mnew
                        alpha = 2.0 ** (m[ln][h] - base[ln][h])
                        m[ln][h] = mnew; l[ln][h] *= alpha
                        for n in range(DT//8):
                            acc[ln][n][2*h] *= alpha; acc[ln][n][2*h+1] *= alpha
                for ln in range(32):
                    for n in range(BK//8):
                        for e in range(4):
                            p = 2.0 ** (s[ln][n][e] - base[ln][e>>1])
                            l[ln][e>>1] += p
                            s[ln][n][e] = p * drop(a, w0 + row(ln, e), k0 + col(ln, n, e)) if a.dropout and p > 0 else p
                pf = [frag(s[ln], BK//8) for ln in range(32)]
                mm_rn(acc, pf, sV, BK, DT//8)
            for ln in range(32):
                for h in range(2):
                    tot = sum(l[(ln & ~3) + i][h] for i in range(4))
                    inv = 1/tot if tot > 0 else 0
                    for n in range(DT//8):
                        for e in (2*h, 2*h+1):
                            r, c = w0 + row(ln, e), col(ln, n, e)
                            if r < a.tq and c < a.dv: O[r, c] = acc[ln][n][e]*inv
                    r = w0 + row(ln, 2*h)
                    if (ln & 3) == 0 and r < a.tq:
                        L[r] = (m[ln][h] + np.log2(tot))*np.log(2) if tot > 0 else np.inf
    return O, L

def dkdv(a, q, k, v, g, lse, dr, DT):
    BQ = 64 if DT == 64 else 32
    dK = np.zeros((a.tk, a.d)); dV = np.zeros((a.tk, a.dv))
    for by in range((a.tk + 63)//64):
        k0 = by*64
        sK = load(k, k0, 64, DT); sV = load(v, k0, 64, DT)
        for warp in range(4):
            w0 = k0 + warp*16
            adk = [[[0.0]*4 for _ in range(DT//8)] for _ in range(32)]
            adv = [[[0.0]*4 for _ in range(DT//8)] for _ in range(32)]
            for q0 in range(k0 if a.causal else 0, a.tq, BQ):
                sQ = load(q, q0, BQ, DT); sG = load(g, q0, BQ, DT)
                sL = [lse[q0+i]*np.log2(np.e) if q0+i < a.tq else np.inf for i in range(BQ)]
                sD = [dr[q0+i] if q0+i < a.tq else 0 for i in range(BQ)]
                st = [[[0.0]*4 for _ in range(BQ//8)] for _ in range(32)]
                dpt = [[[0.0]*4 for _ in range(BQ//8)] for _ in range(32)]
                mm_nt(st, sK, warp*16, sQ, 0, DT, BQ//8)
                mm_nt(dpt, sV, warp*16, sG, 0, DT, BQ//8)
                fl = full(a, q0, BQ, w0, 16)
                for ln in range(32):
                    for n in range(BQ//8):
                        for e in range(4):
                            c = col(ln, n, e); kj = w0 + row(ln, e); qi = q0 + c
                            ok = fl or keep(a, qi, kj)
                            p = 2.0 ** (st[ln][n][e]*a.scale2 - sL[c]) if ok else 0
                            z = drop(a, qi, kj) if a.dropout and ok else 1
                            st[ln][n][e] = p*z
                            dpt[ln][n][e] = p*(dpt[ln][n][e]*z - sD[c])
                mm_rn(adv, [frag(st[ln], BQ//8) for ln in range(32)], sG, BQ, DT//8)
                mm_rn(adk, [frag(dpt[ln], BQ//8) for ln in range(32)], sQ, BQ, DT//8)
            for ln in range(32):
                for n in range(DT//8):
                    for e in range(4):
                        r, c = w0 + row(ln, e), col(ln, n, e)
                        if r < a.tk and c < a.d: dK[r, c] = adk[ln][n][e]*a.scale
                        if r < a.tk and c < a.dv: dV[r, c] = adv[ln][n][e]
    return dK, dV

def dq(a, q, k, v, g, lse, dr, DT):
    BK = 64 if DT == 64 else 32
    dQ = np.zeros((a.tq, a.d))
    for by in range((a.tq + 63)//64):
        q0 = by*64
        sQ = load(q, q0, 64, DT); sG = load(g, q0, 64, DT)
        kend = a.tk
        if a.causal and q0 + 64 < kend: kend = q0 + 64
        for warp in range(4):
            w0 = q0 + warp*16
            l2 = [[(lse[w0+row(ln,2*h)]*np.log2(np.e) if w0+row(ln,2*h) < a.tq else np.inf) for h in range(2)] for ln in range(32)]
            dri = [[(dr[w0+row(ln,2*h)] if w0+row(ln,2*h) < a.tq else 0) for h in range(2)] for ln in range(32)]
            adq = [[[0.0]*4 for _ in range(DT//8)] for _ in range(32)]
            for k0 in range(0, kend, BK):
                sK = load(k, k0, BK, DT); sV = load(v, k0, BK, DT)
                s = [[[0.0]*4 for _ in range(BK//8)] for _ in range(32)]
                dp = [[[0.0]*4 for _ in range(BK//8)] for _ in range(32)]
                mm_nt(s, sQ, warp*16, sK, 0, DT, BK//8)
                mm_nt(dp, sG, warp*16, sV, 0, DT, BK//8)
                fl = full(a, w0, 16, k0, BK)
                for ln in range(32):
                    for n in range(BK//8):
                        for e in range(4):
                            qi, kj = w0 + row(ln, e), k0 + col(ln, n, e)
                            ok = fl or keep(a, qi, kj)
                            p = 2.0 ** (s[ln][n][e]*a.scale2 - l2[ln][e>>1]) if ok else 0
                            z = drop(a, qi, kj) if a.dropout and ok else 1
                            dp[ln][n][e] = p*(dp[ln][n][e]*z - dri[ln][e>>1])
                mm_rn(adq, [frag(dp[ln], BK//8) for ln in range(32)], sK, BK, DT//8)
            for ln in range(32):
                for n in range(DT//8):
                    for e in range(4):
                        r, c = w0 + row(ln, e), col(ln, n, e)
                        if r < a.tq and c < a.d: dQ[r, c] = adq[ln][n][e]*a.scale
    return dQ

def reference(a, q, k, v, g):
    S = q @ k.T * a.scale
    M = np.array([[keep(a, i, j) for j in range(a.tk)] for i in range(a.tq)])
    S = np.where(M, S, -np.inf)
    mx = S.max(1, keepdims=True); mx = np.where(np.isfinite(mx), mx, 0)
    E = np.exp(S - mx); l = E.sum(1, keepdims=True)
    P = np.where(l > 0, E / np.where(l > 0, l, 1), 0)
    Z = np.array([[drop(a, i, j) if a.dropout else 1 for j in range(a.tk)] for i in range(a.tq)])
    O = (P*Z) @ v
    dPz = (g @ v.T)*Z
    D = (g*O).sum(1, keepdims=True)
    dS = P*(dPz - D)
    return O, dS @ k * a.scale, dS.T @ q * a.scale, (P*Z).T @ g, D[:, 0]

failed = False
for (tq, tk, d, dv, causal, dropout) in [(37, 37, 64, 64, True, False), (70, 45, 48, 48, False, True), (45, 70, 128, 128, True, True), (1, 5, 64, 64, False, False), (100, 37, 48, 64, True, False)]:
    a = A_(); a.tq, a.tk, a.d, a.dv, a.causal, a.dropout = tq, tk, d, dv, causal, dropout
    a.scale = 1/np.sqrt(d); a.scale2 = a.scale*np.log2(np.e)
    DT = 64 if max(d, dv) <= 64 else 128
    q, k, v, g = rng.standard_normal((tq, d)), rng.standard_normal((tk, d)), rng.standard_normal((tk, dv)), rng.standard_normal((tq, dv))
    O, L = fwd(a, q, k, v, DT)
    rO, rdq, rdk, rdv, D = reference(a, q, k, v, g)
    dr = (g*O).sum(1)
    dK, dV = dkdv(a, q, k, v, g, L, dr, DT)
    dQ = dq(a, q, k, v, g, L, dr, DT)
    errs = [np.abs(x - y).max() for x, y in [(O, rO), (dQ, rdq), (dK, rdk), (dV, rdv)]]
    print((tq, tk, d, dv, causal, dropout), ["%.1e" % e for e in errs])
    failed = failed or max(errs) > 1e-10
sys.exit(1 if failed else 0)

#!/usr/bin/env python3
"""Writes torch_f64.txt: every op of kiln's op tables evaluated by PyTorch in float64, with its
derivatives from torch.autograd, on a fixed set of points (unary and composite ops on a grid;
binary ops on pairs of a small set of values, ties and zeros included, between two tensors
and between a tensor and a constant; the layers' ops, layer_norm, rms_norm, embedding,
batch_norm (training, with the running statistics after two steps, and evaluation),
group_norm, avg_pool2d, adaptive_avg_pool2d and grouped conv2d, on fixed inputs that the file
holds too). The conv2d cases are compared by kiln-nn's `tests/torch_conv_layers.rs`, which
also checks BatchNorm2d's running statistics against the batch_norm_train cases. `tests/torch_f64.rs` compares kiln's
ops with it (forward and gradient, on the reference and CPU backends) and fails for an op of the
table that this file lacks (a layer case it lacks is skipped with a message).

Run it (where PyTorch is installed) after adding an op to the table: one line in OPS below.

    python3 crates/autograd/tests/torch_golden.py > crates/autograd/tests/data/torch_f64.txt
"""
import math

import torch
import torch.nn.functional as F

# name -> (torch function of (x, param), param values, (lo, hi))
OPS = {
    "neg": (lambda x, p: -x, [None], (-6, 6)),
    "abs": (lambda x, p: x.abs(), [None], (-6, 6)),
    "exp": (lambda x, p: x.exp(), [None], (-20, 20)),
    "log": (lambda x, p: x.log(), [None], (0.001, 50)),
    "sqrt": (lambda x, p: x.sqrt(), [None], (0.001, 50)),
    "square": (lambda x, p: x * x, [None], (-6, 6)),
    "recip": (lambda x, p: x.reciprocal(), [None], (0.05, 8)),
    "sin": (lambda x, p: x.sin(), [None], (-6, 6)),
    "cos": (lambda x, p: x.cos(), [None], (-6, 6)),
    "tanh": (lambda x, p: x.tanh(), [None], (-10, 10)),
    "sigmoid": (lambda x, p: x.sigmoid(), [None], (-10, 10)),
    "relu": (lambda x, p: x.relu(), [None], (-6, 6)),
    "gelu": (lambda x, p: F.gelu(x), [None], (-10, 10)),
    "sign": (lambda x, p: x.sign(), [None], (-6, 6)),
    "floor": (lambda x, p: x.floor(), [None], (-6, 6)),
    "ceil": (lambda x, p: x.ceil(), [None], (-6, 6)),
    "log1p": (lambda x, p: x.log1p(), [None], (-0.9, 10)),
    "expm1": (lambda x, p: x.expm1(), [None], (-10, 10)),
    "erf": (lambda x, p: x.erf(), [None], (-4, 4)),
    "rsqrt": (lambda x, p: x.rsqrt(), [None], (0.01, 50)),
    "softplus": (lambda x, p: F.softplus(x), [None], (-15, 15)),
    "silu": (lambda x, p: F.silu(x), [None], (-10, 10)),
    "mish": (lambda x, p: F.mish(x), [None], (-10, 10)),
    "hardswish": (lambda x, p: F.hardswish(x), [None], (-6, 6)),
    # F.hardsigmoid's float64 backward multiplies by 1/6 rounded to float32
    # (0.1666666716337204); the same function written out differentiates exactly.
    "hardsigmoid": (lambda x, p: (x + 3).clamp(0, 6) / 6, [None], (-6, 6)),
    "gelu_tanh": (lambda x, p: F.gelu(x, approximate="tanh"), [None], (-10, 10)),
    "leaky_relu": (lambda x, p: F.leaky_relu(x, p), [0.01, 0.2], (-6, 6)),
    "elu": (lambda x, p: F.elu(x, p), [1.0, 0.5], (-6, 6)),
}

N = 41

# Binary ops between two tensors: name -> torch function.
BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a.pow(b),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}
# The same against a constant `c`: name -> (x op c, c op x). Against a constant, maximum and
# minimum are torch.clamp (the gradient passes at ties).
SCALAR = {
    "add": (lambda x, c: x + c, lambda x, c: c + x),
    "sub": (lambda x, c: x - c, lambda x, c: c - x),
    "mul": (lambda x, c: x * c, lambda x, c: c * x),
    "div": (lambda x, c: x / c, lambda x, c: c / x),
    "pow": (lambda x, c: x ** c, lambda x, c: c ** x),
    "maximum": (lambda x, c: x.clamp(min=c), lambda x, c: x.clamp(min=c)),
    "minimum": (lambda x, c: x.clamp(max=c), lambda x, c: x.clamp(max=c)),
}
VALUES = [-2.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.25]

# The layers' ops: name -> (op, input dims, normalized shape, weight?, bias?, eps). Each case
# prints `layer <name> <field> <values...>` lines: `spec` (op, dims, normalized shape, weight,
# bias, eps), the inputs x, w, b and the cotangent g, then y = op(x) and the gradients of
# sum(y * g): dx, dw, db.
NORMS = {
    "layer_norm_wb": ("layer_norm", [3, 5], [5], True, True, 1e-5),
    "layer_norm_w": ("layer_norm", [3, 5], [5], True, False, 1e-5),
    "layer_norm_b": ("layer_norm", [3, 5], [5], False, True, 1e-5),
    "layer_norm_2d": ("layer_norm", [2, 3, 4], [3, 4], True, True, 1e-5),
    "layer_norm_plain": ("layer_norm", [2, 3, 4], [3, 4], False, False, 1e-5),
    "rms_norm_w": ("rms_norm", [3, 5], [5], True, False, 1e-6),
    "rms_norm_plain": ("rms_norm", [2, 3, 4], [4], False, False, 1e-6),
}
# name -> (num_embeddings, dim, ids, ids dims, padding_idx): `spec` (op, table dims, ids dims,
# padding_idx or -1), `ids`, the table w, the cotangent g, y and dw.
EMBEDDINGS = {
    "embedding": (6, 3, [2, 0, 5, 2, 1, 2, 3, 0], [2, 4], None),
    "embedding_padding": (6, 3, [2, 0, 5, 2, 1, 2, 3, 0], [2, 4], 2),
}

# name -> (op, input dims, weight?, bias?, eps, groups). Each case prints `spec` (op, dims,
# weight, bias, eps, groups or -1), the inputs x, w, b, g, y and the gradients dx, dw, db as
# above. batch_norm_train also prints a second batch `x2` and the running statistics
# `running_mean`, `running_var` after F.batch_norm(training=True, momentum=0.1) on x then x2
# from zeros and ones; batch_norm_eval prints the running statistics `rm`, `rv` it uses.
CHANNEL_NORMS = {
    "batch_norm_train_4d": ("batch_norm_train", [2, 3, 2, 2], True, True, 1e-5, None),
    "batch_norm_train_2d": ("batch_norm_train", [4, 3], True, False, 1e-5, None),
    "batch_norm_train_3d_plain": ("batch_norm_train", [2, 3, 4], False, False, 1e-5, None),
    "batch_norm_eval": ("batch_norm_eval", [2, 3, 2, 2], True, True, 1e-5, None),
    "group_norm_2": ("group_norm", [2, 4, 3], True, True, 1e-5, 2),
    "group_norm_1_plain": ("group_norm", [2, 4, 2, 2], False, False, 1e-5, 1),
    "group_norm_depth": ("group_norm", [3, 6, 2, 3], True, True, 1e-5, 6),
}
# name -> (op, input dims, args): avg_pool2d (kernel, stride, padding, count_include_pad),
# adaptive_avg_pool2d (output size). `spec` (op, dims, args as h,w pairs / 0 or 1), x, g, y, dx.
POOLS = {
    "avg_pool2d_k3s2p1": ("avg_pool2d", [2, 2, 7, 6], ([3, 2], [2, 1], [1, 1], True)),
    "avg_pool2d_exclude_pad": ("avg_pool2d", [2, 2, 7, 6], ([3, 2], [2, 1], [1, 1], False)),
    "avg_pool2d_k2": ("avg_pool2d", [2, 2, 7, 6], ([2, 2], [2, 2], [0, 0], True)),
    "adaptive_avg_pool2d_3x4": ("adaptive_avg_pool2d", [2, 2, 7, 6], ([3, 4],)),
    "adaptive_avg_pool2d_1x1": ("adaptive_avg_pool2d", [2, 2, 7, 6], ([1, 1],)),
    "adaptive_avg_pool2d_5x5": ("adaptive_avg_pool2d", [2, 2, 7, 6], ([5, 5],)),
}
# name -> (input dims, weight dims, bias?, stride, padding, dilation, groups): `spec` (conv2d,
# dims, weight dims, bias, stride, padding, dilation, groups), x, w, b, g, y, dx, dw, db.
CONVS = {
    "conv2d_groups2": ([2, 4, 5, 5], [6, 2, 3, 3], True, 1, 1, 1, 2),
    "conv2d_depthwise": ([2, 3, 6, 6], [6, 1, 3, 3], False, 2, 1, 1, 3),
    "conv2d_depthwise_dilated": ([1, 4, 7, 7], [4, 1, 3, 3], True, 1, 2, 2, 4),
}


def points(lo, hi):
    # A grid that misses the kinks at integers and 0 (offset by an irrational fraction).
    step = (hi - lo) / N
    return [lo + (i + 0.5 + 0.1 * math.sqrt(2)) * step for i in range(N) if lo + (i + 0.5 + 0.1 * math.sqrt(2)) * step < hi]


def main():
    print("# op param x y dy/dx  (PyTorch %s, float64)" % torch.__version__)
    for name, (f, params, (lo, hi)) in OPS.items():
        for p in params:
            x = torch.tensor(points(lo, hi), dtype=torch.float64, requires_grad=True)
            y = f(x, p)
            (g,) = torch.autograd.grad(y.sum(), x)
            for xi, yi, gi in zip(x.tolist(), y.tolist(), g.tolist()):
                print(f"{name} {'-' if p is None else repr(p)} {xi!r} {yi!r} {gi!r}")
    for name, f in BINARY.items():
        pairs = [(a, b) for a in VALUES for b in VALUES]
        a = torch.tensor([p[0] for p in pairs], dtype=torch.float64, requires_grad=True)
        b = torch.tensor([p[1] for p in pairs], dtype=torch.float64, requires_grad=True)
        y = f(a, b)
        da, db = torch.autograd.grad(y.sum(), (a, b))
        for row in zip(a.tolist(), b.tolist(), y.tolist(), da.tolist(), db.tolist()):
            print("binary " + name + " " + " ".join(repr(v) for v in row))
    for name, (rhs, lhs) in SCALAR.items():
        for side, f in (("a", rhs), ("b", lhs)):
            for c in VALUES:
                x = torch.tensor(VALUES, dtype=torch.float64, requires_grad=True)
                y = f(x, c)
                (dx,) = torch.autograd.grad(y.sum(), x)
                for row in zip(x.tolist(), y.tolist(), dx.tolist()):
                    print(f"scalar {name} {side} {c!r} " + " ".join(repr(v) for v in row))
    layers()


def seq(n, phase, f=math.sin):
    """n fixed values in about [-1.4, 2]: the layers' inputs (printed, so nothing depends on
    reproducing them)."""
    return [1.7 * f(0.9 * i + phase) + 0.3 for i in range(n)]


def numbers(t):
    return " ".join(repr(float(v)) for v in t.detach().reshape(-1).tolist())


def commas(dims):
    return ",".join(str(d) for d in dims) or "-"


def layers():
    for name, (op, dims, nshape, has_w, has_b, eps) in NORMS.items():
        def tensor(shape, phase, f=math.sin):
            n = math.prod(shape)
            return torch.tensor(seq(n, phase, f), dtype=torch.float64).reshape(shape)

        x = tensor(dims, 0.1).requires_grad_()
        w = tensor(nshape, 1.3).requires_grad_() if has_w else None
        b = tensor(nshape, 2.1).requires_grad_() if has_b else None
        g = tensor(dims, 3.7, math.cos)
        if op == "layer_norm":
            y = F.layer_norm(x, nshape, w, b, eps)
        else:
            y = F.rms_norm(x, nshape, w, eps)
        given = [(f, t) for f, t in (("x", x), ("w", w), ("b", b)) if t is not None]
        grads = torch.autograd.grad(y, [t for _, t in given], g)
        print(f"layer {name} spec {op} {commas(dims)} {commas(nshape)} {int(has_w)} {int(has_b)} {eps!r}")
        for field, t in (("x", x), ("w", w), ("b", b), ("g", g), ("y", y)):
            if t is not None:
                print(f"layer {name} {field} {numbers(t)}")
        for (field, _), t in zip(given, grads):
            print(f"layer {name} d{field} {numbers(t)}")
    for name, (num, dim, ids, id_dims, padding) in EMBEDDINGS.items():
        w = torch.tensor(seq(num * dim, 0.5), dtype=torch.float64).reshape(num, dim).requires_grad_()
        idx = torch.tensor(ids, dtype=torch.int64).reshape(id_dims)
        y = F.embedding(idx, w, padding_idx=padding)
        g = torch.tensor(seq(y.numel(), 1.9, math.cos), dtype=torch.float64).reshape(y.shape)
        (dw,) = torch.autograd.grad(y, [w], g)
        pad = -1 if padding is None else padding
        print(f"layer {name} spec embedding {num},{dim} {commas(id_dims)} {pad}")
        print(f"layer {name} ids " + " ".join(str(i) for i in ids))
        for field, t in (("w", w), ("g", g), ("y", y), ("dw", dw)):
            print(f"layer {name} {field} {numbers(t)}")
    conv_layers()


def tensor(shape, phase, f=math.sin):
    n = math.prod(shape)
    return torch.tensor(seq(n, phase, f), dtype=torch.float64).reshape(shape)


def emit(name, named, grads):
    """Prints the given tensors and then the gradients `d<name>` of the inputs."""
    for field, t in named:
        if t is not None:
            print(f"layer {name} {field} {numbers(t)}")
    for field, t in grads:
        print(f"layer {name} d{field} {numbers(t)}")


def conv_layers():
    for name, (op, dims, has_w, has_b, eps, groups) in CHANNEL_NORMS.items():
        c = dims[1]
        x = tensor(dims, 0.1).requires_grad_()
        w = tensor([c], 1.3).requires_grad_() if has_w else None
        b = tensor([c], 2.1).requires_grad_() if has_b else None
        g = tensor(dims, 3.7, math.cos)
        extra = []
        if op == "batch_norm_train":
            y = F.batch_norm(x, None, None, w, b, training=True, eps=eps)
            x2 = tensor(dims, 4.3, math.cos) * 1.5 + 0.25
            rm = torch.zeros(c, dtype=torch.float64)
            rv = torch.ones(c, dtype=torch.float64)
            with torch.no_grad():
                F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=eps)
                F.batch_norm(x2, rm, rv, w, b, training=True, momentum=0.1, eps=eps)
            extra = [("x2", x2), ("running_mean", rm), ("running_var", rv)]
        elif op == "batch_norm_eval":
            rm = tensor([c], 0.7) * 0.5
            rv = tensor([c], 1.9).abs() + 0.5
            y = F.batch_norm(x, rm, rv, w, b, training=False, eps=eps)
            extra = [("rm", rm), ("rv", rv)]
        else:
            y = F.group_norm(x, groups, w, b, eps)
        given = [(f, t) for f, t in (("x", x), ("w", w), ("b", b)) if t is not None]
        grads = torch.autograd.grad(y, [t for _, t in given], g)
        gr = -1 if groups is None else groups
        print(f"layer {name} spec {op} {commas(dims)} {int(has_w)} {int(has_b)} {eps!r} {gr}")
        emit(name, [("x", x), ("w", w), ("b", b), ("g", g), ("y", y)] + extra,
             [(f, t) for (f, _), t in zip(given, grads)])
    for name, (op, dims, args) in POOLS.items():
        x = tensor(dims, 0.1).requires_grad_()
        if op == "avg_pool2d":
            k, s, p, incl = args
            y = F.avg_pool2d(x, k, s, p, count_include_pad=incl)
            words = f"{commas(k)} {commas(s)} {commas(p)} {int(incl)}"
        else:
            (out,) = args
            y = F.adaptive_avg_pool2d(x, out)
            words = commas(out)
        g = tensor(list(y.shape), 3.7, math.cos)
        (dx,) = torch.autograd.grad(y, [x], g)
        print(f"layer {name} spec {op} {commas(dims)} {words}")
        emit(name, [("x", x), ("g", g), ("y", y)], [("x", dx)])
    for name, (dims, wdims, has_b, stride, pad, dil, groups) in CONVS.items():
        x = tensor(dims, 0.1).requires_grad_()
        w = (tensor(wdims, 1.3) * 0.5).requires_grad_()
        b = tensor([wdims[0]], 2.1).requires_grad_() if has_b else None
        y = F.conv2d(x, w, b, stride, pad, dil, groups)
        g = tensor(list(y.shape), 3.7, math.cos)
        given = [(f, t) for f, t in (("x", x), ("w", w), ("b", b)) if t is not None]
        grads = torch.autograd.grad(y, [t for _, t in given], g)
        print(f"layer {name} spec conv2d {commas(dims)} {commas(wdims)} {int(has_b)} "
              f"{stride} {pad} {dil} {groups}")
        emit(name, [("x", x), ("w", w), ("b", b), ("g", g), ("y", y)],
             [(f, t) for (f, _), t in zip(given, grads)])


if __name__ == "__main__":
    main()

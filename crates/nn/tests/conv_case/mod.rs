//! The convolution cases and helpers shared by `cuda_conv.rs` (cuDNN's legacy API and the
//! layouts) and `cuda_conv_graph.rs` (its graph API): a geometry, its seeded f64 operands, the
//! output and three gradients of one recorded convolution, and their comparison.

#![allow(dead_code)]

use kiln_autograd::Var;
use kiln_backend_cpu::Cpu;
use kiln_core::testing::check_close;
use kiln_core::{Backend, Conv2dSpec, DType, Generator, Tensor};
use kiln_nn::{Window, conv2d_grouped, conv2d_im2col_path};

pub fn cpu() -> <Cpu as Backend>::Device {
    Cpu::parse_device("cpu").unwrap()
}

/// One convolution geometry: input `[n, c, h, w]`, `oc` outputs, a `k` kernel, groups.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub x: [usize; 4],
    pub oc: usize,
    pub k: [usize; 2],
    pub stride: usize,
    pub pad: usize,
    pub dil: usize,
    pub groups: usize,
}

pub const fn case(
    x: [usize; 4],
    oc: usize,
    k: usize,
    s: usize,
    p: usize,
    d: usize,
    g: usize,
) -> Case {
    Case {
        x,
        oc,
        k: [k, k],
        stride: s,
        pad: p,
        dil: d,
        groups: g,
    }
}

impl Case {
    pub fn window(&self) -> Window {
        Window {
            kernel: self.k,
            stride: [self.stride; 2],
            padding: [self.pad; 2],
            dilation: [self.dil; 2],
        }
    }
    pub fn w_dims(&self) -> [usize; 4] {
        [self.oc, self.x[1] / self.groups, self.k[0], self.k[1]]
    }
    pub fn y_dims(&self) -> [usize; 4] {
        let spec = Conv2dSpec {
            stride: [self.stride; 2],
            padding: [self.pad; 2],
            dilation: [self.dil; 2],
            groups: self.groups,
        };
        spec.output_dims(self.x, self.w_dims()).unwrap()
    }
    /// Input, weight, bias and the upstream gradient, on the CPU in f64 (seeded).
    pub fn operands(&self, seed: u64) -> [Tensor<Cpu>; 4] {
        let mut g = Generator::new(seed);
        let dev = cpu();
        let mut t = |shape: Vec<usize>| {
            g.normal::<Cpu>(shape, 0.0, 1.0, &dev)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
        };
        [
            t(self.x.to_vec()),
            t(self.w_dims().to_vec()),
            t(vec![self.oc]),
            t(self.y_dims().to_vec()),
        ]
    }
}

/// Output, then the gradients of input, weight and bias of `sum(conv(x, w) + b) * r)`, in f64.
pub fn run<B: Backend>(ops: &[Tensor<B>; 4], c: &Case, im2col: bool) -> [Vec<f64>; 4] {
    let [x, w, b, r] = ops;
    let (x, w, b) = (
        Var::param(x.clone()),
        Var::param(w.clone()),
        Var::param(b.clone()),
    );
    let y = if im2col {
        conv2d_im2col_path(&x, &w, Some(&b), c.window(), c.groups)
    } else {
        conv2d_grouped(&x, &w, Some(&b), c.window(), c.groups)
    }
    .unwrap();
    y.mul(&Var::constant(r.clone()))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let host = |t: Tensor<B>| t.to_f64_vec().unwrap();
    [
        host(y.tensor()),
        host(x.grad().unwrap()),
        host(w.grad().unwrap()),
        host(b.grad().unwrap()),
    ]
}

/// `ops` in `dtype` on `dev` (rounded there: the CPU reference reads the same rounded values).
pub fn on<B: Backend>(ops: &[Tensor<Cpu>; 4], dtype: DType, dev: &B::Device) -> [Tensor<B>; 4] {
    ops.clone()
        .map(|t| t.to_dtype(dtype).unwrap().to_backend::<B>(dev).unwrap())
}

/// The rounded operands widened to `dtype` on the CPU (the reference for 16-bit runs).
pub fn widened(ops: &[Tensor<Cpu>; 4], low: DType, dtype: DType) -> [Tensor<Cpu>; 4] {
    ops.clone()
        .map(|t| t.to_dtype(low).unwrap().to_dtype(dtype).unwrap())
}

/// Compares four results with a tolerance relative to each one's largest magnitude.
pub fn compare(what: &str, got: &[Vec<f64>; 4], want: &[Vec<f64>; 4], tol: f64) {
    for (i, name) in ["y", "dx", "dw", "db"].iter().enumerate() {
        let scale = want[i].iter().fold(1.0f64, |m, v| m.max(v.abs()));
        if let Err(e) = check_close(&got[i], &want[i], tol * scale, tol) {
            panic!("{what} {name}: {e} (tolerance {tol:e}, scale {scale:.3})");
        }
    }
}

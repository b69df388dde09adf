//! Custom kernels, the seeds' way and kiln's (CuPy's `ElementwiseKernel`/`ReductionKernel`/
//! `RawKernel`, PyCUDA's `SourceModule`, Theano's custom GPU op), and one user function fused
//! on the CPU and on the GPU with its gradient.
//!
//! 1. (CPU and GPU) `swish(x) = x * sigmoid(x)` written once with `kiln_autograd::fuse`: one
//!    fused pass forward, a derived fused program backward, checked by `check_backward`.
//! 2. (GPU) PyCUDA's `multiply_them` as a [`RawKernel`] with the user's grid and block.
//! 3. (GPU) Theano's `PyCUDADoubleOp` (`x * 2`) as an [`ElementwiseKernel`].
//! 4. (GPU) CuPy's squared difference [`ElementwiseKernel`] (broadcasting) and L2-norm
//!    [`ReductionKernel`] (per row, and over everything).
//!
//! ```sh
//! cargo run --release --example custom_kernel   # without a GPU: the CPU part, then says so
//! ```

use kiln_autograd::{CheckOptions, Var, check_backward, fuse};
use kiln_backend_cpu::Cpu;
use kiln_backend_cuda::{
    Cuda, ElementwiseKernel, RawKernel, ReductionKernel, empty, try_gpu, unavailable_reason,
};
use kiln_core::{Backend, DType, Generator, Result, Tensor};

/// `swish` on `B`: values, gradient of `sum(swish(x))`, and a numerical gradient check.
fn swish_with_gradient<B: Backend>(dev: &B::Device) -> Result<(Vec<f64>, Vec<f64>)> {
    let swish = fuse(|x| &x * x.sigmoid());
    let t = Tensor::<B>::linspace(-3.0, 3.0, 7, DType::F64, dev)?;
    let y = swish.tensor(&t)?; // one fused kernel / pass
    let x = Var::param(t.clone());
    swish.var(&x)?.sum_all()?.backward()?; // backward: a fused program derived from the IR
    let g = x.grad().expect("x is a parameter");
    check_backward(|xs| swish.var(&xs[0]), &[t], &CheckOptions::default())?;
    Ok((y.to_f64_vec()?, g.to_f64_vec()?))
}

fn show(name: &str, v: &[f64]) {
    let s: Vec<String> = v.iter().map(|x| format!("{x:.4}")).collect();
    println!("  {name:<10} [{}]", s.join(", "));
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

const MULTIPLY_THEM: &str = r#"
extern "C" __global__ void multiply_them(float* dest, const float* a, const float* b) {
    const int i = threadIdx.x;
    dest[i] = a[i] * b[i];
}
"#;

fn main() -> Result<()> {
    println!("1. swish(x) = x * sigmoid(x), fused, on the CPU (gradient checked numerically)");
    let (y_cpu, g_cpu) = swish_with_gradient::<Cpu>(&Cpu::device(0))?;
    show("swish", &y_cpu);
    show("d/dx", &g_cpu);

    let Some(dev) = try_gpu(0) else {
        println!(
            "GPU part skipped: no CUDA device ({})",
            unavailable_reason().unwrap_or_default()
        );
        return Ok(());
    };
    println!("   ... and on {} ({dev})", dev.name()?);
    let (y_gpu, g_gpu) = swish_with_gradient::<Cuda>(&dev)?;
    println!(
        "  max |GPU - CPU|: values {:.1e}, gradients {:.1e}",
        max_diff(&y_gpu, &y_cpu),
        max_diff(&g_gpu, &g_cpu)
    );

    let cpu = Cpu::device(0);
    let to_cpu = |t: &Tensor<Cuda>| t.to_backend::<Cpu>(&cpu);

    println!("2. PyCUDA's multiply_them, a RawKernel: 1 block of 400 threads");
    let multiply_them = RawKernel::new(MULTIPLY_THEM, "multiply_them");
    let a = Generator::new(1).randn::<Cuda>([400], &dev)?;
    let b = Generator::new(2).randn::<Cuda>([400], &dev)?;
    let dest = empty([400], DType::F32, &dev)?;
    multiply_them.launch(1u32, 400u32, 0, &[(&dest).into(), (&a).into(), (&b).into()])?;
    let want = to_cpu(&a)?.mul(&to_cpu(&b)?)?;
    println!(
        "  max |dest - a*b| = {:.1e}",
        max_diff(&dest.to_f64_vec()?, &want.to_f64_vec()?)
    );

    println!("3. Theano's PyCUDADoubleOp (x * 2), an ElementwiseKernel");
    let double_op = ElementwiseKernel::new("T x", "T y", "y = x * 2", "double_op")?;
    let x = Generator::new(3).rand::<Cuda>([2, 3], &dev)?;
    let y = double_op.call1(&[(&x).into()])?;
    show("x", &x.to_f64_vec()?);
    show("2x", &y.to_f64_vec()?);

    println!("4. CuPy's squared_diff (broadcast) and l2norm (ReductionKernel)");
    let squared_diff = ElementwiseKernel::new(
        "float32 x, float32 y",
        "float32 z",
        "z = (x - y) * (x - y)",
        "squared_diff",
    )?;
    let x = Tensor::<Cuda>::arange(0.0, 10.0, 1.0, DType::F32, &dev)?.reshape([2, 5])?;
    let y = Tensor::<Cuda>::arange(0.0, 5.0, 1.0, DType::F32, &dev)?;
    let z = squared_diff.call1(&[(&x).into(), (&y).into()])?;
    show("(x-y)^2", &z.to_f64_vec()?);
    let l2norm =
        ReductionKernel::new("T x", "T y", "x * x", "a + b", "y = sqrt(a)", "0", "l2norm")?;
    let rows = l2norm.call(&[(&x).into()], Some(&[1]), false)?.remove(0);
    let all = l2norm.call(&[(&x).into()], None, false)?.remove(0);
    show("row norms", &rows.to_f64_vec()?);
    show("norm", &all.to_f64_vec()?);
    Ok(())
}

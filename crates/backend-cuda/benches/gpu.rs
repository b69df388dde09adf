//! GPU benchmarks, timed with CUDA events on the device's compute stream (the same way
//! `bench/gpu_torch.py` times PyTorch). Prints `BENCH kiln <name> <value> <unit>` lines that
//! `bench/compare.py` puts beside PyTorch's. Run through `cargo xtask bench-gpu`. Elementwise
//! results are realized (the backend defers elementwise work and would skip unread results).
//!
//! `KILN_BENCH_ONLY=attention` runs the attention rows alone. Without a GPU it prints
//! `skipped: no CUDA device (...)` and exits 0.

mod common;
use common::{report, time};

use std::time::Instant;

use kiln_autograd::{AttnMask, Var, composed_attention, no_grad};
use kiln_backend_cuda::{
    Cuda, CudaDevice, ReducePath, raw, set_allow_tf32, try_gpu, unavailable_reason,
};
use kiln_core::{Backend, DType, Generator, Result, Tensor};

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // `cargo test` runs benches as tests: nothing to do
    }
    let Some(dev) = try_gpu(0) else {
        println!(
            "skipped: no CUDA device ({})",
            unavailable_reason().unwrap_or_default()
        );
        return;
    };
    set_allow_tf32(false);
    println!("kiln device: {}", dev.name().unwrap());
    if std::env::var("KILN_BENCH_ONLY").is_ok_and(|v| v == "attention") {
        attention(&dev); // the attention rows alone (`KILN_BENCH_ONLY=attention`)
        return;
    }
    if std::env::var("KILN_BENCH_ONLY").is_ok_and(|v| v == "reduce") {
        reductions(&dev); // the reduction rows alone (`KILN_BENCH_ONLY=reduce`)
        return;
    }
    let f32t = |shape: &[usize], seed| {
        Generator::new(seed)
            .uniform::<Cuda>(shape, -1.0, 1.0, &dev)
            .unwrap()
    };

    // exp over 230,400 f32, 1000 launches, result kept on the GPU (Theano's loop).
    let x = f32t(&[230_400], 1);
    let ms = time(&dev, 5, 1000, || x.exp()?.realize());
    report("exp_230400_x1000", ms * 1000.0, "ms");
    let t0 = Instant::now();
    for _ in 0..1000 {
        x.exp().unwrap().realize().unwrap();
    }
    Cuda::synchronize(&dev).unwrap();
    report(
        "exp_230400_x1000_wall",
        t0.elapsed().as_secs_f64() * 1e3,
        "ms",
    );
    // The host's share of that loop: 1000 realized `exp`s enqueued, timed before the sync
    // (median of 5). Equal to the wall row when the host, not the GPU, sets the pace.
    let mut enq: Vec<f64> = (0..5)
        .map(|_| {
            Cuda::synchronize(&dev).unwrap();
            let t0 = Instant::now();
            for _ in 0..1000 {
                x.exp().unwrap().realize().unwrap();
            }
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            Cuda::synchronize(&dev).unwrap();
            ms
        })
        .collect();
    enq.sort_by(|a, b| a.partial_cmp(b).unwrap());
    report("exp_230400_x1000_enqueue", enq[2], "ms");

    // The same loop as a user writes it when only the last result matters: each result is
    // dropped unread, the last one read (realized). With deferral, 999 of them never run. Then
    // the recording alone (no read at all), and the loop with fusion off (every op eager).
    let dropped = || -> Result<f64> {
        Cuda::synchronize(&dev)?;
        let t0 = Instant::now();
        let mut last = None;
        for _ in 0..1000 {
            last = Some(x.exp()?);
        }
        last.expect("ran").realize()?;
        Cuda::synchronize(&dev)?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    let best = |f: &dyn Fn() -> Result<f64>| {
        let mut v: Vec<f64> = (0..7).map(|_| f().unwrap()).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    report("exp_230400_dropped_x1000_wall", best(&dropped), "ms");
    let record_only = || -> Result<f64> {
        Cuda::synchronize(&dev)?;
        let t0 = Instant::now();
        for _ in 0..1000 {
            drop(x.exp()?);
        }
        Cuda::synchronize(&dev)?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    report(
        "exp_230400_record_drop_x1000_wall",
        best(&record_only),
        "ms",
    );
    kiln_backend_cuda::set_fusion(false);
    report(
        "exp_230400_dropped_x1000_unfused_wall",
        best(&dropped),
        "ms",
    );
    kiln_backend_cuda::set_fusion(true);

    // add and sum over 256M f32.
    let n = 256 << 20;
    let a = f32t(&[n], 2);
    let b = f32t(&[n], 3);
    let ms = time(&dev, 5, 5, || a.add(&b)?.realize());
    report("add_256M", 3.0 * 4.0 * n as f64 / (ms * 1e-3) / 1e9, "GB/s");
    let ms = time(&dev, 5, 5, || a.sum_all().map(drop));
    report("sum_256M", 4.0 * n as f64 / (ms * 1e-3) / 1e9, "GB/s");
    drop((a, b));

    // A six-op elementwise chain over 64M f32, `((x*y + 0.5).sigmoid() * x - y)^2`: one fused
    // kernel (reads x and y, writes the result) against six kernels; effective GB/s counts
    // those 12 bytes per element. Then the same chain with fusion off.
    let n = 64 << 20;
    let (x6, y6) = (f32t(&[n], 7), f32t(&[n], 8));
    let chain = || -> Result<()> {
        let p = x6.mul(&y6)?.add_scalar(0.5)?.sigmoid()?;
        p.mul(&x6)?.sub(&y6)?.square()?.realize()
    };
    for (fuse, tag) in [(true, ""), (false, "_unfused")] {
        kiln_backend_cuda::set_fusion(fuse);
        let ms = time(&dev, 5, 5, chain);
        report(
            &format!("chain6_64M{tag}"),
            12.0 * n as f64 / (ms * 1e-3) / 1e9,
            "GB/s",
        );
    }
    kiln_backend_cuda::set_fusion(true);
    drop((x6, y6));

    // Row softmax 8192 x 8192.
    let s = f32t(&[8192, 8192], 4);
    let ms = time(&dev, 5, 10, || s.softmax(-1).map(drop));
    report(
        "softmax_8192x8192",
        2.0 * 4.0 * (8192.0 * 8192.0) / (ms * 1e-3) / 1e9,
        "GB/s",
    );
    drop(s);

    // sgemm, TF32 off.
    for m in [4096usize, 8192] {
        let p = f32t(&[m, m], 5);
        let q = f32t(&[m, m], 6);
        let ms = time(&dev, 5, if m == 4096 { 10 } else { 3 }, || {
            p.matmul(&q).map(drop)
        });
        report(
            &format!("sgemm_{m}"),
            2.0 * (m as f64).powi(3) / (ms * 1e-3) / 1e12,
            "TFLOP/s",
        );
    }

    // 16-bit GEMM 8192 (tensor cores, f32 accumulation) and a bf16 six-op chain over 64M
    // elements (6 bytes an element: two 16-bit reads, one write), issue 30's targets.
    for (dt, tag) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
        let m = 8192usize;
        let p = f32t(&[m, m], 5).to_dtype(dt).unwrap();
        let q = f32t(&[m, m], 6).to_dtype(dt).unwrap();
        let ms = time(&dev, 5, 5, || p.matmul(&q).map(drop));
        report(
            &format!("gemm_{tag}_{m}"),
            2.0 * (m as f64).powi(3) / (ms * 1e-3) / 1e12,
            "TFLOP/s",
        );
    }
    let n = 64 << 20;
    for (dt, tag) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
        let x6 = f32t(&[n], 7).to_dtype(dt).unwrap();
        let y6 = f32t(&[n], 8).to_dtype(dt).unwrap();
        // Stored in 16 bits once: a cast still pending would fuse into every chain below and
        // read the f32 sources each time (10 bytes an element instead of 6).
        x6.realize().unwrap();
        y6.realize().unwrap();
        let ms = time(&dev, 5, 5, || {
            let p = x6.mul(&y6)?.add_scalar(0.5)?.sigmoid()?;
            p.mul(&x6)?.sub(&y6)?.square()?.realize()
        });
        report(
            &format!("chain6_64M_{tag}"),
            6.0 * n as f64 / (ms * 1e-3) / 1e9,
            "GB/s",
        );
    }
    // (Copy bandwidth in 16 bits is PyTorch's `clone` row of the same run: a same-device
    // `copy_to` runs on the copy stream, outside this timer's events.)

    // Allocation churn: 1000 buffers of 230,400 f32 (host time; allocation is host work), with
    // the host-side block cache (default) and with the driver's pool alone.
    let bytes = 230_400 * 4;
    for (cache, tag) in [(true, ""), (false, "_driverpool")] {
        kiln_backend_cuda::set_block_cache(cache);
        Cuda::empty_cache(&dev).unwrap();
        for _ in 0..2 {
            drop(raw::alloc(&dev, bytes).unwrap());
        }
        Cuda::synchronize(&dev).unwrap();
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..1000 {
                drop(raw::alloc(&dev, bytes).unwrap());
            }
            Cuda::synchronize(&dev).unwrap();
            best = best.min(t0.elapsed().as_secs_f64() * 1e6);
        }
        report(&format!("alloc_free_1000x230400{tag}"), best, "us");
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t0 = Instant::now();
            let v: Vec<_> = (0..1000)
                .map(|_| raw::alloc(&dev, bytes).unwrap())
                .collect();
            drop(v);
            Cuda::synchronize(&dev).unwrap();
            best = best.min(t0.elapsed().as_secs_f64() * 1e6);
        }
        report(&format!("alloc1000_then_free1000_x230400{tag}"), best, "us");
    }
    kiln_backend_cuda::set_block_cache(true);
    // The exp loop again with the driver pool alone, for the record.
    kiln_backend_cuda::set_block_cache(false);
    let ms = time(&dev, 5, 1000, || x.exp()?.realize());
    report("exp_230400_x1000_driverpool", ms * 1000.0, "ms");
    kiln_backend_cuda::set_block_cache(true);
    drop(x);

    reductions(&dev);
    attention(&dev);
}

/// `Backend::reduce` of computed tensors by its two paths: `reduce_*` the default (each shape on
/// the path that measured faster), `reduce_*_kernels` the hand-written kernels
/// (`kernels/reduce.cu`), `reduce_*_generated` the generated one-reduction programs; GB/s of
/// the input read. Shapes: rows and columns of
/// a 4096² matrix, layer norm's rows and a bias gradient's columns at the GPT shape
/// (16384 × 384), batch norm's statistics of a ResNet activation (256, 64, 32, 32) over
/// (0, 2, 3), everything of 64M; bf16 rows.
fn reductions(dev: &CudaDevice) {
    let t = |shape: &[usize], dtype| {
        Generator::new(11)
            .uniform::<Cuda>(shape, -1.0, 1.0, dev)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.contiguous())
            .unwrap()
    };
    /// Name, shape, axes, max (else sum), dtype.
    type Row = (
        &'static str,
        &'static [usize],
        &'static [isize],
        bool,
        DType,
    );
    let rows: [Row; 8] = [
        ("sum_4096x4096_rows", &[4096, 4096], &[1], false, DType::F32),
        ("sum_4096x4096_cols", &[4096, 4096], &[0], false, DType::F32),
        ("max_4096x4096_rows", &[4096, 4096], &[1], true, DType::F32),
        ("sum_16384x384_rows", &[16384, 384], &[1], false, DType::F32),
        ("sum_16384x384_cols", &[16384, 384], &[0], false, DType::F32),
        (
            "sum_bn_256x64x32x32",
            &[256, 64, 32, 32],
            &[0, 2, 3],
            false,
            DType::F32,
        ),
        ("sum_all_64M", &[64 << 20], &[0], false, DType::F32),
        (
            "sum_4096x4096_rows_bf16",
            &[4096, 4096],
            &[1],
            false,
            DType::BF16,
        ),
    ];
    for (name, shape, axes, max, dtype) in rows {
        let x = t(shape, dtype);
        let bytes = (x.elem_count() * dtype.size_in_bytes()) as f64;
        for (path, tag) in [
            (ReducePath::Auto, ""),
            (ReducePath::Kernels, "_kernels"),
            (ReducePath::Generated, "_generated"),
        ] {
            kiln_backend_cuda::set_reduce_path(path);
            let ms = time(dev, 5, 20, || {
                let y = if max {
                    x.max(axes, false)?
                } else {
                    x.sum(axes, false)?
                };
                y.realize()
            });
            report(
                &format!("reduce_{name}{tag}"),
                bytes / (ms * 1e-3) / 1e9,
                "GB/s",
            );
        }
    }
    kiln_backend_cuda::set_reduce_path(ReducePath::Auto);
}

/// Issue 31: scaled dot-product attention at the GPT example's shape (`attn_gpt_*`: batch 64,
/// 6 heads, T = 256, head size 64, causal) and at a long-sequence one (`attn_long_*`: batch 8,
/// 16 heads, T = 2048, head size 64, causal), forward alone (no graph recorded) and forward +
/// backward (the gradients of q, k and v for a given output gradient, as
/// `torch.autograd.grad`), in f32 (TF32 off) and bf16: what attention takes by default (f32:
/// the fused kernels, on sm_80+ the 3xTF32 tensor-core ones; bf16: fused on sm_80+, composed
/// elsewhere). For the record, kiln only, at the GPT shape: f32 on the f32-FMA kernels
/// (`_fused_fma`) and on 1xTF32 (`_tf32`, `allow_tf32` on); the 16-bit fused kernels asked for
/// explicitly (`_fused_kernel`: tensor cores on sm_80+; `_fused_fma`: the f32-FMA ones); the
/// composed path (`_composed`; not at the long shape, whose f32 scores alone are 2 GiB); and
/// multi-head self-attention over a packed projection ([`packed_rows`]); at the GPT shape in
/// f32 and bf16, forward + backward with dropout 0.2 as the GPT trains (`_dropout`, beside
/// PyTorch's); and at the GPT shape, forward + backward under a key-padding mask instead of
/// the causal one (`_padding`: sequence `i` keeps its first `256 - 2i` keys; a boolean mask
/// `[64, 1, 1, 256]`, beside PyTorch's SDPA with that `attn_mask`; in bf16 also on kiln's own
/// kernels, `_padding_kiln_kernels`) and under ALiBi's additive bias `[1, 6, 256, 256]`
/// (`_additive`, beside PyTorch's SDPA with that float `attn_mask`).
fn attention(dev: &CudaDevice) {
    // The long shape first: the GPT shape's extra rows flip the kernel switches (and leave
    // 16-bit fusion forced off, not on its default).
    for (name, (b, h, t, d)) in [("long", (8, 16, 2048, 64)), ("gpt", (64, 6, 256, 64))] {
        let gpt = name == "gpt";
        for (dt, tag) in [(DType::F32, "f32"), (DType::BF16, "bf16")] {
            let draw = |seed| {
                Generator::new(seed)
                    .uniform::<Cuda>([b, h, t, d], -1.0, 1.0, dev)
                    .and_then(|x| x.to_dtype(dt))
                    .unwrap()
            };
            let (q, k, v) = (
                Var::param(draw(11)),
                Var::param(draw(12)),
                Var::param(draw(13)),
            );
            let g = draw(14);
            let sdpa =
                || q.scaled_dot_product_attention(&k, &v, &AttnMask::Causal, 0.0, None, None);
            let fwd = || no_grad(|| sdpa()?.tensor().realize());
            let fwd_bwd = || -> Result<()> {
                for x in [&q, &k, &v] {
                    x.zero_grad();
                }
                sdpa()?.backward_with(&g)?;
                for x in [&q, &k, &v] {
                    x.grad().expect("a gradient").realize()?;
                }
                Ok(())
            };
            let row = |what: &str, f: &dyn Fn() -> Result<()>| {
                report(&format!("attn_{name}_{what}"), time(dev, 5, 20, f), "ms");
            };
            row(&format!("fwd_{tag}"), &fwd);
            row(&format!("fwd_bwd_{tag}"), &fwd_bwd);
            if dt == DType::BF16 {
                // kiln's own tensor-core kernels with cuDNN's engines off (the rows above take
                // cuDNN's on Hopper).
                kiln_backend_cuda::set_cudnn_attention(Some(false));
                row(&format!("fwd_{tag}_kiln_kernels"), &fwd);
                row(&format!("fwd_bwd_{tag}_kiln_kernels"), &fwd_bwd);
                kiln_backend_cuda::set_cudnn_attention(None);
            }
            if gpt {
                // Training as the GPT runs it: dropout 0.2 on the weights (f32: kiln's kernels;
                // bf16 on Hopper: cuDNN's engines draw the mask, `_kiln_kernels`: kiln's kernels
                // and Philox stream).
                let rng = std::cell::RefCell::new(Generator::new(5));
                let fwd_bwd_dropout = || -> Result<()> {
                    for x in [&q, &k, &v] {
                        x.zero_grad();
                    }
                    let mut rng = rng.borrow_mut();
                    let y = q.scaled_dot_product_attention(
                        &k,
                        &v,
                        &AttnMask::Causal,
                        0.2,
                        None,
                        Some(&mut rng),
                    )?;
                    y.backward_with(&g)?;
                    for x in [&q, &k, &v] {
                        x.grad().expect("a gradient").realize()?;
                    }
                    Ok(())
                };
                row(&format!("fwd_bwd_{tag}_dropout"), &fwd_bwd_dropout);
                if dt == DType::BF16 {
                    kiln_backend_cuda::set_cudnn_attention(Some(false));
                    row(
                        &format!("fwd_bwd_{tag}_dropout_kiln_kernels"),
                        &fwd_bwd_dropout,
                    );
                    kiln_backend_cuda::set_cudnn_attention(None);
                }
            }
            if !gpt {
                continue;
            }
            // A batch of sequences of different lengths: a key-padding mask, fused.
            let padding: Vec<u8> = (0..b * t)
                .map(|x| u8::from(x % t >= t - 2 * (x / t)))
                .collect();
            let padding = Tensor::<Cuda>::from_slice(&padding, [b, t], dev).unwrap();
            let keep = AttnMask::key_padding(&padding).unwrap();
            let fwd_bwd_padding = || -> Result<()> {
                for x in [&q, &k, &v] {
                    x.zero_grad();
                }
                q.scaled_dot_product_attention(&k, &v, &keep, 0.0, None, None)?
                    .backward_with(&g)?;
                for x in [&q, &k, &v] {
                    x.grad().expect("a gradient").realize()?;
                }
                Ok(())
            };
            row(&format!("fwd_bwd_{tag}_padding"), &fwd_bwd_padding);
            if dt == DType::BF16 {
                // The same on kiln's own kernels (cuDNN's engines take it above on Hopper).
                kiln_backend_cuda::set_cudnn_attention(Some(false));
                row(
                    &format!("fwd_bwd_{tag}_padding_kiln_kernels"),
                    &fwd_bwd_padding,
                );
                kiln_backend_cuda::set_cudnn_attention(None);
            }
            // ALiBi's bias, an additive mask [1, h, t, t]: head i adds -2^(-8(i+1)/h)·|q - k|
            // (fused on cuDNN's engines in 16-bit on Hopper; composed elsewhere).
            let alibi: Vec<f64> = (0..h * t * t)
                .map(|x| {
                    let (head, i, j) = (x / (t * t), x / t % t, x % t);
                    let slope = (-8.0 * (head + 1) as f64 / h as f64).exp2();
                    -slope * (i as f64 - j as f64).abs()
                })
                .collect();
            let alibi = Tensor::<Cuda>::from_vec(alibi, [1, h, t, t], dev)
                .and_then(|x| x.to_dtype(dt))
                .unwrap();
            let additive = AttnMask::Additive(alibi);
            let fwd_bwd_additive = || -> Result<()> {
                for x in [&q, &k, &v] {
                    x.zero_grad();
                }
                q.scaled_dot_product_attention(&k, &v, &additive, 0.0, None, None)?
                    .backward_with(&g)?;
                for x in [&q, &k, &v] {
                    x.grad().expect("a gradient").realize()?;
                }
                Ok(())
            };
            row(&format!("fwd_bwd_{tag}_additive"), &fwd_bwd_additive);
            if dt == DType::F32 {
                // The f32-FMA kernels, and 1xTF32 on tensor cores.
                kiln_backend_cuda::set_attention_tensor_cores_f32(false);
                row(&format!("fwd_{tag}_fused_fma"), &fwd);
                row(&format!("fwd_bwd_{tag}_fused_fma"), &fwd_bwd);
                kiln_backend_cuda::set_attention_tensor_cores_f32(true);
                set_allow_tf32(true);
                row(&format!("fwd_{tag}_tf32"), &fwd);
                row(&format!("fwd_bwd_{tag}_tf32"), &fwd_bwd);
                set_allow_tf32(false);
            } else {
                // The 16-bit fused kernels asked for explicitly (the rows above took the
                // default: fused on sm_80+, composed elsewhere): the tensor-core kernels
                // (`_fused_kernel`) and the f32-FMA ones (`_fused_fma`).
                kiln_backend_cuda::set_fused_attention_16bit(true);
                kiln_backend_cuda::set_cudnn_attention(Some(false));
                row(&format!("fwd_{tag}_fused_kernel"), &fwd);
                row(&format!("fwd_bwd_{tag}_fused_kernel"), &fwd_bwd);
                kiln_backend_cuda::set_attention_tensor_cores(false);
                row(&format!("fwd_bwd_{tag}_fused_fma"), &fwd_bwd);
                kiln_backend_cuda::set_attention_tensor_cores(true);
                kiln_backend_cuda::set_fused_attention_16bit(false);
                kiln_backend_cuda::set_cudnn_attention(None);
            }
            packed_rows(dev, (b, h, t, d), (dt, tag));
            let _composed = composed_attention();
            row(&format!("fwd_bwd_{tag}_composed"), &fwd_bwd);
        }
    }
}

/// Multi-head self-attention over a packed `[b, t, 3E]` projection, forward + the gradient of
/// the projection, as `MultiheadAttention` runs it (`attn_gpt_packed_fwd_bwd_*`:
/// `packed_self_attention`, one node, the gradient one buffer the kernels write) and as it ran
/// before (`attn_gpt_narrow_fwd_bwd_*`: three narrowed head views into
/// `scaled_dot_product_attention`, the output transposed back, the gradients zero-padded and
/// summed at the fan-in).
fn packed_rows(
    dev: &CudaDevice,
    (b, h, t, d): (usize, usize, usize, usize),
    (dt, tag): (DType, &str),
) {
    let e = h * d;
    let x = Var::param(
        Generator::new(15)
            .uniform::<Cuda>([b, t, 3 * e], -1.0, 1.0, dev)
            .and_then(|x| x.to_dtype(dt))
            .unwrap(),
    );
    let g = Generator::new(16)
        .uniform::<Cuda>([b, t, e], -1.0, 1.0, dev)
        .and_then(|x| x.to_dtype(dt))
        .unwrap();
    let narrow = || -> Result<Var<Cuda>> {
        let view = |i: usize| {
            x.narrow(-1, i * e, e)?
                .reshape([b, t, h, d])?
                .transpose(-3, -2)
        };
        view(0)?
            .scaled_dot_product_attention(&view(1)?, &view(2)?, &AttnMask::Causal, 0.0, None, None)?
            .transpose(-3, -2)?
            .reshape([b, t, e])
    };
    let packed = || x.packed_self_attention(h, &AttnMask::Causal, 0.0, None, None);
    for (what, f) in [
        ("packed", &packed as &dyn Fn() -> Result<Var<Cuda>>),
        ("narrow", &narrow),
    ] {
        let fwd_bwd = || -> Result<()> {
            x.zero_grad();
            f()?.backward_with(&g)?;
            x.grad().expect("a gradient").realize()
        };
        report(
            &format!("attn_gpt_{what}_fwd_bwd_{tag}"),
            time(dev, 5, 20, &fwd_bwd),
            "ms",
        );
    }
}

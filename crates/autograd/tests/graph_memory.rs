//! What a recorded graph keeps allocated, counted with the CPU backend's `memory_stats`: only
//! the tensors the backward closures saved (an op output nobody holds and no backward saved is
//! freed at once), nothing of a 16-bit batch norm in f32 under autocast, and during `backward`
//! each node's saved tensors are released as soon as that node has run.
//!
//! One test function in its own binary: the byte counters are per device and process-wide,
//! so no other test may allocate beside it. The activations are below the CPU backend's
//! deferral threshold (256K elements), so every op runs (and allocates) when called.

use std::sync::{Arc, Mutex};

use kiln_autograd::{Var, autocast};
use kiln_backend_cpu::Cpu;
use kiln_core::{Backend, DType, Generator, RandDist};

const DIMS: [usize; 4] = [8, 8, 32, 32];
const ELEMS: usize = 8 * 8 * 32 * 32;

fn in_use() -> usize {
    Cpu::memory_stats(&Cpu::device(0)).unwrap().in_use
}

fn leaf(dims: &[usize], seed: u64, dtype: DType) -> Var<Cpu> {
    let t = Generator::new(seed)
        .sample::<Cpu>(
            dims.to_vec(),
            RandDist::Normal {
                mean: 0.5,
                std: 1.5,
            },
            dtype,
            &Cpu::device(0),
        )
        .unwrap();
    Var::leaf(t)
}

/// `relu(batch_norm(x))`, batch norm's output handle dropped at once (as in a model's forward).
fn bn_relu(x: &Var<Cpu>, w: &Var<Cpu>, b: &Var<Cpu>) -> Var<Cpu> {
    let (y, _) = x.batch_norm_train(Some(w), Some(b), 1e-5).unwrap();
    y.relu().unwrap()
}

#[test]
fn the_graph_keeps_only_what_backward_saved_and_frees_it_as_it_goes() {
    let small = 64 * 1024; // the [c] statistics and parameters, with room to spare
    let (w, b) = (leaf(&[8], 1, DType::F32), leaf(&[8], 2, DType::F32));
    for (dtype, amp) in [(DType::F32, None), (DType::BF16, Some(DType::BF16))] {
        let act = ELEMS * dtype.size_in_bytes();
        let x = leaf(&DIMS, 3, dtype);
        let base = in_use();
        let h = {
            let _amp = amp.map(|d| autocast(d).unwrap());
            bn_relu(&x, &w, &b)
        };
        assert_eq!(h.dtype(), dtype);
        // Batch norm saved x (the caller's) and relu its output: one new activation. Its own
        // output is freed (relu saved its output, not its input); under bf16 autocast no f32
        // copy of anything is made.
        let held = in_use() - base;
        assert!(
            held <= act + small,
            "{dtype}: the graph holds {held} bytes, one activation is {act}"
        );
        drop(h);
        assert!(
            in_use() - base <= small,
            "{dtype}: the graph outlived its output"
        );
    }

    // A chain of 6 layers: when the first layer's weight gets its gradient (its hook runs as
    // the last node of the pass has run), the other layers' saved activations are gone.
    let layers: Vec<(Var<Cpu>, Var<Cpu>)> = (0..6)
        .map(|i| {
            (
                leaf(&[8], 10 + i, DType::F32),
                leaf(&[8], 20 + i, DType::F32),
            )
        })
        .collect();
    let x = leaf(&DIMS, 4, DType::F32);
    let act = ELEMS * 4;
    let base = in_use();
    let mut h = x.clone();
    for (w, b) in &layers {
        h = bn_relu(&h, w, b);
    }
    let loss = h.sum(&[0, 1, 2, 3], false).unwrap();
    drop(h);
    let forward = in_use() - base;
    assert!(
        forward >= 6 * act && forward <= 6 * act + small,
        "after the forward: {forward} bytes, 6 activations are {}",
        6 * act
    );
    let seen = Arc::new(Mutex::new(None));
    let s = seen.clone();
    layers[0].0.register_grad_hook(Arc::new(move |_| {
        *s.lock().unwrap() = Some(in_use());
        Ok(())
    }));
    loss.backward().unwrap();
    let at_hook = seen.lock().unwrap().expect("the hook ran") - base;
    // Left then: the first node's input gradient in flight, x's gradient, a temporary or two;
    // not the 5 later layers' saved outputs.
    assert!(
        at_hook <= 3 * act + small,
        "when the first layer finished: {at_hook} bytes live, one activation is {act}"
    );
}

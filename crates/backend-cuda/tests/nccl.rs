//! NCCL collectives on two GPUs (one process, `NcclComm::init_all`, a thread per rank):
//! values of all_reduce (sum, avg), broadcast and all_gather in f32 and f64, ordering against
//! the producing and consuming streams, and a collective that only one rank issues: the
//! watchdog aborts it within the timeout and the error names it — no hang.
//!
//! Skipped (with a message) with fewer than 2 GPUs or without libnccl.

use std::time::{Duration, Instant};

use kiln_backend_cuda::{Cuda, CudaDevice, NcclComm, NcclReduceOp, device_count, nccl_version};
use kiln_core::{DType, DistErrorKind, Tensor};
use std::io::Write as _;

fn two_comms() -> Option<Vec<NcclComm>> {
    if device_count() < 2 {
        // Straight to stderr: the test harness captures `eprintln!`, and a skip must show.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: NCCL tests need 2 GPUs, {} visible",
            device_count()
        );
        return None;
    }
    if let Err(e) = nccl_version() {
        let _ = writeln!(std::io::stderr(), "skipped: {e}");
        return None;
    }
    Some(NcclComm::init_all(&[CudaDevice::new(0), CudaDevice::new(1)]).unwrap())
}

/// Runs `f(comm)` for both ranks at once, one thread each.
fn both<R: Send>(comms: &[NcclComm], f: impl Fn(&NcclComm) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn collectives_give_the_right_values() {
    let Some(comms) = two_comms() else { return };
    // Values small integers: exact in every float type, 16-bit ones included.
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let out = both(&comms, |c| {
            let dev = c.device();
            let r = c.rank() as f64;
            // A value produced by a (possibly deferred) op on the compute stream right before.
            let x = Tensor::<Cuda>::full([1000, 3], r + 1.0, dtype, &dev)
                .unwrap()
                .mul_scalar(2.0)
                .unwrap();
            let sum = c.all_reduce(&x, NcclReduceOp::Sum).unwrap().wait().unwrap();
            let avg = c.all_reduce(&x, NcclReduceOp::Avg).unwrap().wait().unwrap();
            let b = c.broadcast(&x, 1).unwrap().wait().unwrap();
            let g = c
                .all_gather(&x.narrow(0, 0, 2).unwrap())
                .unwrap()
                .wait()
                .unwrap();
            // Consumed on the compute stream after `wait`.
            let sum = sum.add_scalar(0.0).unwrap().to_f64_vec().unwrap();
            (
                sum,
                avg.to_f64_vec().unwrap(),
                b.to_f64_vec().unwrap(),
                g.dims().to_vec(),
                g.to_f64_vec().unwrap(),
            )
        });
        for (sum, avg, b, gdims, g) in out {
            assert!(
                sum.iter().all(|v| *v == 6.0),
                "{dtype}: sum {:?}",
                &sum[..3]
            );
            assert!(
                avg.iter().all(|v| *v == 3.0),
                "{dtype}: avg {:?}",
                &avg[..3]
            );
            assert!(
                b.iter().all(|v| *v == 4.0),
                "{dtype}: broadcast {:?}",
                &b[..3]
            );
            assert_eq!(gdims, vec![2, 2, 3]);
            assert_eq!(g, [vec![2.0; 6], vec![4.0; 6]].concat());
        }
    }
}

#[test]
fn a_collective_only_one_rank_issues_times_out_with_an_error() {
    let Some(comms) = two_comms() else { return };
    // Connections are set up by a collective both ranks issue.
    both(&comms, |c| {
        let x = Tensor::<Cuda>::ones([16], DType::F32, &c.device()).unwrap();
        c.all_reduce(&x, NcclReduceOp::Sum)
            .unwrap()
            .synchronize()
            .unwrap();
    });
    let c0 = &comms[0];
    c0.set_timeout(Duration::from_secs(3));
    let x = Tensor::<Cuda>::ones([16], DType::F32, &c0.device()).unwrap();
    let t = Instant::now();
    let pending = c0.all_reduce(&x, NcclReduceOp::Sum).unwrap();
    let e = pending.synchronize().unwrap_err();
    let waited = t.elapsed();
    eprintln!("one-sided all_reduce ended after {waited:?}: {e}");
    assert!(waited < Duration::from_secs(20), "{waited:?}");
    assert!(
        matches!(
            e.dist_kind(),
            Some(DistErrorKind::Timeout | DistErrorKind::Aborted)
        ),
        "{e}"
    );
    assert!(e.to_string().contains("all_reduce"), "{e}");
    // The communicator is unusable now, and says why.
    let e2 = c0.all_reduce(&x, NcclReduceOp::Sum).unwrap_err();
    assert!(e2.to_string().contains("aborted"), "{e2}");
    assert!(c0.is_aborted());
    // The device itself still works.
    let y = x.mul_scalar(3.0).unwrap().to_f64_vec().unwrap();
    assert_eq!(y, vec![3.0; 16]);
    // Rank 1 is abandoned: abort it too so dropping it does not wait for its peer.
    comms[1].abort("test over");
}

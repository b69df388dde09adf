//! Asking for too much memory, as a new user would: a typed error, never an abort, and a device
//! that still works afterwards.
//!
//! This binary registers no pinned allocator (unlike `pinned.rs`), so it also checks that
//! `pin_memory` without a GPU backend is a typed error.
//!
//! The out-of-memory cases ask for 4 TiB, which Linux's default (heuristic) overcommit refuses
//! up front. A system set to always overcommit (`vm.overcommit_memory = 1`) would hand out the
//! address space and kill the process when the pages are touched, which no library can report:
//! there those cases are skipped, with a message.

use std::sync::Mutex;

use kiln_backend_cpu::Cpu;
use kiln_core::{Backend, DType, Error, Generator, RandDist, Tensor};

/// The tests share the process-wide buffer cache (an out-of-memory retry empties it): one at a
/// time, so that each one's memory statistics are its own.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn overcommit_always() -> bool {
    let always =
        std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|s| s.trim() == "1");
    if always {
        eprintln!("skipped: vm.overcommit_memory = 1 accepts any allocation up front");
    }
    always
}

const TIB4_F32: usize = 1 << 40;

fn assert_oom<T: std::fmt::Debug>(r: kiln_core::Result<T>, op: &str, device: &str) {
    match r {
        Err(Error::OutOfMemory {
            device: d,
            requested,
            msg,
            ..
        }) => {
            assert_eq!(d, device);
            assert!(requested >= TIB4_F32, "requested {requested}");
            assert!(msg.starts_with(op), "{op}: {msg}");
        }
        other => panic!("{op}: expected OutOfMemory, got {other:?}"),
    }
}

#[test]
fn zeros_of_4_tib_is_out_of_memory_and_the_device_still_works() {
    let _g = serial();
    if overcommit_always() {
        return;
    }
    let cpu = Cpu::device(1);
    let before = Cpu::memory_stats(&cpu).unwrap().in_use;
    let e = Tensor::<Cpu>::zeros([TIB4_F32], DType::F32, &cpu).unwrap_err();
    match &e {
        Error::OutOfMemory {
            device,
            requested,
            held,
            msg,
        } => {
            assert_eq!(device, "cpu:1");
            assert_eq!(*requested, 4 << 40);
            assert_eq!(*held, before);
            assert!(msg.contains("fill"), "{msg}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(e.to_string().contains("out of memory on cpu:1"), "{e}");
    // Nothing leaked into the accounting, and the device computes as before.
    assert_eq!(Cpu::memory_stats(&cpu).unwrap().in_use, before);
    let x = Tensor::<Cpu>::arange(0.0, 4.0, 1.0, DType::F32, &cpu).unwrap();
    assert_eq!(
        (&x + 1.0).unwrap().to_vec::<f32>().unwrap(),
        [1.0, 2.0, 3.0, 4.0]
    );
}

#[test]
fn any_large_op_output_is_out_of_memory() {
    let _g = serial();
    if overcommit_always() {
        return;
    }
    let cpu = Cpu::device(2);
    // A broadcast view is free to make; computing on it needs the full output.
    let big = Tensor::<Cpu>::ones([1], DType::F32, &cpu)
        .unwrap()
        .broadcast_to([TIB4_F32])
        .unwrap();
    assert_oom(big.exp(), "exp", "cpu:2");
    assert_oom(&big + 1.0, "add", "cpu:2");
    assert_oom(big.contiguous(), "contiguous", "cpu:2");
    assert_oom(big.to_vec::<f32>(), "to_host", "cpu:2");
    assert_oom(big.copy_to(&Cpu::device(3)), "copy_to", "cpu:3");
    assert_oom(big.to_dtype(DType::F64), "cast", "cpu:2");
    assert_oom(
        Generator::new(7).rand::<Cpu>([TIB4_F32], &cpu),
        "rand",
        "cpu:2",
    );
    let rows = Tensor::<Cpu>::ones([1, 1], DType::F32, &cpu)
        .unwrap()
        .broadcast_to([1 << 20, 1])
        .unwrap();
    let cols = Tensor::<Cpu>::ones([1, 1], DType::F32, &cpu)
        .unwrap()
        .broadcast_to([1, 1 << 20])
        .unwrap();
    assert_oom(rows.matmul(&cols), "matmul", "cpu:2");
    let square = Tensor::<Cpu>::ones([1, 1], DType::F32, &cpu)
        .unwrap()
        .broadcast_to([1 << 20, 1 << 20])
        .unwrap();
    assert_oom(square.softmax(-1), "softmax", "cpu:2");
    let tall = Tensor::<Cpu>::ones([1, 1], DType::F32, &cpu)
        .unwrap()
        .broadcast_to([TIB4_F32, 2])
        .unwrap();
    assert_oom(tall.max(&[1], false), "max", "cpu:2");
    assert_oom(tall.sum(&[1], false), "sum", "cpu:2");
    assert_eq!(
        (&Tensor::<Cpu>::ones([2], DType::F32, &cpu).unwrap() * 3.0)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        [3.0, 3.0]
    );
}

#[test]
fn a_refused_allocation_first_gives_up_the_cache() {
    let _g = serial();
    if overcommit_always() {
        return;
    }
    let cpu = Cpu::device(4);
    // 4 MiB: large enough to be cached when dropped.
    drop(Tensor::<Cpu>::zeros([1 << 20], DType::F32, &cpu).unwrap());
    let s = Cpu::memory_stats(&cpu).unwrap();
    assert!(s.reserved > s.in_use, "the dropped buffer is cached: {s:?}");
    assert!(Tensor::<Cpu>::zeros([TIB4_F32], DType::F32, &cpu).is_err());
    let s = Cpu::memory_stats(&cpu).unwrap();
    assert_eq!(
        s.reserved, s.in_use,
        "the cache was emptied before failing: {s:?}"
    );
}

#[test]
fn sizes_past_the_address_space_are_invalid_arguments() {
    let _g = serial();
    let cpu = Cpu::device(5);
    let invalid = |r: kiln_core::Result<Tensor<Cpu>>, op: &str, what: &str| match r {
        Err(Error::InvalidArgument { op: o, msg }) => {
            assert_eq!(o, op, "{msg}");
            assert!(msg.contains(what), "{msg}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    // The element count overflows usize (it used to panic with `capacity overflow`).
    invalid(
        Tensor::<Cpu>::zeros([usize::MAX / 2, 4], DType::F32, &cpu),
        "full",
        "more elements than usize can count",
    );
    invalid(
        Tensor::<Cpu>::zeros([1 << 32, 1 << 32], DType::U8, &cpu),
        "full",
        "more elements than usize can count",
    );
    // The count fits, its bytes do not.
    invalid(
        Tensor::<Cpu>::zeros([1 << 62], DType::F64, &cpu),
        "fill",
        "more than one allocation can hold",
    );
    invalid(
        Tensor::<Cpu>::ones([usize::MAX / 2 + 1], DType::U8, &cpu),
        "fill",
        "more than one allocation can hold",
    );
    invalid(
        Generator::new(1).sample::<Cpu>(
            [usize::MAX / 2, 4],
            RandDist::Normal {
                mean: 0.0,
                std: 1.0,
            },
            DType::F64,
            &cpu,
        ),
        "rand",
        "more elements than usize can count",
    );
    let big = Tensor::<Cpu>::ones([1], DType::F32, &cpu)
        .unwrap()
        .broadcast_to([usize::MAX / 2, 4])
        .unwrap();
    invalid(big.exp(), "exp", "overflows usize");
    assert_eq!(
        Tensor::<Cpu>::zeros([3], DType::U8, &cpu)
            .unwrap()
            .to_vec::<u8>()
            .unwrap(),
        [0, 0, 0]
    );
}

#[test]
fn pinning_without_a_gpu_backend_is_a_typed_error() {
    let _g = serial();
    let cpu = Cpu::device(0);
    let x = Tensor::<Cpu>::ones([4], DType::F32, &cpu).unwrap();
    match x.pin_memory() {
        Err(Error::InvalidArgument { op, msg }) => {
            assert_eq!(op, "pin_memory");
            assert!(msg.contains("pinned allocator"), "{msg}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(!x.is_pinned());
}

//! 16-bit safetensors interchange with PyTorch (the mixed-precision issue): `data/torch_16bit.safetensors`
//! is what `bench/safetensors_16bit_torch.py --write` saves with PyTorch — 4,121 f32 values
//! (ties, subnormals, overflow, infinities, NaN, -0, and random values over 20 decades) and
//! PyTorch's own rounding of them to `torch.float16` and `torch.bfloat16`. kiln loads the file,
//! rounds the same f32 values itself on the reference and the CPU backend, and must agree bit
//! for bit (NaN as NaN); a file kiln writes from them must hold the same bytes. The other
//! direction, PyTorch reading a kiln file, is `--check` of the same script on a file this test
//! writes where `KILN_SAFETENSORS_OUT` points.

use kiln_backend_cpu::Cpu;
use kiln_core::reference::{RefDevice, Reference};
use kiln_core::{Backend, DType, Tensor, bf16, f16};
use kiln_nn::serialize::{from_safetensors_bytes, to_safetensors_bytes};

const TORCH: &[u8] = include_bytes!("data/torch_16bit.safetensors");

/// `t`'s elements as raw 16-bit words.
fn words<B: Backend>(t: &Tensor<B>) -> Vec<u16> {
    match t.dtype() {
        DType::F16 => t
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => t
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        d => panic!("not a 16-bit tensor: {d}"),
    }
}

/// Whether a 16-bit word of type `d` is a NaN.
fn is_nan(d: DType, w: u16) -> bool {
    match d {
        DType::F16 => f16::from_bits(w).is_nan(),
        _ => bf16::from_bits(w).is_nan(),
    }
}

fn agrees_with_torch<B: Backend>(dev: &B::Device, backend: &str) {
    let file = from_safetensors_bytes::<B>(TORCH, "torch_16bit.safetensors", dev).unwrap();
    let x = &file.tensors["f32"];
    assert_eq!(x.dtype(), DType::F32);
    let f32s = x.to_vec::<f32>().unwrap();
    for (name, d) in [("f16", DType::F16), ("bf16", DType::BF16)] {
        let torch = &file.tensors[name];
        assert_eq!(torch.dtype(), d, "{name}");
        let (want, got) = (words(torch), words(&x.to_dtype(d).unwrap()));
        assert_eq!(want.len(), got.len());
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            let same = w == g || (is_nan(d, *w) && is_nan(d, *g));
            assert!(
                same,
                "{backend} {name}: f32 {:e} (bits {:#010x}) rounds to {g:#06x} in kiln, \
                 {w:#06x} in PyTorch (element {i})",
                f32s[i],
                f32s[i].to_bits()
            );
        }
    }
}

#[test]
fn the_reference_rounds_to_16_bits_as_pytorch_does() {
    agrees_with_torch::<Reference>(&RefDevice(0), "reference");
}

#[test]
fn the_cpu_backend_rounds_to_16_bits_as_pytorch_does() {
    agrees_with_torch::<Cpu>(&Cpu::parse_device("cpu").unwrap(), "cpu");
}

/// kiln's file of the same three tensors holds PyTorch's data bytes (the header may order
/// keys differently; the data section is compared tensor by tensor); it is written where
/// `KILN_SAFETENSORS_OUT` points, for the script's `--check` on a machine with PyTorch.
#[test]
fn kiln_writes_the_bytes_pytorch_wrote() {
    let dev = RefDevice(0);
    let torch = from_safetensors_bytes::<Reference>(TORCH, "torch", &dev).unwrap();
    let x = torch.tensors["f32"].clone();
    let named = vec![
        ("f32".to_string(), x.clone()),
        ("f16".to_string(), x.to_dtype(DType::F16).unwrap()),
        ("bf16".to_string(), x.to_dtype(DType::BF16).unwrap()),
    ];
    let bytes = to_safetensors_bytes(&named, None).unwrap();
    let back = from_safetensors_bytes::<Reference>(&bytes, "kiln", &dev).unwrap();
    for name in ["f16", "bf16"] {
        let (w, g) = (words(&torch.tensors[name]), words(&back.tensors[name]));
        let d = back.tensors[name].dtype();
        let differ = w
            .iter()
            .zip(&g)
            .filter(|(a, b)| a != b && !(is_nan(d, **a) && is_nan(d, **b)))
            .count();
        assert_eq!(differ, 0, "{name}: {differ} words differ from PyTorch's");
    }
    match std::env::var_os("KILN_SAFETENSORS_OUT") {
        Some(path) => std::fs::write(&path, &bytes).unwrap(),
        None => eprintln!(
            "kiln_writes_the_bytes_pytorch_wrote: KILN_SAFETENSORS_OUT unset, so no file was \
             written for bench/safetensors_16bit_torch.py --check"
        ),
    }
}

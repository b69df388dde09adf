//! safetensors round trips and initializer statistics, on the CPU backend.

use std::collections::BTreeMap;

use kiln_core::reference::{RefDevice, Reference as Cpu};
use kiln_core::{DType, Error, Generator, Tensor};
use kiln_nn::init::fans;
use kiln_nn::serialize::{check_state_dict, from_safetensors_bytes, to_safetensors_bytes};
use kiln_nn::{Init, load_safetensors, save_safetensors};

fn dev() -> RefDevice {
    RefDevice(0)
}

#[test]
fn round_trip_every_dtype_and_views() {
    let d = dev();
    let a = Tensor::<Cpu>::arange(0.0, 6.0, 1.0, DType::F32, &d)
        .unwrap()
        .reshape([2, 3])
        .unwrap();
    let at = a.t().unwrap(); // non-contiguous: saved in its logical (row-major) order
    let b = Tensor::<Cpu>::from_vec(vec![1.5f64, -2.25], [2], &d).unwrap();
    let c = Tensor::<Cpu>::from_vec(vec![-7i64, 9, 1 << 40], [3, 1], &d).unwrap();
    let e = Tensor::<Cpu>::from_vec(vec![0u8, 255, 3, 4], [2, 2], &d).unwrap();
    let s = Tensor::<Cpu>::scalar(3.5f32, &d).unwrap();
    let named: Vec<(String, Tensor<Cpu>)> = vec![
        ("0.weight".into(), at.clone()),
        ("b".into(), b.clone()),
        ("c".into(), c.clone()),
        ("e".into(), e.clone()),
        ("s".into(), s.clone()),
    ];
    let dir = std::env::temp_dir().join(format!("kiln_nn_rt_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.safetensors");
    let meta: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    save_safetensors(&path, &named, Some(meta.clone())).unwrap();
    let f = load_safetensors::<Cpu>(&path, &d).unwrap();
    assert_eq!(f.metadata, meta);
    assert_eq!(f.tensors.len(), 5);
    let w = &f.tensors["0.weight"];
    assert_eq!(w.dims(), &[3, 2]);
    assert_eq!(w.to_vec::<f32>().unwrap(), at.to_vec::<f32>().unwrap());
    assert_eq!(f.tensors["b"].to_vec::<f64>().unwrap(), vec![1.5, -2.25]);
    assert_eq!(
        f.tensors["c"].to_vec::<i64>().unwrap(),
        vec![-7, 9, 1 << 40]
    );
    assert_eq!(f.tensors["e"].to_vec::<u8>().unwrap(), vec![0, 255, 3, 4]);
    assert_eq!(f.tensors["s"].rank(), 0);
    assert_eq!(f.tensors["s"].to_scalar().unwrap(), 3.5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sixteen_bit_tensors_round_trip_as_f16_and_bf16() {
    use kiln_core::{bf16, f16};
    let d = dev();
    let h: Vec<f16> = [1.0f32, -2.5, 65504.0, 1e-7, f32::INFINITY]
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let b: Vec<bf16> = [1.0f32, -2.5, 3e38, 1e-30, 0.1]
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let th = Tensor::<Cpu>::from_vec(h.clone(), [5], &d).unwrap();
    let tb = Tensor::<Cpu>::from_vec(b.clone(), [5, 1], &d).unwrap();
    let named = vec![("h".to_string(), th), ("b".to_string(), tb)];
    let bytes = to_safetensors_bytes(&named, None).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    // PyTorch's names for torch.float16 and torch.bfloat16 in safetensors.
    assert!(header.contains(r#""dtype":"F16""#), "{header}");
    assert!(header.contains(r#""dtype":"BF16""#), "{header}");
    // Little-endian 16-bit words, as PyTorch writes them (bf16 1.0 is 0x3f80).
    let tail = &bytes[bytes.len() - 20..];
    assert!(tail.windows(2).any(|w| w == [0x80, 0x3f]), "{tail:?}");
    let f = from_safetensors_bytes::<Cpu>(&bytes, "mem", &d).unwrap();
    assert_eq!(f.tensors["h"].dtype(), DType::F16);
    assert_eq!(f.tensors["b"].dtype(), DType::BF16);
    assert_eq!(f.tensors["b"].dims(), &[5, 1]);
    let got_h = f.tensors["h"].to_vec::<f16>().unwrap();
    assert_eq!(
        got_h.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        h.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    let got_b = f.tensors["b"].to_vec::<bf16>().unwrap();
    assert_eq!(
        got_b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

/// Nothing lost on the way to disk: a save replaces the file in one step (temporary file,
/// sync, rename), so a failed save keeps the previous checkpoint and a reader that opened it
/// keeps reading it whole.
#[test]
fn saving_replaces_the_previous_checkpoint_atomically() {
    let d = dev();
    let dir = std::env::temp_dir().join(format!("kiln_nn_atomic_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ckpt.safetensors");
    let v1 = Tensor::<Cpu>::arange(0.0, 1000.0, 1.0, DType::F32, &d).unwrap();
    let v2 = (&v1 * 2.0).unwrap();
    save_safetensors(&path, &[("w".to_string(), v1.clone())], None).unwrap();
    let old_bytes = std::fs::read(&path).unwrap();
    let mut reader = std::fs::File::open(&path).unwrap();
    save_safetensors(&path, &[("w".to_string(), v2.clone())], None).unwrap();
    let f = load_safetensors::<Cpu>(&path, &d).unwrap();
    assert_eq!(
        f.tensors["w"].to_vec::<f32>().unwrap(),
        v2.to_vec::<f32>().unwrap()
    );
    // A reader of the old checkpoint still reads all of it (writing in place truncates it).
    #[cfg(unix)]
    {
        use std::io::Read;
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        assert_eq!(got, old_bytes, "the old file was overwritten in place");
    }
    #[cfg(not(unix))]
    drop((&mut reader, old_bytes));
    // A save that fails keeps the previous checkpoint.
    let dup = [("w".to_string(), v1.clone()), ("w".to_string(), v1.clone())];
    assert!(save_safetensors(&path, &dup, None).is_err());
    let f = load_safetensors::<Cpu>(&path, &d).unwrap();
    assert_eq!(
        f.tensors["w"].to_vec::<f32>().unwrap(),
        v2.to_vec::<f32>().unwrap()
    );
    // A save that fails after writing (the target is a directory: the rename fails) leaves no
    // temporary file behind and names the path.
    let taken = dir.join("taken.safetensors");
    std::fs::create_dir_all(taken.join("x")).unwrap();
    let e = save_safetensors(&taken, &[("w".to_string(), v1)], None).unwrap_err();
    assert!(
        matches!(&e, Error::Io { path, .. } if path.contains("taken")),
        "{e}"
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["ckpt.safetensors", "taken.safetensors"],
        "no temporary files remain"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_bytes_are_little_endian_row_major_as_pytorch_writes_them() {
    // Header then raw data: the last 8 bytes are the f32s 1.0 and 2.0 in little endian.
    let d = dev();
    let t = Tensor::<Cpu>::from_vec(vec![1.0f32, 2.0], [2], &d).unwrap();
    let bytes = to_safetensors_bytes(&[("x".to_string(), t)], None).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    assert!(
        header.contains(r#""x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#),
        "{header}"
    );
    let mut want = 1.0f32.to_le_bytes().to_vec();
    want.extend(2.0f32.to_le_bytes());
    assert_eq!(&bytes[bytes.len() - 8..], &want[..]);
}

#[test]
fn corrupt_and_missing_files_are_typed_errors() {
    let d = dev();
    let err = load_safetensors::<Cpu>("/nonexistent/kiln/none.safetensors", &d)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    let t = Tensor::<Cpu>::ones([4], DType::F32, &d).unwrap();
    let bytes = to_safetensors_bytes(&[("x".to_string(), t.clone())], None).unwrap();
    let short = &bytes[..bytes.len() - 3];
    let err = from_safetensors_bytes::<Cpu>(short, "trunc.safetensors", &d)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("trunc.safetensors"), "{err}");
    let err = from_safetensors_bytes::<Cpu>(b"\x03", "tiny", &d)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    // Duplicate names on save.
    let err = to_safetensors_bytes(&[("x".to_string(), t.clone()), ("x".to_string(), t)], None)
        .err()
        .unwrap();
    assert!(err.to_string().contains("given twice"), "{err}");
}

#[test]
fn check_state_dict_names_every_problem() {
    let d = dev();
    let t = |dims: &[usize]| Tensor::<Cpu>::zeros(dims.to_vec(), DType::F32, &d).unwrap();
    let expected = vec![
        ("0.weight".to_string(), t(&[3, 2])),
        ("0.bias".to_string(), t(&[3])),
        ("2.weight".to_string(), t(&[1, 3])),
    ];
    let mut loaded = BTreeMap::new();
    loaded.insert("0.weight".to_string(), t(&[2, 3]));
    loaded.insert("2.weight".to_string(), t(&[1, 3]));
    loaded.insert("9.extra".to_string(), t(&[1]));
    let err = check_state_dict("load", "m.safetensors", &expected, &loaded)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("missing tensors: `0.bias`"), "{err}");
    assert!(err.contains("unexpected tensors: `9.extra`"), "{err}");
    assert!(
        err.contains("`0.weight`: expected f32 [3, 2]") || err.contains("`0.weight`"),
        "{err}"
    );
    assert!(err.contains("m.safetensors"), "{err}");
    loaded.insert("0.bias".to_string(), t(&[3]));
    loaded.insert("0.weight".to_string(), t(&[3, 2]));
    loaded.remove("9.extra");
    check_state_dict("load", "m", &expected, &loaded).unwrap();
}

fn stats(v: &[f32]) -> (f64, f64, f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    let lo = v.iter().fold(f64::INFINITY, |a, &x| a.min(x as f64));
    let hi = v.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
    (mean, var.sqrt(), lo, hi)
}

#[test]
fn initializers_follow_pytorch_formulas() {
    let d = dev();
    let shape = [200, 400];
    assert_eq!(fans(&shape.into()).unwrap(), (400, 200));
    assert_eq!(fans(&[16, 6, 5, 5].into()).unwrap(), (150, 400));
    assert!(fans(&[5].into()).is_err());

    // Kaiming uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    let w = Init::torch_default()
        .init::<Cpu>(shape, &mut Generator::new(7), DType::F32, &d)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let b = 1.0 / 400f64.sqrt();
    let (m, s, lo, hi) = stats(&w);
    assert!(lo >= -b && hi < b, "{lo} {hi} {b}");
    assert!(hi > 0.99 * b && lo < -0.99 * b);
    assert!(
        m.abs() < 0.01 * b && (s - b / 3f64.sqrt()).abs() < 0.02 * b,
        "{m} {s}"
    );

    // Kaiming normal (He): std sqrt(2 / fan_in).
    let w = Init::KaimingNormal { a: 0.0 }
        .init::<Cpu>(shape, &mut Generator::new(7), DType::F32, &d)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (m, s, _, _) = stats(&w);
    let want = (2.0 / 400f64).sqrt();
    assert!(
        m.abs() < 0.01 * want && (s - want).abs() < 0.02 * want,
        "{m} {s} {want}"
    );

    // Xavier uniform: bound gain * sqrt(6 / (fan_in + fan_out)).
    let w = Init::XavierUniform { gain: 2.0 }
        .init::<Cpu>(shape, &mut Generator::new(7), DType::F32, &d)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let bound = 2.0 * (6.0 / 600f64).sqrt();
    let (_, _, lo, hi) = stats(&w);
    assert!(lo >= -bound && hi < bound && hi > 0.99 * bound);

    // Xavier normal: std gain * sqrt(2 / (fan_in + fan_out)).
    let w = Init::XavierNormal { gain: 1.0 }
        .init::<Cpu>(shape, &mut Generator::new(7), DType::F32, &d)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (_, s, _, _) = stats(&w);
    let want = (2.0 / 600f64).sqrt();
    assert!((s - want).abs() < 0.02 * want, "{s} {want}");

    // Bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) from the weight's fan_in.
    let bias = Init::BiasUniform { fan_in: 4 }
        .init::<Cpu>([1000], &mut Generator::new(1), DType::F64, &d)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    assert!(bias.iter().all(|&x| (-0.5..0.5).contains(&x)));
    assert!(bias.iter().any(|&x| x > 0.45) && bias.iter().any(|&x| x < -0.45));

    // One draw per tensor: a second draw of the same generator differs, the same seed
    // replays, another seed gives others, and the constant fills draw nothing.
    let init = |g: &mut Generator| {
        Init::torch_default()
            .init::<Cpu>([3, 4], g, DType::F32, &d)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    };
    let mut g = Generator::new(1);
    let (a, b) = (init(&mut g), init(&mut g));
    assert_ne!(a, b);
    assert_eq!(g.draws(), 2);
    Init::Zeros
        .init::<Cpu>([3], &mut g, DType::F32, &d)
        .unwrap();
    assert_eq!(g.draws(), 2);
    g.manual_seed(1);
    assert_eq!(init(&mut g), a);
    assert_ne!(init(&mut Generator::new(2)), a);
    assert!(
        Init::Zeros
            .init::<Cpu>([2], &mut g, DType::I64, &d)
            .is_err()
    );
}

use super::*;
use crate::Tensor;

type T = Tensor<Reference>;
const D: RefDevice = RefDevice(0);

#[test]
fn devices_display_and_parse() {
    assert_eq!(RefDevice(0).to_string(), "ref");
    assert_eq!(RefDevice(1).to_string(), "ref:1");
    assert_eq!(Reference::parse_device("ref:1").unwrap(), RefDevice(1));
    assert_eq!(Reference::parse_device("ref").unwrap(), RefDevice(0));
    assert!(Reference::parse_device("cuda:0").is_err());
    assert!(Reference::parse_device("ref:9").is_err());
}

#[test]
fn small_ops() {
    let a = T::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], &D).unwrap();
    let s = a.sum(&[0], false).unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![5.0, 7.0, 9.0]);
    let m = a.matmul(&a.t().unwrap()).unwrap();
    assert_eq!(m.to_vec::<f32>().unwrap(), vec![14.0, 32.0, 32.0, 77.0]);
    let am = a.argmax(1, false).unwrap();
    assert_eq!(am.to_vec::<i64>().unwrap(), vec![2, 2]);
    let i = T::from_vec(vec![-7i64, 7, 0], [3], &D).unwrap();
    let q = i
        .div(&T::from_vec(vec![2i64, 0, 3], [3], &D).unwrap())
        .unwrap();
    assert_eq!(q.to_vec::<i64>().unwrap(), vec![-3, 0, 0]);
}

#[test]
fn nan_semantics() {
    let a = T::from_vec(vec![1.0f64, f64::NAN, 3.0, f64::NAN], [4], &D).unwrap();
    assert!(a.max_all().unwrap().to_scalar().unwrap().is_nan());
    assert_eq!(
        a.argmax(0, false).unwrap().to_vec::<i64>().unwrap(),
        vec![1]
    );
    assert_eq!(
        a.argmin(0, false).unwrap().to_vec::<i64>().unwrap(),
        vec![1]
    );
}

#[test]
fn index_out_of_range_names_op_and_index() {
    let a = T::zeros([3, 2], DType::F32, &D).unwrap();
    let ids = T::from_vec(vec![0i64, 3], [2], &D).unwrap();
    let e = a.index_select(0, &ids).unwrap_err().to_string();
    assert!(e.contains("index_select") && e.contains("index 3"), "{e}");
}

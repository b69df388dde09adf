//! The MNIST subset committed under `data/mnist/` loads and is what its README says.

use kiln_core::HostBuffer;
use kiln_data::{Dataset, Mnist};

#[test]
fn bundled_mnist_is_balanced_and_scaled() {
    let m = Mnist::load(Mnist::bundled_dir()).unwrap();
    for (set, n, per_digit) in [(&m.train, 4000, 400), (&m.test, 1000, 100)] {
        assert_eq!(set.len(), n);
        assert_eq!(set.feature_dims(), &[784]);
        let HostBuffer::I64(labels) = set.labels() else {
            panic!("labels are i64")
        };
        let mut counts = [0usize; 10];
        labels.iter().for_each(|&l| counts[l as usize] += 1);
        assert_eq!(counts, [per_digit; 10]);
        let HostBuffer::F32(px) = set.features() else {
            panic!("features are f32")
        };
        assert!(px.iter().all(|&p| (0.0..=1.0).contains(&p)));
        // Real digits: every image has ink, and the set uses the full range.
        assert!(
            px.chunks(784)
                .all(|img| img.iter().filter(|&&p| p > 0.5).count() > 20)
        );
        assert_eq!(px.iter().cloned().fold(0.0, f32::max), 1.0);
    }
}

/// A whole shuffled epoch of the bundled training set through the loader on the CPU backend,
/// shaped for a conv net: every digit once, rows intact.
#[test]
fn one_epoch_on_the_cpu_backend() {
    use kiln_backend_cpu::Cpu;
    use kiln_core::Backend;
    use kiln_data::{DataLoader, permutation};

    let dev = Cpu::parse_device("cpu").unwrap();
    let m = Mnist::load(Mnist::bundled_dir()).unwrap();
    let HostBuffer::F32(all_px) = m.train.features().clone() else {
        panic!("features are f32")
    };
    let mut loader = DataLoader::<Cpu>::new(m.train, 128, &dev)
        .unwrap()
        .shuffle(3)
        .sample_shape([1, 28, 28])
        .unwrap();
    assert_eq!(loader.num_batches(), 32); // 31 full batches and one of 32
    let order = permutation(4000, 3, 0);
    let mut counts = [0usize; 10];
    let mut seen = 0;
    for batch in loader.iter() {
        let (x, y) = batch.unwrap();
        let b = y.dims()[0];
        assert_eq!(x.dims(), &[b, 1, 28, 28]);
        assert_eq!(x.device(), &dev);
        let px = x.to_vec::<f32>().unwrap();
        for (r, &l) in y.to_vec::<i64>().unwrap().iter().enumerate() {
            counts[l as usize] += 1;
            let src = order[seen + r];
            assert_eq!(
                px[r * 784..(r + 1) * 784],
                all_px[src * 784..(src + 1) * 784]
            );
        }
        seen += b;
    }
    assert_eq!(seen, 4000);
    assert_eq!(counts, [400; 10]);
}

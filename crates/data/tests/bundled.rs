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

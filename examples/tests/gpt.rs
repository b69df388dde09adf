//! Keeps `examples/gpt` true: a very small GPT trains for a few iterations on the CPU and its
//! loss is finite and falls; the tied output layer is one parameter; sampling gives text.
//! Small enough for a debug build on two cores (CI's `cargo test --workspace`).

use kiln_backend_cpu::Cpu;
use kiln_core::{Backend, Generator};
use kiln_examples::gpt::{CharData, Gpt, GptConfig, TrainConfig, bundled_corpus, generate, train};
use kiln_nn::Module;

#[test]
fn tiny_gpt_loss_falls_on_the_cpu() {
    let text = kiln_examples::gpt::data::read_text(&bundled_corpus()).unwrap();
    let full = CharData::from_text(&text).unwrap();
    assert_eq!(full.vocab_size(), 84);
    let head: String = text.chars().take(100_000).collect();
    let data = CharData::from_text(&head).unwrap();

    let model_cfg = GptConfig {
        vocab_size: data.vocab_size(),
        block: 16,
        n_layer: 1,
        n_head: 2,
        n_embd: 32,
        dropout: 0.1,
    };
    let mut c = TrainConfig::nanogpt(model_cfg, 8, 40);
    c.eval_interval = 20;
    c.eval_iters = 4;
    c.warmup = 5;
    c.lr = 1e-2;
    c.min_lr = 1e-3;
    let dev = Cpu::device(0);
    let mut model = Gpt::<Cpu>::new(model_cfg, &dev, &mut Generator::new(c.seed)).unwrap();

    // The output layer is the token embedding: listed under both names, counted once.
    let named = model.named_parameters();
    let wte = &named
        .iter()
        .find(|(n, _)| n == "transformer.wte.weight")
        .unwrap()
        .1;
    let head_w = &named.iter().find(|(n, _)| n == "lm_head.weight").unwrap().1;
    assert!(wte.ptr_eq(head_w));
    assert_eq!(model.parameters().len(), named.len() - 1);

    let points = train(&mut model, &data, &c, &dev, |_| {}).unwrap();
    assert_eq!(
        points.iter().map(|p| p.iter).collect::<Vec<_>>(),
        [0, 20, 40]
    );
    for p in &points {
        assert!(p.train_loss.is_finite() && p.val_loss.is_finite(), "{p:?}");
    }
    let (first, last) = (points[0], points[points.len() - 1]);
    // Untrained: about ln(vocab); trained a little: clearly lower.
    assert!(
        (first.train_loss - (data.vocab_size() as f64).ln()).abs() < 0.3,
        "{first:?}"
    );
    assert!(
        last.train_loss < first.train_loss - 0.5,
        "{first:?} -> {last:?}"
    );
    assert!(
        last.val_loss < first.val_loss - 0.3,
        "{first:?} -> {last:?}"
    );

    let s = generate(
        &mut model,
        &data,
        "\n",
        20,
        (0.8, Some(10)),
        &mut Generator::new(1),
        &dev,
    )
    .unwrap();
    assert_eq!(s.chars().count(), 20);
    assert_eq!(<Cpu as Backend>::NAME, "cpu");
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let data = CharData::from_text("to be, or not to be, that is the question").unwrap();
    let dev = Cpu::device(0);
    let mut cfg = GptConfig {
        vocab_size: data.vocab_size(),
        block: 8,
        n_layer: 1,
        n_head: 3,
        n_embd: 16,
        dropout: 0.0,
    };
    assert!(Gpt::<Cpu>::new(cfg, &dev, &mut Generator::new(0)).is_err()); // 16 % 3
    cfg.n_head = 2;
    cfg.dropout = 1.0;
    assert!(Gpt::<Cpu>::new(cfg, &dev, &mut Generator::new(0)).is_err());
    let mut g = Generator::new(0);
    assert!(
        data.batch::<Cpu>(kiln_examples::gpt::Split::Val, 2, 100, &mut g, &dev)
            .is_err()
    );
    assert!(CharData::from_text("short").is_err());
}

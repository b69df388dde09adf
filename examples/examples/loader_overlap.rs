//! Does the DataLoader's next batch arrive while the current one trains? Times an MLP training
//! epoch over an in-memory dataset four ways, alternating rounds:
//!
//! - `compute`: the same steps on one batch already on the device (no data movement at all);
//! - `resident`: the same epoch with the dataset already on the device, as a user would keep a
//!   small dataset there: the epoch's order uploaded once, each batch gathered on the device
//!   (`index_select` of its rows) — the alternative a user weighs the loader against;
//! - `sync`: `prefetch(0)`, each batch gathered and uploaded on this thread before its step;
//! - `prefetch`: the loader's default prefetching (`--prefetch N` overrides it): the worker
//!   thread gathers the next batches, uploaded (on a GPU through pinned memory on the copy
//!   stream) while this one trains; with `--pin-dataset` the GPU gathers them from the pinned
//!   dataset instead, on the copy stream, and no worker runs.
//!
//! With full overlap `prefetch` costs what `compute` costs; without any, what `sync` costs.
//! `prefetch/compute` is the median over rounds of each round's ratio (the two epochs run back
//! to back), with the range over rounds beside it; `prefetch/resident` likewise. Without
//! `--shuffle` the batches are consecutive rows, so `resident` narrows instead of gathering.
//! The line `hidden=...%` is the share of the data movement (`sync - compute`) that prefetching
//! hides; `host_us_per_batch` is the training thread's own time in the loader's `next()` and in
//! dropping a used batch, which no prefetching can hide when the step is bound by the host.
//!
//! ```sh
//! cargo run --release --example loader_overlap -- --device cuda
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use kiln_core::{Backend, DType, HostBuffer, HostSource, PinnedBlock, Reduction, Result, Tensor};
use kiln_data::{ArrayDataset, DataLoader};
use kiln_examples::{DEVICE_HELP, Job, dispatch, models};
use kiln_nn::Module;
use kiln_nn::loss::cross_entropy;
use kiln_optim::{Optimizer, SgdConfig};

#[derive(Parser, Clone)]
struct Args {
    #[arg(long, default_value = "cpu", help = DEVICE_HELP)]
    device: String,
    /// Samples in the dataset (an epoch).
    #[arg(long, default_value_t = 65_536)]
    samples: usize,
    #[arg(long, default_value_t = 4096)]
    batch: usize,
    /// Hidden width of the 784-h-h-10 MLP.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// The model: the MLP, or LeNet (samples reshaped to [1, 28, 28]).
    #[arg(long, default_value = "mlp")]
    arch: String,
    /// Timed rounds (each times the three ways once, back to back).
    #[arg(long, default_value_t = 9)]
    rounds: usize,
    /// Also print the profiler's table of one compute epoch, one resident epoch and one
    /// prefetch epoch (where the difference between them goes).
    #[arg(long)]
    profile: bool,
    /// The loader's `upload_bytes` (batches grouped into uploads of at least this many
    /// bytes of features; 0: one batch per upload); default: the loader's own.
    #[arg(long)]
    upload_bytes: Option<usize>,
    /// Batches (groups) the prefetching loader's worker may hold ready ahead of the training
    /// thread (`DataLoader::prefetch`); default: the loader's own.
    #[arg(long)]
    prefetch: Option<usize>,
    /// Diagnostic: the loader epochs still load every batch, but each step trains on the
    /// first batch (resident), so no step depends on a copy (what the data dependency costs).
    #[arg(long)]
    train_on_first: bool,
    /// Keep the dataset in page-locked memory (`ArrayDataset::pin`): on a GPU the device then
    /// gathers each group of batches itself, reading the rows over the bus, and the host
    /// copies nothing.
    #[arg(long)]
    pin_dataset: bool,
    /// With `--pin-dataset`: the worker copies the rows into pinned blocks, one DMA a group,
    /// instead of the GPU gathering them over the bus (`DataLoader::device_gather(false)`).
    #[arg(long)]
    host_gather: bool,
    /// Synthetic features shaped like MNIST's pixels (`byte / 255`) instead of 16-bit
    /// fractions: a pinned dataset then keeps them as bytes (`ArrayDataset::pin`).
    #[arg(long)]
    pixels: bool,
    /// Shuffle every epoch with this seed (`DataLoader::shuffle`), as training does.
    #[arg(long)]
    shuffle: Option<u64>,
    /// Diagnostic: also time compute-only epochs while another thread copies pinned 16 MiB
    /// blocks to the device at this many GB/s (the loader's bytes without the loader): what
    /// the bus traffic alone costs the step (`bus/compute`).
    #[arg(long)]
    bus_load: Option<f64>,
}

fn main() {
    let a = Args::parse();
    let device = a.device.clone();
    if let Err(e) = dispatch(&device, Overlap(a)) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Overlap(Args);

/// How an epoch gets its batches.
enum Way<'a, B: Backend> {
    /// One batch already on the device, for every step.
    Compute,
    /// The loaders' batches, from the dataset already on the device.
    Resident,
    /// From a loader (0: the synchronous one, 1: the prefetching one; indexes the sums).
    Loader(&'a mut DataLoader<B>, usize),
}

/// A thread that copies a pinned 16 MiB block to the device at a set rate while `on`.
struct BusLoad {
    on: Arc<AtomicBool>,
    alive: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Result<usize>>,
}

impl BusLoad {
    fn start<B: Backend>(dev: &B::Device, gbps: f64) -> BusLoad {
        let (on, alive) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(true)),
        );
        let (on2, alive2, dev) = (on.clone(), alive.clone(), dev.clone());
        let handle = std::thread::spawn(move || -> Result<usize> {
            let block = Arc::new(PinnedBlock::new("bus_load", 16 << 20)?);
            let period = Duration::from_secs_f64((16 << 20) as f64 / (gbps * 1e9));
            let (mut next, mut copies) = (Instant::now(), 0);
            while alive2.load(Ordering::Relaxed) {
                if !on2.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_micros(100));
                    next = Instant::now();
                    continue;
                }
                let src = HostSource {
                    bytes: block.as_bytes(),
                    pinned: true,
                    owner: Some(block.clone()),
                };
                drop(B::from_host_source(&dev, DType::F32, src)?);
                copies += 1;
                next += period;
                if let Some(d) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
            }
            Ok(copies)
        });
        BusLoad { on, alive, handle }
    }

    fn stop(self) -> Result<usize> {
        self.alive.store(false, Ordering::Relaxed);
        self.handle
            .join()
            .expect("the bus-load thread does not panic")
    }
}

impl Job for Overlap {
    fn run<B: Backend>(self, dev: B::Device) -> Result<()> {
        let a = self.0;
        let hash = |k: usize| (k as u64).wrapping_mul(2_654_435_761);
        let feats: Vec<f32> = (0..a.samples * 784)
            .map(|k| match a.pixels {
                true => (hash(k) >> 8 & 0xff) as f32 / 255.0,
                false => (hash(k) & 0xffff) as f32 / 65536.0,
            })
            .collect();
        let labels: Vec<i64> = (0..a.samples as i64).map(|i| i % 10).collect();
        let lenet = a.arch == "lenet";
        let shape: Vec<usize> = if lenet { vec![1, 28, 28] } else { vec![784] };
        // The dataset already on the device, for the `resident` epochs.
        let dims = |n: usize| [vec![n], shape.clone()].concat();
        let x_dev = Tensor::<B>::from_host(&HostBuffer::F32(feats.clone()), dims(a.samples), &dev)?;
        let y_dev = Tensor::<B>::from_host(&HostBuffer::I64(labels.clone()), [a.samples], &dev)?;
        let data = ArrayDataset::new(
            HostBuffer::F32(feats),
            [784],
            HostBuffer::I64(labels),
            Vec::<usize>::new(),
            a.samples,
        )?;
        let data = if a.pin_dataset { data.pin()? } else { data };
        let model = if lenet {
            models::lenet::<B>(&dev, &mut kiln_core::Generator::new(0))?
        } else {
            models::mlp::<B>(a.hidden, &dev, &mut kiln_core::Generator::new(0))?
        };
        let mut opt = SgdConfig::new(0.01).init(model.parameters())?;
        let mut step = |x: &kiln_core::Tensor<B>, y: &kiln_core::Tensor<B>| -> Result<()> {
            let loss = cross_entropy(
                &model.forward(&kiln_autograd::Var::constant(x.clone()))?,
                y,
                Reduction::Mean,
            )?;
            opt.zero_grad();
            loss.backward()?;
            opt.step()
        };
        let shuffled = |l: DataLoader<B>| match a.shuffle {
            Some(seed) => l.shuffle(seed),
            None => l,
        };
        let mut sync_loader = shuffled(DataLoader::<B>::new(data.clone(), a.batch, &dev)?)
            .device_gather(!a.host_gather)
            .drop_last(true)
            .prefetch(0)
            .sample_shape(shape.clone())?;
        let probe = data.clone();
        let mut pre_loader = shuffled(DataLoader::<B>::new(data, a.batch, &dev)?)
            .device_gather(!a.host_gather)
            .drop_last(true)
            .sample_shape(shape)?;
        if let Some(bytes) = a.upload_bytes {
            pre_loader = pre_loader.upload_bytes(bytes);
        }
        if let Some(n) = a.prefetch {
            pre_loader = pre_loader.prefetch(n.max(1));
        }
        let steps = sync_loader.num_batches();
        let (x0, y0) = sync_loader.iter().next().expect("at least one batch")?;
        // Host time the training thread spends in the loader's `next()` and in dropping a
        // used batch (both included in the epoch's time), summed over the timed epochs.
        let (mut next_s, mut drop_s, mut loaded) = ([0f64; 2], [0f64; 2], [0usize; 2]);
        let (mut wait_s, mut upload_s, mut uploads) = (0f64, 0f64, 0usize);
        // `timed`: the warm-up and profiled epochs are left out of these sums (their first
        // uploads grow the device and pinned pools: milliseconds that once made a 16 MiB
        // group's upload look 7 times as costly as in steady state).
        let mut resident_epoch = 0u64;
        let mut epoch = |way: Way<'_, B>, timed: bool| -> Result<f64> {
            B::synchronize(&dev)?;
            let t = Instant::now();
            match way {
                Way::Resident => {
                    let n = steps * a.batch;
                    // The epoch's order, uploaded once (the loaders' permutation).
                    let order = match a.shuffle {
                        Some(seed) => {
                            let p = kiln_data::permutation(a.samples, seed, resident_epoch);
                            let p = p.into_iter().take(n).map(|i| i as i64).collect();
                            Some(Tensor::<B>::from_host(&HostBuffer::I64(p), [n], &dev)?)
                        }
                        None => None,
                    };
                    resident_epoch += 1;
                    for k in 0..steps {
                        let (x, y) = match &order {
                            Some(order) => {
                                let ids = order.narrow(0, k * a.batch, a.batch)?;
                                (x_dev.index_select(0, &ids)?, y_dev.index_select(0, &ids)?)
                            }
                            None => (
                                x_dev.narrow(0, k * a.batch, a.batch)?,
                                y_dev.narrow(0, k * a.batch, a.batch)?,
                            ),
                        };
                        step(&x, &y)?;
                    }
                }
                Way::Loader(l, k) => {
                    let mut it = l.iter();
                    loop {
                        let t0 = Instant::now();
                        let Some(b) = it.next() else { break };
                        let next_took = t0.elapsed().as_secs_f64();
                        let (x, y) = b?;
                        if a.train_on_first {
                            step(&x0, &y0)?;
                        } else {
                            step(&x, &y)?;
                        }
                        let t0 = Instant::now();
                        drop((x, y));
                        if timed {
                            next_s[k] += next_took;
                            drop_s[k] += t0.elapsed().as_secs_f64();
                            loaded[k] += 1;
                        }
                    }
                    // The prefetching loader's times only: with a pinned dataset the
                    // `prefetch(0)` loader launches gathers too.
                    if timed && k == 1 {
                        let times = it.times();
                        wait_s += times.waiting.as_secs_f64();
                        upload_s += times.uploading.as_secs_f64();
                        uploads += times.uploads;
                    }
                }
                Way::Compute => {
                    for _ in 0..steps {
                        step(&x0, &y0)?;
                    }
                }
            }
            B::synchronize(&dev)?;
            Ok(t.elapsed().as_secs_f64() * 1e3 / steps as f64)
        };
        // warm-up: kernels, allocator pools, pinned staging
        epoch(Way::Compute, false)?;
        epoch(Way::Loader(&mut sync_loader, 0), false)?;
        epoch(Way::Loader(&mut pre_loader, 1), false)?;
        epoch(Way::Resident, false)?;
        if a.profile {
            let (r, prof) = kiln_core::profile::profile(|| epoch(Way::Compute, false));
            r?;
            println!(
                "== profile of a compute epoch ({steps} steps)\n{}",
                prof.table()
            );
            let (r, prof) = kiln_core::profile::profile(|| epoch(Way::Resident, false));
            r?;
            println!(
                "== profile of a resident epoch ({steps} steps)\n{}",
                prof.table()
            );
            let (r, prof) =
                kiln_core::profile::profile(|| epoch(Way::Loader(&mut pre_loader, 1), false));
            r?;
            println!(
                "== profile of a prefetch epoch ({steps} steps)\n{}",
                prof.table()
            );
        }
        let bus = a.bus_load.map(|gbps| BusLoad::start::<B>(&dev, gbps));
        let (mut c, mut s, mut p, mut with_bus) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut r = Vec::new();
        for _ in 0..a.rounds {
            s.push(epoch(Way::Loader(&mut sync_loader, 0), true)?);
            c.push(epoch(Way::Compute, true)?);
            r.push(epoch(Way::Resident, true)?);
            p.push(epoch(Way::Loader(&mut pre_loader, 1), true)?);
            if let Some(bus) = &bus {
                bus.on.store(true, Ordering::Relaxed);
                let ms = epoch(Way::Compute, true);
                bus.on.store(false, Ordering::Relaxed);
                with_bus.push(ms? / c.last().expect("pushed above"));
            }
        }
        if let Some(bus) = bus {
            let copies = bus.stop()?;
            with_bus.sort_by(f64::total_cmp);
            println!(
                "loader_overlap bus/compute={:.3} ({copies} background copies of 16 MiB)",
                with_bus[with_bus.len() / 2]
            );
        }
        let med = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        // The overlap figure pairs each round's prefetch epoch with the compute epoch just
        // before it, so drift between rounds (clocks, other load on the host) cancels.
        let us = |s: [f64; 2], k: usize| s[k] * 1e6 / loaded[k].max(1) as f64;
        let next_us = [us(next_s, 0), us(next_s, 1)];
        let drop_us = [us(drop_s, 0), us(drop_s, 1)];
        let (wait_us, upload_us) = (us([0.0, wait_s], 1), us([0.0, upload_s], 1));
        let per = loaded[1] as f64 / uploads.max(1) as f64;
        let ratios: Vec<f64> = p.iter().zip(&c).map(|(p, c)| p / c).collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), &r| (l.min(r), h.max(r)));
        let ratio = med(ratios);
        let mut by_res: Vec<f64> = p.iter().zip(&r).map(|(p, r)| p / r).collect();
        by_res.sort_by(f64::total_cmp);
        let (rlo, rhi) = (by_res[0], by_res[by_res.len() - 1]);
        let res_ratio = med(by_res);
        let (c, s, p, r) = (med(c), med(s), med(p), med(r));
        // Where one batch's data movement goes: loading alone (gather + upload, no step) and
        // the host gather alone.
        B::synchronize(&dev)?;
        let t = Instant::now();
        for b in sync_loader.iter() {
            drop(b?);
        }
        B::synchronize(&dev)?;
        let load = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let idx: Vec<usize> = (0..a.batch).collect();
        let (mut fb, mut lb) = (vec![0u8; a.batch * 784 * 4], vec![0u8; a.batch * 8]);
        let t = Instant::now();
        for _ in 0..steps {
            kiln_data::Dataset::get_batch_into(&probe, &idx, &mut fb, &mut lb)?;
        }
        let gather = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let mb = (a.batch * 784 * 4) as f64 / 1e6;
        // The share of the data movement (sync - compute) that prefetching hides.
        let hidden = if s > c * 1.001 {
            format!("{:.0}%", 100.0 * (s - p) / (s - c))
        } else {
            "n/a (no data-movement cost to hide)".to_string()
        };
        let model_name = if a.arch == "lenet" {
            "lenet".to_string()
        } else {
            format!("mlp-784-{h}-{h}-10", h = a.hidden)
        };
        println!(
            "loader_overlap {dev} batch={} ({mb:.1} MB of f32 features) model={model_name} pinned_dataset={} device_gather={} pixels={} shuffle={} steps={steps} \
             ms_per_step: compute={c:.3} resident={r:.3} sync={s:.3} prefetch={p:.3} prefetch/compute={ratio:.3} (rounds {rounds}: {lo:.3}..{hi:.3}) \
             prefetch/resident={res_ratio:.3} ({rlo:.3}..{rhi:.3}) hidden={hidden} load_only={load:.3} gather_only={gather:.3} \
             host_us_per_batch: prefetch next={:.1} (waiting {wait_us:.1}, uploading {upload_us:.1}; {per:.1} batches per upload) drop={:.1} sync next={:.1} drop={:.1}",
            a.batch,
            a.pin_dataset,
            !a.host_gather,
            a.pixels,
            a.shuffle.is_some(),
            next_us[1],
            drop_us[1],
            next_us[0],
            drop_us[0],
            rounds = a.rounds,
        );
        Ok(())
    }
}

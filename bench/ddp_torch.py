"""PyTorch DDP twin of kiln's data_parallel benchmark (issue 12).

MLP 784-4096-4096-4096-10, global batch 8192, SGD (lr 0.1), f32 with TF32 off, fixed synthetic
data, NCCL, one process per GPU. Run under torchrun:

    torchrun --nproc_per_node 2 bench/ddp_torch.py [--steps 20 --warmup 5]

In the same run it first measures one GPU (rank 0 alone, no DDP, the whole global batch) while
the other ranks wait, then every rank together under DDP (global batch split evenly). Prints
`torch data_parallel mode=single gpus=1 ...` and `torch data_parallel mode=ddp gpus=N ...`
lines with step_ms and samples_per_s, in kiln's format.
"""

import argparse
import os
import time

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
             ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp():
    return nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))


def timed(model, x, y, steps, warmup, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=8192)
    p.add_argument("--lr", type=float, default=0.1)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    except TypeError:  # PyTorch < 2.3
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)
    gb = a.global_batch
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(gb, 784, device=dev, generator=g)
    y = torch.randint(0, 10, (gb,), device=dev, generator=g)
    if rank == 0:
        torch.manual_seed(0)
        s = timed(mlp().to(dev), x, y, a.steps, a.warmup, a.lr)
        print(f"torch data_parallel mode=single model=Big gpus=1 global_batch={gb} "
              f"step_ms={s * 1e3:.3f} samples_per_s={gb / s:.0f}", flush=True)
    dist.barrier()
    torch.manual_seed(0)
    model = DDP(mlp().to(dev), device_ids=[local])
    lb = gb // world
    s = timed(model, x[rank * lb:(rank + 1) * lb], y[rank * lb:(rank + 1) * lb], a.steps,
              a.warmup, a.lr)
    t = torch.tensor([s], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    s = t.item()
    if rank == 0:
        print(f"torch data_parallel mode=ddp model=Big gpus={world} global_batch={gb} "
              f"step_ms={s * 1e3:.3f} samples_per_s={gb / s:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

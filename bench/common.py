"""
What the benchmark scripts share: where a run may happen, how it is timed, what its results file records
and where it goes, and the random-weight model with calibrated routers that the end-to-end and serving
benchmarks both run.

    bench/ops.py, bench/tune.py       one op at a time (bench/cases.py: kernel shapes, block sizes)
    bench/e2e.py, bench/serving.py    a whole model (random_model below) through engine.Engine
    research/mask_union.py            trained routers on held-out text (save only)

Every benchmark has a --smoke mode: the same code on tiny fp32 shapes on the CPU, the kernels in the
Triton interpreter (TRITON_INTERPRET=1). It runs every check, row builder and results writer; its times
mean nothing, and it never writes under results/ (out_prefix).
"""
import argparse
import datetime
import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch
import triton

import cli
import engine
import kernels_base
import wide
from model import ModelConfig, Transformer, rope_frequencies
from policy import Policy

COPY_GBS, MATMUL_TFLOPS = 4220, 692  # measured H200 ceilings: device-to-device copy, bf16 matmul 8192^3


# ----------------------------------------------------------------------------------- where a run happens
def parser(doc, script, results):
    """A benchmark's command line (script: "-m bench.NAME"): its own flags go on top of --out and --smoke."""
    p = cli.parser(doc, prog=script)
    p.add_argument("--out", default=None, help=f"output path prefix for .json/.md (default results/{results}; "
                   "--smoke: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU under TRITON_INTERPRET=1: "
                   "runs every check, row builder and writer; times nothing meaningful")
    return p


def prepare(args, script, argv, results):
    """After the flags are parsed and checked: can the run happen here, where do its results go (args.out),
    and one seed for every benchmark's random inputs."""
    need_device(args.smoke, script, argv)
    args.out = out_prefix(args, results)
    cli.writable_dir(os.path.dirname(args.out) or ".", "--out")
    torch.manual_seed(0)


def need_device(smoke, script, argv):
    """One clear line when the run cannot happen here. Called after the flags are parsed (so a bad flag
    is what the user hears about first, on any machine), before anything is built."""
    if smoke and not kernels_base.INTERPRET:
        cli.fail(f"--smoke runs the kernels in the Triton interpreter: TRITON_INTERPRET=1 python {script} "
                 f"{' '.join(argv)}")
    if not smoke and kernels_base.INTERPRET:
        cli.fail("TRITON_INTERPRET=1 is set, so the kernels would run in the interpreter: unset it, or add --smoke")
    if not smoke and not torch.cuda.is_available():
        cli.fail(f"python {script} times kernels on a CUDA GPU; on a CPU, check that the code runs with "
                 f"TRITON_INTERPRET=1 python {script} --smoke")


def out_prefix(args, default):
    """Where results go: results/<default> on a GPU; a fresh temporary folder with --smoke, never results/."""
    if not args.smoke:
        return args.out or os.path.join("results", default)
    if args.out and os.path.abspath(args.out).startswith(os.path.abspath("results") + os.sep):
        cli.fail("--smoke never writes under results/; leave --out out or point it elsewhere")
    return args.out or os.path.join(tempfile.mkdtemp(prefix="wide-smoke-"), default)


# ----------------------------------------------------------------------------------- what a results file records
def meta(smoke, script, argv, **more):
    """What every results file records: GPU, versions, date, the exact command."""
    gpu = "CPU (--smoke, Triton interpreter: times are meaningless)" if smoke else torch.cuda.get_device_name()
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(["python", script] + list(argv)), smoke=smoke, **more)


def save(prefix, data, markdown):
    """prefix.json (the numbers) and prefix.md (the table a reader opens)."""
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(prefix + ".md", "w") as f:
        f.write(markdown)


# ----------------------------------------------------------------------------------- timing
def bench_ms(smoke, fn):
    """Median ms of fn(): do_bench on the GPU (L2 flushed between repetitions); --smoke: one call."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(smoke, fns, reps=20):
    """ms per call of fns[0..n-1] (each on its own copy of the data), captured in one CUDA graph and
    replayed `reps` times after a warm-up outside the graph (Triton compiles, cuBLAS picks kernels).
    Under do_bench a microsecond kernel mostly measures its host launch; a replay does not.
    --smoke: the same calls eagerly, once."""
    if smoke:
        t = time.perf_counter()
        [f() for f in fns]
        return (time.perf_counter() - t) * 1e3 / len(fns)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        [f() for f in fns]
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        [f() for f in fns]
    g.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    [g.replay() for _ in range(reps)]
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps / len(fns)


def clock_ms(smoke, fn, n):
    """ms per call of fn(n) doing n steps: CUDA events on the GPU (no host sync inside the n steps), the
    CPU clock with --smoke."""
    if smoke:
        t = time.perf_counter()
        fn(n)
        return (time.perf_counter() - t) * 1e3 / n
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    fn(n)
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / n


# ----------------------------------------------------------------------------------- the benchmarks' model
@dataclass
class ModelSetup:
    """The model a whole-model benchmark runs: a preset's shape (or `config`, ModelConfig fields) with
    random weights and WIDE routers whose skip biases are calibrated on a random prompt. The Llama-3.1-8B
    shape in bf16 on the GPU; --smoke: SMOKE's tiny fp32 model on the CPU."""
    preset: str = "llama-3.1-8b"
    config: dict = None
    ffn_group_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    smoke: bool = False
    calibrate_tokens: int = 1024


# What every --smoke model run changes (with its own tiny `config`): fp32 on the CPU, FFN groups of 32.
SMOKE = dict(ffn_group_size=32, dtype=torch.float32, device="cpu", smoke=True)


def random_model(run, preset=None, max_seq_len=None):
    """A preset's shape (or run.config) with random weights (std 0.02) and WIDE routers: (model, wcfg).
    Built on the meta device and filled in place, so an 8B shape never exists twice in memory."""
    cfg = ModelConfig(**run.config) if run.config and not preset else ModelConfig.from_name(preset or run.preset)
    cfg.max_seq_len = max_seq_len or cfg.max_seq_len
    torch.set_default_dtype(run.dtype)
    try:
        with torch.device("meta"):
            m = Transformer(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    m.to_empty(device=run.device)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    m.inv_freq = rope_frequencies(cfg).to(run.device)
    gs = run.ffn_group_size if cfg.intermediate_size % run.ffn_group_size == 0 else 32
    wcfg = wide.WideConfig(ffn_group_size=gs)  # attention groups: one KV head's query heads
    wide.install_routers(m, wcfg)              # routers stay fp32
    return m.eval(), wcfg


@torch.no_grad()
def calibrate_routers(m, sparsity, tokens, passes=2):
    """Shift each group's skip-logit bias so that the group skips `sparsity` of a random prompt's tokens
    (the reference forward, model.py). Only the biases move. Two passes, since the later layers see
    what the earlier layers' masks did."""
    routers = list(wide.routers(m))
    idx = torch.randint(0, m.config.vocab_size, (1, min(tokens, m.config.max_seq_len)),
                        device=m.embed_tokens.weight.device)
    for _ in range(passes):
        seen = {}
        hooks = [r.register_forward_hook(lambda mod, a, out: seen.__setitem__(mod, a[0])) for r in routers]
        m(idx)
        for h in hooks:
            h.remove()
        for r, x in seen.items():
            z = r.logits(x).reshape(-1, r.n_groups, 2).float()
            d = z[..., 1] - z[..., 0]  # skip iff d > 0
            r.up.bias.view(-1, 2)[:, 1] -= torch.quantile(d, 1 - sparsity, dim=0)


def set_profile(m, routers, attn, ffn, tokens):
    """Calibrate the routers to skip `attn` of the attention groups and `ffn` of the FFN groups on a
    random prompt (one router type at a time: the other type is removed while one is calibrated, so the
    two interact only through that)."""
    for kind, s in (("attn", attn), ("ffn", ffn)):
        for layer, (a, f, _) in zip(m.layers, routers):
            layer.attn_router, layer.ffn_router = (a, None) if kind == "attn" else (None, f)
        calibrate_routers(m, s, tokens)
    wide.routers_on(m, routers)


def fill_cache(m, context):
    # As if a prompt of `context` tokens had been prefilled; the same values for every engine timed (a seeded
    # generator), so that their routers see the same states.
    gen = torch.Generator(m.layers[0].self_attn.kv_cache.k_cache.device).manual_seed(context)
    for layer in m.layers:
        c = layer.self_attn.kv_cache
        c.k_cache[:, :, :context].normal_(generator=gen)
        c.v_cache[:, :, :context].normal_(generator=gen)


def with_engine(m, routers, policy, fn, weights="bf16"):
    """fn(engine) with the routers on (WIDE) or off (dense); one engine alive at a time."""
    saved = None if routers else wide.routers_off(m)
    try:
        return fn(engine.Engine(m, policy, weights))
    finally:
        if saved is not None:
            wide.routers_on(m, saved)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def mask_summary(masks, batch):
    """A decode step's masks (float [B, 1, G] per layer, as CUDAGraphDecoder.masks holds them): the share
    of groups skipped, and the share live in the batch's union, for attention and FFN; None if no routers."""
    if not masks:
        return None
    out = {f"{k}_skip": round(1 - torch.stack([x.float().mean() for x in masks[k]]).mean().item(), 4) for k in masks}
    out.update({f"{k}_union_live": round(torch.stack([x.reshape(batch, -1).float().amax(0).mean()
                                                      for x in masks[k]]).mean().item(), 4) for k in masks})
    return out


def policy_of(text):
    """--policy NAME=VALUE,...: Policy fields other than their defaults."""
    def value(name, v):  # the field's own type; a bool from true / false (bool("false") would be True)
        kind = type(getattr(Policy(), name))
        if kind is bool and v.lower() not in ("true", "false"):
            raise ValueError(f"{name} is true or false")
        return v.lower() == "true" if kind is bool else kind(v)

    try:
        fields = dict(kv.split("=") for kv in text.split(","))
        return Policy(**{k: value(k, v) for k, v in fields.items()})
    except (ValueError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: give Policy fields as NAME=VALUE,..., e.g. "
                                         f"router_max_tokens=4096 ({e})")

"""
The quality table: held-out perplexity of every method on the held-out plays, next to the sparsity the
routers realized there and the fraction of linear-layer FLOPs executed, and again at matched FLOPs.

    python eval.py   # reads out/, writes results/quality.json, results/quality.md and results/quality.png
    python eval.py --out-dir out-gpu --name quality_gpu   # the GPU-budget models (train.py --recipe gpu)
    python eval.py --model smollm2  # SmolLM2-135M's (train.py --model smollm2) -> results/quality_smollm2.*

Rows: dense (out/base); wide, stages 1 and 2 of every target trained under out/, each with its own dial;
wide dial, the stage-2 routers of --dial-from dialled to other sparsities (--dial); layerskip; static and
teal, the training-free baselines (baselines.py); shared, batch-shared FFN routing of B held-out windows
decoding side by side (BatchShared); serving, bench/serving.py's profiles per token and under the batch
rule (-> results/quality_serving.*; alone with --serving-only); fp8, dense and WIDE with the prunable
linears rounded to e4m3 as engine.Engine(weights="fp8") serves them. Routing is deterministic throughout.
"""
import argparse
import copy
import inspect
import datetime
import json
import math
import os
import sys
from statistics import fmean as mean

import torch

import baselines
import cli
import data
import dial
import kernels
import wide
from checkpoints import load_dialled, load_wide, router_checkpoints
from engine import fp8_model

DIAL_RULE = inspect.signature(load_dialled).parameters["rule"].default  # the rule generate.py's dial uses
from model import Transformer, load_tokenizer


@torch.no_grad()
def score(model, x, y, args):
    """(perplexity over every held-out token, {kind: [skip rate of each layer]}) with deterministic routing."""
    model.eval()
    total, count, per_layer = 0.0, 0, {}
    for i in range(0, len(x), args.batch_size):
        xb, yb = x[i:i + args.batch_size].to(args.device), y[i:i + args.batch_size].to(args.device)
        masks = {}
        _, loss = model(xb, yb, masks=masks)
        total += loss.item() * yb.numel()
        count += yb.numel()
        for kind, layers in masks.items():
            acc = per_layer.setdefault(kind, [0.0] * len(layers))
            for l, keep in enumerate(layers):
                acc[l] += (1 - keep.float().mean().item()) * yb.numel()
    return math.exp(total / count), {k: [v / count for v in acc] for k, acc in per_layer.items()}


def row(method, stage, target, ppl, attn, ffn, flops, **extra):
    """attn, ffn: per-layer skip rates (lists) or one rate for every layer."""
    mean = lambda v: sum(v) / len(v) if isinstance(v, list) else v
    r = dict(method=method, stage=stage, target_sparsity=target, val_ppl=round(ppl, 3),
             attn_sparsity=round(mean(attn), 4), ffn_sparsity=round(mean(ffn), 4),
             linear_flop_fraction=round(flops, 4))
    if isinstance(attn, list):
        r.update(attn_per_layer=[round(a, 4) for a in attn], ffn_per_layer=[round(f, 4) for f in ffn])
    r.update(extra)
    return r


def realized(r):
    """The realized counterpart of a row's target: the mean of attention and FFN (or the layer) skip rate."""
    return r["attn_sparsity"] if r["method"] == "layerskip" else 0.5 * (r["attn_sparsity"] + r["ffn_sparsity"])


def model_row(model, wcfg, x, y, args, method, target, **extra):
    ppl, rates = score(model, x, y, args)
    if wcfg.method == "layerskip":
        r = rates["layer"]
        flops = wide.flop_fraction(model.config, wcfg, None, None, [1 - v for v in r])
        return row("layerskip", wcfg.stage, target, ppl, r, r, flops, **extra)
    ra, rf = rates["attn"], rates["ffn"]
    flops = wide.flop_fraction(model.config, wcfg, [1 - v for v in ra], [1 - v for v in rf])
    return row(method, wcfg.stage, target, ppl, ra, rf, flops, **extra)


def router_rows(args, x, y):
    rows, group_cfg = [], None
    for path, *_ in router_checkpoints(args.out_dir):
        model, wcfg = load_wide(path, device=args.device)  # with the dial of its own target
        extra = dict(checkpoint=path, dialled=bool(wcfg.offsets))
        if wcfg.attn_target is not None:
            extra.update(attn_target=wcfg.attn_target, ffn_target=wcfg.ffn_target)
        rows.append(model_row(model, wcfg, x, y, args, wcfg.method, wide.trained_target(wcfg), **extra))
        if wcfg.method == "wide" and group_cfg is None:
            group_cfg = wcfg  # the group sizes the static baseline uses
        print(f"{path}: ppl {rows[-1]['val_ppl']:.2f}, realized {realized(rows[-1]):.3f}, "
              f"flops {rows[-1]['linear_flop_fraction']:.3f}", flush=True)
    return rows, group_cfg


def dial_rows(args, x, y, path, targets, rules, method):
    """Router checkpoint `path` dialled to each target under each rule; method(rule) names the rows."""
    rows = []
    if not os.path.isfile(os.path.join(path, "wide.json")):
        print(f"{path}: not trained, no dial rows", flush=True)
        return rows
    for rule in rules:
        for s in targets:
            model, wcfg, got = load_dialled(path, target=s, windows=data.dial_windows, device=args.device,
                                            block_size=args.block_size, rule=rule)
            rows.append(model_row(model, wcfg, x, y, args, method(rule), s, checkpoint=path,
                                  trained_target=wide.trained_target(wcfg), offsets=got["offsets"], dial_rule=rule))
            print(f"{path} dialled to {s:g} ({rule}): ppl {rows[-1]['val_ppl']:.2f}, realized "
                  f"{realized(rows[-1]):.3f}, flops {rows[-1]['linear_flop_fraction']:.3f}", flush=True)
    return rows


def fp8_rows(args, x, y, calib):
    """Dense and WIDE (--dial-from) in their dtype and both fp8 schemes (engine.fp8_model: "fp8" weights, "w8a8" also
    the inputs), codes rounded to nearest or by GPTQ on the calib batches (kernels.calibrate_fp8, the model's forward)."""
    rows, mean_rate = [], lambda rates: round(sum(map(mean, rates.values())) / max(1, len(rates)), 4)
    loaders = [("dense", lambda: base_model(args))]
    if os.path.isfile(os.path.join(args.dial_from, "wide.json")):
        loaders.append(("wide", lambda: load_wide(args.dial_from, device=args.device)[0]))
    for method, load in loaders:
        model = load()
        (own, rates), dtype = score(model, x, y, args), str(next(model.parameters()).dtype)[6:]
        for rounding in ("nearest", "gptq"):
            r = dict(method=method, checkpoint=args.dial_from if method == "wide" else "base", rounding=rounding,
                     dtype=dtype, val_ppl=round(own, 3), realized=mean_rate(rates))
            calibrated = kernels.calibrate_fp8(load(), calib) if rounding == "gptq" else None
            for activations, prefix in ((False, "fp8_"), (True, "w8a8_")):
                m = load() if calibrated is None else copy.deepcopy(calibrated)
                ppl, got = score(fp8_model(m, activations), x, y, args)
                r.update({prefix + "val_ppl": round(ppl, 3), prefix + "realized": mean_rate(got),
                          prefix + "vs_model": round(ppl / own, 4)})
            rows.append(r)
            print(f"{method}, {rounding}: ppl {own:.2f}, fp8 {r['fp8_val_ppl']:.2f}, w8a8 {r['w8a8_val_ppl']:.2f}", flush=True)
    return rows


class BatchShared(torch.nn.Module):
    """An FFN router shared by a decode batch. B sequences decode side by side (here B held-out windows,
    one position at a time) and a channel group runs for all B tokens of a position iff at least k of
    their routers want it. k = 1 is the union: no token loses a group it wanted, some run groups they
    would skip, and the batch reads every group any token wants (nearly all of them, results/mask_union.md).
    Larger k lets the batch skip the groups few tokens want: fewer weight bytes per decode step, at
    the quality cost eval.py measures."""

    def __init__(self, router, batch, k):
        super().__init__()
        self.router, self.batch, self.k = router, batch, k

    def forward(self, h):
        keep = self.router(h)  # [B_all, T, G]: consecutive rows of B_all form the decode batches
        return torch.cat([(c.sum(0, keepdim=True) >= self.k).to(c.dtype).expand_as(c) for c in keep.split(self.batch)])


def shared_rows(args, x, y):
    """Per-token routing against batch-shared FFN routing (BatchShared) for each batch size and k."""
    rows = []
    if not args.shared_batch:  # --shared-batch with no sizes: no such rows
        return rows
    # Batches of unrelated windows, every batch full (the remainder windows are left out of these rows).
    n = len(x) // math.lcm(*args.shared_batch) * math.lcm(*args.shared_batch) if args.shared_batch else 0
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:n]
    x, y = x[perm], y[perm]
    for path in (args.dial_from, os.path.join(args.out_dir, "wide-a0.75-f0.25-stage2")):
        if not os.path.isfile(os.path.join(path, "wide.json")):
            continue
        model, _ = load_wide(path, device=args.device)
        own, rates = score(model, x, y, args)
        base = dict(checkpoint=path, per_token_ppl=round(own, 3), per_token_ffn_skip=round(mean(rates["ffn"]), 4))
        routers = [layer.ffn_router for layer in model.layers]
        try:
            for B in args.shared_batch:
                for k in sorted({1, 2, B // 4, B // 2} - {0}):
                    for layer, r in zip(model.layers, routers):
                        layer.ffn_router = BatchShared(r, B, k)
                    sized = argparse.Namespace(**dict(vars(args), batch_size=max(1, args.batch_size // B) * B))
                    ppl, rates = score(model, x, y, sized)
                    rows.append(dict(base, batch=B, k=k, val_ppl=round(ppl, 3), vs_per_token=round(ppl / own, 4),
                                     ffn_live_in_batch=round(1 - mean(rates["ffn"]), 4), windows=n))
                    print(f"{path} batch-shared FFN routing, batch {B}, k {k}: ppl {ppl:.2f} ({own:.2f} per token), "
                          f"FFN groups run {rows[-1]['ffn_live_in_batch']:.1%}", flush=True)
        finally:
            for layer, r in zip(model.layers, routers):
                layer.ffn_router = r
    return rows


def serving_rows(args, x, y, dense_ppl):
    """The quality of bench/serving.py's router profiles, WIDE 50/50 and 75/25, taken as the routers trained
    at those targets (OUT/wide-s0.5-stage2, OUT/wide-a0.75-f0.25-stage2), each two ways: per-token routing
    (a prompt token, and a token decoded in a step of at most wide.FFNRule's max_rows rows) and under
    the batch rule for FFN width (a token decoded in a step of more rows: its FFN runs whole, its attention
    stays routed). A served request mixes the two by its batch sizes."""
    rows = [dict(profile="dense", attn=0.0, ffn=0.0, ffn_rule="-", val_ppl=round(dense_ppl, 3), ppl_vs_dense=1.0)]
    for name, path, (a, f) in (("50/50", args.dial_from, (0.5, 0.5)),
                               ("75/25", os.path.join(args.out_dir, "wide-a0.75-f0.25-stage2"), (0.75, 0.25))):
        if not os.path.isfile(os.path.join(path, "wide.json")):
            print(f"{path}: not trained, no serving rows for WIDE {name}", flush=True)
            continue
        model, _ = load_wide(path, device=args.device)
        for rule in ("per token", "dense at decode"):
            if rule == "dense at decode":  # what the batch rule runs: no FFN router asked
                for layer in model.layers:
                    layer.ffn_router = None
            ppl, rates = score(model, x, y, args)
            rows.append(dict(profile=name, attn=a, ffn=f, ffn_rule=rule, checkpoint=path, val_ppl=round(ppl, 3),
                             ppl_vs_dense=round(ppl / dense_ppl, 4), attn_skip=round(mean(rates["attn"]), 4),
                             ffn_skip=round(mean(rates.get("ffn", [0.0])), 4)))
            print(f"WIDE {name}, {rule}: ppl {ppl:.2f} ({rows[-1]['ppl_vs_dense']:.3f}x dense)", flush=True)
    return rows


def serving_markdown(rows, meta):
    out = [f"# Perplexity of the serving profiles ({meta['device']}, torch {meta['torch']}, {meta['date']})", "",
           f"`{meta['command']}` on the held-out plays ({meta['held_out_tokens']} tokens, windows of "
           f"{meta['block_size']}). 'per token': the routers decide every group; 'dense at decode': the batch rule "
           "for FFN width (a decode step of more than 4 rows runs the whole FFN, attention stays routed). "
           "bench/serving.py's WIDE 50/50 and 75/25 profiles are these routers' targets.", "",
           "| profile | FFN rule | val ppl | ppl / dense | attn skipped | FFN skipped |", "|---|---|---|---|---|---|"]
    out += [f"| {r['profile']} | {r['ffn_rule']} | {r['val_ppl']:.2f} | {r['ppl_vs_dense']:.3f} | "
            f"{r.get('attn_skip', 0):.1%} | {r.get('ffn_skip', 0):.1%} |" for r in rows]
    return "\n".join(out) + "\n"


def base_model(args):
    return Transformer.from_pretrained(os.path.join(args.out_dir, "base"), device=args.device)


def static_row(args, x, y, calib, target, group_cfg):
    model = base_model(args)
    wcfg = wide.WideConfig(target=target, attn_group_size=group_cfg.attn_group_size,
                           ffn_group_size=group_cfg.ffn_group_size)
    baselines.calibrate_static_width(model, wcfg, calib)
    ppl, rates = score(model, x, y, args)
    flops = baselines.static_flop_fraction(model.config, wcfg, target)  # a fixed mask: no router FLOPs
    return row("static", 0, round(target, 4), ppl, rates["attn"], rates["ffn"], flops)


def teal_row(args, x, y, calib, target):
    model = base_model(args)
    baselines.calibrate_teal(model, target, calib)
    ppl, _ = score(model, x, y, args)
    share = lambda names: [getattr(getattr(l, p), n) for l in model.layers for p, n in wide.LORA_TARGETS if n in names]
    zeroed = lambda mods: sum(m.zeroed for m in mods) / max(1, sum(m.total for m in mods))
    return row("teal", 0, round(target, 4), ppl, zeroed(share(("q_proj", "k_proj", "v_proj", "o_proj"))),
               zeroed(share(("gate_proj", "up_proj", "down_proj"))), baselines.teal_flop_fraction(model))


def interpolate(points, f):
    """log-perplexity at FLOP fraction f, linear between the two nearest measured points (or None)."""
    points = sorted(points)
    for (f0, p0), (f1, p1) in zip(points, points[1:]):
        if f0 <= f <= f1:
            t = 0.0 if f1 == f0 else (f - f0) / (f1 - f0)
            return math.exp((1 - t) * math.log(p0) + t * math.log(p1))
    return None


def solve_target(flops_at, f_goal, lo=0.0, hi=0.95, iters=20):
    """The target at which flops_at(target) (decreasing in target) comes closest to f_goal (bisection)."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if flops_at(mid) > f_goal:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def bracket(steps, f):
    """The two adjacent (target, flops) steps (decreasing flops) with flops on either side of f."""
    for hi, lo in zip(steps, steps[1:]):
        if lo[1] <= f <= hi[1]:
            return [hi, lo]
    return [min(steps, key=lambda s: abs(s[1] - f))]


def matched_entry(w, f, rows, dense_ppl, static_at, teal_at, static_steps, cfg):
    """At WIDE row w's executed FLOPs f: layer-skip interpolated between its trained targets; static width
    interpolated between the two whole-group steps around f; TEAL solved for f, corrected once by the FLOPs
    it realized, and interpolated between those two measurements. Every baseline's own FLOPs are kept."""
    entry = dict(wide_method=w["method"], wide_stage=w["stage"], wide_target=w["target_sparsity"],
                 linear_flop_fraction=f, wide_ppl=w["val_ppl"])
    if "attn_target" in w:  # separate targets: label the row by them, not by their mean
        entry.update(attn_target=w["attn_target"], ffn_target=w["ffn_target"])
    ls = [(r["linear_flop_fraction"], r["val_ppl"]) for r in rows
          if r["method"] == "layerskip" and r["stage"] == max(1, w["stage"])]
    entry["layerskip_ppl"] = interpolate(ls, f)
    st = [static_at(t) for t, _ in bracket(static_steps, f)]
    entry["static_points"] = [(r["linear_flop_fraction"], r["val_ppl"]) for r in st]
    entry["static_ppl"] = interpolate(entry["static_points"], f) if len(st) == 2 else None
    t1 = solve_target(lambda t: baselines.teal_nominal_flop_fraction(cfg, t), f)
    first = teal_at(t1)
    slope = baselines.teal_nominal_flop_fraction(cfg, 1.0) - 1.0  # d flops / d target
    second = teal_at(min(0.95, max(0.0, t1 + (f - first["linear_flop_fraction"]) / slope)))
    entry["teal_points"] = [(r["linear_flop_fraction"], r["val_ppl"]) for r in (first, second)]
    entry["teal_ppl"] = interpolate(entry["teal_points"], f)
    if entry["teal_ppl"] is None:  # both on one side: the nearer measurement, at its own FLOPs
        entry["teal_ppl"] = min(entry["teal_points"], key=lambda p: abs(p[0] - f))[1]
    if entry["layerskip_ppl"] is not None:
        gap_w, gap_l = w["val_ppl"] - dense_ppl, entry["layerskip_ppl"] - dense_ppl
        entry["gap_ratio"] = round(gap_w / gap_l, 3) if gap_l > 0 else None
    return entry


def parser():
    count = cli.integer(1)  # every number is checked as it is read: a bad one is one line
    p = cli.parser(__doc__)
    p.add_argument("--out-dir", default="out")
    p.add_argument("--results", default="results")
    p.add_argument("--name", default="quality", help="the results files: RESULTS/NAME.{json,md,png} and "
                   "RESULTS/NAME_serving.{json,md}")
    p.add_argument("--block-size", type=count, default=128)
    p.add_argument("--batch-size", type=count, default=32)
    p.add_argument("--calib-batches", type=count, default=8, help="training batches to calibrate baselines on")
    p.add_argument("--dial-from", default=None, help="router checkpoint to dial (default OUT/wide-s0.5-stage2)")
    p.add_argument("--dial", type=cli.fraction(), nargs="*", default=[0.25, 0.4, 0.6, 0.75],
                   help="sparsities to dial it to")
    p.add_argument("--dial-rules", nargs="+", choices=dial.RULES, default=[DIAL_RULE, "shift"],
                   help="how the dial moves each router's rate (dial.calibrate; default: keep_power, then shift)")
    p.add_argument("--no-plot", action="store_true", help="skip the plot (results/quality.png)")
    p.add_argument("--no-baselines", action="store_true", help="router rows only (no static width, TEAL, matching)")
    p.add_argument("--shared-batch", type=count, nargs="*", default=[8, 16], help="decode batch sizes for the "
                   "batch-shared FFN routing rows (none: no such rows)")
    p.add_argument("--serving-only", action="store_true", help="only results/quality_serving.* (bench/serving.py's "
                   "profiles, per token and under the batch rule for FFN width), the quality table untouched")
    p.add_argument("--replot", metavar="JSON", help="only redraw the plot of a quality results file from its rows "
                   "(JSON's name with .png), nothing scored")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", choices=sorted(MODELS), help="the models train.py --model trained: its values "
                   "(MODELS) replace the defaults above")
    p.add_argument("--max-windows", type=count, help="score this many held-out windows, evenly spaced (default: all)")
    p.add_argument("--bf16", action="store_true", help="score and calibrate in bf16 autocast (CPU too)")
    p.add_argument("--layerskip-dial", type=cli.fraction(), nargs="*", default=[], help="also dial the layer-skip "
                   "stage-1 routers trained at 0.5 (OUT/layerskip-s0.5-stage1) to these sparsities (to bracket WIDE's FLOPs)")
    p.add_argument("--matched-stages", type=cli.integer(1, 2), nargs="+", default=[2],
                   help="the trained WIDE stages that get matched-FLOP rows (dial rows always do)")
    p.add_argument("--no-serving", action="store_true", help="no serving rows (RESULTS/NAME_serving.*)")
    p.add_argument("--no-fp8", action="store_true", help="no fp8 rows")
    p.add_argument("--fp8-only", action="store_true", help="only results/NAME_fp8.* (dense and the --dial-from routers "
                   "in both fp8 schemes), the quality table untouched")
    return p


# --model NAME: train.py --model NAME's models on a two-core budget (64 held-out windows of 256, bf16), the dial
# at 0.3 / 0.7, layer-skip's stage 1 dialled to 0.4 to bracket WIDE's FLOPs, matched FLOPs for stage 1 too.
MODELS = {
    "smollm2": dict(out_dir="out-smollm2", name="quality_smollm2", block_size=256, batch_size=16, max_windows=64,
                    calib_batches=1, bf16=True, dial=[0.3, 0.7], dial_rules=["keep_power"], layerskip_dial=[0.4],
                    matched_stages=[1, 2], shared_batch=[], no_serving=True, no_fp8=True),
}


def parse_args(argv=None):
    p = parser()
    p.set_defaults(**MODELS.get(p.parse_known_args(argv)[0].model, {}))
    args = p.parse_args(argv)
    args.device = cli.pick_device(args.device)
    args.dial_from = args.dial_from or os.path.join(args.out_dir, "wide-s0.5-stage2")
    args.layerskip_from = os.path.join(args.out_dir, "layerskip-s0.5-stage1")
    return args


def texts(args):
    """The held-out windows (x, y) covering every held-out token, and the training batches the
    training-free baselines are calibrated on."""
    tok = load_tokenizer(os.path.join(args.out_dir, "base"))
    train_texts, val_texts = data.split_plays()
    x, y = data.val_windows(data.encode_plays(tok, val_texts), args.block_size, args.max_windows)
    gen = torch.Generator().manual_seed(0)
    stream = data.encode_plays(tok, train_texts)
    calib = [data.get_batch(stream, 16, args.block_size, gen)[0].to(args.device) for _ in range(args.calib_batches)]
    return x, y, calib


def replot(path):
    try:
        with open(path) as f:
            rec = json.load(f)
        rows, evaluated, dense_ppl = rec["rows"], rec["baseline_evaluations"], rec["dense_val_ppl"]
    except (OSError, ValueError, KeyError) as e:
        cli.fail(f"--replot: {path} is not a quality results file of eval.py ({type(e).__name__}: {e})")
    words = rec["command"].split()
    out_dir = words[words.index("--out-dir") + 1] if "--out-dir" in words[:-1] else "out"
    plot(rows, evaluated, dense_ppl, os.path.splitext(path)[0] + ".png", out_dir)


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot)
    cli.writable_dir(args.results, "--results")
    # --bf16: the matmuls in bf16 (weights stay fp32; the routers decide in fp32, wide.Router)
    with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16):
        evaluate(args)


def evaluate(args):
    cfg = Transformer.config_from_dir(os.path.join(args.out_dir, "base"))  # no trained model yet: one clear line
    x, y, calib = texts(args)
    dense_ppl, _ = score(base_model(args), x, y, args)
    print(f"dense: ppl {dense_ppl:.2f} over {y.numel()} held-out tokens", flush=True)
    meta = dict(date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv), device=args.device,
                torch=torch.__version__, held_out_plays=list(data.HELD_OUT), held_out_tokens=y.numel(),
                block_size=args.block_size, **({"precision": "bf16 autocast"} if args.bf16 else {}))
    os.makedirs(args.results, exist_ok=True)
    if not (args.no_serving or args.fp8_only):
        serving = serving_rows(args, x, y, dense_ppl)
        save_results(os.path.join(args.results, args.name + "_serving"), dict(meta, rows=serving), serving_markdown(serving, meta))
    if args.serving_only:
        return
    if args.fp8_only:
        fp8 = fp8_rows(args, x, y, calib)
        return save_results(os.path.join(args.results, args.name + "_fp8"), dict(meta, fp8=fp8),
                            "\n".join(title(meta) + fp8_markdown(fp8)) + "\n")
    trained, group_cfg = router_rows(args, x, y)
    # the default rule's dial rows are "wide dial"; another rule's "wide dial (RULE)"
    wide_dial = dial_rows(args, x, y, args.dial_from, args.dial, args.dial_rules,
                          lambda rule: "wide dial" if rule == DIAL_RULE else f"wide dial ({rule})")
    layerskip_dial = dial_rows(args, x, y, args.layerskip_from, args.layerskip_dial, [DIAL_RULE],
                               lambda rule: "layerskip") if args.layerskip_dial else []
    rows = [row("dense", 0, 0.0, dense_ppl, 0.0, 0.0, 1.0)] + trained + layerskip_dial + wide_dial
    group_cfg = group_cfg or wide.WideConfig()
    wide.check_groups(cfg, group_cfg)
    cache = {}  # baseline rows by (method, target): the matched-FLOP search reuses them

    def baseline(method, t):
        if (method, t) not in cache:
            cache[method, t] = (static_row(args, x, y, calib, t, group_cfg) if method == "static"
                                else teal_row(args, x, y, calib, t))
            r = cache[method, t]
            print(f"{method} at {t:.3f}: ppl {r['val_ppl']:.2f}, flops {r['linear_flop_fraction']:.3f}", flush=True)
        return cache[method, t]

    shared = sorted({r["target_sparsity"] for r in rows if r["method"] == "wide" and "attn_target" not in r} or {0.5})
    for target in [] if args.no_baselines else shared:
        rows += [baseline("static", target), baseline("teal", target)]

    # Matched FLOPs: at each stage-2 and dial row's executed fraction, what do the other methods reach?
    steps = baselines.static_steps(cfg, group_cfg)
    matched = [matched_entry(w, w["linear_flop_fraction"], rows, dense_ppl, lambda t: baseline("static", t),
                             lambda t: baseline("teal", t), steps, cfg)
               for w in rows if not args.no_baselines and (w["method"] == "wide dial" or (
                   w["method"] == "wide" and w["stage"] in args.matched_stages))]
    fp8 = [] if args.no_fp8 else fp8_rows(args, x, y, calib)
    batch_shared = shared_rows(args, x, y)
    extra_static_teal = sorted(cache.values(), key=lambda r: (r["method"], r["target_sparsity"]))
    md = markdown(rows, matched, dense_ppl, meta, fp8, batch_shared)
    save_results(os.path.join(args.results, args.name), dict(
        meta, dense_val_ppl=round(dense_ppl, 3), rows=rows, matched_flops=matched, baseline_evaluations=extra_static_teal,
        fp8=fp8, batch_shared=batch_shared), md)
    print(md)
    if not args.no_plot:
        plot(rows, extra_static_teal, dense_ppl, os.path.join(args.results, args.name + ".png"), args.out_dir)


def save_results(prefix, record, md):
    with open(prefix + ".json", "w") as f:
        json.dump(record, f, indent=2)
    with open(prefix + ".md", "w") as f:
        f.write(md)


def target_label(r):
    if "attn_target" in r:
        return f"a{r['attn_target']:g}/f{r['ffn_target']:g}"
    return f"{r['target_sparsity']:g}"


def title(meta):
    return [f"# Held-out perplexity ({', '.join(p.split('/')[1][:-3] for p in meta['held_out_plays'])}; "
            f"{meta['held_out_tokens']} tokens, windows of {meta['block_size']})", "",
            f"`{meta['command']}` on {meta['device']}" + (f" in {meta['precision']}" if "precision" in meta else "")
            + f", torch {meta['torch']}, {meta['date']}."]


def fp8_markdown(fp8):
    out = ["", "fp8 (e4m3, one scale per output channel, on q, k, v, o, gate, up, down; embeddings, head and routers "
           "unchanged), both schemes `generate.py --weights fp8` runs (engine.fp8_model): weights only, where WIDE's "
           "decode kernels read the codes; weights and activations (each token's input quantized with its own scale), "
           "where torch._scaled_mm runs them. Codes rounded to nearest, or by GPTQ on the calibration batches "
           "(kernels.calibrate_fp8). Target: within 1% of the model's own dtype.", "",
           "| model | rounding | dtype | val ppl | fp8 weights | / dtype | fp8 weights and activations | / dtype | "
           "realized sparsity (dtype / fp8 / both) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in fp8:
        name = "dense" if r["method"] == "dense" else f"WIDE ({r['checkpoint']})"
        out.append(f"| {name} | {r.get('rounding', 'nearest')} | {r['dtype']} | {r['val_ppl']:.2f} | {r['fp8_val_ppl']:.2f} | "
                   f"{r['fp8_vs_model']:.4f} | {r['w8a8_val_ppl']:.2f} | {r['w8a8_vs_model']:.4f} | {r['realized']:.1%} / "
                   f"{r['fp8_realized']:.1%} / {r['w8a8_realized']:.1%} |")
    return out


def markdown(rows, matched, dense_ppl, meta, fp8=(), batch_shared=()):
    out = title(meta)
    out[-1] += (" Sparsities and FLOPs are what the routers (or thresholds) realized on the held-out text; `realized - "
                "target` compares the mean of attention and FFN skip rates with the target. `wide dial` rows are the "
                "stage-2 routers trained at the `from` target, dialled to the row's target.")
    out += ["", "| method | stage | target | val ppl | ppl / dense | attn sparsity | FFN sparsity | realized - target | "
            "linear FLOPs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        method = r["method"] + (f" (from {r['trained_target']:g})" if "trained_target" in r else "")
        gap = "-" if r["method"] == "dense" else f"{realized(r) - r['target_sparsity']:+.3f}"
        out.append(f"| {method} | {r['stage'] or '-'} | {target_label(r)} | {r['val_ppl']:.2f} | "
                   f"{r['val_ppl'] / dense_ppl:.3f} | {r['attn_sparsity']:.1%} | {r['ffn_sparsity']:.1%} | {gap} | "
                   f"{r['linear_flop_fraction']:.1%} |")
    if matched:
        pts = lambda ps: " / ".join(f"{f:.1%}" for f, _ in ps)
        out += ["", "At matched executed linear FLOPs: layer-skip interpolated (log-ppl) between its trained targets; "
                "static width interpolated between the two whole-group steps around the FLOPs (their FLOPs in "
                "brackets); TEAL solved for the FLOPs, corrected once by what it realized, and interpolated "
                "between the two (their FLOPs in brackets).", "",
                "| WIDE row | linear FLOPs | WIDE ppl | layer-skip ppl | static ppl [FLOPs] | TEAL ppl [FLOPs] | "
                "WIDE gap / layer-skip gap |", "|---|---|---|---|---|---|---|"]
        for m in matched:
            ls = f"{m['layerskip_ppl']:.2f}" if m["layerskip_ppl"] is not None else "not bracketed"
            st = f"{m['static_ppl']:.2f}" if m["static_ppl"] is not None else "not bracketed"
            gr = f"{m['gap_ratio']:.2f}" if m.get("gap_ratio") is not None else "-"
            name = f"{'dial' if m['wide_method'] == 'wide dial' else 'stage ' + str(m['wide_stage'])}, " + (
                f"a{m['attn_target']:g}/f{m['ffn_target']:g}" if "attn_target" in m else f"s={m['wide_target']:g}")
            out.append(f"| {name} | {m['linear_flop_fraction']:.1%} | {m['wide_ppl']:.2f} | {ls} | "
                       f"{st} [{pts(m['static_points'])}] | {m['teal_ppl']:.2f} [{pts(m['teal_points'])}] | {gr} |")
    layered = [r for r in rows if "attn_per_layer" in r]
    if layered:
        L = len(layered[0]["attn_per_layer"])
        out += ["", "Realized sparsity per layer (attention / FFN) on the held-out text:", "",
                "| method | stage | target | " + " | ".join(f"layer {l}" for l in range(L)) + " |",
                "|---|---|---|" + "---|" * L]
        for r in layered:
            cells = " | ".join(f"{a:.2f} / {f:.2f}" for a, f in zip(r["attn_per_layer"], r["ffn_per_layer"]))
            out.append(f"| {r['method']} | {r['stage'] or '-'} | {target_label(r)} | {cells} |")
    out += fp8_markdown(fp8) if fp8 else []
    if batch_shared:
        out += ["", f"Batch-shared FFN routing (serving time, no retraining): B held-out windows (shuffled; "
                f"{batch_shared[0]['windows']} of them, full batches only) decode "
                "side by side and an FFN channel group runs for the whole batch iff at least k of the B tokens' "
                "routers want it. 'groups run' is the share of FFN weight bytes a decode step reads; per-token "
                "routing at this batch reads the union (k = 1).", "",
                "| routers | per-token ppl (FFN skip) | batch B | k | groups run | val ppl | vs per-token |",
                "|---|---|---|---|---|---|---|"]
        for r in batch_shared:
            out.append(f"| {r['checkpoint']} | {r['per_token_ppl']:.2f} ({r['per_token_ffn_skip']:.1%}) | {r['batch']} "
                       f"| {r['k']} | {r['ffn_live_in_batch']:.1%} | {r['val_ppl']:.2f} | {r['vs_per_token']:.3f}x |")
    return "\n".join(out) + "\n"


def plot_series(rows, baseline_rows):
    """The plot's lines: {label: rows}. A dial line holds its own rule's rows and the checkpoint's own target."""
    trained = lambda r: r["method"] == "wide" and r["target_sparsity"] > 0  # target 0: the dense + LoRA control
    return {"WIDE stage 2 (trained)": [r for r in rows if trained(r) and r["stage"] == 2],
            "WIDE stage 1 (trained)": [r for r in rows if trained(r) and r["stage"] == 1],
            "WIDE dial (stage 2 from 0.5)": [r for r in rows if r["method"] == "wide dial" or (  # + its own target
                trained(r) and r.get("checkpoint") in {d["checkpoint"] for d in rows if d["method"] == "wide dial"})],
            "dense + stage-2 LoRA (routers at 0)": [r for r in rows if r["method"] == "wide" and r["stage"] == 2
                                                    and r["target_sparsity"] == 0],
            "layer-skip stage 2": [r for r in rows if r["method"] == "layerskip" and r["stage"] == 2],
            "layer-skip stage 1": [r for r in rows if r["method"] == "layerskip" and r["stage"] == 1],
            "static width": [r for r in baseline_rows if r["method"] == "static"],
            "TEAL-style": [r for r in baseline_rows if r["method"] == "teal"]}


def plot(rows, baseline_rows, dense_ppl, path, out_dir="out"):
    """Held-out perplexity against executed linear FLOPs, one line per method."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    series = plot_series(rows, baseline_rows)
    style = {"WIDE stage 2 (trained)": "o-", "WIDE stage 1 (trained)": "o:", "WIDE dial (stage 2 from 0.5)": "s--",
             "layer-skip stage 2": "^-", "layer-skip stage 1": "^:", "static width": "x-", "TEAL-style": "d-",
             "dense + stage-2 LoRA (routers at 0)": "kP"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in series.items():
        pts = sorted((r["linear_flop_fraction"], r["val_ppl"]) for r in rs if "attn_target" not in r)
        if pts:
            ax.plot([100 * f for f, _ in pts], [p for _, p in pts], style[name], label=name)
    ax.plot([100], [dense_ppl], "k*", markersize=12, label="dense")
    ax.set_yscale("log")
    top = max([r["val_ppl"] for rs in series.values() for r in rs] + [dense_ppl])
    bottom = min([r["val_ppl"] for rs in series.values() for r in rs] + [dense_ppl])
    ax.set_ylim(bottom * 0.97, min(top * 1.05, dense_ppl * 4))  # static width at 0.75 is off the top
    ax.set_xlabel("executed linear FLOPs (% of dense)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_title(f"Quality against executed FLOPs (held-out plays; models of {out_dir}/)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    cli.run(main)

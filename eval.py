"""
The quality table: held-out perplexity of every method on the held-out plays, at nominal sparsity and
at a matched fraction of executed linear FLOPs.

    python eval.py            # reads out/, writes results/quality.json and results/quality.md

Rows: dense; WIDE stage 1 and stage 2 and layer-skip stage 1 and stage 2 for every target trained
under out/ (train.py --method ... --sparsity ...); static width and TEAL-style thresholds (both
training-free, calibrated here on training text). Routing is deterministic (eval mode) throughout.
"""
import argparse
import datetime
import glob
import json
import math
import os
import sys

import torch

import baselines
import data
import train
import wide
from model import CheckpointError, Transformer, load_tokenizer


def score(model, x, y, args):
    loss, rates = train.evaluate(model, x, y, args.batch_size, args.device)
    return math.exp(loss), rates


def row(method, stage, target, ppl, attn, ffn, flops):
    return dict(method=method, stage=stage, target_sparsity=target, val_ppl=round(ppl, 3),
                attn_sparsity=round(attn, 4), ffn_sparsity=round(ffn, 4), linear_flop_fraction=round(flops, 4))


def router_rows(args, x, y):
    rows = []
    for path in sorted(glob.glob(os.path.join(args.out_dir, "*-stage[12]"))):
        if not os.path.isfile(os.path.join(path, "wide.json")):
            continue
        model, wcfg = wide.load_wide(path, device=args.device)
        ppl, rates = score(model, x, y, args)
        L = model.config.n_layers
        if wcfg.method == "layerskip":
            r = rates["layer"]
            flops = wide.flop_fraction(model.config, wcfg, None, None, [1 - r] * L)
            rows.append(row("layerskip", wcfg.stage, wcfg.target, ppl, r, r, flops))
        else:
            ra, rf = rates["attn"], rates["ffn"]
            flops = wide.flop_fraction(model.config, wcfg, [1 - ra] * L, [1 - rf] * L)
            rows.append(row("wide", wcfg.stage, wcfg.target, ppl, ra, rf, flops))
        print(f"{path}: ppl {ppl:.2f}, flops {flops:.3f}", flush=True)
    return rows


def static_row(args, x, y, calib, target, group_cfg):
    model = Transformer.from_pretrained(os.path.join(args.out_dir, "base"), device=args.device)
    wcfg = wide.WideConfig(target=target, attn_group_size=group_cfg.attn_group_size,
                           ffn_group_size=group_cfg.ffn_group_size)
    baselines.calibrate_static_width(model, wcfg, calib)
    ppl, rates = score(model, x, y, args)
    L = model.config.n_layers
    # A fixed mask costs nothing at run time: no router FLOPs.
    flops = wide.flop_fraction(model.config, None, [1 - rates["attn"]] * L, [1 - rates["ffn"]] * L)
    return row("static", 0, target, ppl, rates["attn"], rates["ffn"], flops)


def teal_row(args, x, y, calib, target):
    model = Transformer.from_pretrained(os.path.join(args.out_dir, "base"), device=args.device)
    baselines.calibrate_teal(model, target, calib)
    ppl, _ = score(model, x, y, args)
    zeroed = lambda names: sum(getattr(getattr(l, p), n).zeroed for l in model.layers for p, n in wide.LORA_TARGETS
                               if n in names) / max(1, sum(getattr(getattr(l, p), n).total for l in model.layers
                                                          for p, n in wide.LORA_TARGETS if n in names))
    return row("teal", 0, target, ppl, zeroed(("q_proj", "k_proj", "v_proj", "o_proj")),
               zeroed(("gate_proj", "up_proj", "down_proj")), baselines.teal_flop_fraction(model))


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out")
    p.add_argument("--results", default="results")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--calib-batches", type=int, default=8, help="training batches to calibrate baselines on")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    args.device = train.pick_device(args.device)
    base = os.path.join(args.out_dir, "base")
    Transformer.config_from_dir(base)  # one clear line if there is no trained model yet
    tok = load_tokenizer(base)
    train_texts, val_texts = data.split_plays()
    x, y = data.val_windows(data.encode_plays(tok, val_texts), args.block_size)  # every held-out token
    gen = torch.Generator().manual_seed(0)
    stream = data.encode_plays(tok, train_texts)
    calib = [data.get_batch(stream, 16, args.block_size, gen)[0].to(args.device) for _ in range(args.calib_batches)]

    dense_ppl, _ = score(Transformer.from_pretrained(base, device=args.device), x, y, args)
    print(f"dense: ppl {dense_ppl:.2f} over {y.numel()} held-out tokens", flush=True)
    rows = [row("dense", 0, 0.0, dense_ppl, 0.0, 0.0, 1.0)] + router_rows(args, x, y)
    wide_rows = [r for r in rows if r["method"] == "wide"]
    group_cfg = wide.WideConfig()
    if wide_rows:
        with open(os.path.join(args.out_dir, f"wide-s{wide_rows[0]['target_sparsity']:g}-stage1", "wide.json")) as f:
            saved = json.load(f)
        group_cfg.attn_group_size, group_cfg.ffn_group_size = saved["attn_group_size"], saved["ffn_group_size"]
    for target in sorted({r["target_sparsity"] for r in wide_rows} or {0.5}):
        rows.append(static_row(args, x, y, calib, target, group_cfg))
        rows.append(teal_row(args, x, y, calib, target))
        print(f"static/teal at {target:g}: ppl {rows[-2]['val_ppl']:.2f} / {rows[-1]['val_ppl']:.2f}", flush=True)

    # Matched FLOPs: at each WIDE row's executed fraction, what do the other methods reach? The two
    # training-free baselines are recalibrated at the target whose FLOP fraction matches (their FLOPs
    # follow from the target alone: static keeps round((1-s) G) groups, TEAL zeroes ~s of each input).
    cfg = Transformer.config_from_dir(base)
    n_attn, n_ffn = wide.check_groups(cfg, group_cfg)
    L, fl = cfg.n_layers, wide.linear_flops(cfg)
    static_flops = lambda t: wide.flop_fraction(cfg, None, [1 - round(t * n_attn) / n_attn] * L,
                                                [1 - round(t * n_ffn) / n_ffn] * L)
    layer_total = L * (fl["q"] + fl["kv"] + fl["o"] + fl["ffn"])
    teal_flops = lambda t: (fl["head"] + (1 - t) * layer_total) / (fl["head"] + layer_total)
    matched = []
    for w in wide_rows:
        f = w["linear_flop_fraction"]
        entry = dict(wide_stage=w["stage"], wide_target=w["target_sparsity"], linear_flop_fraction=f,
                     wide_ppl=w["val_ppl"])
        ls = [(r["linear_flop_fraction"], r["val_ppl"]) for r in rows
              if r["method"] == "layerskip" and r["stage"] == w["stage"]]
        entry["layerskip_ppl"] = interpolate(ls, f)
        entry["static"] = static_row(args, x, y, calib, solve_target(static_flops, f), group_cfg)
        entry["teal"] = teal_row(args, x, y, calib, solve_target(teal_flops, f))
        if entry["layerskip_ppl"] is not None:
            gap_w, gap_l = w["val_ppl"] - dense_ppl, entry["layerskip_ppl"] - dense_ppl
            entry["gap_ratio"] = round(gap_w / gap_l, 3) if gap_l > 0 else None
        matched.append(entry)

    os.makedirs(args.results, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv),
                device=args.device, torch=torch.__version__, held_out_plays=list(data.HELD_OUT),
                held_out_tokens=y.numel(), block_size=args.block_size)
    with open(os.path.join(args.results, "quality.json"), "w") as f:
        json.dump(dict(meta, dense_val_ppl=round(dense_ppl, 3), rows=rows, matched_flops=matched), f, indent=2)
    md = markdown(rows, matched, dense_ppl, meta)
    with open(os.path.join(args.results, "quality.md"), "w") as f:
        f.write(md)
    print(md)


def markdown(rows, matched, dense_ppl, meta):
    out = [f"# Held-out perplexity ({', '.join(p.split('/')[1][:-3] for p in meta['held_out_plays'])}; "
           f"{meta['held_out_tokens']} tokens, windows of {meta['block_size']})", "",
           f"`{meta['command']}` on {meta['device']}, torch {meta['torch']}, {meta['date']}.", "",
           "| method | stage | target | val ppl | ppl / dense | attn sparsity | FFN sparsity | linear FLOPs |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['stage'] or '-'} | {r['target_sparsity']:g} | {r['val_ppl']:.2f} | "
                   f"{r['val_ppl'] / dense_ppl:.3f} | {r['attn_sparsity']:.1%} | {r['ffn_sparsity']:.1%} | "
                   f"{r['linear_flop_fraction']:.1%} |")
    if matched:
        out += ["", "At matched executed linear FLOPs (layer-skip interpolated in log-ppl between its trained "
                "targets; static and TEAL recalibrated to the same FLOPs):", "",
                "| WIDE row | linear FLOPs | WIDE ppl | layer-skip ppl | static ppl | TEAL ppl | WIDE gap / layer-skip gap |",
                "|---|---|---|---|---|---|---|"]
        for m in matched:
            ls = f"{m['layerskip_ppl']:.2f}" if m["layerskip_ppl"] is not None else "not bracketed"
            gr = f"{m['gap_ratio']:.2f}" if m.get("gap_ratio") is not None else "-"
            out.append(f"| stage {m['wide_stage']}, s={m['wide_target']:g} | {m['linear_flop_fraction']:.1%} | "
                       f"{m['wide_ppl']:.2f} | {ls} | {m['static']['val_ppl']:.2f} | {m['teal']['val_ppl']:.2f} | {gr} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}")

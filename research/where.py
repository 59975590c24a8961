"""
Where WIDE loses (or wins) against TEAL-style thresholds: which layers, attention or FFN, which tokens.

    python -m research.where                                      # -> results/quality_where.{json,md}
    python -m research.where --out-dir out-gpu --name quality_gpu  # -> results/quality_gpu_where.{json,md}

1) Places. The routers of one checkpoint (--target, stage 1 and stage 2) decide in one place only: one
   layer's attention, one layer's FFN, every layer's attention or every layer's FFN; every other group is
   forced to run. TEAL's thresholds go in that same place only (on the dense base), solved for the same
   executed linear FLOPs (once, corrected once by what they realized, log-ppl interpolated between the
   two, as eval.py does). Only the routers of the place count as executed FLOPs: the others would not run.
   A stage-2 model is its own backbone (LoRA merged), so its place costs are read against its own
   perplexity with every group run; stage 1's backbone is the dense base itself.
2) Tokens. WIDE everywhere (stage 2, its own dial) against TEAL everywhere at the same executed FLOPs;
   the held-out tokens are bucketed by the width WIDE gave them, by how hard they are for the dense
   model, and by what the predicted token is; per bucket, the mean NLL increase over the dense model.
"""
import contextlib
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import baselines
import cli
import data
import dial
import wide
from checkpoints import load_wide
from model import Transformer, load_tokenizer


@torch.no_grad()
def token_nll(model, x, y, args):
    """Per held-out token: NLL [N] and, when routers decide, each layer's kept share of attention and FFN
    groups {kind: [L, N]} (deterministic routing)."""
    model.eval()
    nll, keep = [], {}
    for i in range(0, len(x), args.batch_size):
        xb, yb = x[i:i + args.batch_size].to(args.device), y[i:i + args.batch_size].to(args.device)
        masks = {}
        logits = model(xb, masks=masks)
        nll.append(F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="none").cpu())
        for kind, layers in masks.items():
            keep.setdefault(kind, []).append(torch.stack([m.float().mean(-1).flatten().cpu() for m in layers]))
    return torch.cat(nll), {k: torch.cat(v, 1) for k, v in keep.items()}


@contextlib.contextmanager
def routed_only(model, kind, layers):
    """Inside the block only the `kind` routers of `layers` decide; every other router's mask is all ones
    (its groups run). kind None: no router decides."""
    handles = [r.register_forward_hook(lambda m, a, out: torch.ones_like(out))
               for k, i, r in dial.router_list(model) if not (k == kind and i in layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def place_share(cfg, kind, layers):
    """The place's share of dense linear FLOPs that TEAL can prune (q, k, v, o; or gate, up, down)."""
    f = wide.linear_flops(cfg)
    per_layer = f["q"] + f["kv"] + f["o"] if kind == "attn" else f["ffn"]
    return len(layers) * per_layer / wide.dense_flops(cfg)


def wide_place_flops(cfg, wcfg, kind, layers, keep):
    """Executed / dense linear FLOPs when only the place's routers decide: they skip (1 - keep) of its
    Q+O (attention) or FFN work, and cost their own FLOPs."""
    f = wide.linear_flops(cfg, wcfg)
    n_attn, n_ffn = wide.check_groups(cfg, wcfg)
    router = min(wcfg.rank, cfg.dim) * (cfg.dim + 2 * (n_attn if kind == "attn" else n_ffn))
    work = f["q"] + f["o"] if kind == "attn" else f["ffn"]
    saved = sum((1 - keep[l].mean().item()) * work - router for l in layers)
    return 1 - saved / wide.dense_flops(cfg)


def backbone(path, device):
    """The dense model TEAL runs on: a base checkpoint, or a router checkpoint's backbone (LoRA merged,
    routers removed), e.g. the control trained at target 0 (train.py --sparsity 0)."""
    if not os.path.isfile(os.path.join(path, "wide.json")):
        return Transformer.from_pretrained(path, device=device)
    model, _ = load_wide(path, device=device)
    for layer in model.layers:
        layer.attn_router = layer.ffn_router = layer.layer_router = None
    return model


def teal_at(base_dir, kind, layers, s, calib, x, y, args):
    """TEAL thresholds at rate s in the place only: (ppl, executed FLOPs, NLL per token)."""
    model = backbone(base_dir, args.device)
    first = ("q_proj", "o_proj") if kind == "attn" else ("gate_proj", "down_proj")
    everywhere = kind is None
    baselines.calibrate_teal(model, lambda i, n: s if everywhere or (i in layers and n in first) else 0.0, calib)
    nll, _ = token_nll(model, x, y, args)
    return math.exp(nll.mean().item()), baselines.teal_flop_fraction(model), nll


def teal_matched(base_dir, kind, layers, f_goal, share, calib, x, y, args):
    """TEAL in the place at executed FLOPs f_goal: solved nominally, corrected once by what it realized;
    returns (ppl interpolated at f_goal, [(flops, ppl)] of both measurements, the nearer one's NLLs)."""
    s1 = min(0.95, max(0.0, (1 - f_goal) / share))
    p1, f1, n1 = teal_at(base_dir, kind, layers, s1, calib, x, y, args)
    s2 = min(0.95, max(0.0, s1 + (f1 - f_goal) / share))
    p2, f2, n2 = teal_at(base_dir, kind, layers, s2, calib, x, y, args)
    points = sorted([(f1, p1), (f2, p2)])
    (fa, pa), (fb, pb) = points
    if fa <= f_goal <= fb and fb > fa:
        t = (f_goal - fa) / (fb - fa)
        ppl = math.exp((1 - t) * math.log(pa) + t * math.log(pb))
    else:
        ppl = min(points, key=lambda p: abs(p[0] - f_goal))[1]
    nearer = n1 if abs(f1 - f_goal) <= abs(f2 - f_goal) else n2
    return ppl, [(round(f, 4), round(p, 3)) for f, p in points], nearer


def place_rows(args, cfg, x, y, calib, dense_ppl):
    L = cfg.n_layers
    places = ([("attn", [l], f"layer {l} attention") for l in range(L)] + [("ffn", [l], f"layer {l} FFN") for l in range(L)]
              + [("attn", list(range(L)), "every layer's attention"), ("ffn", list(range(L)), "every layer's FFN")])
    rows = []
    for stage in (1, 2):
        path = os.path.join(args.out_dir, f"wide-s{args.target:g}-stage{stage}")
        model, wcfg = load_wide(path, device=args.device)
        with routed_only(model, None, []):
            own = math.exp(token_nll(model, x, y, args)[0].mean().item())  # this backbone, every group run
        for kind, layers, label in places:
            with routed_only(model, kind, layers):
                nll, keep = token_nll(model, x, y, args)
            ppl = math.exp(nll.mean().item())
            f = wide_place_flops(cfg, wcfg, kind, layers, keep[kind])
            teal_ppl, points, _ = teal_matched(args.teal_backbone, kind, layers, f,
                                               place_share(cfg, kind, layers), calib, x, y, args)
            rows.append(dict(stage=stage, place=label, kind=kind, layers=layers, backbone_ppl=round(own, 3),
                             skip=round(1 - sum(keep[kind][l].mean().item() for l in layers) / len(layers), 4),
                             linear_flop_fraction=round(f, 4), wide_ppl=round(ppl, 3), wide_cost=round(ppl / own, 4),
                             teal_ppl=round(teal_ppl, 3), teal_points=points, teal_cost=round(teal_ppl / dense_ppl, 4)))
            r = rows[-1]
            print(f"stage {stage} {label}: skip {r['skip']:.3f}, flops {f:.4f}: WIDE x{r['wide_cost']:.4f} "
                  f"TEAL x{r['teal_cost']:.4f}", flush=True)
    return rows


def token_kind(text):
    if "\n" in text:
        return "newline"
    core = text.strip()
    if not core:
        return "space"
    if not any(c.isalnum() for c in core):
        return "punctuation"
    return "word start" if text[0] == " " else "word piece"


def buckets(labels, order, dense, wide_nll, teal_nll, width):
    """Per label (in `order`): share of tokens, WIDE's mean width, mean NLL increase of WIDE and TEAL."""
    out = []
    for name in order:
        m = labels == name if isinstance(name, int) else torch.tensor([l == name for l in labels])
        if m.sum() == 0:
            continue
        out.append(dict(bucket=name, share=round(m.float().mean().item(), 4), wide_flops=round(width[m].mean().item(), 4),
                        dense_nll=round(dense[m].mean().item(), 4), wide_dnll=round((wide_nll - dense)[m].mean().item(), 4),
                        teal_dnll=round((teal_nll - dense)[m].mean().item(), 4)))
    return out


def token_rows(args, cfg, x, y, calib, tok):
    base_dir = os.path.join(args.out_dir, "base")
    dense, _ = token_nll(Transformer.from_pretrained(base_dir, device=args.device), x, y, args)
    model, wcfg = load_wide(os.path.join(args.out_dir, f"wide-s{args.target:g}-stage2"), device=args.device)
    wide_nll, keep = token_nll(model, x, y, args)
    a, f = keep["attn"].mean(0), keep["ffn"].mean(0)  # per token, over layers
    width = torch.as_tensor(wide.flop_fraction(cfg, wcfg, [a] * cfg.n_layers, [f] * cfg.n_layers))
    f_wide = wide.flop_fraction(cfg, wcfg, keep["attn"].mean(1).tolist(), keep["ffn"].mean(1).tolist())
    teal_ppl, points, teal_nll = teal_matched(args.teal_backbone, None, [], f_wide, place_share(cfg, "attn", range(cfg.n_layers))
                                              + place_share(cfg, "ffn", range(cfg.n_layers)), calib, x, y, args)
    q = lambda v: torch.bucketize(v, torch.quantile(v, torch.tensor([0.2, 0.4, 0.6, 0.8])))  # quintile 0..4
    kinds = [token_kind(tok.decode([i])) for i in y.flatten().tolist()]
    return dict(linear_flop_fraction=round(f_wide, 4), wide_ppl=round(math.exp(wide_nll.mean().item()), 3),
                teal_ppl=round(teal_ppl, 3), teal_points=points, dense_ppl=round(math.exp(dense.mean().item()), 3),
                by_width=buckets(q(width), range(5), dense, wide_nll, teal_nll, width),
                by_dense_nll=buckets(q(dense), range(5), dense, wide_nll, teal_nll, width),
                by_kind=buckets(kinds, ["word start", "word piece", "punctuation", "newline", "space"],
                                dense, wide_nll, teal_nll, width))


def markdown(rec):
    t = rec["tokens"]
    out = [f"# Where WIDE and TEAL differ ({rec['out_dir']}/, routers trained at {rec['target']:g})", "",
           f"`{rec['command']}` on {rec['device']}, torch {rec['torch']}, {rec['date']}; {rec['held_out_tokens']} "
           "held-out tokens. Costs are perplexity ratios: WIDE's against its own backbone with every group run "
           f"(stage 1: the dense base), TEAL's against its backbone ({rec['teal_backbone']}, ppl "
           f"{rec['teal_backbone_ppl']:.2f}), at the same executed linear FLOPs.", ""]
    if rec["places"]:
        out += ["## Places: only one place pruned", "",
                "| stage | place | WIDE skip there | linear FLOPs | WIDE ppl (backbone) | WIDE cost | TEAL ppl [FLOPs] | TEAL cost | WIDE - TEAL |",
                "|---|---|---|---|---|---|---|---|---|"]
    for r in rec["places"]:
        pts = " / ".join(f"{f:.1%}" for f, _ in r["teal_points"])
        out.append(f"| {r['stage']} | {r['place']} | {r['skip']:.1%} | {r['linear_flop_fraction']:.1%} | {r['wide_ppl']:.2f} "
                   f"({r['backbone_ppl']:.2f}) | {r['wide_cost']:.4f} | {r['teal_ppl']:.2f} [{pts}] | {r['teal_cost']:.4f} | "
                   f"{r['wide_cost'] - r['teal_cost']:+.4f} |")
    if t is None:
        return "\n".join(out) + "\n"
    out += ["", f"## Tokens: WIDE stage 2 everywhere vs TEAL everywhere at {t['linear_flop_fraction']:.1%} of linear FLOPs", "",
            f"Perplexity: dense {t['dense_ppl']:.2f}, WIDE {t['wide_ppl']:.2f}, TEAL {t['teal_ppl']:.2f} (interpolated; "
            f"per-token NLLs below from its measurement at {min(t['teal_points'], key=lambda p: abs(p[0] - t['linear_flop_fraction']))[0]:.1%}). "
            "dNLL = mean NLL increase over the dense model on the bucket's tokens (nats).", ""]
    titles = dict(by_width="the width WIDE gave the token (quintiles of its executed linear FLOPs; 0 = narrowest)",
                  by_dense_nll="how hard the token is for the dense model (quintiles of dense NLL; 0 = easiest)",
                  by_kind="what the predicted token is")
    for key, title in titles.items():
        out += [f"By {title}:", "", "| bucket | share of tokens | WIDE linear FLOPs | dense NLL | WIDE dNLL | TEAL dNLL |",
                "|---|---|---|---|---|---|"]
        out += [f"| {b['bucket']} | {b['share']:.1%} | {b['wide_flops']:.1%} | {b['dense_nll']:.3f} | {b['wide_dnll']:+.4f} | "
                f"{b['teal_dnll']:+.4f} |" for b in t[key]] + [""]
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = cli.parser(__doc__, prog="-m research.where")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--results", default="results")
    p.add_argument("--name", default="quality", help="writes RESULTS/NAME_where.{json,md}")
    p.add_argument("--target", type=cli.fraction(), default=0.5, help="the trained target whose routers are read")
    p.add_argument("--block-size", type=cli.integer(1), default=128)
    p.add_argument("--batch-size", type=cli.integer(1), default=32)
    p.add_argument("--calib-batches", type=cli.integer(1), default=8)
    p.add_argument("--teal-backbone", help="the model TEAL runs on (default OUT/base); a router checkpoint means "
                   "its backbone, LoRA merged, routers removed (e.g. OUT/wide-s0-stage2, the control)")
    p.add_argument("--sections", nargs="+", choices=["places", "tokens"], default=["places", "tokens"])
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    args.device = cli.pick_device(args.device)
    cli.writable_dir(args.results, "--results")
    base_dir = os.path.join(args.out_dir, "base")
    args.teal_backbone = args.teal_backbone or base_dir
    cfg = Transformer.config_from_dir(base_dir)
    for stage in (1, 2):  # before any scoring: both stages of the target must be trained
        path = os.path.join(args.out_dir, f"wide-s{args.target:g}-stage{stage}")
        if not os.path.isfile(os.path.join(path, "wide.json")):
            cli.fail(f"{path} is not trained; train it with python train.py --sparsity {args.target:g} "
                     f"--out-dir {args.out_dir} (or pick another --target)")
    tok = load_tokenizer(base_dir)
    train_texts, val_texts = data.split_plays()
    x, y = data.val_windows(data.encode_plays(tok, val_texts), args.block_size)
    gen, stream = torch.Generator().manual_seed(0), data.encode_plays(tok, train_texts)
    calib = [data.get_batch(stream, 16, args.block_size, gen)[0].to(args.device) for _ in range(args.calib_batches)]
    dense_ppl = math.exp(token_nll(Transformer.from_pretrained(base_dir, device=args.device), x, y, args)[0].mean().item())
    teal_ref = math.exp(token_nll(backbone(args.teal_backbone, args.device), x, y, args)[0].mean().item())
    rec = dict(date=datetime.date.today().isoformat(), command=" ".join(["python -m research.where"] + argv), device=args.device,
               torch=torch.__version__, out_dir=args.out_dir, target=args.target, held_out_tokens=y.numel(),
               dense_ppl=round(dense_ppl, 3), teal_backbone=args.teal_backbone, teal_backbone_ppl=round(teal_ref, 3),
               places=place_rows(args, cfg, x, y, calib, teal_ref) if "places" in args.sections else [],
               tokens=token_rows(args, cfg, x, y, calib, tok) if "tokens" in args.sections else None)
    os.makedirs(args.results, exist_ok=True)
    prefix = os.path.join(args.results, args.name + "_where")
    with open(prefix + ".json", "w") as f:
        json.dump(rec, f, indent=2)
    md = markdown(rec)
    with open(prefix + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    cli.run(main)

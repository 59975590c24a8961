"""
The sparsity dial: one router checkpoint, any width.

Deterministic routing skips a group iff z_skip - z_exec > 0 (wide.Router). The dial adds one offset per
(layer, router type) to that gap: skip iff z_skip - z_exec + offset > 0 (a tie still executes); a positive
offset skips more. calibrate() picks the offsets on training windows so that the realized skip rates are
the requested ones. That corrects the drift of deterministic routing from the Gumbel-trained rate (every
stage of train.py ends with it, at its own target) and turns one checkpoint into any sparsity.

    offsets, realized = calibrate(model, windows, target=0.4)   # windows [N, T]: the caller's token ids
    fold_offsets(model, offsets)                                # b_skip += offset: every path applies it
    with dialled(model, offsets): ...                           # the same without touching a weight

The windows come from the caller (train.py's training stream, or data.dial_windows for a checkpoint), so
this file knows nothing of the corpus. checkpoints.py keeps offsets in wide.json and caches new ones.
"""
import contextlib

import torch

KINDS = ("attn", "ffn", "layer")
CALIB_WINDOWS, CALIB_SEED = 64, 1234  # training windows of block_size tokens the dial is calibrated on


def router_list(model):
    """[(kind, layer index, router)] in the order a forward meets them (layer 0 attn, layer 0 ffn, ...)."""
    return [(k, i, getattr(l, f"{k}_router")) for i, l in enumerate(model.layers) for k in KINDS
            if getattr(l, f"{k}_router", None) is not None]


@torch.no_grad()
def fold_offsets(model, offsets):
    """Add each router's offset to its skip biases (b_skip += offset), in place, at load time.

    Exact and free: z_skip + offset is what the router's second Linear now computes, so every path that
    applies the router's own rule applies the dial without knowing about it: Router.forward in the torch
    path, and the fused router kernel of kernels_step.py (z_skip + b_skip <= z_exec + b_exec, a tie executes),
    which therefore needs no change. The checkpoint keeps the raw biases; wide.json keeps the offsets."""
    for kind, i, r in router_list(model):
        if kind in offsets:
            r.up.bias[1::2] += offsets[kind][i]  # logits come in (execute, skip) pairs: odd = skip


@contextlib.contextmanager
def dialled(model, offsets, gaps=None):
    """Within the block, routers decide with their offsets (forward hooks; no weight is touched, so this
    works on a model being trained or sharded). gaps: an optional dict that receives each router's
    skip-minus-execute gaps [N, G] (before the offset), keyed by (kind, layer)."""
    def hook(router, inputs, out, key):
        z = router.logits(inputs[0]).float()
        gap = z[..., 1] - z[..., 0]
        if gaps is not None:
            gaps.setdefault(key, []).append(gap.reshape(-1, gap.shape[-1]))
        o = (offsets or {}).get(key[0])
        return out if o is None else (gap + o[key[1]] <= 0).to(out.dtype)  # skip iff gap + offset > 0
    handles = [r.register_forward_hook(lambda m, a, out, key=(k, i): hook(m, a, out, key))
               for k, i, r in router_list(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def run_layers(model, windows):
    """The model's forward over windows [N, T] with the head at one position per window only: the routers
    read the residual stream, and a large vocabulary's logits at every token would cost more than the
    layers. Through the model's own forward, so a sharded (FSDP2) or wrapped model runs as in training."""
    model(windows, logits_at=torch.full((len(windows),), windows.shape[1] - 1, device=windows.device))


def collect_gaps(model, windows, offsets, batch_size=32):
    was = model.training
    model.eval()
    gaps = {}
    with dialled(model, offsets, gaps):
        for i in range(0, len(windows), batch_size):
            run_layers(model, windows[i:i + batch_size])
    model.train(was)
    return {k: torch.cat(v).double().cpu() for k, v in gaps.items()}  # the solves below run on the CPU


def solve_in_order(model, windows, want, offsets):
    """Each router's offset (solve_offset) from its gaps on all windows with the earlier routers' offsets
    applied. One forward over every window at once does it: a router's hook solves its offset from what it
    sees and applies it before any later router runs, as a pass per router would, at the cost of one."""
    def hook(router, inputs, out, key):
        z = router.logits(inputs[0]).float()
        gap = z[..., 1] - z[..., 0]
        offsets[key[0]][key[1]] = solve_offset(gap.reshape(-1, gap.shape[-1]).double().cpu(), want[key])
        return (gap + offsets[key[0]][key[1]] <= 0).to(out.dtype)
    was = model.training
    model.eval()
    handles = [r.register_forward_hook(lambda m, a, out, key=(k, i): hook(m, a, out, key))
               for k, i, r in router_list(model)]
    try:
        run_layers(model, windows)
    finally:
        for h in handles:
            h.remove()
        model.train(was)


def solve_shift(gaps, target, iters=60):
    """Bisection on one common logit shift c: the mean over these routers of their Gumbel-sampled skip
    rate, mean sigmoid(gap + c) (what the training penalty held on target), equals `target`."""
    rate = lambda c: torch.stack([torch.sigmoid(g + c).mean() for g in gaps]).mean().item()
    lo, hi = -60.0, 60.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < target else (lo, mid)
    return (lo + hi) / 2


def solve_power(rates, target, iters=60):
    """Bisection on one exponent a: the mean over these routers of 1 - (1 - r)^a equals `target`, r each
    router's rate at its trained target. Every router's kept share is raised to the same power, so the order
    of the rates is kept and a router that keeps most of its groups (a layer the training protected) gives
    up the least of them: the "keep_power" rule of calibrate."""
    rate = lambda a: sum(1 - (1 - r) ** a for r in rates) / len(rates)
    lo, hi = -12.0, 12.0  # log2 of the exponent
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(2 ** mid) < target else (lo, mid)
    return 2 ** ((lo + hi) / 2)


def solve_offset(gap, rate):
    """The offset at which mean(gap + offset > 0) is closest to `rate`: skip the k largest gaps, k as near
    rate * N as equal gaps allow (a token that recurs has one gap; it cannot be split). The offset sits
    halfway between the k-th and (k+1)-th largest gap, so that rounding in the folded bias does not move
    a calibration token across the threshold."""
    g = gap.flatten().sort(descending=True).values
    n = g.numel()
    cuts = torch.cat([torch.tensor([0]), torch.nonzero(g[:-1] > g[1:]).flatten() + 1, torch.tensor([n])])
    k = int(cuts[(cuts.double() - rate * n).abs().argmin()])  # the first of equally near cuts: fewer skips
    above = g[k - 1] if k > 0 else g[0] + 1.0
    below = g[k] if k < g.numel() else g[-1] - 1.0
    return -float(above + below) / 2


RULES = ("shift", "keep_power")


def calibrate(model, windows, target=None, attn_target=None, ffn_target=None, rule="shift"):
    """Per-(layer, router type) offsets such that deterministic routing on `windows` [N, T] skips, on
    average, `target` of the groups (shared: the mean of attention and FFN, or the layer-skip rate), or
    attn_target / ffn_target separately. Deterministic: no randomness, a fixed visiting order.

    Which layer skips how much is the routers' own choice. rule "shift": one common shift c per target
    (bisection, solve_shift) moves every router's Gumbel-sampled rate r (mean sigmoid(gap + c)). rule
    "keep_power": every router's kept share 1 - r (r at c = 0, where training held the rates) is raised to
    one common power (solve_power), which moves the routers that skip most the furthest and keeps the
    layers the training protected. Each router then gets the offset at which its deterministic rate equals
    its wanted rate (solve_offset). Routers are calibrated in
    forward order, each with the offsets of the earlier ones applied (they change its input).
    Returns ({kind: [offset per layer]}, {kind: [realized rate per layer on the windows]})."""
    gaps = collect_gaps(model, windows, None)
    kinds = sorted({k for k, _ in gaps})
    if attn_target is not None:
        groups = {("attn",): attn_target, ("ffn",): ffn_target}
    else:
        groups = {tuple(kinds): target}
    if rule not in RULES:
        raise ValueError(f"dial rule {rule!r}: use one of {', '.join(RULES)}")
    want = {}
    for members, t in groups.items():
        mine = {key: g for key, g in gaps.items() if key[0] in members}
        if rule == "shift":
            c = solve_shift(list(mine.values()), t)
            want.update({key: torch.sigmoid(g + c).mean().item() for key, g in mine.items()})
        else:
            base = {key: torch.sigmoid(g).mean().item() for key, g in mine.items()}
            a = solve_power(list(base.values()), t)
            want.update({key: 1 - (1 - r) ** a for key, r in base.items()})
    offsets = {k: [0.0] * len(model.layers) for k in kinds}
    solve_in_order(model, windows, want, offsets)
    final = collect_gaps(model, windows, offsets)
    realized = {k: [(final[(k, i)] + offsets[k][i] > 0).double().mean().item() for i in range(len(model.layers))]
                for k in kinds}
    return offsets, realized


def describe_offsets(offsets):
    return " ".join(f"{k} [" + " ".join(f"{o:+.2f}" for o in v) + "]" for k, v in offsets.items())



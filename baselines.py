"""
The training-free baselines WIDE is compared with, calibrated on a few batches of training text:

  static width  one mask for every token: per layer, keep the (1 - s*) most important head groups and
                channel groups (FixedMask, calibrate_static_width). It plugs in where a router would,
                so the model's two "WIDE:" mask lines apply it.
  TEAL-style    activation sparsity: zero the inputs of every projection whose |x| is below a per-layer
                threshold, the s-quantile of calibration inputs (TealLinear, calibrate_teal,
                teal_flop_fraction).

The third baseline, layer-skip (dynamic depth: one router of one group per layer gating both residual
branches), is trained with the same loss and schedule as WIDE, so it lives in wide.py:
WideConfig(method="layerskip") and install_routers.
"""
import torch
import torch.nn as nn

from dial import run_layers
from wide import LORA_TARGETS, check_groups, dense_flops, flop_fraction, linear_flops


@torch.no_grad()
def capture_inputs(model, batches, names, layers=None):
    """Run the model on calibration batches; collect the inputs of the named projections per layer
    (of every layer, or of the given layer indices)."""
    layers = range(len(model.layers)) if layers is None else layers
    got = {(i, n): [] for i in layers for n in names}
    hooks = []
    for i, layer in ((i, model.layers[i]) for i in layers):
        for n in names:
            mod = getattr(layer.self_attn if n in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, n)
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, key=(i, n): got[key].append(args[0].reshape(-1, args[0].shape[-1]).float())))
    model.eval()
    for x in batches:
        run_layers(model, x)
    for h in hooks:
        h.remove()
    return {k: torch.cat(v) for k, v in got.items()}


# ----------------------------------------------------------------------------------------------------
# static width


class FixedMask(nn.Module):
    """Static width: one mask [G] for every token (no router), broadcast to [B, T, G]."""

    def __init__(self, mask):
        super().__init__()
        self.n_groups = mask.shape[-1]
        self.register_buffer("mask", mask.float())

    def forward(self, x):
        return self.mask.expand(*x.shape[:-1], -1)


@torch.no_grad()
def calibrate_static_width(model, wcfg, batches):
    """Static width: per layer, keep the (1 - s*) most important head groups and channel groups for
    every token. Importance = mean norm of a group's contribution to o_proj / down_proj outputs."""
    n_attn, n_ffn = check_groups(model.config, wcfg)
    acts = capture_inputs(model, batches, ("o_proj", "down_proj"))
    for i, layer in enumerate(model.layers):
        for name, key, proj, n_groups in (("attn", "o_proj", layer.self_attn.o_proj, n_attn),
                                          ("ffn", "down_proj", layer.mlp.down_proj, n_ffn)):
            x = acts[(i, key)]                                                             # [N, K]
            W = proj.weight.float()                                                        # [D, K]
            xg = x.view(x.shape[0], n_groups, -1)
            Wg = W.view(W.shape[0], n_groups, -1)
            importance = torch.einsum("ngk,dgk->ngd", xg, Wg).norm(dim=-1).mean(0)          # [G]
            mask = torch.zeros(n_groups)
            mask[importance.topk(n_groups - int(round(wcfg.target * n_groups))).indices] = 1.0
            setattr(layer, f"{name}_router", FixedMask(mask.to(W.device)))
    return model


def static_flop_fraction(cfg, wcfg, target):
    """Executed / dense linear FLOPs of static width at target s: every layer keeps G - round(s G) groups
    of each kind for every token, as calibrate_static_width does. A fixed mask needs no router."""
    n_attn, n_ffn = check_groups(cfg, wcfg)
    keep = lambda g: (g - int(round(target * g))) / g
    return flop_fraction(cfg, None, [keep(n_attn)] * cfg.n_layers, [keep(n_ffn)] * cfg.n_layers)


def static_steps(cfg, wcfg, points=999):
    """Static width's FLOPs are a step function of the target (whole groups): [(target, flops)], one target
    per step (the middle of its range, clear of rounding ties), in decreasing FLOPs."""
    runs = {}
    for i in range(points):
        t = 0.99 * i / (points - 1)
        runs.setdefault(round(static_flop_fraction(cfg, wcfg, t), 12), []).append(t)
    return sorted(((ts[len(ts) // 2], f) for f, ts in runs.items()), key=lambda p: -p[1])


# ----------------------------------------------------------------------------------------------------
# TEAL-style thresholds


class TealLinear(nn.Module):
    """TEAL-style (training-free activation sparsity): zero input entries with |x| below a per-layer
    threshold, so the matching weight columns need not be read. zeroed / total count the zeroed share.
    Built with threshold None and a sparsity s, the first forward sets the threshold to the s-quantile
    of |x| over everything it is given (calibrate_teal)."""

    def __init__(self, base, threshold, sparsity=None):
        super().__init__()
        self.base, self.threshold, self.sparsity = base, threshold, sparsity
        self.zeroed, self.total = 0, 0

    def forward(self, x):
        if self.threshold is None:
            a = x.detach().abs().float().flatten()
            self.threshold = -1.0 if self.sparsity <= 0 else a.kthvalue(max(1, int(self.sparsity * a.numel()))).values.item()
        kept = x.abs() > self.threshold
        self.zeroed += int((~kept).sum())
        self.total += kept.numel()
        return self.base(x * kept)


@torch.no_grad()
def calibrate_teal(model, sparsity, batches):
    """Thresholds at the s-quantile of |input| for every projection (q, k, v share an input; so do
    gate and up), calibrated on training text: s of every linear's inputs are zeroed there.
    sparsity: one s for every projection, or a function (layer index, first projection of the input's
    group: "q_proj", "o_proj", "gate_proj" or "down_proj") -> s, for thresholds in some places only.

    In forward order, each projection's threshold is set from its input with the thresholds before it
    already in place: they change what it sees, and a threshold from dense inputs would zero more than s
    of the real ones. One forward over all calibration batches at once does that: each TealLinear sets its
    threshold on the input it is given before any later projection runs."""
    rate = sparsity if callable(sparsity) else lambda i, name: sparsity
    for i, layer in enumerate(model.layers):
        for group in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
            for parent, n in LORA_TARGETS:
                if n in group:
                    mod = getattr(layer, parent)  # q, k, v see one input, so they set one threshold
                    setattr(mod, n, TealLinear(getattr(mod, n), None, rate(i, group[0])))
    model.eval()
    run_layers(model, torch.cat(list(batches)))
    for m in model.modules():  # the calibration passes are not part of the zeroed counts
        if isinstance(m, TealLinear):
            m.zeroed, m.total = 0, 0
    return model


def teal_flop_fraction(model):
    """Executed / dense linear FLOPs under TEAL: each projection runs (1 - its zeroed input share)."""
    f = linear_flops(model.config)
    per_proj = dict(q_proj=f["q"], k_proj=f["kv"] / 2, v_proj=f["kv"] / 2, o_proj=f["o"],
                    gate_proj=f["ffn"] / 3, up_proj=f["ffn"] / 3, down_proj=f["ffn"] / 3)
    done = f["head"]
    for layer in model.layers:
        for parent, n in LORA_TARGETS:
            m = getattr(getattr(layer, parent), n)
            done += per_proj[n] * (1 - m.zeroed / max(1, m.total))
    return done / dense_flops(model.config)


def teal_nominal_flop_fraction(cfg, sparsity):
    """The FLOPs TEAL executes if exactly `sparsity` of every projection's inputs are zeroed (the head runs
    dense): what its target is solved from before the realized fraction (teal_flop_fraction) is measured."""
    head = linear_flops(cfg)["head"]
    return (head + (1 - sparsity) * (dense_flops(cfg) - head)) / dense_flops(cfg)

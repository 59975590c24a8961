"""
WIDE: token-level dynamic width. Every layer gets two tiny routers; per token, one picks which
attention head groups run, the other which FFN channel groups run.

    x_l ──► attn router ──► head_mask [B,T,G_a] ──► zero skipped heads before o_proj   (model.py)
    h_l ──► FFN router  ──► channel_mask [B,T,G_f] ─► zero skipped channels before down_proj

This file follows the paper's order:
  1. the router: Linear(D, r) -> Linear(r, 2G), an (execute, skip) logit pair per group;
  2. straight-through: in training each group draws execute/skip from a 2-way hard Gumbel-softmax and
     gets the soft sample's gradient; at inference it skips iff z_skip > z_exec (deterministic);
  3. the temperature schedule: 5 -> 0.5, linear over each stage's optimizer steps, restarting per stage;
  4. skip rates: the fraction of groups skipped over valid tokens x layers x groups;
  5. the penalty: loss = CE + 20 * |s* - (r_attn + r_ffn) / 2|  (train.py writes that line);
  6. LoRA (stage 2) on every projection, merged exactly before inference;
  7. FLOP accounting: the fraction of linear-layer FLOPs a token executes;
  8. checkpoints: the dense weights + router / LoRA tensors + wide.json;
  9. the sparsity dial: per-(layer, router type) offsets on the skip-minus-execute gap, calibrated so
     that deterministic routing realizes a requested sparsity (any S from one checkpoint).

Where to look for the rest:
  model.py    the two lines marked "WIDE:": head_mask multiplies the head outputs before o_proj, and
              channel_mask the SwiGLU product before down_proj (training and the torch backend: dense
              compute, skipped work zeroed). Every Block appends the masks its routers returned to the
              `masks` dict of Transformer.forward; skip_rates and last_width read that dict.
  kernels_layout.py  "The line that builds the layout" (mask reordering: each group's active tokens
              made contiguous); kernels.py "dead tile" (a tile no token of its group runs returns
              before any load); engine.py, the Triton path that runs it all.
  baselines.py  static width, TEAL-style thresholds. The layer-skip baseline (one router of one group
              per layer, gating both residual branches) is trained like WIDE, so it lives here:
              WideConfig(method="layerskip").
"""
import contextlib
import glob
import json
import math
import os
import re
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import CheckpointError, Transformer, load_safetensors_dir, save_checkpoint

PENALTY_WEIGHT = 20.0  # the paper's (hard-coded) weight on the L1 sparsity penalty


@dataclass
class WideConfig:
    method: str = "wide"          # "wide" (head + channel groups) or "layerskip" (whole layers)
    target: float = 0.5           # shared target s*: the mean of the attention and FFN skip rates
    attn_target: float = None     # separate targets instead (both or neither)
    ffn_target: float = None
    attn_group_size: int = 0      # query heads per decision; 0 = n_heads // n_kv_heads (one KV group)
    ffn_group_size: int = 32      # contiguous intermediate channels per decision
    rank: int = 32                # router bottleneck (clipped to the model width)
    lora_rank: int = 0            # 0 = no LoRA (stage 1); stage 2 uses 16
    lora_alpha: float = 32.0
    stage: int = 1
    offsets: dict = None          # the dial calibrated to the target(s) above: {"attn": [L], "ffn": [L]}


def check_groups(model_cfg, wcfg):
    """Fill in the default attention group size and check that both group sizes divide."""
    if wcfg.attn_group_size < 0 or wcfg.ffn_group_size <= 0:
        raise ValueError(f"group sizes must be positive (attn_group_size {wcfg.attn_group_size}, "
                         f"ffn_group_size {wcfg.ffn_group_size}); attn_group_size 0 means one KV group")
    if wcfg.attn_group_size == 0:
        wcfg.attn_group_size = model_cfg.n_heads // model_cfg.n_kv_heads
    if model_cfg.n_heads % wcfg.attn_group_size:
        raise ValueError(f"attn_group_size {wcfg.attn_group_size} does not divide the {model_cfg.n_heads} "
                         f"query heads; pick a divisor such as {model_cfg.n_heads // model_cfg.n_kv_heads}")
    if model_cfg.intermediate_size % wcfg.ffn_group_size:
        raise ValueError(f"ffn_group_size {wcfg.ffn_group_size} does not divide the FFN size "
                         f"{model_cfg.intermediate_size}; pick a divisor such as 32")
    for name in ("target", "attn_target", "ffn_target"):
        v = getattr(wcfg, name)
        if v is not None and not 0.0 <= v < 1.0:
            raise ValueError(f"sparsity {name} = {v} is outside [0, 1)")
    if (wcfg.attn_target is None) != (wcfg.ffn_target is None):
        raise ValueError("give both separate targets (attention and FFN) or neither")
    return model_cfg.n_heads // wcfg.attn_group_size, model_cfg.intermediate_size // wcfg.ffn_group_size


# ----------------------------------------------------------------------------------------------------
# 1. the router


class Router(nn.Module):
    """Linear(D, r) -> Linear(r, 2G), no activation: a (execute, skip) logit pair per group.

    forward(x [B, T, D]) -> the mask [B, T, G] (1 = the group executes): a hard Gumbel-softmax sample
    with a straight-through gradient in training, the deterministic sign test in eval mode. The router
    keeps no state: the model collects what it returns (Transformer.forward's `masks`).

    Kept in fp32 even under bf16 autocast (the paper's are bf16): the decision is a sign test on a
    logit difference, and we want it to be the same whatever precision the backbone runs in.
    """

    def __init__(self, dim, n_groups, rank):
        super().__init__()
        self.n_groups = n_groups
        self.down = nn.Linear(dim, min(rank, dim))
        self.up = nn.Linear(min(rank, dim), 2 * n_groups)
        for lin in (self.down, self.up):
            nn.init.kaiming_uniform_(lin.weight, nonlinearity="linear")
            nn.init.zeros_(lin.bias)
        self.tau = 5.0  # Gumbel temperature, set by the stage's schedule (set_temperature)

    def logits(self, x):
        with torch.autocast(x.device.type, enabled=False):
            z = self.up(self.down(x.to(self.down.weight.dtype)))
        return z.view(*x.shape[:-1], self.n_groups, 2)  # [..., G, (execute, skip)]

    def forward(self, x):
        z = self.logits(x)
        if self.training:
            return hard_gumbel_softmax(z, self.tau)
        return (z[..., 1] <= z[..., 0]).float()  # skip iff z_skip > z_exec; a tie executes


def install_routers(model, wcfg):
    """Give every layer its routers (WIDE: attention + FFN; layer-skip: one per layer, G = 1)."""
    cfg = model.config
    n_attn, n_ffn = check_groups(cfg, wcfg)
    device = model.embed_tokens.weight.device
    for layer in model.layers:
        if wcfg.method == "wide":
            layer.attn_router = Router(cfg.dim, n_attn, wcfg.rank).to(device)
            layer.ffn_router = Router(cfg.dim, n_ffn, wcfg.rank).to(device)
        elif wcfg.method == "layerskip":
            layer.layer_router = Router(cfg.dim, 1, wcfg.rank).to(device)
        else:
            raise ValueError(f"unknown method {wcfg.method!r}; use wide or layerskip")
    return model


def routers(model):
    for layer in model.layers:
        for r in (layer.attn_router, layer.ffn_router, layer.layer_router):
            if r is not None:
                yield r


def routers_off(model):
    """Remove every router (the dense model, same weights, same engine); returns them for routers_on."""
    saved = [(l.attn_router, l.ffn_router, l.layer_router) for l in model.layers]
    for l in model.layers:
        l.attn_router = l.ffn_router = l.layer_router = None
    return saved


def routers_on(model, saved):
    for l, (a, f, g) in zip(model.layers, saved):
        l.attn_router, l.ffn_router, l.layer_router = a, f, g


# ----------------------------------------------------------------------------------------------------
# 2. straight-through: a hard 0/1 sample forward, the soft sample's gradient backward


def hard_gumbel_softmax(z, tau):
    """z [..., G, 2] (execute, skip) logits -> keep [..., G], exactly 0 or 1.

    The sample is the argmax of z + Gumbel noise, i.e. execute with probability softmax(z)[0] whatever
    tau is; tau only shapes the gradient, that of softmax((z + noise) / tau)[0].
    """
    gumbel = -torch.empty_like(z).exponential_().log()        # Gumbel(0, 1) noise
    soft = F.softmax((z + gumbel) / tau, dim=-1)
    hard = F.one_hot(soft.argmax(-1), 2).to(soft.dtype)
    # Straight-through: the forward value is exactly the hard sample (soft - soft.detach() == 0), the
    # backward pass uses the gradient of the soft sample.
    y = hard + (soft - soft.detach())
    return y[..., 0]


# ----------------------------------------------------------------------------------------------------
# 3. the temperature schedule


def temperature(step, steps, tau0=5.0, tau1=0.5):
    """Linear 5 -> 0.5 over a stage's optimizer steps (each stage starts again at 5)."""
    return tau0 - (tau0 - tau1) * step / max(1, steps - 1)


def set_temperature(model, tau):
    for r in routers(model):
        if isinstance(r, Router):
            r.tau = tau


# ----------------------------------------------------------------------------------------------------
# 4. skip rates


def skip_rates(masks, valid=None):
    """Fraction of groups skipped, per type, over valid tokens x layers x groups (padding excluded).

    masks: the dict a forward filled (Transformer.forward(..., masks=masks)): "attn" (head_mask), "ffn"
    (channel_mask) or "layer" (the layer-skip gate), each a list of one [B, T, G] mask per layer.
    valid: optional [B, T] bool/0-1 mask of real tokens. Returns {"attn": r, "ffn": r} (or {"layer": r}),
    each a differentiable scalar when the masks came from Gumbel samples.
    """
    rates = {}
    for name in ("attn", "ffn", "layer"):
        per_layer = []
        for keep in masks.get(name, []):
            skip = 1.0 - keep.float()                                  # [B, T, G]
            if valid is None:
                per_layer.append(skip.mean())
            else:
                v = valid.to(skip.dtype).unsqueeze(-1)
                per_layer.append((skip * v).sum() / (v.sum() * skip.shape[-1]).clamp(min=1))
        if per_layer:
            rates[name] = torch.stack(per_layer).mean()
    return rates


# ----------------------------------------------------------------------------------------------------
# 5. the penalty


def sparsity_penalty(rates, wcfg):
    """20 * |s* - mean rate| (shared target), or the mean of the two L1 terms (separate targets).

    wcfg None is the dense model (base pretraining): no routers, no penalty.
    """
    if wcfg is None:
        return 0.0
    if "layer" in rates:
        return PENALTY_WEIGHT * (wcfg.target - rates["layer"]).abs()
    if wcfg.attn_target is not None:
        return PENALTY_WEIGHT * 0.5 * ((wcfg.attn_target - rates["attn"]).abs()
                                       + (wcfg.ffn_target - rates["ffn"]).abs())
    return PENALTY_WEIGHT * (wcfg.target - 0.5 * (rates["attn"] + rates["ffn"])).abs()


# ----------------------------------------------------------------------------------------------------
# 6. LoRA (stage 2)


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A dropout(x), with W frozen; B starts at zero so training starts at W."""

    def __init__(self, base, rank, alpha, dropout=0.1):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + self.scale * F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)

    @torch.no_grad()
    def merged(self):
        """An ordinary Linear with W + (alpha/r) B A: the same function, no extra cost at inference."""
        w = self.base.weight
        lin = nn.Linear(self.base.in_features, self.base.out_features, bias=False, device=w.device, dtype=w.dtype)
        delta = self.scale * (self.lora_B.double() @ self.lora_A.double())
        lin.weight.copy_((self.base.weight.double() + delta).to(self.base.weight.dtype))
        return lin


# Every projection of a layer: Q, K, V and O of attention, gate, up and down of the FFN.
LORA_TARGETS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def install_lora(model, rank, alpha, dropout=0.1):
    for layer in model.layers:
        for parent, name in LORA_TARGETS:
            mod = getattr(layer, parent)
            setattr(mod, name, LoRALinear(getattr(mod, name), rank, alpha, dropout))
    return model


def merge_lora(model):
    for layer in model.layers:
        for parent, name in LORA_TARGETS:
            mod = getattr(layer, parent)
            if isinstance(getattr(mod, name), LoRALinear):
                setattr(mod, name, getattr(mod, name).merged())
    return model


# ----------------------------------------------------------------------------------------------------
# 7. FLOP accounting


def linear_flops(cfg, wcfg=None):
    """Per-token multiply-adds of each linear layer (x2 for FLOPs does not change any fraction)."""
    D, H, Hkv, d, I = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    f = dict(q=D * H * d, kv=2 * D * Hkv * d, o=H * d * D, ffn=3 * D * I, head=D * cfg.vocab_size)
    if wcfg is not None:  # the routers run for every token
        r = min(wcfg.rank, D)
        n_attn, n_ffn = check_groups(cfg, wcfg) if wcfg.method == "wide" else (0, 0)
        per_router = lambda g: D * r + r * 2 * g
        f["router"] = (per_router(n_attn) + per_router(n_ffn)) if wcfg.method == "wide" else per_router(1)
    return f


def flop_fraction(cfg, wcfg, keep_attn, keep_ffn, keep_layer=None):
    """Executed / dense linear FLOPs, given mean keep fractions per layer (lists of length L).

    K/V projections and the output head always run (the KV cache stays complete); a layer-skipped
    token still computes its K/V, as in the paper's baseline. Router FLOPs count as executed.
    """
    f = linear_flops(cfg, wcfg)
    L = cfg.n_layers
    dense = L * (f["q"] + f["kv"] + f["o"] + f["ffn"]) + f["head"]
    done = f["head"] + L * (f.get("router", 0) + f["kv"])
    for l in range(L):
        if keep_layer is not None:
            done += keep_layer[l] * (f["q"] + f["o"] + f["ffn"])
        else:
            done += keep_attn[l] * (f["q"] + f["o"]) + keep_ffn[l] * f["ffn"]
    return done / dense


def last_width(masks, cfg, wcfg):
    """Per token of a forward: the share of attention groups, FFN groups (or layers) it ran, and the
    fraction of linear FLOPs it executed. masks: the dict that forward filled (see skip_rates).
    Each value is [B, T], averaged over layers."""
    L = cfg.n_layers
    keep = {name: torch.stack([m.float().mean(-1) for m in masks[name]]).mean(0)
            for name in ("attn", "ffn", "layer") if masks.get(name)}
    if "layer" in keep:
        k = keep["layer"]
        return dict(layer=k, flops=flop_fraction(cfg, wcfg, None, None, [k] * L))
    a, f = keep["attn"], keep["ffn"]
    return dict(attn=a, ffn=f, flops=flop_fraction(cfg, wcfg, [a] * L, [f] * L))


# ----------------------------------------------------------------------------------------------------
# 8. checkpoints: the dense weights (HF layout) + router / LoRA tensors + wide.json


def save_wide(path, model, tokenizer, wcfg, train_state=None):
    extra = {f"model.{k}": v for k, v in model.state_dict().items() if "router" in k or "lora_" in k}
    files = {"wide.json": asdict(wcfg)}
    if train_state is not None:
        files["train_state.json"] = train_state
    save_checkpoint(path, model, tokenizer, extra_tensors=extra, extra_files=files)


def load_wide(path, device="cpu", dtype=torch.float32, merge=True, dial=True):
    """A WIDE or layer-skip checkpoint -> (model with routers, WideConfig). LoRA is merged by default;
    the dial calibrated at the end of training (wcfg.offsets) is folded into the routers unless dial=False
    (stage 2 starts from stage 1's raw routers; a new calibration starts from the raw routers too)."""
    file = os.path.join(path, "wide.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: {path!r} is not a router checkpoint (train one with train.py)")
    try:
        with open(file) as f:
            wcfg = WideConfig(**json.load(f))
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{file} is corrupt ({e})") from None
    model = Transformer.from_pretrained(path, device=device)  # fp32 until LoRA is merged
    install_routers(model, wcfg)
    if wcfg.lora_rank:
        install_lora(model, wcfg.lora_rank, wcfg.lora_alpha)
    state = load_safetensors_dir(path)
    extra = {k[len("model."):]: v for k, v in state.items() if "router" in k or "lora_" in k}
    expected = {k for k in model.state_dict() if "router" in k or "lora_" in k}
    if set(extra) != expected:
        raise CheckpointError(f"{path!r}: router/LoRA tensors do not match wide.json "
                              f"(missing {sorted(expected - set(extra))[:2]}, unexpected {sorted(set(extra) - expected)[:2]})")
    model.load_state_dict(extra, strict=False)
    if merge:
        merge_lora(model)
    if dial and wcfg.offsets:
        fold_offsets(model, wcfg.offsets)
    for name, p in model.named_parameters():  # routers stay fp32 (see Router); buffers (RoPE) too
        if "router" not in name:
            p.data = p.data.to(dtype)
    return model.eval(), wcfg


# ----------------------------------------------------------------------------------------------------
# 9. the sparsity dial: one checkpoint, any width
#
# Deterministic routing skips a group iff z_skip - z_exec > 0. The dial adds one offset per (layer,
# router type) to that gap: skip iff z_skip - z_exec + offset > 0 (a tie still executes). A positive
# offset skips more. calibrate() picks the offsets on training windows so that the realized skip rates
# are the requested ones; that corrects the drift of deterministic routing from the Gumbel-trained rate
# (stage 1 and 2 end with it, at their own target) and turns one checkpoint into any sparsity.

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


def collect_gaps(model, windows, offsets, batch_size=32):
    was = model.training
    model.eval()
    gaps = {}
    with torch.no_grad(), dialled(model, offsets, gaps):
        for i in range(0, len(windows), batch_size):
            model(windows[i:i + batch_size])
    model.train(was)
    return {k: torch.cat(v).double().cpu() for k, v in gaps.items()}  # the solves below run on the CPU


def solve_shift(gaps, target, iters=60):
    """Bisection on one common logit shift c: the mean over these routers of their Gumbel-sampled skip
    rate, mean sigmoid(gap + c) (what the training penalty held on target), equals `target`."""
    rate = lambda c: torch.stack([torch.sigmoid(g + c).mean() for g in gaps]).mean().item()
    lo, hi = -60.0, 60.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < target else (lo, mid)
    return (lo + hi) / 2


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


def calibrate(model, windows, target=None, attn_target=None, ffn_target=None):
    """Per-(layer, router type) offsets such that deterministic routing on `windows` [N, T] skips, on
    average, `target` of the groups (shared: the mean of attention and FFN, or the layer-skip rate), or
    attn_target / ffn_target separately. Deterministic: no randomness, a fixed visiting order.

    Which layer skips how much is the routers' own choice: one common shift c per target (bisection,
    solve_shift) moves every router's Gumbel-sampled rate, and each router then gets the offset at which
    its deterministic rate equals its own shifted sampled rate (solve_offset). Routers are calibrated in
    forward order, each with the offsets of the earlier ones applied (they change its input).
    Returns ({kind: [offset per layer]}, {kind: [realized rate per layer on the windows]})."""
    gaps = collect_gaps(model, windows, None)
    kinds = sorted({k for k, _ in gaps})
    if attn_target is not None:
        groups = {("attn",): attn_target, ("ffn",): ffn_target}
    else:
        groups = {tuple(kinds): target}
    want = {}
    for members, t in groups.items():
        c = solve_shift([g for (k, _), g in gaps.items() if k in members], t)
        want.update({key: torch.sigmoid(g + c).mean().item() for key, g in gaps.items() if key[0] in members})
    offsets = {k: [0.0] * len(model.layers) for k in kinds}
    for n, (kind, i, _) in enumerate(router_list(model)):
        gap = gaps[(kind, i)] if n == 0 else collect_gaps(model, windows, offsets)[(kind, i)]
        offsets[kind][i] = solve_offset(gap, want[(kind, i)])
    final = collect_gaps(model, windows, offsets)
    realized = {k: [(final[(k, i)] + offsets[k][i] > 0).double().mean().item() for i in range(len(model.layers))]
                for k in kinds}
    return offsets, realized


def describe_offsets(offsets):
    return " ".join(f"{k} [" + " ".join(f"{o:+.2f}" for o in v) + "]" for k, v in offsets.items())


# Choosing and caching a dial for generate.py and eval.py.

def trained_target(wcfg):
    return 0.5 * (wcfg.attn_target + wcfg.ffn_target) if wcfg.attn_target is not None else wcfg.target


def nearest_checkpoint(out_dir, method, target):
    """The router checkpoint under out_dir whose trained target is nearest `target` (stage 2 before
    stage 1, then the lower target on a tie), or a CheckpointError naming the command that trains one."""
    found = []
    for path in glob.glob(os.path.join(out_dir, f"{method}-*-stage[12]")):
        m = re.fullmatch(rf"{method}-(?:s([0-9.]+)|a([0-9.]+)-f([0-9.]+))-stage([12])", os.path.basename(path))
        if m and os.path.isfile(os.path.join(path, "wide.json")):
            t = float(m[1]) if m[1] else (float(m[2]) + float(m[3])) / 2
            found.append((abs(t - target), -int(m[4]), t, path))
    if not found:
        raise CheckpointError(f"no {method} router checkpoint in {out_dir}/ to dial to sparsity {target:g}; "
                              f"train one with: python train.py --method {method} --sparsity {target:g}")
    return min(found)[3]


def load_dialled(path, target=None, attn_target=None, ffn_target=None, device="cpu", dtype=torch.float32,
                 block_size=128):
    """A router checkpoint dialled to a sparsity: (model, wcfg, dial). At the checkpoint's own target the
    offsets calibrated in training are used; otherwise the raw routers are calibrated on training windows
    and the offsets cached in PATH/dial.json (written atomically). dial: {"offsets", "targets", "source"}."""
    model, wcfg = load_wide(path, device=device, dtype=dtype, dial=False)
    if wcfg.method == "layerskip" and attn_target is not None:
        raise CheckpointError(f"{path!r} is a layer-skip checkpoint: give --sparsity, not attention/FFN targets")
    own = ((attn_target, ffn_target) == (wcfg.attn_target, wcfg.ffn_target) if attn_target is not None
           else wcfg.attn_target is None and target == wcfg.target)
    targets = dict(attn=attn_target, ffn=ffn_target) if attn_target is not None else dict(sparsity=target)
    if own and wcfg.offsets:
        fold_offsets(model, wcfg.offsets)
        return model, wcfg, dict(offsets=wcfg.offsets, targets=targets, source="calibrated in training (wide.json)")
    if own and wcfg.offsets is None and target is not None:  # a checkpoint from before the dial: as trained
        return model, wcfg, dict(offsets=None, targets=targets, source="routers as trained: this checkpoint has no calibrated dial")
    key = " ".join(f"{k}={v:g}" for k, v in targets.items()) + f" windows={CALIB_WINDOWS}x{block_size}"
    cache = os.path.join(path, "dial.json")
    saved = {}
    if os.path.isfile(cache):
        try:
            with open(cache) as f:
                saved = json.load(f)
        except json.JSONDecodeError:
            saved = {}  # a damaged cache is only a cache: calibrate again and rewrite it
    if key in saved:
        offsets, source = saved[key]["offsets"], f"cached in {cache}"
    else:
        import data  # the training plays and the checkpoint's own tokenizer
        from model import load_tokenizer
        stream = data.encode_plays(load_tokenizer(path), data.split_plays()[0])
        windows = data.calibration_windows(stream, block_size, CALIB_WINDOWS, CALIB_SEED)
        offsets, realized = calibrate(model, windows.to(device), target, attn_target, ffn_target)
        saved[key] = dict(offsets=offsets, realized_on_windows=realized)
        source = f"calibrated on {CALIB_WINDOWS} training windows, cached in {cache}"
        try:
            with open(cache + ".tmp", "w") as f:
                json.dump(saved, f, indent=1)
            os.replace(cache + ".tmp", cache)
        except OSError:
            source = f"calibrated on {CALIB_WINDOWS} training windows (not cached: {path} is not writable)"
    fold_offsets(model, offsets)
    return model, wcfg, dict(offsets=offsets, targets=targets, source=source)

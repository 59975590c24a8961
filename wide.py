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
  8. (ours, for serving) FFNRule: the FFN width of a decode step of many rows (the batch and vote rules).

Where to look for the rest:
  model.py    the two lines marked "WIDE:": head_mask multiplies the head outputs before o_proj, and
              channel_mask the SwiGLU product before down_proj (training and the torch backend: dense
              compute, skipped work zeroed). Every Block appends the masks its routers returned to the
              `masks` dict of Transformer.forward; skip_rates and last_width read that dict.
  kernels_layout.py  "The line that builds the layout" (mask reordering: each group's live tokens
              made contiguous).
  kernels.py, kernels_gemv.py, kernels_attention.py  the lines marked "WIDE skip:", where skipped work is never done:
              the decode GEMV's live-group list (gemm_mn reads only the weight rows of groups some token
              of the step runs), gemm_k's live groups (only their weight columns are read), the dead-tile
              exits of gemm_mn and prefill attention (a tile no token of its group runs returns before
              any load), and decode attention's KV-head skip (a row's KV head whose query-head groups are
              all off is never read). tests/test_skipped_work.py records every load and checks it.
  policy.py, engine.py  which op runs where for each step's shape (Policy.plan; Policy.layer_plan decides
              op by op, and names every token-count threshold), and the Triton path that runs the plan.
  dial.py     the sparsity dial: per-(layer, router type) offsets on the skip-minus-execute gap, calibrated
              so that deterministic routing realizes a requested sparsity (any S from one checkpoint).
  checkpoints.py  router checkpoints (the dense weights + router / LoRA tensors + wide.json), the run
              directory names, a checkpoint dialled to any sparsity.
  baselines.py  static width, TEAL-style thresholds. The layer-skip baseline (one router of one group
              per layer, gating both residual branches) is trained like WIDE, so it lives here:
              WideConfig(method="layerskip").
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

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


def trained_target(wcfg):
    """The sparsity a checkpoint was trained to: its shared target, or the mean of the separate ones."""
    return 0.5 * (wcfg.attn_target + wcfg.ffn_target) if wcfg.attn_target is not None else wcfg.target


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


def dense_flops(cfg):
    """The denominator of every FLOP fraction: a dense token's linear multiply-adds, every layer's Q, K, V,
    O and FFN projections and the output head (no routers: they are WIDE's cost, counted as executed)."""
    f = linear_flops(cfg)
    return cfg.n_layers * (f["q"] + f["kv"] + f["o"] + f["ffn"]) + f["head"]


def flop_fraction(cfg, wcfg, keep_attn, keep_ffn, keep_layer=None):
    """Executed / dense linear FLOPs, given mean keep fractions per layer (lists of length L).

    K/V projections and the output head always run (the KV cache stays complete); a layer-skipped
    token still computes its K/V, as in the paper's baseline. Router FLOPs count as executed.
    """
    f = linear_flops(cfg, wcfg)
    L = cfg.n_layers
    done = f["head"] + L * (f.get("router", 0) + f["kv"])
    for l in range(L):
        if keep_layer is not None:
            done += keep_layer[l] * (f["q"] + f["o"] + f["ffn"])
        else:
            done += keep_attn[l] * (f["q"] + f["o"]) + keep_ffn[l] * f["ffn"]
    return done / dense_flops(cfg)


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
# 8. serving (ours, not the paper's): the FFN width of a decode step of many rows


@dataclass(frozen=True)
class FFNRule:
    """How a decode step of several rows (one token each, as serve.py batches requests) sets its FFN width.

    A decode step reads every FFN group some row runs, and the union of a few tokens' channel masks covers
    nearly every group (results/mask_union.md): per-token routing then saves no weight bytes and its router
    and masks only cost time. So, with routing per row kept for attention (its KV-head skip pays anyway):
      the batch rule (default): a decode step of more than `max_rows` rows runs the whole FFN, its routers
        not asked: a token gets more FFN width than its router asked for, never less (None: always route);
      the vote rule (`vote` = k, replacing the batch rule): a group runs for every row of a decode step iff
        at least k rows want it (all of them, if the step has fewer): fewer weight bytes, at a quality cost
        (eval.py's batch-shared rows), and a token may lose a group its router asked for.
    Either way a request's output depends on its batch, as with MoE capacity limits. model.py applies the
    rule; the Triton engine's plan (policy.py) reads it, so the two paths stay equal.
    """
    max_rows: int = 4
    vote: int = None

    def routes(self, rows, decode):
        """Whether a step asks its FFN routers: always, except a decode step of more than max_rows rows
        while the vote rule is off."""
        return not decode or self.vote is not None or self.max_rows is None or rows <= self.max_rows

    def votes_needed(self, rows, decode):
        """The rows a group needs under the vote rule in a decode step of `rows` rows; None: no vote."""
        return min(self.vote, rows) if decode and self.vote is not None else None


def shared_by_vote(mask, k):
    """mask [B, 1, G] of one decode step -> the same shape: a group runs for every row iff >= k rows want it."""
    return (mask.sum(0, keepdim=True) >= k).to(mask.dtype).expand_as(mask)

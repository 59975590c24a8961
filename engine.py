"""
The Triton inference path: the model of model.py (and the routers of wide.py), run so that the work of
every skipped group is never done. A one-token decode step, layer by layer (policy.py plans every shape):

    x ─► norm_route: residual add + RMSNorm + the attention router's first Linear, one kernel
      ─► gemm_mn's decode GEMV: the router's rule (head_mask), Q's live groups, then K and V as its dense tail,
         RoPE and the KV-cache write in its epilogue ─► decode attention over the live KV heads ─► gemm_k: O, + x
      ─► norm_route (FFN router) ─► gemm_mn: its rule, gate+up's live groups, silu(gate)*up ─► gemm_k: down, + x

`select(model, backend)` is the one switch: "torch" returns the model itself (the reference), "triton" an
`Engine` over the same weights, whose ops run their Triton kernels (on a GPU, or under TRITON_INTERPRET=1 on
a CPU) or cuBLAS / SDPA where the plan says so, never a twin. fp8 weights (`weights="fp8"`): the prunable
linears quantized once to e4m3, one scale per output channel, read as codes by the decode kernels.
CUDAGraphDecoder replays a decode step as a CUDA graph (generate.py, serve.py, the benchmarks), CUDAGraphPrefill
a prefill chunk (serve.py).
"""
import contextlib
import time
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import cli
import data
import kernels
import kernels_gemv
from kernels_attention import attention_decode, attention_prefill
from kernels_base import INTERPRET, pow2_divisor
from kernels_layout import layout
from dial import CALIB_SEED, CALIB_WINDOWS
from kernels_step import (norm_route, norm_route_deferred, quantize_rows, quantize_rows_ref, rms_norm, rope_and_store,
                          swiglu_rows)
from policy import NORM_ROUTE_SPLIT_MAX_TOKENS, NORM_ROUTE_TILE, Plan, Policy, Shape
from wide import shared_by_vote


def why_not_ready(model):
    """None if the kernels can run every layer of this model, else the reason (one line)."""
    d = model.config.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    for layer in model.layers:
        a, f = layer.self_attn, layer.mlp
        if any(type(m) is not nn.Linear for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                   f.gate_proj, f.up_proj, f.down_proj)):
            return "a projection is not a plain Linear (merge LoRA first; TEAL runs the reference path)"
        if layer.layer_router is not None:
            return "layer-skip routers run the reference path"
        n_ffn = n_groups(layer.ffn_router)
        if n_ffn and (f.gate_proj.out_features // n_ffn) % 16:
            return f"FFN groups of {f.gate_proj.out_features // n_ffn} channels are not a multiple of 16"
    return None


def fuse_weights(layer):
    """Re-lay one layer's projections once, at load time: Q, K, V as rows of one tensor and gate, up as
    rows of another; returns (wqkv, wgu). The model's Linear weights become views into them (same
    values, same memory), so the reference path is untouched, while the engine reads K and V (and the
    dense model Q, K, V, or gate and up) with one GEMM each: the dense baseline at its best."""
    a, f = layer.self_attn, layer.mlp
    fused = []
    for parts in ((a.q_proj, a.k_proj, a.v_proj), (f.gate_proj, f.up_proj)):
        w = torch.cat([p.weight.detach() for p in parts])
        for p, rows in zip(parts, w.split([p.weight.shape[0] for p in parts])):  # views into w
            p.weight = nn.Parameter(rows, requires_grad=False)
        fused.append(w)
    return tuple(fused)


@torch.no_grad()
def fp8_model(model, activations=False):
    """The torch model that computes what Engine(weights="fp8") does, made in place (eval.py's fp8 rows, the
    tests' reference): each prunable linear's weight replaced by the values its fp8 codes stand for (the
    decode kernels' scheme, weights only); activations=True: each also quantizes its input per token and
    computes as kernels.scaled_mm does (the "fp8 x fp8" ops of the plan)."""
    for layer in model.layers:
        a, f = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj):
            codes, scale = kernels.quantize_fp8(lin.weight)
            lin.weight.copy_(kernels.dequantize_fp8(codes, scale, lin.weight.dtype))
            if activations:
                lin.forward = lambda x, codes=codes, scale=scale: fp8_linear(x, codes, scale)
    return model


def fp8_linear(x, codes, scale):
    # As the "fp8 x fp8" ops compute: x quantized per token, the codes' products summed in fp32, both scales,
    # one rounding to x's dtype (outside any autocast, which would round the sums to bf16 first).
    with torch.autocast(x.device.type, enabled=False):
        a = quantize_rows_ref(x.reshape(-1, x.shape[-1]))
        return kernels.scaled_mm_ref(a, codes, scale, x.dtype).view(*x.shape[:-1], -1)


def fp8_weights(model, weights, tokenizer):
    """--weights of generate.py and serve.py as select takes it: "fp8-gptq" first rounds the prunable linears
    to GPTQ's codes (kernels.calibrate_fp8) on the dial's calibration windows of the training plays; then "fp8"."""
    if weights == "fp8-gptq":
        windows = data.dial_windows(tokenizer, min(256, model.config.max_seq_len), CALIB_WINDOWS, CALIB_SEED)
        kernels.calibrate_fp8(model, windows.to(model.embed_tokens.weight.device).split(16))
    return "fp8" if weights == "fp8-gptq" else weights


def backend_of(model, backend):
    """What select runs for `backend`: "torch" or "triton" ("auto": triton on a CUDA model the kernels take)."""
    if backend not in ("torch", "triton", "auto"):
        raise ValueError(f"backend must be torch, triton or auto, got {backend!r}")
    if backend == "auto":
        backend = "triton" if model.embed_tokens.weight.is_cuda and why_not_ready(model) is None else "torch"
    return backend


def select(model, backend="auto", policy=None, weights="bf16"):
    """The one backend switch (backend_of): "torch" -> the model itself, "triton" -> Engine(model), both model(idx)."""
    return model if backend_of(model, backend) == "torch" else Engine(model, policy, weights)


def n_groups(router):
    """How many groups a router decides over (wide.Router, baselines.FixedMask); 0 without a router."""
    return getattr(router, "n_groups", 0)


def router_kind(router):
    """How policy.plan sees a router: None, "wide" (a wide.Router in fp32: the fused norm_route kernel
    takes it) or "other" (another router module, e.g. baselines.FixedMask: the module itself runs)."""
    if router is None:
        return None
    down = getattr(router, "down", None)
    return "wide" if isinstance(down, nn.Linear) and down.weight.dtype == torch.float32 else "other"


class StepInputs(NamedTuple):
    decode: bool            # one token per row attending to the cache; else a prefill from position `start`
    cos: torch.Tensor       # [B*T, head_dim] per token
    sin: torch.Tensor
    slot: torch.Tensor      # [B*T] the cache slot of each token's K/V (its position; t without a cache)
    kv_len: torch.Tensor    # [B] int32 cache length after this decode step (None for a prefill)
    all_heads: torch.Tensor  # [B, 1] all True: the dense model's decode attention
    visible: torch.Tensor   # [B, 1, 1, L] cache slots each row may see (the "decode_sdpa" attention)
    start: int              # a prefill's first position: 0, or where a chunk of a longer prompt begins
    start_t: torch.Tensor = None  # the same on the device ([1]: input_pos[0]), as the prefill kernel reads it
    every_head: object = None  # the layout of every head group live, for the "prefill_every" attention of a
                               # dense layer's later chunk: built once per step (plan op step_every_head)
    plan: Plan = None       # what runs where in this step (policy.py)


class Engine:
    """model(idx, input_pos=None, logits_at=None, masks=None) with the pruned ops in Triton kernels."""

    def __init__(self, model, policy=None, weights="bf16"):
        if weights not in ("bf16", "fp8"):
            raise ValueError(f"weights must be bf16 (the model's own dtype) or fp8, got {weights!r}")
        problem = why_not_ready(model)
        if problem:
            raise cli.UserError(f"backend triton cannot run this model: {problem}; use --backend torch")
        if not (model.embed_tokens.weight.is_cuda or INTERPRET):
            raise cli.UserError("backend triton needs the model on a CUDA GPU (or TRITON_INTERPRET=1 on a CPU); "
                             "use --backend torch")
        self.model, self.config, self.policy = model, model.config, policy or Policy()
        with torch.no_grad():
            self.fused = {id(layer): fuse_weights(layer) for layer in model.layers}  # -> (wqkv, wgu)
            # fp8: each prunable weight once as (e4m3 codes, fp32 scale per output channel). The model's
            # own weights stay as they are; the engine never reads them for these linears again.
            self.weights, self.fp8 = weights, {}
            if weights == "fp8":
                self.fp8 = {id(layer): dict(qkv=kernels.quantize_fp8(wqkv), gu=kernels.quantize_fp8(wgu),
                                            o=kernels.quantize_fp8(layer.self_attn.o_proj.weight),
                                            down=kernels.quantize_fp8(layer.mlp.down_proj.weight))
                            for layer in model.layers for wqkv, wgu in [self.fused[id(layer)]]}
        device = model.embed_tokens.weight.device
        # Zeroed counters the kernels take tickets from and leave zero again (norm_route's token tiles,
        # gemm_k's split, decode attention's merge); kernels on one stream run one after another, so one
        # buffer serves them all.
        self.tickets = torch.zeros(4096, dtype=torch.int32, device=device)
        self.plans = {}  # (Shape, routers) -> Plan: a step's plan is computed once per shape
        self.constant_masks = {}  # (M, G) -> an all-True mask, for the dense model's ops through WIDE's kernels
        # The plan's "_side" routers run here, beside the main stream's kernels: tickets of their own
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.side_tickets = torch.zeros(4096, dtype=torch.int32, device=device)

    def join(self, norm_op):
        """Before the first read of a mask its router made on the side stream: the layer waits for it there."""
        if norm_op.kind.endswith("_side") and self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)

    def setup_caches(self, *args, **kwargs):
        return self.model.setup_caches(*args, **kwargs)

    def clear_caches(self):
        return self.model.clear_caches()

    def step_plan(self, tokens, decode, start=0):
        """The plan of a step of `tokens` tokens (B * T) with the model's routers as they are now."""
        dtype = self.model.embed_tokens.weight.dtype
        shape = Shape(tokens, decode, start, {torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, "bf16"),
                      self.weights == "fp8")
        routers = tuple((router_kind(l.attn_router), router_kind(l.ffn_router)) for l in self.model.layers)
        if decode and any(f is not None for _, f in routers):  # the model's FFN rule, if it routes the FFN
            rule = self.model.ffn_rule
            shape = shape._replace(dense_ffn=not rule.routes(tokens, True), ffn_vote=rule.votes_needed(tokens, True) or 0)
        if (shape, routers) not in self.plans:
            self.plans[shape, routers] = self.policy.plan(shape, routers)
        return self.plans[shape, routers]

    def describe(self, batch, prompt_len):
        """Where each op runs in a generation of `batch` prompts of `prompt_len` tokens: the plans of its
        prefill and of its decode steps, as generate.py --backend triton prints them."""
        return self.step_plan(batch * prompt_len, False).text() + "\n" + self.step_plan(batch, True).text()

    def inputs(self, idx, input_pos, start=None):
        m = self.model
        if m.training or torch.is_grad_enabled():
            raise RuntimeError("the Triton engine is inference only: call it under torch.no_grad() on an "
                               "eval() model (training runs the torch backend)")
        B, T = idx.shape
        cached = m.causal_mask is not None
        if input_pos is not None and not cached:
            raise ValueError("input_pos needs a KV cache: call setup_caches(batch_size) first")
        if input_pos is None:
            decode, start = False, 0
        elif T == 1:
            decode, start = True, 0
        elif input_pos.dim() == 1:  # a prefill, or a chunk of one at positions start..start+T-1
            # start: given by the caller (a CUDA graph: no host read), or one host sync per prefill. The kernels
            # read it from input_pos; the plan only needs whether it is 0.
            decode, start = False, int(input_pos[0]) if start is None else start
        else:
            raise ValueError("the Triton engine runs prefills (whole or chunked) at shared positions and "
                             "one-token decode steps; several tokens at per-row positions need the torch backend")
        plan = self.step_plan(B * T, decode, start)
        pos = (torch.arange(T, device=idx.device) if input_pos is None else input_pos).expand(B, T)
        cos, sin = m.rope(pos)                                           # [B, T, head_dim]
        d = cos.shape[-1]
        cos, sin = cos.reshape(B * T, d).contiguous(), sin.reshape(B * T, d).contiguous()
        slot = (pos if cached else torch.arange(T, device=idx.device).expand(B, T)).reshape(B * T).contiguous()
        kv_len = (pos[:, 0] + 1).to(torch.int32) if decode else None
        all_heads = torch.ones(B, 1, dtype=torch.bool, device=idx.device)
        visible = None
        if any(ops["attention"].kind == "decode_sdpa" for ops in plan.layers):
            L = m.causal_mask.shape[0]
            visible = (torch.arange(L, device=idx.device) < kv_len[:, None])[:, None, None]
        every_head = None
        if "step_every_head" in plan.step:
            every_head = layout(torch.ones(B, T, m.config.n_kv_heads, dtype=torch.bool, device=idx.device))
        start_t = (input_pos.reshape(-1)[:1].to(idx.device) if input_pos is not None else
                   torch.zeros(1, dtype=torch.long, device=idx.device))
        return StepInputs(decode, cos, sin, slot, kv_len, all_heads, visible, start, start_t, every_head, plan)

    def __call__(self, idx, input_pos=None, logits_at=None, masks=None, start=None):
        """idx [B, T] -> logits [B, T, vocab] (or [B, 1, vocab] at logits_at), as Transformer.forward.
        start: a prefill chunk's first position (input_pos[0]) when the caller knows it (no host read)."""
        m = self.model
        B, T = idx.shape
        if input_pos is None and T > self.config.max_seq_len:
            raise ValueError(f"{T} tokens do not fit the context of {self.config.max_seq_len}")
        step = self.inputs(idx, input_pos, start)
        x, delta = m.embed_tokens(idx), None
        for layer, ops in zip(m.layers, step.plan.layers):
            x, delta = self.block(layer, ops, x, delta, step, masks)
        if logits_at is not None:
            rows = torch.arange(B, device=x.device), logits_at
            x, delta = x[rows][:, None], None if delta is None else delta[rows][:, None]
        normed = rms_norm(x, m.norm) if delta is None else rms_norm(delta, m.norm, residual=x)[1]
        return F.linear(normed, m.head_weight())

    def block(self, layer, ops, x, delta, step, masks):
        """One layer, as its plan says: the residual stream x (+ delta, the previous layer's FFN output where its
        down projection left the add to this layer) -> the next layer's (x, delta)."""
        if delta is None:
            n, head_mask, head_live, rule = self.norm_route(ops["attn_norm"], x, layer.input_layernorm,
                                                            layer.attn_router, masks, "attn")
        else:
            (x, n), head_mask, head_live, rule = self.norm_route(ops["attn_norm"], delta, layer.input_layernorm,
                                                                 layer.attn_router, masks, "attn", residual=x)
        a = self.attention(layer, ops, n, step, head_mask, head_live, residual=x, decision=rule)
        vote = step.plan.shape.ffn_vote or None  # the vote rule: the rows an FFN group needs (wide.FFNRule)
        if ops["o"].runs == "Triton":  # the O projection's kernel already formed h = x + a
            h = a
            n, channel_mask, channel_live, rule = self.norm_route(ops["ffn_norm"], h, layer.post_attention_layernorm,
                                                                  layer.ffn_router, masks, "ffn", vote=vote)
        else:                          # the norm's kernel forms it: (h, norm(h)) with h = x + a
            (h, n), channel_mask, channel_live, rule = self.norm_route(
                ops["ffn_norm"], a, layer.post_attention_layernorm, layer.ffn_router, masks, "ffn", x, vote)
        return self.ffn(layer, ops, n, channel_mask, channel_live, residual=h, decision=rule)

    def norm_route(self, op, x, norm, router, masks, kind, residual=None, vote=None):
        """(norm(x) or (h, norm(h)) with h = residual + x, the router's bool mask [B, T, G] on x or h (True = the
        group runs; None without a router; shared by the rows under the vote rule: vote = the rows a group needs),
        its live list (None where made apart from norm_route), the kernels_step.Decision the decode GEMV finishes
        (or None)). The float mask goes into `masks` as the reference records it."""
        live = decision = None
        if op.kind in ("norm", "norm_fp8"):  # norm_fp8: the output as fp8 rows, for _scaled_mm
            if router is not None and masks is not None:  # the batch rule: every group ran, as the model records
                masks.setdefault(kind, []).append(x.new_ones(*x.shape[:-1], router.n_groups, dtype=torch.float32))
            return rms_norm(x, norm, residual, fp8=op.kind == "norm_fp8"), None, None, None
        if op.kind == "norm_route_deferred":  # one token: the mask's buffers, which the GEMV after it fills
            normed, decision = norm_route_deferred(x, norm, router, residual, self.tickets)
            keep, keepf, live = decision[:3]
        elif op.kind == "norm_route":
            normed, keep, keepf, live = self.fused_route(x, norm, router, residual, self.tickets)
        else:  # the plain norm, then the router: in line, or beside the GEMMs on the side stream ("_side")
            normed = rms_norm(x, norm, residual)
            side = self.side if op.kind.endswith("_side") else None
            if side is not None:  # it starts once the norm's inputs are written; the layer joins it (self.join)
                side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                if op.kind == "norm_route_side":  # norm_route's own decision (its h and norm unread)
                    _, keep, keepf, _ = self.fused_route(x, norm, router, residual, self.side_tickets)
                else:  # "norm_then_router", "norm_then_router_side": the router module
                    keepf = router(x if residual is None else normed[0])  # at inference exactly 0 or 1
                    keep = keepf > 0.5
        if vote is not None:
            keepf = shared_by_vote(keepf.float(), vote)
            keep, live = keepf > 0.5, None  # the vote changed the mask: the kernels list its groups themselves
        if masks is not None:
            masks.setdefault(kind, []).append(keepf)
        return normed, keep, live, decision

    def fused_route(self, x, norm, router, residual, tickets):
        # norm_route at the policy's sizes: decode-sized steps keep NORM_ROUTE_TILE (one tile gives the live list)
        pol = self.policy
        tile = pol.router_split_tile if x.shape[0] * x.shape[1] > NORM_ROUTE_SPLIT_MAX_TOKENS else NORM_ROUTE_TILE
        return norm_route(x, norm, router, residual, tickets, split_max_tokens=pol.router_split_max_tokens,
                          tile_tokens=tile)

    def linear_weights(self, layer, name, op):
        """(weight, fp8 scale or None) as the op reads it: the model dtype, the fp8 codes, or the values
        the fp8 codes stand for (a prefill on an fp8 engine)."""
        w = {"qkv": self.fused[id(layer)][0], "o": layer.self_attn.o_proj.weight,
             "gu": self.fused[id(layer)][1], "down": layer.mlp.down_proj.weight}[name]
        if op.weights in ("fp8", "fp8 x fp8"):
            return self.fp8[id(layer)][name]
        if op.weights.startswith("fp8 -> "):
            return kernels.dequantize_fp8(*self.fp8[id(layer)][name], w.dtype), None
        return w, None

    def matmul(self, x, layer, name, op):
        """x @ w.T for an op on a library GEMM: cuBLAS (F.linear) on the weights linear_weights gives, or, for
        "fp8 x fp8", torch._scaled_mm on the fp8 codes with x quantized per token here (unless x comes as
        Fp8Rows: the norm, or the SwiGLU before down, quantized it)."""
        w, scale = self.linear_weights(layer, name, op)
        if op.weights != "fp8 x fp8":
            return F.linear(x, w)
        if not isinstance(x, kernels.Fp8Rows):
            x = quantize_rows(x)
        one = self.policy.fp8_tensorwise_one_token and x.codes.shape[0] == 1
        return kernels.scaled_mm(x, w, scale, self.model.embed_tokens.weight.dtype, tensorwise=one)

    def attention(self, layer, ops, x, step, head_mask, head_live, residual, decision=None):
        """Attention with head_mask bool [B, T, G] or None (dense), head_live its live list (or None). Returns
        residual + attention where the O projection runs in Triton (its kernel adds the residual in its
        epilogue), else attention alone."""
        attn = layer.self_attn
        B, T, _ = residual.shape
        M, H, Hkv, d = B * T, attn.n_heads, attn.n_kv_heads, attn.head_dim
        nq = H * d
        x2 = x if isinstance(x, kernels.Fp8Rows) else x.reshape(M, -1)  # fp8 rows: the norm quantized it
        if head_mask is not None:
            mask, gs = head_mask.reshape(M, -1), H // head_mask.shape[-1] * d
        if attn.kv_cache is not None:  # K/V are never pruned: the static cache stays complete
            kc, vc = attn.kv_cache.k_cache, attn.kv_cache.v_cache
        else:
            kc, vc = (torch.empty(B, Hkv, T, d, dtype=residual.dtype, device=residual.device) for _ in range(2))
        op = ops["qkv"]
        wqkv, s8 = self.linear_weights(layer, "qkv", op) if op.runs.startswith("Triton") else (None, None)
        beside = ops["attn_norm"].kind.endswith("_side")
        if op.kind == "tiles" and beside:  # K and V first: their GEMM runs beside the side stream's router
            kv = F.linear(x2, wqkv[nq:])
        if "attn_layout" in ops:
            # The layout (mask reordering), built once per router decision: Q proj and attention share it.
            self.join(ops["attn_norm"])
            lay = layout(head_mask)
        # The decode GEMV does RoPE and the KV-cache write in its epilogue (the plan has no separate rope op).
        rope = None if "rope" in ops else kernels_gemv.Rope(step.cos, step.sin, step.slot, kc, vc, nq, Hkv * d, T)
        if op.kind == "gemv":
            # Q's live groups, then K and V (never pruned), as one weight stream in one launch.
            qkv = kernels.gemm_mn(x2, wqkv, mask, gs, dense_tail=wqkv.shape[0] - nq, w_scale=s8, rope=rope,
                                  decision=decision)
        elif op.kind == "gemv_all":  # every row as the dense tail: mask [M, 0]
            qkv = kernels.gemm_mn(x2, wqkv, self.no_groups(M), pow2_divisor(wqkv.shape[0], max(128, d)),
                                  dense_tail=wqkv.shape[0], w_scale=s8, rope=rope)
        elif op.kind == "tiles":
            # Q proj, live groups only; pruned slots stay unwritten (attention never reads them).
            q = kernels.gemm_mn(x2, wqkv[:nq], lay, gs, zero_pruned=False)
            kv = kv if beside else F.linear(x2, wqkv[nq:])  # K and V in one GEMM: never pruned
        else:  # "cublas", "cublas_every_head": Q, K, V in one GEMM
            qkv = self.matmul(x2, layer, "qkv", op)
        if rope is not None:  # qkv is Q, rotated; K and V are in the cache
            q = qkv.view(B, T, H, d).transpose(1, 2)
        else:
            if op.kind != "tiles":
                q, kv = qkv[:, :nq], qkv[:, nq:]
            k, v = kv[:, :Hkv * d], kv[:, Hkv * d:]
            q = rope_and_store(q, k, v, step, kc, vc, H, Hkv, d).view(B, T, H, d).transpose(1, 2)
        kind, S = ops["attention"].kind, step.start  # a prefill chunk at `start` sees the start + T keys before it
        zeroed = kind.endswith("_zeroed")  # every head runs, then the pruned heads' outputs are set to 0
        kind = kind.removesuffix("_zeroed")
        if not zeroed:  # the attention kernel reads the mask (a side stream's router joins here)
            self.join(ops["attn_norm"])
        if kind == "decode_live":
            y = attention_decode(q, kc, vc, mask, step.kv_len, tickets=self.tickets)  # skips idle KV heads
        elif kind == "decode_every":
            y = attention_decode(q, kc, vc, step.all_heads, step.kv_len, tickets=self.tickets)
        elif kind == "decode_sdpa":
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=step.visible, enable_gqa=Hkv != H)
        elif kind == "prefill_live":  # (causal: the kernel reads no key past the chunk's last)
            y = attention_prefill(q, kc, vc, lay, start=step.start_t)
        elif kind == "prefill_every":
            y = attention_prefill(q, kc, vc, step.every_head, start=step.start_t)
        elif kind == "sdpa_causal":  # the dense baseline at its best (cuDNN / flash through SDPA)
            y = F.scaled_dot_product_attention(q, kc[:, :, :T], vc[:, :, :T], is_causal=True, enable_gqa=Hkv != H)
        else:  # "sdpa_rows": rows S.. of the model's causal mask say which cached keys the chunk sees
            y = F.scaled_dot_product_attention(q, kc[:, :, :S + T], vc[:, :, :S + T],
                                               attn_mask=self.model.causal_mask[S:S + T, :S + T],
                                               enable_gqa=Hkv != H)
        y = y.transpose(1, 2)  # [B, T, H, d], laid out for O by the copy below
        if zeroed:  # the same copy zeroes the pruned heads: [B, T, G groups, H / G heads, d]
            self.join(ops["attn_norm"])
            y = torch.where(head_mask.view(B, T, -1, 1, 1), y.view(B, T, head_mask.shape[-1], -1, d), 0)
        y = y.reshape(M, H * d)  # pruned heads are exact zeros here
        op = ops["o"]
        if op.kind == "gemm_k_all":  # the dense model: every group live
            gs, head_live = dense_group(nq), None
            mask = self.all_groups(M, nq // gs)
        if op.runs == "Triton":
            wo, s8 = self.linear_weights(layer, "o", op)
            return kernels.gemm_k(y, wo, mask, gs, residual=residual.reshape(M, -1), tickets=self.tickets,
                                  w_scale=s8, live=head_live).view(B, T, -1)
        return self.matmul(y, layer, "o", op).view(B, T, -1)

    def ffn(self, layer, ops, x, channel_mask, channel_live, residual, decision=None):
        """(residual + SwiGLU FFN, None) where down's kernel adds the residual in its epilogue, else (residual,
        the FFN's output) for the next norm's kernel to add; channel_mask bool [B, T, G] or None (dense) and its
        live list (or None), as the plan says."""
        B, T, D = residual.shape
        M = B * T
        x2 = x if isinstance(x, kernels.Fp8Rows) else x.reshape(M, D)  # fp8 rows: the norm quantized it
        op = ops["gate_up"]
        I = layer.mlp.gate_proj.out_features
        if channel_mask is not None:
            mask, gs = channel_mask.reshape(M, -1), I // channel_mask.shape[-1]
        if op.kind in ("cublas", "cublas_masked"):
            gu = self.matmul(x2, layer, "gu", op)  # gate and up in one GEMM
            pruned = mask if op.kind == "cublas_masked" else None
            self.join(ops["ffn_norm"])
            if ops["down"].weights == "fp8 x fp8":  # silu(gate) * up and the zeros, as down's fp8 input: one launch
                a = quantize_rows(gu, swiglu=True, mask=pruned, group_size=gs if pruned is not None else 0)
            else:  # silu(gate) * up and the pruned groups' zeros: one launch
                a = swiglu_rows(gu, mask=pruned, group_size=gs if pruned is not None else 0)
        else:
            # gate+up fused, live channel groups only, silu(gate)*up in the epilogue, pruned slots 0.
            wgu, sgu = self.linear_weights(layer, "gu", op)
            up_scale = None if sgu is None else sgu[I:]
            gate_scale = None if sgu is None else sgu[:I]
            if op.kind == "gemv_fused_all":  # every row as the decode GEMV's dense tail: mask [M, 0]
                a = kernels.gemm_mn(x2, wgu[:I], self.no_groups(M), dense_group(I), w_up=wgu[I:], dense_tail=I,
                                    w_scale=gate_scale, w_up_scale=up_scale)
            else:  # "gemv_fused" reads the mask itself, "tiles_fused" the layout
                lay = layout(channel_mask) if "ffn_layout" in ops else mask
                a = kernels.gemm_mn(x2, wgu[:I], lay, gs, w_up=wgu[I:], w_scale=gate_scale, w_up_scale=up_scale,
                                    decision=decision)
        op = ops["down"]
        if op.kind == "gemm_k_all":
            gs, channel_live = dense_group(I), None
            mask = self.all_groups(M, I // gs)
        if op.runs == "Triton":  # the residual add in the kernel's epilogue
            wd, sd = self.linear_weights(layer, "down", op)
            return kernels.gemm_k(a, wd, mask, gs, residual=residual.reshape(M, D), tickets=self.tickets,
                                  w_scale=sd, live=channel_live, live_fresh=decision is not None).view(B, T, D), None
        return residual, self.matmul(a, layer, "down", op).view(B, T, D)  # exact: `a`'s pruned channels are 0

    @torch.no_grad()
    def warm_prefill(self, chunk, positions):
        """One prefill chunk of every shape a server sends (Policy.warm_chunks), into row 0 of the cache set up
        now, positions < `positions`; the caller clears that row after. Returns how many chunks ran."""
        shapes = self.policy.warm_chunks(chunk, positions)
        device = self.tickets.device
        for T, start in shapes:
            idx = torch.zeros(1, T, dtype=torch.long, device=device)
            self(idx, input_pos=torch.arange(start, start + T, device=device),
                 logits_at=torch.tensor([T - 1], device=device))
        return len(shapes)

    def no_groups(self, M):
        # gemm_mn's mask when every row is its dense tail (the dense model): [M, 0]
        return self.constant_mask(M, 0)

    def all_groups(self, M, G):
        # gemm_k's mask when every group is live (the dense model): [M, G] all True
        return self.constant_mask(M, G)

    def constant_mask(self, M, G):
        # Made once per shape: a fill kernel per call would cost a launch in the step (and break PDL's overlap)
        if (M, G) not in self.constant_masks:
            self.constant_masks[M, G] = torch.ones(M, G, dtype=torch.bool, device=self.tickets.device)
        return self.constant_masks[M, G]


def dense_group(n):
    """The group size the dense model's fp8 decode kernels cut n rows (or reduction columns) into: the
    largest power of two <= 128 that divides n (at least 16, as the kernels need)."""
    gs = pow2_divisor(n, 128)
    assert gs >= 16, f"{n} channels are not a multiple of 16"
    return gs


# ----------------------------------------------------------------------------------------------------
# replaying a decode step, and timing it


class CUDAGraphDecoder:
    """One decode step captured as a CUDA graph over static buffers (gpt-fast's reduce-overhead, by hand): a
    replay launches every kernel of the step with no Python in between, so a step costs its GPU time, not its
    launch overhead. The warm-up runs outside the graph (Triton compiles, cuBLAS picks its kernels) with the
    step's real inputs, so the K/V it writes are the ones the step writes again. Sampling stays outside."""

    def __init__(self, model, token, pos):
        self.model, self.token, self.pos = model, token.clone(), pos.clone()
        self.masks = {}  # the routers' decisions of a replay: static tensors the graph rewrites
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward()

    def forward(self):
        pos = self.pos.view(1) if self.pos.dim() == 0 else self.pos.view(-1, 1)
        self.masks.clear()
        return self.model(self.token, input_pos=pos, masks=self.masks)[:, -1]

    def __call__(self, token, pos):
        self.token.copy_(token)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.logits


# A prefill chunk is padded to the next of these lengths (then per 1024): the shapes that get a CUDA graph.
PREFILL_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)


def prefill_sizes(longest):
    """The chunk lengths with a graph of their own, up to `longest`: a chunk is padded to the next one."""
    return sorted({b for b in PREFILL_BUCKETS if b < longest} | set(range(3072, longest, 1024)) | {longest})


class CUDAGraphPrefill:
    """One row's prefill chunk of up to `tokens` tokens as a CUDA graph, at start 0 or after it (`later`), into
    the KV cache the model holds at capture (serve.py: one stage row every request prefills in). An eager
    chunk is a few hundred launches from the host, which hold a short chunk up; a replay is one.

    A shorter chunk is padded to `tokens` after its real tokens: causal attention keeps the real tokens from
    seeing the padding, whose logits are never read and whose K/V land at the positions after the chunk,
    which the request writes again before it reads them (a later chunk, a decode step). The chunk's start
    reaches the kernels on the device (positions = arange + start), so one graph serves every start with room
    for `tokens` after it. pool: a graph memory pool shared by graphs that never run at once."""

    def __init__(self, model, tokens, later, positions, pool=None):
        device = model.tickets.device
        self.tokens, self.later, self.positions = tokens, later, positions
        self.idx = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self.base = torch.arange(tokens, device=device)
        self.start = torch.full((1,), int(later), dtype=torch.long, device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)
        # start=int(later): what the plan needs (0 or after it) with no host read of the device start
        forward = lambda: model(self.idx, input_pos=self.base + self.start, logits_at=self.last, start=int(later))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = forward()  # [1, 1, vocab]

    def fits(self, n, start):
        return n <= self.tokens and (start > 0) == self.later and start + self.tokens <= self.positions

    def __call__(self, ids, start):
        """Logits [1, 1, vocab] of the last of `ids` (token ids) placed at positions start.. of the cache row.
        The buffer is the graph's: read it before the next replay of any graph in the pool."""
        n = len(ids)
        self.idx[0, :n].copy_(torch.tensor(ids), non_blocking=True)
        self.start.fill_(start)
        self.last.fill_(n - 1)
        self.graph.replay()
        return self.logits


def clock(device):
    """The host clock in seconds, read once the work queued on `device` has finished."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()

"""
The Triton inference path: the model of model.py (and the routers of wide.py), run so that the work
of every skipped group is never done.

    x ─► route (fused router kernels) ─► head_mask ─► layout ─► gemm_mn: Q proj, live groups only
      ─► RMSNorm (fused) ─► K/V proj (cuBLAS, never pruned) ─► RoPE + KV-cache write (fused)
      ─► attention over live head groups (kernels_attention.py) ─► gemm_k: O proj over live groups
      ─► residual + RMSNorm (fused) ─► route ─► channel_mask ─► gemm_mn: gate+up + SwiGLU, live groups
      ─► gemm_k: down proj over live groups ─► residual

One switch picks the path, in one place: `select(model, backend)` returns either the model itself
(backend "torch": dense compute, skipped groups zeroed; the reference and the training path) or an
`Engine` over the same weights (backend "triton"). In the engine every op runs its Triton kernel, on
a GPU or under TRITON_INTERPRET=1 on the CPU, or the call fails; nothing falls back to a twin. The
ops it deliberately hands to cuBLAS (exact, because pruned slots are zero) are named in `Policy`,
printed by `generate.py --backend triton`.

fp8 weights (`Engine(model, weights="fp8")`, generate.py --weights fp8): the prunable linears' weights
(Q, K and V as one fused tensor, O, gate+up, down) are quantized once to e4m3 with one scale per output
channel; the embeddings and lm_head stay in the model dtype. Steps of at most SMALL_M tokens run
the fp8 decode kernels (the dense model too, every group live); longer ones dequantize and run as bf16.

The small fused kernels of this path (residual add + RMSNorm + router, RoPE with the KV-cache write)
live in kernels_step.py, each after its PyTorch twin. Inference only: prefills (whole, or in chunks
at shared positions, as serve.py feeds them) and one-token decode steps at per-row positions; a CUDA
graph replays a decode step (generate.py).
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from kernels_base import INTERPRET, SMALL_M, pow2_divisor
from kernels_attention import attention_decode, attention_prefill
from kernels_step import norm_route, rms_norm, rope_and_store


@dataclass(frozen=True)
class Policy:
    """Which op the engine runs where. Everything not named here always runs its Triton kernel.

    Decode (a few tokens): gemm_mn / gemm_k skip the weight rows of the groups no token of the step
    runs, but the union of a few tokens' masks already covers nearly every group, so larger steps run
    cuBLAS on the masked input. Prefill: gemm_mn's sorted tiles skip FLOPs from about a thousand tokens
    on; gemm_k cannot (with per-token masks no 16-token tile shares a skipped group), so O and down run
    cuBLAS on the masked input, which is exact because the pruned slots are zero."""
    sparse_decode_max_tokens: int = 4      # steps with at most this many tokens: Q/O/FFN through Triton
    sparse_prefill_min_tokens: int = 1024  # prefills with at least this many tokens: Q, gate+up through Triton
    dense_decode_attention: str = "triton"  # routers off: "triton" (reads each row's cache up to its length) or "sdpa"
    # Routers off, a prefill chunk after the first: "triton" (the prefill kernel, every head on) or "sdpa"
    # (with the model's causal-mask rows, which rules out flash). H200, 2048 queries after 6144 keys: 516 vs 834 us.
    dense_chunk_attention: str = "triton"
    router_max_tokens: int = 64            # longer steps run the router module itself (two fp32 GEMMs)

    def sparse(self, M, kind):
        """Run a pruned linear over M tokens through its kernel? kind "mn" (Q, gate+up) or "k" (O, down)."""
        return M <= self.sparse_decode_max_tokens or (kind == "mn" and M >= self.sparse_prefill_min_tokens)

    def describe(self, weights="bf16"):
        d, p = self.sparse_decode_max_tokens, self.sparse_prefill_min_tokens
        middle = f"{d + 1}-{p - 1} tokens" if p - 1 > d else "no token count"
        if weights == "fp8":
            return "\n".join([
                "  fp8 weights (e4m3, per-output-channel scales): Q, K, V, O, gate, up, down; embeddings and "
                "lm_head stay in the model dtype",
                f"  Triton, reading fp8: Q+K+V (gemm_mn, K and V as its dense tail), gate+up, O and down (gemm_k) "
                f"at <= {SMALL_M} tokens, WIDE and dense alike (dense: every group live)",
                f"  above {SMALL_M} tokens (prefill) the weights are dequantized to the model dtype, then as bf16:",
                self.describe()])
        return "\n".join([
            f"  Triton: layout, attention (prefill and decode), RMSNorm, RoPE + cache write, routers "
            f"(<= {self.router_max_tokens} tokens);",
            f"          Q proj and gate+up (gemm_mn) at <= {d} or >= {p} tokens; O and down (gemm_k) at <= {d} tokens",
            f"  cuBLAS on the masked input (exact, pruned slots are zero): Q and gate+up at {middle}; "
            f"O and down above {d} tokens (prefill)",
            "  cuBLAS, never pruned: K/V projections, lm_head; SDPA: prefill attention with the routers off"
            + (" (a later chunk of a prompt: the Triton kernel, every head on)" if self.dense_chunk_attention == "triton"
               else "") + (" and dense decode attention" if self.dense_decode_attention == "sdpa" else ""),
        ])


def why_not_ready(model):
    """None if the kernels can run every layer of this model, else the reason (one line)."""
    cfg = model.config
    d = cfg.head_dim
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
        start = 0
        for p in parts:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(w[start:start + n], requires_grad=False)
            start += n
        fused.append(w)
    return tuple(fused)


def select(model, backend="auto", policy=None, weights="bf16"):
    """The one backend switch: "torch" -> the model itself, "triton" -> Engine(model), "auto" -> triton
    on a CUDA model whose shapes the kernels take, else torch. Both are called as model(idx, ...)."""
    if backend not in ("torch", "triton", "auto"):
        raise ValueError(f"backend must be torch, triton or auto, got {backend!r}")
    if backend == "auto":
        backend = "triton" if model.embed_tokens.weight.is_cuda and why_not_ready(model) is None else "torch"
    return model if backend == "torch" else Engine(model, policy, weights)


def n_groups(router):
    """How many groups a router decides over (wide.Router, baselines.FixedMask); 0 without a router."""
    return getattr(router, "n_groups", 0)


class Step(NamedTuple):
    decode: bool            # one token per row attending to the cache; else a prefill from position 0
    cos: torch.Tensor       # [B*T, head_dim] per token
    sin: torch.Tensor
    slot: torch.Tensor      # [B*T] the cache slot of each token's K/V (its position; t without a cache)
    kv_len: torch.Tensor    # [B] int32 cache length after this decode step (None for a prefill)
    all_heads: torch.Tensor  # [B, 1] all True: the dense model's decode attention
    visible: torch.Tensor   # [B, 1, 1, L] cache slots each row may see (dense_decode_attention "sdpa")
    start: int              # a prefill's first position: 0, or where a chunk of a longer prompt begins
    every_head: object = None  # a dense layer's prefill chunk (start > 0, dense_chunk_attention "triton"): the
                               # layout of every head group on, built once per step; else None


class Engine:
    """model(idx, input_pos=None, logits_at=None, masks=None) with the pruned ops in Triton kernels."""

    def __init__(self, model, policy=None, weights="bf16"):
        if weights not in ("bf16", "fp8"):
            raise ValueError(f"weights must be bf16 (the model's own dtype) or fp8, got {weights!r}")
        problem = why_not_ready(model)
        if problem:
            raise ValueError(f"backend triton cannot run this model: {problem}; use --backend torch")
        if not (model.embed_tokens.weight.is_cuda or INTERPRET):
            raise ValueError("backend triton needs the model on a CUDA GPU (or TRITON_INTERPRET=1 on a CPU); "
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
        # Zeroed counters the kernels take tickets from and leave zero again (norm_route; gemm_k's split).
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)
        self.tickets = torch.zeros(4096, dtype=torch.int32, device=device)

    def setup_caches(self, *args, **kwargs):
        return self.model.setup_caches(*args, **kwargs)

    def clear_caches(self):
        return self.model.clear_caches()

    def step(self, idx, input_pos):
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
            decode, start = False, int(input_pos[0])  # (one host sync per prefill; decode steps never sync)
        else:
            raise ValueError("the Triton engine runs prefills (whole or chunked) at shared positions and "
                             "one-token decode steps; several tokens at per-row positions need the torch backend")
        pos = (torch.arange(T, device=idx.device) if input_pos is None else input_pos).expand(B, T)
        cos, sin = m.rope(pos)                                           # [B, T, head_dim]
        d = cos.shape[-1]
        cos, sin = cos.reshape(B * T, d).contiguous(), sin.reshape(B * T, d).contiguous()
        slot = (pos if cached else torch.arange(T, device=idx.device).expand(B, T)).reshape(B * T).contiguous()
        kv_len = (pos[:, 0] + 1).to(torch.int32) if decode else None
        all_heads = torch.ones(B, 1, dtype=torch.bool, device=idx.device)
        visible = None
        if decode and self.policy.dense_decode_attention == "sdpa":
            L = m.causal_mask.shape[0]
            visible = (torch.arange(L, device=idx.device) < kv_len[:, None])[:, None, None]
        every_head = None
        if (not decode and start > 0 and self.policy.dense_chunk_attention == "triton"
                and any(layer.attn_router is None for layer in m.layers)):
            every_head = kernels.layout(torch.ones(B, T, m.config.n_kv_heads, dtype=torch.bool, device=idx.device))
        return Step(decode, cos, sin, slot, kv_len, all_heads, visible, start, every_head)

    def __call__(self, idx, input_pos=None, logits_at=None, masks=None):
        """idx [B, T] -> logits [B, T, vocab] (or [B, 1, vocab] at logits_at), as Transformer.forward."""
        m = self.model
        B, T = idx.shape
        if input_pos is None and T > self.config.max_seq_len:
            raise ValueError(f"{T} tokens do not fit the context of {self.config.max_seq_len}")
        step = self.step(idx, input_pos)
        x = m.embed_tokens(idx)
        for layer in m.layers:
            x = self.block(layer, x, step, masks)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]
        return F.linear(rms_norm(x, m.norm), m.head_weight())

    def block(self, layer, x, step, masks):
        """One layer. Each sublayer starts with one kernel that does the residual add, the RMSNorm and
        the router (norm_route), so a decode step has no separate launches for them."""
        wqkv, wgu = self.fused[id(layer)]
        fp8 = self.fp8.get(id(layer))
        n, head_mask = self.norm_route(x, layer.input_layernorm, layer.attn_router, masks, "attn")
        a, added = self.attention(layer.self_attn, wqkv, n, step, head_mask, residual=x, fp8=fp8)
        if added:  # the O projection's kernel already formed h = x + a
            h = a
            n, channel_mask = self.norm_route(h, layer.post_attention_layernorm, layer.ffn_router, masks, "ffn")
        else:      # the norm's kernel forms it: (h, norm(h)) with h = x + a
            (h, n), channel_mask = self.norm_route(a, layer.post_attention_layernorm, layer.ffn_router, masks,
                                                   "ffn", residual=x)
        return self.ffn(layer.mlp, wgu, n, channel_mask, residual=h, fp8=fp8)  # h + FFN(n)

    def norm_route(self, x, norm, router, masks, kind, residual=None):
        """(norm(x) or (h, norm(h)) with h = residual + x, and the router's decision on x or h as a bool
        mask [B, T, G] (True = the group runs; None without a router). The float mask goes into
        `masks` as the reference forward records it."""
        if router is None:
            return rms_norm(x, norm, residual), None
        down = getattr(router, "down", None)
        if (isinstance(down, nn.Linear) and down.weight.dtype == torch.float32
                and x.shape[0] * x.shape[1] <= self.policy.router_max_tokens):
            normed, keep, keepf = norm_route(x, norm, router, residual, self.ticket)
        else:
            normed = rms_norm(x, norm, residual)
            keepf = router(x if residual is None else normed[0])  # at inference exactly 0 or 1
            keep = keepf > 0.5
        if masks is not None:
            masks.setdefault(kind, []).append(keepf)
        return normed, keep

    def attention(self, attn, wqkv, x, step, head_mask, residual, fp8=None):
        """Attention with head_mask bool [B, T, G] or None (dense); wqkv = [Wq; Wk; Wv] (fuse_weights).
        Returns (residual + attention, True) where the O projection's kernel adds the residual in its
        epilogue, else (attention, False). fp8: the layer's quantized weights (Engine(weights="fp8"))."""
        B, T, _ = x.shape
        M, H, Hkv, d = B * T, attn.n_heads, attn.n_kv_heads, attn.head_dim
        nq = H * d
        x2 = x.reshape(M, -1)
        sparse_mn, sparse_k = self.policy.sparse(M, "mn"), self.policy.sparse(M, "k")
        wo, read_fp8 = attn.o_proj.weight, fp8 is not None and M <= SMALL_M
        if fp8 is not None and not read_fp8:  # a prefill: the values the fp8 codes stand for, then as bf16
            wqkv, wo = (kernels.dequantize_fp8(*fp8[k], x.dtype) for k in ("qkv", "o"))
        if head_mask is not None:
            mask, gs = head_mask.reshape(M, -1), H // head_mask.shape[-1] * d
            # The layout (mask reordering), built once per router decision: Q proj and attention share it.
            lay = kernels.layout(head_mask) if not step.decode else mask
        if read_fp8:
            # fp8 codes, one weight stream: Q's live groups (all of Q for the dense model), then K and V.
            (w8, s8), tail = fp8["qkv"], wqkv.shape[0] - (nq if head_mask is not None else 0)
            qkv = kernels.gemm_mn(x2, w8, mask if head_mask is not None else self.no_groups(M),
                                  gs if head_mask is not None else dense_group(wqkv.shape[0]), dense_tail=tail,
                                  w_scale=s8)
            q, kv = qkv[:, :nq], qkv[:, nq:]
        elif head_mask is not None and sparse_mn and M <= SMALL_M:
            # Decode: Q's live groups, then K and V (never pruned), as one weight stream in one launch.
            qkv = kernels.gemm_mn(x2, wqkv, mask, gs, dense_tail=wqkv.shape[0] - nq)
            q, kv = qkv[:, :nq], qkv[:, nq:]
        elif head_mask is not None and sparse_mn:
            # Q proj, active groups only; pruned slots stay unwritten (attention never reads them).
            q = kernels.gemm_mn(x2, wqkv[:nq], lay, gs, zero_pruned=False)
            kv = F.linear(x2, wqkv[nq:])  # K and V in one GEMM: never pruned
        else:
            qkv = F.linear(x2, wqkv)      # Q, K, V in one GEMM
            q, kv = qkv[:, :nq], qkv[:, nq:]
        k, v = kv[:, :Hkv * d], kv[:, Hkv * d:]
        if attn.kv_cache is not None:  # K/V are never pruned: the static cache stays complete
            kc, vc = attn.kv_cache.k_cache, attn.kv_cache.v_cache
        else:
            kc, vc = (torch.empty(B, Hkv, T, d, dtype=x.dtype, device=x.device) for _ in range(2))
        q = rope_and_store(q, k, v, step, kc, vc, H, Hkv, d).view(B, T, H, d).transpose(1, 2)
        if step.decode and head_mask is not None:
            y = attention_decode(q, kc, vc, mask, step.kv_len)  # skips the K/V reads of idle KV heads
        elif step.decode and self.policy.dense_decode_attention == "sdpa":
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=step.visible, enable_gqa=Hkv != H)
        elif step.decode:
            y = attention_decode(q, kc, vc, step.all_heads, step.kv_len)
        elif head_mask is not None:  # a prefill chunk at `start` sees the start + T keys before it
            S = step.start
            y = attention_prefill(q, kc[:, :, :S + T], vc[:, :, :S + T], lay, start=S)
        elif step.start == 0:  # routers off: the dense baseline at its best (cuDNN / flash through SDPA)
            y = F.scaled_dot_product_attention(q, kc[:, :, :T], vc[:, :, :T], is_causal=True,
                                               enable_gqa=Hkv != H)
        elif self.policy.dense_chunk_attention == "triton":  # a chunk at `start`, every head group on
            S = step.start
            y = attention_prefill(q, kc[:, :, :S + T], vc[:, :, :S + T], step.every_head, start=S)
        else:
            S = step.start  # a chunk: rows S.. of the model's causal mask say which cached keys it sees
            y = F.scaled_dot_product_attention(q, kc[:, :, :S + T], vc[:, :, :S + T],
                                               attn_mask=self.model.causal_mask[S:S + T, :S + T],
                                               enable_gqa=Hkv != H)
        y = y.transpose(1, 2).reshape(M, H * d)  # pruned heads are exact zeros here
        if read_fp8:  # O from fp8 codes over the live groups (the dense model: all of them)
            if head_mask is None:
                gs = dense_group(nq)
                mask = self.all_groups(M, nq // gs)
            return kernels.gemm_k(y, fp8["o"][0], mask, gs, residual=residual.reshape(M, -1), tickets=self.tickets,
                                  w_scale=fp8["o"][1]).view(B, T, -1), True
        if head_mask is not None and sparse_k:
            return kernels.gemm_k(y, wo, mask, gs, residual=residual.reshape(M, -1),
                                  tickets=self.tickets).view(B, T, -1), True
        return F.linear(y, wo).view(B, T, -1), False

    def ffn(self, mlp, wgu, x, channel_mask, residual, fp8=None):
        """residual + SwiGLU FFN, with channel_mask bool [B, T, G] or None (dense); wgu = [Wgate; Wup].
        fp8: the layer's quantized weights (Engine(weights="fp8"))."""
        B, T, D = x.shape
        M = B * T
        x2 = x.reshape(M, D)
        I, wd = wgu.shape[0] // 2, mlp.down_proj.weight
        if fp8 is not None and M <= SMALL_M:
            return self.ffn_fp8(x2, I, fp8, channel_mask, residual).view(B, T, D)
        if fp8 is not None:  # a prefill: the values the fp8 codes stand for, then as bf16
            wgu, wd = (kernels.dequantize_fp8(*fp8[k], x.dtype) for k in ("gu", "down"))
        if channel_mask is None or not self.policy.sparse(M, "mn"):
            g, u = F.linear(x2, wgu).split(I, dim=-1)  # gate and up in one GEMM
            a = F.silu(g) * u
            if channel_mask is None:
                return residual + F.linear(a, wd).view(B, T, D)
        mask, gs = channel_mask.reshape(M, -1), I // channel_mask.shape[-1]
        if self.policy.sparse(M, "mn"):
            # gate+up fused, active channel groups only, silu(gate)*up in the epilogue, pruned slots 0.
            lay = kernels.layout(channel_mask) if M > SMALL_M else mask
            a = kernels.gemm_mn(x2, wgu[:I], lay, gs, w_up=wgu[I:])
        else:
            a = (a.view(M, -1, gs) * mask[..., None]).view(M, -1)  # zero the pruned channel groups
        if self.policy.sparse(M, "k"):  # the residual add in the kernel's epilogue
            return kernels.gemm_k(a, wd, mask, gs, residual=residual.reshape(M, D), tickets=self.tickets).view(B, T, D)
        return residual + F.linear(a, wd).view(B, T, D)  # exact: the pruned channels of `a` are zero

    def ffn_fp8(self, x2, I, fp8, channel_mask, residual):
        """A decode step's FFN from fp8 codes: gate+up over the live channel groups, then down over them
        (the dense model: every group live, through the same two kernels). Returns [M, D]."""
        M = x2.shape[0]
        (wgu, sgu), (wd, sd) = fp8["gu"], fp8["down"]
        if channel_mask is not None:
            mask, gs, tail = channel_mask.reshape(M, -1), I // channel_mask.shape[-1], 0
        else:
            gs, tail = dense_group(I), I
            mask = self.no_groups(M)
        a = kernels.gemm_mn(x2, wgu[:I], mask, gs, w_up=wgu[I:], dense_tail=tail, w_scale=sgu[:I], w_up_scale=sgu[I:])
        if channel_mask is None:
            mask = self.all_groups(M, I // gs)
        return kernels.gemm_k(a, wd, mask, gs, residual=residual.reshape(M, -1), tickets=self.tickets, w_scale=sd)

    def no_groups(self, M):
        # gemm_mn's mask when every row is its dense tail (the dense model): [M, 0]
        return torch.ones(M, 0, dtype=torch.bool, device=self.ticket.device)

    def all_groups(self, M, G):
        # gemm_k's mask when every group is live (the dense model): [M, G] all True
        return torch.ones(M, G, dtype=torch.bool, device=self.ticket.device)


def dense_group(n):
    """The group size the dense model's fp8 decode kernels cut n rows (or reduction columns) into: the
    largest power of two <= 128 that divides n (at least 16, as the kernels need)."""
    gs = pow2_divisor(n, 128)
    assert gs >= 16, f"{n} channels are not a multiple of 16"
    return gs

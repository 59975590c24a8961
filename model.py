"""
The dense model: a Llama-style decoder, small enough to read in one sitting.

  tokens -> embed -> [ RMSNorm -> attention (GQA, RoPE) -> + -> RMSNorm -> SwiGLU FFN -> + ] x L -> RMSNorm -> head

The two places WIDE (wide.py) cares about are marked "WIDE:" below: each attention head's output can
be multiplied by a per-token head mask just before `o_proj`, and the SwiGLU product `silu(gate) * up`
can be multiplied by a per-token channel mask just before `down_proj`. With no mask the model is an
ordinary Llama, and it loads Hugging Face Llama checkpoints (config.json + safetensors) as they are:
our parameter names are theirs, minus the leading "model.".

Two backends run the same masks (`model.set_backend`): "torch" computes every layer dense and zeroes
what is skipped (the reference, and the training path); "triton" runs the pruned ops through
kernels.py so the skipped work is never done (the section "the Triton path" at the end of the file).
"""
import copy
import json
import math
import os
import shutil
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

import kernels


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or unreadable. Scripts print it as one line."""


@dataclass
class ModelConfig:
    vocab_size: int = 2048
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    intermediate_size: int = 384
    head_dim: int = 0             # 0 means dim // n_heads
    max_seq_len: int = 256        # the longest context the model (and its KV cache) supports
    rope_theta: float = 10000.0
    rope_scaling: dict = None     # Llama-3 style {"rope_type": "llama3", "factor": ..., ...} or None
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @classmethod
    def from_name(cls, name):
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls(**copy.deepcopy(PRESETS[name]))

    @classmethod
    def from_hf(cls, hf):
        """Build from a Hugging Face Llama config.json dict."""
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise CheckpointError("config.json asks for attention/MLP biases, which this Llama model does not have")
        # Newer transformers keep rope settings under "rope_parameters"; older ones at the top level.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise CheckpointError(f"rope type {kind!r} is not supported (only default and llama3)")
        return cls(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], head_dim=hf.get("head_dim") or 0,
            max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=float(theta),
            rope_scaling=rope if kind == "llama3" else None, norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def to_hf(self):
        """The config.json we write: a plain HF Llama config, so transformers can read our checkpoints too."""
        hf = dict(
            architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=self.vocab_size,
            hidden_size=self.dim, num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads, intermediate_size=self.intermediate_size,
            head_dim=self.head_dim, max_position_embeddings=self.max_seq_len, rope_theta=self.rope_theta,
            rms_norm_eps=self.norm_eps, tie_word_embeddings=self.tie_embeddings, hidden_act="silu",
            attention_bias=False, mlp_bias=False,
        )
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
        return hf


PRESETS = {
    # Trains in a few minutes on two CPU cores. 8 query heads share 4 KV heads, so with the default
    # attn_group_size (= 2 query heads) each routing decision is exactly one KV head.
    "tiny": dict(vocab_size=2048, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=384,
                 max_seq_len=256),
    # A GPU preset, ~30M parameters.
    "small": dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=1536,
                  max_seq_len=1024),
    # Shape only (random weights), used by the speed benchmarks.
    "llama-3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         intermediate_size=14336, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                         tie_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


# ----------------------------------------------------------------------------------------------------
# building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32 (as Llama does) so bf16 activations with large outliers stay accurate.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(cfg):
    """Inverse frequencies of the rotary embedding, with Llama-3's long-context rescaling if configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s:
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band between
        # is interpolated smoothly, so the model sees positions beyond its original context.
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
        medium = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def apply_rope(x, cos, sin):
    # x: [B, heads, T, d]. The "rotate half" form: pairs are (i, i + d/2), as in HF Llama weights.
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache(nn.Module):
    """A static cache, [B, n_kv_heads, max_seq_len, head_dim], written in place at `input_pos`."""

    def __init__(self, batch_size, max_seq_len, n_kv_heads, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos, k, v):
        if input_pos.dim() == 2:  # [B, T]: every row writes at its own positions (batched prompts)
            idx = input_pos[:, None, :, None].expand_as(k)
            self.k_cache.scatter_(2, idx, k.to(self.k_cache.dtype))
            self.v_cache.scatter_(2, idx, v.to(self.v_cache.dtype))
            return self.k_cache, self.v_cache
        self.k_cache.index_copy_(2, input_pos, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, input_pos, v.to(self.v_cache.dtype))
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.kv_cache = None

    def forward(self, x, cos, sin, attn_mask, input_pos, head_mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        # Grouped-query attention: each KV head serves n_heads / n_kv_heads query heads.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        if head_mask is not None:
            # WIDE: zero the outputs of the head groups this token skips, *before* o_proj. head_mask is
            # [B, T, G] over groups of contiguous heads; repeat it out to [B, heads, T, 1].
            group = self.n_heads // head_mask.shape[-1]
            y = y * head_mask.repeat_interleave(group, dim=-1).transpose(1, 2).unsqueeze(-1).to(y.dtype)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def forward_triton(self, x, step, head_mask):
        """The same attention through kernels.py; head_mask is bool [B, T, G] or None (dense)."""
        B, T, _ = x.shape
        M, H, Hkv, d = B * T, self.n_heads, self.n_kv_heads, self.head_dim
        x2 = x.reshape(M, -1)
        if head_mask is not None:
            mask, gs = head_mask.reshape(M, -1), H // head_mask.shape[-1] * d
            # The layout (mask reordering), built once per router decision: Q proj and attention share it.
            lay = kernels.layout(head_mask) if not step.decode else mask
        if head_mask is not None and sparse_linear(M, "mn"):
            # Q proj, active groups only; pruned slots stay unwritten (attention never reads them).
            q = kernels.gemm_mn(x2, self.q_proj.weight, lay, gs, zero_pruned=False)
        else:
            q = F.linear(x2, self.q_proj.weight)
        k, v = F.linear(x2, self.k_proj.weight), F.linear(x2, self.v_proj.weight)
        if self.kv_cache is not None:  # K/V are never pruned: the static cache stays complete
            kc, vc = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            kc, vc = (torch.empty(B, Hkv, T, d, dtype=x.dtype, device=x.device) for _ in range(2))
        q = rope_and_store(q, k, v, step, kc, vc, H, Hkv, d).view(B, T, H, d).transpose(1, 2)
        if step.decode and head_mask is not None:
            # Skips the K/V reads of the KV heads whose groups this token does not run.
            y = kernels.attention_decode(q, kc, vc, mask, step.kv_len)
        elif step.decode and DENSE_DECODE_ATTENTION == "sdpa":
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=step.visible, enable_gqa=Hkv != H)
        elif step.decode:
            y = kernels.attention_decode(q, kc, vc, step.all_heads, step.kv_len)
        elif head_mask is not None:
            y = kernels.attention_prefill(q, kc[:, :, :T], vc[:, :, :T], lay)
        else:
            y = F.scaled_dot_product_attention(q, kc[:, :, :T], vc[:, :, :T], is_causal=True,
                                               enable_gqa=Hkv != H)
        y = y.transpose(1, 2).reshape(M, H * d)  # pruned heads are exact zeros here
        if head_mask is not None and sparse_linear(M, "k"):
            return kernels.gemm_k(y, self.o_proj.weight, mask, gs).view(B, T, -1)
        return F.linear(y, self.o_proj.weight).view(B, T, -1)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x, channel_mask=None):
        a = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if channel_mask is not None:
            # WIDE: zero the SwiGLU channel groups this token skips, *before* down_proj.
            # channel_mask is [B, T, G] over groups of contiguous intermediate channels.
            group = a.shape[-1] // channel_mask.shape[-1]
            a = a * channel_mask.repeat_interleave(group, dim=-1).to(a.dtype)
        return self.down_proj(a)

    def forward_triton(self, x, channel_mask):
        """The same FFN through kernels.py; channel_mask is bool [B, T, G] or None (dense)."""
        B, T, D = x.shape
        M = B * T
        x2 = x.reshape(M, D)
        wg, wu, wd = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        if channel_mask is None:
            return F.linear(F.silu(F.linear(x2, wg)) * F.linear(x2, wu), wd).view(B, T, D)
        mask, gs = channel_mask.reshape(M, -1), wg.shape[0] // channel_mask.shape[-1]
        if sparse_linear(M, "mn"):
            # gate+up fused, active channel groups only, silu(gate)*up in the epilogue, pruned slots 0.
            lay = kernels.layout(channel_mask) if M > kernels.SMALL_M else mask
            a = kernels.gemm_mn(x2, wg, lay, gs, w_up=wu)
        else:
            a = F.silu(F.linear(x2, wg)) * F.linear(x2, wu)
            a = (a.view(M, -1, gs) * mask[..., None]).view(M, -1)  # zero the pruned channel groups
        if sparse_linear(M, "k"):
            return kernels.gemm_k(a, wd, mask, gs).view(B, T, D)
        return F.linear(a, wd).view(B, T, D)  # exact: the pruned channels of `a` are zero


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)
        # Routers are installed by wide.py. Each maps the raw residual stream [B, T, D] to a mask;
        # None (the default) means the dense layer, at no extra cost.
        self.attn_router = None   # -> head_mask    [B, T, G_attn]
        self.ffn_router = None    # -> channel_mask [B, T, G_ffn]
        self.layer_router = None  # -> [B, T, 1] gate on both residual branches (layer-skip baseline)

    def forward(self, x, cos, sin, attn_mask, input_pos):
        # Routers read the residual *before* the RMSNorm: the attention router sees the layer input,
        # the FFN router the residual after attention (as in the paper's code).
        head_mask = self.attn_router(x) if self.attn_router is not None else None
        gate = self.layer_router(x) if self.layer_router is not None else None
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, input_pos, head_mask)
        h = x + (a if gate is None else a * gate)
        channel_mask = self.ffn_router(h) if self.ffn_router is not None else None
        f = self.mlp(self.post_attention_layernorm(h), channel_mask)
        return h + (f if gate is None else f * gate)

    def triton_ready(self):
        """Can the Triton path run this layer? (kernels.py: head_dim a power of two >= 16, groups of
        channels a multiple of 16; plain Linear layers; layer-skip and TEAL run the reference path)"""
        a, f = self.self_attn, self.mlp
        plain = all(type(m) is nn.Linear for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                    f.gate_proj, f.up_proj, f.down_proj))
        d, n_attn, n_ffn = a.head_dim, n_groups(self.attn_router), n_groups(self.ffn_router)
        return (plain and self.layer_router is None and d >= 16 and d & (d - 1) == 0
                and a.n_heads % max(n_attn, 1) == 0 and (f.gate_proj.out_features // max(n_ffn, 1)) % 16 == 0)

    def forward_triton(self, x, step):
        """This layer with the pruned ops in kernels.py, the residual add fused into the second norm."""
        head_mask = route(self.attn_router, x)
        a = self.self_attn.forward_triton(rms_norm(x, self.input_layernorm), step, head_mask)
        h, n = rms_norm(a, self.post_attention_layernorm, residual=x)  # h = x + a
        channel_mask = route(self.ffn_router, h)
        return h + self.mlp.forward_triton(n, channel_mask)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self.causal_mask = None  # built by setup_caches: row p says which cache slots position p may see
        self.backend = "torch"   # see set_backend
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def head_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def setup_caches(self, batch_size, max_seq_len=None, dtype=None):
        """Allocate a static KV cache in every layer; forward() then needs `input_pos`."""
        cfg, p = self.config, self.embed_tokens.weight
        max_seq_len = max_seq_len or cfg.max_seq_len
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(batch_size, max_seq_len, cfg.n_kv_heads, cfg.head_dim,
                                               dtype or p.dtype, p.device)
        self.causal_mask = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=p.device).tril()

    def set_backend(self, backend):
        """"torch": dense compute, skipped heads/channels zeroed (the reference and training path).
        "triton": inference (no_grad, eval) runs the pruned ops through kernels.py and skips their work.
        "auto": triton on a CUDA model whose shapes the kernels take, else torch."""
        if backend not in ("torch", "triton", "auto"):
            raise ValueError(f"backend must be torch, triton or auto, got {backend!r}")
        p = self.embed_tokens.weight
        ready = all(layer.triton_ready() for layer in self.layers)
        if backend == "auto":
            backend = "triton" if p.is_cuda and ready else "torch"
        elif backend == "triton" and not (p.is_cuda or kernels.INTERPRET):
            raise ValueError("backend triton needs the model on a CUDA GPU (or TRITON_INTERPRET=1 on CPU)")
        elif backend == "triton" and not ready:
            raise ValueError("backend triton needs a head_dim that is a power of two >= 16, plain Linear "
                             "layers, no layer-skip router, and group sizes (channels) that are multiples of 16; "
                             "use --backend torch")
        self.backend = backend
        return self

    def clear_caches(self):
        for layer in self.layers:
            layer.self_attn.kv_cache = None
        self.causal_mask = None

    def forward(self, idx, targets=None, input_pos=None, logits_at=None):
        """idx [B, T] -> logits [B, T, vocab]; with targets also the mean cross-entropy (-100 = ignore).

        Without `input_pos` this is a plain causal forward over the T tokens (training, evaluation).
        With `input_pos` [T] (after setup_caches) the tokens sit at those positions, their K/V are written
        into the cache, and they attend to everything cached before them (prefill and decode).
        `input_pos` may also be [B, T], one row of positions per sequence: batched prompts of different
        lengths decode at different positions. `logits_at` [B] keeps only the logits at that position
        of each row -> [B, 1, vocab] (a prefill needs just each prompt's last token).
        """
        B, T = idx.shape
        if input_pos is None and self.causal_mask is not None:
            raise ValueError("the KV cache is set up: pass input_pos (or call clear_caches() first)")
        if input_pos is None and T > self.config.max_seq_len:
            raise ValueError(f"{T} tokens do not fit the context of {self.config.max_seq_len}")
        pos = torch.arange(T, device=idx.device) if input_pos is None else input_pos
        angles = pos[..., None].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if pos.dim() == 2:  # per-row positions: [B, 1, T, d] broadcasts over the heads
            cos, sin = cos[:, None], sin[:, None]
            attn_mask = self.causal_mask[input_pos][:, None]
        else:
            attn_mask = None if input_pos is None else self.causal_mask[None, None, input_pos]
        step = triton_step(self, idx, input_pos, cos, sin) if self.backend == "triton" else None
        x = self.embed_tokens(idx)
        for layer in self.layers:
            if step is not None and layer.triton_ready():
                x = layer.forward_triton(x, step)
            else:
                x = layer(x, cos, sin, attn_mask, input_pos)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]
        x = rms_norm(x, self.norm) if step is not None else self.norm(x)
        logits = F.linear(x, self.head_weight())
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    # ------------------------------------------------------------------------------------------------
    # checkpoints: a directory in the Hugging Face Llama layout

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32):
        """Load our checkpoint or a local HF Llama directory (config.json + model.safetensors, or sharded)."""
        cfg = cls.config_from_dir(path)
        with torch.device("meta"):
            model = cls(cfg)
        state = load_safetensors_dir(path)
        model.load_dense_state(state, dtype, device)
        return model

    @staticmethod
    def config_from_dir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            if os.path.isdir(path.rstrip("/") + ".old"):  # a save was interrupted between its two renames
                raise CheckpointError(f"checkpoint directory {path!r} does not exist, but {path}.old does: a save "
                                      f"was interrupted; rename {path}.old to {path} to use the previous one")
            raise CheckpointError(f"checkpoint directory {path!r} does not exist (train one with: python train.py)")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{config_path} is missing: {path!r} is not a complete checkpoint directory")
        try:
            with open(config_path) as f:
                return ModelConfig.from_hf(json.load(f))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{config_path} is not a valid Llama config ({type(e).__name__}: {e})") from None

    def load_dense_state(self, state, dtype=torch.float32, device="cpu"):
        """Fill the model from HF-named tensors; extra keys (routers, LoRA) are left for wide.py."""
        own = {k: v for k, v in self.state_dict().items()}
        missing = [k for k in own if f"model.{k}" not in state and k not in state
                   and not (k == "lm_head.weight" and self.lm_head is None)]
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        tensors = {}
        for k, ref in own.items():
            t = state.get(f"model.{k}", state.get(k))
            if tuple(t.shape) != tuple(ref.shape):
                raise CheckpointError(f"tensor {k!r} has shape {tuple(t.shape)}, config says {tuple(ref.shape)}")
            tensors[k] = t.to(device=device, dtype=dtype)
        self.to_empty(device=device)
        self.load_state_dict(tensors, strict=True, assign=True)
        self.inv_freq = rope_frequencies(self.config).to(device)
        return self


def load_safetensors_dir(path):
    """All tensors of a checkpoint directory, from model.safetensors or a sharded index."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt ({e})") from None
    else:
        raise CheckpointError(f"no model.safetensors (or model.safetensors.index.json) in {path!r}")
    state = {}
    for file in files:
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: {e}; the file is corrupt or incomplete") from None
    return state


def load_tokenizer(path):
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: the checkpoint has no tokenizer")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise CheckpointError(f"cannot read {file}: {e}") from None


def save_checkpoint(path, model, tokenizer=None, extra_tensors=None, extra_files=None):
    """Write a checkpoint directory atomically: everything goes to `path.tmp`, then one rename.

    A crash mid-write leaves only the `.tmp` directory behind, never a half-written `path`; an older
    checkpoint at `path` is swapped out only after the new one is complete.
    """
    from safetensors.torch import save_file
    tmp, old = path.rstrip("/") + ".tmp", path.rstrip("/") + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tensors = {}
    for k, v in model.state_dict().items():
        if "router" in k or "lora_" in k:
            continue  # routers and LoRA factors are not Llama weights: wide.py passes them as extra_tensors
        k = k.replace(".base.weight", ".weight")  # a LoRA-wrapped projection keeps its frozen W as .base
        tensors["lm_head.weight" if k == "lm_head.weight" else f"model.{k}"] = v.detach().contiguous().cpu()
    tensors.update({k: v.detach().contiguous().cpu() for k, v in (extra_tensors or {}).items()})
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    for name, obj in (extra_files or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=2)
    for name in os.listdir(tmp):  # make sure the bytes are on disk before the rename publishes them
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# the Triton path (backend "triton")
#
# The pruned ops go through kernels.py: routing -> layout (once per router decision) -> gemm_mn (Q;
# gate+up) -> attention -> gemm_k (O; down). The small ops around them (RMSNorm with the residual add,
# RoPE with the KV-cache write, the decode-time routers) are one fused kernel each below, used by WIDE
# and by the dense model (routers off) alike, so a decode step is a short list of launches that a CUDA
# graph replays (generate.py). Inference only: training and prefill chunks after position 0 take the
# reference path.

# Which token counts run the pruned linears through Triton; the others run cuBLAS on the masked input
# (exact: pruned slots are zero). Decode: gemv_mn / gemm_k skip the weights of the groups that no token
# of the step runs, but a few tokens' masks already cover nearly every group. Prefill: gemm_mn's sorted
# tiles skip FLOPs; gemm_k does not beat cuBLAS there (results/kernels_h200.md, results/e2e_h200.md).
SPARSE_DECODE_MAX_TOKENS = 4
SPARSE_PREFILL_MIN_TOKENS = 1024
# Dense decode attention: "triton" = kernels.attention_decode with every head on (it reads each row's
# cache only up to its length); "sdpa" = scaled_dot_product_attention over the whole static cache, masked.
DENSE_DECODE_ATTENTION = "triton"


def sparse_linear(M, kind):
    return M <= SPARSE_DECODE_MAX_TOKENS or (kind == "mn" and M >= SPARSE_PREFILL_MIN_TOKENS)


def n_groups(router):
    """How many groups a router decides over (wide.Router, wide.FixedMask); 0 without a router."""
    if hasattr(router, "n_groups"):
        return router.n_groups
    return router.keep_groups.shape[-1] if hasattr(router, "keep_groups") else 0


class TritonStep(NamedTuple):
    decode: bool            # one token per row attending to the cache; else a prefill from position 0
    cos: torch.Tensor       # [B*T, head_dim] per token
    sin: torch.Tensor
    slot: torch.Tensor      # [B*T] the cache slot of each token's K/V (its position; t without a cache)
    kv_len: torch.Tensor    # [B] int32 cache length after this decode step (None for a prefill)
    all_heads: torch.Tensor  # [B, 1] all True: the dense model's decode attention
    visible: torch.Tensor   # [B, 1, 1, L] cache slots each row may see (DENSE_DECODE_ATTENTION "sdpa")


def triton_step(model, idx, input_pos, cos, sin):
    """What the Triton path needs for one forward, or None where it does not apply."""
    if model.training or torch.is_grad_enabled():
        return None  # no autograd through the kernels
    B, T = idx.shape
    cached = model.causal_mask is not None
    if input_pos is None or (T > 1 and input_pos.dim() == 1 and int(input_pos[0]) == 0):
        decode = False  # (a prefill checks its start on the host once; decode steps never sync)
    elif T == 1 and cached:
        decode = True
    else:
        return None
    t = torch.arange(T, device=idx.device)
    pos = (t if input_pos is None else input_pos).expand(B, T)
    d = cos.shape[-1]
    cos, sin = (c.reshape(-1, T, d).expand(B, T, d).reshape(B * T, d).contiguous() for c in (cos, sin))
    slot = (pos if cached else t.expand(B, T)).reshape(B * T).contiguous()
    kv_len = (pos[:, 0] + 1).to(torch.int32) if decode else None
    all_heads = torch.ones(B, 1, dtype=torch.bool, device=idx.device)
    visible = None
    if decode and DENSE_DECODE_ATTENTION == "sdpa":
        L = model.causal_mask.shape[0]
        visible = (torch.arange(L, device=idx.device) < kv_len[:, None])[:, None, None]
    return TritonStep(decode, cos, sin, slot, kv_len, all_heads, visible)


def route(router, x):
    """The router's decision as a bool mask [B, T, G] (True = the group runs), or None (dense).

    Decode-sized steps of a wide.Router run as two fused kernels (the same fp32 arithmetic and the same
    rule: skip iff z_skip > z_exec); anything else calls the router module itself."""
    if router is None:
        return None
    B, T, D = x.shape
    M = B * T
    down, up = getattr(router, "down", None), getattr(router, "up", None)
    if down is None or up is None or router.training or M > 64 or down.weight.dtype != torch.float32:
        return router(x) > 0.5  # at inference keep is exactly 0 or 1
    G, R = router.n_groups, down.out_features
    z = torch.empty(M, R, dtype=torch.float32, device=x.device)
    BT = max(2, triton.next_power_of_2(M))
    RB = triton.next_power_of_2(R) if kernels.INTERPRET else 1  # the interpreter pays per program
    _router_down_kernel[(triton.cdiv(R, RB),)](x.reshape(M, D).contiguous(), down.weight, down.bias, z, M,
                                               D, R, BT=BT, RB=RB, BK=min(triton.next_power_of_2(D),
                                                                           max(16, 8192 // BT)), num_warps=4)
    keep = torch.empty(M, G, dtype=torch.bool, device=x.device)
    keepf = torch.empty(M, G, dtype=torch.float32, device=x.device)
    BG, TB = min(64, triton.next_power_of_2(G)), BT if kernels.INTERPRET else 1
    _router_up_kernel[(triton.cdiv(M, TB), triton.cdiv(G, BG))](
        z, up.weight, up.bias, keep.view(torch.uint8), keepf, M, G, R, TB=TB, RP=triton.next_power_of_2(R),
        BG=BG, num_warps=4)
    router.keep = keepf.view(B, T, G)  # the float mask the sparsity bookkeeping reads (wide.py)
    return keep.view(B, T, G)


def rms_norm(x, norm, residual=None):
    """norm(x) in one kernel; with residual, (h, norm(h)) for h = residual + x, also in one kernel."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else y
    res = residual.reshape(-1, D).contiguous() if residual is not None else x2
    BD = triton.next_power_of_2(D)
    _rms_norm_kernel[(x2.shape[0],)](x2, res, h, y, norm.weight, D, norm.eps, HAS_RES=residual is not None,
                                     BD=BD, num_warps=8 if BD >= 2048 else 4)
    return y.view(x.shape) if residual is None else (h.view(x.shape), y.view(x.shape))


def rope_and_store(q, k, v, step, k_dst, v_dst, H, Hkv, d):
    """RoPE on q [M, H*d] and k [M, Hkv*d]; k and v go into k_dst/v_dst [B, Hkv, L, d] at step.slot."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    M = q.shape[0]
    q_out = torch.empty_like(q)
    T = M // k_dst.shape[0]
    _rope_kernel[(M,)](q, k, v, step.cos, step.sin, step.slot, q_out, k_dst, v_dst, T, H, Hkv, H * d, Hkv * d,
                       k_dst.stride(0), k_dst.stride(1), k_dst.stride(2), HP=triton.next_power_of_2(H),
                       HKP=triton.next_power_of_2(Hkv), HALF=d // 2, num_warps=4)
    return q_out


@triton.jit
def _rms_norm_kernel(x, res, h_out, y, w, D, eps, HAS_RES: tl.constexpr, BD: tl.constexpr):
    """One row per program: y = RMSNorm(x); with HAS_RES first h = res + x, rounded to the model
    dtype as `x + a` is, and stored. Twin: RMSNorm.forward (fp32 statistics, same roundings)."""
    row = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BD)
    ok = d < D
    h = tl.load(x + row + d, mask=ok, other=0.0)
    if HAS_RES:
        h = (tl.load(res + row + d, mask=ok, other=0.0).to(tl.float32) + h.to(tl.float32)).to(h.dtype)
        tl.store(h_out + row + d, h, mask=ok)
    hf = h.to(tl.float32)
    n = (hf * tl.rsqrt(tl.sum(hf * hf, 0) / D + eps)).to(h.dtype)
    wt = tl.load(w + d, mask=ok, other=0.0)
    tl.store(y + row + d, (wt.to(tl.float32) * n.to(tl.float32)).to(y.dtype.element_ty), mask=ok)


@triton.jit
def _rotate(src, dst, ok, c1, c2, s1, s2, HALF: tl.constexpr):
    # apply_rope's "rotate half" in fp32: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), rounded once.
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst, (a1 * c1 + (-a2) * s1).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (a2 * c2 + a1 * s2).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(q, k, v, cos, sin, slot, q_out, k_dst, v_dst, T, H, HKV, sq, sk, sdb, sdh, sdt,
                 HP: tl.constexpr, HKP: tl.constexpr, HALF: tl.constexpr):
    """RoPE for every head of one token. Grid (B*T,): the query heads go to q_out; the key heads, and
    the value heads as they are, straight into the KV cache at the token's slot (K/V are never pruned:
    the cache stays dense). Twin: apply_rope + KVCache.update."""
    m = tl.program_id(0)
    i = tl.arange(0, HALF)[None, :]
    c1, c2 = tl.load(cos + m * 2 * HALF + i), tl.load(cos + m * 2 * HALF + HALF + i)
    s1, s2 = tl.load(sin + m * 2 * HALF + i), tl.load(sin + m * 2 * HALF + HALF + i)
    hq = tl.arange(0, HP)[:, None]
    _rotate(q + m * sq + hq * 2 * HALF + i, q_out + m * sq + hq * 2 * HALF + i, hq < H, c1, c2, s1, s2, HALF)
    hk = tl.arange(0, HKP)[:, None]
    dst = (m // T).to(tl.int64) * sdb + hk * sdh + tl.load(slot + m) * sdt
    _rotate(k + m * sk + hk * 2 * HALF + i, k_dst + dst + i, hk < HKV, c1, c2, s1, s2, HALF)
    dd = tl.arange(0, 2 * HALF)[None, :]
    vals = tl.load(v + m * sk + hk * 2 * HALF + dd, mask=hk < HKV, other=0.0)
    tl.store(v_dst + dst + dd, vals.to(v_dst.dtype.element_ty), mask=hk < HKV)


@triton.jit
def _router_down_kernel(x, wd, bd, z, M, D, R, BT: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr):
    """z[:, r] = x @ wd[r] + bd[r] in fp32 for the few tokens of a decode step, RB ranks per program.
    Grid (cdiv(R, RB),). Twin: wide.Router.logits (its first Linear)."""
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    t = tl.arange(0, BT)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BT, RB, BK], tl.float32)
    for k0 in range(0, D, BK):
        ok = k0 + kk < D
        a = tl.load(x + t[:, None] * D + k0 + kk[None, :], mask=(t < M)[:, None] & ok[None, :], other=0.0)
        w = tl.load(wd + r[:, None] * D + k0 + kk[None, :], mask=(r < R)[:, None] & ok[None, :], other=0.0)
        acc += a.to(tl.float32)[:, None, :] * w[None, :, :]
    zt = tl.sum(acc, 2) + tl.load(bd + r, mask=r < R, other=0.0)[None, :]
    tl.store(z + t[:, None] * R + r[None, :], zt, mask=(t < M)[:, None] & (r < R)[None, :])


@triton.jit
def _router_up_kernel(z, wu, bu, keep, keepf, M, G, R, TB: tl.constexpr, RP: tl.constexpr, BG: tl.constexpr):
    """The (execute, skip) logit pair of each group, then wide.Router's inference rule: skip iff
    z_skip > z_exec (a tie executes). Grid (cdiv(M, TB), cdiv(G, BG)). Writes keep as bool and float."""
    t = (tl.program_id(0) * TB + tl.arange(0, TB))[:, None, None]
    g = (tl.program_id(1) * BG + tl.arange(0, BG))[None, :, None]
    r = tl.arange(0, RP)[None, None, :]
    zr = tl.load(z + t * R + r, mask=(t < M) & (r < R), other=0.0)
    wm = (g < G) & (r < R)
    z_exec = tl.sum(tl.load(wu + (2 * g) * R + r, mask=wm, other=0.0) * zr, 2)
    z_skip = tl.sum(tl.load(wu + (2 * g + 1) * R + r, mask=wm, other=0.0) * zr, 2)
    t, g = tl.sum(t, 2), tl.sum(g, 2)  # [TB, 1], [1, BG]
    ok = (t < M) & (g < G)
    on = z_skip + tl.load(bu + 2 * g + 1, mask=g < G, other=0.0) <= z_exec + tl.load(bu + 2 * g, mask=g < G, other=0.0)
    tl.store(keep + t * G + g, on.to(tl.uint8), mask=ok)
    tl.store(keepf + t * G + g, on.to(tl.float32), mask=ok)

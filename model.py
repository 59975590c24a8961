"""
The dense model: a Llama-style decoder, small enough to read in one sitting.

  tokens -> embed -> [ RMSNorm -> attention (GQA, RoPE) -> + -> RMSNorm -> SwiGLU FFN -> + ] x L -> RMSNorm -> head

The two places WIDE (wide.py) cares about are marked "WIDE:" below: each attention head's output can
be multiplied by a per-token head mask just before `o_proj`, and the SwiGLU product `silu(gate) * up`
can be multiplied by a per-token channel mask just before `down_proj`. With no mask the model is an
ordinary Llama, and it loads Hugging Face Llama checkpoints (config.json + safetensors) as they are:
our parameter names are theirs, minus the leading "model.".

This file is the reference: it computes every layer dense and zeroes what is skipped (the training path
and the tests' ground truth). engine.py runs the same weights and masks through Triton kernels that
never do the skipped work; model.py itself needs no Triton.
"""
import copy
import json
import math
import os
import shutil
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from cli import UserError
from wide import FFNRule, shared_by_vote


class CheckpointError(UserError):
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
        """Build from a Hugging Face Llama config.json dict; anything that is not a Llama is refused."""
        kind = hf.get("model_type", "llama")
        if kind != "llama":
            raise CheckpointError(f"config.json says model_type {kind!r}: only Llama checkpoints load here")
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config.json asks for hidden_act {hf['hidden_act']!r}; a Llama FFN uses silu")
        if hf.get("sliding_window") and hf.get("use_sliding_window", True):
            raise CheckpointError("config.json asks for sliding-window attention, which this Llama model does not do")
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
    "tiny": dict(vocab_size=2048, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=384, max_seq_len=256),
    # A GPU preset, ~30M parameters.
    "small": dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=1536, max_seq_len=1024),
    # SmolLM2-135M's shape; its weights come from checkpoints.import_pretrained (train.py --model smollm2).
    "smollm2": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                    max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True),
    # Shape only (random weights), used by the speed benchmarks.
    "llama-3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                         max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
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
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


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
        # input_pos [T], or [B, T] when every row writes at its own positions (batched prompts)
        pos = input_pos.expand(k.shape[0], -1) if input_pos.dim() == 1 else input_pos
        idx = pos[:, None, :, None].expand_as(k)
        self.k_cache.scatter_(2, idx, k.to(self.k_cache.dtype))
        self.v_cache.scatter_(2, idx, v.to(self.v_cache.dtype))
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

    def forward(self, x, cos, sin, attn_mask, input_pos, masks=None, route_ffn=True, ffn_vote=None):
        # Routers read the residual *before* the RMSNorm: the attention router sees the layer input,
        # the FFN router the residual after attention (as in the paper's code).
        head_mask = self.attn_router(x) if self.attn_router is not None else None
        gate = self.layer_router(x) if self.layer_router is not None else None
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, input_pos, head_mask)
        h = x + (a if gate is None else a * gate)
        channel_mask = ran = self.ffn_router(h) if self.ffn_router is not None and route_ffn else None
        if channel_mask is not None and ffn_vote is not None:  # the vote rule (wide.FFNRule)
            channel_mask = ran = shared_by_vote(channel_mask, ffn_vote)
        if self.ffn_router is not None and not route_ffn:  # the batch rule (wide.FFNRule): the
            ran = h.new_ones(*h.shape[:-1], self.ffn_router.n_groups, dtype=torch.float32)  # all ran
        f = self.mlp(self.post_attention_layernorm(h), channel_mask)
        if masks is not None:  # the decisions, for the sparsity bookkeeping (wide.skip_rates)
            for kind, m in (("attn", head_mask), ("ffn", ran), ("layer", gate)):
                if m is not None:
                    masks.setdefault(kind, []).append(m)
        return h + (f if gate is None else f * gate)


def is_wide_tensor(name):
    """A router or LoRA tensor, by its state_dict name: what wide.py adds to this model (the router slots
    above, LoRA's lora_A / lora_B). Not a Llama weight, so checkpoints carry these apart from the rest
    and a Llama checkpoint loader leaves them to checkpoints.py's side."""
    return "router" in name or "lora_" in name


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
        # How a decode step of many rows sets its FFN width (serving): the batch rule unless told otherwise.
        self.ffn_rule = FFNRule()
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

    def clear_caches(self):
        for layer in self.layers:
            layer.self_attn.kv_cache = None
        self.causal_mask = None

    def rope(self, pos):
        """cos, sin [..., head_dim] of the rotary embedding at integer positions pos [...]."""
        angles = pos[..., None].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, idx, targets=None, input_pos=None, logits_at=None, masks=None):
        """idx [B, T] -> logits [B, T, vocab]; with targets also the mean cross-entropy (-100 = ignore).

        Without `input_pos` this is a plain causal forward over the T tokens (training, evaluation).
        With `input_pos` [T] (after setup_caches) the tokens sit at those positions, their K/V are written
        into the cache, and they attend to everything cached before them (prefill and decode).
        `input_pos` may also be [B, T], one row of positions per sequence: batched prompts of different
        lengths decode at different positions. `logits_at` [B] keeps only the logits at that position
        of each row -> [B, 1, vocab] (a prefill needs just each prompt's last token).
        `masks`: a dict to receive the routers' decisions, masks["attn"] / ["ffn"] / ["layer"] a list
        (one entry per layer, in order) of float masks [B, T, G], 1 = the group ran (wide.skip_rates).
        """
        B, T = idx.shape
        if input_pos is None and self.causal_mask is not None:
            raise ValueError("the KV cache is set up: pass input_pos (or call clear_caches() first)")
        if input_pos is not None and self.causal_mask is None:
            raise ValueError("input_pos needs a KV cache: call setup_caches(batch_size) first")
        if input_pos is None and T > self.config.max_seq_len:
            raise ValueError(f"{T} tokens do not fit the context of {self.config.max_seq_len}")
        pos = torch.arange(T, device=idx.device) if input_pos is None else input_pos
        cos, sin = self.rope(pos)
        if pos.dim() == 2:  # per-row positions: [B, 1, T, d] broadcasts over the heads
            cos, sin = cos[:, None], sin[:, None]
            attn_mask = self.causal_mask[input_pos][:, None]
        else:
            attn_mask = None if input_pos is None else self.causal_mask[None, None, input_pos]
        x = self.embed_tokens(idx)
        decode = input_pos is not None and T == 1  # one token per row, attending to the cache
        route_ffn, vote = self.ffn_rule.routes(B, decode), self.ffn_rule.votes_needed(B, decode)
        for layer in self.layers:
            # A fresh dict per layer: FSDP2 rebuilds the containers in a layer's arguments that hold
            # tensors needing gradients, so a dict already holding earlier layers' masks would be a copy.
            got = None if masks is None else {}
            x = layer(x, cos, sin, attn_mask, input_pos, got, route_ffn, vote)
            for kind, m in (got or {}).items():
                masks.setdefault(kind, []).extend(m)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]
        logits = F.linear(self.norm(x), self.head_weight())
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    # ------------------------------------------------------------------------------------------------
    # checkpoints: a directory in the Hugging Face Llama layout

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32):
        """Load our checkpoint or a local HF Llama directory (config.json + model.safetensors, or sharded)."""
        with torch.device("meta"):
            model = cls(cls.config_from_dir(path))
        return model.load_dense_state(load_safetensors_dir(path), dtype, device)

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
        """Fill the model from HF-named tensors; extra keys (routers, LoRA) are left for checkpoints.py."""
        own = self.state_dict()
        missing = [k for k in own if f"model.{k}" not in state and k not in state
                   and not (k == "lm_head.weight" and self.lm_head is None)]
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        # A tensor this model has no place for means a different architecture (biases, extra norms...):
        # refuse it rather than load a model with parts silently dropped. Routers and LoRA factors are
        # checkpoints.py's; old HF checkpoints store RoPE's inv_freq, and tied ones sometimes a copy of the head.
        known = set(own) | {f"model.{k}" for k in own}
        unknown = [k for k in state if k not in known and not is_wide_tensor(k)
                   and not k.endswith("rotary_emb.inv_freq") and not (k == "lm_head.weight" and self.lm_head is None)]
        if unknown:
            raise CheckpointError(f"checkpoint has {len(unknown)} tensors a Llama model does not have, e.g. "
                                  f"{unknown[0]!r}: it is not a Llama checkpoint")
        tensors = {k: state.get(f"model.{k}", state.get(k)) for k in own}
        for k, t in tensors.items():
            if tuple(t.shape) != tuple(own[k].shape):
                raise CheckpointError(f"tensor {k!r} has shape {tuple(t.shape)}, config says {tuple(own[k].shape)}")
        tensors = {k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}
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
        if is_wide_tensor(k):
            continue  # routers and LoRA factors are not Llama weights: checkpoints.save_wide passes them as extra_tensors
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


# ----------------------------------------------------------------------------------- picking the next token
def greedy(logits):
    """logits [..., vocab] -> the argmax ids [...], -1 where a row holds NaN or inf. One tensor, so the
    one host read of a step brings back the tokens and the finiteness check together."""
    return torch.where(torch.isfinite(logits).all(-1), logits.argmax(-1), -1)


def sample_rows(logits, temperature, top_k, top_p, noise):
    """logits [n, vocab] -> ids [n], -1 where a row holds NaN or inf; per row i: temperature[i] == 0 is
    greedy, else a draw from softmax(logits[i] / temperature[i]) over its top_k[i] likeliest tokens (0: all)
    and, of those, the smallest set whose probability reaches top_p[i]. The draw is the Gumbel-max trick on
    noise[i] (uniform draws from row i's request's own generator), so a request's tokens never depend on
    which other requests share its step."""
    x = logits.float() / temperature.clamp_min(1e-6)[:, None]
    ranked, order = x.sort(-1, descending=True)
    k = torch.where(top_k > 0, top_k, x.shape[-1]).clamp_max(x.shape[-1])
    cut = torch.arange(x.shape[-1], device=x.device)[None, :] >= k[:, None]  # past the top k
    prob = ranked.masked_fill(cut, float("-inf")).softmax(-1)  # the top k's distribution, likeliest first
    cut |= prob.cumsum(-1) - prob >= top_p[:, None]  # the likelier tokens already reach top_p
    cut[:, 0] = False  # the likeliest token always stays
    gumbel = -torch.log(-torch.log(noise.gather(-1, order).clamp(1e-20, 1.0 - 1e-7)))
    drawn = order.gather(-1, (ranked + gumbel).masked_fill(cut, float("-inf")).argmax(-1, keepdim=True))[:, 0]
    ids = torch.where(temperature > 0, drawn, logits.argmax(-1))
    return torch.where(torch.isfinite(logits).all(-1), ids, -1)

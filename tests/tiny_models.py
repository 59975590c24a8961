"""
The small models that tests/test_wide.py, test_baselines.py, test_train.py and test_checkpoints.py share.

Everything runs on the CPU in fp32 with a two-layer model of width 32 (4 query heads sharing 2 KV heads,
FFN width 64), so routers have 2 head groups (one KV group each) and 4 channel groups of 16. The random
models get weights of std 0.3: with the default 0.02 init the residual stream is so small that every
router logit sits near zero, and routing tests would only ever see near-ties.
"""
import types

import torch

import wide
from model import ModelConfig, Transformer

V = 64  # vocabulary of the test models


def small_config(**overrides):
    cfg = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64, max_seq_len=64)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def random_model(seed=0, **overrides):
    """A dense model with weight matrices of std 0.3 and norm gains 1 + 0.2 * noise (see the docstring)."""
    torch.manual_seed(seed)
    model = Transformer(small_config(**overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.3 * noise)
    return model.eval()


def wide_config(**overrides):
    # 2 head groups (attn_group_size defaults to n_heads / n_kv_heads = 2), 4 channel groups of 16.
    cfg = dict(ffn_group_size=16, rank=8)
    cfg.update(overrides)
    return wide.WideConfig(**cfg)


def wide_model(seed=0, **overrides):
    """A random model with freshly initialised routers, in eval mode (deterministic routing)."""
    model, wcfg = random_model(seed), wide_config(**overrides)
    torch.manual_seed(100 + seed)
    wide.install_routers(model, wcfg)
    return model.eval(), wcfg


def with_lora(model, rank=4, alpha=8.0, seed=0):
    """LoRA on every projection, with B made non-zero (a freshly installed LoRA is an exact no-op)."""
    wide.install_lora(model, rank, alpha)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, wide.LoRALinear):
                m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=g))
    return model.eval()


def tokens(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def run(model, idx):
    """Logits and the mask every router chose, by name: {"layer 0 attn": [B, T, G], "layer 0 ffn": ...}."""
    masks = {}
    logits = model(idx, masks=masks)
    return logits, {f"layer {i} {kind}": m for kind, per_layer in masks.items() for i, m in enumerate(per_layer)}


def router_params(model):
    return [p for n, p in model.named_parameters() if "router" in n]


def loop_args(**overrides):
    """The few command-line settings train.train_loop reads."""
    args = dict(device="cpu", seed=0, batch_size=16, block_size=32, eval_interval=10**6, grad_clip=1.0)
    args.update(overrides)
    return types.SimpleNamespace(**args)

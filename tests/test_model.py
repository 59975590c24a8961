"""
The specification of model.py, the dense model, one property per test: configs and presets, the
forward pass, causality, RoPE, the static KV cache, WIDE's two mask lines and how the model runs the
routers it is given. Checkpoints (loading, saving, Hugging Face parity) are tests/test_checkpoints.py.

Everything runs on the CPU in fp32 with a two-layer model of width 64, so the whole file takes
seconds. The random models get larger-than-usual weights and non-trivial RMSNorm gains: with the
default 0.02 init attention is almost uniform and the norms are all ones, so a mistake such as
swapped norms or a wrong RoPE pairing would hardly move the logits and could slip through.
"""
import copy
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as M
from conftest import assert_close
from model import ModelConfig, Transformer, rope_frequencies


@pytest.fixture(autouse=True)
def _no_grad():
    # Nothing here needs gradients; skipping autograd keeps the file fast.
    with torch.no_grad():
        yield


def small_config(**overrides):
    # 8 query heads share 2 KV heads (GQA with 4 queries per KV head), head_dim 8.
    cfg = dict(vocab_size=97, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, intermediate_size=96,
               max_seq_len=64)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def randomize_(module, seed):
    """Give every weight matrix std 0.1 and every norm gain 1 + 0.2 * noise (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.1 * noise)
    return module


def random_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return randomize_(Transformer(small_config(**overrides)), seed).eval()


def rope_cos_sin(model, T):
    # The cos/sin tables Transformer.forward builds for positions 0..T-1, for calling layers directly.
    angles = torch.arange(T).float()[:, None] * model.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def tokens(B, T, vocab=97, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def n_params(cfg):
    """The parameter count a config implies, written out by hand."""
    D, I, hd, L = cfg.dim, cfg.intermediate_size, cfg.head_dim, cfg.n_layers
    attn = D * cfg.n_heads * hd * 2 + D * cfg.n_kv_heads * hd * 2   # q, o and k, v
    ffn = 3 * D * I                                                # gate, up, down
    norms = 2 * D
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return cfg.vocab_size * D + L * (attn + ffn + norms) + D + head


# ----------------------------------------------------------------------------------------------------
# configs and presets

def test_parameter_count_formula_matches_an_instantiated_model():
    # The formula used for the 8B preset below is checked here against real modules.
    for tie in (True, False):
        cfg = small_config(tie_embeddings=tie)
        assert n_params(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())


def test_presets_build_their_configs():
    tiny = ModelConfig.from_name("tiny")
    assert (tiny.dim, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.head_dim) == (128, 4, 8, 4, 16)
    assert tiny.tie_embeddings and tiny.rope_scaling is None
    small = ModelConfig.from_name("small")
    assert 25e6 < n_params(small) < 35e6, "the 'small' preset is documented as ~30M parameters"
    # Llama 3.1 8B is shape-only here: never instantiated, its size follows from the config alone.
    big = ModelConfig.from_name("llama-3.1-8b")
    assert (big.dim, big.n_layers, big.n_heads, big.n_kv_heads, big.head_dim) == (4096, 32, 32, 8, 128)
    assert big.intermediate_size == 14336 and big.vocab_size == 128256 and not big.tie_embeddings
    assert big.rope_theta == 500000.0 and big.rope_scaling["rope_type"] == "llama3"
    assert n_params(big) == 8_030_261_248  # the published parameter count of Llama 3.1 8B


def test_presets_are_fresh_copies():
    # Editing one config must not leak into the next from_name call.
    a = ModelConfig.from_name("llama-3.1-8b")
    a.rope_scaling["factor"] = 1.0
    a.dim = 1
    b = ModelConfig.from_name("llama-3.1-8b")
    assert b.dim == 4096
    assert b.rope_scaling["factor"] == 8.0, "from_name shares the preset's rope_scaling dict between configs"


def test_unknown_preset_raises_value_error_naming_the_presets():
    with pytest.raises(ValueError) as e:
        ModelConfig.from_name("gpt-5")
    for name in ("tiny", "small", "llama-3.1-8b"):
        assert name in str(e.value)


def test_config_rejects_heads_that_are_not_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=6, n_kv_heads=4)


def test_head_dim_defaults_to_dim_over_heads_and_can_be_set():
    assert ModelConfig(dim=64, n_heads=8, n_kv_heads=2).head_dim == 8
    cfg = small_config(head_dim=16)  # Llama-style models may decouple head_dim from dim / n_heads
    m = randomize_(Transformer(cfg), 0)
    assert m.layers[0].self_attn.q_proj.weight.shape == (8 * 16, 64)
    assert m(tokens(1, 5)).shape == (1, 5, 97)


# ----------------------------------------------------------------------------------------------------
# the plain forward

def test_forward_gives_logits_and_the_mean_cross_entropy():
    model = random_model()
    idx = tokens(2, 9)
    logits = model(idx)
    assert logits.shape == (2, 9, 97) and logits.dtype == torch.float32
    targets = tokens(2, 9, seed=1)
    targets[0, :4] = -100  # ignored positions
    logits2, loss = model(idx, targets)
    assert torch.equal(logits2, logits)
    keep = targets != -100
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert_close(loss, expected, atol=1e-6, what="loss")


def test_tied_model_uses_the_embedding_as_its_head():
    tied, untied = random_model(tie_embeddings=True), random_model(tie_embeddings=False)
    assert tied.lm_head is None and tied.head_weight() is tied.embed_tokens.weight
    assert untied.head_weight() is untied.lm_head.weight
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()


def test_changing_a_future_token_never_changes_earlier_logits():
    model = random_model()
    idx = tokens(2, 12)
    base = model(idx)
    for t in range(12):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 97
        out = model(changed)
        assert_close(out[:, :t], base[:, :t], atol=0.0, what=f"logits before position {t}")
        # ...while the changed position itself does see its new token.
        assert (out[:, t] - base[:, t]).abs().max() > 1e-3


def test_a_batch_row_never_sees_another_row():
    model = random_model()
    idx = tokens(3, 10)
    together = model(idx)
    for b in range(3):
        assert_close(together[b:b + 1], model(idx[b:b + 1]), atol=1e-5, what=f"row {b} alone vs in a batch")


def test_forward_longer_than_the_context_raises_value_error():
    model = random_model()  # max_seq_len 64
    assert model(tokens(1, 64)).shape == (1, 64, 97)
    with pytest.raises(ValueError, match="64"):
        model(tokens(1, 65))


def test_llama3_rope_scaling_changes_only_the_low_frequencies():
    # Llama 3.1's rescaling: wavelengths shorter than original/high_freq_factor are kept, those longer
    # than original/low_freq_factor are slowed down by `factor`, the band between is interpolated.
    plain = M.rope_frequencies(small_config(head_dim=32))
    s = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=32)
    scaled = M.rope_frequencies(small_config(head_dim=32, rope_scaling=s))
    wavelen = 2 * torch.pi / plain.double()
    short, long = wavelen < 32 / 4, wavelen > 32 / 1
    assert short.any() and long.any() and (~short & ~long).any(), "the test should cover all three bands"
    assert torch.equal(scaled[short], plain[short])
    assert_close(scaled[long], plain[long] / 8, atol=1e-9, what="low frequencies")
    mid = ~short & ~long
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


# ----------------------------------------------------------------------------------------------------
# the static KV cache

def decode_logits(model, idx, prompt_len):
    """Prefill idx[:, :prompt_len] at once, then feed the rest one token at a time; all logits, [B, T, V]."""
    T = idx.shape[1]
    steps = [model(idx[:, :prompt_len], input_pos=torch.arange(prompt_len))]
    for t in range(prompt_len, T):
        steps.append(model(idx[:, t:t + 1], input_pos=torch.tensor([t])))
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("prompt_len", [1, 2, 7, 16])
def test_decode_with_cache_equals_full_forward(prompt_len):
    model = random_model()
    idx = tokens(3, prompt_len + 6)
    full = model(idx)
    model.setup_caches(batch_size=3, max_seq_len=32)
    try:
        cached = decode_logits(model, idx, prompt_len)
    finally:
        model.clear_caches()
    assert_close(cached[:, :prompt_len], full[:, :prompt_len], atol=1e-5, what="prefill logits")
    for t in range(prompt_len, idx.shape[1]):
        assert_close(cached[:, t], full[:, t], atol=1e-5, what=f"decode step at position {t}")


def test_decode_with_cache_equals_full_forward_with_llama3_rope_beyond_original_context():
    s = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=16)
    model = random_model(rope_scaling=s, tie_embeddings=False)
    idx = tokens(2, 40)
    full = model(idx)
    model.setup_caches(batch_size=2)  # the default cache length is the model's max_seq_len
    cached = decode_logits(model, idx, 30)
    model.clear_caches()
    assert_close(cached, full, atol=1e-5, what="cached vs full logits")


def test_prefill_in_chunks_equals_full_forward():
    model = random_model()
    idx = tokens(2, 13)
    full = model(idx)
    model.setup_caches(batch_size=2, max_seq_len=16)
    parts = [model(idx[:, a:b], input_pos=torch.arange(a, b)) for a, b in ((0, 3), (3, 4), (4, 11), (11, 13))]
    model.clear_caches()
    assert_close(torch.cat(parts, dim=1), full, atol=1e-5, what="chunked prefill vs full forward")


def test_reusing_the_cache_for_a_new_sequence_forgets_the_old_one():
    # generate.py reuses one cache: a new prompt written from position 0 must not see stale K/V
    # left behind by a longer earlier sequence.
    model = random_model()
    model.setup_caches(batch_size=2, max_seq_len=32)
    decode_logits(model, tokens(2, 20, seed=1), 5)
    second = tokens(2, 9, seed=2)
    cached = decode_logits(model, second, 4)
    model.clear_caches()
    assert_close(cached, model(second), atol=1e-5, what="second sequence through a used cache")


def test_clear_caches_returns_to_the_plain_forward():
    model = random_model()
    idx = tokens(2, 6)
    before = model(idx)
    model.setup_caches(batch_size=2, max_seq_len=8)
    model(idx, input_pos=torch.arange(6))
    model.clear_caches()
    assert all(layer.self_attn.kv_cache is None for layer in model.layers) and model.causal_mask is None
    assert torch.equal(model(idx), before)



def test_input_pos_without_a_cache_raises_value_error_naming_setup_caches():
    # Decoding before setup_caches (or after clear_caches) is a usage error, said in one line.
    model = random_model()
    idx = tokens(1, 4)
    with pytest.raises(ValueError, match=r"setup_caches"):
        model(idx, input_pos=torch.arange(4))
    model.setup_caches(batch_size=1, max_seq_len=8)
    with pytest.raises(ValueError, match="input_pos"):  # and the converse: a cache, but no positions
        model(idx)
    model.clear_caches()
    with pytest.raises(ValueError, match=r"setup_caches"):
        model(idx, input_pos=torch.arange(4))

# ----------------------------------------------------------------------------------------------------
# WIDE's masks: head_mask before o_proj, channel_mask before down_proj

def attention_inputs(seed=0, B=2, T=7):
    model = random_model(seed)
    attn = model.layers[0].self_attn
    x = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(seed + 1))
    cos, sin = rope_cos_sin(model, T)
    return attn, x, cos, sin


def with_o_proj_columns_scaled(attn, scale_per_head):
    """A copy of `attn` whose o_proj input columns of head h are multiplied by scale_per_head[h]."""
    out = copy.deepcopy(attn)
    hd = attn.head_dim
    out.o_proj.weight.mul_(torch.as_tensor(scale_per_head, dtype=torch.float32).repeat_interleave(hd))
    return out


def with_down_proj_columns_scaled(ffn, scale_per_channel):
    out = copy.deepcopy(ffn)
    out.down_proj.weight.mul_(torch.as_tensor(scale_per_channel, dtype=torch.float32))
    return out


@pytest.mark.parametrize("groups", [1, 4, 8])
def test_all_ones_head_mask_is_exactly_the_dense_attention(groups):
    attn, x, cos, sin = attention_inputs()
    dense = attn(x, cos, sin, None, None)
    masked = attn(x, cos, sin, None, None, head_mask=torch.ones(2, 7, groups))
    assert torch.equal(masked, dense)


@pytest.mark.parametrize("groups", [1, 4, 12, 96])
def test_all_ones_channel_mask_is_exactly_the_dense_ffn(groups):
    ffn = random_model().layers[0].mlp
    x = torch.randn(2, 7, 64)
    assert torch.equal(ffn(x, channel_mask=torch.ones(2, 7, groups)), ffn(x))


@pytest.mark.parametrize("groups,dead", [(4, 0), (4, 3), (8, 5), (2, 1)])
def test_zeroing_a_head_group_equals_zeroing_its_o_proj_columns(groups, dead):
    # Groups are contiguous heads: with 8 heads and 4 groups, group g is heads 2g and 2g+1. The mask
    # is applied without any rescaling of the surviving heads.
    attn, x, cos, sin = attention_inputs()
    mask = torch.ones(2, 7, groups)
    mask[..., dead] = 0
    per_group = 8 // groups
    scale = [0.0 if h // per_group == dead else 1.0 for h in range(8)]
    expected = with_o_proj_columns_scaled(attn, scale)(x, cos, sin, None, None)
    assert_close(attn(x, cos, sin, None, None, head_mask=mask), expected, atol=1e-6, what="masked attention")


@pytest.mark.parametrize("groups,dead", [(4, 0), (4, 2), (12, 11), (96, 40)])
def test_zeroing_a_channel_group_equals_zeroing_its_down_proj_columns(groups, dead):
    ffn = random_model().layers[0].mlp
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, groups)
    mask[..., dead] = 0
    per_group = 96 // groups
    scale = [0.0 if c // per_group == dead else 1.0 for c in range(96)]
    expected = with_down_proj_columns_scaled(ffn, scale)(x)
    assert_close(ffn(x, channel_mask=mask), expected, atol=1e-6, what="masked FFN")


def per_token_mask(B, T, G, seed):
    # A mix of hard 0/1 decisions and soft values, different for every token.
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, G, generator=g) > 0.5).float()
    mask[0, 1] = torch.rand(G, generator=g)  # one token with a soft (straight-through style) mask
    mask[1, 2] = 0                            # one token that skips everything
    mask[1, 3] = 1                            # one token that keeps everything
    return mask


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_per_token_head_mask_matches_a_per_token_manual_computation(groups):
    # For each token separately: run the *unmasked* attention over the whole sequence with o_proj's
    # columns scaled by that token's mask, and keep only that token's row.
    attn, x, cos, sin = attention_inputs(B=2, T=6)
    mask = per_token_mask(2, 6, groups, seed=groups)
    out = attn(x, cos, sin, None, None, head_mask=mask)
    for b in range(2):
        for t in range(6):
            scale = mask[b, t].repeat_interleave(8 // groups)
            expected = with_o_proj_columns_scaled(attn, scale)(x, cos, sin, None, None)[b, t]
            assert_close(out[b, t], expected, atol=1e-6, what=f"attention output of token ({b}, {t})")


@pytest.mark.parametrize("groups", [4, 12])
def test_per_token_channel_mask_matches_a_per_token_manual_computation(groups):
    ffn = random_model().layers[1].mlp
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(5))
    mask = per_token_mask(2, 6, groups, seed=groups)
    out = ffn(x, channel_mask=mask)
    for b in range(2):
        for t in range(6):
            scale = mask[b, t].repeat_interleave(96 // groups)
            expected = with_down_proj_columns_scaled(ffn, scale)(x)[b, t]
            assert_close(out[b, t], expected, atol=1e-6, what=f"FFN output of token ({b}, {t})")


class ConstantRouter(nn.Module):
    """A stand-in router: ignores its input except for the shape and returns a fixed mask."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x.clone())
        return self.mask[: x.shape[0], : x.shape[1]]


class LinearRouter(nn.Module):
    """A deterministic per-token router (hard decisions from a fixed random projection)."""

    def __init__(self, dim, groups, seed):
        super().__init__()
        self.proj = randomize_(nn.Linear(dim, groups), seed)

    def forward(self, x):
        return (self.proj(x) > 0).float()


def test_all_ones_routers_give_exactly_the_dense_model():
    model = random_model()
    idx = tokens(2, 8)
    dense = model(idx)
    for layer in model.layers:
        layer.attn_router = ConstantRouter(torch.ones(2, 8, 4))
        layer.ffn_router = ConstantRouter(torch.ones(2, 8, 12))
        layer.layer_router = ConstantRouter(torch.ones(2, 8, 1))
    assert torch.equal(model(idx), dense)


def test_routers_read_the_raw_residual_before_the_norm():
    # The attention router sees the layer input; the FFN router the residual after attention.
    model = random_model()
    idx = tokens(2, 8)
    layer = model.layers[0]
    layer.attn_router = ConstantRouter(torch.ones(2, 8, 4))
    layer.ffn_router = ConstantRouter(torch.ones(2, 8, 12))
    model(idx)
    x = model.embed_tokens(idx)
    assert torch.equal(layer.attn_router.inputs[0], x)
    cos, sin = rope_cos_sin(model, 8)
    h = x + layer.self_attn(layer.input_layernorm(x), cos, sin, None, None)
    assert_close(layer.ffn_router.inputs[0], h, atol=1e-6, what="FFN router input")


def test_masks_dict_receives_every_routers_mask_layer_by_layer():
    # forward(masks={}) is how callers see the routing decisions (wide.skip_rates): one entry per layer,
    # in layer order, exactly the tensor each router returned; the logits do not depend on asking.
    model = random_model()
    idx = tokens(2, 8)
    for i, layer in enumerate(model.layers):
        layer.attn_router = LinearRouter(64, 4, seed=10 + i)
        layer.ffn_router = LinearRouter(64, 12, seed=20 + i)
        layer.layer_router = ConstantRouter(torch.full((2, 8, 1), float(i + 1)))
    masks = {}
    logits = model(idx, masks=masks)
    assert torch.equal(logits, model(idx))
    assert sorted(masks) == ["attn", "ffn", "layer"]
    assert [tuple(m.shape) for m in masks["attn"]] == [(2, 8, 4)] * 2
    assert [tuple(m.shape) for m in masks["ffn"]] == [(2, 8, 12)] * 2
    assert [m.unique().tolist() for m in masks["layer"]] == [[1.0], [2.0]], "one entry per layer, in order"
    x = model.embed_tokens(idx)
    assert torch.equal(masks["attn"][0], model.layers[0].attn_router(x))
    assert all(m.dtype == torch.float32 for ms in masks.values() for m in ms)
    # A dense model records nothing.
    dense, masks = random_model(), {}
    dense(idx, masks=masks)
    assert masks == {}


def test_layer_router_zero_gate_skips_the_whole_block():
    model = random_model()
    idx = tokens(2, 8)
    for layer in model.layers:
        layer.layer_router = ConstantRouter(torch.zeros(2, 8, 1))
    expected = F.linear(model.norm(model.embed_tokens(idx)), model.head_weight())
    assert torch.equal(model(idx), expected)


def test_decode_with_cache_equals_full_forward_with_routers():
    # Routing is per token, so prefill + decode must route every token exactly as the full forward.
    model = random_model()
    for i, layer in enumerate(model.layers):
        layer.attn_router = LinearRouter(64, 4, seed=10 + i)
        layer.ffn_router = LinearRouter(64, 12, seed=20 + i)
    idx = tokens(2, 12)
    full = model(idx)
    model.setup_caches(batch_size=2, max_seq_len=16)
    cached = decode_logits(model, idx, 5)
    model.clear_caches()
    assert_close(cached, full, atol=1e-5, what="routed model, cached vs full")


def test_head_mask_never_touches_keys_and_values():
    # K/V stay dense: a token that skips all its heads still writes its keys and values to the cache.
    idx = tokens(2, 8)
    caches = []
    for routed in (False, True):
        model = random_model()
        if routed:
            for layer in model.layers:
                layer.attn_router = ConstantRouter(torch.zeros(2, 8, 4))
        model.setup_caches(batch_size=2, max_seq_len=8)
        model(idx, input_pos=torch.arange(8))
        caches.append(model.layers[0].self_attn.kv_cache)
    assert torch.equal(caches[0].k_cache, caches[1].k_cache)
    assert torch.equal(caches[0].v_cache, caches[1].v_cache)


# ----------------------------------------------------------------------------------------------------
# model.py stands alone: the reference model needs neither Triton nor the kernels

def test_model_imports_and_runs_without_triton():
    # A fresh interpreter in which `import triton` (and the project's Triton files) fail: model.py must
    # still import, run a forward and decode through its KV cache.
    script = textwrap.dedent("""
        import sys
        for name in ("triton", "kernels", "kernels_attention", "engine"):
            sys.modules[name] = None  # any `import name` now raises ImportError
        import torch
        import model
        cfg = model.ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=8, n_kv_heads=2,
                                intermediate_size=96, max_seq_len=16)
        m = model.Transformer(cfg).eval()
        idx = torch.randint(0, 97, (2, 5))
        with torch.no_grad():
            full = m(idx)
            m.setup_caches(batch_size=2)
            cached = torch.cat([m(idx[:, :3], input_pos=torch.arange(3)),
                                m(idx[:, 3:4], input_pos=torch.tensor([3])),
                                m(idx[:, 4:5], input_pos=torch.tensor([4]))], dim=1)
        assert full.shape == (2, 5, 97) and torch.allclose(cached, full, atol=1e-5)
        assert sys.modules.get("triton") is None and sys.modules.get("kernels") is None
        print("ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------
# llama3 RoPE's smoothed middle band (rope_frequencies): the frequencies whose wavelength lies between
# original_max / high_freq_factor and original_max / low_freq_factor are interpolated between "slowed by
# factor" and "kept". The Hugging Face parity tests use head_dim 8, which has no frequency there;
# Llama-3.1-8B's RoPE (head_dim 128, theta 500000, context 8192) has three, compared with transformers'
# own llama3 initialisation.

def test_llama3_rope_interpolates_the_middle_band_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    transformers.utils.logging.set_verbosity_error()
    cfg = ModelConfig.from_name("llama-3.1-8b")
    s = cfg.rope_scaling
    hf_cfg = transformers.LlamaConfig(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim,
                                      max_position_embeddings=131072,
                                      rope_parameters=dict(s, rope_theta=cfg.rope_theta))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_frequencies(cfg)
    wavelen = 2 * math.pi / ours
    old = s["original_max_position_embeddings"]
    band = (wavelen > old / s["high_freq_factor"]) & (wavelen < old / s["low_freq_factor"])
    assert band.sum() >= 3, "the test needs frequencies inside the smoothed band"
    # Ratios, not differences: the band's frequencies are ~1e-3, the highest is 1.
    assert_close(ours / theirs, torch.ones_like(ours), atol=1e-6, what="our / transformers' inverse frequencies")

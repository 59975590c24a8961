"""
The specification of model.py, one property per test.

Everything runs on the CPU in fp32 with a two-layer model of width 64, so the whole file takes
seconds. The random models get larger-than-usual weights and non-trivial RMSNorm gains: with the
default 0.02 init attention is almost uniform and the norms are all ones, so a mistake such as
swapped norms or a wrong RoPE pairing would hardly move the logits and could slip through.
"""
import copy
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as M
from model import CheckpointError, ModelConfig, Transformer


@pytest.fixture(autouse=True)
def _no_grad():
    # Nothing here needs gradients; skipping autograd keeps the file fast.
    with torch.no_grad():
        yield


def assert_close(actual, expected, atol, what="tensors"):
    """Like torch.testing.assert_close, but the message says how far apart the tensors are."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel() == 0:
        return
    diff = (actual.float() - expected.float()).abs()
    assert diff.max().item() <= atol, (
        f"{what} differ: max abs diff {diff.max().item():.3g}, mean {diff.mean().item():.3g} (allowed {atol:g})")


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
    assert_close(loss, expected, 1e-6, "loss")


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
        assert_close(out[:, :t], base[:, :t], 0.0, f"logits before position {t}")
        # ...while the changed position itself does see its new token.
        assert (out[:, t] - base[:, t]).abs().max() > 1e-3


def test_a_batch_row_never_sees_another_row():
    model = random_model()
    idx = tokens(3, 10)
    together = model(idx)
    for b in range(3):
        assert_close(together[b:b + 1], model(idx[b:b + 1]), 1e-5, f"row {b} alone vs in a batch")


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
    assert_close(scaled[long], plain[long] / 8, 1e-9, "low frequencies")
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
    assert_close(cached[:, :prompt_len], full[:, :prompt_len], 1e-5, "prefill logits")
    for t in range(prompt_len, idx.shape[1]):
        assert_close(cached[:, t], full[:, t], 1e-5, f"decode step at position {t}")


def test_decode_with_cache_equals_full_forward_with_llama3_rope_beyond_original_context():
    s = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=16)
    model = random_model(rope_scaling=s, tie_embeddings=False)
    idx = tokens(2, 40)
    full = model(idx)
    model.setup_caches(batch_size=2)  # the default cache length is the model's max_seq_len
    cached = decode_logits(model, idx, 30)
    model.clear_caches()
    assert_close(cached, full, 1e-5, "cached vs full logits")


def test_prefill_in_chunks_equals_full_forward():
    model = random_model()
    idx = tokens(2, 13)
    full = model(idx)
    model.setup_caches(batch_size=2, max_seq_len=16)
    parts = [model(idx[:, a:b], input_pos=torch.arange(a, b)) for a, b in ((0, 3), (3, 4), (4, 11), (11, 13))]
    model.clear_caches()
    assert_close(torch.cat(parts, dim=1), full, 1e-5, "chunked prefill vs full forward")


def test_reusing_the_cache_for_a_new_sequence_forgets_the_old_one():
    # generate.py reuses one cache: a new prompt written from position 0 must not see stale K/V
    # left behind by a longer earlier sequence.
    model = random_model()
    model.setup_caches(batch_size=2, max_seq_len=32)
    decode_logits(model, tokens(2, 20, seed=1), 5)
    second = tokens(2, 9, seed=2)
    cached = decode_logits(model, second, 4)
    model.clear_caches()
    assert_close(cached, model(second), 1e-5, "second sequence through a used cache")


def test_clear_caches_returns_to_the_plain_forward():
    model = random_model()
    idx = tokens(2, 6)
    before = model(idx)
    model.setup_caches(batch_size=2, max_seq_len=8)
    model(idx, input_pos=torch.arange(6))
    model.clear_caches()
    assert all(layer.self_attn.kv_cache is None for layer in model.layers) and model.causal_mask is None
    assert torch.equal(model(idx), before)


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
    assert_close(attn(x, cos, sin, None, None, head_mask=mask), expected, 1e-6, "masked attention")


@pytest.mark.parametrize("groups,dead", [(4, 0), (4, 2), (12, 11), (96, 40)])
def test_zeroing_a_channel_group_equals_zeroing_its_down_proj_columns(groups, dead):
    ffn = random_model().layers[0].mlp
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, groups)
    mask[..., dead] = 0
    per_group = 96 // groups
    scale = [0.0 if c // per_group == dead else 1.0 for c in range(96)]
    expected = with_down_proj_columns_scaled(ffn, scale)(x)
    assert_close(ffn(x, channel_mask=mask), expected, 1e-6, "masked FFN")


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
            assert_close(out[b, t], expected, 1e-6, f"attention output of token ({b}, {t})")


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
            assert_close(out[b, t], expected, 1e-6, f"FFN output of token ({b}, {t})")


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
    assert_close(layer.ffn_router.inputs[0], h, 1e-6, "FFN router input")


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
    assert_close(cached, full, 1e-5, "routed model, cached vs full")


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
# Hugging Face checkpoints: same logits as transformers' LlamaForCausalLM

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
SENTENCES = ["the quick brown fox jumps over the lazy dog", "WIDE prunes heads and channels per token",
             "Hello, world! 123 tabs\tand  spaces", "ünïcödé and emoji 🙂 survive byte-level BPE"]
TEXT = "The lazy WIDE fox, ünïcödé 42!\nA new line 🙂"


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="module")
def bpe():
    """A tiny byte-level BPE trained on a few sentences (vocab 300 < the models' vocab of 320)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return tok


def hf_llama(transformers, seed, tie, rope_scaling=None, max_pos=64):
    kwargs = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie)
    rope = dict(rope_type="default", rope_theta=10000.0) if rope_scaling is None else dict(rope_scaling, rope_theta=10000.0)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_parameters=rope, **kwargs))
    return randomize_(hf, seed).eval()


def save_hf_dir(transformers, hf, tok, path, **save_kwargs):
    hf.save_pretrained(path, **save_kwargs)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tie,rope_scaling,shard", [
    (True, None, False),
    (False, None, False),
    (False, LLAMA3_ROPE, False),
    (True, LLAMA3_ROPE, True),
], ids=["tied", "untied", "untied-llama3-rope", "tied-llama3-rope-sharded"])
def test_hf_llama_checkpoint_gives_the_same_logits_as_transformers(transformers, bpe, tmp_path, tie, rope_scaling, shard):
    hf = hf_llama(transformers, 1, tie, rope_scaling)
    d = save_hf_dir(transformers, hf, bpe, tmp_path, **({"max_shard_size": "20KB"} if shard else {}))
    if shard:
        assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
        assert not os.path.isfile(os.path.join(d, "model.safetensors"))
    model = Transformer.from_pretrained(d).eval()
    cfg = model.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, cfg.tie_embeddings) == (8, 2, 8, 1e-6, tie)
    assert (cfg.rope_scaling is None) == (rope_scaling is None)
    idx = tokens(2, 48, vocab=320)  # 48 > 32: positions past the llama3 original context
    assert_close(model(idx), hf(idx).logits, 1e-4, "our logits vs transformers' logits")


def test_hf_tokenizer_json_encodes_like_transformers(transformers, bpe, tmp_path):
    d = save_hf_dir(transformers, hf_llama(transformers, 2, True), bpe, tmp_path)
    ours = M.load_tokenizer(d).encode(TEXT).ids
    theirs = transformers.AutoTokenizer.from_pretrained(d)(TEXT, add_special_tokens=False)["input_ids"]
    assert ours == theirs and len(ours) > 5
    assert M.load_tokenizer(d).decode(ours) == TEXT


def test_from_hf_reads_rope_settings_in_old_and_new_layouts():
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    # transformers 4.x: rope_theta at the top level, llama3 settings under rope_scaling.
    old = ModelConfig.from_hf(dict(base, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)))
    # transformers 5.x: both under rope_parameters.
    new = ModelConfig.from_hf(dict(base, rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0)))
    assert old.rope_theta == new.rope_theta == 500000.0
    assert torch.equal(M.rope_frequencies(old), M.rope_frequencies(new))
    assert old.rope_scaling["factor"] == 8.0
    # The plain default rope, in both layouts, means no scaling.
    for hf in (dict(base, rope_theta=1e4, rope_scaling=None), dict(base, rope_parameters=dict(rope_type="default", rope_theta=1e4))):
        cfg = ModelConfig.from_hf(hf)
        assert cfg.rope_scaling is None and cfg.rope_theta == 1e4


def test_from_hf_rejects_what_this_model_cannot_run():
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8)
    with pytest.raises(CheckpointError, match="yarn"):
        ModelConfig.from_hf(dict(base, rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)))
    with pytest.raises(CheckpointError, match="bias"):
        ModelConfig.from_hf(dict(base, attention_bias=True))


# ----------------------------------------------------------------------------------------------------
# our own checkpoints

@pytest.mark.parametrize("tie,rope_scaling", [(True, None), (False, LLAMA3_ROPE)], ids=["tied", "untied-llama3-rope"])
def test_save_checkpoint_round_trip_gives_identical_logits(bpe, tmp_path, tie, rope_scaling):
    model = random_model(3, tie_embeddings=tie, rope_scaling=rope_scaling)
    path = str(tmp_path / "ckpt")
    M.save_checkpoint(path, model, bpe)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "no .tmp or .old directory may be left behind"
    loaded = Transformer.from_pretrained(path).eval()
    assert loaded.config == model.config
    idx = tokens(2, 40)
    assert torch.equal(loaded(idx), model(idx))
    assert M.load_tokenizer(path).encode(TEXT).ids == bpe.encode(TEXT).ids


@pytest.mark.parametrize("tie,rope_scaling", [(True, None), (False, LLAMA3_ROPE)], ids=["tied", "untied-llama3-rope"])
def test_our_checkpoint_loads_in_transformers_with_the_same_logits(transformers, tmp_path, tie, rope_scaling):
    model = random_model(4, tie_embeddings=tie, rope_scaling=rope_scaling)
    M.save_checkpoint(str(tmp_path), model)
    hf, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    idx = tokens(2, 48)
    assert_close(hf.eval()(idx).logits, model(idx), 1e-4, "transformers' logits on our checkpoint")


def test_save_checkpoint_writes_only_the_dense_model_and_the_extras_asked_for(tmp_path):
    from safetensors.torch import load_file
    model = random_model()
    model.layers[0].attn_router = nn.Linear(64, 8)  # wide.py's tensors are saved via extra_tensors only
    extra = {"router.weight": torch.ones(2, 3)}
    M.save_checkpoint(str(tmp_path), model, extra_tensors=extra, extra_files={"wide.json": {"groups": 4}})
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any("attn_router" in k for k in saved)
    assert torch.equal(saved["router.weight"], extra["router.weight"])
    assert json.loads((tmp_path / "wide.json").read_text()) == {"groups": 4}
    assert all(k.startswith("model.") for k in saved if k != "router.weight")  # HF names
    assert Transformer.from_pretrained(str(tmp_path)) is not None  # extra tensors do not break loading


def test_save_checkpoint_is_atomic_when_writing_fails_midway(bpe, tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    old_model = random_model(5)
    M.save_checkpoint(path, old_model, bpe)
    before = {name: (tmp_path / "ckpt" / name).read_bytes() for name in os.listdir(path)}

    import safetensors.torch

    def crash_after_half_a_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash_after_half_a_file)
    with pytest.raises(OSError, match="disk full"):
        M.save_checkpoint(path, random_model(6), bpe)
    monkeypatch.undo()

    assert {name: (tmp_path / "ckpt" / name).read_bytes() for name in os.listdir(path)} == before
    idx = tokens(1, 10)
    assert torch.equal(Transformer.from_pretrained(path).eval()(idx), old_model(idx))
    # The next save succeeds and cleans up the leftovers of the failed one.
    new_model = random_model(7)
    M.save_checkpoint(path, new_model, bpe)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.equal(Transformer.from_pretrained(path).eval()(idx), new_model(idx))


def test_save_checkpoint_is_atomic_when_the_tokenizer_fails(bpe, tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    old_model = random_model(5)
    M.save_checkpoint(path, old_model, bpe)

    class BrokenTokenizer:
        def save(self, file):
            raise RuntimeError("tokenizer cannot be written")

    with pytest.raises(RuntimeError):
        M.save_checkpoint(path, random_model(6), BrokenTokenizer())
    idx = tokens(1, 10)
    assert torch.equal(Transformer.from_pretrained(path).eval()(idx), old_model(idx))
    assert M.load_tokenizer(path).encode(TEXT).ids == bpe.encode(TEXT).ids


# ----------------------------------------------------------------------------------------------------
# errors: one clear CheckpointError naming the problem

@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    M.save_checkpoint(str(path), random_model())
    return path


def test_missing_directory_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Transformer.from_pretrained(str(tmp_path / "nowhere"))


def test_directory_without_config_raises_checkpoint_error(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        Transformer.from_pretrained(str(checkpoint))


@pytest.mark.parametrize("content", ["{not json", '{"hidden_size": 64}'], ids=["garbage", "incomplete"])
def test_invalid_config_raises_checkpoint_error(checkpoint, content):
    (checkpoint / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match="not a valid Llama config"):
        Transformer.from_pretrained(str(checkpoint))


def test_directory_without_weights_raises_checkpoint_error(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Transformer.from_pretrained(str(checkpoint))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_weights_raise_checkpoint_error(checkpoint, damage):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(4096), "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="corrupt or incomplete"):
        Transformer.from_pretrained(str(checkpoint))


def test_sharded_checkpoint_with_a_missing_shard_raises_checkpoint_error(transformers, tmp_path):
    hf_llama(transformers, 1, True).save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / sorted(set(index["weight_map"].values()))[1]).unlink()
    with pytest.raises(CheckpointError, match="corrupt or incomplete"):
        Transformer.from_pretrained(str(tmp_path))


def test_corrupt_shard_index_raises_checkpoint_error(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00001.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="corrupt"):
        Transformer.from_pretrained(str(checkpoint))


def test_config_with_wrong_shapes_raises_checkpoint_error(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=128)))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight.* shape"):
        Transformer.from_pretrained(str(checkpoint))


def test_config_asking_for_more_layers_than_saved_raises_checkpoint_error(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    with pytest.raises(CheckpointError, match=r"lacks .*layers\.2\."):
        Transformer.from_pretrained(str(checkpoint))


def test_missing_or_broken_tokenizer_raises_checkpoint_error(checkpoint):
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        M.load_tokenizer(str(checkpoint))
    (checkpoint / "tokenizer.json").write_text("{garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        M.load_tokenizer(str(checkpoint))


def test_checkpoint_error_is_a_value_error():
    # Scripts catch CheckpointError to print one line; generic callers may catch ValueError.
    assert issubclass(CheckpointError, ValueError)

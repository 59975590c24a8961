"""
Lines that no other test held in place: each test here fails if its one line is changed.

  * llama3 RoPE's smoothed middle band (model.rope_frequencies): the frequencies whose wavelength lies
    between original_max / high_freq_factor and original_max / low_freq_factor are interpolated between
    "slowed by factor" and "kept". The Hugging Face parity tests use head_dim 8, which has no frequency
    there; Llama-3.1-8B's RoPE (head_dim 128, theta 500000, context 8192) has three, compared here
    with transformers' own llama3 initialisation.
  * model.save_checkpoint's swap: the old checkpoint goes to `path.old`, the new one from `path.tmp`
    to `path`. A failure between the two renames must leave the old checkpoint whole (at `path.old`,
    named by the error that loading `path` gives) and nothing half-written at `path`.
  * the exact tensor names written: the Hugging Face Llama layout, `lm_head.weight` for an untied head
    and no head at all for a tied one. Our loader (and transformers') accept `model.lm_head.weight` too,
    so only reading the file itself shows what was written.
  * top-k sampling (generate.sample): draws go beyond the argmax, and never outside each row's top k.
  * the dial (dial.py): calibrate's split of a target over the routers (one common shift per target,
    so each router keeps its own share, not the target itself), and the tie rule inside the calibration
    hook (dial.dialled: a gap exactly at the offset executes, as the folded bias does).
"""
import math
import os
import types

import pytest
import torch

import dial
import generate
import wide
from conftest import assert_close
from model import CheckpointError, ModelConfig, Transformer, rope_frequencies, save_checkpoint
from tiny_models import random_model, tokens, wide_model


# ----------------------------------------------------------------------------------------------------
# llama3 RoPE: the smoothed middle band

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


# ----------------------------------------------------------------------------------------------------
# checkpoints: the swap of the two renames, and the names written

def test_a_save_that_fails_between_its_two_renames_keeps_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    old_model = random_model(1)
    save_checkpoint(path, old_model)
    real_replace = os.replace

    def replace(src, dst):  # the first rename (path -> path.old) happens; the second one fails
        if src.endswith(".tmp"):
            raise OSError("power cut")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="power cut"):
        save_checkpoint(path, random_model(2))
    monkeypatch.undo()

    assert not os.path.exists(path), "nothing half-written may appear at the final path"
    with pytest.raises(CheckpointError, match=r"ckpt\.old"):  # one line that says where the old one is
        Transformer.from_pretrained(path)
    os.rename(path + ".old", path)  # what that line tells the user to do
    idx = tokens(1, 12)
    with torch.no_grad():
        assert torch.equal(Transformer.from_pretrained(path).eval()(idx), old_model(idx)), "the old checkpoint changed"


def hf_llama_names(n_layers, tied):
    """The tensor names of a Hugging Face LlamaForCausalLM checkpoint."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    for i in range(n_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    return names


@pytest.mark.parametrize("lora", [False, True], ids=["dense", "with unmerged LoRA"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_checkpoint_tensor_names_are_exactly_hugging_face_llamas(tmp_path, tied, lora):
    from safetensors import safe_open
    model = random_model(3, tie_embeddings=tied)
    if lora:  # a LoRA-wrapped projection keeps its frozen weight under the projection's own name
        wide.install_lora(model, rank=2, alpha=4.0)
    save_checkpoint(str(tmp_path), model)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == hf_llama_names(model.config.n_layers, tied)
        if not tied:
            assert torch.equal(f.get_tensor("lm_head.weight"), model.lm_head.weight)


# ----------------------------------------------------------------------------------------------------
# top-k sampling

def test_top_k_sampling_draws_beyond_the_argmax_but_never_outside_each_rows_top_k():
    k, n = 4, 2000
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    rows = logits.repeat_interleave(n, 0)  # n draws from each row, one generator: many independent seeds
    draws = generate.sample(rows, temperature=1.0, top_k=k, generator=torch.Generator().manual_seed(1))
    for r in range(2):
        seen = set(draws[r * n:(r + 1) * n].flatten().tolist())
        top = set(torch.topk(logits[r], k).indices.tolist())
        assert seen == top, f"row {r}: drew {sorted(seen)}, its top {k} are {sorted(top)}"


# ----------------------------------------------------------------------------------------------------
# the dial: the split of a target over the routers, and the tie rule of the calibration hook

WINDOWS = tokens(16, 32, seed=1)


@pytest.mark.parametrize("targets", [dict(target=0.4), dict(attn_target=0.6, ffn_target=0.2)],
                         ids=["shared target", "separate targets"])
def test_calibration_gives_each_router_its_own_sampled_rate_under_one_shift_per_target(targets):
    model, _ = wide_model()
    with torch.no_grad():  # FFN routers that lean to skipping: a shared target must not split evenly
        for layer in model.layers:
            layer.ffn_router.up.bias[1::2] += 1.5
    offsets, realized = dial.calibrate(model, WINDOWS, **targets)
    gaps = dial.collect_gaps(model, WINDOWS, None)  # {(kind, layer): skip-minus-execute gaps}, no dial
    if "target" in targets:
        members = {("attn", "ffn"): targets["target"]}
    else:
        members = {("attn",): targets["attn_target"], ("ffn",): targets["ffn_target"]}
    for kinds, t in members.items():
        mine = {key: g for key, g in gaps.items() if key[0] in kinds}
        c = dial.solve_shift(list(mine.values()), t)  # one shift for every router of this target
        share = {key: torch.sigmoid(g + c).mean().item() for key, g in mine.items()}
        assert sum(share.values()) / len(share) == pytest.approx(t, abs=1e-6)
        assert max(share.values()) - min(share.values()) > 0.03, "the routers' shares should differ"
        for (kind, i), want in share.items():
            # As near as equal gaps allow (a token that recurs has one gap): well within 0.01 here.
            assert realized[kind][i] == pytest.approx(want, abs=0.01), f"{kind} router of layer {i}"


def test_inside_the_calibration_hook_a_gap_exactly_at_the_offset_executes():
    router = wide.Router(dim=4, n_groups=2, rank=2).eval()
    with torch.no_grad():
        router.up.weight.zero_()
        router.up.bias.copy_(torch.tensor([0.5, 0.25, 0.5, 0.75]))  # gaps z_skip - z_exec: -0.25, +0.25
    model = types.SimpleNamespace(layers=[types.SimpleNamespace(attn_router=router, ffn_router=None, layer_router=None)])
    x = torch.randn(3, 5, 4)
    for offset, keep in ((0.25, [1.0, 0.0]), (-0.25, [1.0, 1.0]), (0.2500001, [0.0, 0.0])):
        with dial.dialled(model, {"attn": [offset]}), torch.no_grad():
            out = router(x)
        assert torch.equal(out, torch.tensor(keep).expand(3, 5, 2)), f"offset {offset}: a tie executes"

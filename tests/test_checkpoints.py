"""
The specification of model.py's checkpoints, one property per test: Hugging Face Llama directories
load with the same logits (and the same tokenizer) as transformers, our own checkpoints round-trip and
load in transformers, saving is atomic, and every way a checkpoint can be wrong (missing, damaged, or
not a Llama at all) ends in one CheckpointError naming the problem, never in a half-loaded model.
Then checkpoints.py's router checkpoints: routers and LoRA round-trip, and run directories are named
and read back by one pair of functions.

The random models are test_model.py's (two layers, width 64, larger-than-usual weights), and for the
router checkpoints tiny_models.py's.
"""
import json
import os
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

import checkpoints
import data
import model as M
import tiny_models as tm
import wide
from conftest import assert_close
from model import CheckpointError, ModelConfig, Transformer, save_checkpoint
from test_model import randomize_, random_model, tokens


@pytest.fixture(autouse=True)
def _no_grad():
    # Nothing here needs gradients; skipping autograd keeps the file fast.
    with torch.no_grad():
        yield


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
    assert_close(model(idx), hf(idx).logits, atol=1e-4, what="our logits vs transformers' logits")


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
    assert_close(hf.eval()(idx).logits, model(idx), atol=1e-4, what="transformers' logits on our checkpoint")


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


# ----------------------------------------------------------------------------------------------------
# not a Llama: refused, never loaded with parts silently dropped

@pytest.mark.parametrize("change,word", [
    (dict(model_type="qwen2"), "qwen2"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(sliding_window=4096, use_sliding_window=True), "sliding"),
    (dict(attention_bias=True), "bias"),
    (dict(mlp_bias=True), "bias"),
], ids=["qwen2", "gelu", "sliding-window", "attention-bias", "mlp-bias"])
def test_config_of_another_architecture_raises_checkpoint_error(checkpoint, change, word):
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(cfg, **change)))
    with pytest.raises(CheckpointError, match=word):
        Transformer.from_pretrained(str(checkpoint))


def test_config_fields_that_a_llama_may_carry_still_load(checkpoint):
    # The refusals above are about what the fields ask for, not that they are present.
    cfg = json.loads((checkpoint / "config.json").read_text())
    quiet = dict(sliding_window=None, attention_bias=False, mlp_bias=False, hidden_act="silu", model_type="llama")
    (checkpoint / "config.json").write_text(json.dumps(dict(cfg, **quiet)))
    assert Transformer.from_pretrained(str(checkpoint)) is not None
    (checkpoint / "config.json").write_text(json.dumps(dict(cfg, sliding_window=4096, use_sliding_window=False)))
    assert Transformer.from_pretrained(str(checkpoint)) is not None


@pytest.mark.parametrize("extra", [
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.1.mlp.down_proj.bias",
    "model.layers.0.post_feedforward_layernorm.weight",
])
def test_weights_a_llama_does_not_have_raise_checkpoint_error(checkpoint, extra):
    # A valid Llama config over a safetensors file with more in it (Qwen2's q/k/v biases, say): loading
    # only the Llama part would give a different model without a word.
    from safetensors.torch import load_file, save_file
    file = str(checkpoint / "model.safetensors")
    state = load_file(file)
    state[extra] = torch.ones(64)
    save_file(state, file)
    with pytest.raises(CheckpointError, match="does not have") as e:
        Transformer.from_pretrained(str(checkpoint))
    assert extra in str(e.value)


# ----------------------------------------------------------------------------------------------------
# router checkpoints (checkpoints.py): the dense weights + router / LoRA tensors + wide.json, and the
# run directory names. The models are tiny_models.py's (2 layers, 2 head groups, 4 channel groups).


@pytest.fixture(scope="module")
def tokenizer():
    return data.train_tokenizer(["To be, or not to be, that is the question."] * 4, 300)


def router_and_lora_tensors(model):
    return {k: v for k, v in model.state_dict().items() if M.is_wide_tensor(k)}


@pytest.mark.parametrize("method", ["wide", "layerskip"])
def test_router_and_lora_checkpoint_round_trips(tmp_path, tokenizer, method):
    model, wcfg = tm.wide_model(method=method, lora_rank=4, lora_alpha=8.0, stage=2)
    tm.with_lora(model)
    idx = tm.tokens(2, 10)
    expected, expected_masks = tm.run(model, idx)
    path = str(tmp_path / "ckpt")
    checkpoints.save_wide(path, model, tokenizer, wcfg)

    loaded, wcfg2 = checkpoints.load_wide(path, merge=False)
    loaded.eval()
    assert asdict(wcfg2) == asdict(wcfg)
    saved, got = router_and_lora_tensors(model), router_and_lora_tensors(loaded)
    assert saved.keys() == got.keys() and len(saved) > 0
    for k in saved:
        assert torch.equal(got[k], saved[k]), f"{k} changed in the round trip"
    logits, masks = tm.run(loaded, idx)
    assert_close(logits, expected, atol=0.0, what="logits after load_wide(merge=False)")
    for name, keep in masks.items():
        assert torch.equal(keep, expected_masks[name]), f"{name} routes differently after loading"

    merged, _ = checkpoints.load_wide(path)  # merge=True is the default, for inference
    merged.eval()
    assert not any(isinstance(m, wide.LoRALinear) for m in merged.modules())
    assert_close(merged(idx), expected, atol=1e-5 * expected.abs().max().item(),
                 what="logits after load_wide(merge=True)")


def test_load_wide_in_bf16_merges_lora_into_bf16_weights_and_keeps_routers_fp32(tmp_path, tokenizer):
    # What generate.py does on a GPU with a stage-2 checkpoint.
    model, wcfg = tm.wide_model(lora_rank=4, lora_alpha=8.0, stage=2)
    tm.with_lora(model)
    idx = tm.tokens(2, 10)
    path = str(tmp_path / "ckpt")
    checkpoints.save_wide(path, model, tokenizer, wcfg)
    loaded, _ = checkpoints.load_wide(path, dtype=torch.bfloat16)
    loaded.eval()
    wrong = [n for n, p in loaded.named_parameters() if "router" not in n and p.dtype != torch.bfloat16]
    assert not wrong, f"backbone weights not in bf16 after the merge: {wrong[:3]}"
    assert {p.dtype for p in tm.router_params(loaded)} == {torch.float32}
    # The same as merging in fp32 and then casting the backbone to bf16 (routers stay fp32). This random
    # model is chaotic (std 0.3 weights), so bf16 vs fp32 logits are not compared here; the kernels'
    # GPU tests hold the bf16 tolerances.
    wide.merge_lora(model)
    for name, p in model.named_parameters():
        if "router" not in name:
            p.data = p.data.to(torch.bfloat16)
    assert torch.equal(loaded(idx), model(idx))


def test_load_wide_of_a_dense_checkpoint_raises_checkpoint_error(tmp_path, tokenizer):
    path = str(tmp_path / "dense")
    M.save_checkpoint(path, tm.random_model(), tokenizer)
    with pytest.raises(CheckpointError, match="wide.json"):
        checkpoints.load_wide(path)


@pytest.mark.parametrize("wcfg,stage,name,read_back", [
    (dict(target=0.5), 1, "wide-s0.5-stage1", ("wide", 0.5, 1)),
    (dict(method="layerskip", target=0.25), 2, "layerskip-s0.25-stage2", ("layerskip", 0.25, 2)),
    (dict(attn_target=0.6, ffn_target=0.4), 1, "wide-a0.6-f0.4-stage1", ("wide", 0.5, 1)),  # the mean
    (dict(target=1e-05), 2, "wide-s1e-05-stage2", ("wide", 1e-05, 2)),
])
def test_run_directory_names_read_back_as_what_they_were_written_from(wcfg, stage, name, read_back):
    w = wide.WideConfig(**wcfg)
    assert checkpoints.run_name(w, stage) == name
    assert checkpoints.run_dir("out", w, stage) == os.path.join("out", name)
    method, target, st = checkpoints.parse_run_name(name)
    assert (method, st) == read_back[::2] and target == pytest.approx(read_back[1])


@pytest.mark.parametrize("name", ["base", "wide-s0.5-stage3", "teal-s0.5-stage1", "wide-sx-stage1", "wide-s0.5-stage1.old",
                                  "wide-a0.6-stage1"])
def test_names_run_name_does_not_write_are_not_run_directories(name):
    assert checkpoints.parse_run_name(name) is None


def test_router_checkpoints_lists_trained_stages_by_name_and_skips_the_rest(tmp_path, tokenizer):
    model, wcfg = tm.wide_model()
    for name in ("wide-s0.5-stage2", "wide-s0.25-stage1", "base-stage1"):
        checkpoints.save_wide(str(tmp_path / name), model, tokenizer, wcfg)
    (tmp_path / "wide-s0.75-stage1").mkdir()  # no wide.json: not (yet) a checkpoint
    got = [(os.path.basename(p), *rest) for p, *rest in checkpoints.router_checkpoints(str(tmp_path))]
    assert got == [("wide-s0.25-stage1", "wide", 0.25, 1), ("wide-s0.5-stage2", "wide", 0.5, 2)]
    assert checkpoints.router_checkpoints(str(tmp_path / "nowhere")) == []


# ----------------------------------------------------------------------------------------------------
# model.save_checkpoint's swap: the old checkpoint goes to `path.old`, the new one from `path.tmp` to `path`.
# A failure between the two renames must leave the old checkpoint whole (at `path.old`, named by the error
# that loading `path` gives) and nothing half-written at `path`. And the exact tensor names written: the
# Hugging Face Llama layout, `lm_head.weight` for an untied head and no head at all for a tied one. Our
# loader (and transformers') accept `model.lm_head.weight` too, so only reading the file shows what was written.

def test_a_save_that_fails_between_its_two_renames_keeps_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    old_model = tm.random_model(1)
    save_checkpoint(path, old_model)
    real_replace = os.replace

    def replace(src, dst):  # the first rename (path -> path.old) happens; the second one fails
        if src.endswith(".tmp"):
            raise OSError("power cut")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="power cut"):
        save_checkpoint(path, tm.random_model(2))
    monkeypatch.undo()

    assert not os.path.exists(path), "nothing half-written may appear at the final path"
    with pytest.raises(CheckpointError, match=r"ckpt\.old"):  # one line that says where the old one is
        Transformer.from_pretrained(path)
    os.rename(path + ".old", path)  # what that line tells the user to do
    idx = tm.tokens(1, 12)
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
    model = tm.random_model(3, tie_embeddings=tied)
    if lora:  # a LoRA-wrapped projection keeps its frozen weight under the projection's own name
        wide.install_lora(model, rank=2, alpha=4.0)
    save_checkpoint(str(tmp_path), model)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == hf_llama_names(model.config.n_layers, tied)
        if not tied:
            assert torch.equal(f.get_tensor("lm_head.weight"), model.lm_head.weight)

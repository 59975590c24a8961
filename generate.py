"""
Generate text: prompt -> prefill (one forward over the prompt, filling the KV cache) -> decode (one
token at a time, each attending to the cache).

    python generate.py --prompt "ROMEO:"                 # the base model train.py wrote to out/base
    python generate.py --checkpoint path/to/hf-llama-dir  # any local HF Llama directory works too

An empty prompt (--prompt "") starts from the end-of-text token, i.e. the model begins a new passage.
"""
import argparse
import sys
import time

import torch

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="out/base", help="checkpoint directory (ours or a local HF Llama)")
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

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = Transformer.from_pretrained(args.checkpoint, device=args.device, dtype=dtype).eval()
    tok = load_tokenizer(args.checkpoint)
    ids = encode_prompt(tok, args.prompt)
    ctx = model.config.max_seq_len
    if len(ids) > ctx:
        raise SystemExit(f"error: the prompt is {len(ids)} tokens, longer than the model's context of {ctx}")
    if len(ids) + args.max_new_tokens > ctx:
        raise SystemExit(f"error: {len(ids)} prompt tokens + {args.max_new_tokens} new tokens exceed the "
                         f"context of {ctx}; lower --max-new-tokens to {ctx - len(ids)} or less")

    idx = torch.tensor([ids] * args.num_samples, device=args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    sync(args.device)
    t0 = time.perf_counter()
    out = generate(model, idx, args.max_new_tokens, args.temperature, args.top_k, gen)
    sync(args.device)
    dt = time.perf_counter() - t0
    for row in out.tolist():
        print(tok.decode(row[len(ids):] if args.prompt == "" else row))
        print("-" * 60)
    n = args.max_new_tokens * args.num_samples
    print(f"{n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s (batch {args.num_samples}, {args.device})")


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)

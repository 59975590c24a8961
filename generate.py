"""
Generate text: prompt -> prefill (one forward over the prompt, filling the KV cache) -> decode (one
token at a time, each attending to the cache).

    python generate.py --prompt "ROMEO:"                 # the dense model train.py wrote to out/base
    python generate.py --sparsity 0.5 --show-width       # WIDE: every token picks its own width
    python generate.py --sparsity 0.5 --compare-dense    # tokens/s of WIDE next to the dense model
    python generate.py --checkpoint path/to/hf-llama-dir  # any local HF Llama directory works too
    python generate.py --model smollm2 --sparsity 0.5 --show-width --prompt "The moon"  # SmolLM2-135M with
                                                          # the routers that ship in routers/smollm2/

--sparsity S (any S in [0, 1); or --attn-sparsity A --ffn-sparsity F) dials the routers trained for the
nearest target to S (checkpoints.load_dialled) and prints the realized sparsity and executed FLOPs.
--backend torch is the dense-masked reference; triton skips the pruned work (engine.py; on a GPU each
decode step replays as a CUDA graph); auto is triton on a GPU. Several --prompt flags make one batch of
prompts of different lengths; an empty prompt starts a new passage from the end-of-text token.
"""
import os

import torch

import checkpoints
import cli
import data
import engine
import wide
from dial import describe_offsets

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
def prefill(model, idx, temperature, top_k, generator=None, lengths=None, masks=None):
    """Run the whole prompt at positions 0..P-1; return the first new token of each row.

    With right-padded prompts, row b's next token comes from its last real position lengths[b] - 1;
    the padding after it cannot reach the real tokens (attention is causal)."""
    B, P = idx.shape  # idx: [B, P]
    last = torch.full((B,), P - 1, device=idx.device) if lengths is None else lengths - 1
    logits = model(idx, input_pos=torch.arange(P, device=idx.device), logits_at=last, masks=masks)
    return sample(logits[:, -1], temperature, top_k, generator)


@torch.no_grad()
def decode_one_token(model, token, pos, temperature, top_k, generator=None, masks=None):
    """One new token per sequence at position `pos` (a scalar, or one per row), attending to the cache."""
    # token: [B, 1]; pos: [] or [B]
    logits = model(token, input_pos=pos.view(1) if pos.dim() == 0 else pos.view(-1, 1), masks=masks)
    return sample(logits[:, -1], temperature, top_k, generator)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=0.0, top_k=None, generator=None, on_token=None,
             lengths=None, cuda_graph=None, timings=None):
    """idx [B, P] prompt ids -> [B, P + max_new_tokens].

    model: the model (backend torch) or an engine.Engine over it (backend triton); see engine.select.
    lengths [B]: the prompts have different lengths, right-padded into idx; row b of the result is its
    prompt idx[b, :lengths[b]], its new tokens, then zeros. on_token(i, token, masks): called with
    each new token [B, 1] and the routers' decisions of the forward that produced it (the prefill's
    [B, P, G], a decode step's [B, 1, G]; see Transformer.forward). cuda_graph: capture the decode step
    (default: on a GPU). timings: a dict that receives prefill_s, decode_s and decode_tokens (the
    decode steps after the graph capture, synchronized)."""
    B, P = idx.shape
    total = P + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"{P} prompt tokens + {max_new_tokens} new tokens exceed the context of "
                         f"{model.config.max_seq_len}; shorten the prompt or lower --max-new-tokens")
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=idx.device)
    if cuda_graph is None:
        cuda_graph = idx.is_cuda
    model.setup_caches(B, total)
    out = torch.zeros(B, total, dtype=torch.long, device=idx.device)
    out[:, :P] = idx if lengths is None else idx * (torch.arange(P, device=idx.device) < lengths[:, None])
    try:
        t0 = engine.clock(idx.device)
        masks = {} if on_token is not None else None
        token = prefill(model, idx, temperature, top_k, generator, lengths, masks)
        t1 = engine.clock(idx.device)
        prefill_s, graph = t1 - t0, None
        for i in range(max_new_tokens):
            if lengths is None:
                out[:, P + i] = token[:, 0]
            else:
                out.scatter_(1, (lengths + i)[:, None], token)
            if on_token is not None:
                on_token(i, token, masks)
            if i + 1 == max_new_tokens:
                break
            # Every row's next token sits right after its own last one: one position for the whole
            # batch, or one per row when the prompts differ in length.
            pos = torch.tensor(P + i, device=idx.device) if lengths is None else lengths + i
            if cuda_graph and graph is None:
                graph = engine.CUDAGraphDecoder(model, token, pos)
                t1 = engine.clock(idx.device)  # the capture is setup, not decode time
            if graph is not None:
                token, masks = sample(graph(token, pos), temperature, top_k, generator), graph.masks
            else:
                masks = {} if on_token is not None else None
                token = decode_one_token(model, token, pos, temperature, top_k, generator, masks)
        if timings is not None:
            timings.update(prefill_s=prefill_s, decode_s=engine.clock(idx.device) - t1,
                           decode_tokens=B * (max_new_tokens - 1))
    finally:
        model.clear_caches()
    return out


def encode_prompt(tok, prompt):
    if prompt == "":
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise cli.UserError("empty prompt: this tokenizer has no end-of-text token to start from; give --prompt")
        return [eot]
    return tok.encode(prompt).ids


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


# ----------------------------------------------------------------------------------- the command line
def parse_args(argv):
    """The flags, every number checked as it is read; then the checks that need several flags."""
    p = cli.parser(__doc__)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: out/base, or the "
                   "router checkpoint for --sparsity); ours or a local HF Llama directory")
    p.add_argument("--sparsity", type=cli.fraction(), help="dial the routers trained for the nearest target to this "
                   "sparsity")
    p.add_argument("--attn-sparsity", type=cli.fraction(), help="dial attention and FFN separately (with --ffn-sparsity)")
    p.add_argument("--ffn-sparsity", type=cli.fraction(), help="dial attention and FFN separately (with --attn-sparsity)")
    p.add_argument("--method", default="wide", choices=["wide", "layerskip"], help="with --sparsity")
    p.add_argument("--out-dir", default=None, help="where train.py wrote its checkpoints (default out, or "
                   "routers/MODEL with --model)")
    p.add_argument("--model", choices=sorted(checkpoints.PRETRAINED), help="a pretrained model, read from its "
                   "GGUF: dense, or with --sparsity the routers trained on it (routers/MODEL, or --out-dir)")
    p.add_argument("--show-width", action="store_true", help="colour each token by the width it used")
    p.add_argument("--prompt", action="append", help="the prompt (default ROMEO:); give it several times "
                   "for one batch of prompts of different lengths")
    p.add_argument("--max-new-tokens", type=cli.integer(1), default=200)
    p.add_argument("--temperature", type=cli.real(0), default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=cli.integer(0), default=200, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--num-samples", type=cli.integer(1), default=1, help="samples per prompt, generated together "
                   "as one batch")
    p.add_argument("--seed", type=cli.SEED, default=1337)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="torch: dense-masked reference; triton: kernels.py skips the pruned work; "
                        "auto: triton on a GPU")
    p.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-gptq"],
                   help="fp8: the pruned linears' weights quantized once to e4m3 (per-output-channel scales), "
                        "read as fp8 by the decode kernels (backend triton); fp8-gptq: their codes rounded by GPTQ "
                        "on 64 windows of the training plays (kernels.calibrate_fp8; closer to the model's outputs)")
    p.add_argument("--ffn-vote", type=cli.integer(1), default=None, help="the vote rule for FFN width (off by "
                   "default): in a decode step an FFN channel group runs for every row iff at least K rows want it, "
                   "so a row's output depends on its batch (without it, decode steps of more than 4 rows run the "
                   "whole FFN: the batch rule)")
    p.add_argument("--compare-dense", action="store_true", help="also time the same generation with the "
                   "routers off (the dense model, same engine) and print both speeds")
    args = p.parse_args(argv)
    per_type = args.attn_sparsity is not None
    if per_type != (args.ffn_sparsity is not None) or (per_type and args.sparsity is not None):
        cli.fail("give --sparsity S, or --attn-sparsity A with --ffn-sparsity F, not a mix")
    args.device = cli.pick_device(args.device)
    args.out_dir = args.out_dir or (os.path.join("routers", args.model) if args.model else "out")
    # The dial: the routers trained for the nearest target, offsets calibrated to the requested one.
    args.dial_to = args.sparsity if args.attn_sparsity is None else (args.attn_sparsity + args.ffn_sparsity) / 2
    return args


def load(args):
    """(path, model, wcfg, dialled): the checkpoint the flags name (checkpoints.load_for_inference), after the
    checks of the flags that need routers."""
    if args.show_width or args.compare_dense:
        flag = "--show-width" if args.show_width else "--compare-dense"
        if args.checkpoint is None and args.model and args.dial_to is None:
            cli.fail(f"{flag} needs routers (add --sparsity 0.5)")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    path, model, wcfg, dialled = checkpoints.load_for_inference(
        args.checkpoint, args.model, args.out_dir, args.method, args.sparsity, args.attn_sparsity,
        args.ffn_sparsity, windows=data.dial_windows, device=args.device, dtype=dtype)
    if wcfg is None and (args.show_width or args.compare_dense):
        cli.fail(f"{flag} needs a router checkpoint; {path} is a dense model (add --sparsity 0.5)")
    return path, model, wcfg, dialled


def prompt_batch(args, tok, ctx):
    """The prompts as one batch (each --num-samples times): (prompts, token rows, idx [B, P], lengths or
    None). Prompts are right-padded to the longest; each row decodes from its own length."""
    prompts = [q for q in (args.prompt or ["ROMEO:"]) for _ in range(args.num_samples)]
    rows = [encode_prompt(tok, q) for q in prompts]
    longest = max(len(r) for r in rows)
    if longest > ctx:
        cli.fail(f"the prompt is {longest} tokens, longer than the model's context of {ctx}")
    if longest + args.max_new_tokens > ctx:
        cli.fail(f"{longest} prompt tokens + {args.max_new_tokens} new tokens exceed the "
                 f"context of {ctx}; lower --max-new-tokens to {ctx - longest} or less")
    idx = torch.tensor([r + [0] * (longest - len(r)) for r in rows], device=args.device)
    lengths = None if len({len(r) for r in rows}) == 1 else [len(r) for r in rows]
    return prompts, rows, idx, lengths


def print_samples(args, tok, model, prompts, rows, out, widths):
    for b, row in enumerate(out.tolist()):
        n_prompt = len(rows[b])
        prompt_text = "" if prompts[b] == "" else tok.decode(row[:n_prompt])
        new = row[n_prompt:n_prompt + args.max_new_tokens]
        if args.show_width:
            pieces = [colour_for(prunable_share(model, w, b)) + tok.decode([t]) + RESET for t, w in zip(new, widths)]
            print(prompt_text + "".join(pieces))
        else:
            print(prompt_text + tok.decode(new))
        print("-" * 60)


def print_realized(args, wcfg, widths):
    """The mean width over every row's generated tokens, against the target the routers were dialled to."""
    mean = {k: torch.stack([w[k] for w in widths]).mean().item() for k in widths[0]}
    if wcfg.method == "wide":
        target = args.dial_to if args.dial_to is not None else wide.trained_target(wcfg)
        print(f"realized sparsity over generated tokens: attention {1 - mean['attn']:.1%}, "
              f"FFN {1 - mean['ffn']:.1%} (target {target:g}); executed linear FLOPs {mean['flops']:.1%} of dense")
    else:
        target = args.dial_to if args.dial_to is not None else wcfg.target
        print(f"realized layer skipping over generated tokens: {1 - mean['layer']:.1%} "
              f"(target {target:g}); executed linear FLOPs {mean['flops']:.1%} of dense")


def compare_dense(args, model, forward, backend, idx, lengths):
    """--compare-dense: the same generation with the routers on and off, in the same engine."""
    speed = {}
    for name in ("WIDE", "dense"):
        saved = wide.routers_off(model) if name == "dense" else None
        try:  # the same run twice: the first compiles (Triton, cuDNN plans for these strides); time the second
            generate(forward, idx, args.max_new_tokens, lengths=lengths)
            t = {}
            generate(forward, idx, args.max_new_tokens, args.temperature, args.top_k,
                     torch.Generator(device=args.device).manual_seed(args.seed), lengths=lengths, timings=t)
            speed[name] = t
        finally:
            if saved:
                wide.routers_on(model, saved)
    for name, t in speed.items():
        label = "dense (routers off, same engine)" if name == "dense" else f"WIDE ({args.method})"
        print(f"{label}: decode {t['decode_tokens'] / max(t['decode_s'], 1e-9):.1f} tokens/s, "
              f"prefill {t['prefill_s'] * 1e3:.1f} ms")
    w, d = (speed[k]["decode_tokens"] / max(speed[k]["decode_s"], 1e-9) for k in ("WIDE", "dense"))
    print(f"WIDE / dense decode speed: {w / d:.2f}x "
          f"(prefill {speed['dense']['prefill_s'] / max(speed['WIDE']['prefill_s'], 1e-9):.2f}x)")
    if backend == "torch":
        print("note: the torch backend is the dense-masked reference (it computes every group, then "
              "zeroes the skipped ones), so it cannot be faster than dense; skipping becomes time "
              "with --backend triton on a GPU")


def main(argv=None):
    args = parse_args(argv)
    path, model, wcfg, dialled = load(args)
    model.ffn_rule = wide.FFNRule(vote=args.ffn_vote)  # the batch rule unless --ffn-vote
    backend = engine.backend_of(model, args.backend)
    if args.weights != "bf16" and backend == "torch":  # before any calibration
        cli.fail(f"--weights {args.weights} runs on the Triton engine; add --backend triton (a CUDA GPU, "
                 "or TRITON_INTERPRET=1 on a CPU)")
    tok = checkpoints.tokenizer_for(path, args.model)
    weights = engine.fp8_weights(model.eval(), args.weights, tok)  # "fp8-gptq": GPTQ's codes, then "fp8"
    forward = engine.select(model, backend, weights=weights)  # the one backend switch
    prompts, rows, idx, lengths = prompt_batch(args, tok, model.config.max_seq_len)

    widths = []  # per generated token: the width of the forward pass that produced it (kept on device)
    on_token = None
    if wcfg is not None:
        last = torch.tensor([len(r) - 1 for r in rows], device=args.device)
        on_token = lambda i, token, masks: widths.append(token_widths(masks, model.config, wcfg, last if i == 0 else None))
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    t0 = engine.clock(args.device)
    out = generate(forward, idx, args.max_new_tokens, args.temperature, args.top_k, gen, on_token, lengths=lengths)
    dt = engine.clock(args.device) - t0
    widths = [{k: v.cpu() for k, v in w.items()} for w in widths]

    print(f"checkpoint: {path}" + (f" ({wcfg.method}, target {wide.trained_target(wcfg):g}, stage {wcfg.stage})" if wcfg else ""))
    if dialled:  # which offsets turned that checkpoint into the requested sparsity
        target = " ".join(f"{k} {v:g}" for k, v in dialled["targets"].items())
        print(f"dial: {target}; offsets " + (describe_offsets(dialled["offsets"]) if dialled["offsets"] else "none")
              + f" ({dialled['source']})")
    if backend == "triton":
        print("backend triton; where each op runs:\n" + forward.describe(*idx.shape))
    if args.show_width:
        print(width_legend())
    print_samples(args, tok, model, prompts, rows, out, widths)
    n = args.max_new_tokens * len(rows)
    where = f"{args.device}, backend {backend}" + (", CUDA graph" if args.device.startswith("cuda") else "")
    print(f"{n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s (batch {len(rows)}, {where})")
    if wcfg is not None:
        print_realized(args, wcfg, widths)
    if args.compare_dense:
        compare_dense(args, model, forward, backend, idx, lengths)


def token_widths(masks, cfg, wcfg, at=None):
    """The width each row's new token was produced with: {"attn"/"ffn"/"layer": [B], "flops": [B]}.

    masks: the routers' decisions of one forward (generate's on_token). A decode step has one position
    per row; a prefill's token comes from each row's last prompt position `at` [B] (the positions after
    it are padding for the shorter prompts of a batch, and must not count)."""
    w = wide.last_width(masks, cfg, wcfg)  # each [B, T]
    if at is None:
        return {k: v[:, -1].float() for k, v in w.items()}
    return {k: v[torch.arange(v.shape[0], device=v.device), at].float() for k, v in w.items()}


def prunable_share(model, w, b):
    """The share of the prunable (Q, O, FFN) linear work a token ran: the colour scale of --show-width."""
    f = wide.linear_flops(model.config)
    if "layer" in w:
        return w["layer"][b].item()
    attn, ffn = f["q"] + f["o"], f["ffn"]
    return (w["attn"][b].item() * attn + w["ffn"][b].item() * ffn) / (attn + ffn)


if __name__ == "__main__":
    cli.run(main)

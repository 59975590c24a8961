"""
Which op of a step runs where, decided in one place: `Policy.plan(shape, routers)` returns, for one step's
shape, every op with where it runs (a Triton kernel, cuBLAS, SDPA), on which weights (bf16, fp8 codes, fp8
dequantized) and which Triton kernels it launches. `Policy.layer_plan` decides a layer op by op, one method
per op. engine.py runs straight through the plan; `Plan.text()` is what `generate.py --backend triton`
prints; the tests record a step's launches and compare them with `Plan.launches()`.

Every token count that decides where an op runs is named here: the Policy's fields, and the two below at
which a kernel itself changes its code path (kernels.py and kernels_step.py read them from here).
"""
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple


# The token counts at which a kernel takes another code path; the kernels read them from here.
GEMV_MAX_TOKENS = 16  # gemm_mn / gemm_k: at most this many tokens run the decode GEMV (mask read directly,
                      # no layout; the only path that reads fp8 codes); more run token tiles
NORM_ROUTE_TILE = 4  # norm_route: tokens per program; each tile's last program applies the router's second
                     # Linear token by token, and a step of one tile also gets its live list ...
NORM_ROUTE_SPLIT_MAX_TOKENS = 64  # ... in steps of at most this many tokens (Policy.router_split_max_tokens);
                                  # longer ones run its two D-split kernels


class Shape(NamedTuple):
    """What a plan depends on: the step's token count and kind, and the weight format."""
    tokens: int            # B * T tokens in the step
    decode: bool           # one token per row at per-row positions; else a prefill (from `start`)
    start: int = 0         # a prefill chunk's first position (0: a whole prompt or its first chunk)
    dtype: str = "bf16"    # the model's dtype: "bf16", "fp16" or "fp32"
    fp8: bool = False      # Engine(weights="fp8"): the prunable linears' weights as e4m3 codes
    dense_ffn: bool = False  # the batch rule (wide.FFNRule) turned this step's FFN routers off: a decode step
                             # of many rows runs the whole FFN, as dense
    ffn_vote: int = 0        # the vote rule (wide.FFNRule): the rows an FFN group needs (0: no vote); the rows
                             # share one FFN mask, so the decode kernels skip the groups it drops for every row


class Op(NamedTuple):
    """One op of a step: `kind` is what the engine dispatches on, the rest is what it means."""
    kind: str              # e.g. "gemv", "tiles", "cublas" (see KINDS)
    runs: str              # "Triton", "cuBLAS", "_scaled_mm" (torch's fp8 GEMM), "SDPA" or "torch"
    weights: str = ""      # linears: "fp8" (the kernel reads e4m3 codes), "fp8 -> bf16" (dequantized), "fp8 x fp8"
                           # (_scaled_mm: e4m3 codes times the input quantized per token), else the dtype
    kernels: tuple = ()    # the Triton kernels it launches, one launch each (names as tests record them)


# kind -> what the op does then (the text generate.py prints)
KINDS = {
    "norm": "RMSNorm (rms_norm)",
    "norm_route": "RMSNorm + the router in one launch (norm_route; two in a prefill chunk), residual add fused",
    "norm_route_deferred": "RMSNorm + the router's first Linear in one launch (norm_route_deferred), residual add "
                           "fused; the decode GEMV after it applies the rule and writes the mask",
    "norm_then_router": "RMSNorm (rms_norm), then the router module itself (two fp32 GEMMs)",
    "norm_route_side": "RMSNorm (rms_norm), and norm_route's decision on a side stream, beside the GEMMs that do "
                       "not read its mask; the layer waits for it where the mask is first read",
    "norm_then_router_side": "RMSNorm (rms_norm), then the router module on a side stream, beside the GEMMs that do "
                             "not read its mask; the layer waits for it where the mask is first read",
    "norm_fp8": "RMSNorm (rms_norm), its output as per-token fp8 rows for _scaled_mm, in the same launch",
    "layout": "mask reordering: per group, its live tokens first (layout + work list)",
    "gemv": "the live groups' weight rows only (gemm_mn's decode GEMV, its live-group list); K and V as its dense tail; "
            "RoPE and the KV-cache write in its epilogue",
    "gemv_all": "every row as the dense tail of gemm_mn's decode GEMV (the dense model through WIDE's kernel); RoPE and "
                "the KV-cache write in its epilogue",
    "tiles": "Q's live (group, token-tile) items only (gemm_mn, sorted tiles); K and V in one cuBLAS GEMM",
    "cublas": "one library GEMM (nothing routed here)",
    "cublas_every_head": "one library GEMM for every head's Q, K, V (attention reads the live groups' Q only)",
    "cublas_masked_input": "one library GEMM on the masked input (exact: the pruned slots are zero)",
    "cublas_masked": "one library GEMM, then silu(gate)*up with the pruned groups zeroed in one launch (swiglu_rows)",
    "rope": "RoPE + KV-cache write (rope_and_store)",
    "decode_live": "per row, only the KV heads whose head group runs are read (attn_decode's work list)",
    "decode_every": "each row's cache up to its length, every head (attn_decode's work list)",
    "decode_sdpa": "SDPA over the whole cache with a length mask",
    "prefill_live": "the live (group, query-tile) items only (attn_prefill over the layout)",
    "prefill_every": "attn_prefill with every head on (a chunk after the first)",
    "sdpa_causal": "SDPA, causal (cuDNN / flash): the dense baseline at its best",
    "sdpa_rows": "SDPA with the model's causal-mask rows for a chunk after the first",
    "sdpa_causal_zeroed": "SDPA, causal, every head; the pruned heads' outputs zeroed as they are laid out for O",
    "prefill_every_zeroed": "attn_prefill with every head on (a chunk after the first); the pruned heads' outputs zeroed "
                            "as they are laid out for O",
    "sdpa_rows_zeroed": "SDPA with the causal-mask rows, every head; the pruned heads' outputs zeroed as they are laid "
                        "out for O",
    "gemv_fused": "gate+up over the live channel groups only, silu(gate)*up in the epilogue (gemm_mn's decode GEMV)",
    "gemv_fused_all": "gate+up, every group as the dense tail of gemm_mn's decode GEMV, silu(gate)*up in the epilogue",
    "tiles_fused": "gate+up over the live (group, token-tile) items, silu(gate)*up in the epilogue (gemm_mn)",
    "gemm_k": "the live groups' weight columns only (gemm_k; few tokens: from the router's live list), residual add in "
              "the epilogue",
    "gemm_k_all": "gemm_k with every group live (the dense model through WIDE's kernel), residual fused",
    "embed": "embedding lookup",
}

# The order ops run in (and are printed in); `step_*` ops run once per step, the others once per layer.
LAYER_OPS = ("attn_norm", "attn_layout", "qkv", "rope", "attention", "o",
             "ffn_norm", "ffn_layout", "gate_up", "down")
NAMES = {"attn_norm": "attention norm", "attn_layout": "attention layout", "qkv": "Q, K, V",
         "rope": "RoPE + cache", "attention": "attention", "o": "O proj", "ffn_norm": "FFN norm",
         "ffn_layout": "FFN layout", "gate_up": "gate + up", "down": "down proj",
         "step_embed": "embedding", "step_every_head": "every-head layout", "step_norm": "final norm",
         "step_head": "lm_head"}

LAYOUT = ("layout_kernel", "worklist_kernel")
DECODE_ATTENTION = ("attn_decode_kernel",)  # the split merge runs in the same launch


@dataclass(frozen=True)
class Policy:
    """The engine's thresholds, in tokens per step (B * T). Everything `plan` does not send to cuBLAS / SDPA
    runs its Triton kernel."""
    # Q, O and the FFN skip weights through Triton in steps of at most this many tokens (the decode GEMVs
    # read only the live groups: past a few tokens their union covers nearly every group) ...
    sparse_decode_max_tokens: int = 4
    # ... and Q and gate+up skip FLOPs in prefills of at least this many (gemm_mn's sorted tiles pay there)
    sparse_prefill_min_tokens: int = 1024
    # Steps of at most this many tokens run their unrouted linears (the dense model's, say) through WIDE's GEMV
    # and gemm_k with every group live, as fp8 weights always do; 0 = cuBLAS. On the H200 that is the faster
    # dense decode at batch 1 (bench/e2e.py times both: results/e2e_h200.md, 'cublas linears').
    dense_gemv_max_tokens: int = 1
    # fp8 weights: steps of at least this many tokens run the linears no WIDE kernel reads (the dense model's,
    # and a routed linear's library paths) on fp8 tensor cores, torch._scaled_mm, with the input quantized per
    # token in the step: weights and activations in e4m3 ("fp8 x fp8"), as stock fp8 serving runs. Shorter steps
    # run the dense model's through WIDE's kernels with every group live on the weight codes (weights only).
    # `python -m bench.e2e --only fp8` times the dense fp8 decode both ways and keeps the faster.
    fp8_scaled_mm_min_tokens: int = 1
    # A one-token _scaled_mm through the library's per-tensor scaling (fp32 out, the channels' scales applied
    # after: kernels.scaled_mm(tensorwise=True)) instead of its per-row path; bench.e2e --only fp8 times both.
    fp8_tensorwise_one_token: bool = False
    # Steps longer than this run the router module itself after the norm (two fp32 GEMMs and the rule, op by
    # op); the default sends every step to norm_route, whose D-split kernels take prefill chunks in two launches.
    router_max_tokens: int = 1 << 20
    # Steps of at most this many tokens take norm_route's split kernel (the router's ranks over programs, tiles of
    # NORM_ROUTE_TILE tokens: many programs, each reading the tile's rows once per rank); longer ones its D-split
    # kernels (a program per tile of tokens and slice of D, every rank: the rows read once, then added up).
    router_split_max_tokens: int = NORM_ROUTE_SPLIT_MAX_TOKENS
    # ... and its tile in such steps past NORM_ROUTE_SPLIT_MAX_TOKENS tokens (a power of two): more tokens per tile,
    # fewer reads of each token's row (once per rank and tile), longer serial work for each tile's last program.
    router_split_tile: int = NORM_ROUTE_TILE
    # One-token steps: norm_route stops after the router's first Linear and the decode GEMV that reads the mask
    # applies the rule in each of its programs (norm_route_deferred), so norm_route has no ticket and no last
    # program; False keeps the whole decision in norm_route (bench.e2e times both at batch 1).
    router_rule_in_gemv: bool = True
    dense_decode_attention: str = "triton"  # routers off: "triton" (reads each row's cache up to its length) or "sdpa"
    # Routers off, a prefill chunk after the first: "triton" (the prefill kernel, every head on) or "sdpa" (with
    # the model's causal-mask rows, which rules out flash); the Triton kernel was the faster on the H200.
    dense_chunk_attention: str = "triton"
    # WIDE prefill chunks of fewer tokens run attention as the dense model does (every head: SDPA from start 0,
    # dense_chunk_attention after it) and zero the pruned heads' outputs in the copy that lays them out for O:
    # in a short chunk nearly every (head group, query tile) has a token that runs the group, so the layout and
    # the live-tile kernel cost more than they skip; below sparse_prefill_min_tokens nothing else reads the layout.
    # 0: the live tiles at every length. (results/prefill_chunks_h100_every_head.md against the live tiles)
    live_attention_min_tokens: int = 1024
    # Where a step reads a router's mask only after its GEMMs (Q, K, V for every head, then attention over the
    # live heads or every head and the pruned ones zeroed; gate+up on cuBLAS, then the pruned groups zeroed), the
    # plain norm runs before them and the router's decision (norm_route's, or the module's) on a side CUDA stream
    # beside them (on a CPU, in line). bench.prefill --policy and bench.e2e time both.
    router_side_stream: bool = False

    def plan(self, shape, routers):
        """The whole step: routers is one (attn, ffn) pair per layer, each None (no router), "wide" (a
        wide.Router in fp32, which the fused kernel takes) or "other" (any other router module)."""
        if shape.dense_ffn:  # nothing to skip: the batch's union of channel masks is (nearly) full
            routers = [(a, None) for a, _ in routers]
        layers = [self.layer_plan(shape, a, f) for a, f in routers]
        step = {"step_embed": Op("embed", "torch")}
        if any(layer["attention"].kind.startswith("prefill_every") for layer in layers):
            step["step_every_head"] = Op("layout", "Triton", kernels=LAYOUT)  # built once per step, shared
        step["step_norm"] = Op("norm", "Triton", kernels=("rms_norm_kernel",))
        step["step_head"] = Op("cublas", "cuBLAS", shape.dtype)
        return Plan(shape, step, layers)

    def warm_chunks(self, chunk, positions):
        """(tokens, start) of the prefill chunks a server runs before its first request (engine.Engine.warm_prefill)
        so that no chunk it serves later compiles a Triton kernel inside a request's latency. A served prompt of P
        tokens runs chunks of `chunk` tokens from start 0, then a remainder: any length 1..chunk, at start 0 or at a
        multiple of `chunk` (a slot holds `positions` of them). Triton compiles a kernel once per set of constexpr
        values and per class of each int argument (1, a multiple of 16, other). So: every length up to the decode-
        sized paths' limits (those kernels keep their token count specialized, and the plan changes at the policy's
        small thresholds); beyond, the prefill kernels take token counts and starts unspecialized
        (do_not_specialize) and what still varies is a constexpr bucket (the layout's next power of two) or a plan
        threshold: each bucket's longest length and the one below it, each threshold's neighbours; each at start 0
        and at start `chunk`, where the plan differs (dense: SDPA at 0, the prefill kernel after; a one-token chunk
        after 0 runs as a decode step)."""
        small = max(2 * GEMV_MAX_TOKENS, NORM_ROUTE_SPLIT_MAX_TOKENS + 1, self.sparse_decode_max_tokens + 1,
                    self.dense_gemv_max_tokens + 1)
        out = []
        for start in (0, chunk):
            room = min(chunk, positions - start)  # the longest chunk at this start
            thresholds = (self.sparse_prefill_min_tokens, self.router_max_tokens, self.fp8_scaled_mm_min_tokens,
                          self.router_split_max_tokens, self.live_attention_min_tokens)
            lengths = set(range(1, small + 1)) | {t + d for t in thresholds for d in (-1, 0, 1)}
            p = 1
            while p < 2 * room:  # each power-of-two bucket up to room's: its longest length and the one below
                lengths |= {min(p, room), min(p, room) - 1}
                p *= 2
            out += [(T, start) for T in sorted(lengths) if 1 <= T <= room]
        return out

    def layer_plan(self, shape, attn_router, ffn_router):
        """One layer's ops in the order they run, {op name: Op} (an op that does not run is absent). Each op is
        decided on its own, by one method below, from the step's shape and whether its part has a router."""
        w = weight_format(shape)
        ops = {"attn_norm": self.norm_op(shape, attn_router)}
        qkv, attention = self.qkv_op(shape, attn_router, w), self.attention_op(shape, attn_router)
        if attention.kind == "prefill_live" or qkv.kind == "tiles":
            ops["attn_layout"] = Op("layout", "Triton", kernels=LAYOUT)  # prefill attention and Q's tiles read it
        ops["qkv"] = qkv
        if qkv.kind not in ("gemv", "gemv_all"):  # the decode GEMV does RoPE and the cache write in its epilogue
            ops["rope"] = Op("rope", "Triton", kernels=("rope_kernel",))
        ops["attention"] = attention
        ops["o"] = self.o_op(shape, attn_router, w)
        ops["ffn_norm"] = self.norm_op(shape, ffn_router)
        gate_up = self.gate_up_op(shape, ffn_router, w)
        if gate_up.kind == "tiles_fused":
            ops["ffn_layout"] = Op("layout", "Triton", kernels=LAYOUT)  # gate+up's tiles read it
        ops["gate_up"] = gate_up
        ops["down"] = self.down_op(shape, ffn_router, w)
        if gate_up.kind in ("cublas", "cublas_masked") and ops["down"].weights != "fp8 x fp8":
            ops["gate_up"] = gate_up._replace(kernels=gate_up.kernels + ("swiglu_rows_kernel",))  # SwiGLU, zeros
        for norm, linear in (("attn_norm", "qkv"), ("ffn_norm", "gate_up")):
            if (ops[norm].kind == "norm_route" and ops[linear].kind in ("gemv", "gemv_fused") and shape.tokens == 1
                    and self.router_rule_in_gemv and not shape.ffn_vote):  # the GEMV finishes the decision
                ops[norm] = ops[norm]._replace(kind="norm_route_deferred")
            if ops[norm].kind == "norm" and ops[linear].weights == "fp8 x fp8":  # the norm quantizes the input
                ops[norm] = Op("norm_fp8", "Triton", kernels=("rms_norm_kernel",))
                ops[linear] = ops[linear]._replace(kernels=())
        if self.router_side_stream:  # Q, K, V for every head and no layout: attention reads the mask first;
            # Q's tiles: K and V's GEMM runs first (the engine), then the layout reads it
            for norm, late in (("attn_norm", ops["qkv"].kind == "tiles" or "attn_layout" not in ops
                                and ops["qkv"].kind == "cublas_every_head"),
                               ("ffn_norm", ops["gate_up"].kind == "cublas_masked" and not shape.ffn_vote)):
                if late and ops[norm].kind == "norm_route":  # its decision beside, bit for bit the same
                    ops[norm] = Op("norm_route_side", "Triton", kernels=("rms_norm_kernel",) + ops[norm].kernels)
                elif late and ops[norm].kind == "norm_then_router":
                    ops[norm] = ops[norm]._replace(kind="norm_then_router_side", runs="Triton + torch, side stream")
        return {name: ops[name] for name in LAYER_OPS if name in ops}

    def scaled_mm(self, shape):
        """Whether the step's library GEMMs run torch._scaled_mm on fp8 weights and per-token fp8 inputs (an
        fp16 model's would be rounded through bf16: _scaled_mm's per-row scales give bf16 on a GPU)."""
        return shape.fp8 and shape.tokens >= self.fp8_scaled_mm_min_tokens and shape.dtype != "fp16"

    def vendor_gemm(self, kind, shape, w):
        """An op on a library GEMM: cuBLAS on the model dtype (or the values fp8 codes stand for), or
        torch._scaled_mm on the fp8 codes with the input quantized per token (quantize_rows: one launch)."""
        if self.scaled_mm(shape):
            return Op(kind, "_scaled_mm", "fp8 x fp8", ("quantize_rows_kernel",))
        return Op(kind, "cuBLAS", w)

    def every_group_live(self, shape):
        """Whether an op with no router runs WIDE's kernel with every group live: fp8 codes in a step the
        decode kernels take and _scaled_mm does not, or a step small enough for dense_gemv_max_tokens."""
        if shape.fp8:
            return reads_fp8(shape) and not self.scaled_mm(shape)
        return shape.tokens <= self.dense_gemv_max_tokens

    def norm_op(self, shape, router):
        """RMSNorm, with the router's decision in the same launch where it is a wide.Router and the step short."""
        if router is None:
            return Op("norm", "Triton", kernels=("rms_norm_kernel",))
        if router == "wide" and shape.tokens <= self.router_max_tokens:
            split = shape.tokens <= self.router_split_max_tokens  # short: the ranks split over programs
            return Op("norm_route", "Triton", kernels=("norm_route_kernel",) if split else
                      ("norm_route_part_kernel", "norm_route_finish_kernel"))
        return Op("norm_then_router", "Triton + torch", kernels=("rms_norm_kernel",))

    def qkv_op(self, shape, router, w):
        """Q, K, V in one weight stream. K and V are never pruned; Q's groups are skipped by the decode GEMV
        (up to GEMV_MAX_TOKENS) or by gemm_mn's sorted tiles, in the steps where that pays."""
        M = shape.tokens
        if router is None:
            return (Op("gemv_all", "Triton", w, ("gemv_mn_kernel",)) if self.every_group_live(shape)
                    else self.vendor_gemm("cublas", shape, w))
        if not (M <= self.sparse_decode_max_tokens or M >= self.sparse_prefill_min_tokens or reads_fp8(shape)):
            return self.vendor_gemm("cublas_every_head", shape, w)
        if M <= GEMV_MAX_TOKENS:
            return Op("gemv", "Triton", w, ("gemv_mn_kernel",))
        return Op("tiles", "Triton + cuBLAS", w, ("gemm_mn_kernel",))

    def attention_op(self, shape, router):
        """Attention over the live head groups where there is a router; the dense baseline at its best where not
        (and in WIDE's short prefill chunks, then the pruned heads' outputs zeroed)."""
        if shape.decode and router is not None:
            return Op("decode_live", "Triton", kernels=DECODE_ATTENTION)
        if shape.decode:
            if self.dense_decode_attention == "sdpa":
                return Op("decode_sdpa", "SDPA")
            return Op("decode_every", "Triton", kernels=DECODE_ATTENTION)
        if router is not None:
            if shape.tokens >= self.live_attention_min_tokens:
                return Op("prefill_live", "Triton", kernels=("attn_prefill_kernel",))
            every = self.attention_op(shape, None)
            return every._replace(kind=every.kind + "_zeroed")
        if shape.start == 0:
            return Op("sdpa_causal", "SDPA")
        if self.dense_chunk_attention == "triton":
            return Op("prefill_every", "Triton", kernels=("attn_prefill_kernel",))
        return Op("sdpa_rows", "SDPA")

    def o_op(self, shape, router, w):
        """O: gemm_k reads only the live groups' weight columns and adds the residual, in decode-sized steps
        (and where fp8 codes are read); elsewhere cuBLAS on the masked input (exact: pruned slots are zero,
        and no 16-token tile of per-token masks shares a skipped group)."""
        if router is None:
            return (Op("gemm_k_all", "Triton", w, ("gemm_k_kernel",)) if self.every_group_live(shape)
                    else self.vendor_gemm("cublas", shape, w))
        if shape.tokens <= max(self.sparse_decode_max_tokens, self.dense_gemv_max_tokens) or reads_fp8(shape):
            return Op("gemm_k", "Triton", w, ("gemm_k_kernel",))
        return self.vendor_gemm("cublas_masked_input", shape, w)

    def gate_up_op(self, shape, router, w):
        """gate+up with silu(gate)*up fused, as Q: the decode GEMV or gemm_mn's sorted tiles where skipping pays,
        else one cuBLAS GEMM and the pruned groups zeroed. Under the vote rule the step's rows share one mask,
        so the GEMV skips what the vote drops at any decode size it takes."""
        M = shape.tokens
        if router is None:
            return (Op("gemv_fused_all", "Triton", w, ("gemv_mn_kernel",)) if self.every_group_live(shape)
                    else self.vendor_gemm("cublas", shape, w))
        voted = shape.ffn_vote and M <= GEMV_MAX_TOKENS
        if not (M <= self.sparse_decode_max_tokens or M >= self.sparse_prefill_min_tokens or reads_fp8(shape) or voted):
            return self.vendor_gemm("cublas_masked", shape, w)
        if M <= GEMV_MAX_TOKENS:
            return Op("gemv_fused", "Triton", w, ("gemv_mn_kernel",))
        return Op("tiles_fused", "Triton", w, ("gemm_mn_kernel",))

    def down_op(self, shape, router, w):
        """down, as O: gemm_k over the live groups in decode-sized steps (with fp8 codes, or a voted mask at any
        decode size the GEMV takes), else cuBLAS on the masked input."""
        if router is None:
            return (Op("gemm_k_all", "Triton", w, ("gemm_k_kernel",)) if self.every_group_live(shape)
                    else self.vendor_gemm("cublas", shape, w))
        voted = shape.ffn_vote and shape.tokens <= GEMV_MAX_TOKENS
        if shape.tokens <= self.sparse_decode_max_tokens or reads_fp8(shape) or voted:
            return Op("gemm_k", "Triton", w, ("gemm_k_kernel",))
        return self.vendor_gemm("cublas_masked_input", shape, w)


def reads_fp8(shape):
    """fp8 codes are read by the decode kernels only (up to GEMV_MAX_TOKENS); a longer step dequantizes them."""
    return shape.fp8 and shape.tokens <= GEMV_MAX_TOKENS


def weight_format(shape):
    """What the linears read: the model dtype, fp8 codes, or fp8 dequantized to the model dtype."""
    return "fp8" if reads_fp8(shape) else (f"fp8 -> {shape.dtype}" if shape.fp8 else shape.dtype)


class Plan(NamedTuple):
    """Every op of one step: `step` ops once, `layers[i]` the ops of layer i."""
    shape: Shape
    step: dict
    layers: list

    def launches(self):
        """The Triton launches this step makes: Counter(kernel name -> launches)."""
        ops = [*self.step.values(), *(op for layer in self.layers for op in layer.values())]
        return Counter(k for op in ops for k in op.kernels)

    def text(self):
        """The plan as generate.py prints it: each distinct layer plan once, with the layers it covers."""
        s = self.shape
        what = ("a decode step" if s.decode else
                "a prefill" + (f" chunk at position {s.start}" if s.start else ""))
        weights = "fp8 weights for the prunable linears" if s.fp8 else f"{s.dtype} weights"
        lines = [f"{what} of {s.tokens} token{'s' if s.tokens != 1 else ''}, {weights}:"]
        if s.ffn_vote:
            lines.append(f"  (the vote rule: an FFN channel group runs for every row iff {s.ffn_vote} of the step's "
                         "rows want it, wide.FFNRule)")
        if s.dense_ffn:
            lines.append("  (the batch rule: a decode step of more rows than the model's ffn_rule.max_rows "
                         "runs every FFN channel group; its routers are not asked)")
        groups = []  # (layer plan, [layer indices]) in first-seen order
        for i, ops in enumerate(self.layers):
            for plan, idx in groups:
                if plan == ops:
                    idx.append(i)
                    break
            else:
                groups.append((ops, [i]))
        for ops, idx in groups:
            which = "every layer" if len(idx) == len(self.layers) else "layers " + ",".join(map(str, idx))
            lines.append(f"  {which}:")
            lines += [op_line(name, op) for name, op in ops.items()]
        lines.append("  once per step:")
        lines += [op_line(name, op) for name, op in self.step.items()]
        return "\n".join(lines)


def op_line(name, op):
    weights = f" [{op.weights}]" if op.weights else ""
    quantized = "; its input as per-token fp8 rows (quantize_rows)" if "quantize_rows_kernel" in op.kernels else ""
    if op.kind == "cublas" and "swiglu_rows_kernel" in op.kernels:
        quantized += "; then silu(gate)*up in one launch (swiglu_rows)"
    return f"    {NAMES[name]:<18} {op.runs:<14} {KINDS[op.kind]}{quantized}{weights}"

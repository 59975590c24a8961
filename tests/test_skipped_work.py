"""
Skipped work is never done: the product's core claim, checked on the bytes the kernels read.

WIDE is fast because of the loads its kernels leave out. A kernel that computed a skipped group anyway
and threw the result away would still match its twin (skipped outputs are zeroed either way), so
comparing outputs cannot see it. These tests watch the reads instead.

How the recorder works. Under the Triton interpreter (the CPU tests) every load a kernel issues, plain,
masked, atomic or through a tensor descriptor, ends in one builder method,
`interpreter_builder.create_masked_load(ptrs, mask, ...)`, whose `ptrs` hold the raw byte address of
every element it reads. `recorded_loads()` wraps that method, and the interpreter's launch
(`GridExecutor.__call__`, to learn which kernel runs and which tensor each of its arguments is), for the
duration of one op. For every tensor argument of every launch it counts how many times each element is
read where the load's mask is true. The interpreter hands a kernel the addresses of its arguments' host
copies, and on the CPU a host copy is the tensor itself (`storage.cpu()` of a CPU storage returns that
storage), so an address maps back to an element through the argument's data_ptr, element size and
(contiguous) shape. A load outside every argument of the launch fails the test before it happens.

What is pinned (GS = 16 channels per group; "live" = some token of the step, or of the tile, runs it):
  gemm_mn, sorted tiles (M > GEMV_MAX_TOKENS): group g's weight rows are read exactly once per live token tile of
      g, so never for a group no token runs and never by a dead tile; x row t once per group t runs.
  gemm_mn, decode GEMV (M <= 16): each weight row (and fp8 scale) of a live group or of the dense tail
      is read exactly once, with any number of programs; a dead group's rows never.
  gemm_k (decode with its split, short and long K, its groups from its own scan or the router's live
      list, its first weight slice loaded before the PDL wait or not; and the token tiles): group g's
      weight columns are read once per token tile in which g is live, never otherwise; a pruned a-slot
      is never read.
  attention_prefill: q[b, h, t] is read once if token t runs h's group, else never; the K/V of
      (b, KV head) are read up to the last active token of its query heads, and not at all if none is.
  attention_decode: K/V[b, KV head, pos] is read once if some query head of that KV head runs and
      pos < kv_len[b], else never; an inactive query head's q is never read; nothing is read before its PDL
      wait (the wait replaced by a marker that splits each program's loads).
  quantize_rows (an fp8 input for _scaled_mm, SwiGLU and the mask fused) and swiglu_rows (the same in the
      model dtype): a pruned channel's gate and up are never read.
  norm_route on a prefill chunk (nothing to skip, but D split over programs must not re-read): x and the
      residual once, h once more for RMSNorm(h), the router's first Linear once per token tile.
fp8 weights (quantize_fp8 codes + w_scale) go through the same checks: the decode kernels read the codes;
gemm_mn's token tiles read the dequantized copy the op makes (the recorder follows the kernel's argument).
What the kernels write is test_kernels.py's business; here only what they read.
"""
import contextlib
import inspect

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter

import kernels
import kernels_attention
import kernels_base
import kernels_gemv
import kernels_layout
import kernels_step
import wide
from model import RMSNorm

pytestmark = pytest.mark.skipif(not kernels_base.INTERPRET, reason="reads are recorded through the Triton interpreter")

GS = 16       # channels per group: the smallest the kernels take
BLOCK_M = 16  # the layout's token tile, passed explicitly so the expected counts below are plain arithmetic
FORMATS = ["fp32", "fp8"]
KINDS = ["some groups dead", "random", "all on", "all off"]


# ----------------------------------------------------------------------------------------------------
# the recorder

class Launch:
    """One kernel launch: its tensor arguments by name, and how often each of their elements was read.
    (An argument that is another one's placeholder, like gemm_mn's w_up without gate+up, shares its counts.)"""

    def __init__(self, name, tensors):
        self.name, self.tensors = name, tensors
        self.reads = {n: np.zeros(t.numel(), dtype=np.int64) for n, t in tensors.items()}
        self.spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in (t.untyped_storage() for t in tensors.values())]

    def count(self, addr):
        # addr: the byte addresses of one load's true lanes. Each must fall inside some argument's storage.
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in self.spans:
            inside |= (addr >= lo) & (addr < hi)
        assert inside.all(), f"{self.name} loads address {int(addr[~inside][0]):#x}, outside all its arguments"
        for n, t in self.tensors.items():
            lo, size = t.data_ptr(), t.element_size()
            hit = addr[(addr >= lo) & (addr < lo + t.numel() * size)]
            np.add.at(self.reads[n], ((hit - lo) // size).astype(np.int64), 1)


class Loads:
    def __init__(self):
        self.launches = []

    def reads(self, kernel, arg):
        """[shape of `arg`] int64: how many times each element of `kernel`'s argument `arg` was read,
        summed over that kernel's launches (at least one, or the op took another path)."""
        mine = [l for l in self.launches if l.name == kernel]
        assert mine, f"{kernel} never launched (launched: {sorted({l.name for l in self.launches})})"
        t = mine[0].tensors[arg]
        assert t.is_contiguous() and all(l.tensors[arg].shape == t.shape for l in mine)
        return torch.from_numpy(sum(l.reads[arg] for l in mine)).view(t.shape)


@contextlib.contextmanager
def recorded_loads():
    """Within the block, every kernel launch is a Launch in `.launches`, with the reads it made."""
    builder, executor = interpreter.interpreter_builder, interpreter.GridExecutor
    load, launch = builder.create_masked_load, executor.__call__
    rec = Loads()

    def recording_launch(self, *args, **kwargs):
        # self.fn is the kernel's Python function: bind the launch's arguments to its parameter names
        # (the interpreter drops launch options such as num_warps the same way).
        params = inspect.signature(self.fn).parameters
        bound = inspect.getcallargs(self.fn, *args, **{k: v for k, v in kwargs.items() if k in params})
        rec.launches.append(Launch(self.fn.__name__, {n: t for n, t in bound.items() if isinstance(t, torch.Tensor)}))
        return launch(self, *args, **kwargs)

    def recording_load(ptrs, mask, *rest):  # (ptrs, mask, other, cache_policy, is_volatile)
        on = np.broadcast_to(mask.data, ptrs.data.shape)
        rec.launches[-1].count(ptrs.data[on].astype(np.uint64))
        return load(ptrs, mask, *rest)

    builder.create_masked_load, executor.__call__ = recording_load, recording_launch
    try:
        yield rec
    finally:
        del builder.create_masked_load  # the instance attribute goes; the class method is back
        executor.__call__ = launch


# ----------------------------------------------------------------------------------------------------
# inputs

def step_mask(kind, M, G, seed=0):
    """[M, G] bool, True = the token runs the group.
      "random": each (token, group) on with probability 1/2; "all on", "all off": what they say;
      "some groups dead": the odd groups are run by no token, group 0 by exactly min(M, BLOCK_M) tokens
          (so its next tile is dead right at the boundary), the other even groups by a random half;
      "tile-local": random, but group g only by tokens of token tile g % (number of tiles)."""
    if kind in ("all on", "all off"):
        return torch.full((M, G), kind == "all on")
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(M, G, generator=gen) < 0.5
    if kind == "some groups dead":
        mask[:, 1::2] = False
        mask[0, 2::2] = True
        mask[:, 0] = False
        mask[torch.randperm(M, generator=gen)[:BLOCK_M], 0] = True
    if kind == "tile-local":
        tile = torch.arange(M)[:, None] // BLOCK_M
        mask &= tile == torch.arange(G)[None, :] % ((M + BLOCK_M - 1) // BLOCK_M)
    return mask


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def weight(fmt, N, K, seed=1):
    """(w, w_scale): an fp32 weight, or its fp8 codes and per-row scales."""
    w = randn(N, K, seed=seed) / K ** 0.5
    return (w, None) if fmt == "fp32" else kernels.quantize_fp8(w)


def per_row(group_counts, cols):
    """[G] counts -> [G * GS, cols]: each weight row of group g holds group g's count."""
    return group_counts.repeat_interleave(GS)[:, None].expand(-1, cols).long()


def per_column(group_counts, rows):
    """[G] counts -> [rows, G * GS]: each weight column of reduction group g holds group g's count."""
    return group_counts.repeat_interleave(GS)[None, :].expand(rows, -1).long()


# ----------------------------------------------------------------------------------------------------
# the recorder itself: a dense op is seen reading everything, once

def test_the_recorder_sees_a_dense_linear_read_every_weight_element_exactly_once():
    w = randn(4 * GS, 32)
    with recorded_loads() as rec:
        kernels.gemm_mn(randn(1, 32), w, torch.ones(1, 0, dtype=torch.bool), GS, dense_tail=4 * GS)
    assert torch.equal(rec.reads("_gemv_mn_kernel", "w"), torch.ones(w.shape, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------
# gemm_mn: output-channel groups (Q projection, gate + up)

@pytest.mark.parametrize("paired", [False, True], ids=["two products", "paired"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "gate+up"])
@pytest.mark.parametrize("kind", KINDS + ["tile-local"])
def test_gemm_mn_tiles_read_a_groups_weight_rows_once_per_live_tile_and_never_for_a_dead_group(kind, fused, fmt,
                                                                                               paired):
    if paired and not fused:
        pytest.skip("config PAIRED changes gate+up's tile only")
    M, K, G = 40, 32, 4  # three token tiles of 16
    mask = step_mask(kind, M, G)
    x = randn(M, K)
    w, ws = weight(fmt, G * GS, K, seed=1)
    w_up, wus = weight(fmt, G * GS, K, seed=2) if fused else (None, None)
    with recorded_loads() as rec:
        kernels.gemm_mn(x, w, kernels_layout.layout(mask, block_m=BLOCK_M), GS, w_up=w_up, w_scale=ws, w_up_scale=wus,
                        config=dict(BN=GS, BK=32, PAIRED=paired))
    live_tiles = (mask.sum(0) + BLOCK_M - 1) // BLOCK_M  # [G]; a group no token runs has none
    expected = per_row(live_tiles, K)
    assert torch.equal(rec.reads("_gemm_mn_kernel", "w"), expected), "w: rows read != live tiles of their group"
    if fused:
        assert torch.equal(rec.reads("_gemm_mn_kernel", "w_up"), expected), "w_up: rows read != live tiles"
    # Intra-block skip: x row t is loaded once for each group t runs (one BN = GS slice per group), so a
    # token inside a live tile that does not run the group is never loaded for it.
    assert torch.equal(rec.reads("_gemm_mn_kernel", "x"), mask.sum(1)[:, None].expand(-1, K).long())


@pytest.mark.parametrize("runs", ["default", "many programs", "dot", "pipe"])  # 10 programs, some with no chunk
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_gemv_never_reads_the_rows_of_a_dead_group(kind, M, fmt, runs):
    if runs == "many programs" and (fmt, kind) != ("fp32", "some groups dead"):
        pytest.skip("the program count changes only how chunks are shared out: one format and mask suffice")
    if runs in ("dot", "pipe") and M > 1:
        pytest.skip("configs DOT and PIPE change one token's loop only (more tokens always take the tensor-core tile)")
    K, G = 64, 6
    mask = step_mask(kind, M, G)
    w, ws = weight(fmt, G * GS, K)
    cfg = {"default": None, "many programs": dict(programs_per_sm=5, BN=4, BK=32), "dot": dict(DOT=True),
           "pipe": dict(PIPE=3)}[runs]
    with recorded_loads() as rec:
        kernels.gemm_mn(randn(M, K), w, mask, GS, w_scale=ws, config=cfg)
    live = mask.any(0).long()  # [G]: some token of the step runs the group
    assert torch.equal(rec.reads("_gemv_mn_kernel", "w"), per_row(live, K)), "each live row once, dead rows never"
    if fmt == "fp8":
        assert torch.equal(rec.reads("_gemv_mn_kernel", "ws"), per_row(live, 1)[:, 0]), "scales: live rows once"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5])
def test_decode_gemv_of_gate_and_up_reads_both_weights_of_the_live_groups_only(M, fmt):
    K, G = 32, 4
    mask = step_mask("some groups dead", M, G)
    (w, ws), (w_up, wus) = weight(fmt, G * GS, K, seed=1), weight(fmt, G * GS, K, seed=2)
    with recorded_loads() as rec:
        kernels.gemm_mn(randn(M, K), w, mask, GS, w_up=w_up, w_scale=ws, w_up_scale=wus)
    expected = per_row(mask.any(0).long(), K)
    assert torch.equal(rec.reads("_gemv_mn_kernel", "w"), expected)
    assert torch.equal(rec.reads("_gemv_mn_kernel", "w_up"), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("kind", ["some groups dead", "all off"])
def test_decode_gemv_reads_the_dense_tail_once_and_still_skips_the_dead_groups_before_it(kind, M, fmt):
    K, G, tail = 32, 4, 2 * GS  # Q's routed groups, then K and V (always computed) in one weight stream
    mask = step_mask(kind, M, G)
    w, ws = weight(fmt, G * GS + tail, K)
    with recorded_loads() as rec:
        kernels.gemm_mn(randn(M, K), w, mask, GS, dense_tail=tail, w_scale=ws)
    live = torch.cat([mask.any(0).long(), torch.ones(tail // GS, dtype=torch.long)])
    assert torch.equal(rec.reads("_gemv_mn_kernel", "w"), per_row(live, K))


@pytest.mark.parametrize("kind", ["some groups dead", "all off"])
def test_qkv_gemv_with_rope_in_its_epilogue_still_never_reads_a_dead_groups_rows(kind):
    # Q, K, V of a decode step with RoPE and the cache write fused: the epilogue reads cos, sin and the slot,
    # never more weights; Q's dead groups stay unread, K and V (the dense tail) are read once.
    M, K, G, d, Hkv = 1, 32, 4, 16, 2
    mask = step_mask(kind, M, G)
    tail = 2 * Hkv * d
    w, _ = weight("fp32", G * GS + tail, K)
    kc, vc = torch.zeros(1, Hkv, 8, d), torch.zeros(1, Hkv, 8, d)
    rope = kernels_gemv.Rope(randn(M, d, seed=3), randn(M, d, seed=4), torch.tensor([5]), kc, vc, G * GS, Hkv * d, 1)
    with recorded_loads() as rec:
        kernels.gemm_mn(randn(M, K), w, mask, GS, dense_tail=tail, rope=rope)
    live = torch.cat([mask.any(0).long(), torch.ones(tail // GS, dtype=torch.long)])
    assert torch.equal(rec.reads("_gemv_mn_kernel", "w"), per_row(live, K))


# ----------------------------------------------------------------------------------------------------
# gemm_k: reduction groups (O projection, down projection)

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("long_k", [False, True], ids=["short K", "long K"])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["own list", "router's list", "router's list, prefetched", "own list, FMA + PIPE"])
def test_decode_gemm_k_never_reads_the_weight_columns_of_a_group_no_token_runs(kind, M, long_k, fmt, source):
    K = kernels_base.LONG_K if long_k else kernels_base.LONG_K - GS  # the long-K variant splits from LONG_K on
    G, N = K // GS, 64
    mask = step_mask(kind, M, G)
    w, ws = weight(fmt, N, K)
    if source != "own list" and long_k:
        pytest.skip("the router's list replaces the same scan in both K variants: one suffices")
    live = kernels_step.live_ref(mask) if source.startswith("router") else None
    cfg = dict(PREFETCH=True) if source.endswith("prefetched") else dict(FMA=True, PIPE=3) if "PIPE" in source else None
    with recorded_loads() as rec:  # PREFETCH: the first slice before the PDL wait, then the loop the rest
        kernels.gemm_k(randn(M, K), w, mask, GS, w_scale=ws, live=live, config=cfg)
    # The split programs share a tile's live groups out: each live group's columns are read exactly once.
    assert torch.equal(rec.reads("_gemm_k_kernel", "w"), per_column(mask.any(0).long(), N))
    a_read = rec.reads("_gemm_k_kernel", "a") > 0
    assert torch.equal(a_read, mask.repeat_interleave(GS, 1)), "a pruned a-slot is never read, a live one is"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS + ["tile-local"])
def test_gemm_k_tiles_read_a_groups_weight_columns_only_for_tiles_in_which_some_token_runs_it(kind, fmt):
    M, K, N = 40, 64, 32  # three token tiles of BLOCK_M in token order, 4 groups
    mask = step_mask(kind, M, K // GS)
    w, ws = weight(fmt, N, K)
    with recorded_loads() as rec:
        kernels.gemm_k(randn(M, K), w, mask, GS, w_scale=ws, config=dict(BM=BLOCK_M, BN=32, BK=16))
    tiles = torch.nn.functional.pad(mask, (0, 0, 0, -M % BLOCK_M)).view(-1, BLOCK_M, K // GS)
    live_tiles = tiles.any(1).sum(0)  # [G]: token tiles in which some token runs the group
    assert torch.equal(rec.reads("_gemm_k_kernel", "w"), per_column(live_tiles, N))
    assert torch.equal(rec.reads("_gemm_k_kernel", "a") > 0, mask.repeat_interleave(GS, 1))


# ----------------------------------------------------------------------------------------------------
# attention: the query heads of inactive groups, and in decode the K/V of a KV head none of whose heads run

B, H, HKV, D = 3, 4, 2, 16  # 2 query heads per KV head


@pytest.mark.parametrize("G", [4, 2], ids=["2 groups per KV head", "1 group per KV head"])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_attention_reads_q_of_active_heads_once_and_kv_only_up_to_their_last_active_token(kind, G):
    T = 20
    head_mask = step_mask(kind, B * T, G).view(B, T, G)
    q, k, v = randn(B, H, T, D, seed=1), randn(B, HKV, T, D, seed=2), randn(B, HKV, T, D, seed=3)
    with recorded_loads() as rec:
        kernels_attention.attention_prefill(q, k, v, kernels_layout.layout(head_mask))
    active = head_mask.repeat_interleave(H // G, 2).permute(0, 2, 1)  # [B, H, T]
    assert torch.equal(rec.reads("_attn_prefill_kernel", "q"), active[..., None].expand(-1, -1, -1, D).long()), \
        "q: each active (token, head) row exactly once, inactive ones never (a dead tile loads nothing)"
    # Causal, and the tiles hold only active tokens: the keys after the last active token of a KV head's
    # query heads are never needed, and a KV head with no active query head is never read at all.
    per_kv = active.view(B, HKV, H // HKV, T).any(2)  # [B, Hkv, T]
    last = torch.where(per_kv, torch.arange(T), -1).amax(-1)  # [B, Hkv]; -1: no active token
    needed = torch.arange(T)[None, None, :] <= last[..., None]
    for name in ("k", "v"):
        read = rec.reads("_attn_prefill_kernel", name).sum(-1) > 0
        assert torch.equal(read, needed), f"{name}: rows read != rows up to the last active token"


@pytest.mark.parametrize("G", [4, 2], ids=["2 groups per KV head", "1 group per KV head"])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_attention_never_reads_the_kv_cache_of_a_kv_head_whose_query_heads_are_all_off(kind, G):
    L, kv_len = 40, torch.tensor([40, 17, 5])
    head_mask = step_mask(kind, B, G, seed=3)
    q, k, v = randn(B, H, 1, D, seed=1), randn(B, HKV, L, D, seed=2), randn(B, HKV, L, D, seed=3)
    with recorded_loads() as rec:
        kernels_attention.attention_decode(q, k, v, head_mask, kv_len)
    active = head_mask.repeat_interleave(H // G, 1)  # [B, H]
    kv_on = active.view(B, HKV, H // HKV).any(2)  # [B, Hkv]: some query head of the KV head runs
    cached = torch.arange(L)[None, :] < kv_len[:, None]  # [B, L]
    expected = (kv_on[:, :, None] & cached[:, None, :])[..., None].expand(-1, -1, -1, D).long()
    for name in ("k", "v"):
        assert torch.equal(rec.reads("_attn_decode_kernel", name), expected), \
            f"{name}: each cached position of a running KV head exactly once, nothing else"
    q_read = rec.reads("_attn_decode_kernel", "q").sum(-1)[:, :, 0] > 0
    assert torch.equal(q_read, active), "an inactive query head's q is never read"


def test_decode_attention_reads_only_final_bytes_before_its_pdl_wait(monkeypatch):
    # Under PDL the previous launch may still run until the wait: it writes q and each row's newest key,
    # so before the wait none of them may be read. The wait is replaced by
    # a marker and each program's loads are split at it (the interpreter runs one program at a time).
    L, kv_len = 40, torch.tensor([40, 17, 5])
    head_mask = step_mask("random", B, 4, seed=3)
    q, k, v = randn(B, H, 1, D, seed=1), randn(B, HKV, L, D, seed=2), randn(B, HKV, L, D, seed=3)
    waited, before = [False], []
    monkeypatch.setattr(kernels_attention, "prior_done", lambda PDL: waited.__setitem__(0, True))
    builder = interpreter.interpreter_builder
    set_idx, load = builder.set_grid_idx, builder.create_masked_load

    def program_start(*idx):
        waited[0] = False
        return set_idx(*idx)

    def load_marked(ptrs, mask, *rest):
        if not waited[0]:
            before.append(ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64))
        return load(ptrs, mask, *rest)

    monkeypatch.setattr(builder, "set_grid_idx", program_start)
    monkeypatch.setattr(builder, "create_masked_load", load_marked)
    out = kernels_attention.attention_decode(q, k, v, head_mask, kv_len)
    torch.testing.assert_close(out, kernels_attention.attention_decode_ref(q, k, v, head_mask, kv_len))
    addr = np.concatenate(before) if before else np.zeros(0, np.uint64)

    def rows_read(t):  # [B, HKV, L]: some element of this cached key was read before the wait
        lo, size = t.data_ptr(), t.element_size()
        hit = addr[(addr >= lo) & (addr < lo + t.numel() * size)]
        read = np.zeros(t.numel(), bool)
        read[((hit - lo) // size).astype(np.int64)] = True
        return torch.from_numpy(read).view(t.shape).any(-1)

    assert not ((addr >= q.data_ptr()) & (addr < q.data_ptr() + q.numel() * 4)).any(), "q read before the wait"
    for t in (k, v):  # (each row's newest key among them: the previous launch writes it)
        assert not rows_read(t).any(), "a cached key read before the wait"
    assert len(addr) == 0, "nothing at all is read before the wait"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("fp8", [True, False], ids=["quantize_rows", "swiglu_rows"])
def test_swiglu_never_reads_the_gate_or_up_of_a_pruned_channel(kind, M, fp8):
    # silu(gate) * up after a routed gate+up's library GEMM, as down's fp8 input (quantize_rows) or in the model
    # dtype (swiglu_rows): the channels the token runs, each read once; a pruned channel is 0 without a load.
    G, K = 4, 4 * GS
    mask = step_mask(kind, M, G)
    gu = randn(M, 2 * K)
    with recorded_loads() as rec:
        if fp8:
            kernels_step.quantize_rows(gu, swiglu=True, mask=mask, group_size=GS)
        else:
            kernels_step.swiglu_rows(gu, mask=mask, group_size=GS)
    runs = mask.repeat_interleave(GS, 1).long()  # [M, K]
    read = rec.reads("_quantize_rows_kernel", "x") if fp8 else rec.reads("_swiglu_rows_kernel", "gu")
    assert torch.equal(read, torch.cat([runs, runs], 1))



@pytest.mark.parametrize("BK", [16, 32], ids=["two steps per slice", "one step per slice"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_prefill_norm_route_reads_each_row_once_and_the_routers_weights_once_per_token_tile(with_residual, BK):
    # kernels_step's D-split pair on 37 tokens, D = 100 in slices of 32 (the last one short), tiles of 16; with
    # BK = 32 a slice's router weights are one load before the wait
    M, D, BT = 37, 100, 16
    torch.manual_seed(0)
    r, norm = wide.Router(D, 4, 32).eval(), RMSNorm(D, 1e-5)
    x, res = randn(1, M, D, seed=1), randn(1, M, D, seed=2)
    with recorded_loads() as rec, torch.no_grad():
        kernels_step.norm_route(x, norm, r, res if with_residual else None,
                                config=dict(BT=BT, BK=BK, DS=32, FINISH_BK=32), split_max_tokens=0)
    once = torch.ones(M, D, dtype=torch.long)
    assert torch.equal(rec.reads("_norm_route_part_kernel", "x"), once)
    assert torch.equal(rec.reads("_norm_route_part_kernel", "res"), once)  # (without a residual: x itself)
    assert torch.equal(rec.reads("_norm_route_part_kernel", "wd"), torch.full((32, D), -(-M // BT)))
    assert torch.equal(rec.reads("_norm_route_finish_kernel", "h"), once), "h (or x) once more, for RMSNorm(h)"
    # the slices' partial sums: a tile's sums of squares by each of its S slices' programs, its share of the
    # first Linear by the one program that applies the rule (S = 4 slices, rank 32)
    assert torch.equal(rec.reads("_norm_route_finish_kernel", "part_ss"), torch.full((4, M), 4))
    assert torch.equal(rec.reads("_norm_route_finish_kernel", "part_z"), torch.ones(4, M, 32, dtype=torch.long))

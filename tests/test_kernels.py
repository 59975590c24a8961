"""Every Triton kernel against its PyTorch twin (dense compute, then pruned slots zeroed).

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1): fp32, tiny
shapes, results equal to fp32 rounding. Under the interpreter every buffer the kernels allocate
starts as NaN (or -1), so a slot a kernel forgot to write fails the test. GPU tests (bf16, rel err
<= 1e-2) skip without CUDA. Speed is measured in bench/ops.py, never here.
"""
import os
import random
import subprocess
import sys

import pytest
import torch

import kernels
import kernels_attention
import kernels_base
import kernels_layout
import kernels_step
import policy
from conftest import assert_close as _assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_close(out, ref, tol=1e-4):
    assert not torch.isnan(out).any(), "NaN: some output slot was never written"
    _assert_close(out, ref, rtol=tol, what="kernel output")


def make_mask(shape, p_on, gen=None):
    if p_on in (0.0, 1.0):
        return torch.full(shape, bool(p_on), device=DEV)
    return (torch.rand(shape, generator=gen) < p_on).to(DEV)


def randn(*shape, gen=None, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(DEV, dtype)


# ---------------------------------------------------------------------------------- layout
def check_layout(lay, mask, block_m):
    flat = mask.reshape(-1, mask.shape[-1]).cpu()
    M, G = flat.shape
    counts, perm, work = lay.counts.cpu(), lay.perm.cpu(), lay.work.cpu()
    assert torch.equal(counts, flat.sum(0).int()), "counts must be exact"
    for g in range(G):
        n = int(counts[g])
        act, rest = perm[g, :n], perm[g, n:]
        assert torch.equal(act, torch.nonzero(flat[:, g]).flatten().int()), "active tokens, ascending"
        assert torch.equal(rest, torch.nonzero(~flat[:, g]).flatten().int()), "inactive tokens, ascending"
    n_tiles = -(-M // block_m)
    tiles = [(-(-int(c) // block_m)) for c in counts]
    live = [g * n_tiles + t for g in range(G) for t in range(tiles[g])]
    dead = [g * n_tiles + t for g in range(G) for t in range(tiles[g], n_tiles)]
    assert work.tolist() == live + dead, "work list: live (group, tile) items first, group-major"
    if mask.dim() == 3:
        assert torch.equal(lay.batch_counts.cpu(), mask.sum(1).int().cpu())


@pytest.mark.parametrize("p_on", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("shape", [(1, 3), (37, 5), (2, 19, 4)])
def test_layout_permutation_is_stable_and_counts_exact(shape, p_on):
    mask = make_mask(shape, p_on, torch.Generator().manual_seed(1))
    for lay in (kernels_layout.layout(mask, block_m=16), kernels_layout.layout_ref(mask, 16)):
        check_layout(lay, mask, 16)


# ---------------------------------------------------------------------------------- gemm_mn / gemm_k
def run_gemm_mn(M, K, G, gs, p_on, fused, gen, as_layout=False, config=None):
    x, w = randn(M, K, gen=gen), randn(G * gs, K, gen=gen)
    w_up = randn(G * gs, K, gen=gen) if fused else None
    mask = make_mask((M, G), p_on, gen)
    arg = kernels_layout.layout(mask) if as_layout else mask
    out = kernels.gemm_mn(x, w, arg, gs, w_up=w_up, config=config)
    ref = kernels.gemm_mn_ref(x, w, mask, gs, w_up=w_up)
    assert_close(out, ref)
    pruned = ~mask.repeat_interleave(gs, 1)
    assert (out[pruned] == 0).all(), "pruned outputs must be exactly zero"


def run_gemm_k(M, N, G, gs, p_on, method, gen, as_layout=False):
    a, w = randn(M, G * gs, gen=gen), randn(N, G * gs, gen=gen)
    mask = make_mask((M, G), p_on, gen)
    a_garbage = a.masked_fill(~mask.repeat_interleave(gs, 1), float("nan"))  # pruned slots unread
    arg = kernels_layout.layout(mask) if as_layout else mask
    out = kernels.gemm_k(a_garbage, w, arg, gs, method=method)
    assert_close(out, kernels.gemm_k_ref(a, w, mask, gs))


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 17, 40])
@pytest.mark.parametrize("fused", [False, True])
def test_gemm_mn_matches_twin(M, fused):
    run_gemm_mn(M, 48, 3, 16, 0.5, fused, torch.Generator().manual_seed(M))


@pytest.mark.parametrize("p_on", [0.0, 1.0])
@pytest.mark.parametrize("M", [3, 33])
def test_gemm_mn_all_groups_on_and_off(M, p_on):
    run_gemm_mn(M, 32, 2, 32, p_on, True, torch.Generator().manual_seed(2))


@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("BN", [16, 8], ids=["whole group", "half a group"])
def test_gemm_mn_paired_gate_up_tile_matches_twin(BN, p_on):
    # config PAIRED: one product over gate's and up's rows in turns. 37 tokens (tiles of 16: a boundary tile),
    # K = 80 in slices of 32 (the last one partial)
    run_gemm_mn(37, 80, 3, 16, p_on, True, torch.Generator().manual_seed(5), config=dict(BN=BN, BK=32, PAIRED=True))


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 33])
@pytest.mark.parametrize("method", ["tile", "atomic"])
def test_gemm_k_matches_twin_and_never_reads_pruned_inputs(M, method):
    run_gemm_k(M, 24, 4, 16, 0.5, method, torch.Generator().manual_seed(M))


@pytest.mark.parametrize("p_on", [0.0, 1.0])
def test_gemm_k_all_groups_on_and_off(p_on):
    run_gemm_k(21, 32, 3, 16, p_on, "tile", torch.Generator().manual_seed(3))


@pytest.mark.parametrize("M", [1, 3, 16])
def test_decode_sized_gemms_take_the_gemv_paths(launches, M):
    # Up to GEMV_MAX_TOKENS tokens: gemm_mn is the persistent GEMV (one token: FMA path; more: a 16-row tile),
    # gemm_k the no-layout tile kernel; both read the mask directly, no layout is built.
    gen = torch.Generator().manual_seed(10 + M)
    run_gemm_mn(M, 48, 3, 16, 0.5, True, gen)
    run_gemm_k(M, 24, 3, 16, 0.5, "tile", gen)
    assert launches.count("gemv_mn_kernel") == 1 and launches.count("gemm_mn_kernel") == 0
    assert launches.count("gemm_k_kernel") == 1 and launches.count("layout_kernel") == 0


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
def test_decode_gemm_mn_computes_a_dense_tail_after_the_routed_groups(M, p_on):
    # Q's routed groups, then K and V (never pruned) as one weight: the tail is always computed.
    gen = torch.Generator().manual_seed(20 + M)
    x, w = randn(M, 48, gen=gen), randn(3 * 16 + 32, 48, gen=gen)
    mask = make_mask((M, 3), p_on, gen)
    out = kernels.gemm_mn(x, w, mask, 16, dense_tail=32)
    ref = kernels.gemm_mn_ref(x, w, mask, 16, dense_tail=32)
    assert_close(out, ref)
    assert_close(out[:, 48:], x @ w[48:].t())
    assert (out[:, :48][~mask.repeat_interleave(16, 1)] == 0).all()


@pytest.mark.parametrize("loop", ["fma", "dot", "pipe"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "gate+up"])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("per_sm", [1, 5])  # 2 or 10 programs (two "SMs" under the interpreter)
def test_decode_gemv_shares_the_live_chunks_over_any_number_of_programs_and_matches_twin(launches, per_sm, M, fused,
                                                                                       fp8, loop):
    # The programs share the live chunks out, whole chunks each (some get none when there are more programs
    # than chunks). dot: one token on the 16-row tensor-core tile (config DOT; more tokens always take it).
    # pipe: one token's lane sums with tiles pipelined through shared memory (config PIPE; more tokens ignore it).
    dot = loop == "dot"
    gen = torch.Generator().manual_seed(30 + per_sm + M)
    G, GS, K, tail = 5, 16, 80, 16  # K = 80 in slices of 32: three steps per chunk, the last one short
    x = randn(M, K, gen=gen)
    w, w_up = randn(G * GS + tail, K, gen=gen), randn(G * GS + tail, K, gen=gen) if fused else None
    mask = make_mask((M, G), 0.5, gen)
    mask[:, 1] = False  # one group no token runs, three that some token does, one either way
    mask[0, [0, 2, 4]] = True
    ws = wus = None
    if fp8:
        w, ws = kernels.quantize_fp8(w)
        w_up, wus = kernels.quantize_fp8(w_up) if fused else (None, None)
    out = kernels.gemm_mn(x, w, mask, GS, w_up=w_up, dense_tail=tail, w_scale=ws, w_up_scale=wus,
                          config=dict(programs_per_sm=per_sm, BN=8, BK=32, DOT=dot, PIPE=3 if loop == "pipe" else 0))
    assert_close(out, kernels.gemm_mn_ref(x, w, mask, GS, w_up=w_up, dense_tail=tail, w_scale=ws, w_up_scale=wus))
    tile = launches.constants["gemv_mn_kernel"][0]["BT"]
    want = 1 if M == 1 and not dot else policy.GEMV_MAX_TOKENS
    assert tile == want, "one token: FMAs, unless DOT takes the 16-row tile"
    pipe = launches.constants["gemv_mn_kernel"][0]["PIPE"]
    assert pipe == (3 if loop == "pipe" and M == 1 else 0), "PIPE is one token's loop only"


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
def test_decode_gemm_k_with_the_routers_live_list_matches_twin(M, p_on):
    gen = torch.Generator().manual_seed(40 + M)
    a, w = randn(M, 6 * 16, gen=gen), randn(24, 6 * 16, gen=gen)
    mask = make_mask((M, 6), p_on, gen)
    if p_on == 0.5:
        mask[:, ::2] = False  # groups no token runs, at any M: the kernel takes the list's groups, not all
    res = randn(M, 24, gen=gen)
    out = kernels.gemm_k(a, w, mask, 16, residual=res, live=kernels_step.live_ref(mask))
    assert_close(out, kernels.gemm_k_ref(a, w, mask, 16, residual=res))


@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("split", [1, 2, 8])  # 8 programs for 6 groups: some get none, so nothing to prefetch
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_gemm_k_prefetching_its_first_weight_slice_matches_twin(launches, p_on, split, fp8):
    # config PREFETCH: one token with the router's live list loads its first (group, slice) of weights
    # before the PDL wait, then the loop takes the rest; with FMA and without, BK smaller than a group.
    gen = torch.Generator().manual_seed(70 + split)
    K, N = 6 * 32, 40
    a, w, res = randn(1, K, gen=gen), randn(N, K, gen=gen), randn(1, N, gen=gen)
    mask = make_mask((1, 6), p_on, gen)
    if p_on == 0.5:
        mask[:, ::2] = False
    scale = None
    if fp8:
        w, scale = kernels.quantize_fp8(w)
    garbage = torch.where(mask.repeat_interleave(32, 1), a, torch.full_like(a, float("nan")))
    tickets = torch.zeros(64, dtype=torch.int32, device=DEV)
    for fma in (False, True):
        out = kernels.gemm_k(garbage, w, mask, 32, residual=res, tickets=tickets, w_scale=scale,
                             live=kernels_step.live_ref(mask),
                             config={"PREFETCH": True, "SPLIT": split, "BK": 16, "FMA": fma})
        assert_close(out, kernels.gemm_k_ref(a, w, mask, 32, residual=res, w_scale=scale))
        assert (tickets == 0).all()
    assert all(c["PREFETCH"] for c in launches.constants["gemm_k_kernel"])
    kernels.gemm_k(a, w, mask, 32, w_scale=scale, config={"PREFETCH": True})  # no live list: nothing to prefetch by
    assert not launches.constants["gemm_k_kernel"][-1]["PREFETCH"]


def test_decode_gemm_k_with_a_long_reduction_splits_the_live_groups(launches):
    # The down projection's shape class: K >= 8192 (LONG_K on a GPU) and one token. The live groups
    # are shared out over SPLIT programs (grid axis 1) whose fp32 partials are summed in a fixed order.
    gen = torch.Generator().manual_seed(11)
    run_gemm_k(1, 16, 64, 128, 0.5, "tile", gen)
    (grid,) = launches.grids["gemm_k_kernel"]
    assert grid[1] == kernels_base.CONFIGS["gemm_k_small_long_k"]["SPLIT"] > 1, grid


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 weights", "fp8 codes"])
@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
def test_one_token_gemm_k_with_a_short_reduction_takes_no_split_and_no_ticket(launches, p_on, fp8):
    # O's shape class at one token (K < LONG_K): its own CONFIGS key, a program per few output rows over all the
    # live groups as one-row FMAs: no partials, no ticket; a token of 2+ keeps the split tile (gemm_k_small).
    gen = torch.Generator().manual_seed(13)
    K, N = 3 * 16, 40
    assert K < kernels_base.LONG_K
    a, w, res = randn(1, K, gen=gen), randn(N, K, gen=gen), randn(1, N, gen=gen)
    scale = None
    if fp8:
        w, scale = kernels.quantize_fp8(w)
    mask = make_mask((1, K // 16), p_on, gen)
    garbage = a.masked_fill(~mask.repeat_interleave(16, 1), float("nan"))
    tickets = torch.full((64,), 7, dtype=torch.int32, device=DEV)  # never touched without the split
    out = kernels.gemm_k(garbage, w, mask, 16, residual=res, tickets=tickets, w_scale=scale)
    assert_close(out, kernels.gemm_k_ref(a, w, mask, 16, residual=res, w_scale=scale))
    assert (tickets == 7).all()
    key = "gemm_k_small_1" + ("_fp8" if fp8 else "")
    (grid,), (consts,) = launches.grids["gemm_k_kernel"], launches.constants["gemm_k_kernel"]
    assert grid[1] == 1 and consts["SPLIT"] == 1 and consts["BM"] == 1
    assert consts["BN"] == kernels_base.CONFIGS[key]["BN"]
    launches.clear()
    kernels.gemm_k(randn(2, K, gen=gen), w, make_mask((2, K // 16), p_on, gen), 16, w_scale=scale)
    (grid,) = launches.grids["gemm_k_kernel"]
    assert grid[1] == kernels_base.CONFIGS["gemm_k_small" + ("_fp8" if fp8 else "")]["SPLIT"] > 1


def test_gemm_k_early_next_lets_only_its_own_launch_release_the_next_kernel_early(launches, monkeypatch):
    # Config EARLY_NEXT (a bench.tune variant): this launch's programs let the next kernel launch once they have
    # passed their PDL wait (PDL mode 2), whatever the global mode; with PDL off it stays off.
    launches.dry = True  # the launch keywords are the point; nothing runs
    a, w, mask = randn(1, 48), randn(40, 48), torch.ones(1, 3, dtype=torch.bool, device=DEV)
    monkeypatch.setattr(kernels_base, "pdl", lambda device: 1)  # a Hopper GPU in the default "exit" mode
    kernels.gemm_k(a, w, mask, 16)
    kernels.gemm_k(a, w, mask, 16, config={"EARLY_NEXT": True})
    assert [(c["PDL"], c["launch_pdl"]) for c in launches.constants["gemm_k_kernel"]] == [(1, True), (2, True)]
    monkeypatch.setattr(kernels_base, "pdl", lambda device: 0)  # WIDE_PDL=0, or no Hopper
    kernels.gemm_k(a, w, mask, 16, config={"EARLY_NEXT": True})
    last = launches.constants["gemm_k_kernel"][-1]
    assert (last["PDL"], last["launch_pdl"]) == (0, False)


@pytest.mark.parametrize("M, K", [(1, 24 * 16), (3, 64 * 16), (21, 24 * 16)])  # split, split, plain
def test_gemm_k_adds_the_residual_in_its_epilogue_and_leaves_its_tickets_at_zero(M, K):
    gen = torch.Generator().manual_seed(12 + M)
    a, w, res = randn(M, K, gen=gen), randn(40, K, gen=gen), randn(M, 40, gen=gen)
    mask = make_mask((M, K // 16), 0.5, gen)
    tickets = torch.zeros(64, dtype=torch.int32, device=DEV)
    for _ in range(2):  # tickets back at zero: a second launch (a graph replay) reduces again
        out = kernels.gemm_k(a, w, mask, 16, residual=res, tickets=tickets)
        assert (tickets == 0).all()
        assert_close(out, kernels.gemm_k_ref(a, w, mask, 16, residual=res))


@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("pipe", [0, 3])
def test_one_token_gemm_k_with_fma_matches_twin_and_never_reads_pruned_inputs(launches, p_on, split, pipe):
    # config FMA: one token is a one-row tile summed with fp32 multiply-adds instead of a padded
    # 16-row tl.dot; the live-group list, the split and the residual epilogue are the same code. PIPE: the
    # K loop as a pipelined tl.range.
    gen = torch.Generator().manual_seed(30 + split)
    K, N = 5 * 16, 40
    a, w, res = randn(1, K, gen=gen), randn(N, K, gen=gen), randn(1, N, gen=gen)
    mask = make_mask((1, 5), p_on, gen)
    garbage = torch.where(mask.repeat_interleave(16, 1), a, torch.full_like(a, float("nan")))
    tickets = torch.zeros(64, dtype=torch.int32, device=DEV)
    out = kernels.gemm_k(garbage, w, mask, 16, residual=res, tickets=tickets,
                         config={"FMA": True, "SPLIT": split, "PIPE": pipe})
    assert_close(out, kernels.gemm_k_ref(a, w, mask, 16, residual=res))
    assert (tickets == 0).all() and launches.constants["gemm_k_kernel"][0]["BM"] == 1
    assert launches.constants["gemm_k_kernel"][0]["PIPE"] == pipe


def test_one_layout_serves_gate_up_then_down():
    # The FFN pair: one layout; the intermediate's pruned slots are left unwritten (NaN-poisoned)
    # and gemm_k, reading only active slots, still matches the dense-masked reference.
    gen = torch.Generator().manual_seed(4)
    M, D, G, gs = 35, 32, 4, 16
    x, wg, wu, wd = randn(M, D, gen=gen), randn(G * gs, D, gen=gen), randn(G * gs, D, gen=gen), randn(D, G * gs, gen=gen)
    mask = make_mask((M, G), 0.5, gen)
    lay = kernels_layout.layout(mask)
    h = kernels.gemm_mn(x, wg, lay, gs, w_up=wu, zero_pruned=False)
    if kernels_base.INTERPRET:  # buffers start poisoned only under the interpreter
        assert torch.isnan(h[~mask.repeat_interleave(gs, 1)]).all(), "zero_pruned=False leaves pruned slots"
    for method in ("tile", "atomic"):
        out = kernels.gemm_k(h, wd, lay, gs, method=method)
        ref = kernels.gemm_k_ref(kernels.gemm_mn_ref(x, wg, mask, gs, wu), wd, mask, gs)
        assert_close(out, ref)


# ---------------------------------------------------------------------------------- attention
def run_prefill(B, H, Hkv, T, D, G, p_on, causal, gen, lengths=None, start=0):
    # start > 0: a chunk of a longer prompt, its T queries after `start` cached keys
    q, k, v = randn(B, H, T, D, gen=gen), randn(B, Hkv, start + T, D, gen=gen), randn(B, Hkv, start + T, D, gen=gen)
    mask = make_mask((B, T, G), p_on, gen)
    if lengths is not None:  # right padding: padded tokens run no group
        mask &= (torch.arange(T, device=DEV)[None, :] < torch.tensor(lengths, device=DEV)[:, None])[..., None]
    out = kernels_attention.attention_prefill(q, k, v, mask, causal=causal, start=start)
    ref = kernels_attention.attention_prefill_ref(q, k, v, mask, causal=causal, start=start)
    assert_close(out, ref)
    keep = mask.repeat_interleave(H // G, dim=-1).permute(0, 2, 1)
    assert (out[~keep] == 0).all(), "inactive (token, head group) outputs must be exactly zero"


def run_decode(B, H, Hkv, L, D, G, p_on, lengths, gen, config=None):
    q, kc, vc = randn(B, H, 1, D, gen=gen), randn(B, Hkv, L, D, gen=gen), randn(B, Hkv, L, D, gen=gen)
    mask = make_mask((B, G), p_on, gen)
    kv_len = torch.tensor(lengths, device=DEV)
    # K/V of inactive KV heads are never read: poison them and the output must not change.
    dead_kv = ~mask.repeat_interleave(H // G, 1).view(B, Hkv, H // Hkv).any(-1)
    kc_p, vc_p = kc.clone(), vc.clone()
    kc_p[dead_kv], vc_p[dead_kv] = float("nan"), float("nan")
    tickets = torch.zeros(B * Hkv + 3, dtype=torch.int32, device=DEV)
    out = kernels_attention.attention_decode(q, kc_p, vc_p, mask, kv_len, config=config, tickets=tickets)
    assert_close(out, kernels_attention.attention_decode_ref(q, kc, vc, mask, kv_len))
    assert (out[~mask.repeat_interleave(H // G, 1)] == 0).all()
    assert (tickets == 0).all(), "the in-launch merge leaves its tickets zero for the next call"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("G", [1, 2, 4])  # 2 = one group per KV head (default); 4 = a group inside a KV head
def test_attention_prefill_matches_twin(G, causal):
    run_prefill(2, 4, 2, 37, 16, G, 0.5, causal, torch.Generator().manual_seed(G), lengths=[37, 20])


@pytest.mark.parametrize("start, T", [(5, 7), (16, 16), (33, 9)])  # inside, at and past a key block
@pytest.mark.parametrize("G", [2, 4])
def test_attention_prefill_of_a_chunk_sees_the_cached_keys_before_it(start, T, G):
    run_prefill(2, 4, 2, T, 16, G, 0.5, True, torch.Generator().manual_seed(start + G), start=start)


def test_attention_prefill_twin_of_a_chunk_is_the_matching_rows_of_the_whole_prompt():
    # The twin's meaning: a chunk's outputs are the rows start.. of the whole prompt's attention.
    gen = torch.Generator().manual_seed(30)
    B, H, Hkv, L, D, S = 1, 4, 2, 20, 16, 12
    q, k, v = randn(B, H, L, D, gen=gen), randn(B, Hkv, L, D, gen=gen), randn(B, Hkv, L, D, gen=gen)
    mask = make_mask((B, L, 2), 0.5, gen)
    whole = kernels_attention.attention_prefill_ref(q, k, v, mask)
    chunk = kernels_attention.attention_prefill_ref(q[:, :, S:], k, v, mask[:, S:], start=S)
    assert_close(chunk, whole[:, :, S:], tol=1e-6)


@pytest.mark.parametrize("p_on", [0.0, 1.0])
def test_attention_prefill_all_groups_on_and_off(p_on):
    run_prefill(1, 4, 2, 19, 16, 2, p_on, True, torch.Generator().manual_seed(5))


@pytest.mark.parametrize("p_on", [0.0, 0.5, 1.0])
def test_attention_decode_skips_inactive_kv_heads(p_on):
    run_decode(3, 4, 2, 70, 16, 2, p_on, [70, 1, 33], torch.Generator().manual_seed(6))


# The work list cuts each live (row, KV head)'s keys into chunks sized for about programs_per_sm x SMs
# items: 64 per SM gives chunks of one key block (many partials, merged by the pair's last program), 1 per
# SM long chunks (most pairs in one item, written directly); 16 rows of varied lengths in between.
@pytest.mark.parametrize("per_sm", [64, 4, 1])
@pytest.mark.parametrize("p_on", [0.25, 1.0])
def test_attention_decode_work_list_over_rows_of_any_length(per_sm, p_on):
    lengths = [1, 16, 17, 70, 33, 2, 64, 5, 48, 70, 9, 31, 32, 15, 66, 40]
    run_decode(16, 4, 2, 70, 16, 2, p_on, lengths, torch.Generator().manual_seed(per_sm),
               config=dict(programs_per_sm=per_sm))


def after_rope(device, B, H, Hkv, D, L, steps, dtype):
    """attention_decode right after rope_and_store, the launch that writes q and each row's newest key (as in
    a decode step); that key is poisoned before every step, so reading it before the write (under PDL, where
    the two launches overlap) would reach the output. Returns the worst error against the twin over the steps."""
    gen = torch.Generator().manual_seed(B)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    kc, vc = rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
    cfg = kernels_base.CONFIGS["attn_decode"]
    worst = 0.0
    for i in range(steps):
        kv_len = torch.randint(1, L + 1, (B,), generator=gen)
        kv_len[0] = [1, L, cfg["BN"], cfg["BN"] + 1][i % 4] if L > cfg["BN"] else L
        kv_len = kv_len.to(device)
        slot = kv_len - 1
        rows = torch.arange(B, device=device)
        kc[rows, :, slot], vc[rows, :, slot] = float("nan"), float("nan")
        step = type("Step", (), dict(cos=rnd(B, D).float(), sin=rnd(B, D).float(), slot=slot))
        mask = (torch.rand(B, Hkv, generator=gen) < 0.5).to(device)
        mask[:, 0] = True
        q = kernels_step.rope_and_store(rnd(B, H * D), rnd(B, Hkv * D), rnd(B, Hkv * D), step, kc, vc, H, Hkv, D)
        out = kernels_attention.attention_decode(q.view(B, H, 1, D), kc, vc, mask, kv_len)
        ref = kernels_attention.attention_decode_ref(q.view(B, H, 1, D).float(), kc.float(), vc.float(), mask, kv_len)
        assert torch.isfinite(out).all(), f"step {i}: a poisoned newest key was read before it was written"
        worst = max(worst, rel_err(out, ref))
    return worst


def test_attention_decode_after_the_launch_that_writes_the_newest_key():
    assert after_rope(DEV, 2, 4, 2, 16, 40, 4, torch.float32) <= 1e-4


def test_attention_decode_group_smaller_than_kv_head():
    run_decode(2, 8, 2, 40, 16, 8, 0.5, [40, 17], torch.Generator().manual_seed(7))


def test_attention_reuses_a_layout():
    gen = torch.Generator().manual_seed(8)
    B, H, Hkv, T, D = 2, 4, 2, 23, 16
    q, k, v = randn(B, H, T, D, gen=gen), randn(B, Hkv, T, D, gen=gen), randn(B, Hkv, T, D, gen=gen)
    mask = make_mask((B, T, 2), 0.5, gen)
    lay = kernels_layout.layout(mask)  # the same layout feeds Q proj, attention, O proj
    assert_close(kernels_attention.attention_prefill(q, k, v, lay),
                 kernels_attention.attention_prefill_ref(q, k, v, mask))


# ---------------------------------------------------------------------------------- dispatch, fuzz
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU without the interpreter")
def test_kernels_never_fall_back_to_their_twins_on_a_cpu_without_the_interpreter():
    # No silent fallback: on a CPU tensor without TRITON_INTERPRET=1 the op refuses, naming the fix.
    code = ("import torch, kernels\n"
            "x, w, m = torch.randn(5, 32), torch.randn(32, 32), torch.ones(5, 2, dtype=torch.bool)\n"
            "kernels.gemm_mn(x, w, m, 16)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr, r.stderr[-500:]


def test_fuzz_random_shapes_and_masks():
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    for case in range(60):
        p_on = rng.choice([0.0, 0.2, 0.5, 0.8, 1.0])
        op = case % 5
        if op == 0:
            run_gemm_mn(rng.randint(1, 40), rng.choice([16, 40, 64]), rng.randint(1, 3),
                        rng.choice([16, 32]), p_on, rng.random() < 0.5, gen, as_layout=rng.random() < 0.5)
        elif op == 1:
            run_gemm_k(rng.randint(1, 40), rng.choice([8, 24, 40]), rng.randint(1, 3),
                       rng.choice([16, 32]), p_on, rng.choice(["tile", "atomic"]), gen,
                       as_layout=rng.random() < 0.5)
        elif op == 2:
            mask = make_mask((rng.randint(1, 3), rng.randint(1, 40), rng.randint(1, 6)), p_on, gen)
            check_layout(kernels_layout.layout(mask, block_m=16), mask, 16)
        elif op == 3:
            Hkv = rng.choice([1, 2])
            H = Hkv * rng.choice([1, 2, 4])
            B, T = rng.randint(1, 3), rng.randint(1, 40)
            run_prefill(B, H, Hkv, T, 16, rng.choice([g for g in (1, 2, 4) if H % g == 0]), p_on,
                        rng.random() < 0.8, gen, lengths=[rng.randint(1, T) for _ in range(B)])
        else:
            Hkv = rng.choice([1, 2])
            H = Hkv * rng.choice([1, 2, 4])
            B, L = rng.randint(1, 4), rng.randint(1, 80)
            run_decode(B, H, Hkv, L, 16, rng.choice([g for g in (1, 2, 4) if H % g == 0]), p_on,
                       [rng.randint(1, L) for _ in range(B)], gen)


# ---------------------------------------------------------------------------------- GPU, bf16
def rel_err(out, ref):
    # relative to the reference; against an all-zero reference (every group skipped), the largest |out|
    diff = (out.float() - ref.float()).norm()
    return (diff / ref.float().norm() if ref.abs().max() > 0 else out.float().abs().max()).item()


@GPU
@pytest.mark.parametrize("M", [1, 4, 300])
def test_gpu_bf16_gemms(M):
    torch.manual_seed(M)
    D, I, gs = 512, 1024, 128
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(I, D, device="cuda", dtype=torch.bfloat16) / D ** 0.5 for _ in range(2))
    wd = torch.randn(D, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    mask = torch.rand(M, I // gs, device="cuda") < 0.5
    lay = kernels_layout.layout(mask)
    h = kernels.gemm_mn(x, wg, lay, gs, w_up=wu)
    h_ref = kernels.gemm_mn_ref(x.float(), wg.float(), mask, gs, wu.float())
    assert rel_err(h, h_ref) <= 1e-2 and (h[~mask.repeat_interleave(gs, 1)] == 0).all()
    for method in ("tile", "atomic"):
        y = kernels.gemm_k(h, wd, lay, gs, method=method)
        assert rel_err(y, kernels.gemm_k_ref(h.float(), wd.float(), mask, gs)) <= 1e-2


@GPU
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", ["gate+up", "qkv"])
@pytest.mark.parametrize("config", [None, dict(DOT=True, BN=32, BK=256, programs_per_sm=2),
                                    dict(PIPE=4, BN=16, BK=256, programs_per_sm=2)], ids=["tuned", "dot", "pipe"])
def test_gpu_one_token_gemv_mn_at_full_size_matches_twin(fp8, shape, config):
    # The decode GEMV at the Llama-3.1-8B shapes (hundreds of programs); each mask twice. dot: one token on
    # the 16-row tensor-core tile.
    torch.manual_seed(7)
    D, (N, gs, tail, fused) = 4096, {"gate+up": (14336, 128, 0, True), "qkv": (6144, 512, 2048, False)}[shape]
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    w, wu = (torch.randn(N, D, device="cuda", dtype=torch.bfloat16) / D ** 0.5 for _ in range(2))
    (w, ws), (wu, wus) = (kernels.quantize_fp8(v) if fp8 else (v, None) for v in (w, wu))
    wu, wus = (wu, wus) if fused else (None, None)
    for p_on in (0.0, 0.5, 1.0):
        mask = torch.rand(1, (N - tail) // gs, device="cuda") < p_on
        ref = kernels.gemm_mn_ref(x.float(), w if fp8 else w.float(), mask, gs, None if wu is None else
                                  (wu if fp8 else wu.float()), dense_tail=tail, w_scale=ws, w_up_scale=wus)
        for _ in range(2):
            out = kernels.gemm_mn(x, w, mask, gs, w_up=wu, dense_tail=tail, w_scale=ws, w_up_scale=wus, config=config)
            assert rel_err(out, ref) <= 1e-2, (p_on, rel_err(out, ref))


@GPU
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("K", [1024, 16384])  # the O projection's and the down projection's (split) classes
def test_gpu_one_token_gemm_k_with_fma_rows(fp8, K):
    # config FMA compiles and matches the twin on the GPU (the interpreter cannot tell it from a tl.dot)
    torch.manual_seed(K)
    N, gs = 512, 128
    a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    w, scale = kernels.quantize_fp8(w) if fp8 else (w, None)
    res = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    for p_on in (0.0, 0.5, 1.0):
        mask = torch.rand(1, K // gs, device="cuda") < p_on
        out = kernels.gemm_k(a, w, mask, gs, residual=res, w_scale=scale, config={"FMA": True})
        ref = kernels.gemm_k_ref(a.float(), w.float() if scale is None else w, mask, gs, residual=res.float(),
                                 w_scale=scale)
        assert rel_err(out, ref) <= 1e-2, (p_on, rel_err(out, ref))


@GPU
@pytest.mark.parametrize("B", [1, 4])
def test_gpu_attention_decode_after_the_launch_that_writes_the_newest_key(B):
    # under PDL, where the two launches overlap: no key rope_and_store writes is read before the wait
    assert after_rope("cuda", B, 32, 8, 128, 1024, 50, torch.bfloat16) <= 1e-2


@GPU
def test_gpu_bf16_attention():
    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 8, 2, 300, 128
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.rand(B, T, 2, device="cuda") < 0.5
    out = kernels_attention.attention_prefill(q, k, v, mask)
    assert rel_err(out, kernels_attention.attention_prefill_ref(q.float(), k.float(), v.float(), mask)) <= 1e-2
    dmask = torch.rand(B, 2, device="cuda") < 0.5
    kv_len = torch.tensor([300, 77], device="cuda")
    out = kernels_attention.attention_decode(q[:, :, :1], k, v, dmask, kv_len)
    ref = kernels_attention.attention_decode_ref(q[:, :, :1].float(), k.float(), v.float(), dmask, kv_len)
    assert rel_err(out, ref) <= 1e-2 or not dmask.any()

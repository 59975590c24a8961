"""End to end: the Triton engine against the reference, through the whole model and generate().

The same weights run through backend "torch" (model.py: dense compute, skipped groups zeroed) and
backend "triton" (engine.py: the kernels skip them). On CPU the kernels run in the Triton interpreter
(conftest), fp32, and the launch recorder proves that the width-skipping kernels ran (layout, gemm_mn,
gemm_k, prefill and decode attention): routing masks must be identical, logits equal to fp32
rounding, greedy tokens identical for 32 new tokens at batch 1 and for a batch of prompts of
different lengths. With a GPU the same tests run there (fp32), and the GPU tests add CUDA graphs and
bf16; they skip without CUDA. Speed lives in `python -m bench.e2e`, never here.
"""
import copy
import dataclasses

import pytest
import torch

import engine
import wide
from conftest import assert_close as _assert_close
from generate import generate
from model import ModelConfig, Transformer
from policy import Policy

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Every pruned linear through its Triton kernel, whatever the token count (the default policy hands
# mid-sized steps to cuBLAS on the masked input; that path is tested too).
DEFAULT = Policy()
ALL_SPARSE = Policy(sparse_decode_max_tokens=10 ** 6, sparse_prefill_min_tokens=1, live_attention_min_tokens=0)
ALL_DENSE_LINEARS = Policy(sparse_decode_max_tokens=0, sparse_prefill_min_tokens=10 ** 9)
# The kernels that skip work in a generation with the default policy (a short prompt, then one-token
# steps: gemm_mn runs as its GEMV kernel); a test of the Triton path that did not launch them proves nothing.
# What skips work in a short prompt's generation by default (its prefill runs attention over every head:
# Policy.live_attention_min_tokens): the decode kernels
SKIPPING = ("gemv_mn_kernel", "gemm_k_kernel", "attn_decode_kernel")


def wide_model(device=DEV, dtype=torch.float32, seed=0, routers=True, std=0.3, cfg=None, ffn_group_size=32):
    """Tiny, but shaped as the kernels need: head_dim 16, groups of 2 heads (one KV head) and of 32
    channels. Large weights give clear argmax margins; random routers skip about half the groups.
    cfg / ffn_group_size: another shape (the GPU tests)."""
    torch.manual_seed(seed)
    cfg = cfg or ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                             max_seq_len=96)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    if routers:
        wide.install_routers(m, wide.WideConfig(ffn_group_size=ffn_group_size))
    m = m.to(device)
    for name, p in m.named_parameters():  # routers stay fp32, as checkpoints.load_wide leaves them
        if "router" not in name:
            p.data = p.data.to(dtype)
    return m.eval()


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_close(out, ref, tol):
    _assert_close(out, ref, rtol=tol, what="logits")


def run_both(m, fn, policy=DEFAULT):
    """fn(forward) with the model itself (torch), then with engine.Engine (triton): [result, result]."""
    with torch.no_grad():
        return [fn(m), fn(engine.Engine(m, policy))]


def assert_same_masks(a, b):
    assert a.keys() == b.keys()
    for kind in a:
        assert len(a[kind]) == len(b[kind])
        for x, y in zip(a[kind], b[kind]):
            assert torch.equal(x, y), f"routing masks ({kind}) must be identical"


# ----------------------------------------------------------------------------------------------------
# one forward


SPLIT_ROUTER = Policy(router_split_max_tokens=128)  # a 74-token step on norm_route's split kernel, not its D-split pair
SPLIT_ROUTER_16 = Policy(router_split_max_tokens=128, router_split_tile=16)  # ... in tiles of 16 tokens
LIVE_TILES = Policy(live_attention_min_tokens=0)  # a 74-token step's attention over its live (group, tile) items only
SIDE_ROUTER = Policy(router_side_stream=True)  # the router's decision beside the plain norm (a side stream on a GPU)


@pytest.mark.parametrize("policy", [DEFAULT, ALL_SPARSE, ALL_DENSE_LINEARS, SPLIT_ROUTER, SPLIT_ROUTER_16, LIVE_TILES,
                                    SIDE_ROUTER], ids=["default", "all-sparse", "dense-linears", "split-router",
                                                       "split-router-16", "live-tiles", "side-router"])
def test_triton_forward_routes_identically_and_matches_reference_logits(launches, policy):
    m = wide_model()
    idx = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1)).to(DEV)
    (ref, ref_masks), (out, out_masks) = run_both(m, lambda f: (f(idx, masks=(d := {})), d), policy)
    assert_same_masks(ref_masks, out_masks)
    assert 0.2 < torch.stack([a.mean() for a in ref_masks["attn"]]).mean() < 0.8, "routers should skip some groups"
    assert_close(out, ref, 1e-5)
    # 74 tokens: attention over every head (SDPA, the pruned heads zeroed, nothing reads a layout) unless the policy
    # asks for the live tiles (layout and prefill kernel); the pruned linears where the policy says so.
    if policy.live_attention_min_tokens > 74:
        assert launches.count("layout_kernel") == launches.count("attn_prefill_kernel") == 0
    else:
        assert launches.count("layout_kernel") > 0 and launches.count("attn_prefill_kernel") == len(m.layers)
    assert launches.count("gemm_mn_kernel") == (2 * len(m.layers) if policy is ALL_SPARSE else 0)
    assert launches.count("gemm_k_kernel") == (2 * len(m.layers) if policy is ALL_SPARSE else 0)
    split = policy in (SPLIT_ROUTER, SPLIT_ROUTER_16)  # the router in the norm's launch, one kernel or the other
    assert launches.count("norm_route_kernel") == (2 * len(m.layers) if split else 0)
    beside = policy is SIDE_ROUTER  # the plain norm, and norm_route for its decision (on a side stream on a GPU)
    assert launches.count("rms_norm_kernel") == (2 * len(m.layers) if beside else 0) + 1  # + the final norm
    for half in ("norm_route_part_kernel", "norm_route_finish_kernel"):  # the prefill chunk's two launches
        assert launches.count(half) == (0 if split else 2 * len(m.layers))
    if split:  # the tiles the policy asked for: 74 tokens in tiles of 4 or 16
        tiles = {grid[1] for grid in launches.grids["norm_route_kernel"]}
        assert tiles == {-(-74 // (16 if policy is SPLIT_ROUTER_16 else 4))}


@pytest.mark.parametrize("policy", [DEFAULT, ALL_SPARSE], ids=["default", "all-sparse"])
def test_triton_prefill_and_decode_with_per_row_positions_match_reference(launches, policy):
    m = wide_model()
    idx = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(2)).to(DEV)

    def steps(f):
        f.setup_caches(3, 16)
        masks = {}
        out = [f(idx, input_pos=torch.arange(9, device=DEV), masks=masks)]
        pos = torch.tensor([[4], [9], [6]], device=DEV)  # each row continues after its own prompt
        for i in range(3):
            out.append(f(idx[:, i:i + 1], input_pos=pos + i, masks=masks))
        f.clear_caches()
        return torch.cat(out, 1), masks

    (ref, ref_masks), (out, out_masks) = run_both(m, steps, policy)
    assert_same_masks(ref_masks, out_masks)
    assert_close(out, ref, 1e-5)
    # Decode steps of 3 tokens are GEMV-sized: every pruned linear and the decode attention in Triton.
    assert launches.count("gemv_mn_kernel") >= 2 * 3 * len(m.layers)
    assert launches.count("attn_decode_kernel") == 3 * len(m.layers)


def test_dense_model_through_the_triton_engine_equals_the_reference(launches):
    m = wide_model(routers=False)
    idx = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3)).to(DEV)

    def steps(f):
        f.setup_caches(2, 24)
        out = torch.cat([f(idx, input_pos=torch.arange(20, device=DEV)),
                         f(idx[:, :1], input_pos=torch.tensor([20], device=DEV))], 1)
        f.clear_caches()
        return out

    ref, out = run_both(m, steps)
    assert_close(out, ref, 1e-5)
    assert launches.count("attn_decode_kernel") == len(m.layers) and launches.count("rms_norm_kernel") > 0


@pytest.mark.parametrize("policy", [DEFAULT, ALL_SPARSE, LIVE_TILES], ids=["default", "all-sparse", "live-tiles"])
def test_prefill_in_chunks_through_the_engine_equals_the_whole_prompt(launches, policy):
    # A long prompt fed in chunks (serve.py does this between decode steps): each chunk attends to the
    # cache before it, and the logits equal the reference's whole-prompt forward.
    # Routed: both multi-token chunks run the prefill kernel over their live tiles, or (by default, short chunks)
    # attention as dense runs it, the pruned heads then zeroed. Dense: the first runs SDPA (is_causal), the later
    # one the kernel with every head on (Policy.dense_chunk_attention), or SDPA with mask rows.
    every = policy.live_attention_min_tokens > 13
    for routers, chunk_attention, kernel_chunks in ((True, "triton", 1 if every else 2), (True, "sdpa", 0 if every else 2),
                                                    (False, "triton", 1), (False, "sdpa", 0)):
        m = wide_model(routers=routers)
        idx = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(4)).to(DEV)
        e = engine.Engine(m, dataclasses.replace(policy, dense_chunk_attention=chunk_attention))
        launches.clear()
        with torch.no_grad():
            full = m(idx)
            e.setup_caches(2, 32)
            parts = [e(idx[:, a:b], input_pos=torch.arange(a, b, device=DEV)) for a, b in ((0, 9), (9, 10), (10, 23))]
            e.clear_caches()
        assert_close(torch.cat(parts, 1), full, 1e-5)
        assert launches.count("attn_prefill_kernel") == kernel_chunks * len(m.layers), (routers, chunk_attention)


def test_the_engine_refuses_what_it_does_not_run_instead_of_falling_back():
    m = wide_model()
    idx = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4)).to(DEV)
    e = engine.Engine(m)
    with torch.no_grad():
        e.setup_caches(2, 16)
        with pytest.raises(ValueError, match="torch backend"):  # several tokens at per-row positions
            e(idx[:, :5], input_pos=torch.arange(5, device=DEV).expand(2, 5))
        e.clear_caches()
    with pytest.raises(RuntimeError, match="no_grad"):  # training runs the reference path
        e(idx)


def test_select_is_the_one_backend_switch():
    m = wide_model()
    assert engine.select(m, "torch") is m
    assert isinstance(engine.select(m, "triton"), engine.Engine)
    assert (engine.select(m, "auto") is m) == (DEV == "cpu")  # auto = triton on a GPU only
    small = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    intermediate_size=64)).to(DEV)  # head_dim 8: too small for the kernels
    with pytest.raises(ValueError, match="head_dim"):
        engine.select(small, "triton")
    assert engine.select(small, "auto") is small
    with pytest.raises(ValueError, match="torch, triton or auto"):
        engine.select(m, "cuda")


def test_the_plan_names_every_op_it_sends_to_cublas():
    # The ops deliberately handed to cuBLAS (exact, because pruned slots are zero) are named in the plan.
    e = engine.Engine(wide_model())
    prefill, decode = e.step_plan(74, False).text(), e.step_plan(5, True).text()
    assert "O proj             cuBLAS         one library GEMM on the masked input" in prefill
    assert "O proj             cuBLAS         one library GEMM on the masked input" in decode  # 5 > 4 tokens
    # and the batch rule (wide.FFNRule): 5 rows > 4, the FFN runs dense, its routers not asked
    assert "down proj          cuBLAS         one library GEMM (nothing routed here)" in decode and "batch rule" in decode
    assert "lm_head            cuBLAS" in prefill and "lm_head            cuBLAS" in decode


# ----------------------------------------------------------------------------------------------------
# generate(): greedy tokens, batches of prompts of different lengths


def greedy_both(m, idx, n, lengths=None, policy=DEFAULT):
    def run(f):
        steps = []
        out = generate(f, idx, n, temperature=0.0, lengths=lengths,
                       on_token=lambda i, t, masks: steps.append({k: [x.clone() for x in v] for k, v in masks.items()}))
        return out, steps
    return run_both(m, run, policy)


def test_greedy_tokens_identical_across_backends_at_batch_1(launches):
    m = wide_model()
    # a 12-token prompt and 6 new tokens: the cache grows past the interpreter's key block of 16 (positions 12..17)
    prompt = [[5, 17, 3, 44, 9, 21, 8, 60, 2, 33, 14, 7]]
    (ref, ref_steps), (out, out_steps) = greedy_both(m, torch.tensor(prompt, device=DEV), 6)
    assert torch.equal(out, ref), f"\n{ref.tolist()}\n{out.tolist()}"
    for a, b in zip(ref_steps, out_steps):
        assert_same_masks(a, b)
    for name in SKIPPING:
        assert launches.count(name) > 0, f"{name} never ran: the Triton path did not skip any work"


@pytest.mark.parametrize("policy", [DEFAULT, ALL_SPARSE], ids=["default", "all-sparse"])
def test_greedy_tokens_identical_across_backends_for_prompts_of_different_lengths(launches, policy):
    m = wide_model()
    lengths = [14, 9, 12]
    idx = torch.randint(1, 96, (3, 14), generator=torch.Generator().manual_seed(5)).to(DEV)
    idx[1, 9:], idx[2, 12:] = 0, 0  # right padding
    (ref, _), (out, _) = greedy_both(m, idx, 8, lengths, policy)  # every row past one key block of 16, as above
    assert torch.equal(out, ref), f"\n{ref.tolist()}\n{out.tolist()}"
    for name in ("attn_decode_kernel",) + (("layout_kernel", "attn_prefill_kernel", "gemm_mn_kernel", "gemm_k_kernel")
                                          if policy is ALL_SPARSE else ("gemv_mn_kernel", "gemm_k_kernel")):
        assert launches.count(name) > 0, f"{name} never ran"


def test_prompts_of_different_lengths_generate_as_if_alone():
    # Padding never reaches a real token: each row of the batch equals that prompt generated alone.
    m = wide_model()
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9]]
    idx = torch.tensor([p + [0] * (7 - len(p)) for p in prompts], device=DEV)
    together = generate(m, idx, 12, lengths=[len(p) for p in prompts])
    for b, p in enumerate(prompts):
        alone = generate(m, torch.tensor([p], device=DEV), 12)
        assert together[b, :len(p) + 12].tolist() == alone[0].tolist()
        assert (together[b, len(p) + 12:] == 0).all()


# ----------------------------------------------------------------------------------------------------
# GPU


class Replay(torch.nn.Module):
    """Stands in for a router: returns the masks another run recorded, one forward at a time."""

    def __init__(self, recorded):
        super().__init__()
        self.recorded = list(recorded)

    def forward(self, x):
        return self.recorded.pop(0)


@GPU
def test_gpu_fp32_greedy_tokens_identical_across_backends_with_cuda_graphs():
    m = wide_model("cuda")
    idx = torch.randint(1, 96, (3, 7), generator=torch.Generator().manual_seed(6)).cuda()
    for lengths in (None, [7, 3, 5]):
        (ref, _), (out, _) = greedy_both(m, idx, 32, lengths)
        assert torch.equal(out, ref), f"\n{ref.tolist()}\n{out.tolist()}"


@GPU
def test_gpu_cuda_graph_decode_equals_eager_decode():
    e = engine.Engine(wide_model("cuda", torch.bfloat16))
    idx = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(7)).cuda()
    graphed = generate(e, idx, 24, cuda_graph=True)
    eager = generate(e, idx, 24, cuda_graph=False)
    assert torch.equal(graphed, eager)


@GPU
@pytest.mark.parametrize("policy", [DEFAULT, ALL_SPARSE], ids=["default", "all-sparse"])
def test_gpu_bf16_logits_within_1e_2_of_the_reference(policy):
    # The reference is the same checkpoint in fp32 (bf16 itself is ~1e-2 from it, whichever backend).
    # Rounding may tip a router logit near a tie, so the reference replays the masks the bf16 run took.
    m = wide_model("cuda", torch.bfloat16, std=0.08)
    idx = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(8)).cuda()

    def steps(f, masks=None):
        f.setup_caches(4, 72)
        out = []
        for i in range(5):  # a prefill, then four decode steps
            tokens, pos = (idx, torch.arange(64)) if i == 0 else (idx[:, i:i + 1], torch.tensor([63 + i]))
            out.append(f(tokens, input_pos=pos.cuda(), masks=masks))
        f.clear_caches()
        return torch.cat(out, 1)

    seen = {}
    with torch.no_grad():
        got = {"triton": steps(engine.Engine(m, policy), seen), "torch": steps(m)}
        ref_model = copy.deepcopy(m).float()
        L = len(m.layers)
        for i, l in enumerate(ref_model.layers):  # masks are recorded step-major, layer by layer
            l.attn_router = Replay(seen["attn"][i::L])
            l.ffn_router = Replay(seen["ffn"][i::L])
        ref = steps(ref_model)
    err, torch_err = rel_err(got["triton"], ref), rel_err(got["torch"], ref)
    assert err <= 1e-2, f"bf16 Triton logits rel err {err:.2e} vs fp32 (bf16 torch backend: {torch_err:.2e})"


@GPU
@pytest.mark.parametrize("routers", [True, False], ids=["wide", "dense-triton-linears"])
def test_gpu_pdl_changes_no_bit_of_a_graphed_decode(routers):
    # Programmatic dependent launch (kernels_base.pdl) lets a kernel start while the previous one drains; a
    # read that got ahead of its wait would change a result. Every kernel is deterministic, so the graphed
    # decode must give the same logits bit for bit with PDL and without, on shapes big enough that the
    # launches really overlap (hundreds of programs per kernel).
    import kernels_base
    if not kernels_base.pdl(torch.device("cuda")):
        pytest.skip("PDL needs compute capability >= 9")
    cfg = ModelConfig(vocab_size=512, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=4096,
                      max_seq_len=600)
    m = wide_model("cuda", torch.bfloat16, seed=3, routers=routers, std=0.05, cfg=cfg, ffn_group_size=128)
    idx = torch.randint(0, 512, (1, 500), generator=torch.Generator().manual_seed(4)).cuda()
    policy = Policy()

    def run():  # the prompt, then 40 graphed decode steps (greedy): every step's logits
        e = engine.Engine(m, policy)
        e.setup_caches(1, 560)
        with torch.no_grad():
            token = e(idx, input_pos=torch.arange(500, device="cuda"))[:, -1:].argmax(-1)
            pos = torch.tensor([500], device="cuda")
            graph, out = engine.CUDAGraphDecoder(e, token, pos), []
            for _ in range(40):
                out.append(graph(token, pos).clone())
                token, pos = out[-1].argmax(-1, keepdim=True), pos + 1
        e.clear_caches()
        return torch.stack(out)

    with kernels_base.pdl_off():
        off = run()
    on = run()
    assert torch.equal(on, off), f"PDL changed the logits: max diff {(on.float() - off.float()).abs().max():.3g}"


@GPU
@pytest.mark.parametrize("module", [False, True], ids=["norm_route's decision", "the router module"])
def test_gpu_the_side_streams_router_changes_no_bit_even_when_it_finishes_last(monkeypatch, module):
    # Policy.router_side_stream: a short chunk's router decision runs on a side stream beside the GEMMs, and the
    # layer waits for it where the mask is first read. Each decision first spins for ~1 ms on its stream, so a
    # read that did not wait would see an unwritten mask; eager chunks, a graphed later chunk and graphed decode
    # steps of 8 rows must give the logits of the same decision made in line, bit for bit.
    cfg = ModelConfig(vocab_size=512, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=4096,
                      max_seq_len=600)
    m = wide_model("cuda", torch.bfloat16, seed=5, std=0.05, cfg=cfg, ffn_group_size=128)
    idx = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(6)).cuda()
    route = engine.norm_route
    monkeypatch.setattr(engine, "norm_route", lambda *a, **k: (torch.cuda._sleep(2_000_000), route(*a, **k))[1])
    for layer in m.layers:
        for r in (layer.attn_router, layer.ffn_router):
            r.register_forward_pre_hook(lambda *_: torch.cuda._sleep(2_000_000))
    limit = 0 if module else 1 << 20  # Policy.router_max_tokens: past it, the module itself

    def run(policy):  # a first chunk, a later one, the later one again as a CUDA graph; decode steps
        e = engine.Engine(m, policy)
        kind = "norm_then_router" if module else "norm_route"
        assert e.step_plan(100, False, 200).layers[0]["ffn_norm"].kind == kind + "_side" * policy.router_side_stream
        e.setup_caches(1, 600)
        with torch.no_grad():
            graph = engine.CUDAGraphPrefill(e, 128, True, 600)  # (its capture writes K/V the chunks then rewrite)
            first = e(idx[:, :200], input_pos=torch.arange(200, device="cuda"))
            later = e(idx[:, 200:], input_pos=torch.arange(200, 300, device="cuda"))
            graphed = graph(idx[0, 200:].tolist(), 200).clone()
            e.clear_caches()
            e.setup_caches(8, 64)  # graphed decode steps of 8 rows: decode attention reads the mask
            e(rows, input_pos=torch.arange(40, device="cuda"))
            token, pos = rows[:, -1:], torch.full((8, 1), 40, device="cuda")
            step = engine.CUDAGraphDecoder(e, token, pos)
            decode = torch.stack([step(token, pos + i).clone() for i in range(3)])
        e.clear_caches()
        return first, later, graphed, decode

    rows = torch.randint(0, 512, (8, 40), generator=torch.Generator().manual_seed(7)).cuda()
    # 150: the first chunk (200 tokens) runs Q's tiles (K and V's GEMM beside the router), the later ones (100)
    # attention over every head, the pruned heads zeroed
    sizes = dict(router_max_tokens=limit, sparse_prefill_min_tokens=150, live_attention_min_tokens=150)
    inline, side = run(Policy(**sizes)), run(Policy(**sizes, router_side_stream=True))
    for what, a, b in zip(("first chunk", "later chunk", "graphed later chunk", "graphed decode"), inline, side):
        assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max():.3g}"

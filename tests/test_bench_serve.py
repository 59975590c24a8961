"""The serving benchmark's own rules (bench/serving.py): what its plot and table show, which workload the
flags resolve to, and the flags it refuses. The serving loop itself is specified in test_serve.py.

The plot and table are built from synthetic records (no model runs), so these tests are fast; one
--smoke run checks that --slots reaches the cache and the results file.
"""
import json
import math
import types

import pytest
import torch

import kernels_base
import serve
from bench import common, serving
from conftest import assert_one_line_error, stopped
from model import ModelConfig
from policy import Policy

INF = math.inf
PROFILES = [["dense", None, None], ["WIDE 50/50", 0.5, 0.5], ["WIDE 75/25", 0.75, 0.25]]


def row(rate, profile, tok_s, tpot_p99=20.0):
    return dict(rate=rate, profile=profile, skip=None if profile == "dense" else {"attn": 0.5, "ffn": 0.5},
                requests=64, rejected=0, output_tokens=20000, wall_s=10.0, output_tok_s=tok_s, ttft_p50_ms=100.0,
                ttft_p99_ms=400.0, tpot_p50_ms=10.0, tpot_p99_ms=tpot_p99, concurrency_max=64, concurrency_mean=30.5,
                decode_steps=500, prefill_ms_per_1k_tokens=29.3, decode_ms_per_step=8.64, in_phase_share=0.99)


def record(rates, quality=()):
    speed = {"dense": 1000.0, "WIDE 50/50": 1200.0, "WIDE 75/25": 1300.0}
    rows = [row(r, name, speed[name] * (1 + i), tpot_p99=10.0 + i) for name, _, _ in PROFILES
            for i, r in enumerate(rates)]
    return dict(gpu="NVIDIA H200", torch="2", triton="3", date="today", command="python -m bench.serving", smoke=False,
                rows=rows, model="llama-3.1-8b shape", workload="mixed: 64 requests", engine="engine.Engine",
                workload_name="mixed", slots=64, slot_len=8705, profiles=PROFILES, ffn_router_max_decode_rows=4,
                quality_file="results/quality_serving.json", quality=list(quality))


def plotted(rec):
    """Per panel, each Line2D as (label, xs, ys, joined): joined when a line is drawn between its points."""
    fig = serving.serving_figure(rec)
    panels = [[(l.get_label(), list(l.get_xdata()), list(l.get_ydata()), l.get_linestyle() not in ("None", "none", ""))
               for l in ax.get_lines()] for ax in fig.axes]
    ticks = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes]
    legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]
    import matplotlib.pyplot as plt
    plt.close(fig)
    return panels, ticks, legends


# ----------------------------------------------------------------------------------- the plot
def test_saturated_point_is_a_separate_marker_right_of_the_finite_rates_never_joined_to_them():
    panels, ticks, legends = plotted(record([2.0, 4.0, 8.0, INF]))
    assert len(panels) == 2  # (a) throughput, (b) p99 TPOT
    for lines, labels, legend in zip(panels, ticks, legends):
        joined = [l for l in lines if l[3]]
        markers = [l for l in lines if not l[3]]
        assert [l[1] for l in joined] == [[2.0, 4.0, 8.0]] * 3, "each profile's line joins its finite rates only"
        assert all(math.isfinite(x) for l in lines for x in l[1]), "an inf x cannot be drawn on a numeric axis"
        assert len(markers) == 3 and all(len(m[1]) == 1 and m[1][0] > 8.0 for m in markers)
        assert len({m[1][0] for m in markers}) == 1, "every profile's saturated marker sits at the same x"
        assert labels == ["2", "4", "8", "all at once"]
        assert legend == ["dense", "WIDE 50/50", "WIDE 75/25"]
    (a, b) = panels
    assert [m[2][0] for m in a if not m[3]] == [4000.0, 4800.0, 5200.0]  # the inf rows' tok/s (4th rate: x4)
    assert [l[2] for l in b if l[3]][0] == [10.0, 11.0, 12.0]             # p99 TPOT, not tok/s


def test_plot_of_a_saturated_only_run_has_the_markers_and_no_line():
    panels, ticks, legends = plotted(record([INF]))
    for lines, labels, legend in zip(panels, ticks, legends):
        assert lines and not any(l[3] for l in lines) and all(len(l[1]) == 1 for l in lines)
        assert labels == ["all at once"] and legend == ["dense", "WIDE 50/50", "WIDE 75/25"]


def test_plot_of_finite_rates_only_has_lines_and_no_saturated_tick():
    panels, ticks, legends = plotted(record([1.0, 3.0]))
    for lines, labels, legend in zip(panels, ticks, legends):
        assert all(l[3] for l in lines) and [l[1] for l in lines] == [[1.0, 3.0]] * 3
        assert labels == ["1", "3"] and legend == ["dense", "WIDE 50/50", "WIDE 75/25"]


def test_plot_file_is_written(tmp_path):
    serving.plot_serving(record([2.0, INF]), str(tmp_path / "serving.png"))
    assert (tmp_path / "serving.png").stat().st_size > 1000


# ----------------------------------------------------------------------------------- the table
def table(rec):
    lines = serving.serving_markdown(rec).splitlines()
    head = next(l for l in lines if l.startswith("| rate"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    body = [dict(zip(cols, (c.strip() for c in l.strip("|").split("|")))) for l in lines if l.startswith("| ")
            and not l.startswith("| rate")]
    return cols, body, "\n".join(lines)


@pytest.mark.parametrize("rates", [[2.0, 8.0, INF], [INF], [4.0]], ids=["both", "inf-only", "finite-only"])
def test_table_has_every_profile_at_every_rate_with_its_ratio_latencies_and_phase_times(rates):
    cols, body, text = table(record(rates))
    for c in ("output tok/s", "vs dense", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "concurrency max / mean",
              "prefill ms per 1k tokens", "decode ms per step", "ppl / dense"):
        assert c in cols, c
    assert len(body) == 3 * len(rates)
    labels = [serving.rate_label(r) for r in rates]
    assert [b["rate (req/s)"] for b in body] == [l for l in labels for _ in range(3)], "grouped by rate"
    assert [b["vs dense"] for b in body[:3]] == ["1.00x", "1.20x", "1.30x"]
    assert all(b["concurrency max / mean"] == "64 / 30.5" and b["decode ms per step"] == "8.64" for b in body)
    assert all(b["ppl / dense"] == "-" for b in body)  # no quality rows: no number is made up
    assert text.splitlines()[0].endswith("the mixed workload, 64 slots")  # the run's slots, in the header


def test_table_shows_the_perplexity_ratio_of_each_matching_quality_row_labelled_by_its_rule():
    quality = [{"profile": "75/25", "attn": 0.75, "ffn": 0.25, "ffn_rule": "per token", "ppl_vs_dense": 1.252},
               {"profile": "75/25", "attn": 0.7500001, "ffn": 0.25, "ffn_rule": "dense at decode", "ppl_vs_dense": 1.1}]
    cols, body, text = table(record([INF], quality))
    ppl = {b["profile"]: b["ppl / dense"] for b in body}
    assert ppl == {"dense": "-", "WIDE 50/50": "-", "WIDE 75/25": "1.252 (per token) / 1.100 (dense at decode)"}
    assert "dense at decode" in text.split("| rate")[0] and "more than 4 rows" in text  # the header says the rule


def test_quality_file_rows_are_matched_to_the_run_profiles_on_three_decimals(tmp_path):
    path = tmp_path / "quality_serving.json"
    rows = [{"attn": 0.5, "ffn": 0.5, "ppl_vs_dense": 1.2}, {"attn": 0.8, "ffn": 0.25, "ppl_vs_dense": 1.4},
            {"attn": 0.7504, "ffn": 0.25, "ppl_vs_dense": 1.3}, {"attn": 0.75, "ffn": 0.25}]  # last: no ratio
    path.write_text(json.dumps({"rows": rows}))
    profiles = [tuple(p) for p in PROFILES]
    assert serving.load_quality(str(path), profiles) == [rows[0], rows[2]]
    path.write_text(json.dumps(rows))  # a bare list of rows reads the same
    assert serving.load_quality(str(path), profiles) == [rows[0], rows[2]]
    assert serving.load_quality(str(tmp_path / "absent.json"), profiles) == []


# ----------------------------------------------------------------------------------- the workloads
def resolved(monkeypatch, *flags):
    """(workload, args) that main would run with, on any machine: the device check and the run stubbed."""
    monkeypatch.setattr(common, "need_device", lambda *a: None)
    monkeypatch.setattr(serving, "run_bench", lambda w, args, argv: (w, args))
    return serving.main(list(flags))


@pytest.mark.parametrize("flags, prompt, slots, requests, rates, out", [
    ((), (512, 8192), 64, 64, (2.0, 4.0, 8.0, INF), "results/serving_h200_mixed"),
    (("--workload", "mixed"), (512, 8192), 64, 64, (2.0, 4.0, 8.0, INF), "results/serving_h200_mixed"),
    (("--workload", "8k"), (8192, 8192), 64, 64, (2.0, 4.0, 8.0, INF), "results/serving_h200_8k"),
    (("--workload", "long"), (16384, 32768), 16, 32, (0.5, INF), "results/serving_h200_long"),
])
def test_each_workload_resolves_to_its_prompts_slots_and_results_file(monkeypatch, flags, prompt, slots, requests,
                                                                      rates, out):
    w, args = resolved(monkeypatch, *flags)
    assert (w.prompt, w.n_slots, w.requests, w.rates, args.out) == (prompt, slots, requests, rates, out)
    assert w.output == (128, 512) and [p[0] for p in w.profiles] == ["dense", "WIDE 50/50", "WIDE 75/25"]


def test_explicit_flags_override_the_workload(monkeypatch):
    w, args = resolved(monkeypatch, "--workload", "long", "--prompt", "1000,2000", "--slots", "8", "--requests",
                       "5", "--rates", "inf", "--out", "elsewhere/x", "--profiles", "0.5/0.5,0.875/0.25")
    assert (w.name, w.prompt, w.n_slots, w.requests, w.rates, args.out) == ("long", (1000, 2000), 8, 5, (INF,),
                                                                            "elsewhere/x")
    assert w.profiles == (("dense", None, None), ("WIDE 50/50", 0.5, 0.5), ("WIDE 87.5/25", 0.875, 0.25))


def test_long_workload_cache_fits_the_h200_next_to_the_8b_weights():
    cfg = ModelConfig.from_name("llama-3.1-8b")
    per_position = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    assert per_position == 128 * 1024
    for name in serving.WORKLOADS:
        w = serving.Workload(name=name, **serving.WORKLOADS[name])
        slot_len = w.prompt[1] + w.output[1] + 1
        assert serving.cache_bytes(cfg, w.n_slots, slot_len, 2) + 16e9 < 0.8 * 141e9, name
    # and 64 slots of the long workload's length would not: that is why it has 16
    assert serving.cache_bytes(cfg, 64, 32768 + 512 + 1, 2) > 141e9


# ----------------------------------------------------------------------------------- refused flags
@pytest.mark.parametrize("flags, words", [
    (("--slots", "0"), ("--slots",)),
    (("--slots", "1.5"), ("--slots", "whole number")),
    (("--slots", "100000"), ("--slots",)),
    (("--workload", "32k"), ("--workload", "long")),
    (("--profiles", "0.5/1.0"), ("--profiles", "[0, 1)")),
    (("--profiles", "0.5"), ("--profiles", "ATTN/FFN")),
    (("--profiles", "0.5/0.5,0.5/0.5"), ("--profiles", "twice")),
    (("--profiles", "0.5/nan"), ("--profiles", "finite")),
    (("--prompt", "8192,200000"), ("--prompt", "131072")),
    (("--output", "1,999999"), ("--output", "131072")),
    (("--prompt", "65536,65536", "--output", "65536,65536"), ("--prompt/--output", "131072")),  # no room for + 1
])
def test_bad_flags_are_refused_in_one_line_before_the_device_check(capsys, monkeypatch, flags, words):
    monkeypatch.setattr(common, "prepare", lambda *a: pytest.fail("the flags were not checked first"))
    for smoke in ((), ("--smoke",)):
        assert_one_line_error(stopped(capsys, serving.main, *smoke, *flags), *words)


# ----------------------------------------------------------------------------------- a run
@pytest.mark.skipif(not kernels_base.INTERPRET, reason="--smoke runs the kernels in the Triton interpreter (the CPU test "
                    "setup); on a GPU `python -m bench.serving` is the real run")
def test_smoke_run_serves_through_the_slots_asked_for_and_records_them(tmp_path):
    rec = serving.main(["--smoke", "--slots", "1", "--rates", "inf", "--output", "2,2", "--profiles", "0.5/0.5",
                        "--policy", "router_side_stream=true", "--out", str(tmp_path / "serving")])
    assert [r["profile"] for r in rec["rows"]] == ["dense", "WIDE 50/50"]
    seen = [(r["concurrency_max"], r["rejected"]) for r in rec["rows"]]
    assert seen == [(1, 0), (1, 0)], f"(concurrency max, rejected) per profile: {seen}"  # one slot: one at a time
    saved = json.load(open(tmp_path / "serving.json"))
    assert saved["slots"] == 1 and saved["slot_len"] == 16 + 2 + 1 and saved["workload_name"] == "mixed"
    assert saved["policy"] == repr(Policy(router_side_stream=True)), "the engine's policy, as --policy gave it"
    assert "1 slots of 19 positions" in open(tmp_path / "serving.md").read()
    assert (tmp_path / "serving.png").stat().st_size > 1000


@pytest.mark.skipif(not kernels_base.INTERPRET, reason="--smoke runs the kernels in the Triton interpreter (the CPU test "
                    "setup); on a GPU `python -m bench.serving --http` is the real run")
def test_smoke_run_through_the_http_front_serves_the_same_tokens_as_the_loop(tmp_path, monkeypatch):
    def in_this_process(*args):
        raise AssertionError("the clients ran in the server's interpreter")
    monkeypatch.setattr(serving, "stream_all", in_this_process)  # a spawned client process imports its own
    rec = serving.main(["--smoke", "--slots", "2", "--rates", "inf", "--output", "3,3", "--profiles", "0.5/0.5",
                        "--requests", "2", "--http", "--out", str(tmp_path / "serving")])
    assert [r["profile"] for r in rec["rows"]] == ["dense", "dense, HTTP front", "WIDE 50/50",
                                                   "WIDE 50/50, HTTP front"]
    for loop, front in zip(rec["rows"][::2], rec["rows"][1::2]):
        assert front["rejected"] == 0 and front["output_tokens"] == loop["output_tokens"] == 3 * loop["requests"]
    md = (tmp_path / "serving.md").read_text()
    assert "Through the HTTP front (streaming clients), WIDE 50/50 at all at once:" in md


def test_redraw_rewrites_the_tables_from_the_json_with_todays_quality_file(tmp_path, monkeypatch):
    rec = record([INF])
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(rec))
    quality = tmp_path / "quality_serving.json"
    quality.write_text(json.dumps([{"profile": "50/50", "attn": 0.5, "ffn": 0.5, "ffn_rule": "per token",
                                    "ppl_vs_dense": 1.155}]))
    monkeypatch.setattr(serving, "QUALITY", str(quality))
    serving.main(["--redraw", str(path)])
    md = (tmp_path / "serving.md").read_text()
    assert "1.155 (per token)" in md and (tmp_path / "serving.png").exists()
    assert json.loads(path.read_text())["rows"] == rec["rows"]  # the measurements themselves untouched
    with pytest.raises(SystemExit):
        serving.main(["--redraw", str(tmp_path / "absent.json")])


def test_runs_are_each_compared_with_their_own_dense_and_their_spread_reported():
    rec = record([INF])
    second = [dict(r, run=2, output_tok_s=r["output_tok_s"] * (2.0 if r["profile"] == "dense" else 1.0))
              for r in rec["rows"]]
    rec["rows"] = [dict(r, run=1) for r in rec["rows"]] + second[::-1]  # run 2 served the profiles in reverse
    md = serving.serving_markdown(rec)
    assert "| all at once | 1 | WIDE 50/50 | 1200.0 | 1.20x |" in md
    assert "| all at once | 2 | WIDE 50/50 | 1200.0 | 0.60x |" in md, "run 2's WIDE against run 2's dense"
    assert "WIDE 50/50 at all at once, vs dense over 2 runs: 0.60x - 1.20x" in md
    panels, _, legends = plotted(rec)
    assert "WIDE 50/50, run 2" in legends[0] and len(panels[0]) == 6  # a marker per profile and run


def test_first_requests_ttft_is_reported_apart_from_the_rest():
    reqs = [serve.Request([1], 2, arrival=i) for i in range(20)]
    for i, r in enumerate(reqs):
        r.tokens, r.t_first, r.t_done = [1, 2], r.arrival + (0.5 if i < 16 else 0.1), r.arrival + 1.0
    server = types.SimpleNamespace(busy=[1], steps=1, marks=[], device=torch.device("cpu"))
    got = serving.summarize(reqs, server, 10.0)
    assert got["ttft_first16_p50_ms"] == pytest.approx(500.0) and got["ttft_rest_p50_ms"] == pytest.approx(100.0)


def test_first_requests_ttft_per_prompt_token_tells_a_longer_prompt_from_a_one_time_cost():
    # the first 16 prompts are 5x longer and take 5x longer to their first token: no one-time cost at all
    reqs = [serve.Request([1] * (500 if i < 16 else 100), 2, arrival=i) for i in range(20)]
    for i, r in enumerate(reqs):
        r.tokens, r.t_first, r.t_done = [1, 2], r.arrival + (0.5 if i < 16 else 0.1), r.arrival + 1.0
    server = types.SimpleNamespace(busy=[1], steps=1, marks=[], device=torch.device("cpu"))
    got = serving.summarize(reqs, server, 10.0)
    assert got["ttft_first16_p50_ms"] == pytest.approx(5 * got["ttft_rest_p50_ms"])
    assert got["ttft_first16_p50_ms_per_1k"] == pytest.approx(got["ttft_rest_p50_ms_per_1k"]) == pytest.approx(1000.0)
    rec = record([4.0])
    rec["rows"][0].update({k: got[k] for k in got if k.startswith("ttft_")})
    assert "| 500 / 100 (1.00x per prompt token) |" in serving.serving_markdown(rec)

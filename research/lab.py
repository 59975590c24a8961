"""What the kernel labs share (gate_up_lab, ffn_flow_lab): a sweep's rows and their command line."""
import argparse
import os

import torch

import cli
from bench.common import graph_ms, meta, save


def lab_main(argv, doc, name, on_cpu, sweep, markdown):
    """python -m research.<name>: on a GPU, sweep() -> rows -> results/<name>_<gpu>.{json,md} (markdown(meta, rows));
    under TRITON_INTERPRET=1, on_cpu() (the lab kernel against its twin, no timing); else one line and a non-zero
    exit."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpreted and not torch.cuda.is_available():
        raise cli.UserError(f"research.{name} times kernels on a CUDA GPU; on a CPU run it with TRITON_INTERPRET=1 "
                            "(the lab kernel against its twin, no timing)")
    if interpreted:
        return on_cpu()
    rows = sweep()
    m = meta(False, f"-m research.{name}", argv or [])
    md = markdown(m, rows)
    save(f"results/{name}_{'h200' if 'H200' in m['gpu'] else 'h100'}", dict(meta=m, rows=rows), md)
    print(md)


def lab_row(keys, name, measure):
    """One row of a lab's sweep: keys, the kernel's name and measure()'s numbers, or the error of a variant that
    does not fit (the next may), printed as it comes."""
    try:
        row = dict(keys, kernel=name, **measure())
    except Exception as e:  # noqa: BLE001
        row = dict(keys, kernel=name, err=f"{type(e).__name__}: {str(e)[:200]}")
    print(row, flush=True)
    return row


def cells(row, *formats):
    """A row's table cells: its numbers as formatted ({field: format}), or its error and blanks."""
    if "err" in row:
        return ["failed: " + row["err"][:80]] + [""] * (len(formats) - 1)
    return [format(row[k], f) for k, f in formats]


def graph_rows(keys, timed, probs):
    """One problem's rows: each (name, check or None, call, live bytes) in timed is checked (against its twin), then
    timed as a CUDA-graph replay of call(p) for every copy p in probs (L2 defeated), us per call and TB/s."""
    def measure(check, fn, nbytes):
        if check is not None:
            check()
        us = graph_ms(False, [lambda p=p: fn(p) for p in probs]) * 1e3
        return dict(us=us, tb_s=nbytes / us / 1e6)
    return [lab_row(keys, name, lambda c=c, fn=fn, nb=nb: measure(c, fn, nb)) for name, c, fn, nb in timed]


def graph_table(m, title, text, keys, bytes_name, rows):
    """graph_rows' rows as markdown: the title, the run's versions and command, text, then one line per row: its keys
    (header, row -> cell), the kernel, us and TB/s of bytes_name."""
    head = [h for h, _ in keys] + ["kernel", "us", f"TB/s of {bytes_name}"]
    lines = [f"# {title}, lab, on {m['gpu']}", "", f"torch {m['torch']}, triton {m['triton']}, {m['date']}, "
             f"`{m['command']}`. {text}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([cell(r) for _, cell in keys] + [r["kernel"]]
                                + cells(r, ("us", ".1f"), ("tb_s", ".2f"))) + " |" for r in rows]
    return "\n".join(lines) + "\n"

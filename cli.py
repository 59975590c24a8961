"""
What every script shares at its command line: one way to leave with an error, flags that are checked
as they are parsed, and the --device rule.

A user's mistake (a flag out of range, a missing checkpoint, CUDA asked for where there is none, an output
directory that cannot be written) ends in one line on stderr naming the problem and the fix, and a
non-zero exit; never a traceback:
  * `Parser` is argparse whose errors are one line (exit code 2);
  * `fail(message)` leaves from anywhere with "error: message" (exit code 1);
  * `UserError` is what the project's modules raise for such a mistake (model.CheckpointError is one);
    `run(main)`, how a script's `__main__` calls its main, turns it into the same one line. Any other
    exception is a bug and keeps its traceback.
The `integer` / `real` / `fraction` types check numeric flags when argparse reads them, and
`writable_dir` checks an output directory before any work starts.
"""
import argparse
import math
import os
import tempfile

import torch


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (and exit code 2), not the whole usage text.
    Subcommand parsers (add_subparsers) are made of the same class, so they answer the same way."""

    def error(self, message):
        self.exit(2, f"error: {message} (see python {self.prog} --help)\n")


def parser(doc, prog=None):
    """The parser of a script whose module docstring is its --help text. prog: how the script is started
    when that is not `python FILE` (the benchmarks' "-m bench.ops")."""
    return Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def fail(message):
    """Leave the script with one line, "error: <message>", and exit code 1."""
    raise SystemExit(f"error: {message}")


class UserError(ValueError):
    """A mistake in what the user gave (a flag, a path, a checkpoint, a model the kernels cannot run); its
    message says what is wrong and what to do. A ValueError, so library callers may treat it as one."""


def run(main, *args):
    """Call a script's main; a UserError that reaches here leaves as one line, anything else with its
    traceback (a bug must show where it happened)."""
    try:
        return main(*args)
    except UserError as e:
        fail(e)


def writable_dir(path, flag):
    """Leave with one line unless files can be written in directory `path` (made if it is missing). Called
    before any work starts, so a run never trains or measures for minutes and then fails to save."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        fail(f"{flag} {path}: cannot write there ({e.strerror or e}); give a directory you can write to")


# ---------------------------------------------------------------------------------------------------
# numeric flags, checked as they are parsed: type=integer(1), type=real(0, None), type=fraction()
def integer(lo=None, hi=None):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is outside {_range(lo, hi)}")
        return v
    parse.__name__ = "integer"  # what argparse names in "invalid integer value"
    return parse


def real(lo=None, hi=None, lo_open=False, hi_open=False):
    """A finite float in [lo, hi] (open at an end where lo_open / hi_open)."""
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number")
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if (lo is not None and (v < lo or (lo_open and v == lo))) or \
                (hi is not None and (v > hi or (hi_open and v == hi))):
            raise argparse.ArgumentTypeError(f"{v:g} is outside {_range(lo, hi, lo_open, hi_open)}")
        return v
    parse.__name__ = "number"
    return parse


def fraction():
    """A sparsity: a share of the groups skipped, in [0, 1)."""
    return real(0.0, 1.0, hi_open=True)


SEED = integer(0, 2 ** 63 - 1)  # what torch.manual_seed takes


def _range(lo, hi, lo_open=False, hi_open=False):
    lo, hi = (v if v is None or isinstance(v, int) else f"{v:g}" for v in (lo, hi))
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {hi}"
    return f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def pick_device(name):
    """--device auto | cpu | cuda | cuda:N -> the device to run on; CUDA asked for where there is none
    (or a name that is no device) leaves with one line."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        fail(f"unknown --device {name!r}; use auto, cpu or cuda")
    if name != "cpu" and not torch.cuda.is_available():
        fail(f"--device {name} was asked for but no CUDA GPU is visible; use --device cpu")
    return name


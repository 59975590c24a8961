"""The shape of the code base: files import downward only, no file reaches into another's private
names, the reference model never touches Triton, the serving loop imports no benchmark, every entry
point is a short main, and every file stays readable in one sitting.

These read the source (ast), so they run in milliseconds and fail on the line that breaks a rule.
"""
import ast
import os

import pytest

from conftest import ROOT

FILES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
SCRIPTS = [f for f in FILES if 'if __name__ == "__main__":' in open(os.path.join(ROOT, f + ".py")).read()]
BENCHMARKS = [f for f in FILES if f.startswith("bench_") or f == "mask_union"]


def tree(name):
    with open(os.path.join(ROOT, name + ".py")) as f:
        return ast.parse(f.read())


def imports(name):
    """The project files `name` imports (at any depth of the file: top level or inside a function)."""
    found = set()
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(FILES) - {name}


def test_the_project_files_import_each_other_without_a_cycle():
    graph = {f: imports(f) for f in FILES}
    done, path = set(), []

    def visit(f):
        if f in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(f):] + [f]))
        if f in done:
            return
        path.append(f)
        for g in sorted(graph[f]):
            visit(g)
        path.pop()
        done.add(f)
    for f in FILES:
        visit(f)


def test_no_file_imports_another_files_private_names():
    for f in FILES:
        for node in ast.walk(tree(f)):
            if isinstance(node, ast.ImportFrom) and node.module in FILES:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{f}.py imports {private} from {node.module}.py"
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in FILES
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                assert node.attr.endswith("_kernel"), f"{f}.py:{node.lineno} uses {node.value.id}.{node.attr}"


def test_only_benchmarks_import_benchmarks_and_no_file_imports_the_serving_loop_or_a_top_script():
    for f in FILES:
        if f not in BENCHMARKS:
            assert not imports(f) & set(BENCHMARKS), f"{f}.py imports {imports(f) & set(BENCHMARKS)}"
    for f in FILES:  # scripts a user runs at the top: nothing builds on them (serve: its benchmark only)
        for top in ("train", "eval", "bench_e2e", "bench_serve", "bench_tune"):
            assert top not in imports(f), f"{f}.py imports {top}.py"
        assert "serve" not in imports(f) or f == "bench_serve", f"{f}.py imports serve.py"


def test_the_reference_model_and_the_method_never_import_triton():
    for f in ("model", "wide", "dial", "checkpoints", "data", "baselines"):
        modules = {a.name.split(".")[0] for node in ast.walk(tree(f)) if isinstance(node, ast.Import) for a in node.names}
        modules |= {node.module.split(".")[0] for node in ast.walk(tree(f))
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert not modules & {"triton", "engine", "policy"} and not any(m.startswith("kernels") for m in modules), \
            f"{f}.py reaches Triton: {sorted(modules)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_entry_point_is_a_short_main_that_leaves_through_cli(script):
    mains = [n for n in tree(script).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert mains, f"{script}.py has no main()"
    length = mains[0].end_lineno - mains[0].lineno + 1
    assert length <= 80, f"{script}.main is {length} lines"
    source = open(os.path.join(ROOT, script + ".py")).read()
    assert "cli.run(main" in source, f"{script}.py's __main__ does not call cli.run(main)"
    assert "sys.exit(" not in source and 'SystemExit(f"error' not in source, f"{script}.py leaves another way"


@pytest.mark.parametrize("name", FILES)
def test_every_file_is_readable_in_one_sitting(name):
    with open(os.path.join(ROOT, name + ".py")) as f:
        n = sum(1 for _ in f)
    assert n <= 600, f"{name}.py has {n} lines"


def test_no_script_reads_a_numeric_flag_with_a_bare_int_or_float():
    # cli.integer / cli.real / cli.fraction refuse "-3", "nan" or "1.5" in one line; a bare int or float
    # lets an out-of-range value through to a traceback (or a silent nonsense run) later on.
    for f in SCRIPTS + ["bench_common"]:
        for node in ast.walk(tree(f)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for kw in node.keywords:
                    bare = kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float")
                    assert not bare, f"{f}.py:{node.lineno} reads a flag with type={kw.value.id}"

"""The shape of the code base: the lesson flat at the root, the lab in folders (bench/, research/) that
the root never imports; files import downward only, no script imports another script, every name is
imported from the file that defines it, the reference model never touches Triton, every entry point is
a short main, and every file stays readable in one sitting.

These read the source (ast), so they run in milliseconds and fail on the line that breaks a rule.
"""
import ast
import functools
import os

import pytest

from conftest import ROOT

FOLDERS = ("bench", "research")  # the lab: benchmarks, tools that explain results


def module_names():
    """Every project module by its import name: "engine" at the root, "bench.e2e" in a folder."""
    names = [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")]
    for folder in FOLDERS:
        names += [f"{folder}.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, folder))
                  if f.endswith(".py") and f != "__init__.py"]
    return sorted(names)


def path(name):
    """The file of a module, from the repository root: "bench/e2e.py"."""
    return os.path.join(*name.split(".")) + ".py"


def source(name):
    with open(os.path.join(ROOT, path(name))) as f:
        return f.read()


MODULES = module_names()
ROOT_MODULES = [m for m in MODULES if "." not in m]
SCRIPTS = [m for m in MODULES if 'if __name__ == "__main__":' in source(m)]


@functools.lru_cache(maxsize=None)
def tree(name):
    return ast.parse(source(name))


def imported(name):
    """{project module: the names taken from it} for every import in `name` (at any depth of the file:
    top level or inside a function); a plain `import m` takes no names."""
    found = {}
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.setdefault(a.name, set())
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in FOLDERS:  # from bench import common: the module bench.common
                for a in node.names:
                    found.setdefault(f"{node.module}.{a.name}", set())
            else:
                found.setdefault(node.module, set()).update(a.name for a in node.names)
    return {m: names for m, names in found.items() if m in MODULES and m != name}


def imports(name):
    return set(imported(name))


def defined(name):
    """The names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in tree(name).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_the_root_holds_the_lesson_and_the_lab_sits_in_folders():
    assert len(ROOT_MODULES) <= 20, f"{len(ROOT_MODULES)} .py files at the root: {ROOT_MODULES}"
    for card in ("wide", "model", "train", "kernels", "generate"):
        assert card in ROOT_MODULES, f"{card}.py belongs at the root"
    assert not [m for m in ROOT_MODULES if m.startswith("bench")], "benchmarks live in bench/"


def test_root_modules_never_import_from_the_folders():
    for m in ROOT_MODULES:
        lab = {i for i in imports(m) if "." in i}
        assert not lab, f"{m}.py imports {sorted(lab)}"
        folders = {node.module for node in ast.walk(tree(m)) if isinstance(node, ast.ImportFrom)} & set(FOLDERS)
        assert not folders, f"{m}.py imports from {sorted(folders)}/"


def test_the_project_files_import_each_other_without_a_cycle():
    graph = {m: imports(m) for m in MODULES}
    done, trail = set(), []

    def visit(m):
        if m in trail:
            pytest.fail("import cycle: " + " -> ".join(trail[trail.index(m):] + [m]))
        if m in done:
            return
        trail.append(m)
        for n in sorted(graph[m]):
            visit(n)
        trail.pop()
        done.add(m)
    for m in MODULES:
        visit(m)


def test_no_script_imports_another_script():
    # generate.py's generate() is the one generation loop: the end-to-end benchmark runs a trained model
    # through it as a user's generation runs, so it may take that one name from the script; likewise the
    # serving benchmark drives serve.py's loop (Request, Server) as the HTTP front does; the in-step tune times
    # a decode step exactly as the end-to-end benchmark does (its model setup and its timing); the SASS reader
    # builds the gate+up lab's kernel beside the engine's tile that follows it.
    allowed = {("bench.e2e", "generate"): {"generate"}, ("research.sass", "research.gate_up_lab"): {"lab_gate_up"},
               ("bench.serving", "serve"): {"Request", "Server", "Loop", "make_app"},
               ("bench.tune", "bench.e2e"): {"E2ESetup", "smoke_run", "time_decode"}}
    for m in MODULES:
        for script, names in imported(m).items():
            if script in SCRIPTS:
                assert names and names <= allowed.get((m, script), set()), \
                    f"{path(m)} imports the script {script} ({sorted(names) or 'the module'})"


def test_every_name_is_imported_from_the_file_that_defines_it():
    # no re-exports: a name has one import path, its owner's (`from engine import Policy` and
    # `engine.Policy` both fail while Policy lives in policy.py)
    for m in MODULES:
        for owner, names in imported(m).items():
            foreign = names - defined(owner)
            assert not foreign, f"{path(m)} imports {sorted(foreign)} from {owner}, which does not define them"
        plain = {a.name for node in ast.walk(tree(m)) if isinstance(node, ast.Import) for a in node.names} & set(MODULES)
        for node in ast.walk(tree(m)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in plain:
                assert node.attr in defined(node.value.id) or node.attr.startswith("__"), \
                    f"{path(m)}:{node.lineno} uses {node.value.id}.{node.attr}, which {node.value.id}.py does not define"


def test_no_file_imports_another_files_private_names():
    for m in MODULES:
        for owner, names in imported(m).items():
            private = sorted(n for n in names if n.startswith("_"))
            assert not private, f"{path(m)} imports {private} from {owner}"
        for node in ast.walk(tree(m)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in MODULES
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                assert node.attr.endswith("_kernel"), f"{path(m)}:{node.lineno} uses {node.value.id}.{node.attr}"


def test_only_the_serving_benchmark_imports_the_serving_loop():
    for m in MODULES:
        assert "serve" not in imports(m) or m == "bench.serving", f"{path(m)} imports serve.py"


def test_the_reference_model_and_the_method_never_import_triton():
    for m in ("model", "wide", "dial", "checkpoints", "data", "baselines"):
        modules = {a.name.split(".")[0] for node in ast.walk(tree(m)) if isinstance(node, ast.Import) for a in node.names}
        modules |= {node.module.split(".")[0] for node in ast.walk(tree(m))
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert not modules & {"triton", "engine", "policy"} and not any(n.startswith("kernels") for n in modules), \
            f"{m}.py reaches Triton: {sorted(modules)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_entry_point_is_a_short_main_that_leaves_through_cli(script):
    mains = [n for n in tree(script).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert mains, f"{path(script)} has no main()"
    length = mains[0].end_lineno - mains[0].lineno + 1
    assert length <= 80, f"{script}.main is {length} lines"
    text = source(script)
    assert "cli.run(main" in text, f"{path(script)}'s __main__ does not call cli.run(main)"
    assert "sys.exit(" not in text and 'SystemExit(f"error' not in text, f"{path(script)} leaves another way"


@pytest.mark.parametrize("name", MODULES + [f"tests.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "tests"))
                                            if f.endswith(".py")])
def test_every_file_is_readable_in_one_sitting(name):
    with open(os.path.join(ROOT, path(name))) as f:
        n = sum(1 for _ in f)
    assert n <= 600, f"{path(name)} has {n} lines"


def test_no_script_reads_a_numeric_flag_with_a_bare_int_or_float():
    # cli.integer / cli.real / cli.fraction refuse "-3", "nan" or "1.5" in one line; a bare int or float
    # lets an out-of-range value through to a traceback (or a silent nonsense run) later on.
    for m in SCRIPTS + ["bench.common"]:
        for node in ast.walk(tree(m)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for kw in node.keywords:
                    bare = kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float")
                    assert not bare, f"{path(m)}:{node.lineno} reads a flag with type={kw.value.id}"

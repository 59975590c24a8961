"""The PDL rule, read from the kernels' source: under programmatic dependent launch a kernel may start
while the one before it still runs, so before its wait (kernels_base.prior_done) it may store nothing and load
only what no running kernel writes. The interpreter runs no PDL and a GPU shows such a race only now and
then, so the rule is checked on the code itself, for every binary a kernel's constexpr flags select.
(test_skipped_work checks decode attention's loads before its wait as they run; test_kernels runs it after
the launch that writes what it must wait for.)"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pdl_kernels():
    """(file, kernel name, body) of every @triton.jit function in the kernel files that takes PDL."""
    import ast
    found = []
    for name in ("kernels.py", "kernels_gemv.py", "kernels_attention.py", "kernels_layout.py", "kernels_step.py"):
        tree = ast.parse(open(os.path.join(ROOT, name)).read())
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and "PDL" in [a.arg for a in fn.args.args] and fn.name != "prior_done":
                found.append((name, fn.name, fn))
    return found


# What a kernel may read before its wait: weights, which no kernel of a step writes (the router's, the norm's),
# and gemm_k's live list, which norm_route wrote two or more launches before (see _gemm_k_kernel: PREFETCH).
READ_BEFORE_WAIT = {"_norm_route_kernel": {"wd", "bd", "wu", "bu", "nw"}, "_gemm_k_kernel": {"w", "swn", "live"},
                    "_gemv_mn_kernel": {"rw", "rb"}, "_norm_route_part_kernel": {"wd"}}


def specializations(fn):
    """fn's body once per setting of the constexpr flags its top-level `if`s test (`if PREFETCH:`, `if FLAG == 0:`),
    each such `if` replaced by the branch Triton compiles for that setting: [(setting, statements)]."""
    import ast
    import itertools
    flag = lambda test: next((n.id for n in ast.walk(test) if isinstance(n, ast.Name)), None)
    constexprs = {a.arg for a in fn.args.args if "constexpr" in ast.unparse(a.annotation or ast.Constant(""))}
    flags = sorted({flag(s.test) for s in fn.body if isinstance(s, ast.If) and flag(s.test) in constexprs
                    and {n.id for n in ast.walk(s.test) if isinstance(n, ast.Name)} == {flag(s.test)}})
    out = []
    for values in itertools.product((0, 1), repeat=len(flags)):
        env = dict(zip(flags, values))
        body = []
        for s in fn.body:
            if isinstance(s, ast.If) and flag(s.test) in env and {n.id for n in ast.walk(s.test)
                                                                 if isinstance(n, ast.Name)} == {flag(s.test)}:
                body += s.body if eval(ast.unparse(s.test), {}, env) else s.orelse
            else:
                body.append(s)
        out.append((env, body))
    return out


def test_every_kernel_that_takes_pdl_waits_before_its_first_load_or_store():
    # Under PDL a kernel may start while the one before it still runs (kernels_base.prior_done): a load of
    # what that kernel writes, or any store, before the wait is a race that the interpreter never shows (it
    # runs no PDL) and a GPU shows only now and then. So the rule is kept by construction, in every binary a
    # kernel's constexpr flags select: prior_done(PDL) is a top-level statement (so on every path), and before
    # it the kernel stores nothing, calls no helper, and loads only from what READ_BEFORE_WAIT names for it.
    import ast
    kernels_with_pdl = pdl_kernels()
    assert {"_gemv_mn_kernel", "_gemm_k_kernel", "_attn_decode_kernel", "_norm_route_kernel",
            "_norm_route_part_kernel", "_norm_route_finish_kernel"} <= \
        {k for _, k, _ in kernels_with_pdl}, "the decode kernels and a prefill chunk's norm + router take PDL"
    harmless = {"arange", "program_id", "num_programs", "zeros", "full", "cdiv", "minimum", "maximum", "where",
                "sum", "max", "cumsum", "static_range"}
    checked = 0
    for file, kernel, fn in kernels_with_pdl:
        params = {a.arg for a in fn.args.args}
        for setting, body in specializations(fn):
            where = f"{file}: {kernel}" + (f" {setting}" if setting else "")
            waits = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                     and getattr(s.value.func, "id", None) == "prior_done"
                     and [getattr(a, "id", None) for a in s.value.args] == ["PDL"]]
            assert waits, f"{where} takes PDL but never calls prior_done(PDL) at its top level"
            allowed = READ_BEFORE_WAIT.get(kernel, set())
            formed = {}  # a local name before the wait -> the parameters its value is formed from
            names = lambda node: set().union(*[formed.get(n.id, {n.id}) for n in ast.walk(node)
                                               if isinstance(n, ast.Name)])
            for stmt in body[:waits[0]]:
                for a in (n for n in ast.walk(stmt) if isinstance(n, ast.Assign)):
                    pairs = zip(a.targets[0].elts, a.value.elts) if isinstance(a.targets[0], ast.Tuple) \
                        and isinstance(a.value, ast.Tuple) else [(a.targets[0], a.value)]
                    formed.update({t.id: names(v) for t, v in pairs if isinstance(t, ast.Name)})
                for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                    name = getattr(call.func, "attr", None) or getattr(call.func, "id", None)
                    if name in ("load", "router_second_linear"):
                        # the pointer arguments the address is formed from (upper-case ones are sizes); the router's
                        # second Linear (kernels_base) loads from its first two arguments
                        read = set().union(*[names(a) for a in call.args[:1 if name == "load" else 2]]) & params
                        assert read and all(n in allowed or n.isupper() for n in read), \
                            f"{where} loads from {sorted(read)} before prior_done(PDL)"
                    else:
                        assert name in harmless or name in ("to",), f"{where} calls {name} before prior_done(PDL)"
            checked += 1
    assert checked > len(kernels_with_pdl), "gemm_k's PREFETCH gives it two binaries to check"

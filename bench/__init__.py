"""The GPU benchmarks (the lab): each writes its tables under results/ and runs from the repository root as
`python -m bench.NAME` (ops, tune, e2e, serving); `--smoke` runs the same code on a CPU under the Triton
interpreter. The root modules never import from here."""

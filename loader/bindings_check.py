"""Does the installed `cuda-bindings` provide everything the loader calls?  (CPU only; no driver needed.)

    python3 -m svdq_loader.bindings_check [ARTIFACTS]

Reads the loader's driver module, collects every ``cu.<name>[.<member>]`` it uses and checks each exists in
the installed `cuda.bindings.driver`; with ARTIFACTS, also loads them (verification, host programs, launch
recipes) and interprets one sample launch per variant.  Prints the binding version; exit 1 on any gap.
Used by tests/test_bindings_compat.py and tools/check_bindings.sh (a temporary venv per binding major).
"""
from __future__ import annotations

import ast
import os
import sys


def used_names(source: str) -> list[tuple[str, ...]]:
    """Every attribute chain rooted at the name ``cu`` in `source` (``("cuInit",)``, ``("CUresult", "CUDA_SUCCESS")``)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "cu":
                out.add(tuple(reversed(chain)))
    # keep the longest chains only (("CUresult",) is implied by ("CUresult", "CUDA_SUCCESS"))
    return sorted(c for c in out if not any(o != c and o[:len(c)] == c for o in out))


def missing_names() -> list[str]:
    from cuda.bindings import driver as cu
    from . import driver
    with open(driver.__file__) as f:
        chains = used_names(f.read())
    gaps = []
    for chain in chains:
        obj = cu
        for part in chain:
            if not hasattr(obj, part):
                if part == "cuKernelGetParamCount":      # optional: newer bindings only (the loader checks)
                    break
                gaps.append("cu." + ".".join(chain))
                break
            obj = getattr(obj, part)
    return gaps


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import cuda.bindings
    print(f"cuda-bindings {cuda.bindings.__version__}")
    gaps = missing_names()
    for g in gaps:
        print(f"missing in this cuda-bindings: {g}")
    if argv:
        import svdq_loader
        from svdq_loader.ops import op_spec
        lib = svdq_loader.load(os.path.abspath(argv[0]))
        for vv in lib._verified.values():
            e = vv.entry
            args = op_spec(e.op).sample_args(e.requirements)
            rec = vv.program.launch(args, {s: [p.size for p in ps] for s, ps in e.params.items()})
            if rec.kernel not in e.kernel_symbols:
                print(f"{e.name}: sample launch of {rec.kernel!r}")
                gaps.append(e.name)
        print(f"loaded and interpreted {len(lib.variants)} variant(s)")
    print("OK" if not gaps else f"{len(gaps)} problem(s)")
    return 1 if gaps else 0


if __name__ == "__main__":
    raise SystemExit(main())

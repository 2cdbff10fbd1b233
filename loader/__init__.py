"""svdq_loader: the DSL-free runtime of svdq-aot.

    import svdq_loader
    lib = svdq_loader.load("artifacts")       # manifest checksum, sha256s, cross-checks; no CUDA yet
    lib = svdq_loader.load()                  # $SVDQ_ARTIFACTS, an installed artifact wheel, ./artifacts
    act, ascales, la = lib.quantize_act(x, smooth=smooth, lora_down=lora_down)
    y = lib.gemm_w4a4(act, w, ascales, lora_act_in=la)        # w = lib.prepare_weight(...)
    # the FP8-compute mode (sm_90a): w8 = lib.prepare_weight(..., compute="fp8")
    a8, _, la = lib.quantize_act(x, smooth=smooth, lora_down=lora_down, compute="fp8")     # a8: an E4m3Act
    y = lib.gemm_w4a4(a8, w8, None, lora_act_in=la)

``import svdq_loader`` imports only the standard library; numpy,
`cuda.bindings` and torch are imported when a library is loaded or an
operator is called.  Never the CuTe DSL, never a compiler.  Test and
benchmark helpers live in `svdq_loader.testing` (imported on demand).
"""
from ._version import __version__

__all__ = ["__version__", "load", "Library", "E4m3Act"]


def load(path: str | None = None, tuning=True):
    """Read, validate, sha256-verify and cross-check the artifacts in `path` and their tuning table
    (``tuning``: True uses ``<path>/tuning.json`` when present, False none, or a table's path); no CUDA call.

    With no path: ``$SVDQ_ARTIFACTS``, then an installed artifact package, then ``./artifacts``.
    """
    from .library import load as _load
    return _load(path, tuning)


def __getattr__(name):
    if name == "Library":
        from .library import Library
        return Library
    if name == "E4m3Act":
        from .ops.act_fp8 import E4m3Act
        return E4m3Act
    raise AttributeError(name)

"""svdq_loader: the DSL-free runtime of svdq-aot.

    import svdq_loader
    lib = svdq_loader.load("artifacts")       # manifest + sha256 checks, no CUDA yet
    y = lib.gemm_w4a4(act, wgt, ascales, wscales, lora_act_in=la, lora_up=lu,
                      wcscale=wc, bias=b, out_dtype=torch.bfloat16)

Imports only the standard library, numpy, `cuda.bindings` and (for the
operator) torch.  Never the CuTe DSL, never a compiler.
"""
from ._version import __version__

__all__ = ["__version__", "load", "Library"]


def load(path: str = "artifacts"):
    """Read, validate and sha256-verify the artifacts in `path` (no CUDA call)."""
    from .library import load as _load
    return _load(path)


def __getattr__(name):
    if name == "Library":
        from .library import Library
        return Library
    raise AttributeError(name)

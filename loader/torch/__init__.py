"""svdq_loader.torch: SVDQuant W4A4 linears as torch modules (docs/torch.md).

    import svdq_loader, svdq_loader.torch as svdq_torch
    lib = svdq_loader.load("artifacts")
    report = svdq_torch.quantize_model(model, lib, rank=32)     # swaps eligible nn.Linear in place
    print(report)

`W4A4Linear` is one layer (built from an `nn.Linear` with SVDQuant's offline
recipe, or from already-quantized tensors); `quantize_model` swaps a model's
linears and reports what it skipped and why; `calibrate` collects the
activation maxima the smoothing step uses; `load_quantized` rebuilds a
swapped model from its saved state dict.  Importing this package imports
torch (`import svdq_loader` alone does not).
"""
from svdq_loader.torch.linear import STATE_NAMES, W4A4Linear, weight_bytes
from svdq_loader.torch.recipe import QuantizedLinear, quantize_linear
from svdq_loader.torch.swap import SwapReport, calibrate, eligibility, load_quantized, quantize_model, resolve_arch

__all__ = ["W4A4Linear", "STATE_NAMES", "weight_bytes", "QuantizedLinear", "quantize_linear", "SwapReport",
           "quantize_model", "calibrate", "load_quantized", "eligibility", "resolve_arch"]

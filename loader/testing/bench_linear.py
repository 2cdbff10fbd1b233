"""`svdq-aot bench --op linear`: a whole W4A4 linear as a model runs it, against the linear it replaces.

A model's linear starts from 16-bit activations: ours is ``quantize_act`` (smoothing and the LoRA-down product
fused; smoothing by the reciprocals a layer makes once, ``smooth_rcp``, as ``W4A4Linear`` does, and the torch
baselines get the same reciprocals) and then ``gemm_w4a4`` on the same stream, back to back (the GEMM is a
programmatic dependent of the quantizer, so its CTAs may launch while the quantizer drains).  The operator
benches time each half alone; this case times the pair, which is what a user swapping a bf16 ``nn.Linear`` pays.  Baselines on the same M, K, N:

* ``dense``   cuBLAS on the 16-bit activations and weights (``torch.matmul``): the layer before quantization;
* ``eager``   the same W4A4 linear in plain torch (quantize, dequantize both operands, matmul, LoRA, affine);
* ``compile`` ``torch.compile`` of that.

TFLOP/s = 2·M·N·K / time (LoRA flops not counted), as for the GEMM.  Inputs rotate exactly as in the other cases.
With ``--compute fp8`` the pair is ``quantize_act(..., compute="fp8")`` (NVFP4, then act_fp8) and the FP8-compute
GEMM from its E4M3 activation; the check then allows the mode's distance from the exact operator.
"""
from __future__ import annotations

LINEAR_BASELINES = ("dense", "eager", "compile")
_WEIGHT_KEYS = ("wgt", "wscales", "lora_up", "wcscale", "bias")     # torch_linear's weight-side arguments, in order


def torch_linear(x, smooth, lora_down, wgt, wscales, lora_up, wcscale, bias, lut=None, smooth_rcp=None):
    """The W4A4 linear in torch (the eager baseline and the check): quantize_act's exact rules, then the GEMM
    pipeline on the dequantized operands, in x's dtype (smoothing by `smooth`, or by its reciprocals
    `smooth_rcp`: the same x̂)."""
    from . import torch_quant as tq
    act, ascales, lora_act_in = tq.quantize_act(x, smooth, lora_down, smooth_rcp)
    return tq.w4a4_unfused(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, x.dtype, lut=lut)


def linear_set_bytes(m: int, k: int, n: int, rank: int) -> int:
    """Bytes one input set of a linear call touches: x, the quantized activation and its scales, the 4-bit
    weight and its scales, smooth, lora_down / lora_act_in / lora_up, wcscale and bias, and the output."""
    return (2 * m * k + m * k // 2 + m * k // 16 + n * k // 2 + n * k // 16 + 2 * k
            + 2 * rank * (k + m + n) + 8 * n + 2 * m * n)


def linear_case(lib, m, k, n, rank, dtype, baselines, st, l2, compute="exact") -> dict:
    import torch
    from . import bench
    from . import reference as ref
    from . import torch_quant as tq
    tdt = bench._dtype(dtype)
    res = dict(op="linear", m=m, k=k, n=n, rank=rank, dtype=dtype, smooth=True, compute=compute)
    p = ref.random_problem(m, n, k, rank, seed=(m * 7919 + k * 31 + n + 17) % 2**31, out_dtype=dtype, device="cuda")
    x, smooth, lora_down = bench._quant_inputs(m, k, rank, tdt, seed=m + k + n)
    ns = bench.n_sets_for(linear_set_bytes(m, k, n, rank), l2)
    X = [x] + [x.clone() for _ in range(ns - 1)]
    SM = [smooth] + [smooth.clone() for _ in range(ns - 1)]
    RS = [lib.smooth_reciprocals(v) for v in SM] if hasattr(lib, "smooth_reciprocals") else None
    LD = [lora_down] + [bench._clone(lora_down) for _ in range(ns - 1)]
    P = [p] + [{key: bench._clone(v) for key, v in p.items()} for _ in range(ns - 1)]
    Y = [torch.empty(m, n, dtype=tdt, device="cuda") for _ in range(ns)]

    def setup():
        kw = {} if compute == "exact" else dict(compute=compute)
        W = [lib.prepare_weight(q["wgt"], q["wscales"], lora_up=q["lora_up"], wcscale=q["wcscale"], bias=q["bias"],
                                **kw) for q in P]
        sm = [dict(smooth=SM[i]) if RS is None else dict(smooth_rcp=RS[i]) for i in range(ns)]
        Q = [lib.quantize_act(X[i], lora_down=LD[i], **sm[i], **kw) for i in range(ns)]

        def ours(i):
            act, sc, la = Q[i]
            lib.quantize_act(X[i], lora_down=LD[i], out_act=act, out_scales=sc, out_lora=la, **sm[i], **kw)
            lib.gemm_w4a4(act, W[i], sc, lora_act_in=la, out=Y[i])
        return ours

    lut = tq.e2m1_lut(tdt, "cuda")

    def pipeline(f, rcp=RS is not None):          # the torch linear on input set i (rcp: by the reciprocals)
        if rcp:
            return lambda i: f(X[i], None, LD[i], *(P[i][key] for key in _WEIGHT_KEYS), lut=lut, smooth_rcp=RS[i])
        return lambda i: f(X[i], SM[i], LD[i], *(P[i][key] for key in _WEIGHT_KEYS), lut=lut)

    ours, skipped = bench.first_call_or_skip(res, setup)
    if skipped:
        return skipped

    want = pipeline(torch_linear, False)(0).float()          # from the factors themselves
    got = Y[0].float()
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
    tol = bench.FP8_CHECK_TOL if compute == "fp8" else bench.CHECK_TOL
    res["check"] = dict(rel_err_vs_eager=rel, ok=bool(rel < tol and torch.isfinite(got).all()))
    del want, got
    timers = {"dense": lambda: bench._dense_case(m, k, n, tdt, st, l2),
              "eager": lambda: bench.time_calls(pipeline(torch_linear), ns, st),
              "compile": lambda: bench.time_calls(pipeline(tq.compiled(torch_linear)), ns, st)}
    return bench.time_against(res, ours, ns, st, (m, n, k), {x: timers[x] for x in baselines if x in timers})


__all__ = ["LINEAR_BASELINES", "linear_case", "linear_set_bytes", "torch_linear"]

"""The per-call fast paths (`fast_args` of quantize_act and gemm_w4a4) against the detailed checks (`plan_call`).

The library runs `fast_args` first on every call and falls back to `plan_call` only where it returns None. So
`fast_args` must never take a call that `plan_call` refuses, and where both take a call they must hand the same
features, dimensions, pointers and scalars to selection and launch. Checked on the CPU: every tensor reports
device 0 (``get_device`` patched) and the CUDA-device check is stubbed out, so that every structural rule is
reached. Cases: hand-made single-rule breaks, then seeded random combinations of them.
"""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.ops import gemm_w4a4 as gemm_op  # noqa: E402
from svdq_loader.ops import quantize_act as quant_op  # noqa: E402

BF16, FP16, U8, F8 = torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _device_zero(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(quant_op, "check_devices", lambda named: None)
    monkeypatch.setattr(gemm_op, "check_devices", lambda named: None)


def _misaligned(shape, dtype):
    """A contiguous tensor of `shape` whose data pointer is 2 bytes past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    item = torch.empty((), dtype=dtype).element_size()
    base = torch.zeros(n * item + 16, dtype=U8)
    off = (-base.data_ptr()) % 16 + 2
    t = base[off:off + n * item].view(dtype).view(shape)
    assert t.is_contiguous() and t.data_ptr() % 16
    return t


def _noncontig(shape, dtype):
    return torch.zeros(tuple(reversed(shape)), dtype=dtype).t() if len(shape) == 2 else \
        torch.zeros(shape[0] * 2, dtype=dtype)[::2]


# ---------------------------------------------------------------- quantize_act
M, K, R = 77, 128, 32


def _q_base():
    g = torch.Generator().manual_seed(0)
    return dict(arch="sm_90a", x=torch.randn(M, K, generator=g).to(BF16),
                smooth=(torch.rand(K, generator=g) + 0.5).to(BF16),
                lora_down=torch.randn(K, R, generator=g).to(BF16),
                out_act=None, out_scales=None, out_lora=None, smooth_rcp=None)


Q_BREAKS = {
    "x fp32": dict(x=torch.randn(M, K)),
    "x fp16 (smooth, lora bf16)": dict(x=torch.randn(M, K).to(FP16)),
    "x 3-D": dict(x=torch.randn(1, M, K).to(BF16)),
    "x 1-D": dict(x=torch.randn(K).to(BF16)),
    "x K = 120": dict(x=torch.randn(M, 120).to(BF16)),
    "x empty": dict(x=torch.zeros(0, K, dtype=BF16)),
    "x non-contiguous": dict(x=_noncontig((M, K), BF16)),
    "x misaligned": dict(x=_misaligned((M, K), BF16)),
    "x a Parameter (subclass)": dict(x=torch.nn.Parameter(torch.randn(M, K).to(BF16), requires_grad=False)),
    "x not a tensor": dict(x=[[0.0] * K] * M),
    "smooth absent": dict(smooth=None),
    "smooth fp16": dict(smooth=torch.ones(K, dtype=FP16)),
    "smooth short": dict(smooth=torch.ones(K // 2, dtype=BF16)),
    "smooth 2-D": dict(smooth=torch.ones(1, K, dtype=BF16)),
    "smooth non-contiguous": dict(smooth=_noncontig((K,), BF16)),
    "smooth misaligned": dict(smooth=_misaligned((K,), BF16)),
    "smooth_rcp instead": dict(smooth=None, smooth_rcp=(torch.rand(K) + 0.5).to(BF16)),
    "smooth_rcp and smooth": dict(smooth_rcp=(torch.rand(K) + 0.5).to(BF16)),
    "smooth_rcp fp16": dict(smooth=None, smooth_rcp=torch.ones(K, dtype=FP16)),
    "smooth_rcp short": dict(smooth=None, smooth_rcp=torch.ones(K // 2, dtype=BF16)),
    "smooth_rcp non-contiguous": dict(smooth=None, smooth_rcp=_noncontig((K,), BF16)),
    "smooth_rcp misaligned": dict(smooth=None, smooth_rcp=_misaligned((K,), BF16)),
    "lora absent": dict(lora_down=None),
    "lora rank 24": dict(lora_down=torch.zeros(K, 24, dtype=BF16)),
    "lora rank 64": dict(lora_down=torch.zeros(K, 64, dtype=BF16)),
    "lora wrong K": dict(lora_down=torch.zeros(K + 16, R, dtype=BF16)),
    "lora fp16": dict(lora_down=torch.zeros(K, R, dtype=FP16)),
    "lora non-contiguous": dict(lora_down=_noncontig((K, R), BF16)),
    "lora misaligned": dict(lora_down=_misaligned((K, R), BF16)),
    "out_act given": dict(out_act=torch.zeros(M, K // 2, dtype=U8)),
    "out_act wide": dict(out_act=torch.zeros(M, K, dtype=U8)),
    "out_act int8": dict(out_act=torch.zeros(M, K // 2, dtype=torch.int8)),
    "out_act non-contiguous": dict(out_act=_noncontig((M, K // 2), U8)),
    "out_act misaligned": dict(out_act=_misaligned((M, K // 2), U8)),
    "out_scales given": dict(out_scales=torch.zeros(M, K // 16).to(F8)),
    "out_scales blocked": dict(out_scales=torch.zeros(1, 2, 32, 4, 4).to(F8)),
    "out_scales uint8": dict(out_scales=torch.zeros(M, K // 16, dtype=U8)),
    "out_scales misaligned": dict(out_scales=_misaligned((M, K // 16), F8)),
    "out_lora given": dict(out_lora=torch.zeros(M, R, dtype=BF16)),
    "out_lora short rank": dict(out_lora=torch.zeros(M, 16, dtype=BF16)),
    "out_lora fp16": dict(out_lora=torch.zeros(M, R, dtype=FP16)),
    "out_lora misaligned": dict(out_lora=_misaligned((M, R), BF16)),
    "out_lora not a tensor": dict(out_lora=object()),
    "arch sm_100a (blocked scales)": dict(arch="sm_100a"),
    "arch sm_100a, logical out_scales": dict(arch="sm_100a", out_scales=torch.zeros(M, K // 16).to(F8)),
    "arch sm_100a, blocked out_scales": dict(arch="sm_100a", out_scales=torch.zeros(1, 2, 32, 4, 4).to(F8)),
}


def _q_agree(case: dict) -> str:
    """'refused', 'fast' (both took it, with the same facts) or 'slow only'. Fails on any disagreement."""
    a = dict(case)
    arch = a.pop("arch")
    fast = quant_op.fast_args(arch, a["x"], a["smooth"], a["lora_down"], a["out_act"], a["out_scales"],
                              a["out_lora"], a["smooth_rcp"])
    try:
        call = quant_op.plan_call(arch, a.pop("x"), **a)
    except InvalidArgument:
        assert fast is None, "fast_args took a call that plan_call refuses"
        return "refused"
    if fast is None:
        return "slow only"
    feats, dims, outs, args = fast
    names = quant_op.SPEC.arg_names
    got = dict(zip(names, args))
    assert feats == call.features
    assert dims == (("m", call.m), ("k", call.k))
    assert (got["m"], got["k"], got["use_smooth"]) == (call.m, call.k, call.use_smooth)
    for name in ("x", "smooth", "lora_down"):
        assert got[name] == call.pointers[name], name
    assert call.use_smooth == (2 if case["smooth_rcp"] is not None else int(case["smooth"] is not None))
    for name, given, out in zip(("act", "ascales", "lora_act_in"), (case["out_act"], case["out_scales"],
                                                                    case["out_lora"]), outs):
        if given is not None:
            assert out is given and got[name] == call.pointers[name], name
        ref = dict(act=call.outputs[0], ascales=call.outputs[1], lora_act_in=call.outputs[2])[name]
        if ref is None:
            assert out is None and got[name] == 0, name
        else:       # an allocated output: the one plan_call would allocate, same shape and dtype
            assert (tuple(out.shape), out.dtype) == (tuple(ref.shape), ref.dtype), name
            assert got[name] == out.data_ptr(), name
    return "fast"


def test_quantize_fast_path_takes_the_common_calls():
    assert _q_agree(_q_base()) == "fast"
    for name in ("smooth absent", "smooth_rcp instead", "lora absent", "out_act given", "out_scales given", "out_lora given",
                 "lora rank 64", "arch sm_100a (blocked scales)", "arch sm_100a, blocked out_scales"):
        assert _q_agree({**_q_base(), **Q_BREAKS[name]}) == "fast", name


@pytest.mark.parametrize("name", sorted(Q_BREAKS))
def test_quantize_fast_path_agrees_with_plan_call(name):
    _q_agree({**_q_base(), **Q_BREAKS[name]})


def test_quantize_fast_path_agrees_on_random_combinations():
    rng = random.Random(44)
    names = sorted(Q_BREAKS)
    seen = set()
    for _ in range(300):
        case = _q_base()
        for name in rng.sample(names, rng.randint(2, 4)):
            case.update(Q_BREAKS[name])
        seen.add(_q_agree(case))
    assert {"refused", "fast"} <= seen


# ---------------------------------------------------------------- gemm_w4a4
N = 256


def _g_base():
    g = torch.Generator().manual_seed(1)
    wgt = torch.randint(0, 256, (N, K // 2), dtype=U8, generator=g)
    wscales = torch.full((N, K // 16), 1.0).to(F8)
    lora_up = torch.randn(N, R, generator=g).to(BF16)
    w = gemm_op.prepare_weight(wgt, wscales, lora_up=lora_up, wcscale=torch.rand(N, generator=g) + 0.5,
                               bias=torch.randn(N, generator=g), arch="sm_90a")
    return dict(arch="sm_90a", act=torch.randint(0, 256, (M, K // 2), dtype=U8, generator=g), weight=w,
                ascales=torch.full((M, K // 16), 1.0).to(F8), lora_act_in=torch.randn(M, R, generator=g).to(BF16),
                out=None, out_dtype=None)


def _g_weight(**kw):
    g = torch.Generator().manual_seed(2)
    return gemm_op.prepare_weight(torch.randint(0, 256, (N, K // 2), dtype=U8, generator=g),
                                  torch.full((N, K // 16), 1.0).to(F8), **kw)


G_BREAKS = {
    "act int8": dict(act=torch.zeros(M, K // 2, dtype=torch.int8)),
    "act half K": dict(act=torch.zeros(M, K // 4, dtype=U8)),
    "act empty": dict(act=torch.zeros(0, K // 2, dtype=U8), ascales=torch.zeros(0, K // 16).to(F8)),
    "act non-contiguous": dict(act=_noncontig((M, K // 2), U8)),
    "act misaligned": dict(act=_misaligned((M, K // 2), U8)),
    "act 3-D": dict(act=torch.zeros(1, M, K // 2, dtype=U8)),
    "ascales uint8": dict(ascales=torch.zeros(M, K // 16, dtype=U8)),
    "ascales short": dict(ascales=torch.zeros(M, K // 32).to(F8)),
    "ascales rows": dict(ascales=torch.zeros(M + 1, K // 16).to(F8)),
    "ascales misaligned": dict(ascales=_misaligned((M, K // 16), F8)),
    "ascales non-contiguous": dict(ascales=_noncontig((M, K // 16), F8)),
    "lora absent": dict(lora_act_in=None),
    "lora fp16": dict(lora_act_in=torch.zeros(M, R, dtype=FP16)),
    "lora rows": dict(lora_act_in=torch.zeros(M + 1, R, dtype=BF16)),
    "lora misaligned": dict(lora_act_in=_misaligned((M, R), BF16)),
    "weight without LoRA": dict(weight=lambda: _g_weight(arch="sm_90a")),
    "weight without LoRA, none given": dict(weight=lambda: _g_weight(arch="sm_90a"), lora_act_in=None),
    "weight logical format": dict(weight=lambda: _g_weight(lora_up=torch.zeros(N, R, dtype=BF16))),
    "out given": dict(out=torch.zeros(M, N, dtype=BF16)),
    "out fp16": dict(out=torch.zeros(M, N, dtype=FP16)),
    "out fp32": dict(out=torch.zeros(M, N)),
    "out narrow": dict(out=torch.zeros(M, N - 1, dtype=BF16)),
    "out misaligned": dict(out=_misaligned((M, N), BF16)),
    "out non-contiguous": dict(out=_noncontig((M, N), BF16)),
    "out_dtype bf16": dict(out_dtype=BF16),
    "out_dtype fp16": dict(out_dtype=FP16),
    "out_dtype fp32": dict(out_dtype=torch.float32),
    "arch sm_100a": dict(arch="sm_100a"),
}


def _g_case(*names) -> dict:
    """The valid call with the named breaks applied (weights prepared here, where the device check is stubbed)."""
    case = _g_base()
    for name in names:
        case.update({key: v() if callable(v) else v for key, v in G_BREAKS[name].items()})
    return case


def _g_agree(case: dict) -> str:
    a = dict(case)
    fast = gemm_op.fast_args(a["arch"], a["act"], a["weight"], a["ascales"], a["lora_act_in"], a["out"],
                             a["out_dtype"])
    try:
        call = gemm_op.plan_call(a["arch"], a["act"], a["weight"], a["ascales"], lora_act_in=a["lora_act_in"],
                                 out=a["out"], out_dtype=a["out_dtype"])
    except InvalidArgument:
        assert fast is None, "fast_args took a call that plan_call refuses"
        return "refused"
    if fast is None:
        return "slow only"
    feats, dims, out, args, weight = fast
    got = dict(zip(gemm_op.SPEC.arg_names, args))
    assert feats == call.features and weight is a["weight"]
    assert dims == (("m", call.m), ("n", call.n), ("k", call.k))
    assert (got["m"], got["n"], got["k"]) == (call.m, call.n, call.k)
    for name, ptr in call.pointers.items():
        if name != "out":
            assert got[name] == ptr, name
    if case["out"] is not None:
        assert out is case["out"]
    assert (tuple(out.shape), out.dtype) == (tuple(call.out.shape), call.out.dtype)
    assert got["out"] == out.data_ptr()
    return "fast"


def test_gemm_fast_path_takes_the_common_calls():
    assert _g_agree(_g_base()) == "fast"
    for name in ("out given", "out_dtype bf16", "weight without LoRA, none given"):
        assert _g_agree(_g_case(name)) == "fast", name


@pytest.mark.parametrize("name", sorted(G_BREAKS))
def test_gemm_fast_path_agrees_with_plan_call(name):
    _g_agree(_g_case(name))


def test_gemm_fast_path_agrees_on_random_combinations():
    rng = random.Random(44)
    names = sorted(G_BREAKS)
    seen = set()
    for _ in range(200):
        seen.add(_g_agree(_g_case(*rng.sample(names, rng.randint(2, 3)))))
    assert {"refused", "fast"} <= seen

"""Operator ``gemm_w4a4``: the SVDQuant W4A4 (NVFP4) GEMM with LoRA residual and per-column affine.

    y[m, n] = (Σ_k A[m,k]·W[n,k])·wcscale[n] + bias[n] + Σ_r lora_act_in[m,r]·lora_up[n,r]

The spec (`SPEC`) is pure Python.  The torch-facing part (`prepare_weight`,
`plan_call`) checks every argument on tensor metadata only, before anything
touches the GPU.  Logical layouts:

    act      [M, K/2]  uint8 (two E2M1 nibbles, low = even k)
    ascales  [M, K/16] float8_e4m3fn (layout "logical"; "blocked" on Blackwell, see layouts.py)
    wgt      [N, K/2]  uint8
    wscales  [N, K/16] float8_e4m3fn (prepare_weight converts it, and lora_up, into the weight format
                                      of the arch: layouts.WEIGHT_FORMAT_BY_ARCH)
    lora_act_in [M, R], lora_up [N, R]   fp16 or bf16 (= output dtype)
    wcscale, bias [N]  any float dtype (used as float32)
    out      [M, N]    fp16 or bf16, row-major
"""
from __future__ import annotations

from dataclasses import dataclass

from . import gemm_streamk
from .act_fp8 import E4m3Act
from .decode_act import image_size_problem, tile_rows_problem
from .layouts import SCALE_LAYOUT_BY_ARCH
from .spec import PTR_ALIGN, Feature, OpSpec


def _shape_rule(req, dims) -> str | None:
    if dims["m"] < 1:
        return f"M={dims['m']} must be at least 1"
    if dims["n"] % req["n_multiple"]:
        return f"N={dims['n']} is not a multiple of {req['n_multiple']}"
    if dims["k"] % req["k_multiple"]:
        return f"K={dims['k']} is not a multiple of {req['k_multiple']}"
    return None


def _knob_size_rule(knobs, dims) -> str | None:
    if knobs.get("act_source") != "images":
        return None
    return image_size_problem(dims["m"], dims["k"]) or tile_rows_problem(int(knobs.get("tile_m", 1)), dims["m"])


def _coverage(config) -> list[tuple[str, str, dict]]:
    return [(f"{s.name} (K={s.k}, N={s.n})", f"shapes.{s.name}", {"m": 1, "n": s.n, "k": s.k})
            for s in config.shapes]


SPEC = OpSpec(
    name="gemm_w4a4",
    summary="NVFP4 W4A4 GEMM + LoRA residual + per-column scale and bias",
    host_args=(
        ("act", "ptr"), ("ascales", "ptr"), ("wgt", "ptr"), ("wscales", "ptr"),
        ("lora_act_in", "ptr"), ("lora_up", "ptr"), ("wcscale", "ptr"), ("bias", "ptr"),
        ("out", "ptr"), ("m", "i32"), ("n", "i32"), ("k", "i32"), ("sm_count", "i32"),
        ("stream", "stream"),
    ),
    features=(
        Feature("out_dtype", "out_dtypes", ("bf16", "fp16")),
        Feature("rank", "ranks"),
        # run-time inputs of a variant built with them: a call without one passes its identity vector
        Feature("wcscale", "wcscale", (False, True), identity=1.0),
        Feature("bias", "bias", (False, True), identity=0.0),
        Feature("scale_layout", "arch", by_arch=SCALE_LAYOUT_BY_ARCH),
    ),
    dims=("m", "n", "k"),
    shape_rule=_shape_rule,
    requirement_keys=("n_multiple", "k_multiple"),
    coverage_problems=_coverage,
    sample_scalars={"sm_count": 132},
    # a variant with act_source "images" reads the stage images decode_act writes (ops/decode_act.py)
    prepass=lambda knobs: "decode_act" if knobs.get("act_source") == "images" else None,
    # the stream-K schedule's meetings use the decode_act workspace past the images (ops/gemm_streamk.py)
    prepass_extra_bytes=lambda knobs: (gemm_streamk.workspace_bytes_for(knobs)
                                       if knobs.get("schedule") == "ws_streamk" else None),
    knob_size_rule=_knob_size_rule,
)


# ---------------------------------------------------------------------------
# The per-call part: torch tensors -> checked call (torch imported on first use)
# ---------------------------------------------------------------------------

from .checks import check_devices, check_i32_sizes, check_tensor, check_vector, fail, half_dtypes, torch_module  # noqa: E402
from .layouts import BLOCK_K, WEIGHT_FORMAT_MODULES, scale_shape  # noqa: E402
from .layouts import COMPUTE_MODES, GEMM_OP_BY_COMPUTE, WEIGHT_FORMATS_BY_COMPUTE  # noqa: E402


def _as_f32(t):
    t = t.to(torch_module().float32).contiguous()
    if t.data_ptr() % PTR_ALIGN:
        t = t.clone()
    return t


#: (device, N, value) -> a float32 [N] vector of `value`: what a call without wcscale (1.0) or bias (0.0) passes
_IDENTITY: dict = {}


def identity_vector(like, n: int, value: float):
    """The float32 [n] vector of `value` on `like`'s device, made once per (device, n, value) and shared."""
    key = (str(like.device), int(n), float(value))
    t = _IDENTITY.get(key)
    if t is None:
        if len(_IDENTITY) > 4096:  # pragma: no cover - bounded; a dropped vector lives on in its weights
            _IDENTITY.clear()
        t = _IDENTITY[key] = torch_module().full((int(n),), float(value), dtype=torch_module().float32,
                                                 device=like.device)
    return t


@dataclass(frozen=True)
class PreparedWeight:
    """The weight side of ``gemm_w4a4``, checked and converted once.

    Pass it as `wgt`; nothing on the weight side is then checked or
    converted per call.
    """
    wgt: object                 # [N, K/2] uint8
    wscales: object             # [N, K/16] float8_e4m3fn
    lora_up: object | None      # [N, R] fp16/bf16
    wcscale: object | None      # [N] float32
    bias: object | None         # [N] float32
    n: int
    k: int
    rank: int
    weight_format: str = "logical"   # "logical", or the arch's format (layouts.WEIGHT_FORMAT_BY_ARCH)
    compute: str = "exact"           # "fp8": the FP8-compute mode (op gemm_w4a4_fp8); wcscale then holds wcscale / rw

    def __post_init__(self):
        if self.compute not in GEMM_OP_BY_COMPUTE:
            fail(f"compute={self.compute!r}: expected one of {', '.join(map(repr, GEMM_OP_BY_COMPUTE))}")
        # what every call reuses: the weight-side pointers in host-argument order, the device.  An absent
        # wcscale / bias points at its identity vector (ones / zeros), so a variant built with the input
        # serves the call (selection prefers one built without it, if any); one built without ignores it.
        ptr = lambda t: t.data_ptr() if t is not None else 0  # noqa: E731
        wcs = self.wcscale if self.wcscale is not None else identity_vector(self.wgt, self.n, 1.0)
        bias = self.bias if self.bias is not None else identity_vector(self.wgt, self.n, 0.0)
        object.__setattr__(self, "fills", (wcs, bias))
        object.__setattr__(self, "ptrs", (ptr(self.wgt), ptr(self.wscales), ptr(self.lora_up),
                                          ptr(wcs), ptr(bias)))
        object.__setattr__(self, "device_index", self.wgt.get_device())
        object.__setattr__(self, "lora_dtype", self.lora_up.dtype if self.lora_up is not None else None)
        # the operator a call with this weight runs: gemm_w4a4, or gemm_w4a4_fp8 (compute="fp8")
        object.__setattr__(self, "op", GEMM_OP_BY_COMPUTE[self.compute])

    @property
    def device(self):
        return self.wgt.device


def weight_format_for(arch, compute: str = "exact") -> str:
    """The weight format the GEMM of `arch` reads in `compute` mode (`layouts.WEIGHT_FORMATS_BY_COMPUTE`; fails
    for a mode the arch lacks)."""
    formats = WEIGHT_FORMATS_BY_COMPUTE.get(compute)
    if formats is None:
        fail(f"compute must be one of {', '.join(map(repr, COMPUTE_MODES))}, got {compute!r}")
    if compute != "exact" and arch not in formats:
        fail(f"compute={compute!r} (the FP8-compute mode) runs on {', '.join(formats)} only; this weight's device "
             f"is {arch or 'not a CUDA device'}")
    return formats.get(arch, "logical")


def prepare_weight(wgt, wscales, *, lora_up=None, wcscale=None, bias=None, arch=None,
                   compute: str = "exact") -> PreparedWeight:
    """Check the weight side once; for an `arch` listed in ``layouts.WEIGHT_FORMAT_BY_ARCH`` also convert it
    to the format that arch's GEMM reads.  ``compute="fp8"`` prepares it for the FP8-compute mode (sm_90a): the
    ``sm90_fp8_frag`` format and a wcscale of wcscale / rw (`sm90_fp8_weight_format`)."""
    torch = torch_module()
    fmt = weight_format_for(arch, compute)
    check_tensor("wgt", wgt, dtype=torch.uint8, ndim=2)
    n, kh = wgt.shape
    k = 2 * kh
    if n < 1 or kh < 1:
        fail(f"wgt must be non-empty, got shape {tuple(wgt.shape)}")
    if k % BLOCK_K:
        fail(f"K = 2*wgt.shape[1] = {k} must be a multiple of {BLOCK_K} (one E4M3 scale per {BLOCK_K} k)")
    check_tensor("wscales", wscales, dtype=torch.float8_e4m3fn, ndim=2, shape=(n, k // BLOCK_K))
    rank = 0
    if lora_up is not None:
        check_tensor("lora_up", lora_up, dtype=tuple(half_dtypes()), ndim=2, shape=(n, None))
        rank = int(lora_up.shape[1])
        if rank < 1 or rank % 16:
            fail(f"LoRA rank R = lora_up.shape[1] = {rank} must be a positive multiple of 16")
    if wcscale is not None:
        check_vector("wcscale", wcscale, n)
    if bias is not None:
        check_vector("bias", bias, n)
    check_devices(dict(wgt=wgt, wscales=wscales, lora_up=lora_up, wcscale=wcscale, bias=bias))
    if wcscale is not None:
        wcscale = _as_f32(wcscale)
    if bias is not None:
        bias = _as_f32(bias)
    if fmt != "logical":
        import importlib
        module = importlib.import_module(f"{__package__}.{WEIGHT_FORMAT_MODULES[fmt]}")
        if compute == "fp8":            # the format also folds 1 / rw into wcscale (sm90_fp8_weight_format)
            wgt, wscales, wcscale = module.convert(wgt, wscales, wcscale)
        else:
            wgt, wscales, lora_up = module.convert(n, k, wgt, wscales, lora_up, wcscale)
    return PreparedWeight(wgt, wscales, lora_up, wcscale, bias, n, k, rank, fmt, compute)


@dataclass(frozen=True)
class GemmCall:
    """One checked call: the selection features, dims, output and the host-argument values."""
    features: tuple             # (out_dtype, rank, wcscale, bias, scale_layout) = SPEC.feature_names
    m: int
    n: int
    k: int
    out: object
    pointers: dict


def plan_call(arch: str, act, weight: PreparedWeight, ascales, *, lora_act_in=None, out=None,
              out_dtype=None) -> GemmCall:
    torch = torch_module()
    layout = SCALE_LAYOUT_BY_ARCH.get(arch, "logical")
    if isinstance(act, E4m3Act):
        m, k, n = _e4m3_act_side(act, weight, ascales)
        check_i32_sizes(M_times_N_output_elements=m * n, N_times_K_half_weight_bytes=n * k // 2)
        return _plan_rest(arch, layout, act.data, None, weight, lora_act_in, out, out_dtype, m, n, k)
    check_tensor("act", act, dtype=torch.uint8, ndim=2)
    m, kh = act.shape
    if m < 1:
        fail(f"act must have at least one row (M >= 1), got shape {tuple(act.shape)}")
    if 2 * kh != weight.k:
        fail(f"act has K = 2*{kh} = {2 * kh} but the weight has K = {weight.k}")
    k, n = weight.k, weight.n
    check_i32_sizes(M_times_N_output_elements=m * n, M_times_K_half_act_bytes=m * kh,
                    N_times_K_half_weight_bytes=n * kh)
    want_shape = scale_shape(layout, m, k)
    if isinstance(ascales, torch.Tensor) and tuple(ascales.shape) != want_shape:
        hint = ("; logical [M, K/16] scales convert with svdq_loader.ops.blackwell_weight.to_blocked_scales"
                if layout == "blocked" else "")
        fail(f"ascales has shape {tuple(ascales.shape)} but the {arch} GEMM reads the {layout} scale layout, "
             f"shape {want_shape} for M={m}, K={k}; pass the ascales that quantize_act wrote on this device"
             + hint)
    check_tensor("ascales", ascales, dtype=torch.float8_e4m3fn, ndim=len(want_shape), shape=want_shape)
    return _plan_rest(arch, layout, act, ascales, weight, lora_act_in, out, out_dtype, m, n, k)


def _e4m3_act_side(act, weight: PreparedWeight, ascales) -> tuple[int, int, int]:
    """The rules of an FP8-compute activation (`act_fp8.E4m3Act`, from ``quantize_act(..., compute="fp8")``):
    no ascales (its scales are folded in), a weight prepared for the same mode, the same K.  Returns (m, k, n)."""
    if ascales is not None:
        fail("act is an E4m3Act (quantize_act(..., compute='fp8')): its block scales are folded into it, so "
             "ascales must be None")
    if weight.compute != "fp8":
        fail(f"act is an E4m3Act (the FP8-compute mode's activation) but the weight was prepared for "
             f"compute={weight.compute!r}; prepare it with compute='fp8', or quantize the activation with "
             f"compute={weight.compute!r}")
    if act.k != weight.k:
        fail(f"act has K = {act.k} but the weight has K = {weight.k}")
    return act.m, act.k, weight.n


def _plan_rest(arch, layout, act, ascales, weight, lora_act_in, out, out_dtype, m, n, k) -> GemmCall:
    """plan_call after the activation side: LoRA, the output, the weight's format, devices, pointers.  `act` is
    the activation's tensor (an E4m3Act's workspace); `ascales` None for an E4m3Act (the GEMM then gets the
    workspace's address there too: the FP8-compute kernel reads no activation scales)."""
    torch = torch_module()
    if (lora_act_in is None) != (weight.lora_up is None):
        fail("lora_act_in and lora_up must be given together (got only "
             f"{'lora_act_in' if lora_act_in is not None else 'lora_up'})")
    dts = half_dtypes()
    if out_dtype is not None and out_dtype not in dts:
        fail(f"out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    want = out_dtype
    if out is not None:
        check_tensor("out", out, dtype=tuple(dts), ndim=2, shape=(m, n))
        if want is not None and out.dtype != want:
            fail(f"out has dtype {out.dtype} but out_dtype={want}")
        want = out.dtype
    if weight.lora_up is not None:
        if want is None:
            want = weight.lora_up.dtype
        if weight.lora_up.dtype != want:
            fail(f"lora_up has dtype {weight.lora_up.dtype}, must equal the output dtype {want}")
        check_tensor("lora_act_in", lora_act_in, dtype=want, ndim=2, shape=(m, weight.rank))
    if want is None:
        want = torch.bfloat16
    want_fmt = weight_format_for(arch, weight.compute)
    if weight.weight_format != want_fmt:
        fail(f"the weight is in the {weight.weight_format!r} format but the {arch} GEMM reads {want_fmt!r}; "
             f"prepare it for this device (lib.prepare_weight on the device the call runs on)")
    check_devices(dict(act=act, wgt=weight.wgt, ascales=ascales, lora_act_in=lora_act_in, out=out))
    if out is None:
        out = torch.empty((m, n), dtype=want, device=act.device)
    ptrs = dict(
        act=act.data_ptr(), ascales=(ascales if ascales is not None else act).data_ptr(), wgt=weight.wgt.data_ptr(),
        wscales=weight.wscales.data_ptr(),
        lora_act_in=lora_act_in.data_ptr() if lora_act_in is not None else 0,
        lora_up=weight.lora_up.data_ptr() if weight.lora_up is not None else 0,
        wcscale=weight.ptrs[3], bias=weight.ptrs[4],     # an absent one: its identity vector
        out=out.data_ptr(),
    )
    feats = (dts[want], weight.rank, weight.wcscale is not None, weight.bias is not None, layout)
    return GemmCall(feats, m, n, k, out, ptrs)


# ---------------------------------------------------------------------------
# The hot path: the same rules as plan_call, checked in one pass
# ---------------------------------------------------------------------------

#: The order `fast_args` builds its argument list in; it must be the spec's (checked at import).
_FAST_ORDER = ("act", "ascales", "wgt", "wscales", "lora_act_in", "lora_up", "wcscale", "bias", "out",
               "m", "n", "k", "sm_count", "stream")
if SPEC.arg_names != _FAST_ORDER:  # pragma: no cover - a spec edit must update the fast path too
    raise ImportError(f"gemm_w4a4: fast_args builds {_FAST_ORDER} but the spec's host args are {SPEC.arg_names}")
SM_COUNT_INDEX = _FAST_ORDER.index("sm_count")
STREAM_INDEX = _FAST_ORDER.index("stream")
_I32 = 1 << 31
_fast_consts = None


def _consts():
    global _fast_consts
    torch = torch_module()
    _fast_consts = (torch.Tensor, torch.uint8, torch.float8_e4m3fn, half_dtypes(), torch.empty)
    return _fast_consts


def fast_args(arch: str, act, weight, ascales, lora_act_in, out, out_dtype):
    """``(features, dims, out, args, weight)`` when every rule of `plan_call` holds, else None.

    `args` is the host-argument list with ``sm_count`` and ``stream`` left
    0 for the caller; `weight` is the `PreparedWeight` its pointers come from
    (the caller holds it until the launch is queued).  None never means "invalid": the caller then runs
    `plan_call`, which raises the precise error (or accepts a rare form this
    one-pass check does not take, such as a tensor subclass).
    """
    T, u8, f8, halves, empty = _fast_consts or _consts()
    if type(weight) is not PreparedWeight:
        return None
    k, n = weight.k, weight.n
    if type(act) is E4m3Act:        # the FP8-compute activation (its checks ran when it was made)
        m = act.m
        if ascales is not None or weight.compute != "fp8" or act.k != k or m * n >= _I32:
            return None
        dev = act.get_device()
        pa = ps = act.data_ptr()
    else:
        if type(act) is not T or type(ascales) is not T:
            return None
        if act.dtype is not u8 or ascales.dtype is not f8 or act.dim() != 2:
            return None
        m, kh = act.shape
        if m < 1 or 2 * kh != k or m * n >= _I32 or m * kh >= _I32:
            return None
        if ascales.shape != (m, k // BLOCK_K) or not act.is_contiguous() or not ascales.is_contiguous():
            return None
        dev = act.get_device()          # -1 for a CPU tensor
        pa, ps = act.data_ptr(), ascales.data_ptr()
        if (pa | ps) & (PTR_ALIGN - 1) or ascales.get_device() != dev:
            return None
    if SCALE_LAYOUT_BY_ARCH.get(arch) != "logical":
        return None
    if weight.weight_format != WEIGHT_FORMATS_BY_COMPUTE[weight.compute].get(arch, "logical"):
        return None
    if dev < 0 or weight.device_index != dev:
        return None
    want = weight.lora_dtype
    if out is not None:
        if type(out) is not T or out.dtype not in halves or out.shape != (m, n) or not out.is_contiguous() \
                or out.get_device() != dev or (want is not None and out.dtype is not want):
            return None
        want = out.dtype
    if out_dtype is not None and (out_dtype is not want if want is not None else out_dtype not in halves):
        return None
    want = want or out_dtype or _bf16()
    if want not in halves:
        return None
    pl = 0
    if weight.rank:
        if type(lora_act_in) is not T or lora_act_in.dtype is not want or lora_act_in.shape != (m, weight.rank) \
                or not lora_act_in.is_contiguous() or lora_act_in.get_device() != dev:
            return None
        pl = lora_act_in.data_ptr()
        if pl & (PTR_ALIGN - 1):
            return None
    elif lora_act_in is not None:
        return None
    if out is None:
        out = empty((m, n), dtype=want, device=act.device)
    po = out.data_ptr()
    if po & (PTR_ALIGN - 1):
        return None
    pw, pws, plu, pwc, pb = weight.ptrs
    feats = (halves[want], weight.rank, weight.wcscale is not None, weight.bias is not None, "logical")
    return feats, (("m", m), ("n", n), ("k", k)), out, [pa, ps, pw, pws, pl, plu, pwc, pb, po, m, n, k, 0, 0], weight


def _bf16():
    return torch_module().bfloat16

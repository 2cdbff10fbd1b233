"""Operator ``quantize_act``: bf16/fp16 activations -> NVFP4 codes + E4M3 block scales (+ LoRA-down).

    x̂            = x · RN(1 / smooth), one rounding to x's dtype (smooth optional, [K]; or smooth_rcp, the
                   reciprocals RN(1 / smooth) themselves, from `smooth_reciprocals`: the same x̂, and the
                   kernel skips computing them)
    act, ascales = NVFP4(x̂)                        (exact rules: svdq_loader.testing.quantize_ref)
    lora_act_in  = x̂ @ lora_down                   (lora_down optional, [K, R]; fp32 accumulation)

Outputs: ``act [M, K/2]`` uint8 (low nibble = even k), ``ascales`` in the
layout the GEMM family of the device reads (`layouts.SCALE_LAYOUT_BY_ARCH`),
``lora_act_in [M, R]`` in x's dtype.
"""
from __future__ import annotations

import functools

from .layouts import SCALE_LAYOUT_BY_ARCH
from . import ranges
from .spec import PTR_ALIGN, Feature, OpSpec, distinct_k_coverage, m_k_shape_rule
from .workspace import PerCallWorkspace


SPEC = OpSpec(
    name="quantize_act",
    summary="NVFP4 activation quantization with optional smoothing and fused LoRA-down",
    host_args=(
        ("x", "ptr"), ("smooth", "ptr"), ("lora_down", "ptr"),
        ("act", "ptr"), ("ascales", "ptr"), ("lora_act_in", "ptr"), ("workspace", "ptr"),
        ("m", "i32"), ("k", "i32"), ("use_smooth", "i32"), ("ksplit", "i32"), ("ctas", "i32"),
        ("stream", "stream"),
    ),
    features=(
        Feature("dtype", "out_dtypes", ("bf16", "fp16")),
        Feature("rank", "ranks"),
        Feature("scale_layout", "arch", by_arch=SCALE_LAYOUT_BY_ARCH),
    ),
    dims=("m", "k"),
    shape_rule=m_k_shape_rule,
    requirement_keys=("k_multiple",),
    coverage_problems=distinct_k_coverage,
    wrap_launcher=lambda ln, entry: QuantizeLauncher(ln, entry),
    build_refusal=lambda switches, features: _lora_layout_refusal(switches, features),
)

# ---------------------------------------------------------------------------
# The per-call part (torch imported on first use)
# ---------------------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402

from .checks import check_devices, check_i32_sizes, check_tensor, fail, half_dtypes, torch_module  # noqa: E402
from .layouts import BLOCK_K, scale_shape  # noqa: E402


@dataclass(frozen=True)
class QuantizeCall:
    features: tuple          # (dtype, rank, scale_layout) = SPEC.feature_names
    m: int
    k: int
    use_smooth: int
    outputs: tuple           # (act, ascales, lora_act_in or None)
    pointers: dict


#: The kernel's ``use_smooth`` argument: no smoothing, `smooth` given (the kernel computes RN(1 / smooth) per k),
#: `smooth_rcp` given (the reciprocals as passed)
SMOOTH_NONE, SMOOTH_DIV, SMOOTH_RCP = 0, 1, 2


#: The build switch (its start, as the manifest's ``generator.kernel_switches`` records it) of the experiment builds
#: whose LoRA variants read lora_down in the mma fragment order (``SVDQ_KERNEL_QUANT_LORA=rk``, ``rk3``; docs/PERF.md,
#: session 57): the library refuses to call them with lora_down, and tools/quant_sweep.py passes them that layout.
LORA_FRAGMENTS_SWITCH = "SVDQ_KERNEL_QUANT_LORA=rk"


def _lora_layout_refusal(switches: str, features: tuple) -> "str | None":
    """The op's `build_refusal`: a call with LoRA (features = (dtype, rank, scale_layout)) on such a build."""
    if features[1] and LORA_FRAGMENTS_SWITCH in switches:
        return (f"an experiment build ({switches}): its quantize_act variants with LoRA read lora_down in another "
                f"layout than [K, R], which only tools/quant_sweep.py passes; rebuild without SVDQ_KERNEL_QUANT_LORA "
                f"to call quantize_act with lora_down")
    return None


def lora_fragments(lora_down):
    """lora_down [K, R] (a torch tensor) in the order the ``SVDQ_KERNEL_QUANT_LORA=rk`` kernels read it
    (`LORA_FRAGMENTS_SWITCH`): [K / 64][R / 16][4][32][8] 16-bit values, one 512-byte block per (64-k step, m-tile rt
    of the rank, 16-k block j), in which lane l = 4g + t holds the four A registers of its ``mma.m16n8k16`` fragment
    for A = lora_down^T under the kernel's k permutation (virtual k {2t, 2t + 1} = real 16t + 4j + {0, 1},
    {2t + 8, 2t + 9} = 16t + 4j + {2, 3}): (row r, k, k + 1), (r + 8, k, k + 1), (r, k + 2, k + 3),
    (r + 8, k + 2, k + 3), r = 16rt + g, k = 16t + 4j.  Real k = 64s + 16t + 4j + 2e2 + e1, rank r = 16rt + 8h + g
    -> (s, rt, j, g, t, e2, h, e1)."""
    k, r = lora_down.shape
    v = lora_down.reshape(k // 64, 4, 4, 2, 2, r // 16, 2, 8)          # (s, t, j, e2, e1, rt, h, g)
    return v.permute(0, 5, 2, 7, 1, 3, 6, 4).contiguous()             # (s, rt, j, g, t, e2, h, e1)


def smooth_reciprocals(smooth):
    """The reciprocals ``RN_D(RN32(1 / smooth))`` of smoothing factors ([K], bf16 or fp16, on any device), in
    smooth's dtype: what ``quantize_act(x, smooth_rcp=...)`` takes in place of ``smooth`` for the same result,
    bit for bit (IEEE fp32 division, then one rounding to the 16-bit type: svdq_loader.testing.quantize_ref's
    rule).  Make them once per set of factors (they are weights); the kernel then skips the per-step
    reciprocal."""
    dts = half_dtypes()
    check_tensor("smooth", smooth, dtype=tuple(dts), ndim=1)
    return (1.0 / smooth.float()).to(smooth.dtype)


def plan_call(arch: str, x, *, smooth=None, lora_down=None, out_act=None, out_scales=None,
              out_lora=None, smooth_rcp=None) -> QuantizeCall:
    torch = torch_module()
    dts = half_dtypes()
    check_tensor("x", x, dtype=tuple(dts), ndim=2)
    m, k = x.shape
    if m < 1 or k < 1:
        fail(f"x must be non-empty [M, K], got shape {tuple(x.shape)}")
    if k % BLOCK_K:
        fail(f"K = x.shape[1] = {k} must be a multiple of {BLOCK_K} (one scale per {BLOCK_K} k)")
    check_i32_sizes(M_times_K_elements=m * k)
    use_smooth = SMOOTH_NONE
    if smooth is not None and smooth_rcp is not None:
        fail("smooth and smooth_rcp were both given: pass the smoothing factors (smooth) or their reciprocals "
             "(smooth_rcp = smooth_reciprocals(smooth)), not both")
    if smooth is not None:
        check_tensor("smooth", smooth, dtype=x.dtype, ndim=1, shape=(k,))
        use_smooth = SMOOTH_DIV
    elif smooth_rcp is not None:
        check_tensor("smooth_rcp", smooth_rcp, dtype=x.dtype, ndim=1, shape=(k,))
        smooth, use_smooth = smooth_rcp, SMOOTH_RCP
    rank = 0
    if lora_down is not None:
        check_tensor("lora_down", lora_down, dtype=x.dtype, ndim=2, shape=(k, None))
        rank = int(lora_down.shape[1])
        if rank < 1 or rank % 16:
            fail(f"LoRA rank R = lora_down.shape[1] = {rank} must be a positive multiple of 16")
    elif out_lora is not None:
        fail("out_lora was given but lora_down was not: there is no LoRA-down product to write")
    layout = SCALE_LAYOUT_BY_ARCH.get(arch, "logical")
    s_shape = scale_shape(layout, m, k)
    if out_act is not None:
        check_tensor("out_act", out_act, dtype=torch.uint8, ndim=2, shape=(m, k // 2))
    if out_scales is not None:
        if isinstance(out_scales, torch.Tensor) and tuple(out_scales.shape) != s_shape:
            fail(f"out_scales has shape {tuple(out_scales.shape)} but on {arch} quantize_act writes the {layout} "
                 f"scale layout the GEMM reads, shape {s_shape} for M={m}, K={k}")
        check_tensor("out_scales", out_scales, dtype=torch.float8_e4m3fn, ndim=len(s_shape), shape=s_shape)
    if out_lora is not None:
        check_tensor("out_lora", out_lora, dtype=x.dtype, ndim=2, shape=(m, rank))
    check_devices({"x": x, "smooth_rcp" if use_smooth == SMOOTH_RCP else "smooth": smooth, "lora_down": lora_down,
                   "out_act": out_act, "out_scales": out_scales, "out_lora": out_lora})
    dev = x.device
    if out_act is None:
        out_act = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    if out_scales is None:
        out_scales = torch.empty(s_shape, dtype=torch.float8_e4m3fn, device=dev)
    if rank and out_lora is None:
        out_lora = torch.empty((m, rank), dtype=x.dtype, device=dev)
    ptrs = dict(
        x=x.data_ptr(), smooth=smooth.data_ptr() if smooth is not None else 0,
        lora_down=lora_down.data_ptr() if lora_down is not None else 0,
        act=out_act.data_ptr(), ascales=out_scales.data_ptr(),
        lora_act_in=out_lora.data_ptr() if out_lora is not None else 0,
    )
    return QuantizeCall((dts[x.dtype], rank, layout), m, k, use_smooth, (out_act, out_scales, out_lora), ptrs)


# ---------------------------------------------------------------------------
# The hot path: the same rules as plan_call, checked in one pass
# ---------------------------------------------------------------------------

#: Most CTAs of one row tile that split its K (the cluster size; 8 is the portable limit).
KSPLIT_MAX = 8
#: k one step of a CTA's four warps covers (64 k per warp step)
_CTA_STEP_K = 64 * 4
#: Without LoRA, 8 CTAs per tile where each warp still gets at least this many steps (session 10)
_MIN_WARP_STEPS_AT_8 = 6
#: With LoRA, the split doubles while twice the CTAs stay resident, at this many per SM (session 14)
_LORA_CTAS_PER_SM = 3
#: With LoRA and more tiles than half the resident CTAs, K from which 2 CTAs per tile pay (session 15)
_LORA_SPLIT_MIN_K = 8192
#: With LoRA, each warp gets at least this many steps of its tile's K.  H100, CUDA-graph timing (docs/PERF.md,
#: session 36): at M = 256, K = 3072 four CTAs per tile (3 steps per warp) took 5.2 µs, eight (1.5) 6.0, two 6.6
_LORA_MIN_WARP_STEPS = 3
#: The cluster splits whose residency the launcher asks the driver for (`QuantizeLauncher.cluster_facts`)
CLUSTER_SPLITS = (2, 4, 8)


@functools.lru_cache(maxsize=4096)
def ksplit_for(m: int, k: int, rank: int, sm_count: int, clusters: tuple | None = None) -> int:
    """CTAs (one cluster along K) per row tile of the launch, from M, K, the rank and the SM count.  It counts
    16-row tiles of M and, with LoRA, three CTAs per SM, the one-m-tile variants it was fitted on; the two-m-tile
    variants (32-row tiles) take its answer as is, which is how they were timed (docs/PERF.md, session 37).

    The H200 sweeps of docs/PERF.md.  With LoRA (3 CTAs of 4 warps per SM): where twice the tiles fit
    in the resident CTAs, the largest split whose CTAs, twice over, stay within them (M = 1024: 4, 5-9 %
    faster than 2 at every K; M <= 256: 8; session 14); above that, 2 CTAs per tile only where K is large and
    the tiles fit in two rounds of the resident CTAs, else 1 (session 15: at M = 9216 / 18432, K = 3072 one
    CTA per tile is 9 / 17 % faster than two, at M = 18432, K = 12288 3 % faster; at M = 4608 and 9216 with
    K = 12288 two are 3-11 % faster; at M = 4608, K = 3072 the two tie).  Without LoRA (4 CTAs per SM) 4 per
    tile, 8 where K gives every warp at least 6 steps at 8 (K >= 12288 at M = 4608: 7-8 % faster than 4; at
    K = 3072, 4 stays fastest; session 10), or as many as keep two CTAs per SM.  A power of two, at most
    KSPLIT_MAX, at most one per step of a warp, with LoRA at most one per `_LORA_MIN_WARP_STEPS` steps.

    `clusters`: ((split, clusters of that many CTAs the device holds at once), ...), the driver's count
    (`QuantizeLauncher.cluster_facts`).  A cluster's CTAs share one GPC, so fewer clusters of 4 or 8 fit than the
    resident CTAs suggest (H100, rank 32: 92 of 4 and 45 of 8, against 396 CTAs); a split meant to fit in one
    round is not taken where the launch's clusters do not all fit (session 36: M = 1536, K = 3072, 96 clusters
    of 4 took 13.6 µs, 96 of 2 10.1).  None (no driver, e.g. on the CPU): every resident CTA counts.
    Memoised: the loader asks on every call, with the cache key's own values.
    """
    tiles = -(-m // 16)
    fit = dict(clusters or ())

    def fits(split: int) -> bool:
        return tiles <= fit.get(split, tiles)

    cap = k // _CTA_STEP_K                           # one split per step of a CTA's warps at most
    if rank:
        fill = _LORA_CTAS_PER_SM * sm_count
        if tiles * 2 > fill:                         # many tiles: the split only pays at large K, in two rounds
            s = 2 if k >= _LORA_SPLIT_MIN_K and tiles <= 2 * fill else 1
        else:
            s = 2 if fits(2) else 1
            while 1 < s < KSPLIT_MAX and tiles * 2 * s <= fill and fits(2 * s):
                s *= 2
        cap //= _LORA_MIN_WARP_STEPS
    else:
        s = 8 if k >= _CTA_STEP_K * 8 * _MIN_WARP_STEPS_AT_8 else 4
        while s > 1 and not fits(s):
            s //= 2
        while 1 < s < KSPLIT_MAX and tiles * 2 * s <= 2 * sm_count and fits(2 * s):
            s *= 2
    while s > 1 and s > cap:
        s //= 2
    return s


# ---------------------------------------------------------------------------
# The range form's arithmetic (the ranges themselves and the counters: `ranges`, shared with the GEMM's stream-K
# schedule), for the loader and tests on Python ints.  U = tiles * (K / 64) units, unit u = tile * steps + step.
# ---------------------------------------------------------------------------

def tile_count(m: int, tile_rows: int, blocked: bool) -> int:
    """Row tiles of an M-row launch: M (``logical`` scales) or M rounded up to 128 (``blocked``) rows."""
    rows = -(-m // 128) * 128 if blocked else m
    return -(-rows // tile_rows)


def range_ctas(tiles: int, k: int, fill: int) -> int:
    """CTAs of a range launch: whole waves of `fill` CTAs, at least one per tile (so a CTA spans at most two
    tiles), at most one per (tile, 64-k step) unit."""
    return max(tiles, min(-(-tiles // fill) * fill, tiles * (k // 64)))


def workspace_bytes(ctas: int, tile_rows: int, rank: int) -> int:
    """Bytes of the workspace a ``ctas``-CTA range launch needs (0 without LoRA: no sums to meet)."""
    if not rank:
        return 0
    return ranges.workspace_bytes(ctas, tile_rows * rank * 4)


#: Without LoRA the range form serves from this many row tiles (M >= 256) up: 2-22 % less time than the best
#: cluster split at M = 1024-18432; at M = 256 equal to the rule's split at K = 3072 and 19 % less at K = 15360
#: (H200, docs/PERF.md, session 18)
RANGE_MIN_TILES_NO_LORA = 16
#: With LoRA the range form pays only where its split tiles are few against their length: K from this up, and
#: either more tiles than half the resident CTAs but no more than them (there a 2-CTA split needs two rounds), or
#: more tiles than a quarter of them where a 2-CTA split's one round would leave more than a quarter idle.
#: Session 18 (H200): M = 4608, K = 12288 / 15360 3 / 6 % faster than the best cluster split, at K = 3072 10 %
#: slower, at M = 9216 4-5 % slower.  Session 36 (H100, CUDA-graph timing, ranks 16 and 32, against the 2-CTA
#: split): M = 1792 / 2048 (57 / 65 % of the resident CTAs busy at 2) up to 17 % faster (one point 1.5 %
#: slower); M = 2560 / 3072 (81 / 97 %) 4-10 % slower; M = 1280 and below 20-29 % slower; M = 1536 (48 %, a
#: quarter in tiles) -2 / +4 %
RANGE_MIN_K_LORA = 8192


def range_pays(tiles: int, k: int, rank: int, fill: int) -> bool:
    """Whether the range form (ksplit 1, whole waves of resident CTAs) beats the cluster split: the sweeps of
    docs/PERF.md, sessions 18 and 36.  `fill`: the CTAs the SMs hold at once."""
    if not rank:
        return tiles >= RANGE_MIN_TILES_NO_LORA
    return k >= RANGE_MIN_K_LORA and (fill < 2 * tiles <= 2 * fill or fill < 4 * tiles and 8 * tiles < 3 * fill)


@functools.lru_cache(maxsize=4096)
def schedule(m: int, k: int, rank: int, sm_count: int, resident: int, tile_rows: int, blocked: bool,
             clusters: tuple | None = None) -> tuple[int, int, int]:
    """``(ksplit, ctas, workspace bytes)`` of a launch.  The range form (`range_pays`): ksplit 1 and ``ctas`` =
    whole waves of the `resident` CTAs per SM, each CTA taking an equal range of the (row tile, 64-k step)
    units, at least one tile's worth (``ctas >= tiles``, which keeps a CTA within two tiles), with a workspace
    where that splits tiles and there are LoRA sums to add.  Else the cluster form: `ksplit_for` CTAs per
    tile (one at 1; `clusters` as there), ``tiles * ksplit`` CTAs.  Memoised."""
    tiles = tile_count(m, tile_rows, blocked)
    fill = max(1, resident) * sm_count
    if range_pays(tiles, k, rank, fill):
        ctas = range_ctas(tiles, k, fill)
        return 1, ctas, workspace_bytes(ctas, tile_rows, rank) if ctas > tiles else 0
    s = ksplit_for(m, k, rank, sm_count, clusters)
    return s, tiles * s, 0


class QuantizeLauncher(PerCallWorkspace):
    """The launcher of a ``quantize_act`` variant: sizes the grid (`schedule`, from the device's SM count, how
    many of the variant's CTAs an SM holds and how many clusters of each split the device holds, asked of the
    driver once) and, where a range launch splits row tiles over CTAs, takes the workspace its CTAs meet in
    (`workspace`: per call, from torch's caching allocator).  The workspace needs no zeroing (the kernel's
    counters recognise their own words).  Same interface as `Launcher`."""

    def __init__(self, inner, entry):
        self.inner = inner
        self.name = inner.name
        self.device = inner.device
        kn = entry.knobs
        self.rank = int(kn["rank"])
        self.tile_rows = 16 * int(kn["mtiles"])
        self.threads = 32 * int(kn["warps"])
        self.blocked = kn["scale_layout"] == "blocked"
        self._smem = int(entry.smem_bytes)
        self._plans: dict = {}       # (m, k) -> schedule(...): one dict lookup per call
        # asked once, here: the library makes launchers outside graph capture only (it refuses to load then)
        self._grid = self.grid_facts()
        self._clusters = self.cluster_facts()

    def grid_facts(self) -> tuple[int, int]:
        """(SM count, CTAs of this variant one SM holds at once) on the launcher's device."""
        from .. import driver
        ordinal = getattr(self.device, "ordinal", 0)
        sym = next(iter(self.inner.kernels))
        return (driver.device_attribute(driver.MULTIPROCESSOR_COUNT, ordinal),
                self.device.resident_blocks(sym, self.threads, self._smem))

    def cluster_facts(self) -> tuple | None:
        """((split, clusters of that many CTAs the device holds at once), ...) for the splits `CLUSTER_SPLITS`,
        from the driver (`ksplit_for` takes a split only where a launch's clusters all fit); None where the
        driver cannot say (the split then counts every resident CTA, as before it asked)."""
        from .. import driver
        sym = next(iter(self.inner.kernels))
        try:
            return tuple((s, self.device.resident_clusters(sym, self.threads, self._smem, s)) for s in CLUSTER_SPLITS)
        except driver.CudaError:
            return None

    def plan(self, m: int, k: int) -> tuple[int, int, int]:
        """(ksplit, ctas, workspace bytes) of an M x K call on this launcher's device (`schedule`)."""
        sms, resident = self._grid
        p = schedule(m, k, self.rank, sms, resident, self.tile_rows, self.blocked, self._clusters)
        if len(self._plans) >= 4096:
            self._plans.clear()
        self._plans[(m, k)] = p
        return p

    def launch(self, args) -> None:
        key = (args[_M_INDEX], args[_K_INDEX])
        ks, ctas, nbytes = self._plans.get(key) or self.plan(*key)
        args[KSPLIT_INDEX] = ks
        args[CTAS_INDEX] = ctas
        if nbytes:
            ws = self._alloc(nbytes)
            args[WORKSPACE_INDEX] = ws.data_ptr()
            self.inner.launch(args)
            del ws
        else:                      # no tile split: the kernel never reads the workspace pointer
            self.inner.launch(args)


_FAST_ORDER = ("x", "smooth", "lora_down", "act", "ascales", "lora_act_in", "workspace", "m", "k", "use_smooth",
               "ksplit", "ctas", "stream")
if SPEC.arg_names != _FAST_ORDER:  # pragma: no cover - a spec edit must update the fast path too
    raise ImportError(f"quantize_act: fast_args builds {_FAST_ORDER} but the spec's host args are {SPEC.arg_names}")
STREAM_INDEX = _FAST_ORDER.index("stream")
LORA_INDEX = _FAST_ORDER.index("lora_down")
KSPLIT_INDEX = _FAST_ORDER.index("ksplit")
CTAS_INDEX = _FAST_ORDER.index("ctas")
WORKSPACE_INDEX = _FAST_ORDER.index("workspace")
_M_INDEX, _K_INDEX = _FAST_ORDER.index("m"), _FAST_ORDER.index("k")
_fast_consts = None


def _consts():
    global _fast_consts
    torch = torch_module()
    _fast_consts = (torch.Tensor, half_dtypes(), torch.empty, torch.uint8, torch.float8_e4m3fn)
    return _fast_consts


def fast_args(arch: str, x, smooth, lora_down, out_act=None, out_scales=None, out_lora=None, smooth_rcp=None):
    """``(features, dims, outputs, args)`` when every rule of `plan_call` holds.

    None never means "invalid": the caller then runs `plan_call`, which
    raises the precise error (or accepts what this one-pass check leaves out).
    """
    T, halves, empty, u8, f8 = _fast_consts or _consts()
    if type(x) is not T or x.dim() != 2:
        return None
    dt = x.dtype
    name = halves.get(dt)
    layout = SCALE_LAYOUT_BY_ARCH.get(arch)
    m, k = x.shape
    if name is None or layout is None or m < 1 or k < 1 or k % BLOCK_K or m * k >= 1 << 31 \
            or not x.is_contiguous():
        return None
    dev = x.get_device()
    px = x.data_ptr()
    ps = pd = 0
    mode = SMOOTH_DIV
    if smooth_rcp is not None:
        if smooth is not None:
            return None
        smooth, mode = smooth_rcp, SMOOTH_RCP
    if smooth is not None:
        if type(smooth) is not T or smooth.dtype is not dt or smooth.shape != (k,) or not smooth.is_contiguous() \
                or smooth.get_device() != dev:
            return None
        ps = smooth.data_ptr()
    rank = 0
    if lora_down is not None:
        if type(lora_down) is not T or lora_down.dtype is not dt or lora_down.dim() != 2 \
                or lora_down.shape[0] != k or not lora_down.is_contiguous() or lora_down.get_device() != dev:
            return None
        rank = lora_down.shape[1]
        if rank < 1 or rank % 16:
            return None
        pd = lora_down.data_ptr()
    if dev < 0 or (px | ps | pd) & (PTR_ALIGN - 1):
        return None
    s_shape = scale_shape(layout, m, k)
    if out_act is None:
        out_act = empty((m, k // 2), dtype=u8, device=x.device)
    elif type(out_act) is not T or out_act.dtype is not u8 or out_act.shape != (m, k // 2) \
            or not out_act.is_contiguous() or out_act.get_device() != dev:
        return None
    if out_scales is None:
        out_scales = empty(s_shape, dtype=f8, device=x.device)
    elif type(out_scales) is not T or out_scales.dtype is not f8 or out_scales.shape != s_shape \
            or not out_scales.is_contiguous() or out_scales.get_device() != dev:
        return None
    pl = 0
    if rank:
        if out_lora is None:
            out_lora = empty((m, rank), dtype=dt, device=x.device)
        elif type(out_lora) is not T or out_lora.dtype is not dt or out_lora.shape != (m, rank) \
                or not out_lora.is_contiguous() or out_lora.get_device() != dev:
            return None
        pl = out_lora.data_ptr()
    elif out_lora is not None:
        return None
    pa, pc = out_act.data_ptr(), out_scales.data_ptr()
    if (pa | pc | pl) & (PTR_ALIGN - 1):
        return None
    args = [px, ps, pd, pa, pc, pl, 0, m, k, mode if ps else SMOOTH_NONE, 1, 1, 0]
    return (name, rank, layout), (("m", m), ("k", k)), (out_act, out_scales, out_lora), args

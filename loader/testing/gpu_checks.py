"""One GPU numerics check per operator call, shared by the GPU tests and ``svdq-aot selftest``.

* `gemm_case`: fresh random W4A4 problem (``reference.random_problem``), output poisoned with NaN
  inside a larger buffer with guard rows, one call through the loader, compared with the float64
  reference (``reference.reference_torch_f64``, computed independently on the GPU).  On an arch
  whose GEMM reads the blocked scale layout, the activation scales are converted with
  ``ops.blackwell_weight.to_blocked_scales`` (the documented conversion for logical-layout callers)
  and the weight goes through ``lib.prepare_weight``.
* `quantize_case`: ``quantize_act`` bit for bit against ``quantize_ref.quantize_act_ref_torch``
  (codes and scales), ``lora_act_in`` within the output rounding; caller-provided outputs poisoned
  (0xFF / NaN) inside larger buffers whose tails must stay untouched.
* `decode_case`: a ``decode_act`` variant bit for bit against ``reference.reference_images``.
* ``gemm_case(..., compute="fp8")``: the FP8-compute mode (op ``gemm_w4a4_fp8``) against its own float64
  reference (``fp8_reference.reference_torch_f64_fp8``, on the GPU), at the exact mode's tolerance;
  `act_fp8_case`: its pre-pass bit for bit against ``fp8_reference.reference_act_fp8_workspace``.

Each returns a `CaseResult` (never raises on a wrong result; the caller asserts or tabulates).
Needs torch and a CUDA GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import reference as ref
from .quantize_ref import quantize_act_ref_torch

GEMM_TOL = {"bf16": 1e-2, "fp16": 2e-3}
LORA_TOL = {"bf16": 4e-3, "fp16": 1e-3}     # relative (norm) error of lora_act_in: output rounding only
GUARD = 64


@dataclass
class CaseResult:
    ok: bool
    what: str                 # the case, with its seed
    error: float              # relative error (GEMM, lora_act_in) or differing bytes (codes + scales)
    tol: float
    seconds: float            # GPU time of one call (CUDA events), after the checked call
    problems: list = field(default_factory=list)

    @property
    def message(self) -> str:
        return f"{self.what}: " + ("; ".join(self.problems) if self.problems else "ok")


def _torch():
    import torch
    return torch


def _dtypes():
    torch = _torch()
    return {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_scale_layout(device=None) -> str:
    """The scale layout the GEMM of the current (or given) device reads."""
    from svdq_loader.driver import device_arch
    from svdq_loader.ops.layouts import SCALE_LAYOUT_BY_ARCH
    torch = _torch()
    idx = torch.cuda.current_device() if device is None else device
    return SCALE_LAYOUT_BY_ARCH.get(device_arch(idx), "logical")


def _gpu_seconds(fn, reps: int = 3) -> float:
    torch = _torch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _fp8_expect(p):
    """The FP8-compute mode's float64 reference of problem `p`, computed with torch on the GPU
    (``fp8_reference.reference_torch_f64_fp8``: the rules of the numpy statement, which tests/test_fp8_reference.py
    checks it against, with torch's own E4M3 cast: independent of the kernel)."""
    from .fp8_reference import reference_torch_f64_fp8
    return reference_torch_f64_fp8(p["act"], p["wgt"], p["ascales"], p["wscales"], lora_act_in=p.get("lora_act_in"),
                                   lora_up=p.get("lora_up"), wcscale=p.get("wcscale"), bias=p.get("bias"))


def gemm_case(lib, m, n, k, r, dt, wc, b, seed, *, prepared=False, base_seed=0, time_it=False,
              compute="exact") -> CaseResult:
    torch = _torch()
    seed = (seed * 1000003 + base_seed) % (2**31)
    what = f"gemm M={m} N={n} K={k} R={r} {dt} wcscale={wc} bias={b} prepared={prepared} compute={compute} seed={seed}"
    p = ref.random_problem(m, n, k, r, seed=seed, out_dtype=dt, wcscale=wc, bias=b, device="cuda")
    if compute == "fp8":
        expect = _fp8_expect(p)                      # float64, on the GPU, independent of the kernel
        prepared = True                              # the mode's weight comes from prepare_weight(compute="fp8")
    else:
        expect = ref.reference_torch_f64(**p)        # float64, on the GPU, independent of the kernel
    ascales = p["ascales"]
    if device_scale_layout() == "blocked":
        from svdq_loader.ops.blackwell_weight import to_blocked_scales
        ascales = to_blocked_scales(ascales)
        prepared = True                              # the weight format of this arch comes from prepare_weight
    buf = torch.full((m + 3, n), float("nan"), dtype=_dtypes()[dt], device="cuda")
    out = buf[:m]
    kw = dict(lora_act_in=p.get("lora_act_in"), out=out)
    if prepared:
        w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p.get("lora_up"), wcscale=p.get("wcscale"),
                               bias=p.get("bias"), compute=compute)

        def call():
            return lib.gemm_w4a4(p["act"], w, ascales, **kw)
    else:
        def call():
            return lib.gemm_w4a4(p["act"], p["wgt"], ascales, p["wscales"], lora_up=p.get("lora_up"),
                                 wcscale=p.get("wcscale"), bias=p.get("bias"), **kw)
    y = call()
    torch.cuda.synchronize()
    problems = []
    if y.data_ptr() != out.data_ptr():
        problems.append("the result is not in the caller's out tensor")
    nan = int(torch.isnan(y).sum())
    if nan:
        problems.append(f"{nan} output elements never written (still NaN)")
    if not torch.isnan(buf[m:]).all():
        problems.append("kernel wrote past row M into the guard rows")
    yd = y.double()
    rel = float(torch.linalg.vector_norm(torch.nan_to_num(yd) - expect) / torch.linalg.vector_norm(expect))
    tol = GEMM_TOL[dt]
    if not rel <= tol:
        problems.append(f"relative error {rel:.3e} > {tol:.0e}")
    secs = _gpu_seconds(call) if time_it and not problems else float("nan")
    return CaseResult(not problems, what, rel, tol, secs, problems)


def make_x(m, k, dt, g, special=False):
    """Rows with groups over many binades; `special` adds tie / zero / subnormal-scale groups."""
    torch = _torch()
    mag = torch.exp2(torch.empty(m, k // 16, 1).uniform_(-10, 6, generator=g))
    x = (torch.randn(m, k // 16, 16, generator=g) * mag).reshape(m, k)
    if special:
        ties = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
        gcount = k // 16
        for r in range(m):
            gi = (r * 7) % gcount
            kind = r % 5
            scale = {0: 2.0 ** ((r % 9) - 4), 1: 0.0, 2: 2.0**-10, 3: 2.0**-12, 4: 2.0**-9}[kind]
            x[r, 16 * gi:16 * gi + 16] = ties * scale
        if k >= 32:
            x[0, 16:32] = 1e-40 if dt == "bf16" else 2.0**-24          # fp32-subnormal / fp16-subnormal inputs
    return x.to(_dtypes()[dt])


def quantize_case(lib, m, k, dt, use_smooth, r, seed, *, base_seed=0, special=False, use_outs=True,
                  time_it=False):
    """Returns ``(CaseResult, (act, asc, lai), (a_ref, s_ref, l_ref), (x, smooth, lora_down))``.  `use_smooth`: 0
    (False) none, 1 (True) `smooth`, 2 its reciprocals as ``smooth_rcp`` (the reference from `smooth` itself)."""
    torch = _torch()
    DT = _dtypes()
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1000003 + base_seed) % (2**63))
    x = make_x(m, k, dt, g, special).cuda()
    smooth = (torch.rand(k, generator=g) * 3.75 + 0.25).to(DT[dt]).cuda() if use_smooth else None
    lora_down = (torch.randn(k, r, generator=g) / k**0.5).to(DT[dt]).cuda() if r else None
    a_ref, s_ref, l_ref = quantize_act_ref_torch(x, smooth, lora_down, device_scale_layout())
    what = (f"quantize_act M={m} K={k} {dt} smooth={int(use_smooth)} R={r} special={special} seed={seed} "
            f"base={base_seed}")

    act_buf = torch.full((m * k // 2 + GUARD,), 0xFF, dtype=torch.uint8, device="cuda")
    asc_buf = torch.full((s_ref.numel() + GUARD,), 0xFF, dtype=torch.uint8, device="cuda")
    lai_buf = torch.full((m * r + GUARD,), float("nan"), dtype=DT[dt], device="cuda") if r else None
    outs = (act_buf[: m * k // 2].view(m, k // 2), asc_buf[: s_ref.numel()].view(s_ref.shape),
            None if not r else lai_buf[: m * r].view(m, r))

    sm = dict(smooth=smooth) if use_smooth != 2 else dict(smooth_rcp=lib.smooth_reciprocals(smooth))

    def call():
        if not use_outs:
            return lib.quantize_act(x, lora_down=lora_down, **sm)
        return lib.quantize_act(x, lora_down=lora_down, out_act=outs[0],
                                out_scales=outs[1].view(torch.float8_e4m3fn), out_lora=outs[2], **sm)
    act, asc, lai = call()
    torch.cuda.synchronize()
    problems = []
    act_h = act.view(torch.uint8).cpu().reshape(m, k // 2)
    asc_h = asc.view(torch.uint8).cpu().reshape(s_ref.shape)
    bad_a = int((act_h != a_ref).sum())
    bad_s = int((asc_h != s_ref).sum())
    if bad_s:
        problems.append(f"{bad_s} scale bytes differ from the reference")
    if bad_a:
        problems.append(f"{bad_a} code bytes differ from the reference")
    if use_outs:
        if act.data_ptr() != act_buf.data_ptr() or asc.data_ptr() != asc_buf.data_ptr():
            problems.append("results are not in the caller's buffers")
        if not (act_buf[m * k // 2:] == 0xFF).all():
            problems.append("act written past its end")
        if not (asc_buf[s_ref.numel():] == 0xFF).all():
            problems.append("ascales written past its end")
    err = float(bad_a + bad_s)
    tol = 0.0
    if r:
        if lai is None or lai.shape != (m, r) or lai.dtype != DT[dt]:
            problems.append(f"lora_act_in missing or mis-shaped: {None if lai is None else (lai.shape, lai.dtype)}")
        else:
            ld = lai.double().cpu()
            if not torch.isfinite(ld).all():
                problems.append("lora_act_in has non-finite values")
            rel = float(torch.linalg.vector_norm(ld - l_ref) / torch.linalg.vector_norm(l_ref).clamp_min(1e-30))
            if not rel <= LORA_TOL[dt]:
                problems.append(f"lora_act_in relative error {rel:.2e} > {LORA_TOL[dt]:.0e}")
            if not problems:
                err, tol = rel, LORA_TOL[dt]
            if use_outs and not torch.isnan(lai_buf[m * r:]).all():
                problems.append("lora_act_in written past its end")
    elif lai is not None:
        problems.append("lora_act_in returned although R = 0")
    secs = _gpu_seconds(call) if time_it and not problems else float("nan")
    res = CaseResult(not problems, what, err, tol, secs, problems)
    return res, (act, asc, lai), (a_ref, s_ref, l_ref), (x, smooth, lora_down)


def decode_case(lib, entry, m, k, seed, *, base_seed=0, time_it=False) -> CaseResult:
    """The ``decode_act`` variant `entry` on a fresh random act / ascales (every code, scales over the whole
    finite E4M3 range, both signs), bit for bit against ``reference.reference_images``; the image buffer is
    poisoned (0xFF) inside a larger one whose tail must stay untouched."""
    import numpy as np
    seed = (seed * 1000003 + base_seed) % (2**31)
    what = f"decode_act M={m} K={k} seed={seed}"
    rng = np.random.default_rng(seed)
    act_h = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    asc_h = (rng.integers(0, 0x7F, (m, k // 16), dtype=np.uint8) | (rng.integers(0, 2, (m, k // 16),
                                                                                dtype=np.uint8) << 7))
    want = ref.reference_images(act_h, asc_h)
    return _prepass_case(lib, entry, m, k, act_h, asc_h, want, what, "image", time_it)


def _prepass_case(lib, entry, m, k, act_h, asc_h, want, what: str, noun: str, time_it: bool) -> CaseResult:
    """Launch the pre-pass variant `entry` on (act_h, asc_h) into a buffer poisoned with 0xFF and longer than its
    output, and compare the output with `want` byte for byte; the tail must stay untouched."""
    import numpy as np
    torch = _torch()
    act = torch.from_numpy(act_h).cuda()
    asc = torch.from_numpy(asc_h).cuda().view(torch.float8_e4m3fn)
    nb = want.size
    buf = torch.full((nb + GUARD,), 0xFF, dtype=torch.uint8, device="cuda")
    ln = lib._launcher(entry.name, torch.cuda.current_device(), False)

    def call():
        ln.launch([act.data_ptr(), asc.data_ptr(), buf.data_ptr(), m, k, torch.cuda.current_stream().cuda_stream])
    call()
    torch.cuda.synchronize()
    got = buf.cpu().numpy()
    problems = []
    bad = int((got[:nb] != want).sum())
    if bad:
        first = int(np.flatnonzero(got[:nb] != want)[0])
        problems.append(f"{bad} {noun} bytes differ from the reference (first at byte {first})")
    if not (got[nb:] == 0xFF).all():
        problems.append(f"{noun} written past its end")
    secs = _gpu_seconds(call) if time_it and not problems else float("nan")
    return CaseResult(not problems, what, float(bad), 0.0, secs, problems)


def act_fp8_case(lib, entry, m, k, seed, *, base_seed=0, time_it=False) -> CaseResult:
    """The ``act_fp8`` variant `entry` on a fresh random act / ascales (every code, scales over the whole finite
    non-negative E4M3 range, one row of zero scales), bit for bit against
    ``fp8_reference.reference_act_fp8_workspace``; the workspace is poisoned (0xFF) inside a larger buffer whose
    tail must stay untouched."""
    import numpy as np
    from .fp8_reference import reference_act_fp8_workspace
    seed = (seed * 1000003 + base_seed) % (2**31)
    what = f"act_fp8 M={m} K={k} seed={seed}"
    rng = np.random.default_rng(seed)
    act_h = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    asc_h = rng.integers(0, 0x7F, (m, k // 16), dtype=np.uint8)
    asc_h[m // 2] = 0
    want = reference_act_fp8_workspace(act_h, asc_h)
    return _prepass_case(lib, entry, m, k, act_h, asc_h, want, what, "workspace", time_it)

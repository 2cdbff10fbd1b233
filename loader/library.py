"""`load(path)`: verified artifacts -> per-(variant, device) launchers -> the operators.

Order of work, so that a bad artifact or a wrong device fails early and
cleanly:
  1. `verify.open_artifacts`: manifest (schema, checksum), every file's
     SHA-256, host programs parsed, every fact cross-checked against the
     bytes (no CUDA call; works on a machine with no GPU);
  2. per call: the op's `plan_call` checks the tensors (metadata only),
     one cached lookup of (problem, device) gives the launcher, which fills
     the parameters and calls `cuLaunchKernelEx` on the caller's current
     torch stream;
  3. the first time a variant is needed on a device: its arch and shared
     memory are checked against the device, then the cubin is loaded there
     (`cuLibraryLoadData`, context independent) and the DSL's own per-device
     load function is replayed (kernel attributes).

Selection follows the manifest's rules, except where the artifact
directory's tuning table (``tuning.json``, written by `svdq-aot tune` and
verified with everything else) has an entry for the problem measured on
this device's GPU model: then its winner is used.  On another GPU model the
entry is ignored, with one logged notice per process.
"""
from __future__ import annotations

import contextlib
import os
import threading

from . import cuda_versions, driver, select, tuning_table
from .errors import CaptureError, DeviceMismatch, InvalidArgument, NoCuda
from .launcher import Launcher
from .ops import (OPS, WORKSPACE_BYTES_BY_PREPASS, decode_act as decode_op, gemm_w4a4 as gemm_op, op_spec,
                  quantize_act as quant_op)
from .ops.act_fp8 import E4m3Act
from .verify import open_artifacts

_GEMM_SMS = gemm_op.SM_COUNT_INDEX
_GEMM_STREAM = gemm_op.STREAM_INDEX
_QUANT_STREAM = quant_op.STREAM_INDEX
try:  # the class of a plain tensor, for the hot path's device lookup (torch is optional at import)
    from torch import Tensor as _Tensor
except ImportError:  # pragma: no cover
    _Tensor = None


class Library:
    """Artifacts loaded from one directory.  Thread-safe; launches go on the caller's current stream."""

    def __init__(self, path: str, tuning=True):
        self.path = os.path.abspath(path)
        arts = open_artifacts(self.path, tuning)
        self.manifest = arts.manifest
        self.tuning = arts.tuning                 # the verified tuning table, or None
        self._gpu: dict[int, tuning_table.GpuId] = {}
        self._verified = arts.variants
        self._lock = threading.Lock()
        self._launchers: dict[tuple[str, int], Launcher] = {}   # what calls of (variant, device) launch
        self._kernel_lns: dict[tuple[str, int], Launcher] = {}  # one kernel launcher per (variant, device)
        self._arch: dict[int, str] = {}           # device ordinal -> arch
        self._sms: dict[int, int] = {}            # device ordinal -> SM count
        self._choice: dict[tuple, Launcher] = {}  # (op, ordinal, features, dims) -> launcher
        self.rules = self.manifest.rules          # (op, arch, family) -> selection rule (select_rules)
        self._arg_order = {op: spec.arg_names for op, spec in OPS.items()}

    # -- introspection -----------------------------------------------------
    @property
    def variants(self):
        return [v.entry for v in self._verified.values()]

    def explain(self, op: str, arch: str | None = None, features: tuple | None = None, *, gpu=None,
                sm_count: int | None = None, **kw) -> select.Explanation:
        """Why selection picks what it picks for a problem: `select.Explanation` (`.chosen`, `.why`,
        `.rejected`, `.text()`, `.to_dict()`); no CUDA call.

            lib.explain("gemm_w4a4", "sm_90a", m=4608, n=3072, k=12288, rank=32, dtype="bf16")
            lib.explain("gemm_w4a4", "sm_90a", ("bf16", 32, True, True, "logical"), m=77, n=256, k=256)

        `arch` defaults to the one arch the artifacts build `op` for.  Without `features`, the keywords
        ``dtype``, ``rank``, ``wcscale``, ``bias`` name them (defaults bf16, 0, True, True).
        `gpu`: the GPU model to explain for when a tuning table is present (a name, a
        `tuning_table.GpuId`, or ``lib.device_gpu(ordinal)``); None assumes the table's own GPU and
        says so.  ``.source`` says whether the rules or the tuning table chose.  `sm_count`: the SMs the
        grid-fill preferences assume (default: `gpu`'s, else `select.DEFAULT_SM_COUNT`, said in ``.why``).
        When no variant fits it raises UnsupportedProblem, whose ``.explanation`` holds the same record.
        """
        arch = arch or self.default_arch(op)
        if features is None:
            p = select.problem_for(op, arch, **kw)
        else:
            p = select.Problem(op, arch, tuple(features), tuple(kw.items()))
        if isinstance(gpu, str):
            gpu = tuning_table.GpuId(gpu)
        sms = sm_count if sm_count is not None else getattr(gpu, "sm_count", None)
        ex = select.explain(self.variants, self.rules, p, self._hit(p, gpu, notice=False), sm_count=sms)
        if ex.chosen is None:
            err = select.UnsupportedProblem(ex.error)
            err.explanation = ex
            raise err
        return ex

    def choose(self, op: str, arch: str | None = None, features: tuple | None = None, **kw):
        """The VariantEntry selection picks (raises UnsupportedProblem with every reason)."""
        return self.explain(op, arch, features, **kw).chosen

    def _hit(self, p: select.Problem, gpu, notice: bool = True, ordinal: int | None = None):
        """The tuning-table entry for `p` as a `TableHit` (None: no table or no entry). With `ordinal`, the
        GPU is that device's; an entry measured on another model is noticed once per process."""
        table = self.tuning
        if table is None:
            return None
        # the call's own features first, then those of variants that serve it with identity fills
        entry = next((e for key in op_spec(p.op).serving_keys(p.features)
                      if (e := table.lookup(select.Problem(p.op, p.arch, key, p.dims))) is not None), None)
        if entry is None:
            return None
        if ordinal is not None:
            gpu = self.device_gpu(ordinal)
        applies = table.matches(gpu)
        if not applies and notice:
            tuning_table.notice_other_gpu(table, gpu)
        return tuning_table.TableHit(entry, table, applies, gpu)

    def device_gpu(self, ordinal: int) -> "tuning_table.GpuId":
        """The GPU model of device `ordinal` as the tuning table compares it (name, SM count)."""
        g = self._gpu.get(ordinal)
        if g is None:
            self._device_arch(ordinal)
            g = self._gpu[ordinal] = tuning_table.GpuId(driver.device_name(ordinal), self._sms[ordinal])
        return g

    @contextlib.contextmanager
    def pinned(self, name: str, p: select.Problem, device=None):
        """For `svdq-aot tune` and tests: calls of exactly problem `p` on `device` use variant `name` (which must
        serve it) while the block runs; the cached choice is dropped after, so selection decides again."""
        ordinal = _ordinal(device)
        ex = select.explain(self.variants, self.rules, p)
        if name not in ex.candidates:
            raise select.UnsupportedProblem(f"variant {name} does not serve {p.op} {dict(p.dims)} with features "
                                            f"{p.features}; candidates: {ex.candidates or ex.error}")
        key = (p.op, ordinal, tuple(p.features), tuple(p.dims))
        before = set(self._choice)
        self._choice[key] = self._launcher(name, ordinal, _capturing())
        try:
            yield
        finally:
            self._choice.pop(key, None)
        missed = [k for k in set(self._choice) - before if k[0] == p.op]
        if missed:
            raise RuntimeError(f"calls while {name} was pinned for {p.op} {dict(p.dims)} selected "
                               f"for other problems {missed[:2]}; they did not run the pinned variant")

    def default_arch(self, op: str) -> str:
        archs = sorted({v.arch for v in self.variants if v.op == op})
        if len(archs) != 1:
            raise select.UnsupportedProblem(
                f"the artifacts build {op} for {archs or 'no arch'}; name the arch (one of them)")
        return archs[0]

    # -- devices -----------------------------------------------------------
    def _device_arch(self, ordinal: int) -> str:
        arch = self._arch.get(ordinal)
        if arch is None:
            arch = driver.device_arch(ordinal)
            self._sms[ordinal] = driver.device_attribute(driver.MULTIPROCESSOR_COUNT, ordinal)
            self._arch[ordinal] = arch    # last: a thread that sees the arch also sees the SM count
        return arch

    def _check_driver(self, arch: str) -> None:
        """Refuse (DriverTooOld) if the driver is older than what these artifacts need for `arch`."""
        need = self.manifest.cuda_driver.get(arch) or cuda_versions.ARCH_MIN_CUDA.get(arch)
        if need:
            cuda_versions.check(driver.driver_version(), need, arch, self.path)

    def _launcher(self, name: str, ordinal: int, capturing: bool) -> Launcher:
        """The launcher of variant `name` on device `ordinal` (loaded on first use).  A variant whose op spec
        names a pre-pass (``gemm_w4a4`` with act_source images) gets an `ImagesLauncher` around it: each
        call runs the pre-pass op's variant into a workspace first."""
        ln = self._launchers.get((name, ordinal))
        if ln is not None:
            return ln
        e = self._verified[name].entry
        pre = OPS[e.op].prepass(e.knobs)
        if pre is None:
            ln = self._kernel_launcher(name, ordinal, capturing)
            wrap = OPS[e.op].wrap_launcher
            if wrap is not None:
                ln = wrap(ln, e)
        else:
            mine = sorted(v.name for v in self.variants if v.op == pre and v.arch == e.arch)
            if not mine:
                raise select.UnsupportedProblem(
                    f"variant {name} runs {pre} before each call, and {self.path} has no {pre} variant for "
                    f"{e.arch}; rebuild with `{pre}: {{}}` under variants.{e.arch} of the config")
            ln = decode_op.ImagesLauncher(self._kernel_launcher(mine[0], ordinal, capturing),
                                          self._kernel_launcher(name, ordinal, capturing), OPS[e.op].arg_names,
                                          OPS[e.op].prepass_extra_bytes(e.knobs),
                                          WORKSPACE_BYTES_BY_PREPASS[pre])
        with self._lock:
            return self._launchers.setdefault((name, ordinal), ln)

    def _kernel_launcher(self, name: str, ordinal: int, capturing: bool) -> Launcher:
        """The one kernel launcher of variant `name` on device `ordinal` (its cubin loaded on first use)."""
        key = (name, ordinal)
        ln = self._kernel_lns.get(key)
        if ln is not None:
            return ln
        vv = self._verified[name]
        e = vv.entry
        arch = self._device_arch(ordinal)
        if arch != e.arch:
            raise DeviceMismatch(f"variant {e.name} is built for {e.arch} but device {ordinal} is {arch}; "
                                 f"refusing to load it")
        optin = driver.device_attribute(driver.MAX_SMEM_OPTIN, ordinal)
        static = max((r.static_smem for r in e.resources.values()), default=0)
        if e.smem_bytes + static > optin:
            raise DeviceMismatch(f"variant {e.name} needs {e.smem_bytes + static} bytes of shared memory per "
                                 f"block ({e.smem_bytes} dynamic + {static} static); device {ordinal} allows {optin}")
        self._check_driver(arch)
        if capturing:
            raise CaptureError(f"kernel {e.name} is not loaded on device {ordinal} yet and a CUDA graph is "
                               f"being captured; call lib.preload() (or run once) before capturing")
        with self._lock:
            ln = self._kernel_lns.get(key)
            if ln is None:
                dk = driver.DeviceKernels(vv.cubin, e.kernel_symbols, ordinal, vv.program.load_plan,
                                          {s: [tuple(p) for p in ps] for s, ps in e.params.items()})
                ln = Launcher.for_variant(vv, dk)
                self._kernel_lns[key] = ln
        return ln

    def preload(self, device=None) -> int:
        """Load every variant built for the device's arch (default: the current device). Returns how many."""
        ordinal = _ordinal(device)
        arch = self._device_arch(ordinal)
        n = 0
        for name, vv in self._verified.items():
            if vv.entry.arch == arch:
                self._launcher(name, ordinal, False)
                n += 1
        return n

    warmup = preload

    def _resolve(self, op: str, ordinal: int, features: tuple, dims: tuple, capturing: bool) -> Launcher:
        """A (problem, device) the call cache has not seen: select, load if needed, remember."""
        arch = self._device_arch(ordinal)
        why = OPS[op].build_refusal(self.manifest.generator.kernel_switches, features)
        if why:
            raise select.UnsupportedProblem(f"{self.path}: {why}")
        p = select.Problem(op, arch, features, dims)
        entry = select.choose(self.variants, p, self.rules, self._hit(p, None, ordinal=ordinal),
                              sm_count=self._sms[ordinal])
        ln = self._launcher(entry.name, ordinal, capturing)
        if len(self._choice) > 65536:
            self._choice.clear()
        self._choice[(op, ordinal, features, dims)] = ln
        return ln

    # -- operators ---------------------------------------------------------
    @staticmethod
    def smooth_reciprocals(smooth):
        """The reciprocals RN(1 / smooth) ([K], smooth's dtype) that `quantize_act` takes as ``smooth_rcp``: make
        them once per set of smoothing factors (svdq_loader.ops.quantize_act.smooth_reciprocals)."""
        return quant_op.smooth_reciprocals(smooth)

    def prepare_weight(self, wgt, wscales, *, lora_up=None, wcscale=None, bias=None, compute="exact"):
        """Check and convert the weight side of `gemm_w4a4` once, into the format the GEMM of the
        weight's device reads (see `ops.gemm_w4a4.PreparedWeight`, `ops.layouts.WEIGHT_FORMAT_BY_ARCH`).
        ``compute="fp8"``: for the FP8-compute mode (sm_90a; not bit-equivalent: docs/design.md section 2);
        every call with this weight then runs ``gemm_w4a4_fp8``."""
        return gemm_op.prepare_weight(wgt, wscales, lora_up=lora_up, wcscale=wcscale, bias=bias,
                                      arch=self._weight_arch(wgt), compute=compute)

    def _weight_arch(self, wgt):
        """The arch of `wgt`'s CUDA device; None for a non-CUDA tensor (prepare_weight then refuses it)."""
        dev = wgt.get_device() if hasattr(wgt, "get_device") else -1
        return self._device_arch(dev) if isinstance(dev, int) and dev >= 0 else None

    def gemm_w4a4(self, act, wgt, ascales, wscales=None, *, lora_act_in=None, lora_up=None, wcscale=None,
                  bias=None, out=None, out_dtype=None, compute=None):
        """y = (A·Wᵀ)·wcscale + bias + lora_act_in·lora_upᵀ. Returns `out` (allocated if not given).

        The compute mode is the prepared weight's (`prepare_weight`); with raw weight tensors, ``compute``
        ("exact", the default, or "fp8") chooses it, and with a prepared weight it may only repeat its mode."""
        plain = wscales is None and lora_up is None and wcscale is None and bias is None
        prepared = wgt.__class__ is gemm_op.PreparedWeight
        e4m3 = act.__class__ is E4m3Act            # quantize_act(..., compute="fp8"): the GEMM alone runs
        if e4m3 and compute is None and not prepared:
            compute = "fp8"
        if plain != prepared:
            _weight_form_error(wgt, wscales, lora_up, wcscale, bias)
        if compute is not None and prepared and compute != wgt.compute:
            gemm_op.fail(f"compute={compute!r} but the weight was prepared for compute={wgt.compute!r}; prepare it "
                         f"again with compute={compute!r}")
        ordinal = act.get_device() if act.__class__ is _Tensor or e4m3 else -1
        if ordinal < 0:
            ordinal = _tensor_ordinal(act)
        arch = self._arch.get(ordinal) or self._device_arch(ordinal)
        fast = gemm_op.fast_args(arch, act, wgt, ascales, lora_act_in, out, out_dtype) if plain else None
        if fast is None:
            fast = self._gemm_checked(arch, act, wgt, ascales, wscales, lora_act_in, lora_up, wcscale, bias,
                                      out, out_dtype, compute or "exact")
        feats, dims, out, args, _weight = fast   # _weight: held until the kernels are queued
        op = _weight.op
        ln = self._choice.get((op, ordinal, feats, dims))
        if ln is None:
            ln = self._resolve(op, ordinal, feats, dims, _capturing())
        if e4m3:
            ln = ln.workspace_gemm()
        args[_GEMM_SMS] = self._sms[ordinal]
        args[_GEMM_STREAM] = _current_stream(ordinal)
        _launch_in_primary(ln, args)
        return out

    def _gemm_checked(self, arch, act, wgt, ascales, wscales, lora_act_in, lora_up, wcscale, bias, out, out_dtype,
                      compute="exact"):
        """The detailed path: every rule checked with its own message (raises InvalidArgument).  Returns the
        weight prepared here last: the caller must hold it until the launch is queued (its memory would
        otherwise go back to torch's allocator first, and a workspace allocated by the launch could reuse it
        while the GEMM still has to read it)."""
        _weight_form_error(wgt, wscales, lora_up, wcscale, bias)
        weight = wgt if isinstance(wgt, gemm_op.PreparedWeight) else \
            gemm_op.prepare_weight(wgt, wscales, lora_up=lora_up, wcscale=wcscale, bias=bias, arch=arch,
                                   compute=compute)
        call = gemm_op.plan_call(arch, act, weight, ascales, lora_act_in=lora_act_in, out=out, out_dtype=out_dtype)
        values = dict(call.pointers, m=call.m, n=call.n, k=call.k, sm_count=0, stream=0)
        return (call.features, (("m", call.m), ("n", call.n), ("k", call.k)), call.out,
                [values[a] for a in self._arg_order["gemm_w4a4"]], weight)

    def quantize_act(self, x, *, smooth=None, lora_down=None, out_act=None, out_scales=None, out_lora=None,
                     compute="exact", smooth_rcp=None):
        """x [M, K] -> (act [M, K/2] uint8, ascales in this device's GEMM layout, lora_act_in [M, R] or None).

        Smoothing (x̂ = x · RN(1 / smooth)): `smooth` [K], or `smooth_rcp` = `smooth_reciprocals(smooth)` made
        once: the same result bit for bit, and a faster kernel (it skips the per-step reciprocals).

        ``compute="fp8"`` (sm_90a): the activation of the FP8-compute mode instead, (`E4m3Act`, None,
        lora_act_in): each NVFP4 value rounded once to E4M3 after its row's power of two (docs/design.md section
        2), for ``gemm_w4a4`` with a weight prepared with ``compute="fp8"``.  `out_act` may then be an E4m3Act of
        the same M and K to write into; `out_scales` has no meaning there."""
        fp8 = compute != "exact"
        if fp8:                            # the FP8-compute activation: the NVFP4 kernel, then act_fp8 (two launches)
            _check_fp8_outputs(compute, out_act, out_scales)
            out8, out_act = out_act, None
        ordinal = x.get_device() if x.__class__ is _Tensor else -1
        if ordinal < 0:
            ordinal = _tensor_ordinal(x)
        arch = self._arch.get(ordinal) or self._device_arch(ordinal)
        fast = quant_op.fast_args(arch, x, smooth, lora_down, out_act, out_scales, out_lora, smooth_rcp)
        if fast is None:
            call = quant_op.plan_call(arch, x, smooth=smooth, lora_down=lora_down, out_act=out_act,
                                      out_scales=out_scales, out_lora=out_lora, smooth_rcp=smooth_rcp)
            values = dict(call.pointers, workspace=0, m=call.m, k=call.k, use_smooth=call.use_smooth, ksplit=1, ctas=1,
                          stream=0)
            fast = (call.features, (("m", call.m), ("k", call.k)), call.outputs,
                    [values[a] for a in self._arg_order["quantize_act"]])
        feats, dims, outputs, args = fast
        ln = self._choice.get(("quantize_act", ordinal, feats, dims))
        if ln is None:
            ln = self._resolve("quantize_act", ordinal, feats, dims, _capturing())
        if fp8:        # every rule checked and both kernels chosen before the first launch
            m, k = dims[0][1], dims[1][1]
            pre = self._act_fp8_launcher(ordinal, m, k, out8)
            if out8 is None:
                out8 = E4m3Act.empty(m, k, x.device)
        stream = args[_QUANT_STREAM] = _current_stream(ordinal)
        _launch_in_primary(ln, args)
        if not fp8:
            return outputs
        act, ascales, lora = outputs
        _launch_in_primary(pre, [act.data_ptr(), ascales.data_ptr(), out8.data_ptr(), m, k, stream])
        return out8, None, lora

    def act_to_fp8(self, act, ascales, *, out=None) -> "E4m3Act":
        """NVFP4 activations (act [M, K/2] uint8, ascales [M, K/16] float8_e4m3fn, as `quantize_act` writes them
        on sm_90a) -> the FP8-compute mode's `E4m3Act` (sm_90a; K a multiple of 256), for `gemm_w4a4` with a
        weight prepared with ``compute="fp8"``.  `out`: an E4m3Act of the same M and K to write into."""
        from .ops.checks import check_devices, check_tensor, torch_module
        torch = torch_module()
        check_tensor("act", act, dtype=torch.uint8, ndim=2)
        m, k = act.shape[0], 2 * act.shape[1]
        if m < 1:
            raise InvalidArgument(f"act must have at least one row (M >= 1), got shape {tuple(act.shape)}")
        check_tensor("ascales", ascales, dtype=torch.float8_e4m3fn, ndim=2, shape=(m, k // 16))
        check_devices(dict(act=act, ascales=ascales))
        ordinal = _tensor_ordinal(act)
        pre = self._act_fp8_launcher(ordinal, m, k, out)
        out = out if out is not None else E4m3Act.empty(m, k, act.device)
        _launch_in_primary(pre, [act.data_ptr(), ascales.data_ptr(), out.data_ptr(), m, k, _current_stream(ordinal)])
        return out

    def _act_fp8_launcher(self, ordinal: int, m: int, k: int, out):
        """The act_fp8 launcher for an M x K activation on `ordinal`, `out` (None or the E4m3Act to write) checked.
        Raises before anything is launched."""
        if out is not None and (out.__class__ is not E4m3Act or (out.m, out.k, out.get_device()) != (m, k, ordinal)):
            got = (f"an E4m3Act of M={out.m}, K={out.k} on device {out.get_device()}" if out.__class__ is E4m3Act
                   else type(out).__name__)
            raise InvalidArgument(f"the FP8-compute activation's output must be an E4m3Act of M={m}, K={k} on "
                                  f"device {ordinal} (E4m3Act.empty(M, K, device)), got {got}")
        feats, dims = ("logical",), (("m", m), ("k", k))
        pre = self._choice.get(("act_fp8", ordinal, feats, dims))
        if pre is None:
            arch = self._device_arch(ordinal)
            if not any(v.op == "act_fp8" and v.arch == arch for v in self.variants):
                raise select.UnsupportedProblem(
                    f"the FP8-compute activation needs an act_fp8 kernel, and {self.path} has none for {arch} (the "
                    f"FP8-compute mode is built for sm_90a only, by a config with compute: [exact, fp8])")
            pre = self._resolve("act_fp8", ordinal, feats, dims, _capturing())
        return pre


def _check_fp8_outputs(compute, out_act, out_scales) -> None:
    """quantize_act's arguments that only the FP8-compute activation rules on (raises InvalidArgument)."""
    if compute != "fp8":
        raise InvalidArgument(f"compute must be 'exact' or 'fp8', got {compute!r}")
    if out_scales is not None:
        raise InvalidArgument("out_scales was given with compute='fp8': the FP8-compute activation folds its "
                              "block scales into the E4M3 values (there are none to write)")
    if out_act is not None and out_act.__class__ is not E4m3Act:
        raise InvalidArgument(f"out_act must be an E4m3Act with compute='fp8' (E4m3Act.empty(M, K, device)), got "
                              f"{type(out_act).__name__}")


def _weight_form_error(wgt, wscales, lora_up, wcscale, bias) -> None:
    """Raise if the weight side is given in neither of its two forms (prepared, or raw tensors)."""
    if isinstance(wgt, gemm_op.PreparedWeight):
        extra = [n for n, x in (("wscales", wscales), ("lora_up", lora_up), ("wcscale", wcscale),
                                ("bias", bias)) if x is not None]
        if extra:
            raise InvalidArgument(f"wgt is a PreparedWeight; {', '.join(extra)} belong to prepare_weight(), "
                                  f"not to the call")
    elif wscales is None:
        raise InvalidArgument("wscales is required unless wgt is a PreparedWeight")


def _launch_in_primary(ln: Launcher, args) -> None:
    """Launch in the device's primary context (torch's), restoring a foreign current context after."""
    dk = ln.device
    if dk.foreign_context():
        dk.push_primary()
        try:
            ln.launch(args)
        finally:
            dk.pop()
    else:
        ln.launch(args)


def _tensor_ordinal(t) -> int:
    from .ops.checks import torch_module
    torch_module()                       # no torch: say so (TorchMissing), not "not a tensor"
    dev = getattr(t, "device", None)
    if dev is None:
        raise InvalidArgument(f"expected a torch CUDA tensor, got {type(t).__name__}")
    if dev.type != "cuda":
        raise InvalidArgument(f"tensors must be CUDA tensors, got one on {dev}")
    return dev.index if dev.index is not None else 0


def _ordinal(device) -> int:
    from .ops.checks import torch_module
    torch = torch_module()
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise NoCuda(f"torch sees no CUDA device ({build}; torch.cuda.is_available() is False); kernels can only "
                     f"be loaded on a CUDA GPU: install a CUDA build of torch and run where a GPU is visible")
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def _capturing() -> bool:
    from .ops.checks import torch_module
    return torch_module().cuda.is_current_stream_capturing()


_raw_stream = None   # torch's current-stream getter, bound on first use (torch is optional at import)


def _current_stream(ordinal: int) -> int:
    """The raw handle of torch's current stream on `ordinal` (the public call costs ~3 µs more)."""
    fn = _raw_stream
    if fn is None:
        fn = _bind_raw_stream()
    return fn(ordinal)


def _bind_raw_stream():
    global _raw_stream
    from .ops.checks import torch_module
    torch = torch_module()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    _raw_stream = raw if raw is not None else (lambda ordinal: torch.cuda.current_stream(ordinal).cuda_stream)
    return _raw_stream


def load(path: str | None = None, tuning=True) -> Library:
    """Read, validate and cross-check the artifacts in `path` (and their tuning table, if any: ``tuning``
    True uses ``<path>/tuning.json`` when present, False ignores it, a path names another table file).
    No CUDA call is made here.

    With no `path`: ``$SVDQ_ARTIFACTS``, then an installed artifact package (entry point
    ``svdq_loader.artifacts``), then ``./artifacts`` (see `svdq_loader.discovery`).
    """
    if path is None:
        from .discovery import find_artifacts
        path = find_artifacts().path
    return Library(path, tuning)

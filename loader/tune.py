"""`svdq-aot tune`: time every candidate variant per problem on this GPU and build the tuning table.

    svdq-aot tune artifacts                    (writes artifacts/tuning.json)
    svdq-aot tune artifacts --config configs/flux.yaml --m 64,4608 --quick --json

For each op, each shape (the config's, else the manifest's, else the FLUX.1
linears), each feature combination built for this device's arch (optionally
narrowed by dtype and rank) and each M bucket of the selection rules, every
variant that serves the problem is timed at the bucket's Ms with the bench's
method (`svdq_loader.testing.bench.time_calls`: CUDA-event medians after
warm-up, inputs and outputs rotated so one pass moves more than twice the L2,
CUDA graphs of several calls).  A problem only one variant serves is not
measured: the rules and a table would agree.

The winner of a bucket has the smallest geometric mean, over the bucket's Ms,
of its time divided by the fastest time at that M.  The rules' own choice is
kept unless the winner beats it by more than ``min_gain`` (2 % by default),
so measurement noise does not flip a choice.

The planning and the winner rule are pure Python (tested on the CPU); the
measurement needs torch and a CUDA GPU.
"""
from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass

from . import select
from ._version import __version__
from .ops import OPS
from .select_rules import rule_for
from .tuning_table import Entry, TuningTable

#: Ms measured per op when none are given: each M bucket gets those inside it.
DEFAULT_M = {"gemm_w4a4": (16, 64, 256, 1024, 4608, 9728), "gemm_w4a4_fp8": (256, 1024, 4608, 9728),
             "quantize_act": (256, 4608)}
#: The operators tune measures (the public ones; a pre-pass op runs inside its GEMM's calls)
TUNED_OPS = tuple(DEFAULT_M)
MIN_GAIN = 0.02
#: At most this many input copies per problem (the bench stops at 64, which leaves a small problem's
#: inputs partly L2-resident; small copies are cheap, and a pass must move more than twice the L2).
MAX_SETS = 2048


def n_sets(bytes_per_set: int, l2_bytes: int) -> int:
    """Fewest input copies whose one pass moves more than twice the L2 (at most `MAX_SETS`)."""
    return max(1, min(MAX_SETS, 2 * l2_bytes // max(1, bytes_per_set) + 1))


@dataclass(frozen=True)
class Job:
    """One table entry to measure: a problem family (op, features, non-M dims), an M bucket and its Ms."""
    op: str
    arch: str
    features: tuple
    dims: tuple[tuple[str, int], ...]     # the op's dims but m
    m_min: int
    m_max: int | None
    ms: tuple[int, ...]
    candidates: tuple[str, ...]           # variants serving it, in the rules' order
    rule_choice: str

    def problem(self, m: int) -> select.Problem:
        d = dict(self.dims, m=m)
        return select.Problem(self.op, self.arch, self.features, tuple((n, d[n]) for n in OPS[self.op].dims))

    def text(self) -> str:
        spec = OPS[self.op]
        feats = ", ".join(f"{n}={v}" for n, v in zip(spec.feature_names, self.features))
        b = f"M in [{self.m_min}, {self.m_max}]" if self.m_max is not None else f"M >= {self.m_min}"
        return f"{self.op} " + " ".join(f"{k.upper()}={v}" for k, v in self.dims) + f", {b}, {feats}"


def m_buckets(rules, op: str, arch: str, families) -> list[tuple[int, int | None]]:
    """The M buckets of the rules of `families` for (op, arch), refined together: [(lo, hi or None)]."""
    bounds = sorted({b.m_max for f in families for b in rule_for(rules, op, arch, f).buckets if b.m_max is not None})
    out, lo = [], 1
    for hi in bounds:
        out.append((lo, hi))
        lo = hi + 1
    return out + [(lo, None)]


def plan(variants, rules, arch: str, shapes, *, ops=None, ms=None, dtypes=None, ranks=None):
    """(jobs, skipped): what to measure on `arch`, and [(problem text, why not)].

    `shapes`: [(name, K, N)]; `ms`: Ms to measure (default `DEFAULT_M` per op), each falling in its bucket;
    `dtypes`, `ranks`: keep only these feature values (None: all built)."""
    jobs, skipped = [], []
    for op in ops or TUNED_OPS:
        spec = OPS[op]
        mine = [v for v in variants if v.op == op and v.arch == arch]
        if not mine:
            continue
        feats = sorted({spec.feature_key(v.knobs) for v in mine}, key=repr)
        names = spec.feature_names
        feats = [f for f in feats if _keep(dict(zip(names, f)), dtypes, ranks)]
        dim_sets = []
        for _, k, n in shapes:
            d = tuple((x, {"k": k, "n": n}[x]) for x in spec.dims if x != "m")
            if d not in dim_sets:
                dim_sets.append(d)
        families = sorted({v.family for v in mine})
        for f in feats:
            for d in dim_sets:
                for lo, hi in m_buckets(rules, op, arch, families):
                    want = [m for m in (ms or DEFAULT_M[op]) if m >= lo and (hi is None or m <= hi)]
                    if not want:
                        continue
                    job = Job(op, arch, f, d, lo, hi, tuple(want), (), "")
                    ex = select.explain(variants, rules, job.problem(want[0]))
                    job = Job(op, arch, f, d, lo, hi, tuple(want), tuple(ex.candidates),
                              ex.chosen.name if ex.chosen is not None else "")
                    if len(ex.candidates) < 2:
                        skipped.append((job.text(), ex.error or "one variant serves it: nothing to choose"))
                    else:
                        jobs.append(job)
    return jobs, skipped


def _keep(feats: dict, dtypes, ranks) -> bool:
    dt = feats.get("out_dtype", feats.get("dtype"))
    return (not dtypes or dt in dtypes) and (ranks is None or feats.get("rank") in ranks)


def pick_winner(ms, times: dict[str, list[float]], rule_choice: str, min_gain: float = MIN_GAIN) -> str:
    """The variant with the smallest geometric mean of time / fastest time over `ms`; the rules' choice
    is kept unless that winner beats it by more than `min_gain` (ties: the name)."""
    best = [min(t[i] for t in times.values()) for i in range(len(ms))]

    def score(name):
        return math.exp(sum(math.log(t / b) for t, b in zip(times[name], best)) / len(ms))

    win = min(times, key=lambda n: (score(n), n))
    if rule_choice in times and score(rule_choice) <= score(win) * (1.0 + min_gain):
        return rule_choice
    return win


def entry_for(job: Job, times: dict[str, list[float]], min_gain: float = MIN_GAIN) -> Entry:
    return Entry(job.op, job.arch, job.features, job.dims, job.m_min, job.m_max, job.ms,
                 pick_winner(job.ms, times, job.rule_choice, min_gain), job.rule_choice,
                 {n: tuple(t) for n, t in times.items()})


def make_table(manifest, entries, measured_on: dict, method: dict, source: str) -> TuningTable:
    from .manifest import body_checksum
    return TuningTable(source, body_checksum(manifest.body()), dict(measured_on), dict(method), tuple(entries))


# ---------------------------------------------------------------------------
# Measurement (torch and a CUDA GPU)
# ---------------------------------------------------------------------------

def kernel_driver_version(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver version ('570.124.06') where the OS shows it, else None."""
    try:
        with open(path) as f:
            m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+\.\d+(?:\.\d+)?)", f.read())
        return m.group(1) if m else None
    except OSError:
        return None


def measured_on(lib, ordinal: int) -> dict:
    import torch
    from . import driver
    g = lib.device_gpu(ordinal)
    return {"gpu": g.name, "sm_count": g.sm_count, "arch": lib._device_arch(ordinal),
            "cuda_driver": driver.driver_version(), "driver": kernel_driver_version(), "loader_version": __version__,
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _tdtype(name):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _inputs(lib, op: str, feats: dict, dims: dict, l2: int, seed: int, dev: str = "cuda"):
    """(number of input sets, call(i)): rotating copies of one problem's inputs and outputs on `dev`."""
    import torch
    from .ops.layouts import scale_shape
    from .testing.bench import quant_bytes
    g = torch.Generator(device=dev).manual_seed(seed)

    def u8(*s):
        return torch.randint(0, 256, s, dtype=torch.uint8, device=dev, generator=g)

    def scales(shape):     # E4M3 scales in [0.25, 1): nonzero, as real block scales are
        return (torch.rand(shape, device=dev, generator=g) * 0.75 + 0.25).to(torch.float8_e4m3fn)

    def half(*s, scale=1.0):
        return (torch.randn(s, device=dev, generator=g) * scale).to(tdt)

    m, k, r = dims["m"], dims["k"], feats["rank"]
    if op in ("gemm_w4a4", "gemm_w4a4_fp8"):
        mode = {} if op == "gemm_w4a4" else dict(compute="fp8")
        n, tdt, layout = dims["n"], _tdtype(feats["out_dtype"]), feats["scale_layout"]
        per = m * k // 2 + m * k // 16 + n * k // 2 + n * k // 16 + 2 * r * (m + n) + 8 * n + 2 * m * n
        sets = []
        for _ in range(n_sets(per, l2)):
            w = lib.prepare_weight(u8(n, k // 2), scales(scale_shape(layout, n, k)),
                                   lora_up=half(n, r) if r else None,
                                   wcscale=torch.rand(n, device=dev, generator=g) + 0.5 if feats["wcscale"] else None,
                                   bias=torch.randn(n, device=dev, generator=g) if feats["bias"] else None, **mode)
            sets.append((u8(m, k // 2), w, scales(scale_shape(layout, m, k)), half(m, r) if r else None,
                         torch.empty(m, n, dtype=tdt, device=dev)))

        def call(i):
            a, w, s, la, out = sets[i]
            lib.gemm_w4a4(a, w, s, lora_act_in=la, out=out)
        return len(sets), call
    if op == "quantize_act":
        tdt, layout = _tdtype(feats["dtype"]), feats["scale_layout"]
        sets = []
        for _ in range(n_sets(quant_bytes(m, k, r), l2)):
            sets.append((half(m, k), (torch.rand(k, device=dev, generator=g) * 1.5 + 0.5).to(tdt),
                         half(k, r, scale=k ** -0.5) if r else None,
                         torch.empty(m, k // 2, dtype=torch.uint8, device=dev),
                         torch.empty(scale_shape(layout, m, k), dtype=torch.float8_e4m3fn, device=dev),
                         torch.empty(m, r, dtype=tdt, device=dev) if r else None))

        def call(i):
            x, sm, ld, oa, osc, ol = sets[i]
            lib.quantize_act(x, smooth=sm, lora_down=ld, out_act=oa, out_scales=osc, out_lora=ol)
        return len(sets), call
    raise ValueError(f"svdq-aot tune does not know how to make inputs for op {op!r}")


def measure(lib, p: select.Problem, names, settings=None, device=None, seed: int = 0) -> dict[str, float]:
    """Median µs per call of each variant in `names` on problem `p` (same inputs for all, bench method)."""
    import torch
    from .testing.bench import Settings, time_calls
    st = settings or Settings()
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or 64 << 20
    spec = OPS[p.op]
    count, call = _inputs(lib, p.op, dict(zip(spec.feature_names, p.features)), dict(p.dims), l2, seed)
    out = {}
    for name in names:
        with lib.pinned(name, p, device):
            out[name] = time_calls(call, count, st)["us"]
    del call
    torch.cuda.synchronize()
    return out


def tune(lib, shapes, *, ops=None, ms=None, dtypes=None, ranks=None, settings=None, min_gain: float = MIN_GAIN,
         source: str = "tuning.json", progress=print):
    """Measure every job `plan` makes on the current device; returns (TuningTable, skipped)."""
    import gc

    import torch
    from .testing.bench import Settings
    st = settings or Settings(reps=15, warmup=3, target_ms=2.0)
    ordinal = torch.cuda.current_device()
    arch = lib._device_arch(ordinal)
    jobs, skipped = plan(lib.variants, lib.rules, arch, shapes, ops=ops, ms=ms, dtypes=dtypes, ranks=ranks)
    entries = []
    for job in jobs:
        times: dict[str, list[float]] = {n: [] for n in job.candidates}
        for m in job.ms:
            got = measure(lib, job.problem(m), job.candidates, st, ordinal, seed=m * 131 + len(entries))
            for n, t in got.items():
                times[n].append(t)
            gc.collect()
            torch.cuda.empty_cache()
        e = entry_for(job, times, min_gain)
        entries.append(e)
        progress(f"  {job.text()}: {e.winner}" + ("" if e.winner == e.rule_choice else
                                                   f" (rules: {e.rule_choice})") + "  " + "; ".join(
            f"{n}: {', '.join(f'{t:.1f}' for t in ts)} µs" for n, ts in e.times_us.items()))
    method = {"timer": "CUDA events, median of samples", "samples": st.reps, "warmup_passes": st.warmup,
              "target_ms": st.target_ms, "graphs": st.graphs,
              "rotation": "input+output copies so one pass moves > 2x L2", "min_gain": min_gain,
              "winner": "smallest geometric mean of time / fastest time over the bucket's Ms"}
    return make_table(lib.manifest, entries, measured_on(lib, ordinal), method, source), skipped


__all__ = ["DEFAULT_M", "TUNED_OPS", "MIN_GAIN", "Job", "m_buckets", "plan", "pick_winner", "entry_for", "make_table",
           "measure", "tune", "measured_on"]

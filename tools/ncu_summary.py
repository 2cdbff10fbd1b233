"""One markdown row per kernel launch from an `ncu --csv --metrics ...` log: time, grid, pipes, L2, SM activity, stalls.

    ncu --clock-control none --csv -k regex:svdq --metrics "$(python3 tools/ncu_summary.py --metrics)" \\
        python3 tools/sm90_one_call.py --m 256,64,16 --k 3072 --n 3072 > ncu.csv
    python3 tools/ncu_summary.py ncu.csv [--label "(3072, 3072)"] [--header]
    python3 tools/ncu_summary.py --header        (the header alone, for a table of several logs)
    python3 tools/ncu_summary.py ncu.csv --show l1tex__t_sector_hit_rate.pct   (after each row, these metrics as
                                                                                  logged: "name = value unit")

The log may hold the profiled program's own lines before ncu's CSV; they are skipped. "SMs active" is
`sm__cycles_active.avg` over `sm__cycles_elapsed.avg` (the share of the kernel's cycles an average SM had work);
"L2" is `lts__throughput` (% of its peak) and the L2's bytes (`lts__t_bytes.sum`) over the kernel's time;
a stall's share is its `smsp__average_warp_latency_issue_stalled_*` ratio over the sum of the stall ratios measured,
and the column lists the largest three other than "selected" (the cycles a warp issues). `tools/h200_all.sh
measures` runs it on the kernels of issue 7's small-M points.
"""
from __future__ import annotations

import argparse
import csv
import sys

STALLS = ("long_scoreboard", "wait", "barrier", "math_pipe_throttle", "membar", "dispatch_stall", "short_scoreboard",
          "selected", "not_selected", "no_instruction")
BASE = ("gpu__time_duration.sum", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__cycles_active.avg", "sm__cycles_elapsed.avg", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__t_bytes.sum")
METRICS = BASE + tuple(f"smsp__average_warp_latency_issue_stalled_{s}.ratio" for s in STALLS)
_TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
_BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}      # ncu's units are decimal
#: the name fields of a GEMM variant that tell its form apart (the rest is the same for every kernel of a call)
_FORM_KEYS = ("tilem", "tilen", "schedule", "splitk", "wsets", "actsource")
HEADER = ("| problem | # | kernel | grid × threads (registers) | µs | tensor pipe | issue slots | DRAM | L2 "
          "| SMs active | largest stalls |\n|---|---|---|---|---|---|---|---|---|---|---|")


class NcuLogError(ValueError):
    """The log holds no ncu CSV, or a row lacks a column ncu always writes."""


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def read_launches(text: str) -> list[dict]:
    """[{"id", "kernel", "metrics": {name: (value text, unit)}}] in launch order."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise NcuLogError("no ncu CSV header (a line starting with \"ID\") in the log")
    launches: dict[tuple, dict] = {}
    for row in csv.DictReader(line for line in lines[start:] if line.startswith('"')):   # not ncu's ==PROF== lines
        try:
            key = (row["ID"], row["Kernel Name"])
            name, unit, value = row["Metric Name"], row["Metric Unit"], row["Metric Value"]
        except KeyError as e:
            raise NcuLogError(f"ncu CSV row without the column {e}: run ncu with --csv --metrics") from None
        entry = launches.setdefault(key, {"id": key[0], "kernel": key[1], "metrics": {}})
        entry["metrics"][name] = (value, unit)
    return list(launches.values())


def short_name(kernel: str) -> str:
    """`svdq_gemm_w4a4_sm90a_..._tilem64_tilen128_..._schedulews_splitk4_..._0` -> `gemm_w4a4 tilem64 tilen128 ...`."""
    name = kernel[5:] if kernel.startswith("svdq_") else kernel
    if name.endswith("_0"):
        name = name[:-2]
    parts = name.split("_")
    arch = next((i for i, p in enumerate(parts) if p.startswith("sm") and p[2:4].isdigit()), None)
    if arch is None:
        return name
    form = [p for p in parts[arch + 1:] if p.startswith(_FORM_KEYS)]
    return " ".join(["_".join(parts[:arch])] + form)


def summarize(launch: dict) -> dict:
    m = launch["metrics"]

    def get(name):
        return _number(m[name][0]) if name in m else None

    out = {"id": launch["id"], "kernel": short_name(launch["kernel"])}
    t = m.get("gpu__time_duration.sum")
    out["us"] = _number(t[0]) * _TIME_UNITS.get(t[1], float("nan")) if t else None
    out["grid"], out["block"] = get("launch__grid_size"), get("launch__block_size")
    out["regs"] = get("launch__registers_per_thread")
    out["tensor"] = get("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
    out["issue"] = get("smsp__issue_active.avg.pct_of_peak_sustained_active")
    out["dram"] = get("dram__throughput.avg.pct_of_peak_sustained_elapsed")
    out["l2"] = get("lts__throughput.avg.pct_of_peak_sustained_elapsed")
    b = m.get("lts__t_bytes.sum")
    nbytes = _number(b[0]) * _BYTE_UNITS.get(b[1], float("nan")) if b else None
    out["l2_tbs"] = nbytes / out["us"] / 1e6 if nbytes is not None and out["us"] else None
    act, el = get("sm__cycles_active.avg"), get("sm__cycles_elapsed.avg")
    out["sms_active"] = 100.0 * act / el if act is not None and el else None
    stalls = {s: get(f"smsp__average_warp_latency_issue_stalled_{s}.ratio") for s in STALLS}
    stalls = {s: v for s, v in stalls.items() if v is not None}
    total = sum(stalls.values())
    out["stalls"] = ({s: 100.0 * v / total for s, v in stalls.items()} if total > 0 else {})
    return out


def row(s: dict, label: str) -> str:
    def pct(v):
        return "—" if v is None else f"{v:.0f} %"

    def num(v):
        return "—" if v is None else f"{v:.0f}"

    top = sorted(((v, k) for k, v in s["stalls"].items() if k != "selected"), reverse=True)[:3]
    stalls = ", ".join(f"{k.replace('_', ' ')} {v:.0f} %" for v, k in top) or "—"
    us = "—" if s["us"] is None else f"{s['us']:.1f}"
    l2 = pct(s["l2"]) + ("" if s["l2_tbs"] is None else f" ({s['l2_tbs']:.1f} TB/s)")
    return (f"| {label} | {s['id']} | {s['kernel']} | {num(s['grid'])} × {num(s['block'])} ({num(s['regs'])}) | {us} "
            f"| {pct(s['tensor'])} | {pct(s['issue'])} | {pct(s['dram'])} | {l2} | {pct(s['sms_active'])} "
            f"| {stalls} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", nargs="?", help="ncu's CSV output (the program's own lines before it are skipped)")
    ap.add_argument("--label", default="", help="the first column of every row (e.g. the problem)")
    ap.add_argument("--header", action="store_true", help="print the table's header first (alone, without a log)")
    ap.add_argument("--metrics", action="store_true", help="print the --metrics list this tool reads, and exit")
    ap.add_argument("--show", default="", help="comma list of more metrics to print after each row, as logged")
    a = ap.parse_args(argv)
    if a.metrics:
        print(",".join(METRICS))
        return 0
    if not a.log:
        if a.header:
            print(HEADER)
            return 0
        ap.error("give an ncu CSV log (or --metrics, or --header)")
    try:
        with open(a.log, encoding="utf-8", errors="replace") as f:
            launches = read_launches(f.read())
    except (OSError, NcuLogError) as e:
        print(f"ncu_summary: {a.log}: {e}", file=sys.stderr)
        return 1
    if a.header:
        print(HEADER)
    for launch in launches:
        print(row(summarize(launch), a.label))
        for name in filter(None, a.show.split(",")):
            value, unit = launch["metrics"].get(name, ("(not in the log)", ""))
            print(f"    {name} = {value} {unit}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())

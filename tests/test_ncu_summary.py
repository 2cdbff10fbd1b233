"""`tools/ncu_summary.py`: ncu's CSV (metrics mode) to one markdown row per launch, on hand-built logs."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ncu_summary.py"
_spec = importlib.util.spec_from_file_location("ncu_summary", TOOL)
ncu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_summary)

_COLS = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
         "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value")
GEMM = ("svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_wcscale1_bias1_tilem256_tilen128_tilek64_stages4_prefetch1_"
        "skippad1_actdecodeprmt_schedulews_wsets2_actsourceimages_reqn128k64_0")


def _log(launches):
    """ncu-like text: the program's own output first, then the CSV (one line per metric, every field quoted)."""
    lines = ["ok 256 (256, 21504)", '"' + '","'.join(_COLS) + '"']
    for lid, kernel, metrics in launches:
        for name, (unit, value) in metrics.items():
            f = [lid, "1596", "python3.12", "127.0.0.1", kernel, "1", "7", "(384, 1, 1)", "(132, 1, 1)", "0", "9.0",
                 "Command line profiler metrics", name, unit, value]
            lines.append('"' + '","'.join(f) + '"')
    return "\n".join(lines + ["==PROF== Disconnected from process 1596"]) + "\n"


def _gemm_metrics(time=("ns", "72,608")):
    m = {"gpu__time_duration.sum": time, "launch__grid_size": ("", "132"), "launch__block_size": ("", "384"),
         "launch__registers_per_thread": ("register/thread", "168"),
         "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": ("%", "81.76"),
         "smsp__issue_active.avg.pct_of_peak_sustained_active": ("%", "23.47"),
         "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "12.27"),
         "sm__cycles_active.avg": ("cycle", "60,000.00"), "sm__cycles_elapsed.avg": ("cycle", "100,000.00"),
         "lts__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "47.60"),
         "lts__t_bytes.sum": ("Mbyte", "301.26")}     # over 72.608 us: 4.149 TB/s
    # stall ratios summing to 1000: shares are the values / 10
    for s, v in (("long_scoreboard", 400), ("selected", 250), ("wait", 150), ("barrier", 120), ("membar", 80)):
        m[f"smsp__average_warp_latency_issue_stalled_{s}.ratio"] = ("inst/warp", f"{v:,}.00")
    return m


def test_one_row_per_launch_with_shares_computed_from_the_raw_metrics(tmp_path):
    log = tmp_path / "ncu.csv"
    log.write_text(_log([("0", "svdq_decode_act_sm90a_reqk64_0", {"gpu__time_duration.sum": ("usecond", "3.80")}),
                         ("1", GEMM, _gemm_metrics())]))
    r = subprocess.run([sys.executable, str(TOOL), str(log), "--label", "(3072, 21504)", "--header"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| problem | # | kernel |") and lines[1].startswith("|---|")
    assert lines[2] == "| (3072, 21504) | 0 | decode_act | — × — (—) | 3.8 | — | — | — | — | — | — |"
    assert lines[3] == ("| (3072, 21504) | 1 | gemm_w4a4 tilem256 tilen128 schedulews wsets2 actsourceimages | "
                        "132 × 384 (168) | 72.6 | 82 % | 23 % | 12 % | 48 % (4.1 TB/s) | 60 % | "
                        "long scoreboard 40 %, wait 15 %, barrier 12 % |")     # "selected" (25 %) left out
    assert len(lines) == 4


@pytest.mark.parametrize("unit, value, us", [("ns", "9,024", 9.024), ("usecond", "9.02", 9.02),
                                             ("msecond", "1.5", 1500.0)])
def test_time_units(unit, value, us):
    launch = ncu_summary.read_launches(_log([("3", GEMM, _gemm_metrics((unit, value)))]))[0]
    assert ncu_summary.summarize(launch)["us"] == pytest.approx(us)


def test_a_log_without_the_csv_is_refused_by_name(tmp_path):
    log = tmp_path / "empty.csv"
    log.write_text("==PROF== Disconnected\nTraceback: no GPU\n")
    r = subprocess.run([sys.executable, str(TOOL), str(log)], capture_output=True, text=True)
    assert r.returncode == 1 and "empty.csv" in r.stderr and "no ncu CSV header" in r.stderr
    with pytest.raises(ncu_summary.NcuLogError, match="Metric Value"):
        ncu_summary.read_launches('"ID","Kernel Name","Metric Name","Metric Unit"\n"0","k","a","b"\n')


def test_metrics_list_names_every_metric_the_summary_reads():
    r = subprocess.run([sys.executable, str(TOOL), "--metrics"], capture_output=True, text=True)
    names = r.stdout.strip().split(",")
    assert r.returncode == 0 and len(names) == len(set(names)) == 21
    assert "lts__t_bytes.sum" in names and "lts__throughput.avg.pct_of_peak_sustained_elapsed" in names
    assert "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active" in names
    assert all(f"smsp__average_warp_latency_issue_stalled_{s}.ratio" in names for s in ncu_summary.STALLS)


def test_the_header_alone():
    r = subprocess.run([sys.executable, str(TOOL), "--header"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == ncu_summary.HEADER + "\n"
    r = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True)
    assert r.returncode == 2 and "give an ncu CSV log" in r.stderr


@pytest.mark.parametrize("unit, value", [("byte", "301,260,000"), ("Kbyte", "301,260"), ("Mbyte", "301.26"),
                                         ("Gbyte", "0.30126")])
def test_l2_bytes_in_any_unit_over_the_kernel_time(unit, value):
    """The L2 rate is lts__t_bytes (ncu's decimal units) over gpu__time_duration: 301.26 MB in 72.608 us."""
    m = _gemm_metrics()
    m["lts__t_bytes.sum"] = (unit, value)
    s = ncu_summary.summarize(ncu_summary.read_launches(_log([("1", GEMM, m)]))[0])
    assert s["l2"] == pytest.approx(47.6) and s["l2_tbs"] == pytest.approx(301.26e6 / 72.608e-6 / 1e12)


def test_show_prints_named_metrics_after_each_row_as_logged(tmp_path):
    """--show: after a launch's row, each named metric as ncu logged it ("name = value unit"), and a metric the log
    lacks says so (docs/PERF.md session 54 read quantize_act's L1 hit rate and SMEM carveout this way)."""
    m = _gemm_metrics()
    m["l1tex__t_sector_hit_rate.pct"] = ("%", "38.21")
    log = tmp_path / "ncu.csv"
    log.write_text(_log([("0", GEMM, m)]))
    r = subprocess.run([sys.executable, str(TOOL), str(log), "--show",
                        "l1tex__t_sector_hit_rate.pct,launch__shared_mem_config_size"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| ") and " | 0 | gemm_w4a4 tilem256 " in lines[0]
    assert lines[1:] == ["    l1tex__t_sector_hit_rate.pct = 38.21 %",
                         "    launch__shared_mem_config_size = (not in the log)"]

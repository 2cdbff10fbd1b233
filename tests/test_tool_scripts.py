"""The device-call scripts under tools/ parse (``bash -n``) and say how they are run, so a scarce H200 call is not
lost to a typo."""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "tools").glob("*.sh"))


def test_there_are_scripts():
    assert any(p.name == "h200_ab.sh" for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_documents_its_use(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = script.read_text().splitlines()
    assert lines[0].startswith("#!"), "no interpreter line"
    assert any(f"tools/{script.name}" in line for line in lines[:12] if line.startswith("#")), \
        "the header comment does not show how to run it"


def test_the_ab_script_refuses_missing_folders(tmp_path):
    script = str(SCRIPTS[0].parent / "h200_ab.sh")
    r = subprocess.run(["bash", script], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: h200_ab.sh BASE [EXP ...]" in r.stderr
    base = tmp_path / "base"
    base.mkdir()
    (base / "manifest.json").write_text("{}")
    r = subprocess.run(["bash", script, str(base), str(tmp_path / "nope")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and "nope has no manifest.json" in r.stderr
    assert not (tmp_path / "out").exists()           # refused before anything ran


def _artifact_folders(tmp_path, names):
    """Folders that pass h200_ab.sh's manifest check (an empty manifest.json each); their paths, in order."""
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    return [str(tmp_path / name) for name in names]


def _stub_bin(tmp_path, ncu=False):
    """A PATH whose python3, nvidia-smi and compute-sanitizer (and, with ncu, ncu) only record their arguments
    (python3 prints a best table when it runs the sweep) and whose timeout runs its command (options and the limit
    dropped), so the device scripts' own logic runs without a GPU."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "calls.log"
    (bin_ / "python3").write_text(
        "#!/bin/bash\n"
        f"echo \"python3 $*\" >> {calls}\n"
        "case \"$*\" in *sm90_sweep.py*) echo '| M | K | N | cuBLAS µs | a: best µs (form) |';"
        " echo '| 64 | 3072 | 3072 | 9.0 | 12.0 (64x128 ws w8 s4 img) |';; esac\n")
    (bin_ / "nvidia-smi").write_text("#!/bin/bash\necho 'NVIDIA H200, 580'\n")
    (bin_ / "compute-sanitizer").write_text(f"#!/bin/bash\necho \"compute-sanitizer $*\" >> {calls}\n")
    if ncu:
        (bin_ / "ncu").write_text(f"#!/bin/bash\necho \"ncu $*\" >> {calls}\n")
    (bin_ / "timeout").write_text("#!/bin/bash\nwhile [[ $1 == -* ]]; do shift 2; done\nshift\nexec \"$@\"\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return f"{bin_}:/usr/bin:/bin", calls


@pytest.mark.parametrize("selftest, tested", [("1", ["exp1", "exp2"]), ("0", [])])
def test_the_ab_script_runs_selftests_unless_told_not_to_and_sweeps_every_folder(tmp_path, selftest, tested):
    script = str(SCRIPTS[0].parent / "h200_ab.sh")
    folders = _artifact_folders(tmp_path, ("base", "exp1", "exp2"))
    path, calls = _stub_bin(tmp_path)
    r = subprocess.run(["bash", script, *folders], capture_output=True, text=True,
                       env={"PATH": path, "OUT": str(tmp_path / "out"), "SELFTEST": selftest, "NCU": "0"})
    assert r.returncode == 0, r.stderr
    log = calls.read_text().splitlines()
    ran = [line.split()[3].rsplit("/", 1)[1] for line in log if "svdq_loader.testing.selftest" in line]
    assert ran == tested
    sweep = [line for line in log if "tools/sm90_sweep.py" in line]
    assert len(sweep) == 1 and all(f in sweep[0] for f in folders)
    assert "| 64 | 3072 | 3072 | 9.0 | 12.0 (64x128 ws w8 s4 img) |" in r.stdout     # the best table, echoed


def test_the_ab_script_runs_each_selftest_op_of_a_comma_list(tmp_path):
    """SELFTEST_OP=act_fp8,gemm_w4a4_fp8: every tested folder gets one selftest per op, in that order (one call
    checks an FP8 pre-pass build and an FP8 GEMM build)."""
    script = str(SCRIPTS[0].parent / "h200_ab.sh")
    folders = _artifact_folders(tmp_path, ("base", "exp"))
    path, calls = _stub_bin(tmp_path)
    r = subprocess.run(["bash", script, *folders], capture_output=True, text=True,
                       env={"PATH": path, "OUT": str(tmp_path / "out"), "NCU": "0",
                            "SELFTEST_OP": "act_fp8,gemm_w4a4_fp8"})
    assert r.returncode == 0, r.stderr
    runs = [line.split() for line in calls.read_text().splitlines() if "svdq_loader.testing.selftest" in line]
    assert [(w[3].rsplit("/", 1)[1], w[-1]) for w in runs] == [("exp", "act_fp8"), ("exp", "gemm_w4a4_fp8")]


@pytest.mark.parametrize("racecheck", ["1", "0"])
def test_the_ab_script_racechecks_every_folder_when_asked(tmp_path, racecheck):
    """RACECHECK=1: compute-sanitizer racecheck of each folder's default variants at M = 77 and 1000, base first
    (the check a switch that changes SMEM traffic needs before it becomes the default); none otherwise."""
    script = str(SCRIPTS[0].parent / "h200_ab.sh")
    folders = _artifact_folders(tmp_path, ("base", "exp"))
    path, calls = _stub_bin(tmp_path)
    r = subprocess.run(["bash", script, *folders], capture_output=True, text=True,
                       env={"PATH": path, "OUT": str(tmp_path / "out"), "NCU": "0", "SELFTEST": "0",
                            "RACECHECK": racecheck})
    assert r.returncode == 0, r.stderr
    runs = [line.split() for line in calls.read_text().splitlines() if line.startswith("compute-sanitizer")]
    if racecheck == "1":
        assert [w[w.index("tools/sanitize_variants.py") + 1] for w in runs] == folders
        assert all(w[1:3] == ["--tool", "racecheck"] and "--default-only" in w and w[-1] == "77,1000" for w in runs)
        assert r.stdout.count("racecheck ") == 2
    else:
        assert runs == []


def test_the_sanitize_stage_runs_memcheck_then_racecheck_over_every_variant(tmp_path):
    """`h200_all.sh sanitize`: compute-sanitizer memcheck of every variant at four Ms, then racecheck of every
    variant at one M (not only the default variants: that check missed 17 variants with hazards, session 41), each
    a step with its verdict in summary.txt."""
    script = str(SCRIPTS[0].parent / "h200_all.sh")
    path, calls = _stub_bin(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run(["bash", script, "sanitize"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": path, "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    runs = [line.split() for line in calls.read_text().splitlines() if line.startswith("compute-sanitizer")]
    assert [w[2] for w in runs] == ["memcheck", "racecheck"]
    for w, ms in zip(runs, ("1,77,1000,4592", "77")):
        assert w[w.index("tools/sanitize_variants.py") + 1] == "artifacts" and w[-2:] == ["--m", ms]
        assert "--default-only" not in w and "--match" not in w and "--error-exitcode" in w
    summary = (out / "summary.txt").read_text()
    assert "memcheck, every variant: exit 0" in summary and "racecheck, every variant: exit 0" in summary


def test_a_dangling_artifacts_link_is_refused_before_any_step(tmp_path):
    """The device tool carries an `artifacts` symlink without the folder it points to: `h200_all.sh` says so, names
    the target and how to carry it, and exits 2 before it installs anything or runs a step."""
    script = str(SCRIPTS[0].parent / "h200_all.sh")
    path, calls = _stub_bin(tmp_path)
    (tmp_path / "artifacts").symlink_to("artifacts_build_s99")
    out = tmp_path / "out"
    r = subprocess.run(["bash", script, "measures"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": path, "OUT": str(out)})
    assert r.returncode == 2
    assert "'artifacts_build_s99', which is not here" in r.stderr and "ln -sfn FOLDER artifacts" in r.stderr
    assert not calls.exists() or "python3" not in calls.read_text()
    (tmp_path / "artifacts_build_s99").mkdir()                  # with the target there, the stage runs
    r = subprocess.run(["bash", script, "measures"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": path, "OUT": str(tmp_path / "out2")})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("with_ncu", [True, False])
def test_the_measures_stage_benches_both_operators_and_profiles_the_small_m_kernels(tmp_path, with_ncu):
    """`h200_all.sh measures`: quantize_act's bench, the GEMM's in bf16 and fp16 at M = 16-9728 with plots, and (where
    ncu exists) ncu of the three (K, N) of issue 7's small-M points, each summarised by tools/ncu_summary.py; a run
    that leaves more than the device tool's 8 files in $OUT is packed into one archive beside summary.txt."""
    script = str(SCRIPTS[0].parent / "h200_all.sh")
    path, calls = _stub_bin(tmp_path, ncu=with_ncu)
    out = tmp_path / "out"
    r = subprocess.run(["bash", script, "measures"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": path, "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    log = calls.read_text().splitlines()
    benches = [line.split() for line in log if "svdq_loader.testing.bench" in line]
    assert [(w[w.index("--dtype") + 1], w[w.index("--op") + 1]) for w in benches] == \
        [("bf16", "quantize_act"), ("bf16", "gemm_w4a4"), ("fp16", "gemm_w4a4")]
    for w in benches[1:]:
        assert w[w.index("--m") + 1] == "16,64,256,1024,4608,9728" and "--plot" in w and "--json" in w
    profiles = [line.split() for line in log if line.startswith("ncu ")]
    summaries = [line.split() for line in log if "tools/ncu_summary.py" in line and "--metrics" not in line
                 and "--header" not in line]
    if with_ncu:
        assert [(w[w.index("--k") + 1], w[w.index("--n") + 1]) for w in profiles] == \
            [("3072", "3072"), ("3072", "21504"), ("15360", "3072")]
        assert all("--clock-control" in w and "tools/sm90_one_call.py" in w for w in profiles)
        assert [w[-1] for w in summaries] == ["(3072,3072)", "(3072,21504)", "(15360,3072)"]
        assert [w[w.index("tools/ncu_summary.py") + 1] for w in summaries] == \
            [str(out / f"ncu_{k}.csv") for k in ("3072_3072", "3072_21504", "15360_3072")]
        assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.txt"]    # 10 files: packed
        with tarfile.open(out / "results.tgz") as tar:
            names = {Path(n).name for n in tar.getnames()}
        assert {"bench_gemm_fp16.log", "ncu_15360_3072.csv", "ncu_small_m.md", "summary.txt"} <= names
    else:
        assert profiles == [] and summaries == []
        assert "ncu: not found" in (out / "summary.txt").read_text()
        assert not (out / "results.tgz").exists()                                      # 6 files: left as they are


def test_outputs_are_packed_only_where_the_run_started_in_an_empty_folder(tmp_path):
    """A user's own $OUT with files in it is never packed or cleared: the archive is only for the device tool's
    fresh, empty $OUT."""
    script = str(SCRIPTS[0].parent / "h200_all.sh")
    path, _ = _stub_bin(tmp_path, ncu=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    r = subprocess.run(["bash", script, "measures"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": path, "OUT": str(out)})
    assert r.returncode == 0, r.stderr
    names = {p.name for p in out.iterdir()}
    assert "results.tgz" not in names and (out / "mine.txt").read_text() == "keep me"
    assert {"bench_gemm_bf16.log", "ncu_3072_21504.csv", "summary.txt"} <= names and len(names) > 8


def test_the_quant_ab_script_refuses_missing_folders(tmp_path):
    script = str(SCRIPTS[0].parent / "h200_quant_ab.sh")
    r = subprocess.run(["bash", script], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: h200_quant_ab.sh BASE EXP" in r.stderr
    base, = _artifact_folders(tmp_path, ("base",))
    r = subprocess.run(["bash", script, base, str(tmp_path / "nope")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and "nope has no manifest.json" in r.stderr
    assert not (tmp_path / "out").exists()           # refused before anything ran


def test_the_quant_ab_script_sweeps_both_folders_then_tests_the_experiment(tmp_path):
    """`h200_quant_ab.sh BASE EXP`: one quant_sweep over both folders with the full check, then the GPU tests and the
    selftest of EXP alone, each a step with its verdict in summary.txt."""
    script = str(SCRIPTS[0].parent / "h200_quant_ab.sh")
    base, exp = _artifact_folders(tmp_path, ("base", "exp"))
    path, calls = _stub_bin(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run(["bash", script, base, exp], capture_output=True, text=True,
                       env={"PATH": path, "OUT": str(out), "SWEEP_RANKS": "32", "SWEEP_DTYPE": "fp16"})
    assert r.returncode == 0, r.stderr
    log = [line for line in calls.read_text().splitlines() if "pip install" not in line]
    assert len(log) == 3
    sweep, tests, selftest = (line.split() for line in log)
    assert sweep[1] == "tools/quant_sweep.py" and sweep[2:4] == [base, exp] and "--full-check" in sweep
    assert sweep[sweep.index("--ranks") + 1] == "32" and sweep[sweep.index("--dtype") + 1] == "fp16"
    assert sweep[sweep.index("--smooth") + 1] == "1"           # the default smoothing form
    assert tests[1:4] == ["-m", "pytest", "-q"] and "tests/test_gpu_quantize.py" in tests
    assert selftest[3] == exp and selftest[-2:] == ["--op", "quantize_act"]
    summary = (out / "summary.txt").read_text()
    assert all(f"{step}: exit 0" in summary for step in ("sweep", "tests", "selftest"))

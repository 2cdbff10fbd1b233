"""Fake kernel families meeting the family contract (no DSL), and a fake registry to install them.

`install_fake(monkeypatch)` replaces the registry seen by `svdq_aot.variants`
and `svdq_aot.config` with one holding a fake ``gemm_w4a4`` family and a
fake ``quantize_act`` family for sm_90a (and quantize_act for sm_100a), a fake ``gemm_w4a4``
family for sm_100a/sm_103a, and both ops for sm_120a / sm_121a (the GEMM there in the blocked
scale layout).
"""
from __future__ import annotations

import types
from pathlib import Path

from svdq_aot import config as C
from svdq_aot import variants as V
from svdq_aot.family import CompiledKernel, check_family


def _axes_tiles_stages(arch, section):
    problems = [f"{k}: unknown key (allowed: tiles, stages)" for k in section if k not in ("tiles", "stages")]
    tiles = section.get("tiles", [[128, 128, 64]])
    stages = section.get("stages", ["auto"])
    return [dict(tile_m=t[0], tile_n=t[1], tile_k=t[2], stages=s) for t in tiles for s in stages], problems


def make_gemm_family(**overrides) -> types.SimpleNamespace:
    fam = types.SimpleNamespace(__name__="fake.gemm")
    fam.OP = "gemm_w4a4"
    fam.ARCHS = ("sm_90a",)
    fam.NAME = "fake_gemm"
    fam.TUNING = dict(tile_m=(64, 128), tile_n=(64, 128, 256), tile_k=(64, 128), stages=(1, 2, 3, 4))
    fam.FEATURES = dict(out_dtype=("fp16", "bf16"), rank=(0, 16, 32, 48, 64, 128), wcscale=(False, True),
                        bias=(False, True), scale_layout=("logical",))
    fam.resource_calls = []

    def resource_problem(knobs):
        fam.resource_calls.append(dict(knobs))
        if knobs["rank"] == 128 and knobs["tile_n"] == 256:
            return f"SMEM budget exceeded: needs 240 KiB > 227 KiB at rank {knobs['rank']} with tile_n 256"
        return None

    def invalid_reason(arch, knobs):
        bad = []
        for table in (fam.FEATURES, fam.TUNING):
            for k, allowed in table.items():
                if knobs.get(k) not in allowed:
                    bad.append(f"{k} {knobs.get(k)!r} not supported by fake_gemm "
                               f"(supported: {', '.join(map(repr, allowed))})")
        if bad:
            return "; ".join(bad)
        return fam.resource_problem(knobs)

    def resolve(arch, knobs):
        return dict(knobs, stages=2) if knobs["stages"] == "auto" else dict(knobs)

    def compile(arch, knobs, name, dump_dir):
        assert Path(dump_dir).is_dir()
        return CompiledKernel(cubin=b"\x7fELF-fake-" + name.encode(), compiled=name, entry=f"host_{name}",
                              kernel_symbols=[f"{name}_0"], smem_bytes=1024 * knobs["stages"])

    fam.resource_problem = resource_problem
    fam.config_axes = _axes_tiles_stages
    fam.resolve = resolve
    fam.invalid_reason = invalid_reason
    fam.requirements = lambda arch, knobs: {"n_multiple": knobs["tile_n"], "k_multiple": knobs["tile_k"]}
    fam.compile = compile
    for k, v in overrides.items():
        setattr(fam, k, v)
    return fam


def make_quant_family(**overrides) -> types.SimpleNamespace:
    fam = types.SimpleNamespace(__name__="fake.quant")
    fam.OP = "quantize_act"
    fam.ARCHS = ("sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")
    fam.NAME = "fake_quant"
    fam.TUNING = dict(rows=(4, 8))

    def config_axes(arch, section):
        problems = [f"{k}: unknown key (allowed: rows)" for k in section if k != "rows"]
        return [dict(rows=r) for r in section.get("rows", [8])], problems

    def invalid_reason(arch, knobs):
        if knobs["rank"] > 64:
            return f"rank {knobs['rank']} needs {knobs['rank'] * 512} B of registers per row block, more than 32768"
        return None

    def compile(arch, knobs, name, dump_dir):
        return CompiledKernel(cubin=b"\x7fELF-fake-" + name.encode(), compiled=name, entry=f"host_{name}",
                              kernel_symbols=[f"{name}_0"], smem_bytes=0)

    fam.config_axes = config_axes
    fam.resolve = lambda arch, knobs: dict(knobs)
    fam.invalid_reason = invalid_reason
    fam.requirements = lambda arch, knobs: {"k_multiple": 64}
    fam.compile = compile
    for k, v in overrides.items():
        setattr(fam, k, v)
    return fam


def make_decode_family() -> types.SimpleNamespace:
    """A fake of sm90_decode_act's config surface: no knobs, one variant."""
    fam = types.SimpleNamespace(__name__="fake.decode")
    fam.OP = "decode_act"
    fam.ARCHS = ("sm_90a",)
    fam.NAME = "fake_decode"
    fam.TUNING = {}

    def compile(arch, knobs, name, dump_dir):
        return CompiledKernel(cubin=b"\x7fELF-fake-" + name.encode(), compiled=name, entry=f"host_{name}",
                              kernel_symbols=[f"{name}_0"], smem_bytes=0)

    fam.config_axes = lambda arch, section: ([{}], [f"{k}: unknown key (decode_act has no knobs)" for k in section])
    fam.resolve = lambda arch, knobs: dict(knobs)
    fam.invalid_reason = lambda arch, knobs: None
    fam.requirements = lambda arch, knobs: {"k_multiple": 64}
    fam.compile = compile
    return fam


def make_blackwell_gemm_family() -> types.SimpleNamespace:
    """A fake of sm100_gemm_w4a4's config surface: tiles [cta_group, tile_m, tile_n], ab_stages."""
    fam = types.SimpleNamespace(__name__="fake.gemm_sm100")
    fam.OP = "gemm_w4a4"
    fam.ARCHS = ("sm_100a", "sm_103a")
    fam.NAME = "fake_gemm_sm100"
    fam.TUNING = dict(cta_group=(1, 2), tile_m=(128, 256), tile_n=(128, 256), ab_stages=(2, 3, 4, 5))

    def config_axes(arch, section):
        problems = [f"{k}: unknown key (allowed: tiles, ab_stages)" for k in section if k not in ("tiles", "ab_stages")]
        tiles = section.get("tiles", [[2, 256, 128]])
        return [dict(cta_group=t[0], tile_m=t[1], tile_n=t[2], ab_stages=s) for t in tiles
                for s in section.get("ab_stages", ["auto"])], problems

    def compile(arch, knobs, name, dump_dir):
        return CompiledKernel(cubin=b"\x7fELF-fake-" + name.encode(), compiled=name, entry=f"host_{name}",
                              kernel_symbols=[f"{name}_0"], smem_bytes=4096)

    fam.config_axes = config_axes
    fam.resolve = lambda arch, knobs: dict(knobs, ab_stages=4) if knobs["ab_stages"] == "auto" else dict(knobs)
    fam.invalid_reason = lambda arch, knobs: None
    fam.requirements = lambda arch, knobs: {"n_multiple": knobs["tile_n"], "k_multiple": 256}
    fam.compile = compile
    return fam


def make_fake_registry(gemm=None, quant=None) -> types.SimpleNamespace:
    gemm = gemm or make_gemm_family()
    quant = quant or make_quant_family()
    bw = make_blackwell_gemm_family()
    gemm12 = make_gemm_family(__name__="fake.gemm12", ARCHS=("sm_120a", "sm_121a"), NAME="fake_gemm12")
    gemm12.FEATURES = dict(gemm12.FEATURES, scale_layout=("blocked",))
    fams = {("gemm_w4a4", "sm_90a"): gemm, ("quantize_act", "sm_90a"): quant, ("quantize_act", "sm_100a"): quant,
            ("quantize_act", "sm_103a"): quant, ("gemm_w4a4", "sm_100a"): bw, ("gemm_w4a4", "sm_103a"): bw,
            ("gemm_w4a4", "sm_120a"): gemm12, ("gemm_w4a4", "sm_121a"): gemm12,
            ("quantize_act", "sm_120a"): quant, ("quantize_act", "sm_121a"): quant,
            ("decode_act", "sm_90a"): make_decode_family()}

    def family(op, arch):
        fam = fams[(op, arch)]
        check_family(fam, where=fam.__name__)
        return fam

    return types.SimpleNamespace(FAMILIES={k: f.__name__ for k, f in fams.items()}, family=family)


def install_fake(monkeypatch, gemm=None, quant=None):
    reg = make_fake_registry(gemm, quant)
    monkeypatch.setattr(V, "_registry", lambda: reg)
    monkeypatch.setattr(V, "_FAMILY_CACHE", {})
    monkeypatch.setattr(C, "_registered", lambda: tuple(reg.FAMILIES))
    return reg

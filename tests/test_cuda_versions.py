"""Minimum driver per arch and the refusal message (pure Python)."""
from __future__ import annotations

import pytest

from svdq_loader import cuda_versions as cv


def test_required_per_arch_and_toolkit():
    assert cv.required("sm_90a", 12) == 12040          # the loader's own floor (cuKernelGetParamInfo)
    assert cv.required("sm_100a", 12) == 12080
    assert cv.required("sm_103a", 12) == 12090
    assert cv.required("sm_90a", 13) == cv.required("sm_103a", 13) == 13000   # a CUDA 13 compiler: driver 580+
    assert cv.required("sm_999a", 12) == 12040          # an arch not in the table: the toolkit / loader floor


def test_text_and_linux_driver():
    assert cv.text(12080) == "12.8" and cv.text(13000) == "13.0" and cv.text(12040) == "12.4"
    assert cv.linux_driver(12090) == "575.51.03"
    assert cv.linux_driver(12060) == "550.54.14+"
    assert cv.linux_driver(11080) == "?"


def test_check_names_both_versions():
    cv.check(13000, 12080, "sm_100a", "artifacts")
    with pytest.raises(cv.DriverTooOld, match=r"the CUDA driver supports CUDA 12.4 \(12040\) but the sm_100a kernels "
                                              r"in artifacts need CUDA 12.8 \(12080\), Linux driver 570.26 or newer"):
        cv.check(12040, 12080, "sm_100a", "artifacts")


def test_the_build_records_the_requirement(tiny_artifacts):
    from svdq_aot.build import _toolkit_major
    from svdq_loader.manifest import read_manifest
    m = read_manifest(tiny_artifacts)
    assert m.schema_version == 3 and _toolkit_major() in (12, 13)
    assert m.cuda_driver == {"sm_90a": cv.required("sm_90a", _toolkit_major())}
    assert {(r.op, r.family) for r in m.selection} == {("gemm_w4a4", "sm90_wgmma_w4a4"), ("quantize_act", "quantize_act")}

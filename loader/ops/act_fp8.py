"""Operator ``act_fp8``: NVFP4 activations -> the E4M3 *stage images* of the sm_90a FP8-compute GEMM.

An internal operator: no public call.  The ``gemm_w4a4_fp8`` op's spec names it as its ``prepass``: each call runs it
into a per-call workspace, then the GEMM reads that workspace through its ``act`` pointer (`decode_act.ImagesLauncher`).
It is the FP8-compute mode's activation side (docs/design.md section 2): the activation quantize_act wrote, each
value rounded once to E4M3 after the row's power of two ``ra``.

The workspace (one home: `ira_bytes`, `workspace_bytes`, `image_offset`):

* first ``1 / ra[r]`` as float32 for every image row r (``image_rows(M)`` of them, `decode_act.image_rows`;
  rows >= M hold 1.0): the GEMM's epilogue reads them through the ``act`` pointer itself;
* then the image: element (r, k) holds ``e4m3(A[r, k] · ra[r])`` (``A`` = e2m1 code · E4M3 block scale; rows >= M
  hold +0), k-tile major with 128 k per k-tile: the 128 bytes of k-tile t of row r are at
  ``ira_bytes(M) + (t · image_rows(M) + r) · 128``, and inside a row the 16-byte chunk c (k = 16c .. 16c + 15) sits
  at chunk ``c ^ (r % 8)``: the 128-byte swizzle of the GEMM's E4M3 stages.  One k-tile of the rows of a GEMM tile
  is one contiguous block, one bulk copy.

``ra[r]`` is the largest power of two with 6 · (the row's largest block scale) · ra <= 448 (1 for a row of zero
scales): `svdq_loader.testing.fp8_reference.scale_pow2`.
"""
from __future__ import annotations

from .decode_act import image_rows, prepass_spec, workspace_size_problem

#: k per E4M3 image row of a k-tile (one 128-byte stage row)
IMAGE_K = 128


def ira_bytes(m: int) -> int:
    """Bytes of the 1 / ra vector at the start of the workspace (float32 per image row; a multiple of 256)."""
    return 4 * image_rows(m)


def workspace_bytes(m: int, k: int) -> int:
    """Bytes of the workspace one call of an FP8-compute GEMM needs: 1 / ra, then the E4M3 image."""
    return (4 + k) * image_rows(m)


def image_size_problem(m: int, k: int) -> str | None:
    """Why the FP8-compute GEMM cannot serve an M x K call (its workspace would not fit 32-bit offsets), or None."""
    return workspace_size_problem("the act_fp8 workspace", "act_fp8", m, k, workspace_bytes(m, k),
                                  "split the call along M")


def image_offset(m: int, row: int, k: int) -> int:
    """Byte offset of element (row, k) in the workspace of an M-row activation."""
    t, kk = divmod(k, IMAGE_K)
    c, e = divmod(kk, 16)
    return ira_bytes(m) + ((t * image_rows(m) + row) * 8 + (c ^ (row % 8))) * 16 + e


SPEC = prepass_spec("act_fp8", "NVFP4 activations -> E4M3 stage images and 1 / ra (the pre-pass of the sm_90a "
                               "FP8-compute GEMM)")

__all__ = ["SPEC", "IMAGE_K", "ira_bytes", "workspace_bytes", "image_size_problem", "image_offset"]

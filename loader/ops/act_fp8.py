"""Operator ``act_fp8``: NVFP4 activations -> the E4M3 *stage images* of the sm_90a FP8-compute GEMM.

No call of its own: ``quantize_act(..., compute="fp8")`` and ``act_to_fp8`` run it (below), and the ``gemm_w4a4_fp8``
op's spec names it as its ``prepass``: each call from an NVFP4 activation runs it
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

**The FP8-compute activation (`E4m3Act`).**  ``lib.quantize_act(x, compute="fp8")`` returns the activation in this
mode's own form: this workspace, filled.  ``lib.gemm_w4a4`` then takes it in place of ``act`` (with ``ascales=None``)
and a weight prepared with ``compute="fp8"``, and launches the GEMM alone.  The workspace is made by quantize_act's
NVFP4 kernel and then this op's kernel (two launches, the NVFP4 intermediate freed after); a single fused kernel is
not built (docs/design.md section 2 says why: ``ra`` needs the row's largest scale before the first E4M3 value).
"""
from __future__ import annotations

from dataclasses import dataclass

from .decode_act import image_rows, prepass_spec, workspace_size_problem
from .spec import PTR_ALIGN

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


#: act_fp8's launch: its CTAs own 16 image rows each (``image_rows(M) / 16`` row tiles, grid.x), and where the row
#: tiles are fewer than this many, each row tile's K is split over grid.y CTAs (`ksplit_by`; the default build since
#: session 31, ``SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT=0`` builds the unsplit form), so a small M still fills the GPU: the
#: pass is latency-bound (about 8 loads in flight per thread), and unsplit, M = 1024's 72 row tiles took 22 µs for
#: K = 12288 on the H200 (session 30; split, 5 µs on an H100, session 31).  Four CTAs per SM of a 132-SM GPU is the
#: target.
KSPLIT_TARGET_CTAS = 528


def ksplit_by(row_ctas, k, floordiv, maximum, minimum):
    """CTAs per row tile of act_fp8 (grid.y) over any integer arithmetic (the kernel's traced integers, the launch
    recipe's expressions, Python ints): ``min(max(KSPLIT_TARGET_CTAS // row_ctas, 1), K / 256)``.  CTA z of a row
    tile converts the k-tile pairs [P·z / S, P·(z + 1) / S) of P = K / 256 (every CTA at least one pair)."""
    return minimum(maximum(floordiv(KSPLIT_TARGET_CTAS, row_ctas), 1), floordiv(k, 2 * IMAGE_K))


def ksplit(m: int, k: int, rows_per_cta: int = 16) -> int:
    """`ksplit_by` on Python ints for an M x K activation."""
    return ksplit_by(image_rows(m) // rows_per_cta, k, lambda a, b: a // b, max, min)


def image_offset(m: int, row: int, k: int) -> int:
    """Byte offset of element (row, k) in the workspace of an M-row activation."""
    t, kk = divmod(k, IMAGE_K)
    c, e = divmod(kk, 16)
    return ira_bytes(m) + ((t * image_rows(m) + row) * 8 + (c ^ (row % 8))) * 16 + e


@dataclass(frozen=True)
class E4m3Act:
    """An activation in the FP8-compute mode: `data` is the act_fp8 workspace of an M x K activation (1 / ra, then
    the E4M3 image; ``workspace_bytes(m, k)`` uint8 on one CUDA device).  What ``quantize_act(..., compute="fp8")``
    returns and ``gemm_w4a4`` takes as ``act`` (its ``ascales`` is then None): the GEMM reads it as it is."""
    data: object
    m: int
    k: int

    def __post_init__(self):
        from .checks import fail, torch_module
        torch = torch_module()
        d = self.data
        if not isinstance(d, torch.Tensor) or d.dtype != torch.uint8 or d.dim() != 1 or not d.is_contiguous():
            fail(f"E4m3Act.data must be a contiguous 1-D uint8 tensor, got "
                 f"{getattr(d, 'dtype', type(d).__name__)} of shape {tuple(getattr(d, 'shape', ()))}")
        if self.m < 1 or self.k < 1 or self.k % (2 * IMAGE_K):
            fail(f"E4m3Act of M={self.m}, K={self.k}: M >= 1 and K a multiple of {2 * IMAGE_K}")
        if d.data_ptr() % PTR_ALIGN:
            fail(f"E4m3Act.data pointer 0x{d.data_ptr():x} is not {PTR_ALIGN}-byte aligned (the GEMM bulk-copies it)")
        want = workspace_bytes(self.m, self.k)
        if d.numel() != want:
            fail(f"E4m3Act.data has {d.numel()} bytes but an M={self.m}, K={self.k} activation takes {want} "
                 f"(4 + K bytes per image row, {image_rows(self.m)} rows)")

    @property
    def device(self):
        return self.data.device

    def get_device(self) -> int:
        return self.data.get_device()

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    @classmethod
    def empty(cls, m: int, k: int, device) -> "E4m3Act":
        """An unfilled activation of M x K on `device` (what quantize_act writes into)."""
        from .checks import torch_module
        torch = torch_module()
        return cls(torch.empty(workspace_bytes(m, k), dtype=torch.uint8, device=device), m, k)


SPEC = prepass_spec("act_fp8", "NVFP4 activations -> E4M3 stage images and 1 / ra (the pre-pass of the sm_90a "
                               "FP8-compute GEMM)")

__all__ = ["SPEC", "E4m3Act", "KSPLIT_TARGET_CTAS", "ksplit_by", "ksplit", "IMAGE_K", "ira_bytes", "workspace_bytes",
           "image_size_problem", "image_offset"]

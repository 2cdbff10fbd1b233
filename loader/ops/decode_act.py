"""Operator ``decode_act``: NVFP4 activations -> exact fp16 *stage images* for the sm_90a GEMM.

An internal operator: no public call.  A ``gemm_w4a4`` variant whose knob
``act_source`` is ``images`` does not decode the activations itself; its
call first runs this op into a per-call workspace, then the GEMM reads that
workspace through its ``act`` pointer (`ImagesLauncher`; the GEMM op spec's
``prepass`` names this op).  The decode then happens once per call instead
of once per weight tile a CTA meets (N / tile_n times per activation row).

The image format (``images``; one home: `image_rows`, `image_bytes`,
`image_offset`):

* element (m, k) holds ``e2m1(code[m, k]) · e4m3(ascales[m, k // 16]) · 2^-7``
  as an fp16 (exact: at most 6 significant bits, between 2^-17 and 21);
  the GEMM's epilogue multiplies by 2^14 (the weight side carries the
  other 2^-7);
* rows are padded with +0.0 to `image_rows(M)`: the smallest multiple of
  64 (one decode_act CTA) that covers whole tiles of every images tile
  height (`IMAGE_TILE_ROWS`: 64, 128, 208, 224 and 256; the first two divide
  256, so they never add rows), so every tile's rows exist; a form of
  a height in `IMAGE_INNER_ROWS` (216) serves an M only where its tiles
  lie inside those rows (`tile_rows_problem`);
* k-tile major: the 64 k of k-tile t of row r are the 128 bytes at
  ``(t · image_rows(M) + r) · 128``, so the rows [m0, m0 + tile_m) of one
  k-tile are one contiguous block that one bulk copy moves into a stage;
* inside a row, the 16-byte chunk c (k = 8c .. 8c + 7) sits at chunk
  ``c ^ (r % 8)``: the 128-byte swizzle of the GEMM's SMEM stages.

Workspace: ``K · image_rows(M) · 2`` bytes per call (4x the size of `act`).
"""
from __future__ import annotations

from .layouts import SCALE_LAYOUT_BY_ARCH
from .spec import Feature, OpSpec, distinct_k_coverage, m_k_shape_rule
from .workspace import PerCallWorkspace

#: The activation tile heights (tile_m) an images GEMM form may have: the image covers whole tiles of each.
#: 224 exists for the wave count: at M = 4608, N = 3072 its 504 tiles are 3.8 waves on 132 SMs, where 256 rows
#: give 432 tiles, 3.3 waves (a last wave with 96 of 132 SMs idle).  208 for M = 1024 and 2048: as many row tiles
#: as 224 (five at M = 1024), each with 7 % less work, where the call is a whole number of tile times.  64 and 128
#: for small M (session 17: the 64-row tile 7-10 % faster reading the image at M = 64, N >= 9216, than decoding the
#: same activations in each CTA); both divide 256, so they change no image's height.
IMAGE_TILE_ROWS = (64, 128, 208, 224, 256)
#: The heights that set an image's rows: a height that divides another one is covered whenever that one is, so the
#: rule (and the per-call arithmetic, the decode_act launch and the kernels' row count) skips it: 208, 224, 256.
IMAGE_COVER_ROWS = tuple(t for t in IMAGE_TILE_ROWS if not any(u != t and u % t == 0 for u in IMAGE_TILE_ROWS))
#: Tile heights an images form may also have that do not set the image's rows (so adding one changed no image, no
#: pre-pass and no other kernel): such a form serves an M only where its row tiles lie inside `image_rows(M)`
#: (`tile_rows_problem`; 216 rows: 85 % of M up to 20000, M = 1024 and 4608 among them).  216 exists for the wave
#: count at M = 4608: 22 row tiles by 24, 72 or 96 weight tiles are exactly 4, 12 or 16 waves on 132 SMs, with 3.6 %
#: less work per SM than the 224-row tile's 21 row tiles in as many waves (measured on an H100, session 31: 1.3-2.3 %
#: faster than 224 rows at M = 4608 in both modes).  A multiple of 8, the swizzle's row period, so a tile's first row
#: sits at swizzle phase 0.
IMAGE_INNER_ROWS = (216,)
#: decode_act writes 64 image rows per CTA: the image's rows are a multiple of this.
IMAGE_ROW_BLOCK = 64
#: k per image row (one 128-byte fp16 row of a GEMM stage)
IMAGE_K = 64
#: The power-of-two factor every image value carries (undone in the GEMM's epilogue with the weight's).
IMAGE_SCALE_LOG2 = -7


#: An image must take fewer bytes than this: decode_act computes its offsets in 32-bit integers.  The GEMM's
#: images forms are out of the selection for a call whose image would not fit (the nvfp4 forms serve it).
IMAGE_BYTES_LIMIT = 1 << 31


def image_rows_by(m, round_up, maximum):
    """The image_rows rule over any integer arithmetic: `round_up(x, t)` is x rounded up to a multiple of the
    constant t, `maximum(a, b)` the larger.  The one statement of the rule, evaluated on Python ints here, on DSL
    integers by the kernels and as launch-recipe expressions by decode_act's recipe hint."""
    cover = round_up(m, IMAGE_COVER_ROWS[0])
    for t in IMAGE_COVER_ROWS[1:]:
        cover = maximum(cover, round_up(m, t))
    return round_up(cover, IMAGE_ROW_BLOCK)


def image_rows(m: int) -> int:
    """Rows of the image of an M-row activation: M rounded up to whole tiles of every IMAGE_TILE_ROWS height,
    then to IMAGE_ROW_BLOCK."""
    return image_rows_by(m, lambda x, t: -(-x // t) * t, max)


def image_bytes(m: int, k: int) -> int:
    """Bytes of the workspace one call of an images GEMM needs."""
    return k * image_rows(m) * 2


def image_size_problem(m: int, k: int) -> str | None:
    """Why an images GEMM cannot serve an M x K call (its image would not fit 32-bit offsets), or None."""
    return workspace_size_problem("act_source images: the decode_act image", "decode_act", m, k, image_bytes(m, k),
                                  "the forms that decode in their producer (act_source nvfp4) serve this call")


def tile_rows_problem(tile_m: int, m: int) -> str | None:
    """Why an images form of `tile_m` rows cannot serve an M-row call (its last row tile would read past the
    image's rows), or None.  Always None for the heights of IMAGE_TILE_ROWS, which the image covers."""
    end = -(-m // tile_m) * tile_m
    if end <= image_rows(m):
        return None
    return (f"tile_m {tile_m}: the row tiles of M={m} end at row {end}, past the {image_rows(m)} rows of its stage "
            f"image (image_rows: whole tiles of {', '.join(map(str, IMAGE_COVER_ROWS))} rows, then a multiple of "
            f"{IMAGE_ROW_BLOCK}); the forms of those heights serve this call")


def workspace_size_problem(what: str, op: str, m: int, k: int, nbytes: int, remedy: str) -> str | None:
    """None if a pre-pass output of `nbytes` fits the 32-bit offsets pre-pass `op` indexes it with, else why (and
    `remedy`)."""
    if nbytes < IMAGE_BYTES_LIMIT:
        return None
    return (f"{what} of M={m}, K={k} takes {nbytes} bytes, not below 2^31 ({op} indexes it with 32-bit offsets); "
            f"{remedy}")


def image_offset(m: int, row: int, k: int) -> int:
    """Byte offset of element (row, k) in the image of an M-row activation (swizzled chunk, then k % 8)."""
    t, kk = divmod(k, IMAGE_K)
    c, e = divmod(kk, 8)
    return ((t * image_rows(m) + row) * 8 + (c ^ (row % 8))) * 16 + 2 * e


def prepass_spec(name: str, summary: str) -> OpSpec:
    """The spec of an sm_90a activation pre-pass (decode_act, act_fp8): NVFP4 act / ascales in, a workspace out;
    M >= 1, K a multiple of the variant's k_multiple, one variant per distinct K of a config."""
    return OpSpec(
        name=name, summary=summary,
        host_args=(("act", "ptr"), ("ascales", "ptr"), ("images", "ptr"), ("m", "i32"), ("k", "i32"),
                   ("stream", "stream")),
        features=(Feature("scale_layout", "arch", by_arch={a: v for a, v in SCALE_LAYOUT_BY_ARCH.items()
                                                           if a == "sm_90a"}),),
        dims=("m", "k"),
        shape_rule=m_k_shape_rule,
        requirement_keys=("k_multiple",),
        coverage_problems=distinct_k_coverage,
    )


SPEC = prepass_spec("decode_act", "NVFP4 activations -> exact fp16 stage images (the pre-pass of the sm_90a images "
                                  "GEMM)")

_ORDER = ("act", "ascales", "images", "m", "k", "stream")
if SPEC.arg_names != _ORDER:  # pragma: no cover - a spec edit must update ImagesLauncher too
    raise ImportError(f"decode_act: ImagesLauncher builds {_ORDER} but the spec's host args are {SPEC.arg_names}")


#: byte alignment of the meetings' workspace inside a call's workspace (its counters are 64-bit words)
MEET_ALIGN = 256


class ImagesLauncher(PerCallWorkspace):
    """The launcher of a ``gemm_w4a4`` variant with ``act_source`` images: per call, a workspace from
    torch's caching allocator (on the current stream, which is the stream the library launches on), the
    decode pass into it, then the GEMM with ``act`` = the workspace.  Same interface as `Launcher`.

    The workspace is released when `launch` returns (`workspace`).  `extra`: None, or (m, n, k, sm_count) -> bytes
    the GEMM needs beside the images (the op spec's ``prepass_extra_bytes``: a stream-K form's meetings), taken in
    the same block after them and passed to the GEMM as ``ascales``, which an images form does not otherwise read.
    `nbytes`: (m, k) -> the pre-pass's bytes (`ops.WORKSPACE_BYTES_BY_PREPASS`: decode_act's images, or act_fp8's
    1 / ra and E4M3 images)."""

    def __init__(self, decode, gemm, gemm_arg_names: tuple[str, ...], extra=None, nbytes=None):
        self.decode, self.gemm = decode, gemm
        self._nbytes = nbytes or image_bytes
        self.name = gemm.name
        self.device = gemm.device
        self._m, self._k = gemm_arg_names.index("m"), gemm_arg_names.index("k")
        self._stream = gemm_arg_names.index("stream")
        self._act, self._asc = gemm_arg_names.index("act"), gemm_arg_names.index("ascales")
        self._extra = extra
        self._alone = gemm
        if extra is not None:
            self._n, self._sms = gemm_arg_names.index("n"), gemm_arg_names.index("sm_count")
            self._alone = MeetingsLauncher(self)

    def workspace_gemm(self):
        """The GEMM alone, for a call whose activation already is this pre-pass's workspace (an
        ``act_fp8.E4m3Act``): its own launcher, or, where it needs more workspace (`extra`), a launcher that takes
        that per call and passes it as ``ascales`` (made once, with this launcher)."""
        return self._alone

    def launch(self, args) -> None:
        m, k = args[self._m], args[self._k]
        nbytes = self._nbytes(m, k)
        if self._extra is not None:
            at = -(-nbytes // MEET_ALIGN) * MEET_ALIGN
            nbytes = at + self._extra(m, args[self._n], k, args[self._sms])
        ws = self._alloc(nbytes)
        p = ws.data_ptr()
        self.decode.launch([args[self._act], args[self._asc], p, m, k, args[self._stream]])
        a = list(args)
        a[self._act] = p
        if self._extra is not None:
            a[self._asc] = p + at
        self.gemm.launch(a)
        del ws


class MeetingsLauncher(PerCallWorkspace):
    """The GEMM of an `ImagesLauncher` with extra workspace, run alone on a ready activation (`workspace_gemm`): per
    call, the extra bytes from torch's allocator, passed as ``ascales``."""

    def __init__(self, images: ImagesLauncher):
        self._images = images
        self.gemm = images.gemm
        self.name, self.device = images.name, images.device

    def launch(self, args) -> None:
        im = self._images
        ws = self._alloc(im._extra(args[im._m], args[im._n], args[im._k], args[im._sms]))
        a = list(args)
        a[im._asc] = ws.data_ptr()
        self.gemm.launch(a)
        del ws


__all__ = ["SPEC", "prepass_spec", "workspace_size_problem",
           "IMAGE_BYTES_LIMIT", "IMAGE_COVER_ROWS", "IMAGE_INNER_ROWS", "IMAGE_ROW_BLOCK", "IMAGE_TILE_ROWS", "IMAGE_K",
           "IMAGE_SCALE_LOG2", "image_rows", "image_rows_by", "image_bytes", "image_size_problem", "tile_rows_problem",
           "image_offset", "MEET_ALIGN", "ImagesLauncher", "MeetingsLauncher"]

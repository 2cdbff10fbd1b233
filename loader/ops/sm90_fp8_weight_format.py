"""The Hopper weight format of ``gemm_w4a4`` in the FP8-compute mode (``compute: fp8``): NVFP4 weights pre-shuffled
into FP8 ``wgmma`` register fragments, with the per-column power of two ``rw`` (docs/design.md section 2).

The ``sm_90a`` kernel keeps the weight as the register-sourced A operand of ``wgmma.m64nNk32`` (E4M3) and computes
``Yᵀ = W·Aᵀ``.  One thread's A fragment of a 64-row x 32-k block is four 32-bit registers of four E4M3 values each:
register ``i`` holds row ``r0 + 8·(i % 2)`` (``r0 = 16·warp + lane // 4``), k ``16·(i // 2) + 4·(lane % 4)`` and the
three after it (the DSL's ``tv_layout_A`` of the FP8 atom; ``tests/test_sm90_fp8_weight_format.py`` reads it back).
A k-tile is 128 k (one 128-byte row of an E4M3 stage), four such blocks:

``wgt_frag``  uint8 ``[N/64, K/128, 128, 32]``: thread ``t``'s eight words, two 16-byte loads.  Word ``2·kb + h``
    (k-block ``kb``, group ``h`` of its two 16-k groups) holds the eight values of registers ``2h`` (row r0) and
    ``2h + 1`` (row r0 + 8) of block kb.  Its nibble ``j`` (bits ``4j .. 4j+3``) keeps the E2M1 magnitude of value
    ``j`` in bits ``4j .. 4j+2`` (values 0-3: row r0, k ``+0 .. +3``; values 4-7: row r0 + 8), and in bit ``4j+3``
    a sign: nibble ``2b + 1`` the sign of value ``b``, nibble ``2b`` that of value ``4 + b``.  The kernel's decode
    (`decode_word`, `E2M1_E4M3_LUT`) is then seven integer instructions per word: ``m = w & 0x77777777``, one
    byte permute of the E4M3 table per register (selectors ``m`` and ``m >> 16``), and the signs OR-ed in from
    ``w & 0x80808080`` and ``(w << 4) & 0x80808080``.  Each register's four E4M3 values are exact E2M1 values; two
    conversions to fp16x2, one ``mul.f16x2`` by the block's ``scale · rw`` (exact in fp16: at most 4 significant bits,
    between 2⁻¹² and 74.7) and two rounding conversions back (``cvt.rn.satfinite.e4m3x2.f16x2``) give
    ``e4m3(W · rw)``, the mode's operand, bit for bit (the products are exact in fp16, so this is one rounding).
``wscales``   uint8 ``[4·N + N·K/16]``: first ``rw`` as float32 ``[N]`` (the MMA warps read the pair of their two
    rows once per tile, through the kernel's ``wscales`` parameter itself), then ``[N/64, K/128, 32, 16]``: for quad
    ``q = 8·warp + lane // 4`` (rows r0, r0 + 8) the bytes ``[s(r0, 0), s(r1, 0), s(r0, 1), s(r1, 1), ...,
    s(r1, 7)]`` of the k-tile's eight 16-k groups, so 32-bit word ``kb`` of the quad's 16-byte load holds block kb's
    scales and one ``cvt.f16x2.e4m3x2`` of its half ``h`` gives group h's scales of both rows.

The epilogue divides by rw through the ``wcscale`` input, which ``prepare_weight`` sets to wcscale / rw in this
mode.  Both tensors hold the logical tensors' bytes (plus the 4·N of rw); conversion runs once, in
``prepare_weight``; `to_logical` inverts it (the tests prove the permutation a bijection).
"""
from __future__ import annotations

from .checks import fail, torch_module
from .sm90_weight_format import bytes_to_words, fragment_bytes, logical_of_blocks

FRAG_ROWS = 64     # W rows per fragment block (one wgmma M atom)
FRAG_K = 128       # k per fragment block (one k-tile: four 32-k wgmma steps)
NAME = "sm90_fp8_frag"

#: E4M3 bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 (low word) and 2, 3, 4, 6 (high word): the byte permute's table
E2M1_E4M3_LUT = (0x3C383000, 0x4C484440)
MAG_MASK = 0x77777777
SIGN_MASK = 0x80808080


def decode_word(words):
    """The kernel's integer decode of fragment words (ints or int64 tensors of 32-bit words) -> (lo, hi): four E4M3
    bytes each (registers 2h and 2h + 1), the exact E2M1 values with their signs.  Written from the same steps as
    the kernel's PTX (`kernel_src.sm90_fp8_ptx`), with the byte permute spelled out."""
    lut = E2M1_E4M3_LUT[0] | (E2M1_E4M3_LUT[1] << 32)
    m = words & MAG_MASK

    def permute(sel):
        out = 0
        for b in range(4):
            idx = (sel >> (4 * b)) & 7
            out = out | (((lut >> (8 * idx)) & 0xFF) << (8 * b))
        return out
    lo = permute(m & 0xFFFF) | (words & SIGN_MASK)
    hi = permute((m >> 16) & 0xFFFF) | (((words << 4) & 0xFFFFFFFF) & SIGN_MASK)
    return lo, hi


def _nibble_order():
    """(row, k) of every nibble of one 64 x 128 block, in storage order: thread t (128), word w (8), nibble j (8)."""
    torch = torch_module()
    t = torch.arange(128).view(128, 1, 1)
    w = torch.arange(8).view(1, 8, 1)
    j = torch.arange(8).view(1, 1, 8)
    warp, lane = t // 32, t % 32
    kb, h = w // 2, w % 2
    row = 16 * warp + lane // 4 + 8 * (j // 4)
    k = 32 * kb + 16 * h + 4 * (lane % 4) + j % 4
    return (row * FRAG_K + k).reshape(-1)


def _sign_slot(j: int) -> int:
    """The nibble whose bit 3 holds value j's sign."""
    return 2 * j + 1 if j < 4 else 2 * (j - 4)


def _pack(vals):
    """[..., 8] nibble values (value order) -> [...] int64 words in the bit layout above."""
    torch = torch_module()
    word = torch.zeros(vals.shape[:-1], dtype=torch.int64, device=vals.device)
    for j in range(8):
        word |= (vals[..., j] & 7).to(torch.int64) << (4 * j)
        word |= ((vals[..., j] >> 3) & 1).to(torch.int64) << (4 * _sign_slot(j) + 3)
    return word


def _unpack(word):
    torch = torch_module()
    out = [((word >> (4 * j)) & 7) | (((word >> (4 * _sign_slot(j) + 3)) & 1) << 3) for j in range(8)]
    return torch.stack(out, dim=-1)


def check_dims(n: int, k: int) -> None:
    if n % FRAG_ROWS or k % FRAG_K:
        fail(f"the {NAME} weight format needs N % {FRAG_ROWS} == 0 and K % {FRAG_K} == 0, got N={n}, K={k}")


def column_pow2(wscales):
    """``rw [N]`` float32: the largest power of two with 6 · (the column's largest block scale) · rw ≤ 448, 1 for a
    column of zero scales (the mode's rule, `svdq_loader.testing.fp8_reference.scale_pow2`)."""
    torch = torch_module()
    s = wscales.to(torch.float32).abs().amax(dim=1)
    if not torch.isfinite(s).all():
        fail("wscales holds a NaN scale (E4M3 0x7F / 0xFF): the FP8-compute mode needs finite block scales")
    bound = 6.0 * s
    e = torch.floor(torch.log2(torch.where(bound > 0, 448.0 / bound, torch.ones_like(bound))))
    r = torch.exp2(e)
    r = torch.where(bound * r > 448.0, r / 2, r)          # settle a rounded log2 on the exact products
    r = torch.where(bound * (2 * r) <= 448.0, 2 * r, r)
    return torch.where(bound > 0, r, torch.ones_like(r)).to(torch.float32)


def convert(wgt, wscales, wcscale):
    """`prepare_weight`'s hook for sm_90a in the FP8-compute mode: ``(wgt_frag, rw + wscales_frag, wcscale / rw)``
    (`wcscale` None: 1 / rw), with rw computed once (`column_pow2`); the division is exact (rw is a power of two)."""
    torch = torch_module()
    rw = column_pow2(wscales)
    w, sc = to_frag(wgt.contiguous(), wscales.contiguous(), rw)
    return w, sc, (wcscale if wcscale is not None else torch.ones_like(rw)) / rw


def to_frag(wgt, wscales, rw=None):
    """Logical ``wgt [N, K/2]`` uint8 and ``wscales [N, K/16]`` e4m3 -> ``(wgt_frag, rw_and_wscales_frag)`` (`rw`:
    `column_pow2` of wscales, computed here when not given)."""
    torch = torch_module()
    check_dims(wgt.shape[0], 2 * wgt.shape[1])
    wgt_frag = fragment_bytes(wgt, FRAG_ROWS, FRAG_K, _nibble_order(), _pack)    # [nb, kb, 128, 32]
    nb, kb = wgt_frag.shape[:2]
    s = wscales.view(torch.uint8).view(nb, 4, 2, 8, kb, 8)                 # [nb, warp, h (r0/r1), g, kt, group]
    s = s.permute(0, 4, 1, 3, 5, 2).reshape(nb, kb, 32, 16)                # [nb, kt, quad, (group, h)]
    rw = column_pow2(wscales) if rw is None else rw
    return wgt_frag, torch.cat((rw.view(torch.uint8), s.reshape(-1))).contiguous()


def to_logical(wgt_frag, wsc):
    """Inverse of `to_frag`: ``(wgt [N, K/2] uint8, wscales [N, K/16] e4m3)`` (rw is recomputed, not returned)."""
    torch = torch_module()
    nb, kb = wgt_frag.shape[:2]
    vals = _unpack(bytes_to_words(wgt_frag).view(nb, kb, 128, 8)).reshape(nb, kb, FRAG_ROWS * FRAG_K)
    blocks = torch.empty_like(vals)
    blocks[:, :, _nibble_order().to(wgt_frag.device)] = vals
    wgt = logical_of_blocks(blocks, FRAG_ROWS, FRAG_K)
    s = wsc[4 * nb * FRAG_ROWS:].view(nb, kb, 4, 8, 8, 2)                      # [nb, kt, warp, g, group, h]
    s = s.permute(0, 2, 5, 3, 1, 4).reshape(nb * FRAG_ROWS, kb * 8)
    return wgt, s.contiguous().view(torch.float8_e4m3fn)


def rw_of(wsc, n: int):
    """rw float32 [N] from the head of a converted ``wscales``."""
    torch = torch_module()
    return wsc[: 4 * n].view(torch.float32)

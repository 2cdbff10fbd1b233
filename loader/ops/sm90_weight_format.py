"""The Hopper weight format of ``gemm_w4a4``: NVFP4 weights pre-shuffled into wgmma register fragments.

The ``sm_90a`` kernel (``svdq_kernels.sm90_wgmma_w4a4``) keeps the weight as wgmma's
register-sourced A operand and computes ``Yᵀ = W·Aᵀ`` one 64-row slice of W per warpgroup.
One thread's A fragment of a 64-row x 16-k block holds 8 values: rows ``r0 = 16·warp + lane//4``
and ``r1 = r0 + 8``, columns ``k0 = 2·(lane%4)`` (+1) and ``k0 + 8`` (+1).  This module lays the
nibbles out so that one 16-byte load gives a thread its fragments of a 64 x 64 block (four
16-k blocks, one 32-bit word each), and the block scales so that one 8-byte load gives it the
eight E4M3 scales it needs (the four threads of a quad load the same 8 bytes):

``wgt_frag``  uint8 ``[N/64, K/64, 128, 16]``: thread ``t``'s word ``j`` (k-block ``j``) holds the
    four fp16x2 pairs ``p = 0..3`` of its fragment (pair ``p``: row ``r0 + 8·(p%2)``, k
    ``k0 + 8·(p//2)`` and the next k).  Of pair ``p``, the even-k value's magnitude bits (E2M1
    bits 0-2) sit at word bits ``3p .. 3p+2`` and its sign at bit ``12+p``; the odd-k value's
    magnitude at ``16+3p ..`` and its sign at ``28+p``.  The kernel turns pair ``p`` into
    fp16 bit patterns that are ``e2m1 · 2^-14`` in each half, exactly, by one of the
    `PAIR_DECODES` forms: ``shift`` (two shifts, two masks: ``(w << (9-3p)) & 0x0E000E00 |
    (w << (3-p)) & 0x80008000``) or ``mul`` (one multiply places both shifted copies at once).
``wsc_frag``  uint8 ``[N/64, K/64, 32, 8]``: for quad ``q = 8·warp + lane//4`` (rows r0, r1)
    the bytes ``[s(r0,0), s(r1,0), s(r0,1), s(r1,1), ..., s(r1,3)]`` (``s(r, j)`` = E4M3 scale of
    row r, k-block j), so one ``cvt.f16x2.e4m3x2`` gives the scales of k-block j for both rows.

Both tensors hold exactly as many bytes as the logical ``[N, K/2]`` / ``[N, K/16]`` ones.
Conversion runs once, in ``prepare_weight``, on the weight's device; `to_logical` inverts it
(tests use it to prove the permutation is a bijection).
"""
from __future__ import annotations

from .checks import torch_module

FRAG_ROWS = 64   # W rows per fragment block (one wgmma M atom)
FRAG_K = 64      # k per fragment block (four 16-k wgmma steps)
NAME = "sm90_frag"

#: The fp16x2 bits a decoded pair may set: each half's sign (bit 15) and E2M1 magnitude (bits 9-11).
PAIR_BITS = 0x8E008E00


def field_mask(p: int) -> int:
    """The word bits of pair p: both values' magnitudes and signs."""
    return (7 << 3 * p) | (7 << (16 + 3 * p)) | (1 << (12 + p)) | (1 << (28 + p))


def _shift_terms(p: int):
    return ((None, 1 << (9 - 3 * p), 0x0E000E00), (None, 1 << (3 - p), 0x80008000))


#: How the kernel turns pair p of a word into fp16x2 bit patterns (``e2m1 · 2^-14`` in each half), per decode
#: form: the OR over terms ``(pre, mult, post)`` of ``((w & pre) · mult mod 2^32) & post`` (``pre`` None: no
#: mask; a power-of-two ``mult`` is a shift).  The kernel's PTX is written from these terms and the CPU tests
#: replay them, so both read one statement.
#:
#: * ``shift``: two shifts and two masks per pair (four integer instructions; pair 3's shifts are by 0).
#: * ``mul``: pairs 0 and 1 mask their eight bits, then one multiply by 2^a + 2^b puts a copy shifted by a (the
#:   magnitudes' shift) and one shifted by b (the signs') in one word.  The copies' other bits land outside
#:   `PAIR_BITS` and never overlap a bit of the other copy below it, so no carry reaches `PAIR_BITS`
#:   (`tests/test_sm90_weight_format.py` checks every value).  Pair 3 is already in place (one mask).  Pair 2's
#:   two shifts differ by 2, less than the magnitude's 3 bits, so its copies would overlap: it keeps the shift
#:   form.  In the SASS: 11 integer instructions per word, against the shift form's 13 (ptxas shares the shift by
#:   3 of pairs 0 and 2).
PAIR_DECODES = {
    "shift": {p: _shift_terms(p) for p in range(4)},
    "mul": {0: ((field_mask(0), (1 << 9) + (1 << 3), PAIR_BITS),),
            1: ((field_mask(1), (1 << 6) + (1 << 2), PAIR_BITS),),
            2: _shift_terms(2),
            3: ((None, 1, PAIR_BITS),)},
}


def decode_pair_bits(words, p: int, form: str):
    """The fp16x2 bit patterns of pair p of `words` (ints, or int64 tensors / arrays of 32-bit words), computed
    with the kernel's own terms for `form` (`PAIR_DECODES`)."""
    out = 0
    for pre, mult, post in PAIR_DECODES[form][p]:
        x = words if pre is None else words & pre
        out = out | (((x * mult) & 0xFFFFFFFF) & post)
    return out


def _nibble_order():
    """(row, k) of every nibble of one 64 x 64 block, in storage order.

    Storage order: thread t (128), word j (4), bit field f (8 nibbles).  Field f = (half h, pair p)
    with h = f // 4, p = f % 4 is the field at magnitude bits ``16·h + 3p`` / sign bit ``12 + 16·h + p``.
    """
    torch = torch_module()
    t = torch.arange(128).view(128, 1, 1)
    j = torch.arange(4).view(1, 4, 1)
    f = torch.arange(8).view(1, 1, 8)
    warp, lane = t // 32, t % 32
    h, p = f // 4, f % 4
    row = 16 * warp + lane // 4 + 8 * (p % 2)
    k = 16 * j + 2 * (lane % 4) + 8 * (p // 2) + h
    return (row * FRAG_K + k).reshape(-1)      # flat index into the block's [64, 64] values


def _pack_fields(vals):
    """[..., 8] nibble values (field order) -> [...] int32 words in the bit layout above."""
    torch = torch_module()
    mag = (vals & 7).to(torch.int64)
    sgn = ((vals >> 3) & 1).to(torch.int64)
    word = torch.zeros(vals.shape[:-1], dtype=torch.int64, device=vals.device)
    for f in range(8):
        h, p = f // 4, f % 4
        word |= mag[..., f] << (16 * h + 3 * p)
        word |= sgn[..., f] << (12 + 16 * h + p)
    return word


def _unpack_fields(word):
    torch = torch_module()
    out = []
    for f in range(8):
        h, p = f // 4, f % 4
        mag = (word >> (16 * h + 3 * p)) & 7
        sgn = (word >> (12 + 16 * h + p)) & 1
        out.append(mag | (sgn << 3))
    return torch.stack(out, dim=-1)


def _check_dims(n: int, k: int) -> None:
    from .checks import fail
    if n % FRAG_ROWS or k % FRAG_K:
        fail(f"the {NAME} weight format needs N % {FRAG_ROWS} == 0 and K % {FRAG_K} == 0, got N={n}, K={k}")


def convert(n: int, k: int, wgt, wscales, lora_up, wcscale):
    """`prepare_weight`'s hook for sm_90a: (wgt, wscales) in fragment order; lora_up as given."""
    w, sc = to_frag(wgt.contiguous(), wscales.contiguous())
    return w, sc, lora_up


def nibble_blocks(wgt, rows: int, kk: int):
    """Logical ``wgt [N, K/2]`` uint8 -> int64 ``[N/rows, K/kk, rows·kk]``: each rows x kk block's nibble values,
    row-major (shared with the FP8 format, `sm90_fp8_weight_format`)."""
    torch = torch_module()
    n, kh = wgt.shape
    k = 2 * kh
    w = wgt.to(torch.int64)
    nib = torch.stack((w & 15, w >> 4), dim=-1).reshape(n, k)
    return nib.view(n // rows, rows, k // kk, kk).permute(0, 2, 1, 3).reshape(n // rows, k // kk, rows * kk)


def logical_of_blocks(blocks, rows: int, kk: int):
    """Inverse of `nibble_blocks`: int64 ``[nb, kb, rows·kk]`` -> ``wgt [nb·rows, kb·kk/2]`` uint8."""
    torch = torch_module()
    nb, kb = blocks.shape[:2]
    nib = blocks.view(nb, kb, rows, kk).permute(0, 2, 1, 3).reshape(nb * rows, kb * kk)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8).contiguous()


def fragment_bytes(wgt, rows: int, kk: int, order, pack):
    """Logical ``wgt`` -> uint8 ``[N/rows, K/kk, 128, 4W]``: the nibbles of each rows x kk block taken in `order`
    (flat block indices, 128 threads x W words x 8 nibbles), each thread's words packed by `pack`
    (``[..., W, 8]`` nibble values -> ``[..., W]`` words)."""
    n, kh = wgt.shape
    nb, kb = n // rows, 2 * kh // kk
    vals = nibble_blocks(wgt, rows, kk)[:, :, order.to(wgt.device)].view(nb, kb, 128, -1, 8)
    return words_to_bytes(pack(vals)).contiguous()


def words_to_bytes(words):
    """int64 ``[..., W]`` 32-bit words -> uint8 ``[..., 4W]``, little-endian."""
    torch = torch_module()
    b = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    return b.to(torch.uint8).reshape(*words.shape[:-1], 4 * words.shape[-1])


def bytes_to_words(b):
    """uint8 ``[..., 4W]`` -> int64 ``[..., W]`` 32-bit words, little-endian."""
    torch = torch_module()
    b = b.to(torch.int64).view(*b.shape[:-1], b.shape[-1] // 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def to_frag(wgt, wscales):
    """Logical ``wgt [N, K/2]`` uint8 and ``wscales [N, K/16]`` e4m3 -> ``(wgt_frag, wsc_frag)``."""
    torch = torch_module()
    _check_dims(wgt.shape[0], 2 * wgt.shape[1])
    wgt_frag = fragment_bytes(wgt, FRAG_ROWS, FRAG_K, _nibble_order(), _pack_fields)     # [nb, kb, 128, 16]
    nb, kb = wgt_frag.shape[:2]

    s = wscales.view(torch.uint8).view(nb, FRAG_ROWS, kb, 4)                # [nb, row, kb, j]
    s = s.permute(0, 2, 1, 3).reshape(nb, kb, 4, 2, 8, 4)                   # row = 16·warp + 8·h + g
    # -> [nb, kb, warp, g, j, h]
    s = s.permute(0, 1, 2, 4, 5, 3).reshape(nb, kb, 32, 8)
    wsc_frag = s.contiguous().view(torch.float8_e4m3fn)
    return wgt_frag, wsc_frag


def to_logical(wgt_frag, wsc_frag):
    """Inverse of `to_frag`: ``(wgt [N, K/2] uint8, wscales [N, K/16] e4m3)``."""
    torch = torch_module()
    nb, kb = wgt_frag.shape[:2]
    fields = _unpack_fields(bytes_to_words(wgt_frag)).reshape(nb, kb, FRAG_ROWS * FRAG_K)
    order = _nibble_order().to(wgt_frag.device)
    blocks = torch.empty_like(fields)
    blocks[:, :, order] = fields
    wgt = logical_of_blocks(blocks, FRAG_ROWS, FRAG_K)
    s = wsc_frag.view(torch.uint8).view(nb, kb, 4, 8, 4, 2)                 # [nb, kb, warp, g, j, h]
    s = s.permute(0, 2, 5, 3, 1, 4).reshape(nb * FRAG_ROWS, kb * 4)
    return wgt, s.contiguous().view(torch.float8_e4m3fn)

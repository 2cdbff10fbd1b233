"""The Hopper weight format (loader/ops/sm90_weight_format.py) and the exact decode the sm_90a kernel runs.

CPU only.  The kernel's integer/fp16 steps are emulated bit for bit (shift/mask to fp16 bit patterns,
one fp16 multiply by scale·2^7, the 2^14 the epilogue folds in) and must reproduce the float64
dequantization of the logical tensors exactly, for every value and every E4M3 scale byte.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.ops import gemm_w4a4 as gemm_op  # noqa: E402
from svdq_loader.ops import sm90_weight_format as fmt  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402

F16_128 = torch.tensor(128.0, dtype=torch.float16)


def _random_weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    wgt = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    sc = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8, generator=g)   # every finite E4M3 magnitude
    sc[0, : min(k // 16, 127)] = torch.arange(min(k // 16, 127), dtype=torch.uint8)   # incl. 0 and subnormals
    return wgt, sc.view(torch.float8_e4m3fn)


def _f16_of_bits(bits):
    """int64 tensor of 16-bit patterns -> float16 tensor."""
    return bits.to(torch.int16).view(torch.float16) if bits.max() < 0x8000 else \
        (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)


def _scaled(bits16, scale_bytes):
    """fp16(e2m1 bits) x fp16(e4m3 scale) x 2^7 in fp16 (the kernel's mul.rn.f16x2), then x 2^7 in float64."""
    s16 = scale_bytes.view(torch.float8_e4m3fn).to(torch.float16) * F16_128
    return (_f16_of_bits(bits16) * s16).double() * 128.0


def test_round_trip_is_a_bijection_and_keeps_the_byte_count():
    wgt, ws = _random_weight(192, 320, seed=1)
    wf, sf = fmt.to_frag(wgt, ws)
    assert wf.shape == (3, 5, 128, 16) and sf.shape == (3, 5, 32, 8)
    assert wf.numel() == wgt.numel() and sf.numel() == ws.numel()
    w2, s2 = fmt.to_logical(wf, sf)
    assert torch.equal(w2, wgt) and torch.equal(s2.view(torch.uint8), ws.view(torch.uint8))
    # a different weight gives a different image (no value is dropped)
    wgt[5, 7] ^= 0x30
    assert not torch.equal(fmt.to_frag(wgt, ws)[0], wf)


@pytest.mark.parametrize("form", sorted(fmt.PAIR_DECODES))
def test_kernel_decode_of_the_fragment_format_is_exact(form):
    n, k = 128, 192
    wgt, ws = _random_weight(n, k, seed=2)
    want = ref.dequantize_nvfp4(wgt.numpy(), ws.view(torch.uint8).numpy())       # float64 [N, K]
    wf, sf = fmt.to_frag(wgt, ws)
    b = wf.to(torch.int64).view(n // 64, k // 64, 128, 4, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)      # [nb, kb, t, j]
    sb = sf.view(torch.uint8).view(n // 64, k // 64, 32, 4, 2)                       # [nb, kb, quad, j, h]
    got = np.full((n, k), np.nan)
    t = torch.arange(128)
    warp, lane = t // 32, t % 32
    for p in range(4):
        # the kernel: the form's terms give fp16 bits e2m1 · 2^-14 in each half, then x (scale·2^7)
        x = fmt.decode_pair_bits(words, p, form)
        sc = sb[:, :, (warp * 8 + lane // 4), :, p % 2]                             # [nb, kb, t, j]
        lo = _scaled(x & 0xFFFF, sc)
        hi = _scaled((x >> 16) & 0xFFFF, sc)
        for j in range(4):
            rows = (16 * warp + lane // 4 + 8 * (p % 2)).numpy()
            cols = (16 * j + 2 * (lane % 4) + 8 * (p // 2)).numpy()
            for nb in range(n // 64):
                for kb in range(k // 64):
                    got[nb * 64 + rows, kb * 64 + cols] = lo[nb, kb, :, j].numpy()
                    got[nb * 64 + rows, kb * 64 + cols + 1] = hi[nb, kb, :, j].numpy()
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


def _direct_pair_bits(words, p):
    """Pair p's fp16x2 bits from the field layout itself (magnitude at bits 9-11, sign at 15, per half)."""
    out = 0
    for h in range(2):
        mag = (words >> (16 * h + 3 * p)) & 7
        sgn = (words >> (12 + 16 * h + p)) & 1
        out = out | (mag << (16 * h + 9)) | (sgn << (16 * h + 15))
    return out


@pytest.mark.parametrize("form", sorted(fmt.PAIR_DECODES))
def test_every_decode_form_gives_each_pair_exactly_its_own_bits(form):
    """Every value of a pair's eight bits, beside the other 24 bits all clear, all set and random: the multiply
    form's shifted copies must not carry into the pair's bits, whatever the word holds."""
    pair_vals = torch.arange(256, dtype=torch.int64)
    g = torch.Generator().manual_seed(11)
    for p in range(4):
        fm = fmt.field_mask(p)
        assert bin(fm).count("1") == 8
        bits = [b for b in range(32) if fm >> b & 1]
        pair = torch.zeros(256, dtype=torch.int64)
        for i, b in enumerate(bits):
            pair |= ((pair_vals >> i) & 1) << b
        fills = [torch.zeros(256, dtype=torch.int64), torch.full((256,), 0xFFFFFFFF, dtype=torch.int64)]
        fills += [torch.randint(0, 1 << 32, (256,), dtype=torch.int64, generator=g) for _ in range(8)]
        for fill in fills:
            words = pair | (fill & ~fm & 0xFFFFFFFF)
            got = fmt.decode_pair_bits(words, p, form)
            assert torch.equal(got, _direct_pair_bits(words, p)), (form, p)
            assert int((got & ~fmt.PAIR_BITS & 0xFFFFFFFF).max()) == 0


def test_kernel_decode_of_logical_activations_is_exact():
    """The activation path: byte i of a 32-bit word (low nibble = even k) -> fp16x2 bit patterns."""
    codes = torch.arange(256, dtype=torch.int64)                     # every byte value
    lo = ((codes << 9) & 0x0E00) | ((codes << 12) & 0x8000)
    hi = ((codes << 21) & 0x0E000000) | ((codes << 24) & 0x80000000)
    for sbyte in range(0x7F):                                        # every finite E4M3 magnitude, and 0
        s = torch.full((256,), sbyte, dtype=torch.uint8)
        got_lo = _scaled(lo, s).numpy()
        got_hi = _scaled(hi >> 16, s).numpy()
        scale = ref.decode_e4m3(np.uint8(sbyte))
        np.testing.assert_array_equal(got_lo, ref.decode_e2m1(codes.numpy() & 15) * scale)
        np.testing.assert_array_equal(got_hi, ref.decode_e2m1(codes.numpy() >> 4) * scale)


def test_prepare_weight_converts_by_arch_and_refuses_untileable_shapes(monkeypatch):
    monkeypatch.setattr(gemm_op, "check_devices", lambda named: None)     # CPU tensors stand in
    wgt, ws = _random_weight(128, 128, seed=3)
    plain = gemm_op.prepare_weight(wgt, ws)
    assert plain.weight_format == "logical" and plain.wgt is wgt
    w = gemm_op.prepare_weight(wgt, ws, arch="sm_90a")
    assert w.weight_format == "sm90_frag" and w.wgt.shape == (2, 2, 128, 16)
    assert torch.equal(w.wgt, fmt.to_frag(wgt, ws)[0])
    assert gemm_op.prepare_weight(wgt, ws, arch="sm_100a").weight_format == "blackwell_weight"   # its own format
    w96, s96 = _random_weight(96, 128, seed=4)
    with pytest.raises(InvalidArgument, match=r"sm90_frag weight format needs N % 64 == 0 .* N=96, K=128"):
        gemm_op.prepare_weight(w96, s96, arch="sm_90a")


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on int64 tensors: result byte i = byte (sel nibble i & 7) of {b, a}, or
    that byte's sign replicated when the nibble's bit 3 is set."""
    src = torch.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = torch.where(byte >= 0x80, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def test_prmt_activation_decode_matches_the_shift_decode_bit_for_bit():
    """act_decode="prmt": two byte forms per word, then prmt + mask per pair == the shift/mask patterns."""
    g = torch.Generator().manual_seed(7)
    words = torch.cat([torch.randint(0, 2**32, (4096,), dtype=torch.int64, generator=g),
                       torch.arange(256, dtype=torch.int64) * 0x01010101])      # every byte in every position
    lo_form = ((words << 1) & 0x0E0E0E0E) | ((words << 4) & 0x80808080)
    hi_form = ((words >> 3) & 0x0E0E0E0E) | (words & 0x80808080)
    for byte in range(4):
        sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)
        got = _prmt(lo_form, hi_form, sel) & 0x8E008E00
        y = words >> (8 * byte)
        want = ((y << 9) & 0x0E00) | ((y << 12) & 0x8000) | ((y << 21) & 0x0E000000) | ((y << 24) & 0x80000000)
        assert torch.equal(got, want), byte

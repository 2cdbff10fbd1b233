"""The FP8-compute mode's Hopper weight format (loader/ops/sm90_fp8_weight_format.py) and the decode its kernel runs.

CPU only.  The kernel's steps are replayed bit for bit (the integer decode to E4M3 bytes, the conversion to fp16x2,
one fp16 multiply by scale · rw, the rounding conversion back to E4M3) and must give the mode's operand
e4m3(W · rw) of the float64 reference (`fp8_reference`) for every value and every E4M3 scale byte; the fragment's
(row, k) map is checked against the DSL's own FP8 wgmma A layout where the DSL is installed."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.ops import sm90_fp8_weight_format as fmt  # noqa: E402
from svdq_loader.testing import fp8_reference as f8  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402


def _random_weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    wgt = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    sc = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8, generator=g)   # every finite E4M3 magnitude
    sc[0, : min(k // 16, 127)] = torch.arange(min(k // 16, 127), dtype=torch.uint8)   # incl. 0 and subnormals
    sc[1] = 0                                                                 # a column of zero scales: rw = 1
    sc[2] = 0x01                                                              # only the smallest: rw = 2^15
    sc[3, 5] = 0x7E                                                           # 448: rw = 1/8
    return wgt, sc.view(torch.float8_e4m3fn)


def test_round_trip_is_a_bijection_and_records_rw():
    n, k = 192, 384
    wgt, ws = _random_weight(n, k, seed=1)
    wf, sf = fmt.to_frag(wgt, ws)
    assert wf.shape == (3, 3, 128, 32) and wf.numel() == wgt.numel()
    assert sf.dtype == torch.uint8 and sf.numel() == ws.numel() + 4 * n
    w2, s2 = fmt.to_logical(wf, sf)
    assert torch.equal(w2, wgt) and torch.equal(s2.view(torch.uint8), ws.view(torch.uint8))
    rw = fmt.rw_of(sf, n)
    want = f8.scale_pow2(ws.view(torch.uint8).numpy())
    np.testing.assert_array_equal(rw.double().numpy(), want)
    assert rw[1] == 1.0 and rw[2] == 2.0 ** 15 and rw[3] == 0.125
    wgt[5, 7] ^= 0x30
    assert not torch.equal(fmt.to_frag(wgt, ws)[0], wf)


def _place(got, out, rows, cols):
    """Write the decoded bytes `out` [blocks, k-tiles, thread] of one (row, k) per thread into `got` [N, K]."""
    for nbi in range(out.shape[0]):
        for kti in range(out.shape[1]):
            got[nbi * 64 + rows.numpy(), kti * 128 + cols.numpy()] = out[nbi, kti].numpy()


def test_lut_holds_the_e2m1_values_as_e4m3():
    lut = [(fmt.E2M1_E4M3_LUT[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(8)]
    assert list(ref.decode_e4m3(np.array(lut, np.uint8))) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_kernel_decode_gives_the_modes_operand_bit_for_bit():
    n, k = 128, 256
    wgt, ws = _random_weight(n, k, seed=2)
    w8_want, rw_want = f8.fp8_operand(wgt.numpy(), ws.view(torch.uint8).numpy())       # uint8 [N, K], [N]
    wf, sf = fmt.to_frag(wgt, ws)
    nb, kb = n // 64, k // 128
    b = wf.to(torch.int64).view(nb, kb, 128, 8, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)      # [nb, kt, t, word]
    sq = sf[4 * n:].view(nb, kb, 32, 4, 2, 2)                                           # [nb, kt, quad, kb, h, row]
    rw = fmt.rw_of(sf, n)
    got = np.full((n, k), -1, dtype=np.int64)
    t = torch.arange(128)
    warp, lane = t // 32, t % 32
    r0 = 16 * warp + lane // 4
    for w in range(8):
        kblk, h = w // 2, w % 2
        regs = fmt.decode_word(words[:, :, :, w])
        for i, reg in enumerate(regs):                               # register 2h + i: row r0 + 8i
            rows = r0 + 8 * i
            s = sq[:, :, (warp * 8 + lane // 4), kblk, h, i]                       # [nb, kt, t]
            mult = (s.view(torch.float8_e4m3fn).to(torch.float16)
                    * rw.view(nb, 64)[:, rows].unsqueeze(1).to(torch.float16))     # cvt, then x rw (fp16)
            for e in range(4):                                       # the four E4M3 bytes of the register
                byte = ((reg >> (8 * e)) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn)
                prod = byte.to(torch.float16) * mult                 # mul.rn.f16x2 (exact here)
                out = prod.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)   # cvt.rn.satfinite
                _place(got, out, rows, 32 * kblk + 16 * h + 4 * (lane % 4) + e)
    assert (got >= 0).all()
    np.testing.assert_array_equal(got, w8_want.astype(np.int64))
    np.testing.assert_array_equal(rw.double().numpy(), rw_want)


#: the E2M1 magnitudes in code order (the lut form's table order, `sm90_fp8_ptx.MAG_F16X2`)
_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def test_lut_form_decode_gives_the_modes_operand_bit_for_bit():
    """weights "lut" (kernel_src/sm90_wgmma_kernel.py): the producer's byte tables (per row and 16-k group, the eight
    magnitudes times the fp16 scale · rw, each rounded once to E4M3) and the MMA warps' decode (mask, byte permute
    of the row's table, sign OR) replayed on every value and every finite E4M3 scale byte: the mode's operand."""
    n, k = 128, 256
    wgt, ws = _random_weight(n, k, seed=5)
    w8_want, _ = f8.fp8_operand(wgt.numpy(), ws.view(torch.uint8).numpy())
    wf, sf = fmt.to_frag(wgt, ws)
    nb, kb = n // 64, k // 128
    b = wf.to(torch.int64).view(nb, kb, 128, 8, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)      # [nb, kt, t, word]
    sq = sf[4 * n:].view(nb, kb, 32, 8, 2)                                              # [nb, kt, quad, group, row]
    rw = fmt.rw_of(sf, n)
    mags = torch.tensor(_MAGS, dtype=torch.float16)
    t = torch.arange(128)
    warp, lane = t // 32, t % 32
    r0 = 16 * warp + lane // 4
    got = np.full((n, k), -1, dtype=np.int64)
    for w in range(8):
        kblk, h = w // 2, w % 2
        g = 2 * kblk + h
        word = words[:, :, :, w]
        for i in range(2):                                           # register 2h + i: row r0 + 8i
            rows = r0 + 8 * i
            s = sq[:, :, warp * 8 + lane // 4, g, i]                 # [nb, kt, t]: the producer's scale byte
            mult = (s.view(torch.float8_e4m3fn).to(torch.float16)
                    * rw.view(nb, 64)[:, rows].unsqueeze(1).to(torch.float16))     # block_mults: cvt, x rw (fp16)
            table = (mags * mult.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)  # [.., 8]
            sel = (word & fmt.MAG_MASK) >> (16 * i)                  # the register's four 3-bit codes
            sign = word & fmt.SIGN_MASK if i == 0 else (word << 4) & fmt.SIGN_MASK
            for e in range(4):
                code = (sel >> (4 * e)) & 7                          # prmt: byte e from table entry `code`
                out = torch.gather(table, -1, code.unsqueeze(-1)).squeeze(-1) | ((sign >> (8 * e)) & 0x80)
                _place(got, out, rows, 32 * kblk + 16 * h + 4 * (lane % 4) + e)
    assert (got >= 0).all()
    np.testing.assert_array_equal(got, w8_want.astype(np.int64))


def test_lut_form_constants_are_the_e2m1_magnitudes():
    pytest.importorskip("cutlass")
    from svdq_kernels.sm90_fp8_ptx import MAG_F16X2
    halves = [(v >> (16 * i)) & 0xFFFF for v in MAG_F16X2 for i in range(2)]
    assert torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(torch.float16).tolist() == list(_MAGS)


def test_bad_dims_and_nan_scales_are_refused():
    wgt, ws = _random_weight(64, 192, seed=3)
    with pytest.raises(InvalidArgument, match="K % 128"):
        fmt.to_frag(wgt, ws)
    wgt, ws = _random_weight(64, 128, seed=3)
    ws.view(torch.uint8)[0, 0] = 0x7F
    with pytest.raises(InvalidArgument, match="NaN"):
        fmt.to_frag(wgt, ws)


def test_fragment_map_is_the_dsls_fp8_wgmma_a_layout():
    """The (row, k) of value v of thread t, from the DSL's tv_layout_A of the E4M3 register-A wgmma atom, is the
    one the format assumes: register v // 4 = 2·(k // 16) + row // 8 offset, byte v % 4 = k % 4."""
    pytest.importorskip("cutlass")
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float8E4M3FN, Float32
    from cutlass._mlir import ir
    from cutlass.base_dsl.compiler import GPUArch
    from cutlass.base_dsl.dsl import BaseDSL
    from cutlass.cute.nvgpu import OperandMajorMode

    opt = BaseDSL._get_dsl().compile_options.options[GPUArch]       # the atom checks the DSL's target arch
    saved, opt.value = opt.value, "sm_90a"
    try:
        with ir.Context(), ir.Location.unknown():
            with ir.InsertionPoint(ir.Module.create().body):
                tm = sm90_utils.make_trivial_tiled_mma(Float8E4M3FN, Float8E4M3FN, OperandMajorMode.K,
                                                       OperandMajorMode.K, Float32, (1, 1, 1), (64, 64),
                                                       sm90_utils.OperandSource.RMEM)
                lay = tm.tv_layout_A
                seen = {"shape": lay.shape, "stride": lay.stride}
    finally:
        opt.value = saved

    def flat(x):
        return [y for e in x for y in flat(e)] if isinstance(x, tuple) else [int(x)]
    (tshape, vshape), (tstride, vstride) = seen["shape"], seen["stride"]

    def index(c, shape, stride):
        out = 0
        for s, d in zip(flat(shape), flat(stride)):
            out += (c % s) * d
            c //= s
        return out
    for t in range(128):
        for v in range(16):
            idx = index(t, tshape, tstride) + index(v, vshape, vstride)       # m + 64 k in the 64 x 32 atom
            row, kk = idx % 64, idx // 64
            warp, lane, reg = t // 32, t % 32, v // 4
            assert row == 16 * warp + lane // 4 + 8 * (reg % 2)
            assert kk == 16 * (reg // 2) + 4 * (lane % 4) + v % 4

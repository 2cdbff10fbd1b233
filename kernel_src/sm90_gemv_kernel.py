"""The small-M form of the sm_90a W4A4 GEMM (``schedule: gemv``) -- CuTe-DSL, build time only.

At M <= 64 the GEMM is a stream over the weight: 4-bit weights are a quarter of cuBLAS bf16's bytes, and the time
is set by how many weight bytes are in flight, not by the tensor cores.  The warp-specialised wgmma forms chain
an mbarrier handshake, a wgmma and a weight decode per k-tile on three warps per scheduler (about 0.42 us per
k-tile per CTA on the H200, docs/PERF.md session 5); this form has no producer, no consumer and no per-k-tile
handshake:

* **Tile.** One CTA = tile_n / 16 warps = tile_n weight rows (tile_n 128: two 64-row blocks of the sm90 fragment
  format, 8 warps; 64: one block, 4 warps; warp w takes the 16-row slice ``w % 4`` of block ``w // 4``) x tile_m
  (64 or 16) activation rows.  ``mma.sync m16n8k16`` (fp16 in, fp32 accumulators): A = the warp's 16 weight rows -- the fragment format's 16-byte word per thread per 64 k *is*
  four mma A fragments --, B = 8 activation rows per n8 block, C = Yᵀ.  n8 blocks of rows >= m are skipped
  (a warp-uniform branch), so one variant serves every M <= 64 at the MMA cost of its rows.
* **Weights through a per-thread cp.async ring**, ``RING`` k-tiles deep (each thread copies its own 16-byte word
  and 8 scale bytes and reads them back itself: no barrier, no mbarrier).  A CTA keeps RING - 1 k-tiles of its
  weight in flight.  At tile_m 16 the loop carries the read and refill slot offsets and the refill's source
  addresses from k-tile to k-tile (``sm90_plan.gemv_ring_next``) rather than computing ``kt % RING`` and 64-bit
  products each time (docs/PERF.md, session 22).
* **Activations.** The CTA's K range is walked in phases of 128 k.  Each thread copies (cp.async, in the same
  groups as the weights, (RING + 1) / 2 phases ahead) and later decodes one or two 32-k chunks of one row (256
  tasks per phase) -- its own bytes again -- into a double-buffered, XOR-swizzled fp16 tile that the warps read
  with ``ldmatrix``.  One CTA barrier per phase; the weight copies keep flowing across it.  Decode and scale bookkeeping are the wgmma form's
  (``e2m1 · 2^-14`` times ``scale · 2^7`` on both operands, exact in fp16; the epilogue multiplies by 2^14).
* **tile_m 16** (M <= 16 per tile): instead of the phase double buffer, 8 phases of decoded activations are
  resident at a time (``sm90_plan.GEMV_CHUNK``), so the loop has two CTA barriers per 16 k-tiles; the raw bytes
  of chunk q + 2 ride in the group of chunk q's first k-tile, into the second of two raw chunk buffers.
* **Split K over a cluster** of S CTAs, S chosen by the host code at launch: the largest power of two up to 8
  that is at most ``ctas_per_sm·sm_count // tiles`` (``sm90_plan.GEMV_LAYOUTS``: 2 CTAs of tile_n 128 or 3 of
  tile_n 64 fit an SM) and ``k // 512`` (at least four phases per rank; ``split_of``).  CTA rank r takes
  phases ``[r·P // S, (r+1)·P // S)`` of the P = k // 128.
  Warp w of rank ``w % S`` owns its 16 x tile_m slice of the tile: the other ranks leave their partial sums in their
  own SMEM, a cluster barrier publishes them, the owner adds them in rank order (``mapa`` +
  ``ld.shared::cluster``), a second barrier keeps them alive until read, and the owner alone runs the epilogue.
* **Epilogue** (owner warps): ``acc · 2^14 · wcscale[n]``, then LoRA as more ``mma.sync`` (A = ``lora_up`` rows,
  B = ``lora_act_in`` rows, both loaded straight from global in the output dtype), then ``+ bias[n]``.  At tile_m 16
  the owners load all of these operands before the split-K barrier (their DRAM round trip overlaps it), the
  reduction issues four peers' loads before it adds them, and the output leaves as transposed 16-bit pairs, one
  32-bit store per pair of columns (``sm90_epilogue_ptx``; 8-17 % faster at M <= 16, docs/PERF.md session 12).
  tile_m 64 keeps the loads after the reduction and stores 16-bit values: its registers are at the 2-CTA limit.

Launch ABI: the wgmma form's (host args: 9 pointers, m, n, k, sm_count, stream; kernel params: 9 pointers, m, n,
k); block (2·tile_n, 1, 1), cluster (S, 1, 1), grid = tiles x S, PDL as the wgmma form's.  Preconditions (the loader's shape rule):
n % tile_n == 0, k % 128 == 0, 16-byte aligned contiguous tensors, weights in the sm90 fragment format.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .quantize_ptx import (_asm, _cp_async4 as _cp4, _cp_async16_cg as _cp16, _cp_commit, _cp_wait, _lds_u32, _lds_v4,
                           _mma, _sts_v4)
from .sm90_plan import GEMV_CHUNK, gemv_layout, gemv_ring_next, gemv_ring_start
from .sm90_decode_ptx import (_adecode_prmt, _bcast, _byte_form, _ld_cluster_v4f, _scales_x128, _sts_v4f, _wdecode,
                              weight_scales_x128)
from .sm90_epilogue_ptx import pair_blocks, store_yt

PHASE_K = 128          # k per activation phase (two 64-k k-tiles)
MAX_SPLIT = 8          # portable cluster size
#: the fewest phases (128 k each) a split-K rank gets: at K = N = 3072, M = 1 and 16 on an H100, 4 ranks of 6 phases
#: took 4-6 % (16 x 128) and 27-28 % (16 x 64) less time than 8 ranks of 3 (docs/PERF.md, session 35)
MIN_RANK_PHASES = 4
_A_BUF = 2 * 64 * 128  # tile_m 64: one phase of decoded activations (2 k-tiles x 64 rows x 128 bytes)
_A_PH16 = 2 * 16 * 128  # tile_m 16: one phase of decoded activations (2 k-tiles x 16 rows x 128 bytes)
_ACC_UNSCALE = float(2 ** 14)


def split_of(tiles: int, sm_count: int, phases: int, ctas_per_sm: int) -> int:
    """The host code's split (plain integers; tests/test_sm90_gemv.py checks it against the host program's): the
    largest power of two up to 8 that keeps the grid within `ctas_per_sm` CTAs per SM and gives every rank at least
    `MIN_RANK_PHASES` phases (or one rank, where K has fewer)."""
    x = min(max(1, (ctas_per_sm * sm_count) // tiles), max(1, phases // MIN_RANK_PHASES))
    return 8 if x >= 8 else 4 if x >= 4 else 2 if x >= 2 else 1


def phase_share(rank: int, phases: int, split: int) -> tuple[int, int]:
    """(first phase, phases) of cluster rank `rank`: an even split, the larger shares last."""
    lo = rank * phases // split
    return lo, (rank + 1) * phases // split - lo


def raw_phase_of_group(j):
    """The activation phase whose raw bytes ride in cp.async group j (even j; phase 0 also rides in group 0): phase
    q >= 1 in group 2q - 2, so it lands (RING + 1) / 2 phases before its decode.  Plain operators: the kernel calls
    it on Python and DSL integers, tests/test_sm90_gemv.py replays the whole schedule with it."""
    return j // 2 + 1


def swizzled_chunk(row, chunk):
    """The 16-byte slot of (row, 16-byte chunk) in a 128-byte row of the decoded tile (conflict-free ldmatrix)."""
    return chunk ^ (row % 8)


def _cp8(saddr, gaddr):
    _asm("cp.async.ca.shared.global [$0], [$1], 8;", (), [saddr, gaddr], "r,l")


def _lds_v2(saddr):
    return _asm("ld.shared.v2.u32 {$0, $1}, [$2];", (Int32,) * 2, [saddr], "=r,=r,r", True)


def _ldsm_x4(saddr):
    return _asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
                (Int32,) * 4, [saddr], "=r,=r,=r,=r,r", True)


def _ldg_u32(gaddr):
    return _asm("ld.global.nc.u32 $0, [$1];", (Int32,), [gaddr], "=r,l", True)


def _ldg_f32(gaddr):
    return _asm("ld.global.nc.f32 $0, [$1];", (Float32,), [gaddr], "=f,l", True)


def _st_u16_pred(gaddr, v, pred):
    _asm("{\n.reg .pred p;\n.reg .b16 h;\nsetp.ne.u32 p, $2, 0;\ncvt.u16.u32 h, $1;\n@p st.global.u16 [$0], h;\n}",
         (), [gaddr, v, pred], "l,r,r")


def _pack1(x, dtype: str):
    """One fp32 -> its 16-bit pattern (RNE) in the low half of an Int32."""
    op = "cvt.rn.bf16.f32" if dtype == "bf16" else "cvt.rn.f16.f32"
    return _asm("{\n.reg .b16 h;\n" + op + " h, $1;\ncvt.u32.u16 $0, h;\n}", (Int32,), [x], "=r,f")


def _ctaid_x():
    """%ctaid.x through a side-effecting asm read, so that the compiler recomputes what depends on it here."""
    return _asm("mov.u32 $0, %ctaid.x;", (Int32,), [], "=r", True)


class _Sm90Gemv:
    KERNEL_METHODS = ("kernel",)
    MMA_PTX = "mma.sync.aligned.m16n8k16"         # the main loop's MMA (the family's static check)

    def __init__(self, cfg):
        self.cfg = cfg
        self.rank = cfg.rank
        self.dt = cfg.out_dtype
        self.lay = gemv_layout(cfg)
        self.tm, self.tn, self.threads, self.ring = cfg.tile_m, cfg.tile_n, self.lay.threads, self.lay.ring
        self.raw_slots = self.lay.raw_slots
        self.r_slot = self.lay.raw_tasks * 20       # bytes of one raw slot (16 raw + 4 scale bytes per task)
        self.tasks = self.lay.raw_tasks // self.threads     # activation tasks per thread per slot (1, 2 or 4)
        self.nacc = 4 * (self.tm // 8)              # fp32 accumulators per thread: one m16n8 C per n8 block
        self.prefetch = cfg.prefetch                # k-tiles of weight words read and decoded per ring wait
        self.smem_bytes = self.lay.smem_bytes
        self.paired_store = self.tm == 16           # tile_m 64 stores 16-bit values (see _epilogue)
        self.lora_words = 4 + self.tm // 4          # LoRA words per 16 ranks: 4 of lora_up, 2 per n8 block

    def recipe_hints(self, host_args) -> tuple:
        """The host code's launch as launch-recipe expressions over `host_args` (the op's (name, kind) list): the
        split of ``split_of`` as 1 << (clog2(x + 1) - 1), and grid = tiles x split; the fitter would not find them."""
        at = {name: ["arg", i] for i, (name, _) in enumerate(host_args)}
        tiles = ["mul", ["ceildiv", at["m"], self.tm], ["floordiv", at["n"], self.tn]]
        x = ["min", ["min", ["max", 1, ["floordiv", ["mul", self.lay.ctas_per_sm, at["sm_count"]], tiles]],
                     ["max", 1, ["floordiv", at["k"], PHASE_K * MIN_RANK_PHASES]]], MAX_SPLIT]
        split = ["shl", 1, ["sub", ["clog2", ["add", x, 1]], 1]]
        return (split, ["mul", tiles, split])

    def resource_problem(self, usage: dict):
        """None, or why a compiled kernel's registers leave fewer CTAs per SM than the split assumes."""
        for sym, u in usage.items():
            if not self.lay.fits_registers(u["registers"]):
                return (f"kernel {sym}: {u['registers']} registers leave fewer than the {self.lay.ctas_per_sm} CTAs "
                        f"per SM its launch-time split assumes (the validity predicate should have refused it)")
        return None

    @cute.jit
    def __call__(self, act: cute.Pointer, ascales: cute.Pointer, wgt: cute.Pointer, wscales: cute.Pointer,
                 lora_act_in: cute.Pointer, lora_up: cute.Pointer, wcscale: cute.Pointer, bias: cute.Pointer,
                 out: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 sm_count: cutlass.Int32, stream: cuda.CUstream):
        tiles = ((m + (self.tm - 1)) // self.tm) * (n // self.tn)
        x = cutlass.min(cutlass.max(1, (self.lay.ctas_per_sm * sm_count) // tiles),
                        cutlass.max(1, k // (PHASE_K * MIN_RANK_PHASES)))
        split = cutlass.select_(x >= 8, 8, cutlass.select_(x >= 4, 4, cutlass.select_(x >= 2, 2, 1)))
        self.kernel(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out, m, n, k).launch(
            grid=[tiles * split, 1, 1], block=[self.threads, 1, 1], cluster=[split, 1, 1], smem=self.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, p_act: cute.Pointer, p_asc: cute.Pointer, p_wgt: cute.Pointer, p_wsc: cute.Pointer,
               p_la: cute.Pointer, p_lu: cute.Pointer, p_wc: cute.Pointer, p_bias: cute.Pointer,
               p_out: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32):
        cute.arch.griddepcontrol_wait()             # PDL: the previous grid's writes are visible from here on
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        g = lane // 4
        c4 = lane % 4
        S = cute.arch.make_warp_uniform(cute.arch.cluster_size())
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        tile = bid // S
        RING, T, NT = self.ring, self.tasks, self.threads
        tiles_n = n // self.tn
        tm_i = tile // tiles_n
        m0 = tm_i * self.tm
        n0 = (tile - tm_i * tiles_n) * self.tn
        mrem = m - m0                                  # rows of this tile that exist (>= 1)
        ph0, nph = phase_share(rank, k // PHASE_K, S)
        nk = 2 * nph                                   # this CTA's k-tiles
        KT = k // 64

        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.smem_bytes, byte_alignment=1024)
        sb = base.toint()
        lay = self.lay
        wring = sb + lay.w_ring_at + tid * 16
        sring = sb + lay.s_ring_at + tid * 8
        abuf = sb + lay.a_buf_at

        # ---- this thread's weight word and scale bytes (sm90 fragment format) --------------------------
        nb = n0 // 64 + tid // 128
        t128 = tid % 128
        wsrc = p_wgt.toint() + (Int64(nb) * KT * 128 + t128) * 16          # + kt * 2048
        ssrc = p_wsc.toint() + (Int64(nb) * KT * 32 + t128 // 4) * 8       # + kt * 256
        kt_abs0 = 2 * ph0

        # tile_m 16: the owner warps (w % S == rank, see below) load the epilogue's operands before the split-K
        # barrier, so their DRAM round trip overlaps it.  tile_m 64 holds 4 x the accumulators and 5 x the LoRA words
        # (160 registers at rank 128), and its registers are at the 2-CTA limit: there the loads stay after the
        # reduction, one 16-rank chunk at a time.  (An L2 prefetch of these operands at kernel start was measured on
        # top of this and dropped: no faster anywhere, and up to 12 % slower at N = 21504 with S = 1.)
        EARLY = self.tm == 16

        # ---- this thread's activation tasks (task = tid + i * threads): row (task % 64) // 4, 32 k at
        # 32 * (task % 4) of phase task // 64 of the slot (tile_m 64: one phase per slot, so phase 0); a task's raw
        # bytes sit at task * 16 of a raw slot, its scales at raw_tasks * 16 + task * 4 -----------------------
        rring, rsring, arow, akc, apq, arow_ok, asrc, scsrc = [], [], [], [], [], [], [], []
        for i in cutlass.range_constexpr(T):
            task = tid + i * NT
            rring.append(sb + lay.r_ring_at + task * 16)
            rsring.append(sb + lay.r_ring_at + lay.raw_tasks * 16 + task * 4)
            if cutlass.const_expr(self.tm == 64):
                arow.append(task // 4)
                apq.append(0)
            else:
                arow.append((task % 64) // 4)
                apq.append(task // 64)
            akc.append(task % 4)
            arow_ok.append(Int32(arow[i] < mrem))
            arow_c = cutlass.min(m0 + arow[i], m - 1)
            asrc.append(p_act.toint() + Int64(arow_c) * (k // 2) + 16 * akc[i] + 64 * apq[i])       # + phase * 64
            scsrc.append(p_asc.toint() + Int64(arow_c) * (k // 16) + 4 * (akc[i] // 2) + 8 * apq[i])  # + phase * 8

        c = self._Ctx()
        for name in ("nk", "nph", "ph0", "kt_abs0", "wring", "sring", "rring", "rsring", "abuf", "wsrc", "ssrc",
                     "asrc", "scsrc", "arow", "akc", "apq", "RING", "NT"):
            setattr(c, name, locals()[name])

        acc = cute.make_rmem_tensor((self.nacc,), Float32)
        acc.fill(0.0)
        afr = cute.make_rmem_tensor((16 * self.prefetch,), Int32)       # A fragments of 1 or 2 k-tiles
        # ldmatrix: lane L points at row 8 * (L // 16) + L % 8 of a pair of n8 blocks, k half (L // 8) % 2; the
        # swizzled byte offsets within a k-tile (row % 8 == L % 8 for every pair) do not change in the loop
        lrow = 8 * (lane // 16) + lane % 8
        lkh = (lane // 8) % 2
        xoff = [lrow * 128 + swizzled_chunk(lane % 8, 2 * kb + lkh) * 16 for kb in range(4)]
        if cutlass.const_expr(self.tm == 16):
            # ---- tile_m 16: chunks of CH phases resident.  Group 0 carries raw chunks 0 and 1 (and weight k-tile
            # 0); raw chunk q >= 2 rides in the group of chunk q - 2's first k-tile; chunk q is decoded after the
            # last k-tile of chunk q - 1 (every warp is past it: one barrier before, one after) ------------------
            CH = GEMV_CHUNK
            nch = (nph + (CH - 1)) // CH
            for j in cutlass.range_constexpr(RING - 1):
                if j < nk:
                    self._copy_w(c, j)
                if cutlass.const_expr(j == 0):
                    for i in cutlass.range_constexpr(T):
                        if arow_ok[i] != 0:
                            if apq[i] < nph:
                                self._copy_raw(c, 0, i)
                            if CH + apq[i] < nph:
                                self._copy_raw(c, 1, i)
                _cp_commit()
            _cp_wait(RING - 2)
            for i in cutlass.range_constexpr(T):
                if arow_ok[i] != 0:
                    if apq[i] < nph:
                        self._decode_raw(c, 0, i)
            cute.arch.sync_threads()
            # the weight ring walked with running offsets instead of `kt % RING` and `kt * 2048` per k-tile: run =
            # (the slot k-tile kt reads, the slot k-tile kt + RING - 1 refills: the one k-tile kt - 1 read) as
            # scale-ring offsets (the weight ring's are twice them); src = that refill's weight and scale sources
            run = cute.make_rmem_tensor((2,), Int32)
            r0, r1 = gemv_ring_start(RING, NT * 8)
            run[0] = Int32(r0)
            run[1] = Int32(r1)
            src = cute.make_rmem_tensor((2,), Int64)
            src[0] = wsrc + Int64(kt_abs0 + RING - 1) * 2048
            src[1] = ssrc + Int64(kt_abs0 + RING - 1) * 256
            for cq in cutlass.range(0, nch, 1, unroll=1):
                pn = cutlass.min(CH, nph - CH * cq)
                for pl in cutlass.range(0, pn, 1, unroll=1):
                    for h in cutlass.range_constexpr(2):
                        kt = 2 * (CH * cq + pl) + h
                        wv, sv = self._read_w_at(c, run[0])
                        j = kt + RING - 1
                        if j < nk:
                            self._copy_w_to(c, run[1], src[0], src[1])
                        self._advance_ring(c, run, src)
                        if cutlass.const_expr(h == 0):
                            if pl == 0:
                                for i in cutlass.range_constexpr(T):
                                    if arow_ok[i] != 0:
                                        if CH * (cq + 2) + apq[i] < nph:
                                            self._copy_raw(c, cq + 2, i)
                        _cp_commit()
                        self._decode_w(wv, sv, afr, 0)
                        tbase = abuf + (2 * pl + h) * (16 * 128)
                        for kb in cutlass.range_constexpr(4):
                            bf = _ldsm_x4(tbase + xoff[kb])
                            a = [afr[4 * kb + q] for q in range(4)]
                            for e in cutlass.range_constexpr(2):
                                res = _mma("fp16", [acc[4 * e + q] for q in range(4)], a, [bf[2 * e], bf[2 * e + 1]])
                                for q in cutlass.range_constexpr(4):
                                    acc[4 * e + q] = res[q]
                cute.arch.sync_threads()
                if cq + 1 < nch:
                    for i in cutlass.range_constexpr(T):
                        if arow_ok[i] != 0:
                            if CH * (cq + 1) + apq[i] < nph:
                                self._decode_raw(c, cq + 1, i)
                    cute.arch.sync_threads()
        else:
            # ---- prologue: groups 0 .. RING-2 carry weight k-tiles 0 .. RING-2; raw phase q >= 1 rides in the
            # group of k-tile 2q - 2, phase 0 in group 0 ------------------------------------------------------
            for j in cutlass.range_constexpr(RING - 1):
                if j < nk:
                    self._copy_w(c, j)
                for i in cutlass.range_constexpr(T):
                    if arow_ok[i] != 0:
                        if cutlass.const_expr(j == 0):
                            self._copy_raw(c, 0, i)
                        if cutlass.const_expr(j % 2 == 0):
                            if raw_phase_of_group(j) < nph:
                                self._copy_raw(c, raw_phase_of_group(j), i)
                _cp_commit()
            _cp_wait(RING - 2)
            for i in cutlass.range_constexpr(T):
                if arow_ok[i] != 0:
                    self._decode_raw(c, 0, i)
            cute.arch.sync_threads()

            P1 = self.prefetch == 1
            for ph in cutlass.range(0, nph, 1, unroll=1):
                # prefetch 1, per k-tile: wait for its group, read its words, refill the ring, decode, MMA.  prefetch 2,
                # per phase: one wait for both k-tiles (groups <= 2ph+1), both words and both decodes, then the refills
                # (the slot of k-tile 2ph, which k-tile 2ph + RING re-uses, is consumed by then), then the MMAs
                if cutlass.const_expr(not P1):
                    _cp_wait(RING - 3)
                    wvs = [_lds_v4(wring + ((2 * ph + h) % RING) * (NT * 16)) for h in range(2)]
                    svs = [_lds_v2(sring + ((2 * ph + h) % RING) * (NT * 8)) for h in range(2)]
                    for h in cutlass.range_constexpr(2):
                        self._decode_w(wvs[h], svs[h], afr, 16 * h)
                for h in cutlass.range_constexpr(2):
                    kt = 2 * ph + h
                    if cutlass.const_expr(P1):
                        wv, sv = self._read_w(c, kt)
                    j = kt + RING - 1
                    if j < nk:
                        self._copy_w(c, j)
                    if cutlass.const_expr((h + RING - 1) % 2 == 0):
                        for i in cutlass.range_constexpr(T):
                            if arow_ok[i] != 0:
                                if raw_phase_of_group(j) < nph:
                                    self._copy_raw(c, raw_phase_of_group(j), i)
                    _cp_commit()
                    if cutlass.const_expr(P1):
                        self._decode_w(wv, sv, afr, 0)
                        tbase = abuf + (ph % 2) * _A_BUF + h * (64 * 128)
                        for bp in cutlass.range_constexpr(4):
                            if 16 * bp < mrem:
                                r = 16 * bp + lrow
                                for kb in cutlass.range_constexpr(4):
                                    bf = _ldsm_x4(tbase + r * 128 + swizzled_chunk(r, 2 * kb + lkh) * 16)
                                    a = [afr[4 * kb + i] for i in range(4)]
                                    for e in cutlass.range_constexpr(2):
                                        o = 4 * (2 * bp + e)
                                        cur = [acc[o + i] for i in range(4)]
                                        res = _mma("fp16", cur, a, [bf[2 * e], bf[2 * e + 1]])
                                        for i in cutlass.range_constexpr(4):
                                            acc[o + i] = res[i]
                if cutlass.const_expr(not P1):
                    pbase = abuf + (ph % 2) * _A_BUF
                    for bp in cutlass.range_constexpr(4):
                        if 16 * bp < mrem:
                            for h in cutlass.range_constexpr(2):
                                for kb in cutlass.range_constexpr(4):
                                    bf = _ldsm_x4(pbase + (h * 64 * 128 + 16 * bp * 128) + xoff[kb])
                                    a = [afr[16 * h + 4 * kb + q] for q in range(4)]
                                    for e in cutlass.range_constexpr(2):
                                        o = 4 * (2 * bp + e)
                                        res = _mma("fp16", [acc[o + q] for q in range(4)], a, [bf[2 * e], bf[2 * e + 1]])
                                        for q in cutlass.range_constexpr(4):
                                            acc[o + q] = res[q]
                if ph + 1 < nph:
                    for i in cutlass.range_constexpr(T):
                        if arow_ok[i] != 0:
                            self._decode_raw(c, ph + 1, i)
                cute.arch.sync_threads()
        _cp_wait(0)
        # the tile's origin again, from %ctaid read anew (an asm read the compiler cannot merge with the first):
        # carried across the main loop instead, m0 took a stack slot in some variants (ptxas kept 80 registers)
        tile = _ctaid_x() // S
        tm_i = tile // tiles_n
        m0 = tm_i * self.tm
        n0 = (tile - tm_i * tiles_n) * self.tn
        epf = cute.make_rmem_tensor((4,), Float32)                    # 2^14·wcscale and bias of rows g, g + 8
        owner = Int32((warp % S) == rank)
        r0 = n0 + (warp // 4) * 64 + (warp % 4) * 16
        PER = self.lora_words
        epw = cute.make_rmem_tensor((max(1, self.rank // 16 * PER if EARLY else PER),), Int32)
        rows = (r0 + g, r0 + g + 8)
        if cutlass.const_expr(EARLY):
            if owner != 0:
                self._load_affine(p_wc, p_bias, rows, epf)
                for rs in cutlass.range_constexpr(self.rank // 16):
                    self._load_lora(p_la, p_lu, m, m0, rows, g, c4, rs, epw, rs * PER)

        # ---- split K: owner warps (w % S == rank) add the other ranks' partial sums ----------------------
        Q = self.nacc // 4
        red = abuf + warp * (512 * Q) + lane * 16        # this thread's nacc floats, Q x 16 bytes, 512 apart
        if S > 1:
            if owner == 0:
                for i in cutlass.range_constexpr(Q):
                    _sts_v4f(red + i * 512, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3])
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if owner != 0:
                # in rank order, the owner's own sums first
                if cutlass.const_expr(EARLY):
                    # tile_m 16: the loads of four ranks are all issued before any of them is added (ranks >= S or
                    # = rank load nothing and add zeros), so their latencies overlap
                    for r_lo in cutlass.range_constexpr(0, MAX_SPLIT, 4):
                        parts = []
                        for r in cutlass.range_constexpr(r_lo, r_lo + 4):
                            ok = Int32(r < S) * Int32(r != rank)
                            parts.append([_ld_cluster_v4f(red + i * 512, r, ok) for i in range(Q)])
                        for ri in cutlass.range_constexpr(4):
                            for i in cutlass.range_constexpr(Q):
                                for e in cutlass.range_constexpr(4):
                                    acc[4 * i + e] = acc[4 * i + e] + parts[ri][i][e]
                else:
                    # tile_m 64 (32 accumulators): one peer at a time
                    for r in cutlass.range(0, S, 1, unroll=1):
                        if r != rank:
                            for i in cutlass.range_constexpr(Q):
                                v = _ld_cluster_v4f(red + i * 512, r)
                                for e in cutlass.range_constexpr(4):
                                    acc[4 * i + e] = acc[4 * i + e] + v[e]
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        if owner != 0:
            if cutlass.const_expr(not EARLY):
                self._load_affine(p_wc, p_bias, rows, epf)
            self._epilogue(p_la, p_lu, p_out, m, n, m0, r0, lane, acc, epf, epw, EARLY)

    class _Ctx:
        """Trace-time bag of the kernel's per-thread addresses (the helpers below stay out of the AST rewrite)."""

    def _read_w(self, c, kt):
        """Wait for k-tile kt's group (RING - 1 in flight), then this thread's weight words and scale bytes."""
        return self._read_w_at(c, (kt % c.RING) * (c.NT * 8))

    def _decode_w(self, wv, sv, afr, at):
        """One k-tile's weight words and scale bytes -> its 16 A fragment registers afr[at .. at+16) (exact fp16)."""
        for kb in range(4):
            s2 = weight_scales_x128(sv[kb // 2], kb % 2)
            sbc = (_bcast(s2, 0), _bcast(s2, 1))
            for p in range(4):
                afr[at + 4 * kb + p] = _wdecode(wv[kb], sbc[p % 2], p)

    def _read_w_at(self, c, ro):
        """Wait for the slot at scale-ring offset ro (the weight ring's is 2 ro; RING - 1 groups in flight), then
        this thread's weight words and scale bytes there."""
        _cp_wait(c.RING - 2)
        return _lds_v4(c.wring + 2 * ro), _lds_v2(c.sring + ro)

    def _copy_w_to(self, c, wo, gw, gs):
        """cp.async this thread's weight word and scale bytes from gw / gs into the slot at scale-ring offset wo."""
        _cp16(c.wring + 2 * wo, gw)
        _cp8(c.sring + wo, gs)

    def _advance_ring(self, c, run, src):
        """One k-tile on: the slot just read is the next one refilled; the read slot wraps after RING."""
        pick = lambda cnd, a, b: cutlass.select_(cnd, Int32(a), b)            # noqa: E731
        run[0], run[1] = gemv_ring_next(run[0], c.NT * 8, c.RING, pick)
        src[0] = src[0] + 2048
        src[1] = src[1] + 256

    def _copy_w(self, c, j):
        """cp.async this thread's weight word and scale bytes of local k-tile j into ring slot j % RING."""
        kt = Int64(c.kt_abs0 + j)
        self._copy_w_to(c, (j % c.RING) * (c.NT * 8), c.wsrc + kt * 2048, c.ssrc + kt * 256)

    def _copy_raw(self, c, q, i):
        """cp.async task i's 16 raw activation bytes and 4 scale bytes of local phase q (tile_m 64) or of its phase
        in local chunk q (tile_m 16) into raw slot q % raw_slots."""
        slot = q % self.raw_slots
        ph = Int64(c.ph0 + q * (1 if self.tm == 64 else GEMV_CHUNK))
        _cp16(c.rring[i] + slot * self.r_slot, c.asrc[i] + ph * 64)
        _cp4(c.rsring[i] + slot * self.r_slot, c.scsrc[i] + ph * 8)

    def _decode_raw(self, c, q, i):
        """Phase q's chunk of task i (this thread's own copy) -> the fp16 tile buffer q % 2 (swizzled rows)."""
        slot = q % self.raw_slots
        raw = _lds_v4(c.rring[i] + slot * self.r_slot)
        s4 = _lds_u32(c.rsring[i] + slot * self.r_slot)
        akc, arow = c.akc[i], c.arow[i]
        s2 = _scales_x128((s4 >> (16 * (akc % 2))) & 0xFFFF)
        sc = (_bcast(s2, 0), _bcast(s2, 1))
        if self.tm == 64:       # phase q -> buffer q % 2: [k-tile][64 rows][128 bytes]
            dst0 = c.abuf + (q % 2) * _A_BUF + (akc // 2) * (64 * 128) + arow * 128
        else:                   # the chunk's phase apq -> [phase][k-tile][16 rows][128 bytes]
            dst0 = c.abuf + c.apq[i] * _A_PH16 + (akc // 2) * (16 * 128) + arow * 128
        for w in range(4):
            lo, hi = _byte_form(raw[w], 0), _byte_form(raw[w], 1)
            d = [_adecode_prmt(lo, hi, sc[w // 2], b) for b in range(4)]
            chunk = (akc % 2) * 4 + w
            _sts_v4(dst0 + swizzled_chunk(arow, chunk) * 16, d[0], d[1], d[2], d[3])

    def _load_affine(self, p_wc, p_bias, rows, epf):
        """epf = (2^14·wcscale, bias) of the thread's two rows; a variant without wcscale or bias writes nothing
        there (the epilogue uses 2^14 and skips the bias: an element written in one branch only and never read
        kept a stack slot)."""
        for h in range(2):
            if cutlass.const_expr(self.cfg.wcscale):
                epf[h] = _ldg_f32(p_wc.toint() + Int64(rows[h]) * 4) * Float32(_ACC_UNSCALE)
            if cutlass.const_expr(self.cfg.bias):
                epf[2 + h] = _ldg_f32(p_bias.toint() + Int64(rows[h]) * 4)

    def _load_lora(self, p_la, p_lu, m, m0, rows, g, c4, rs, epw, at):
        """Ranks 16·rs .. 16·rs + 15 into epw[at ..): the four lora_up words of the thread's MMA A fragment, then two
        lora_act_in words (its B fragment) per n8 block of activation rows.  Row addresses first, so each word is
        a constant offset from one of them."""
        R = self.rank
        lu = [p_lu.toint() + (Int64(rows[h]) * R + 2 * c4) * 2 for h in range(2)]
        la = [p_la.toint() + (Int64(cutlass.min(m0 + 8 * b + g, m - 1)) * R + 2 * c4) * 2 for b in range(self.tm // 8)]
        rk = 32 * rs                                     # byte offset of rank 16·rs
        epw[at + 0] = _ldg_u32(lu[0] + rk)
        epw[at + 1] = _ldg_u32(lu[1] + rk)
        epw[at + 2] = _ldg_u32(lu[0] + rk + 16)
        epw[at + 3] = _ldg_u32(lu[1] + rk + 16)
        for b in range(self.tm // 8):
            epw[at + 4 + 2 * b] = _ldg_u32(la[b] + rk)
            epw[at + 5 + 2 * b] = _ldg_u32(la[b] + rk + 16)

    def _epilogue(self, p_la, p_lu, p_out, m, n, m0, r0, lane, acc, epf, epw, early: bool):
        """acc[n, m] (rows r0 + g, r0 + g + 8) -> ·2^14·wcscale, + LoRA, + bias, stored where m < M.  `early`: every
        LoRA word is in epw already, and the store transposes pairs (``sm90_epilogue_ptx``); otherwise each 16-rank
        chunk is loaded into epw just before its MMAs, and values are stored one at a time."""
        g, c4 = lane // 4, lane % 4
        for i in range(self.nacc):
            acc[i] = acc[i] * (epf[(i // 2) % 2] if self.cfg.wcscale else Float32(_ACC_UNSCALE))
        R = self.rank
        if cutlass.const_expr(R > 0):
            for rs in range(R // 16):
                w = rs * self.lora_words if early else 0
                if not early:
                    self._load_lora(p_la, p_lu, m, m0, (r0 + g, r0 + g + 8), g, c4, rs, epw, 0)
                a = [epw[w + q] for q in range(4)]
                for b in range(self.tm // 8):
                    res = _mma(self.dt, [acc[4 * b + i] for i in range(4)], a, [epw[w + 4 + 2 * b], epw[w + 5 + 2 * b]])
                    for i in range(4):
                        acc[4 * b + i] = res[i]
        if cutlass.const_expr(self.cfg.bias):
            for i in range(self.nacc):
                acc[i] = acc[i] + epf[2 + (i // 2) % 2]
        if early:
            store_yt(p_out.toint(), n, m, m0, r0, lane, acc, pair_blocks(1, self.tm), self.dt)
        else:
            # tile_m 64: 16-bit stores (the transposed pairs take it from 128 to 140 registers at rank 64, prefetch 2)
            ob = p_out.toint()
            for b in range(self.tm // 8):
                for i in range(4):
                    col = 8 * b + 2 * c4 + i % 2            # activation row within the tile
                    mm = cutlass.min(m0 + col, m - 1)
                    _st_u16_pred(ob + (Int64(mm) * n + r0 + g + 8 * (i // 2)) * 2, _pack1(acc[4 * b + i], self.dt),
                                 Int32(m0 + col < m))

"""Trace-time decisions of the sm_100a/sm_103a W4A4 GEMM, as plain functions (no DSL import).

The kernel calls the integer functions below on DSL ``Int32`` values (they use
only ``+ - * // %`` and a `minimum` it passes in, which Python ints and the
DSL's integers both support); the CPU tests call them on Python ints and
prove coverage.

* `lora_slice` -- which LoRA atoms are issued after main k-block ``kb``.
* `tile_coord` / `tiles_of_cluster` -- the static persistent tile scheduler.
* `persistent_clusters` -- the grid, from the device's SM count at launch.
* `SmemBytes` / `max_ab_stages` / `smem_problem` and `tmem_columns` / `tmem_problem` -- the
  SMEM and TMEM budgets, fed with byte counts that the kernel module measures from the real
  layouts (``cute.cosize``).
"""
from __future__ import annotations

from dataclasses import dataclass

#: SMEM one sm_100 / sm_103 CTA may opt in to (228 KiB per SM minus 1 KiB reserved), static + dynamic.
SMEM_LIMIT_BYTES = 227 * 1024
#: Static SMEM every cubin of this family carries (the DSL's reserved block; a test checks the cubins).
STATIC_SMEM_BYTES = 1024
#: Tensor-memory columns per SM (128 lanes x 512 columns of 32 bit).
TMEM_COLUMNS = 512
#: Bytes the kernel keeps for mbarriers and the TMEM-pointer slot (generous; measured need < 200 B).
BARRIER_BYTES = 1024
#: K elements per block-scaled main k-block (4 MMA atoms of K = 64).
MAIN_K_BLOCK = 256
#: K elements of one f16/bf16 tcgen05 MMA atom (the LoRA step).
LORA_ATOM_K = 16
#: Deepest A/B pipeline the family builds.
MAX_AB_STAGES = 8


# ---------------------------------------------------------------------------
# LoRA interleave schedule
# ---------------------------------------------------------------------------


def lora_slice(kb, num_kb, lora_atoms, minimum=min):
    """LoRA atoms ``[lo, hi)`` issued right after main k-block `kb` (0 <= kb < num_kb).

    Front-loaded: ``c = ceil(L / KB)`` atoms after each k-block until all L are issued, i.e.
    ``[min(kb*c, L), min((kb+1)*c, L))``.  The slices are disjoint and cover ``[0, L)`` because
    ``KB * c >= L``, so every atom is issued exactly once for every KB >= 1 and L >= 0, including
    K < 4R (L > KB: several atoms after one k-block), where a rule of "one LoRA atom every KB // L
    blocks" drops work.  Front-loading frees the single LoRA buffer early in the tile
    (`lora_release_kb`), so the next tile's LoRA operands load while this tile's main loop runs.
    `minimum` is ``min`` for Python ints and ``cutlass.min`` in the kernel.
    """
    c = (lora_atoms + num_kb - 1) // num_kb
    return minimum(kb * c, lora_atoms), minimum((kb + 1) * c, lora_atoms)


def lora_release_kb(num_kb: int, lora_atoms: int) -> int:
    """The k-block after whose LoRA atoms the LoRA buffer is released: the one whose slice holds the
    last atom (the kernel tests ``lo < hi == L``, which holds for exactly this kb)."""
    if lora_atoms < 1 or num_kb < 1:
        raise ValueError(f"no LoRA buffer to release with {lora_atoms} LoRA atoms and {num_kb} k-blocks")
    c = (lora_atoms + num_kb - 1) // num_kb
    return (lora_atoms - 1) // c


def lora_schedule(num_kb: int, lora_atoms: int) -> list[tuple[int, int]]:
    """The whole schedule of one tile: ``lora_slice`` for every main k-block (for tests and docs)."""
    if num_kb < 1:
        raise ValueError(f"a tile needs at least one main k-block, got {num_kb}")
    return [lora_slice(kb, num_kb, lora_atoms) for kb in range(num_kb)]


# ---------------------------------------------------------------------------
# Static persistent tile scheduler
# ---------------------------------------------------------------------------


def tile_coord(t, tiles_m):
    """Linear tile index -> (m-tile, n-tile); M runs fastest, so clusters working at the same
    time share one weight (N) tile and the activations stream."""
    return t % tiles_m, t // tiles_m


def persistent_clusters(sm_count: int, cluster_size: int, num_tiles: int) -> int:
    """Clusters to launch: as many as fit on the device at one CTA per SM, at most one per tile,
    at least one.  The host function computes the same with the launch-time ``sm_count``."""
    return max(1, min(sm_count // cluster_size, num_tiles))


def tiles_of_cluster(cluster: int, num_clusters: int, num_tiles: int) -> range:
    """The linear tiles cluster `cluster` computes: cluster, cluster + C, cluster + 2C, ..."""
    return range(cluster, num_tiles, num_clusters)


# ---------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SmemBytes:
    """Bytes of one CTA's SMEM buffers, measured from the real layouts (``cute.cosize``)."""
    ab_stage: int       # one A/B pipeline stage: A + B + SFA + SFB
    lora: int           # the LoRA operands of one tile (lora_act_in + lora_up), one buffer; 0 at R = 0
    epilogue: int       # the output staging buffers of the TMA store (all stages)
    align: int = 1024   # each buffer is aligned to this

    def fixed(self) -> int:
        return _up(self.lora, self.align) + _up(self.epilogue, self.align) + BARRIER_BYTES

    def dynamic(self, ab_stages: int) -> int:
        """The dynamic SMEM the kernel's shared-storage struct takes."""
        return self.fixed() + _up(self.ab_stage * ab_stages, self.align)

    def total(self, ab_stages: int) -> int:
        """Dynamic plus the static SMEM of the cubin: what must fit the per-CTA limit."""
        return self.dynamic(ab_stages) + STATIC_SMEM_BYTES


def _up(x: int, a: int) -> int:
    return -(-x // a) * a


def max_ab_stages(b: SmemBytes, limit: int = SMEM_LIMIT_BYTES) -> int:
    """The deepest A/B pipeline that fits `limit` (may be 0 or 1: the caller rejects those)."""
    st = 0
    while st < MAX_AB_STAGES and b.total(st + 1) <= limit:
        st += 1
    return st


def smem_problem(b: SmemBytes, ab_stages: int, limit: int = SMEM_LIMIT_BYTES) -> str | None:
    """None if `ab_stages` stages fit, else why, with the numbers."""
    if ab_stages < 2:
        return f"ab_stages={ab_stages}: the A/B pipeline needs at least 2 stages"
    need = b.total(ab_stages)
    if need > limit:
        return (f"needs {need} B of SMEM ({ab_stages} A/B stages x {b.ab_stage} B + LoRA {b.lora} B + "
                f"epilogue {b.epilogue} B + barriers {BARRIER_BYTES} B + static {STATIC_SMEM_BYTES} B, each buffer "
                f"aligned to {b.align} B), "
                f"more than the {limit} B an sm_100 CTA may use (at most {max_ab_stages(b, limit)} A/B stages fit)")
    return None


def tmem_columns(tile_n: int, acc_stages: int, sfa_cols: int, sfb_cols: int) -> int:
    """TMEM columns used: fp32 accumulator (tile_n per stage) + scale factors."""
    return tile_n * acc_stages + sfa_cols + sfb_cols


def acc_stages_for(tile_n: int, sfa_cols: int, sfb_cols: int) -> int:
    """Two accumulator stages when they fit the 512 columns (epilogue overlaps the next tile), else one."""
    return 2 if tmem_columns(tile_n, 2, sfa_cols, sfb_cols) <= TMEM_COLUMNS else 1


def tmem_problem(tile_n: int, acc_stages: int, sfa_cols: int, sfb_cols: int) -> str | None:
    used = tmem_columns(tile_n, acc_stages, sfa_cols, sfb_cols)
    if used > TMEM_COLUMNS:
        return (f"needs {used} TMEM columns ({acc_stages} accumulator stage(s) x {tile_n} + SFA {sfa_cols} + "
                f"SFB {sfb_cols}), more than the {TMEM_COLUMNS} an SM has")
    return None


def tmem_alloc_columns(used: int) -> int:
    """TMEM allocations are powers of two >= 32 columns."""
    c = 32
    while c < used:
        c *= 2
    return c

"""Per-call fast path: cache interpreted launches, patch pointers in.

Interpreting the host program costs tens to hundreds of microseconds per
call.  What it computes depends on the scalar arguments (shapes) and, in a
few known byte positions, on the pointer values (tensor base addresses in
parameter structs and TMA descriptors).  :class:`LaunchPlanCache` interprets
once per distinct tuple of non-pointer arguments and afterwards only writes
the pointers into the cached parameter bytes.

How pointer slots are found (soundly, per cache key):

1. interpret with a set of random 16-byte-aligned pointers below 2**47 and
   with its bitwise complement in address bits 4..46 (so anything that
   depends on a single pointer bit changes); pointers that are 0 in the
   caller's call stay 0: which pointers are null is part of the cache key;
2. a *slot* is an 8-byte little-endian window of a parameter whose value is
   ``pointer_i + c`` (mod 2**64) with the same ``c`` in both runs; the stream
   is a slot when ``record.stream == pointer_i`` in both runs;
3. every byte not covered by a slot, and the kernel, grid, block, smem,
   attributes and parameter sizes, must be identical in both runs,
   otherwise the key is marked *not patchable* and every call with it is
   interpreted in full (correct, slow);
4. a third run with random *unaligned* pointers tells which pointers also
   work unaligned (a slot that does not reproduce there, e.g. a TMA
   descriptor's ``addr >> 4 << 4``, makes its pointer alignment-sensitive;
   if anything else changes, all pointers are treated as sensitive);
5. the caller's own call is then reproduced by patching and compared with a
   full interpretation of it; any mismatch marks the key not patchable.

At call time a pointer that is alignment-sensitive and not 16-byte aligned,
or any pointer outside ``[0, 2**48)``, is simply interpreted in full.  The
patched result therefore equals ``HostProgram.launch`` whenever the host
code uses each pointer as "base + constant" in whole 8-byte words, which is
verified on up to four pointer sets; a dependence the runs cannot expose
(say, on two pointer bits jointly) would go unnoticed.  DSL host code seen
so far only copies addresses and, in TMA descriptors, stores
``(addr >> 4) << 4``; both are handled.

Null pointers: the DSL host code does not special-case them in any kernel
seen so far, but nothing guarantees that; a call with null pointers uses a
key that includes which pointers are null, and those pointers keep their
interpreted bytes (no offset is ever added to a pointer that the derivation
did not vary).

The object returned by :meth:`LaunchPlanCache.get` for a patchable key is
the cache entry itself, patched in place: it stays valid until the next
``get`` with the same key (launch it before that; the CUDA driver copies
parameter values at launch).  It is not thread-safe per key.
"""

from __future__ import annotations

import random
import struct
from operator import and_, itemgetter, not_
from typing import Sequence

from .hostvm import HostProgram, HostTrap, HostVMError, LaunchRecord

M64 = (1 << 64) - 1
HIGH = M64 ^ ((1 << 48) - 1)  # bits that no device/host pointer has
ALIGN_SENSITIVE = HIGH | 15
ALIGN_FREE = HIGH
_FLIP = ((1 << 47) - 1) & ~15  # address bits 4..46
_U64 = struct.Struct("<Q")
_pack_u64 = _U64.pack_into


def _getter(idx: Sequence[int]):
    """args -> tuple of args[i] for i in idx (always a tuple)."""
    idx = tuple(idx)
    if not idx:
        return lambda args: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda args: (args[i],)
    return itemgetter(*idx)


class CachedLaunch:
    """A cached, pointer-patched launch; same fields as :class:`LaunchRecord`.

    ``params`` are bytearrays patched in place by every ``get`` with this key.
    """

    __slots__ = ("kernel", "grid", "block", "smem", "stream", "attrs", "params", "printf", "slots", "stream_pos", "pmask", "_ptr_array", "__weakref__")

    def __init__(self, rec: LaunchRecord):
        self.kernel = rec.kernel
        self.grid = rec.grid
        self.block = rec.block
        self.smem = rec.smem
        self.stream = rec.stream
        self.attrs = rec.attrs
        self.params = [bytearray(p) for p in rec.params]
        self.printf = rec.printf
        self.slots: tuple = ()
        self.stream_pos = None
        self.pmask: tuple = ()
        self._ptr_array = None

    def record(self) -> LaunchRecord:
        """A detached :class:`LaunchRecord` copy of the current contents."""
        return LaunchRecord(self.kernel, self.grid, self.block, self.smem, self.stream, list(self.attrs),
                            [bytes(p) for p in self.params], self.printf)

    @property
    def kernel_params_address(self) -> int:
        """Address of a ``void*[]`` pointing at each parameter buffer (stable; for cuLaunchKernelEx)."""
        if self._ptr_array is None:
            import ctypes

            bufs = [(ctypes.c_char * max(len(p), 1)).from_buffer(p) if len(p) else ctypes.create_string_buffer(1) for p in self.params]
            arr = (ctypes.c_void_p * max(len(bufs), 1))(*[ctypes.addressof(b) for b in bufs])
            self._ptr_array = (arr, bufs)
        import ctypes

        return ctypes.addressof(self._ptr_array[0])


class _Unpatchable:
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class LaunchPlanCache:
    """Cache of launches per tuple of non-pointer arguments, with pointer patching.

    ``ptr_arg_indices``: positions of the entry arguments that are pointers
    (device pointers and the stream).  ``param_sizes``: ``{kernel: [size,...]}``
    from the cubin (passed to :meth:`HostProgram.launch`).
    """

    def __init__(self, program: HostProgram, ptr_arg_indices: Sequence[int], param_sizes: dict[str, list[int]] | None = None,
                 *, max_entries: int = 4096, seed: int | None = 0x5D9A07):
        self.program = program
        n = len(program.arg_kinds)
        ptr = sorted(set(int(i) for i in ptr_arg_indices))
        if any(not 0 <= i < n for i in ptr):
            raise ValueError(f"pointer argument index out of range for {n} arguments")
        self.ptr_idx = tuple(ptr)
        self.scalar_idx = tuple(i for i in range(n) if i not in set(ptr))
        self._nargs = n
        self._scalars_of = _getter(self.scalar_idx)
        self._ptrs_of = _getter(self.ptr_idx)
        self.param_sizes = param_sizes
        self.max_entries = max_entries
        self._rng = random.Random(seed)
        self._cache: dict = {}
        self.hits = 0
        self.misses = 0
        self.slow = 0

    # -- hot path ------------------------------------------------------------
    def get(self, args: Sequence):
        """The launch for ``args`` (same result as ``program.launch(args, param_sizes)``)."""
        p = self._ptrs_of(args)
        key = self._scalars_of(args)
        if 0 in p:
            key = (key, tuple(map(not_, p)))
        e = self._cache.get(key)
        if e.__class__ is CachedLaunch and not any(map(and_, p, e.pmask)):
            for buf, off, i, c in e.slots:
                _pack_u64(buf, off, (p[i] + c) & M64)
            if e.stream_pos is not None:
                e.stream = p[e.stream_pos]
            self.hits += 1
            return e
        return self._slow(args, key, e)

    # -- slow path -----------------------------------------------------------
    def _interp(self, args) -> LaunchRecord:
        return self.program.launch(args, self.param_sizes)

    def _slow(self, args, key, e):
        if len(args) != self._nargs:
            raise HostVMError(f"entry function takes {self._nargs} arguments, got {len(args)}")
        if e is None:
            self.misses += 1
            rec, e = self._derive(args)
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
            self._cache[key] = e
            if rec is not None:
                return rec
        self.slow += 1
        return self._interp(args)

    def entry_for(self, args: Sequence):
        """The cache entry for ``args`` (a CachedLaunch, or an object with ``.reason`` if not patchable)."""
        p = self._ptrs_of(args)
        key = self._scalars_of(args)
        if 0 in p:
            key = (key, tuple(map(not_, p)))
        if key not in self._cache:
            self.get(args)
        return self._cache[key]

    def _rand_ptrs(self, p, aligned: bool):
        out = []
        for v in p:
            if v == 0:
                out.append(0)
                continue
            x = self._rng.randrange(1 << 36, 1 << 47)
            x = x & ~15 if aligned else (x & ~15) | self._rng.randrange(1, 16)
            out.append(x)
        return out

    def _with_ptrs(self, args, ptrs):
        a = list(args)
        for i, v in zip(self.ptr_idx, ptrs):
            a[i] = v
        return a

    def _derive(self, args):
        """Interpret the caller's call and derive the patch plan for its key.

        Returns (record for the caller's args or None, cache entry).
        """
        p = tuple(int(x) for x in self._ptrs_of(args))
        rec_a = self._interp(args)  # raises HostTrap etc. for the caller: nothing is cached then
        # B: random; C: B with every address bit 4..46 flipped, so that a
        # byte depending on any single pointer bit differs between B and C
        pb = self._rand_ptrs(p, True)
        pc = [x ^ _FLIP if x else 0 for x in pb]
        while any(x == 0 for x, v in zip(pc, p) if v):
            pb = self._rand_ptrs(p, True)
            pc = [x ^ _FLIP if x else 0 for x in pb]
        try:
            rec_b = self._interp(self._with_ptrs(args, pb))
            rec_c = self._interp(self._with_ptrs(args, pc))
        except (HostTrap, HostVMError) as ex:
            return rec_a, _Unpatchable(f"interpretation with other pointers failed: {ex}")
        why = _same_shape(rec_b, rec_c)
        if why:
            return rec_a, _Unpatchable(why)
        entry = CachedLaunch(rec_b)
        # slots in parameters
        slots = []
        nz = [i for i, v in enumerate(p) if v != 0]
        for pi, (xb, xc) in enumerate(zip(rec_b.params, rec_c.params)):
            covered = bytearray(len(xb))
            o = 0
            n = len(xb)
            while o + 8 <= n:
                vb = _U64.unpack_from(xb, o)[0]
                vc = _U64.unpack_from(xc, o)[0]
                hit = None
                if vb != vc:
                    for i in nz:
                        c = (vb - pb[i]) & M64
                        if (vc - pc[i]) & M64 == c:
                            hit = (i, c)
                            break
                if hit is not None and not any(covered[o : o + 8]):
                    slots.append((pi, o, hit[0], hit[1]))
                    covered[o : o + 8] = b"\x01" * 8
                    o += 8
                    continue
                o += 1
            for j in range(n):
                if not covered[j] and xb[j] != xc[j]:
                    return rec_a, _Unpatchable(f"parameter {pi} byte {j} depends on pointers in a way that is not base+offset")
        stream_pos = None
        if rec_b.stream != rec_c.stream:
            for i in nz:
                if rec_b.stream == pb[i] and rec_c.stream == pc[i]:
                    stream_pos = i
                    break
            if stream_pos is None:
                return rec_a, _Unpatchable("the stream depends on pointers in a way that is not a plain copy")
        entry.slots = tuple((entry.params[pi], o, i, c) for pi, o, i, c in slots)
        entry.stream_pos = stream_pos
        # alignment sensitivity: a run with unaligned pointers
        sensitive = set(nz)
        pd = self._rand_ptrs(p, False)
        try:
            rec_d = self._interp(self._with_ptrs(args, pd))
        except (HostTrap, HostVMError):
            rec_d = None
        if rec_d is not None and not _same_shape(rec_b, rec_d):
            ok = True
            bad = set()
            for pi, (xb, xd) in enumerate(zip(rec_b.params, rec_d.params)):
                cov = bytearray(len(xb))
                for spi, o, i, c in slots:
                    if spi != pi:
                        continue
                    cov[o : o + 8] = b"\x01" * 8
                    if _U64.unpack_from(xd, o)[0] != (pd[i] + c) & M64:
                        bad.add(i)
                if any(not cov[j] and xb[j] != xd[j] for j in range(len(xb))):
                    ok = False
            if stream_pos is not None and rec_d.stream != pd[stream_pos]:
                bad.add(stream_pos)
            if ok:
                sensitive = bad
        entry.pmask = tuple(ALIGN_SENSITIVE if i in sensitive else ALIGN_FREE for i in range(len(p)))
        # finally: the caller's own call, reproduced by patching, must match exactly
        if not any(map(and_, p, entry.pmask)):
            for buf, off, i, c in entry.slots:
                _pack_u64(buf, off, (p[i] + c) & M64)
            if entry.stream_pos is not None:
                entry.stream = p[entry.stream_pos]
            if entry.record() != rec_a:
                return rec_a, _Unpatchable("patched launch differs from the interpreted one for the caller's pointers")
            return entry, entry
        return rec_a, entry

    def stats(self) -> dict:
        unpatchable = [k for k, v in self._cache.items() if isinstance(v, _Unpatchable)]
        return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses, "slow": self.slow,
                "unpatchable": len(unpatchable)}


def _same_shape(a: LaunchRecord, b: LaunchRecord) -> str | None:
    """Reason why two launches differ in more than parameter bytes / stream (None if they don't)."""
    for f in ("kernel", "grid", "block", "smem"):
        if getattr(a, f) != getattr(b, f):
            return f"{f} depends on pointer values"
    if a.attrs != b.attrs:
        return "launch attributes depend on pointer values"
    if [len(x) for x in a.params] != [len(x) for x in b.params]:
        return "parameter sizes depend on pointer values"
    return None


__all__ = ["CachedLaunch", "LaunchPlanCache"]

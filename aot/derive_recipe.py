"""Derive a variant's launch recipe from its host program, at build time.

``derive_recipe`` runs the host-program interpreter (``svdq_loader.hostvm``)
on many random argument lists from a caller-supplied sampler and explains
every launch field by data:

* kernel, parameter sizes and attribute ids must not vary;
* the stream must be a copy of one pointer argument (or always 0);
* in each parameter, an 8-byte window whose value minus some pointer
  argument is constant (or a fitted scalar expression) is a pointer slot;
* every other byte that varies is covered by the widest defined window
  (8, 4, 2, then 1 bytes) whose value fits an expression of the scalars:
  ``a*q + b`` with ``q`` an argument or its floor/ceil division by a
  constant; an affine function of all scalars; ``a*q1*q2 + b``;
  ``min``/``max`` of such with an argument; and FastDivmod fields
  (multiplier, shifts) of an expression already found;
* bytes the host code never writes (they change with the interpreter's
  ``undef_byte``) stay template bytes (0, as the interpreter reads them);
* inputs the host code refuses (``printf`` on its error path, or a trap)
  become a guard when one fitted quantity separates them from the rest.

The recipe is then checked on fresh samples against the interpreter (every
field, every byte), with null and unaligned pointers to learn which
pointers may be null or unaligned.  Anything that does not fit or does not
check out returns ``(None, reason)``: the loader then keeps using the
interpreter (with its per-shape cache) for that variant.
"""
from __future__ import annotations

import random
from fractions import Fraction
from math import gcd
from typing import Callable, Sequence

from svdq_loader.hostvm import HostProgram, HostReturned, HostTrap, HostVMError
from svdq_loader.launch_recipe import (Block, LaunchRecipe, RecipeError, RecipeEvalError, Slot, eval_expr,
                                       format_expr)

M64 = (1 << 64) - 1
# powers of two first: with inputs that are all multiples of 128, n // 128 must win over ceil(n / 127) - 1
_DIVISORS = [1 << s for s in range(1, 25)] + sorted(set(range(3, 257)) - {1 << s for s in range(9)}) + [3 << s for s in range(7, 16)]
_PRODUCT_DIVISORS = [1 << s for s in range(1, 13)]


class _NoFit(Exception):
    pass


def _signed(v: int, w: int) -> int:
    return v - (1 << w) if v >> (w - 1) else v


def _affine(a: int, q, b: int):
    """The expression a*q + b, simplified."""
    e = q if a == 1 else ["mul", a, q]
    return e if b == 0 else ["add", e, b]


class _Fitter:
    """Fits sample values to small integer expressions of the scalar arguments."""

    def __init__(self, xs: list[list[int]], scalar_idx: Sequence[int], hints: Sequence = ()):
        self.xs = xs
        self.n = len(xs)
        self.scalar_idx = list(scalar_idx)
        self.known: list = []
        basis, seen = [], set()

        def add(expr, vals, small):
            key = tuple(vals)
            if key in seen or len(set(key)) < 2:
                return
            seen.add(key)
            basis.append((expr, key, small))

        for j in self.scalar_idx:
            col = [x[j] for x in xs]
            add(["arg", j], col, True)
            for d in _DIVISORS:
                small = d in _PRODUCT_DIVISORS
                add(["ceildiv", ["arg", j], d], [-(-v // d) for v in col], small)
                add(["floordiv", ["arg", j], d], [v // d for v in col], small)
        for h in hints:         # the family's candidates, tried like any basis expression (then verified)
            try:
                add(h, [eval_expr(h, x) for x in xs], False)
            except RecipeEvalError:
                continue
        self.basis = basis

    # -- families ----------------------------------------------------------------
    def _lin(self, qs, ys, idx, mod):
        """(a, b) with a*q + b == y (mod 2**w) on idx, or None (y read as signed, then as unsigned)."""
        i0 = idx[0]
        i = next((i for i in idx if qs[i] != qs[i0]), None)
        if i is None:
            return None
        dq = qs[i] - qs[i0]
        for y in (ys, self._unsigned):
            dy = y[i] - y[i0]
            if dy % dq:
                continue
            a = dy // dq
            b = y[i0] - a * qs[i0]
            if all((a * qs[k] + b - ys[k]) % mod == 0 for k in idx):
                return a, b
        return None

    def _all_affine(self, ys, idx, mod):
        cols = self.scalar_idx
        rows = [[Fraction(1)] + [Fraction(self.xs[i][j]) for j in cols] + [Fraction(ys[i])] for i in idx]
        nv = len(cols) + 1
        piv, r = [], 0
        for c in range(nv):
            p = next((k for k in range(r, len(rows)) if rows[k][c] != 0), None)
            if p is None:
                continue
            rows[r], rows[p] = rows[p], rows[r]
            pr = rows[r]
            for k in range(len(rows)):
                if k != r and rows[k][c] != 0:
                    f = rows[k][c] / pr[c]
                    rows[k] = [u - f * v for u, v in zip(rows[k], pr)]
            piv.append((r, c))
            r += 1
        if any(row[nv] != 0 for row in rows[r:]):
            return None
        coef = [Fraction(0)] * nv
        for r, c in piv:
            coef[c] = rows[r][nv] / rows[r][c]
        if any(v.denominator != 1 for v in coef):
            return None
        coef = [int(v) for v in coef]
        e = None
        for a, j in zip(coef[1:], cols):
            if a:
                t = _affine(a, ["arg", j], 0)
                e = t if e is None else ["add", e, t]
        if e is None:
            return None
        e = e if coef[0] == 0 else ["add", e, coef[0]]
        if all((self._eval(e, i) - ys[i]) % mod == 0 for i in idx):
            return e
        return None

    def _eval(self, e, i):
        return eval_expr(e, self.xs[i])

    def _plain(self, ys, idx, mod):
        y0 = ys[idx[0]]
        if all(ys[i] == y0 for i in idx):
            return y0, None
        for expr, qs, _ in self.basis:
            ab = self._lin(qs, ys, idx, mod)
            if ab:
                return _affine(ab[0], expr, ab[1]), expr
        e = self._all_affine(ys, idx, mod)
        if e is not None:
            return e, None
        for expr, _ in self._unary_known():
            qs = self._vals(expr)
            if qs is not None:
                ab = self._lin(qs, ys, idx, mod)
                if ab:
                    return _affine(ab[0], expr, ab[1]), None
        small = [b for b in self.basis if b[2]]
        for u in range(len(small)):
            for v in range(u, len(small)):
                qs = [p * q for p, q in zip(small[u][1], small[v][1])]
                ab = self._lin(qs, ys, idx, mod)
                if ab:
                    return _affine(ab[0], ["mul", small[u][0], small[v][0]], ab[1]), None
        return None

    def _unary_known(self):
        for k in self.known:
            yield ["fdm_mul", k], k
            yield ["clog2", k], k
            yield ["min", ["clog2", k], 1], k
            yield ["max", ["sub", ["clog2", k], 1], 0], k

    def _vals(self, expr):
        try:
            return [self._eval(expr, i) for i in range(self.n)]
        except RecipeEvalError:
            return None

    def fit(self, values: Sequence[int], width: int):
        """An expression whose low ``width`` bits equal ``values`` on every sample, or None."""
        mod = 1 << width
        self._unsigned = [v % mod for v in values]
        ys = [_signed(v, width) for v in self._unsigned]
        idx = list(range(self.n))
        got = self._plain(ys, idx, mod)
        if got is None:
            for j in self.scalar_idx:
                for op in ("min", "max"):
                    xj = [x[j] for x in self.xs]
                    rest = [i for i in idx if ys[i] != xj[i]]
                    if len(rest) < 2 or len(rest) == len(idx):
                        continue
                    sub = self._plain(ys, rest, mod)
                    if sub is None:
                        continue
                    e = ["min" if op == "min" else "max", sub[0], ["arg", j]]
                    vals = self._vals(e)
                    if vals is not None and all((v - y) % mod == 0 for v, y in zip(vals, ys)):
                        got = (e, sub[1])
                        break
                if got is not None:
                    break
        if got is None:
            return None
        expr, core = got
        for k in (expr, core):
            if k is not None and not isinstance(k, int) and k not in self.known:
                self.known.append(k)
        return expr


def _le(b: bytes, o: int, w: int) -> int:
    return int.from_bytes(b[o:o + w], "little")


def _fit_block(fitter: _Fitter, datas: list[bytes], undefined: bytearray, ptrs: list[list[int]] | None,
               what: str) -> Block:
    """Template + slots explaining ``datas`` (one per sample); raises _NoFit."""
    n = len(datas[0])
    d0 = datas[0]
    varying = [any(d[j] != d0[j] for d in datas) for j in range(n)]
    covered = bytearray(n)
    slots = []
    if ptrs:
        o = 0
        while o + 8 <= n:
            if any(undefined[o:o + 8]) or not any(varying[o:o + 8]):
                o += 1
                continue
            vs = [_le(d, o, 8) for d in datas]
            hit = None
            for i, col in enumerate(ptrs):
                if col is None:
                    continue
                rs = [(v - p) & M64 for v, p in zip(vs, col)]
                if all(r == rs[0] for r in rs):
                    hit = Slot(o, 8, _signed(rs[0], 64), i)
                elif max(_signed(r, 64) for r in rs) - min(_signed(r, 64) for r in rs) < 1 << 40:
                    e = fitter.fit(rs, 64)
                    if e is not None:
                        hit = Slot(o, 8, e, i)
                if hit:
                    break
            if hit is None:
                o += 1
                continue
            slots.append(hit)
            covered[o:o + 8] = b"\x01" * 8
            o += 8

    def cover(o, w):
        need = [j for j in range(o, min(o + w, n)) if varying[j] and not covered[j]]
        if not need:
            return []
        if o + w <= n and not any(undefined[o:o + w]) and not any(covered[o:o + w]):
            e = fitter.fit([_le(d, o, w) for d in datas], 8 * w)
            if e is not None:
                return [Slot(o, w, e)]
        if w == 1:
            vals = sorted({d[o] for d in datas})
            raise _NoFit(f"{what} byte {o}: no expression fits (values {vals[:6]}...)")
        h = w // 2
        return cover(o, h) + cover(o + h, h)

    for g in range(0, n, 8):
        slots += cover(g, 8)
    slots.sort(key=lambda s: s.offset)
    return Block(d0, slots)


def derive_recipe(program: HostProgram, param_sizes: dict[str, list[int]] | None, ptr_arg_indices: Sequence[int],
                  sample_args: Callable[[random.Random], list], *, n_samples: int = 24, n_verify: int = 24,
                  extra_args: Sequence[Sequence[int]] = (), domain: dict[int, tuple[int, int, int]] | None = None,
                  seed: int = 0x5EC1BE, hints: Sequence = ()) -> tuple[LaunchRecipe | None, str]:
    """``(recipe, "ok")``, or ``(None, reason)`` when the launch is not expressible as a recipe.  ``hints``:
    expressions the fitter tries beside its own search (a family's; verified like every fit).

    ``sample_args(rng)`` returns one valid argument list (pointers 16-byte
    aligned and random, scalars valid for the op); ``extra_args`` are edge
    cases added to the derivation samples.  ``domain`` (``{arg: (lo, hi,
    multiple_of)}``) declares where the recipe should apply; by default it
    is the box spanned by all (derivation and verification) samples.
    """
    try:
        return _derive(program, param_sizes, ptr_arg_indices, sample_args, n_samples, n_verify, extra_args,
                       domain, seed, hints)
    except _NoFit as e:
        return None, str(e)


def _derive(program, param_sizes, ptr_arg_indices, sample_args, n_samples, n_verify, extra_args, domain, seed,
            hints=()):
    rng = random.Random(seed)
    types = program.arg_types
    nargs = len(types)
    ptr_idx = sorted(set(int(i) for i in ptr_arg_indices))
    scalar_idx = [i for i in range(nargs) if i not in ptr_idx]
    for i in scalar_idx:
        if types[i].kind != "int":
            raise _NoFit(f"argument {i} is {types[i].text}: only integer scalars are supported")

    def xvec(args):
        x = [0] * nargs
        for i in scalar_idx:
            x[i] = _signed(int(args[i]) & types[i].mask, types[i].width)
        return x

    def run(args, undef=0):
        """(record or None if the host code refused these inputs)."""
        try:
            rec = program.launch(list(args), param_sizes, undef_byte=undef)
        except (HostTrap, HostReturned):
            return None
        except HostVMError as e:
            raise _NoFit(f"the interpreter failed: {e}") from None
        return None if rec.printf.strip() else rec

    derive_args = [list(a) for a in extra_args] + [list(sample_args(rng)) for _ in range(n_samples)]
    verify_args = [list(sample_args(rng)) for _ in range(n_verify)]
    for a in derive_args + verify_args:
        if len(a) != nargs:
            raise _NoFit(f"the sampler returned {len(a)} arguments, the host function takes {nargs}")
    recs = [run(a) for a in derive_args]
    ok = [i for i, r in enumerate(recs) if r is not None]
    refused = [i for i, r in enumerate(recs) if r is None]
    if len(ok) < 8:
        raise _NoFit(f"only {len(ok)} of {len(recs)} samples launched: too few to derive a recipe")
    R = [recs[i] for i in ok]
    A = [derive_args[i] for i in ok]
    r0 = R[0]
    if any(r.kernel != r0.kernel for r in R):
        raise _NoFit("the kernel launched depends on the inputs")
    if any([len(p) for p in r.params] != [len(p) for p in r0.params] for r in R):
        raise _NoFit("parameter sizes depend on the inputs")
    if any([a for a, _ in r.attrs] != [a for a, _ in r0.attrs] for r in R):
        raise _NoFit("the launch attributes used depend on the inputs")
    # the stream
    stream = None
    if any(r.stream for r in R):
        stream = next((i for i in ptr_idx if all(r.stream == int(a[i]) for r, a in zip(R, A))), None)
        if stream is None:
            raise _NoFit("the stream is not a copy of a pointer argument")
    # bytes the host code never writes
    und_p = [bytearray(len(p)) for p in r0.params]
    und_a = [bytearray(64) for _ in r0.attrs]
    for a in A[:3]:
        base = run(a)
        for fill in (0xA5, 0x5A):
            other = run(a, fill)
            if other is None:
                raise _NoFit("the host code's refusal depends on uninitialised memory")
            for u, x, y in zip(und_p, base.params, other.params):
                for j in range(len(x)):
                    u[j] |= x[j] != y[j]
            for u, (_, x), (_, y) in zip(und_a, base.attrs, other.attrs):
                for j in range(64):
                    u[j] |= x[j] != y[j]
    fitter = _Fitter([xvec(a) for a in A], scalar_idx, hints)

    def fit(vals, width, what):
        e = fitter.fit(vals, width)
        if e is None:
            raise _NoFit(f"{what}: no expression of the scalar arguments fits (values {sorted(set(vals))[:6]}...)")
        return e

    grid = [fit([r.grid[d] for r in R], 32, f"grid[{d}]") for d in range(3)]
    block = [fit([r.block[d] for r in R], 32, f"block[{d}]") for d in range(3)]
    smem = fit([r.smem for r in R], 64, "smem")
    attrs = []
    for k, (aid, _) in enumerate(r0.attrs):
        b = _fit_block(fitter, [r.attrs[k][1] for r in R], und_a[k], None, f"attribute {aid}")
        b.attr_id = aid
        attrs.append(b)
    pcols = [[int(a[i]) for a in A] if all(int(a[i]) for a in A) else None for i in range(nargs)]
    pcols = [c if i in ptr_idx else None for i, c in enumerate(pcols)]
    params = [_fit_block(fitter, [r.params[k] for r in R], und_p[k], pcols, f"parameter {k}")
              for k in range(len(r0.params))]

    # domain of the scalars: the box of every launching sample (or the caller's)
    V = [(a, run(a)) for a in verify_args]
    launched = A + [a for a, r in V if r is not None]
    scalars = []
    for i in scalar_idx:
        if domain and i in domain:
            lo, hi, mult = (int(v) for v in domain[i])
        else:
            vals = [xvec(a)[i] for a in launched]
            lo, hi, mult = min(vals), max(vals), 0
            for v in vals:
                mult = gcd(mult, v)
            mult = max(mult, 1)
        scalars.append({"arg": i, "bits": types[i].width, "lo": lo, "hi": hi, "multiple_of": mult})
    pointers = [{"arg": i, "align": 1} for i in ptr_idx]
    common = dict(kernel=r0.kernel, nargs=nargs, scalars=scalars, stream=stream, grid=grid, block=block,
                  smem=smem, attrs=attrs, params=params)

    def make(pointers, nulls_ok, guards):
        try:
            return LaunchRecipe(pointers=pointers, nulls_ok=nulls_ok, guards=guards, **common)
        except RecipeError as e:  # pragma: no cover - a derivation bug
            raise _NoFit(f"derived an invalid recipe: {e}") from None

    # refused inputs -> a guard on one fitted quantity
    guards = []
    bad_args = [derive_args[i] for i in refused] + [a for a, r in V if r is None]
    if bad_args:
        guards = _guard(make(pointers, True, []), A, bad_args, xvec)
        if guards is None:
            raise _NoFit(f"the host code refuses {len(bad_args)} sampled inputs under a condition the recipe "
                         f"cannot express")
    recipe = make(pointers, True, guards)

    def check(rec_args, rec_want, label):
        """None if the recipe reproduces the interpreter's launch, else a reason."""
        scal = [rec_args[i] for i in recipe.scalar_args]
        b = recipe.bind(scal)
        if b is None:
            return None if rec_want is None else "skip"
        if rec_want is None:
            return f"{label}: the host code refuses args {rec_args} that the recipe accepts"
        p = [int(rec_args[i]) for i in recipe.ptr_args]
        if not b.usable(p):
            return "skip"
        got = b.record(p)
        return _diff(got, rec_want, label, rec_args)

    # the domain is a box: also check it where the sampler's correlations never go -- scalars mixed
    # across samples, the box's corners and uniform points inside it
    box = []
    for t in range(n_verify + 32 + 16):
        a = list(rng.choice(launched))
        for s in scalars:
            lo, hi, mult = s["lo"], s["hi"], s["multiple_of"]
            if t < n_verify:
                v = xvec(rng.choice(launched))[s["arg"]]
            elif t < n_verify + 32:
                v = hi if (t >> scalars.index(s)) & 1 else lo
            else:
                v = rng.randrange(lo, hi + 1)
            a[s["arg"]] = min(max(-(-v // mult) * mult, -(-lo // mult) * mult), hi // mult * mult)
        box.append(a)
    V += [(a, run(a)) for a in box]
    checked = 0
    for a, r in V:
        why = check(a, r, "verification")
        if why == "skip":
            continue
        if why:
            raise _NoFit(why)
        checked += r is not None
    if checked < max(4, n_verify // 2):
        raise _NoFit(f"only {checked} fresh samples fell inside the recipe's domain: cannot verify it")
    # null pointers
    nulls_ok = True
    tensor_ptrs = [i for i in ptr_idx if i != stream]
    for a, _ in V[:8]:
        z = list(a)
        for i in tensor_ptrs:
            if rng.random() < 0.4:
                z[i] = 0
        why = check(z, run(z), "null pointers")
        if why and why != "skip":
            nulls_ok = False
            break
    # unaligned pointers, one at a time
    for pi, i in enumerate(ptr_idx):
        for a, _ in V[:3]:
            u = list(a)
            u[i] = (int(u[i]) | rng.randrange(1, 16)) if int(u[i]) else rng.randrange(1 << 32, 1 << 47) | 8
            why = check(u, run(u), "unaligned pointer")
            if why and why != "skip":
                pointers[pi]["align"] = 16
                break
    recipe = make(pointers, nulls_ok, guards)
    return recipe, "ok"


def _guard(recipe: LaunchRecipe, ok_args, bad_args, xvec):
    """A guard list separating accepted from refused inputs, or None."""
    cands = [recipe.smem, *recipe.grid, *recipe.block] + [["arg", i] for i in recipe.scalar_args]
    for q in cands:
        if isinstance(q, int):
            continue
        try:
            okv = [eval_expr(q, xvec(a)) for a in ok_args]
            badv = [eval_expr(q, xvec(a)) for a in bad_args]
        except RecipeEvalError:
            continue
        if max(okv) < min(badv):
            return [{"expr": q, "le": max(okv)}]
        if min(okv) > max(badv):
            return [{"expr": q, "ge": min(okv)}]
    return None


def _diff(got, want, label, args) -> str | None:
    for f in ("kernel", "grid", "block", "smem", "stream"):
        if getattr(got, f) != getattr(want, f):
            return f"{label}: {f} {getattr(got, f)!r} != interpreter {getattr(want, f)!r} for args {args}"
    for k, ((ia, va), (ib, vb)) in enumerate(zip(got.attrs, want.attrs)):
        if ia != ib or va != vb:
            return f"{label}: attribute {ib} differs from the interpreter for args {args}"
    if len(got.attrs) != len(want.attrs) or len(got.params) != len(want.params):
        return f"{label}: attribute/parameter count differs from the interpreter"
    for k, (x, y) in enumerate(zip(got.params, want.params)):
        if x != y:
            bad = [j for j in range(min(len(x), len(y))) if x[j] != y[j]]
            return f"{label}: parameter {k} bytes {bad[:8]} differ from the interpreter for args {args}"
    return None


__all__ = ["derive_recipe", "format_expr"]


# ---------------------------------------------------------------------------
# The build's entry point: an op's variant -> its recipe dict (or None)
# ---------------------------------------------------------------------------

#: Where a build-time recipe must hold (the loader takes the interpreter path outside it).
#: m and n are bounded so that the largest grid (the 64-row GEMM tile split over four CTAs: 4 x m/64 x n/128
#: CTAs) stays below 2^31 over the whole box.
DIM_LIMITS = {"m": (1, 1 << 22), "n": (1, 1 << 18), "k": (1, 1 << 20)}
SCALAR_LIMITS = {"sm_count": (1, 4096), "use_smooth": (0, 1), "ksplit": (1, 8), "ctas": (1, 1 << 20)}


def _dim_box(spec, requirements):
    box = {}
    for i, (a, kind) in enumerate(spec.host_args):
        if kind != "i32":
            continue
        if a in DIM_LIMITS:
            lo, hi = DIM_LIMITS[a]
            mult = int(requirements.get(f"{a}_multiple", 1))
            box[i] = (max(lo, mult), hi - hi % mult, mult)
        else:
            lo, hi = SCALAR_LIMITS.get(a, (0, 1))
            box[i] = (lo, hi, 1)
    return box


def derive_for_op(spec, host_doc: dict, params: dict, requirements: dict, hints: Sequence = ()) -> dict | None:
    """Derive and verify the launch recipe of one variant of op `spec`; its dict form, or None.  `hints`:
    candidate expressions of the family (``CompiledKernel.recipe_hints``)."""
    program = HostProgram.from_dict(host_doc)
    sizes = {sym: [int(p[2]) for p in ps] for sym, ps in params.items()}
    ptr_idx = [i for i, (_, kind) in enumerate(spec.host_args) if kind in ("ptr", "stream")]
    box = _dim_box(spec, requirements)

    def sample(rng: random.Random) -> list:
        out = []
        for i, (_, kind) in enumerate(spec.host_args):
            if kind == "ptr":
                out.append(rng.randrange(1 << 36, 1 << 47) & ~15)
            elif kind == "stream":
                out.append(rng.randrange(1 << 20, 1 << 40) & ~15)
            else:
                lo, hi, mult = box[i]
                if hi - lo > 4096:   # log-uniform over the range, so small and large values both appear
                    v = int(2 ** rng.uniform(0, (hi // max(lo, 1)).bit_length()) * max(lo, 1))
                    v = min(max(v, lo), hi)
                else:
                    v = rng.randint(lo, hi)
                out.append(max(lo, v - v % mult))
        return out

    def edge(which: str) -> list:
        a = sample(random.Random(7))
        for i, (lo, hi, mult) in box.items():
            a[i] = lo if which == "lo" else hi
        return a

    recipe, _why = derive_recipe(program, sizes, ptr_idx, sample, extra_args=(edge("lo"), edge("hi")),
                                 domain=box, hints=hints)
    return None if recipe is None else recipe.to_dict()

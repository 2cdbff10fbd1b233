"""The one verification of an artifact directory, shared by `load()` and `svdq-aot verify`.

`open_artifacts(directory)` makes no CUDA call.  It:

1. reads the manifest strictly (schema version, its own checksum);
2. reads every file it names, checking path, size and SHA-256 of the exact
   bytes returned;
3. parses every host program (a corrupt one is refused with its file name);
4. cross-checks each variant's facts against the bytes they describe:
   the op exists and its host arguments are the op's; the feature knobs are
   allowed for the op and arch; the name is the one the naming rule gives
   for the knobs (and so the kernel symbols, which carry the name, bind the
   knobs to the cubin); the cubin's ELF arch; its kernel symbols; each
   parameter's offset and size from ``.nv.info``; registers, stack frame and
   static shared memory; and, by one interpreted sample launch, the kernel,
   the dynamic shared memory and the parameter sizes the host program
   really uses.  A stored launch recipe must reproduce that sample launch;
5. the tuning table ``tuning.json``, when the directory holds one
   (`tuning_table.parse_table`: its schema and checksum, that it was
   measured for this manifest, and that every variant it names exists and
   serves the entry's problem).  A bad table is refused, like a bad manifest.

Every problem is an `ArtifactError` subclass naming the file, the variant
and both values.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ._version import __version__
from .cubin_info import CubinFormatError, cubin_info
from .hostvm import HostProgram, HostVMError
from .manifest import (MANIFEST_NAME, ArtifactError, Manifest, ManifestError, VariantEntry, read_artifacts,
                       read_manifest)
from .ops import OPS
from .tuning_table import TABLE_NAME, TuningTable, TuningTableError, parse_table


class ArtifactMismatch(ArtifactError):
    """A manifest fact disagrees with the bytes it describes."""


@dataclass
class VerifiedVariant:
    entry: VariantEntry
    cubin: bytes
    program: HostProgram
    recipe: object | None        # a parsed LaunchRecipe, when the manifest stores one


@dataclass
class Artifacts:
    directory: str
    manifest: Manifest
    variants: dict[str, VerifiedVariant]
    tuning: TuningTable | None = None

    def files(self) -> list[str]:
        """Every file of the artifact set, as names in `directory` (what must ship): the manifest, the
        files it lists, and the tuning table if one was verified from the directory."""
        out = [MANIFEST_NAME] + [n for n, _, _ in self.manifest.files()]
        if self.tuning is not None and Path(self.tuning.source) == Path(self.directory) / TABLE_NAME:
            out.append(TABLE_NAME)
        return out


def _arch_sm(arch: str) -> int | None:
    digits = "".join(ch for ch in arch[3:] if ch.isdigit()) if arch.startswith("sm_") else ""
    return int(digits) if digits else None


def _fact_problems(v: VariantEntry, cubin: bytes, program: HostProgram) -> tuple[list[str], object | None]:
    """(every disagreement between `v` and the bytes it describes, its parsed launch recipe or None)."""
    spec = OPS.get(v.op)
    if spec is None:
        return [f"op {v.op!r} is not known to this loader (svdq_loader {__version__} serves "
                f"{', '.join(OPS)}); install the loader the artifacts were built for"], None
    out: list[str] = []
    if tuple(v.host_args) != spec.host_args:
        out.append(f"host_args {[list(a) for a in v.host_args]} differ from op {v.op}'s "
                   f"{[list(a) for a in spec.host_args]} in this loader ({__version__}); rebuild the artifacts")
    out += spec.check_feature_values(v.knobs, v.arch)
    if sorted(v.requirements) != sorted(spec.requirement_keys):
        out.append(f"requirements {sorted(v.requirements)} are not op {v.op}'s {sorted(spec.requirement_keys)}")
    if not out:
        want_name = spec.name_for(v.arch, v.knobs, v.requirements)
        if v.name != want_name:
            out.append(f"name does not match its knobs and requirements: {v.knobs} with {v.requirements} "
                       f"name the variant {want_name!r}")
    try:
        info = cubin_info(cubin)
    except CubinFormatError as e:
        return out + [f"{v.cubin}: not a readable cubin: {e}"], None
    sm = _arch_sm(v.arch)
    if info.sm != sm:
        out.append(f"{v.cubin}: the cubin is built for sm_{info.sm} but the manifest says {v.arch}")
    for sym in v.kernel_symbols:
        if not sym.startswith(v.name):
            out.append(f"kernel symbol {sym!r} does not carry the variant name {v.name!r}")
        k = info.kernels.get(sym)
        if k is None:
            out.append(f"{v.cubin}: has no kernel {sym!r} (it has {sorted(info.kernels)})")
            continue
        cub = [tuple(p) for p in k.params]
        man = [tuple(p) for p in v.params[sym]]
        if cub != man:
            out.append(f"{v.cubin}: kernel {sym} parameters (index, offset, size) are {cub} in the cubin "
                       f"but {man} in the manifest")
        r = v.resources[sym]
        got = (k.regcount or 0, k.frame_size or 0, k.static_smem)
        if (r.registers, r.stack_frame_bytes, r.static_smem) != got:
            out.append(f"{v.cubin}: kernel {sym} uses registers/stack/static smem {got} but the manifest "
                       f"says {(r.registers, r.stack_frame_bytes, r.static_smem)}")
    if len(program.arg_types) != len(v.host_args):
        out.append(f"{v.host_program.file}: the host function takes {len(program.arg_types)} arguments, "
                   f"the manifest lists {len(v.host_args)}")
        return out, None
    if out:
        return out, None
    sizes = {s: [p.size for p in v.params[s]] for s in v.kernel_symbols}
    args = spec.sample_args(v.requirements)
    try:
        rec = program.launch(args, sizes)
    except HostVMError as e:
        return [f"{v.host_program.file}: a sample launch of the host program failed: {e}"], None
    if rec.kernel not in v.kernel_symbols:
        out.append(f"{v.host_program.file}: launches kernel {rec.kernel!r}, not one of {list(v.kernel_symbols)}")
    if rec.smem != v.smem_bytes:
        out.append(f"smem_bytes is {v.smem_bytes} but the host program requests {rec.smem} bytes of "
                   f"dynamic shared memory")
    recipe = None
    if not out and v.launch_recipe is not None:   # the stored recipe must reproduce this same sample launch
        from .launch_recipe import LaunchRecipe
        try:
            recipe = LaunchRecipe.from_dict(v.launch_recipe, source=f"{v.name}.launch_recipe")
        except ValueError as e:
            return out + [f"malformed launch recipe: {e}"], None
        bound = recipe.bind([args[i] for i in recipe.scalar_args])
        if bound is None:
            out.append("its launch recipe does not cover a sample problem of its own requirements")
        elif bound.record([args[i] for i in recipe.ptr_args]) != rec:
            out.append("its launch recipe does not reproduce the host program's launch for a sample problem")
    return out, recipe


def read_tuning(manifest: Manifest, directory: str | os.PathLike, tuning=True) -> TuningTable | None:
    """The verified tuning table: ``tuning`` True reads ``<directory>/tuning.json`` when present, False/None
    reads none, a path reads that file (which must exist). Raises TuningTableError."""
    if not tuning:
        return None
    path = Path(directory) / TABLE_NAME if tuning is True else Path(tuning)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if tuning is True:
            return None
        raise TuningTableError(f"{path}: no tuning table there") from None
    except OSError as e:
        raise TuningTableError(f"{path}: cannot read the tuning table: {e.strerror}") from None
    return parse_table(raw, manifest, str(path))


def open_artifacts(directory: str | os.PathLike, tuning=True) -> Artifacts:
    """Read, hash and cross-check everything in `directory` (and its tuning table: see `read_tuning`); no
    CUDA call. Raises ArtifactError."""
    d = Path(directory)
    manifest = read_manifest(d)
    files = read_artifacts(manifest, d)
    problems: list[str] = []
    out: dict[str, VerifiedVariant] = {}
    for v in manifest.variants:
        where = f"{d / 'manifest.json'}: variant {v.name}"
        try:
            doc = json.loads(files[v.host_program.file])
            program = HostProgram.from_dict(doc)
        except (ValueError, HostVMError) as e:
            problems.append(f"{d / v.host_program.file}: corrupt host program of variant {v.name}: "
                            f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
            continue
        errs, recipe = _fact_problems(v, files[v.cubin], program)
        problems += [f"{where}: {e}" for e in errs]
        out[v.name] = VerifiedVariant(v, files[v.cubin], program, recipe)
    if problems:
        head = "artifacts failed the cross-check" if len(problems) == 1 else \
            f"{len(problems)} problems found cross-checking the artifacts"
        raise ArtifactMismatch(f"{head}: " + "; ".join(problems[:6])
                               + (f"; ... and {len(problems) - 6} more" if len(problems) > 6 else "")
                               + " (rebuild the artifacts; never edit them by hand)")
    return Artifacts(str(d), manifest, out, read_tuning(manifest, d, tuning))


__all__ = ["open_artifacts", "read_tuning", "Artifacts", "VerifiedVariant", "ArtifactMismatch", "ManifestError"]

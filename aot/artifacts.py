"""Writing an artifact directory safely.

Guarantees
----------
* Every file is written atomically: a temp file in the same directory,
  fsync, `os.replace`, then an fsync of the directory.  A reader never sees
  a partial file under a final name.
* The manifest is written last.  An interrupted or failed build therefore
  never leaves a manifest pointing at missing or partial files.
* A build owns what it writes, and nothing else.  ``.svdq-aot-build.json``
  (the *build record*) lists every file a build wrote into the directory;
  a rebuild removes only files the previous record lists that the new build
  no longer writes, after the new manifest is in place.  Any other file (a
  README, another project's ``*.cubin``) is never touched.  A directory with
  no record (nor an svdq-aot manifest from an older build) that is not empty
  is *foreign*: opening it raises `ForeignDirectory` unless ``force=True``.
  The record is written before the first artifact file (listing old and new
  names), so an interrupted build never leaves a file of ours unlisted.
* Rebuilding into a directory that already holds a build: the old manifest
  stays valid until the new one atomically replaces it.  New files that
  would overwrite a file the old manifest references *with different
  bytes* cause the old manifest to be removed first (so it can never point
  at a file whose hash no longer matches); identical files are left as they
  are.  A tuning table (``tuning.json``) measured for another manifest is
  removed once the new manifest is in place: the loader would refuse it,
  and its numbers describe other kernels.
* One build at a time per directory: an advisory lock (``flock``) on
  ``<dir>/.svdq-aot.lock``, taken when the `ArtifactDir` is entered, which a
  build does *before* compiling anything.  A second build into the same
  directory fails at once with `BuildLocked`.  The lock is released by the
  kernel when the process exits, even if it is killed; the (empty apart from
  a pid) lock file itself is left in place on purpose.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

from svdq_loader.manifest import MANIFEST_NAME, Manifest, body_checksum
from svdq_loader.tuning_table import TABLE_NAME

LOCK_NAME = ".svdq-aot.lock"
#: The build record: which files of this directory a build wrote (and facts about that build).
RECORD_NAME = ".svdq-aot-build.json"
RECORD_FORMAT = 1
_TMP_PREFIX = ".svdq-tmp-"


class BuildLocked(RuntimeError):
    """Another build holds the directory's lock."""


class ForeignDirectory(RuntimeError):
    """The output directory holds files no svdq-aot build wrote (use --force to build into it anyway)."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either the old or the complete new content."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _referenced_by_manifest_on_disk(directory: Path) -> dict[str, str] | None:
    """{file: sha256} referenced by the manifest currently in `directory`; None if none/unreadable.

    Lenient on purpose (an older or damaged manifest must not block a rebuild).
    """
    try:
        data = json.loads((directory / MANIFEST_NAME).read_bytes())
        out = {}
        for v in data["variants"]:
            out[v["cubin"]] = v["sha256"]
            out[v["host_program"]["file"]] = v["host_program"]["sha256"]
        return out
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - unreadable manifest: treat as referencing everything
        return {}


def read_record(directory: str | os.PathLike) -> dict | None:
    """The build record of `directory` (None if there is none or it is unreadable)."""
    try:
        doc = json.loads((Path(directory) / RECORD_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("owned"), list):
        return None
    return doc


def _svdq_manifest_files(directory: Path) -> set[str] | None:
    """Files an svdq-aot manifest in `directory` references (plus itself); None if there is none."""
    try:
        data = json.loads((directory / MANIFEST_NAME).read_bytes())
        if data["generator"]["package"] != "svdq-aot":
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    refs = _referenced_by_manifest_on_disk(directory) or {}
    return {MANIFEST_NAME, *refs}


def owned_files(directory: str | os.PathLike) -> tuple[set[str] | None, list[str]]:
    """(files an svdq-aot build owns in `directory` or None if it is foreign, the foreign entries).

    An empty or missing directory is owned with nothing in it.
    """
    d = Path(directory)
    if not d.is_dir():
        return set(), []
    names = sorted(p.name for p in d.iterdir() if p.name != LOCK_NAME and not p.name.startswith(_TMP_PREFIX))
    rec = read_record(d)
    if rec is not None:
        owned = {str(n) for n in rec["owned"]}
    else:
        owned = _svdq_manifest_files(d)
        if owned is None:
            if names:
                return None, names
            owned = set()
    return owned, [n for n in names if n not in owned and n != RECORD_NAME]


class ArtifactDir:
    """Exclusive writer for one artifact directory (use as a context manager).

    Entering takes the lock and checks ownership (`ForeignDirectory` unless
    ``force``); `commit` writes files, the manifest (last of the artifacts),
    the extra files (e.g. a report) and the build record.

    >>> with ArtifactDir(out) as ad:
    ...     ad.commit({"a.cubin": b"..."}, manifest)
    """

    def __init__(self, directory: str | os.PathLike, *, force: bool = False):
        self.dir = Path(directory)
        self.force = force
        self._created = False
        self._lock_fd: int | None = None
        self.previously_owned: set[str] = set()
        self.written: list[str] = []
        self.removed: list[str] = []
        self.old_manifest_removed = False

    # -- locking -------------------------------------------------------------
    def __enter__(self) -> "ArtifactDir":
        if self.dir.exists() and not self.dir.is_dir():
            raise NotADirectoryError(f"{self.dir}: exists and is not a directory")
        existed = self.dir.is_dir()
        self._created = not existed
        if existed and not self.force:   # before creating a lock file in someone else's folder
            owned, foreign = owned_files(self.dir)
            if owned is None:
                raise ForeignDirectory(_foreign_message(self.dir, foreign))
        self.dir.mkdir(parents=True, exist_ok=True)
        lock_path = self.dir / LOCK_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = ""
                try:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                except OSError:
                    pass
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise BuildLocked(
                        f"{self.dir}: another svdq-aot build is writing into this directory"
                        f"{f' (pid {holder})' if holder else ''}; wait for it or use another --out "
                        f"directory (lock: {lock_path})") from None
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        owned, _ = owned_files(self.dir)   # again, under the lock
        if owned is None and not self.force:
            self.__exit__(None, None, None)
            raise ForeignDirectory(_foreign_message(self.dir, owned_files(self.dir)[1]))
        self.previously_owned = owned or set()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                self._discard_unreferenced_writes()
        finally:
            if self._lock_fd is not None:
                try:
                    os.ftruncate(self._lock_fd, 0)
                except OSError:  # pragma: no cover
                    pass
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def _discard_unreferenced_writes(self) -> None:
        """After a failure: remove files this build wrote that no manifest on disk references.

        The record then lists what of ours is still there; a folder this build created and
        left empty is removed again.
        """
        keep = _referenced_by_manifest_on_disk(self.dir) or {}
        for name in self.written:
            if name not in keep and name != MANIFEST_NAME:
                try:
                    os.unlink(self.dir / name)
                except OSError:
                    pass
        for p in self.dir.glob(f"{_TMP_PREFIX}*"):
            try:
                os.unlink(p)
            except OSError:
                pass
        rec = read_record(self.dir)
        if rec is not None:
            still = {n for n in rec["owned"] if (self.dir / str(n)).exists()}
            try:
                if still:
                    self.write_record(still, dict(rec, complete=False))
                else:
                    os.unlink(self.dir / RECORD_NAME)
            except OSError:
                pass
        if self._created and {p.name for p in self.dir.iterdir()} <= {LOCK_NAME}:
            try:
                os.unlink(self.dir / LOCK_NAME)
                self.dir.rmdir()
            except OSError:
                pass

    # -- writing -------------------------------------------------------------
    def write_record(self, owned: Iterable[str], record: dict) -> None:
        doc = dict(record, format=RECORD_FORMAT, owned=sorted(set(owned)))
        atomic_write_bytes(self.dir / RECORD_NAME, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

    def commit(self, files: dict[str, bytes], manifest: Manifest, *, extra: dict[str, bytes] | None = None,
               record: dict | None = None, manifest_text: str | None = None) -> None:
        """Write `files`, the manifest, `extra` files and the record; then remove what we no longer write."""
        if self._lock_fd is None:
            raise RuntimeError("ArtifactDir.commit outside its `with` block")
        extra = dict(extra or {})
        record = dict(record or {})
        referenced = {n for n, _, _ in manifest.files()}
        missing = referenced - set(files)
        if missing:
            raise ValueError(f"manifest references files not being written: {sorted(missing)}")
        hashes = {n: sha256_bytes(b) for n, b in files.items()}
        for n, sha, _ in manifest.files():
            if hashes[n] != sha:
                raise ValueError(f"{n}: manifest sha256 {sha} does not match the bytes being written "
                                 f"({hashes[n]})")
        new_owned = set(files) | set(extra) | {MANIFEST_NAME}

        # 0. Own every name before writing any: an interruption never leaves a file of ours unlisted.
        self.write_record(self.previously_owned | new_owned, dict(record, complete=False))

        # 1. Never let the previous manifest point at a file about to change.
        old = _referenced_by_manifest_on_disk(self.dir)
        if old is not None and (old == {} or any(n in old and old[n] != hashes[n] for n in files)):
            os.unlink(self.dir / MANIFEST_NAME)
            _fsync_dir(self.dir)
            self.old_manifest_removed = True

        # 2. The artifact files (identical existing files are kept as they are).
        for name in sorted(files):
            data = files[name]
            target = self.dir / name
            if target.is_file() and not target.is_symlink() and target.stat().st_size == len(data) \
                    and sha256_bytes(target.read_bytes()) == hashes[name]:
                continue
            atomic_write_bytes(target, data)
            self.written.append(name)

        # 3. The manifest, last of the artifacts; then the extras.
        atomic_write_bytes(self.dir / MANIFEST_NAME, (manifest_text or manifest.to_json()).encode())
        for name in sorted(extra):
            atomic_write_bytes(self.dir / name, extra[name])

        # 4. Files earlier builds wrote that this one does not, only now that the new manifest is in place;
        #    and a tuning table measured for other kernels.
        self.removed = self.remove_stale(new_owned)
        if self._drop_stale_tuning(body_checksum(manifest.body())):
            self.removed.append(TABLE_NAME)
        self.write_record(new_owned, dict(record, complete=True))

    def _drop_stale_tuning(self, checksum: str) -> bool:
        """Remove a tuning table measured for another manifest (or unreadable). True if one was removed."""
        path = self.dir / TABLE_NAME
        if not path.is_file():
            return False
        try:
            if json.loads(path.read_bytes()).get("manifest_checksum") == checksum:
                return False
        except Exception:  # noqa: BLE001 - an unreadable table is stale too
            pass
        os.unlink(path)
        _fsync_dir(self.dir)
        return True

    def remove_stale(self, keep: Iterable[str]) -> list[str]:
        """Remove files a previous build owned that are not in `keep` (and our leftover temp files)."""
        keep = set(keep)
        removed = []
        for name in sorted(self.previously_owned - keep - {RECORD_NAME, LOCK_NAME}):
            p = self.dir / name
            if "/" in name or name in (".", ".."):
                continue
            if p.is_file() or p.is_symlink():
                try:
                    os.unlink(p)
                    removed.append(name)
                except OSError:
                    pass
        for p in self.dir.glob(f"{_TMP_PREFIX}*"):
            try:
                os.unlink(p)
                removed.append(p.name)
            except OSError:
                pass
        if removed:
            _fsync_dir(self.dir)
        return removed

    def clean(self) -> list[str]:
        """Remove every file a build owns here and the record (the lock file goes last, when released)."""
        if self._lock_fd is None:
            raise RuntimeError("ArtifactDir.clean outside its `with` block")
        removed = self.remove_stale(set())
        self.previously_owned = set()
        try:
            os.unlink(self.dir / RECORD_NAME)
            removed.append(RECORD_NAME)
        except FileNotFoundError:
            pass
        return removed


def _foreign_message(d: Path, foreign: list[str]) -> str:
    shown = ", ".join(foreign[:5]) + (f", ... ({len(foreign)} entries)" if len(foreign) > 5 else "")
    return (f"{d}: the directory is not empty and no svdq-aot build wrote it (it holds {shown}); "
            f"choose an empty or new --out directory, or pass --force to build into it anyway "
            f"(svdq-aot then writes and later removes only its own files)")

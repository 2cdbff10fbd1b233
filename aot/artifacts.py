"""Writing an artifact directory safely.

Guarantees
----------
* Every file is written atomically: a temp file in the same directory,
  fsync, `os.replace`, then an fsync of the directory.  A reader never sees
  a partial file under a final name.
* The manifest is written last.  An interrupted or failed build therefore
  never leaves a manifest pointing at missing or partial files.
* Rebuilding into a directory that already holds a build: the old manifest
  stays valid until the new one atomically replaces it.  New files that
  would overwrite a file the old manifest references *with different
  bytes* cause the old manifest to be removed first (so it can never point
  at a file whose hash no longer matches); identical files are left as they
  are.  Files from the previous build that the new manifest does not
  reference (``*.cubin``, ``*.host.json``, leftover temp files) are removed
  only after the new manifest is in place.  So is a tuning table
  (``tuning.json``) measured for another manifest: the loader would refuse
  it, and its numbers describe other kernels.  Other files (a README, ...)
  are never touched.
* One build at a time per directory: an advisory lock (``flock``) on
  ``<dir>/.svdq-aot.lock``, held for the whole write.  A second build into
  the same directory fails at once with `BuildLocked`.  The lock is
  released by the kernel when the process exits, even if it is killed; the
  (empty apart from a pid) lock file itself is left in place on purpose.
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
#: Suffixes of files this tool owns in an artifact directory (stale ones are removed).
OWNED_SUFFIXES = (".cubin", ".host.json")
_TMP_PREFIX = ".svdq-tmp-"


class BuildLocked(RuntimeError):
    """Another build holds the directory's lock."""


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


class ArtifactDir:
    """Exclusive writer for one artifact directory (use as a context manager).

    >>> with ArtifactDir(out) as ad:
    ...     ad.commit({"a.cubin": b"..."}, manifest)
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self._lock_fd: int | None = None
        self.written: list[str] = []
        self.removed: list[str] = []
        self.old_manifest_removed = False

    # -- locking -------------------------------------------------------------
    def __enter__(self) -> "ArtifactDir":
        if self.dir.exists() and not self.dir.is_dir():
            raise NotADirectoryError(f"{self.dir}: exists and is not a directory")
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
        """After a failure: remove files this build wrote that no manifest on disk references."""
        keep = _referenced_by_manifest_on_disk(self.dir) or {}
        for name in self.written:
            if name not in keep:
                try:
                    os.unlink(self.dir / name)
                except OSError:
                    pass
        for p in self.dir.glob(f"{_TMP_PREFIX}*"):
            try:
                os.unlink(p)
            except OSError:
                pass

    # -- writing -------------------------------------------------------------
    def commit(self, files: dict[str, bytes], manifest: Manifest) -> None:
        """Write `files`, then the manifest (last), then remove stale owned files."""
        if self._lock_fd is None:
            raise RuntimeError("ArtifactDir.commit outside its `with` block")
        referenced = {n for n, _, _ in manifest.files()}
        missing = referenced - set(files)
        if missing:
            raise ValueError(f"manifest references files not being written: {sorted(missing)}")
        hashes = {n: sha256_bytes(b) for n, b in files.items()}
        for n, sha, _ in manifest.files():
            if hashes[n] != sha:
                raise ValueError(f"{n}: manifest sha256 {sha} does not match the bytes being written "
                                 f"({hashes[n]})")

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

        # 3. The manifest, last.
        atomic_write_bytes(self.dir / MANIFEST_NAME, manifest.to_json().encode())

        # 4. Stale files from earlier builds, only now that the new manifest is in place.
        self.removed = self.remove_stale(referenced)
        if self._drop_stale_tuning(body_checksum(manifest.body())):
            self.removed.append(TABLE_NAME)

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

    def remove_stale(self, referenced: Iterable[str]) -> list[str]:
        referenced = set(referenced)
        removed = []
        for p in sorted(self.dir.iterdir()):
            name = p.name
            owned = name.endswith(OWNED_SUFFIXES) or name.startswith(_TMP_PREFIX)
            if owned and name not in referenced and (p.is_file() or p.is_symlink()):
                try:
                    os.unlink(p)
                    removed.append(name)
                except OSError:
                    pass
        if removed:
            _fsync_dir(self.dir)
        return removed

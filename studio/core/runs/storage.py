"""What the run directory's writes promise: private modes, and a full disk said in one line.

A run directory holds prompts, answers and data excerpts (events.jsonl, config.yaml, worker.log,
checkpoints, the adapter, eval.json and eval.csv), so it is private to its owner: folders 0700,
files 0600. The worker runs with :data:`PRIVATE_UMASK`; :func:`make_private` tightens a run folder
made by an older Studio (or copied in with looser modes).

A full disk (or quota) is not a crash: whatever was being written is cut back or removed, and the
person reads one line naming the path and what to do (:class:`DiskFull`). Plain Python, no torch.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
"""The worker's umask: what it creates is readable by its owner only."""

DIR_MODE = 0o700
FILE_MODE = 0o600

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How libraries that drop the errno word it: safetensors (Rust's StorageFull), torch.save's writer.
_NO_SPACE_WORDS = ("no space left", "storagefull", "quota exceeded", "disk quota")
_GENERIC_WRITE_WORDS = ("file write failed", "failed writing")
LOW_SPACE_BYTES = 1 << 20
"""Free space under which a write failure that names no cause is taken for a full disk."""


class DiskFull(OSError):
    """A write failed for want of space; ``str()`` is the one line a person reads."""

    def __init__(self, path: str | Path, run_id: str | None = None):
        self.path = Path(path)
        self.run_id = run_id
        super().__init__(errno.ENOSPC, disk_full_message(path, run_id))

    def __str__(self) -> str:
        return disk_full_message(self.path, self.run_id)


def disk_full_message(path: str | Path, run_id: str | None = None) -> str:
    """``disk full at <path>: free space and run `studio train --resume RUN` `` (with the run's id;
    without a run, one that was never made, it says to run the command again)."""
    then = f"`studio train --resume {run_id}`" if run_id else "the command again"
    return f"disk full at {path}: free space and run {then}"


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (its nearest existing
    parent's), or None when that cannot be told."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def is_disk_full(exc: BaseException, path: str | Path | None = None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a write that ran out of space.

    An OSError carries ENOSPC or EDQUOT; some libraries only word it; torch's writer says no more
    than "file write failed", which counts when ``path``'s filesystem is (nearly) full now.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DiskFull):
            return True
        if isinstance(current, OSError) and current.errno in _NO_SPACE_ERRNOS:
            return True
        text = str(current).lower()
        if any(word in text for word in _NO_SPACE_WORDS):
            return True
        if path is not None and any(word in text for word in _GENERIC_WRITE_WORDS):
            free = free_bytes(path)
            if free is not None and free < LOW_SPACE_BYTES:
                return True
        current = current.__cause__ or current.__context__
    return False


def make_private(folder: str | Path) -> int:
    """Tighten ``folder`` and everything in it to 0700 (folders) and 0600 (files) where they are
    looser; returns how many modes changed. Symlinks and sockets are left alone (os.walk does not
    follow a linked folder, and a link's target is not the run's)."""
    changed = 0
    root = Path(folder)
    for current, _dirs, files in os.walk(root):
        here = Path(current)
        for path, mode in [(here, DIR_MODE)] + [(here / name, FILE_MODE) for name in files]:
            try:
                info = path.lstat()
            except OSError:
                continue
            if stat.S_ISLNK(info.st_mode) or stat.S_ISSOCK(info.st_mode):
                continue
            if stat.S_IMODE(info.st_mode) & ~mode & 0o777:
                try:
                    os.chmod(path, stat.S_IMODE(info.st_mode) & mode)
                    changed += 1
                except OSError:
                    pass
    return changed


def sync_tree(folder: str | Path) -> None:
    """fsync every file under ``folder`` and the folders themselves, so that a rename that follows
    publishes data that is on the disk: after a power cut, a checkpoint that is there is whole."""
    for current, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(Path(current) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_dir(current)


def sync_dir(folder: str | Path) -> None:
    """fsync a folder: its entries (a rename into it) survive a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_folder(tmp: str | Path, final: str | Path) -> Path:
    """Put the finished folder ``tmp`` (written and synced: :func:`sync_tree`) in ``final``'s place.

    Without a ``final``, one rename publishes ``tmp``. With one (an adapter saved again, a step
    checkpointed twice), the old folder is first renamed aside to ``.old-<name>`` and removed once
    ``tmp`` is in place, so a crash in between leaves one whole folder, never a mixed one. The parent
    is synced last: the rename survives a power cut. Returns ``final``."""
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    sync_dir(final.parent)
    return final

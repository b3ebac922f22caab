"""Checkpoint folders: written atomically, verified on load, named by content.

A checkpoint is a folder of files plus ``manifest.json``, written last, that lists
every file with its size and sha256. The folder is assembled under a temporary
name and renamed into place, so a reader sees either nothing or a complete
checkpoint; a truncated or edited file is caught by the manifest on load.
The adapter files follow peft's layout, so ``PeftModel.from_pretrained`` reads them too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "mintflow-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete or corrupted."""


class DiskFullError(OSError):
    """A checkpoint (or artifact) that did not fit on its disk; nothing of it was left behind."""


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it chains) is "no space left on device" or "disk quota exceeded".

    Libraries that write files in native code report it in their own types (safetensors: a
    ``SafetensorError`` whose message carries "os error 28"), so the message counts too.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "Disk quota exceeded" in text or f"os error {errno.ENOSPC})" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(what: str, folder: Path) -> DiskFullError:
    """A DiskFullError naming what could not be written, where, and how much room is left."""
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(errno.ENOSPC, f"{what}: the disk is full (no space left on device in {folder}, {free}); "
                                       "nothing was written and what was there before is unchanged. Free some "
                                       "space and run again")


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's content, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def failpoint(name: str) -> None:
    """Die here, as a crash would (SIGKILL), when ``$MINTFLOW_FAULT`` names this point.

    The fault-injection tests set it; nothing else does. Points are named where they are placed:
    ``stage:<task>`` before each flow stage, ``<task>:<moment>`` inside the tasks,
    ``checkpoint:before_rename`` here, ``flow:iteration_logged`` and ``tracking:checkpoint_uploaded``
    (the list in order is ``CRASHES`` in tests/test_flow.py).
    """
    if os.environ.get("MINTFLOW_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def write_checkpoint(path: str | Path, write_files: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Write a checkpoint folder at ``path`` atomically; an existing one is replaced whole."""
    path = Path(path).expanduser().absolute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    except OSError as e:
        if disk_full(e):
            raise disk_full_error(f"checkpoint {str(path)!r}", path.parent) from e
        raise
    try:
        write_files(tmp)
        files = {}
        for file in sorted(tmp.iterdir()):
            with open(file, "rb+") as f:
                os.fsync(f.fileno())
            files[file.name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
        manifest = {"format": FORMAT, **meta, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        with open(tmp / MANIFEST, "rb+") as f:
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        failpoint("checkpoint:before_rename")
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            path.rename(old / "ckpt")
            try:
                tmp.rename(path)
            except BaseException:  # put the previous checkpoint back where it was
                (old / "ckpt").rename(path)
                old.rmdir()
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
        _fsync_dir(path.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            raise disk_full_error(f"checkpoint {str(path)!r}", path.parent) from e
        raise
    return path


def read_manifest(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; raises CheckpointError naming what is wrong."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist (expected a folder from save_state)")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {MANIFEST}: it was never completed")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupted ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: unknown format {manifest.get('format')!r}")
    if verify:
        for name, expected in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint {str(path)!r}: file {name} is missing")
            size = file.stat().st_size
            if size != expected["bytes"]:
                raise CheckpointError(
                    f"checkpoint {str(path)!r}: file {name} is truncated or changed "
                    f"({size} bytes, manifest says {expected['bytes']})")
            if sha256_file(file) != expected["sha256"]:
                raise CheckpointError(f"checkpoint {str(path)!r}: file {name} does not match its sha256")
    return manifest


def checkpoint_digest(path: str | Path) -> str:
    """A content hash of a checkpoint (the hash of its manifest's file list), for cache keys."""
    manifest = read_manifest(path, verify=False)
    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()

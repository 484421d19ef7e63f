"""Checkpoint manifests: what a checkpoint folder must contain, with checksums, and the
durable-write helpers (write to a temporary name, fsync, rename, fsync the folder).

manifest.json = {"format": "subnet_ext.checkpoint/1", "step": ..., "files": {relative
path: {"bytes": n, "sha256": hex}}, ...caller's fields..., "checksum": sha256 of the
rest}. The manifest's own checksum catches a manifest that is corrupt yet still parses.
"""
from __future__ import annotations

import hashlib
import json
import os

FORMAT = "subnet_ext.checkpoint/1"
MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class CorruptCheckpoint(ValueError):
    """A checkpoint folder is incomplete, truncated or corrupt; the message says which file and how."""


def fsync_dir(path: str) -> None:
    """fsync the directory `path`, so the entries just created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes | None = None, write=None) -> None:
    """Write `data` (or call write(file)) to a temporary name, fsync, rename over `path`,
    fsync the folder: readers see the old file or the whole new one, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if write is not None:
                write(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def file_digest(path: str) -> dict:
    """{"bytes": size, "sha256": hex digest} of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def list_files(folder: str) -> list[str]:
    """Relative paths of every file under folder except the manifest, sorted."""
    out = []
    for root, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _body_checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(folder: str, body: dict) -> None:
    """Writes manifest.json (atomically) with `body` plus its format and checksum."""
    body = {"format": FORMAT, **body}
    text = json.dumps({**body, "checksum": _body_checksum(body)}, indent=1, sort_keys=True)
    atomic_write(os.path.join(folder, MANIFEST), text.encode())


def read_manifest(folder: str) -> dict:
    """The manifest's body (without its checksum). Raises CorruptCheckpoint."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CorruptCheckpoint(f"{path}: missing (the save did not finish, or this is not a checkpoint folder)")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"{path}: not valid JSON ({e}); truncated or corrupt") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{path}: not a {FORMAT} manifest (format {data.get('format')!r})"
                                if isinstance(data, dict) else f"{path}: not a manifest (a {type(data).__name__})")
    checksum = data.pop("checksum", None)
    if checksum != _body_checksum(data):
        raise CorruptCheckpoint(f"{path}: its checksum does not match its content; the manifest is corrupt")
    if not isinstance(data.get("files"), dict) or not isinstance(data.get("step"), int):
        raise CorruptCheckpoint(f"{path}: lacks 'files' or 'step'")
    return data


def check_files(folder: str, files: dict, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems (one line each, naming the file) among `files` (manifest entries); only
    every share[1]-th file starting at share[0] is read, so ranks can split the work."""
    problems = []
    for i, (rel, expected) in enumerate(sorted(files.items())):
        if i % share[1] != share[0]:
            continue
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
            continue
        size = os.path.getsize(path)
        if size != expected.get("bytes"):
            what = "truncated" if size < expected.get("bytes", 0) else "has extra bytes"
            problems.append(f"{path}: {size} bytes, the manifest says {expected.get('bytes')} ({what})")
            continue
        actual = file_digest(path)["sha256"]
        if actual != expected.get("sha256"):
            problems.append(f"{path}: sha256 {actual[:12]}... but the manifest says "
                            f"{str(expected.get('sha256'))[:12]}... (corrupt)")
    return problems

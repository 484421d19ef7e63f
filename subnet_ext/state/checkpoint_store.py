"""Sharded, verified, atomic checkpoints on top of torch.distributed.checkpoint (DCP).

DCP writes each rank's tensors in parallel (one file per rank plus `.metadata`) and
reads any subset of keys back on any number of ranks. What it lacks, added here:

- atomic commit: everything goes to `save_dir/.incomplete-step-N/`; only when every
  rank finished, rank 0 writes the manifest, fsyncs and renames the folder to
  `step-N/`, then moves `LATEST`. A crash at any point leaves the previous checkpoint
  untouched and selectable;
- checksums: the manifest lists every file's size and SHA-256 (the ranks hash their
  share of the files in parallel), and its own checksum; loading re-checks them;
- fallback: `find_checkpoint` walks from `LATEST` to older checkpoints, warning about
  each bad one (which file, what is wrong), and fails with every reason if none is good;
- retention: the newest `keep_last` checkpoints are kept.

Every function taking `group` is collective over it (None: the default group, or a
single process when torch.distributed is not initialised). All ranks must see the same
`save_dir` (a shared file system), as DCP itself requires for loading.

The manifest says what a checkpoint folder must contain, with checksums; beside it are the
durable-write helpers (write to a temporary name, fsync, rename, fsync the folder).

manifest.json = {"format": "subnet_ext.checkpoint/1", "step": ..., "files": {relative
path: {"bytes": n, "sha256": hex}}, ...caller's fields..., "checksum": sha256 of the
rest}. The manifest's own checksum catches a manifest that is corrupt yet still parses.

Parts:
- the manifest and durable writes: CorruptCheckpoint, fsync_dir, atomic_write, file_digest,
  list_files, write_manifest, read_manifest, check_files;
- the checkpoints: CheckpointError, CheckpointWriteError, step_dir, save_checkpoint,
  list_checkpoints, prune, verify_checkpoint, find_checkpoint, state_metadata, read_state;
- a RankLayout's tensors and optimizer state: save_layout_checkpoint, load_layout_checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings

import torch.distributed as dist

from .layout import RankLayout

# ---- manifests: what a checkpoint folder must contain, with checksums, and durable writes
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


LATEST = "LATEST"
STATE = "state"  # the DCP folder inside a checkpoint
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit this run; the message says why."""


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank (disk full, I/O error); the previous checkpoints are intact."""


def step_dir(step: int) -> str:
    """Folder name of the checkpoint at `step`: 'step-000120'."""
    return f"step-{step:06d}"


# ----------------------------------------------------------------------------- collectives
def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _gather(obj, group) -> list:
    if _size(group) == 1:
        return [obj]
    out = [None] * _size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _from_first(obj, group):
    """Rank 0's `obj` on every rank of `group`."""
    if _size(group) == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _errors(error: str | None, group) -> list[str]:
    """Every rank's error (None when fine), so all ranks take the same branch afterwards."""
    return [f"rank {r}: {e}" for r, e in enumerate(_gather(error, group)) if e]


def _attempt(fn) -> str | None:
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- save
def save_checkpoint(save_dir: str, step: int, state: dict, manifest: dict, *, group=None, keep_last: int = 3,
                    extra_files: dict | None = None, per_rank=None) -> str:
    """Write a checkpoint of `step`; returns its folder. Collective.

    Args:
        state: this rank's tensors for DCP ({key: tensor}, or nested dicts such as
            torch.distributed.checkpoint.state_dict's); a key saved by several ranks is
            written once.
        manifest: JSON-able fields for manifest.json (rank 0's are used).
        extra_files: {relative path: write(file)} written by rank 0 (e.g. a consolidated
            model); pass it on every rank (or on none), the others' writers are not called.
        per_rank: a JSON-able object from each rank, stored as manifest["ranks"][rank].
        keep_last: keep the newest N complete checkpoints (>= 1).
    Raises:
        CheckpointWriteError on every rank when any rank failed; nothing is left half-written.
    """
    import torch.distributed.checkpoint as dcp

    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    rank = _rank(group)
    final = os.path.join(save_dir, step_dir(step))
    tmp = os.path.join(save_dir, "." + "incomplete-" + step_dir(step))

    def prepare():
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by a crashed attempt at this step
        os.makedirs(os.path.join(tmp, STATE))

    errors = _errors(_attempt(prepare) if rank == 0 else None, group)
    if not errors:
        # DCP reports a failure on any rank to every rank, so this stays collective.
        errors = _errors(_attempt(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(
            os.path.join(tmp, STATE), sync_files=True), process_group=group)), group)
    if not errors and extra_files:
        def write_extra():
            for rel, write in extra_files.items():
                atomic_write(os.path.join(tmp, rel), write=write)
        errors = _errors(_attempt(write_extra) if rank == 0 else None, group)
    digests, ranks = {}, _gather(per_rank, group)
    if not errors:
        def digest_share():
            files = list_files(tmp)
            digests.update({f: file_digest(os.path.join(tmp, f)) for f in files[rank::_size(group)]})
        error = _attempt(digest_share)
        shares = _gather((error, digests), group)
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(shares) if e]
        for _, d in shares:
            digests.update(d)
    if not errors and rank == 0:
        body = {**manifest, "step": step, "files": digests, "ranks": ranks}
        error = _attempt(lambda: _commit(save_dir, tmp, final, body, keep_last, step))
        errors = [f"rank 0: {error}"] if error else []
    errors = _from_first(errors, group)  # the same on every rank until rank 0's commit
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"checkpoint of step {step} in {save_dir!r} was not written (the previous "
                                   f"checkpoints are intact): " + "; ".join(errors))
    return final


def _commit(save_dir: str, tmp: str, final: str, body: dict, keep_last: int, step: int) -> None:
    write_manifest(tmp, body)
    for root, _, _ in os.walk(tmp):
        fsync_dir(root)
    aside = None
    if os.path.exists(final):  # saving a step again (e.g. after resuming from it)
        aside = os.path.join(save_dir, ".replaced-" + os.path.basename(final))
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    atomic_write(os.path.join(save_dir, LATEST), os.path.basename(final).encode())
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    prune(save_dir, keep_last, current=step)


def list_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """[(step, folder)] of the complete-looking checkpoints (step-N folders), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for name in os.listdir(save_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            out.append((int(m.group(1)), os.path.join(save_dir, name)))
    return sorted(out)


def prune(save_dir: str, keep_last: int, current: int | None = None) -> None:
    """Remove all but the newest `keep_last` checkpoints, leftovers of crashed saves, and —
    when `current` is given — checkpoints newer than it: they belong to a timeline this
    run abandoned by resuming from an older checkpoint."""
    found = list_checkpoints(save_dir)
    if current is not None:
        for s, folder in found:
            if s > current:
                shutil.rmtree(folder, ignore_errors=True)
        found = [(s, f) for s, f in found if s <= current]
    for _, folder in found[:-keep_last]:
        shutil.rmtree(folder, ignore_errors=True)
    for name in os.listdir(save_dir):
        if name.startswith((".incomplete-", ".replaced-")):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    fsync_dir(save_dir)


# ----------------------------------------------------------------------------- find and verify
def _candidates(save_dir: str) -> list[str]:
    """LATEST's target first, then older checkpoints, newest first (newer ones than LATEST
    are ignored: a save that renamed its folder but crashed before moving LATEST)."""
    found = list_checkpoints(save_dir)
    latest = os.path.join(save_dir, LATEST)
    target = None
    if os.path.isfile(latest):
        with open(latest, "rb") as f:
            m = _STEP_DIR.match(f.read(64).decode(errors="replace").strip())
        target = int(m.group(1)) if m else None
    if target is None or not any(s == target for s, _ in found):
        return [folder for _, folder in reversed(found)]
    return [folder for s, folder in reversed(found) if s <= target]


def verify_checkpoint(folder: str, group=None) -> dict:
    """The manifest of `folder` once every file's size and checksum matched it (the ranks
    of `group` split the files). Raises CorruptCheckpoint on every rank otherwise."""
    manifest = problem = None
    try:
        manifest = read_manifest(folder)
        problems = check_files(folder, manifest["files"], (_rank(group), _size(group)))
        problem = "; ".join(problems) or None
    except CorruptCheckpoint as e:
        problem = str(e)
    problems = [p for p in _gather(problem, group) if p]
    if problems:
        raise CorruptCheckpoint("; ".join(dict.fromkeys(problems)))
    return manifest


def find_checkpoint(path: str, group=None) -> tuple[str, dict, list[str]]:
    """(folder, manifest, skipped): the newest good checkpoint under a save folder, or the
    given checkpoint folder itself. `skipped` lists each bad newer checkpoint and why
    (also issued as warnings). Collective.

    Raises:
        CheckpointError: nothing to load, or no checkpoint passed its checks (every reason listed).
    """
    if os.path.isfile(os.path.join(path, MANIFEST)) or _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        candidates = [path]  # an explicit checkpoint: that one or an error, no fallback
    else:
        candidates = _from_first(_candidates(path), group)
        if not candidates:
            raise CheckpointError(f"no checkpoint in {path!r} (no step-N folder)")
    skipped = []
    for folder in candidates:
        try:
            return folder, verify_checkpoint(folder, group), skipped
        except CorruptCheckpoint as e:
            skipped.append(f"{folder}: {e}")
            if _rank(group) == 0:
                later = "trying an older one" if folder != candidates[-1] else "no older one left"
                warnings.warn(f"checkpoint {folder} is not usable: {e}; {later}", RuntimeWarning, stacklevel=2)
    raise CheckpointError("no good checkpoint: " + " | ".join(skipped))


def state_metadata(folder: str) -> dict:
    """{key: (shape, dtype)} of every tensor the checkpoint's DCP state holds."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(os.path.join(folder, STATE)).read_metadata()
    return {k: (tuple(m.size), m.properties.dtype) for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def read_state(folder: str, request: dict, group=None) -> None:
    """Fill `request` ({key: preallocated tensor}, possibly nested) from the checkpoint's DCP
    state. Collective over `group` (each rank its own request); a single process when
    torch.distributed is not initialised."""
    import torch.distributed.checkpoint as dcp

    single = not dist.is_initialized()
    with warnings.catch_warnings():
        if single:  # DCP warns that it assumes one process, which is what single means here
            warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        dcp.load(request, storage_reader=dcp.FileSystemReader(os.path.join(folder, STATE)), process_group=group,
                 no_dist=single)


# ----------------------------------------------------------------------------- SDP
def save_layout_checkpoint(save_dir: str, step: int, layout: RankLayout, optimizer=None, manifest: dict | None = None,
                           *, group=None, keep_last: int = 3, extra_files: dict | None = None, per_rank=None) -> str:
    """Checkpoint this rank's pieces (and `optimizer`'s state of them) in full-model
    coordinates, each piece written once by its leader; returns the folder. Collective over
    `group` (the engine's). The manifest also holds the plan, so `load_layout_checkpoint`
    works on any plan of the same model (another world size, coverage, level or regime).
    `subnet_ext.checkpoint.save_subnet_checkpoint` calls it for a SubnetDataParallel."""
    from .optim_state import hyperparameters, sharded_state_dict

    tensors, info = sharded_state_dict(layout, optimizer, group)
    body = {**(manifest or {}), "plan": layout.plan.to_json(), "sdp": info,
            "optimizer": {"param_groups": hyperparameters(optimizer) if optimizer is not None else []}}
    return save_checkpoint(save_dir, step, tensors, body, group=group, keep_last=keep_last,
                           extra_files=extra_files, per_rank=per_rank)


def load_layout_checkpoint(path: str, layout: RankLayout, optimizer=None, *, group=None,
                           verified_manifest: dict | None = None) -> dict:
    """Load the newest good checkpoint under `path` (or the checkpoint folder `path`) into
    the tensors of `layout` and into `optimizer`, re-planned to the layout's plan; returns its
    manifest (with "folder"). Collective over `group`. `verified_manifest`: what
    find_checkpoint returned for the folder `path`, to skip checking its files a second time.

    Raises:
        CheckpointError: no good checkpoint. ValueError: a checkpoint of another model.
    """
    from .optim_state import load_hyperparameters, load_sharded_state_dict
    from ..planning.plan import SubnetPlan

    if verified_manifest is not None:
        folder, manifest = path, verified_manifest
    else:
        folder, manifest, _ = find_checkpoint(path, group)
    if "plan" not in manifest or "sdp" not in manifest:
        raise CheckpointError(f"{folder} is not a SubnetDataParallel checkpoint (no plan in its manifest; "
                              f"method {manifest.get('identity', {}).get('method')!r})")
    load_sharded_state_dict(layout, optimizer, SubnetPlan.from_json(manifest["plan"]), manifest["sdp"],
                            state_metadata(folder), lambda request: read_state(folder, request, group))
    if optimizer is not None:
        load_hyperparameters(optimizer, manifest["optimizer"]["param_groups"])
    return {**manifest, "folder": folder}

"""Checkpoints of a SubnetDataParallel: `subnet_ext.checkpoint`.

    from subnet_ext.checkpoint import save_subnet_checkpoint, load_subnet_checkpoint
    save_subnet_checkpoint(save_dir, step, sdp, optimizer)      # collective
    load_subnet_checkpoint(save_dir, sdp, optimizer)            # any plan of the same model

The engine's part is small: it checks that every rank makes the call at the same point
(its call ledger), puts FSDP2's shards back, and hands its rank layout and process group
to state/checkpoint_store.py, which writes and reads the pieces in full-model coordinates
(atomic, verified, sharded by torch.distributed.checkpoint). That module's public names
(find_checkpoint, verify_checkpoint, CheckpointError, ...) are re-exported here.
"""
from __future__ import annotations

from ..state.checkpoint_store import (LATEST, STATE, CheckpointError, CheckpointWriteError, find_checkpoint,  # noqa: F401
                                list_checkpoints, load_layout_checkpoint, prune, read_state, save_checkpoint,
                                save_layout_checkpoint, state_metadata, step_dir, verify_checkpoint)
from .data_parallel import SubnetDataParallel


def save_subnet_checkpoint(save_dir: str, step: int, sdp: SubnetDataParallel, optimizer=None,
                           manifest: dict | None = None, *, keep_last: int = 3, extra_files: dict | None = None,
                           per_rank=None) -> str:
    """Checkpoint a SubnetDataParallel (and its optimizer) in full-model coordinates, each
    piece written once by its leader; returns the folder. Collective over sdp's group.

    The manifest also holds the plan, so `load_subnet_checkpoint` works on any plan of the
    same model (another world size, coverage, level or regime). See
    state/checkpoint.save_checkpoint for `manifest`, `keep_last`, `extra_files`, `per_rank`."""
    with sdp.call_ledger.collective("save_subnet_checkpoint"):  # every rank, in the order of its collectives
        layout, group = sdp.state_access("save_subnet_checkpoint")
        return save_layout_checkpoint(save_dir, step, layout, optimizer, manifest, group=group, keep_last=keep_last,
                                      extra_files=extra_files, per_rank=per_rank)


def load_subnet_checkpoint(path: str, sdp: SubnetDataParallel, optimizer=None, *,
                           verified_manifest: dict | None = None) -> dict:
    """Load the newest good checkpoint under `path` (or the checkpoint folder `path`) into
    `sdp` and `optimizer`, re-planned to sdp's plan; returns its manifest (with "folder").
    Collective over sdp's group. `verified_manifest`: what find_checkpoint returned for
    the folder `path`, to skip checking its files a second time.

    Raises:
        CheckpointError: no good checkpoint. ValueError: a checkpoint of another model.
    """
    with sdp.call_ledger.collective("load_subnet_checkpoint"):
        layout, group = sdp.state_access("load_subnet_checkpoint")
        return load_layout_checkpoint(path, layout, optimizer, group=group, verified_manifest=verified_manifest)

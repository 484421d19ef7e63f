"""full_state_dict(rank0_only=True, cpu_offload=True) and the same options of
full_optimizer_state_dict: rank 0 alone gets the assembled state, equal to what every rank
gets by default, and the other ranks never hold more than one chunk of it.

The memory is measured here, independently of the code: a TorchDispatchMode sees every
tensor an op creates during the call, follows which storages are still referenced (by
those tensors or views of them) after each op, and reports the peak of their bytes,
charged to whoever asked for them (host_reads.subnet_ext_caller): the engine's own
allocations, bounded by one chunk, apart from torch's (torch.distributed's object
collectives pickle into byte tensors, which the gloo backend may still hold after the
wait when the machine is loaded), bounded far below the model so that no path through a
torch helper can hold the model either. The same count over the default call (every rank
gets the whole model) must see at least the whole model, so the bound on rank 1 is not
one any count would meet.
"""
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import subnet_ext as sx
from host_reads import subnet_ext_caller
from sdp_helpers import batch, make_model, value_error
from subnet_ext.state import full_gather
from subnet_ext.testing import run_distributed

CHUNK = 8 * 1024  # small chunks, so a chunk is far less than the model (about 90 KB)


class PeakNewBytes(TorchDispatchMode):
    """Peak bytes of storages created inside the mode and still referenced, {"engine": ...,
    "torch": ...} by who asked for them (subnet_ext's code, or torch's own).

    A storage is new when an op returns a tensor whose storage none of the op's inputs
    shares (a view or an in-place result shares its input's); it stays alive while any
    tensor seen on it (the first one or later views) is alive."""

    def __init__(self):
        super().__init__()
        self.storages = {}  # data_ptr -> (bytes, whose, [weak references to tensors on it])
        self.peak = {"engine": 0, "torch": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        out = func(*args, **kwargs)
        whose = None
        for t in pytree.tree_leaves(out):
            if not torch.is_tensor(t) or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            entry = self.storages.get(key)
            if entry is not None and self._alive(entry):
                entry[2].append(weakref.ref(t))
            elif key not in inputs:
                whose = whose or ("engine" if subnet_ext_caller(sys._getframe(1)) else "torch")
                self.storages[key] = (t.untyped_storage().nbytes(), whose, [weakref.ref(t)])
        for who in self.peak:
            held = sum(n for n, w, refs in self.storages.values() if w == who and self._alive((n, w, refs)))
            self.peak[who] = max(self.peak[who], held)
        return out

    @staticmethod
    def _alive(entry) -> bool:
        return any(r() is not None for r in entry[2])


def measured(fn):
    """(fn(), {"engine": peak bytes, "torch": peak bytes} of the tensors fn's call created)."""
    with PeakNewBytes() as counter:
        result = fn()
    return result, counter.peak


def _worker(rank, world):
    full_gather.CHUNK_BYTES = CHUNK
    torch.manual_seed(0)
    model = make_model(width=64)
    plan = sx.plan_subnetworks(model, world, 0.5, "neuron")  # pieces led by both ranks
    sdp = sx.SubnetDataParallel(model, plan, regime="forward")
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    x, y = batch(rank, 0)
    F.cross_entropy(sdp(x), y).backward()
    opt.step()
    out = {"model_bytes": sum(t.numel() * t.element_size() for t in make_model(width=64).state_dict().values()),
           "largest": max(t.numel() * t.element_size() for t in make_model(width=64).state_dict().values())}
    reference, out["default_peak"] = measured(sdp.full_state_dict)
    mine, out["rank0_peak"] = measured(lambda: sdp.full_state_dict(rank0_only=True, cpu_offload=True))
    out["keys"] = (sorted(mine), sorted(reference))
    out["equal"] = rank != 0 or all(torch.equal(mine[k], reference[k]) for k in reference)
    out["devices"] = sorted({str(t.device) for t in mine.values()})
    optim_reference, out["optim_default_peak"] = measured(lambda: sdp.full_optimizer_state_dict(opt))
    optim, out["optim_rank0_peak"] = measured(lambda: sdp.full_optimizer_state_dict(opt, rank0_only=True))
    out["optim_empty"] = optim == {}
    if rank == 0:
        out["optim_equal"] = optim["param_groups"] == optim_reference["param_groups"] and all(
            torch.equal(optim["state"][n][k], v) for n, entries in optim_reference["state"].items()
            for k, v in entries.items())
    out["optim_bytes"] = sum(v.numel() * v.element_size() for entries in optim_reference["state"].values()
                             for v in entries.values() if v.dim() > 0)
    everywhere = sdp.full_state_dict(cpu_offload=True)  # every rank, on the CPU
    out["offload_equal"] = all(torch.equal(everywhere[k], reference[k]) for k in reference)
    out["bad_option"] = value_error(lambda: sdp.full_state_dict(rank0_only="yes"))
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


def test_only_rank0_gets_the_state_and_it_equals_the_default(results):
    rank0, rank1 = results
    assert rank0["keys"][0] == rank0["keys"][1] and rank0["equal"]
    assert rank1["keys"][0] == [], rank1["keys"][0]
    assert rank0["devices"] == ["cpu"]
    assert rank0["optim_equal"] and not rank0["optim_empty"] and rank1["optim_empty"]
    assert all(r["offload_equal"] for r in results)


def test_other_ranks_hold_one_chunk_not_the_model(results):
    rank1 = results[1]
    bound = max(CHUNK, rank1["largest"])
    assert rank1["model_bytes"] >= 8 * bound, rank1  # the model spans many chunks
    # The count sees the default assembly hold the whole model on rank 1 ...
    assert rank1["default_peak"]["engine"] >= rank1["model_bytes"], rank1
    assert rank1["optim_default_peak"]["engine"] >= rank1["optim_bytes"], rank1
    # ... and rank0_only hold at most one chunk there (plus, for the optimizer, a 0-d copy
    # of a step count at a time), however loaded the machine ...
    assert rank1["rank0_peak"]["engine"] <= bound, rank1
    assert rank1["optim_rank0_peak"]["engine"] <= bound + 64, rank1
    # ... and torch's own buffers of those calls (pickled key lists) stay far below the model.
    for peak in ("rank0_peak", "optim_rank0_peak"):
        assert rank1[peak]["torch"] <= rank1["model_bytes"] // 8, rank1


def test_a_bad_option_is_refused(results):
    for res in results:
        assert "rank0_only must be True or False, got 'yes'" in res["bad_option"], res["bad_option"]

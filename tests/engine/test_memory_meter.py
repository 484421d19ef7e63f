"""StepMemoryMeter (subnet_ext/measure/step_memory.py), the study's one meter of per-rank peak memory.

Checked against three references:
- torch's own MemTracker (torch.distributed._tools.mem_tracker) on the same step: the peak
  totals agree within 5%, for a plain and a checkpointed model;
- a live-storage count written here (a TorchDispatchMode of its own, stacked on the same
  step): the ratios the study reports (DDP + checkpointing and SDP against DDP) agree within
  10%, at the full study's sizes, and so do the ratios of every committed study summary;
- synthetic steps whose peak this file knows: allocations and frees, FSDP2-style storage
  resizes, and a weight's view saved for backward (model state, never an activation).
"""
import glob
import json
import os
import sys
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

from subnet_ext.measure.step_memory import StepMemoryMeter, measure_step
from subnet_ext.testing import run_distributed
from gpu_marks import needs_cuda
from shakespeare_file import needs_tiny_shakespeare

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2 ** 20


class LiveStorage(TorchDispatchMode):
    """The reference count: every storage an op reads or returns is live from then (one first read as an
    input existed before the step: it counts from the start) until its weak reference dies; the peak is
    the largest total after an op."""

    def __init__(self, tensors=()):
        super().__init__()
        self.sizes, self.total, self.peak, self.refs = {}, 0, 0, []
        for t in tensors:
            self._add(t, from_start=True)

    def _add(self, t, from_start):
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.total += self.sizes[key]
        if from_start:
            self.peak += self.sizes[key]
        self.refs.append(weakref.ref(storage, lambda _, key=key: self._free(key)))

    def _free(self, key):
        self.total -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_iter((args, kwargs or {})):
            self._add(t, from_start=True)
        out = func(*args, **(kwargs or {}))
        for t in tree_iter(out):
            self._add(t, from_start=False)
        self.peak = max(self.peak, self.total)
        return out


def _gpt(seq_len=64, checkpoint=False):
    from subnet_ext.models.gpt import GPT, GPT_PRESETS

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["deep"])
    if checkpoint:
        from subnet_ext.jobs.training import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 128, (2, seq_len), generator=g) for _ in range(2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), (x, y)


def _step(model, optimizer, batch):
    x, y = batch
    logits = model(x)[0]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    optimizer.step()


def _steady(model, optimizer, batch, steps=2):
    for _ in range(steps):  # AdamW's state exists after the first step; later steps are alike
        _step(model, optimizer, batch)
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_peak_agrees_with_torch_memtracker(checkpoint):
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer, batch = _gpt(checkpoint=checkpoint)
    _steady(model, optimizer, batch)
    meter = StepMemoryMeter([model], [optimizer])
    with meter:
        _step(model, optimizer, batch)
    ours = meter.result()
    optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *batch)
    with tracker:
        _step(model, optimizer, batch)
    theirs = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    assert ours["total"] == pytest.approx(theirs, rel=0.05), (ours, theirs)
    assert ours["model_state"] + ours["activations"] + ours["transient"] == ours["total"]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert ours["model_state"] >= 3 * params  # parameters and AdamW's two moments at least, whatever the peak's moment


@needs_cuda
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_cuda_total_is_the_allocators_peak_and_agrees_with_memtracker(checkpoint):
    """On CUDA the meter's total is the allocator's peak over the step, measured here from the
    allocator's own counters around the same step, and it agrees with torch's MemTracker (the
    allocator also holds blocks a tensor count does not see: 10%)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer, batch = _gpt(checkpoint=checkpoint)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batch = tuple(t.cuda() for t in batch)
    _steady(model, optimizer, batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    meter = StepMemoryMeter([model], [optimizer])
    with meter:
        _step(model, optimizer, batch)
    torch.cuda.synchronize()
    ours = meter.result()
    assert ours["total"] == torch.cuda.max_memory_allocated()
    assert ours["model_state"] + ours["activations"] + ours["transient"] == ours["total"]
    optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *batch)
    with tracker:
        _step(model, optimizer, batch)
    theirs = sum(snap["Total"] for dev, snap in tracker.get_tracker_snapshot("peak").items()
                 if torch.device(dev).type == "cuda")
    assert ours["total"] == pytest.approx(theirs, rel=0.10), (ours, theirs)


def test_checkpointing_trades_activations_for_recomputation():
    results = {}
    for checkpoint in (False, True):
        model, optimizer, batch = _gpt(seq_len=128, checkpoint=checkpoint)
        _steady(model, optimizer, batch)
        _, results[checkpoint] = measure_step(lambda: _step(model, optimizer, batch), [model], [optimizer])
    plain, checkpointed = results[False], results[True]
    assert plain["activations"] > 4 * checkpointed["activations"]  # only each block's input is saved
    assert checkpointed["total"] < 0.6 * plain["total"]


def test_a_synthetic_step_allocations_frees_and_resizes():
    held = torch.zeros(1024)  # 4 KiB, existed before the step, touched by it
    gathered = torch.zeros(0)  # FSDP2's unsharded parameter: storage resized up, then freed
    meter = StepMemoryMeter()
    with meter:
        held.add_(1)
        a = torch.empty(256 * 1024)  # 1 MiB
        gathered.untyped_storage().resize_(2 * MIB)  # 2 MiB more: the peak, 3 MiB + 4 KiB
        gathered.untyped_storage().resize_(0)
        del a
        b = torch.empty(640 * 1024)  # 2.5 MiB after the frees: below the peak (not, were a still counted)
    r = meter.result()
    assert r["total"] == 3 * MIB + 4096, r
    assert r["transient"] == r["total"] and r["model_state"] == r["activations"] == 0
    del b


def test_a_saved_weight_is_model_state_not_an_activation():
    layer = nn.Linear(1024, 1024, bias=False)  # 4 MiB of weight; a matmul saves weight.t(), a view of it
    x = torch.randn(2, 1024, requires_grad=True)
    _, r = measure_step(lambda: layer(x).sum().backward(), modules=[layer])
    assert r["model_state"] >= 4 * MIB  # the weight (and its gradient at the peak)
    assert r["activations"] < 64 * 1024, r  # x and small saved tensors only: the weight's view is not counted


def test_result_before_a_step_is_refused():
    with pytest.raises(RuntimeError, match="no step measured"):
        StepMemoryMeter().result()


# --------------------------------------------------------------------------------------------------
# The study's ratios against the reference count, at the full study's sizes (one rank: DDP in a
# one-process group, SDP as a simulated rank of K = 4).

def _ratio_worker(rank, world, sizes_list, data):
    from subnet_ext.jobs.methods import DDPMethod, SDPMethod
    from subnet_ext.jobs.tasks import build_task
    from subnet_ext.jobs.training import apply_activation_checkpointing
    from subnet_ext.planning.plan import plan_subnetworks

    out = []
    for sizes in sizes_list:
        task = build_task(f"shakespeare:{data}", "gpt", sizes["preset"], sizes["batch_size"], sizes["seq_len"], 0)
        batch = task.batch(2, 0, 4)
        found = {}
        for name in ("ddp", "ddp-ac", "sdp-block-forward-c0.5", "sdp-neuron-forward-c0.5"):
            torch.manual_seed(0)
            model = task.make_model()
            if name == "ddp-ac":
                apply_activation_checkpointing(model)
            if name.startswith("ddp"):
                method = DDPMethod(model, torch.device("cpu"))
            else:
                level = name.split("-")[1]
                plan = plan_subnetworks(model, world_size=4, coverage=0.5, level=level, seed=0)
                method = SDPMethod(model, plan, "forward", 1, "none", simulate_rank=0)
            optimizer = torch.optim.AdamW(method.parameters(), lr=1e-3, fused=True)

            def step():
                logits = method(batch[0])[0]
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1)).backward()
                optimizer.step()

            for _ in range(2):
                step()
                optimizer.zero_grad(set_to_none=True)
            state = [t for p in method.module.parameters() for t in (p, p.grad) if t is not None]
            state += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            reference = LiveStorage([*state, *batch])
            meter = StepMemoryMeter([method.module], [optimizer])
            with meter, reference:  # the same step, seen by both
                step()
            found[name] = (meter.result()["total"], reference.peak)
        out.append(found)
    return out


def _profile_sizes(summary_path):
    from bench.study.runs import MAIN_TASK, PROFILES

    with open(summary_path) as f:
        summary = json.load(f)
    return summary, PROFILES[summary["profile"]]["tasks"][MAIN_TASK]


@needs_tiny_shakespeare
def test_study_ratios_agree_with_a_live_storage_count():
    from bench.study.runs import MAIN_TASK, PROFILES, data_path

    summaries = sorted(glob.glob(os.path.join(REPO, "docs", "study-cpu*", "summary.json")))
    sizes = [PROFILES["full"]["tasks"][MAIN_TASK]] + [_profile_sizes(p)[1] for p in summaries]
    found = run_distributed(_ratio_worker, 1, sizes, data_path(), timeout=600)[0]
    for name in ("ddp-ac", "sdp-block-forward-c0.5", "sdp-neuron-forward-c0.5"):
        meter = found[0][name][0] / found[0]["ddp"][0]
        reference = found[0][name][1] / found[0]["ddp"][1]
        assert meter == pytest.approx(reference, rel=0.10), (name, meter, reference)
    # Every committed summary: its measured ratios (four real ranks, the worst one) against this count.
    for path, counted in zip(summaries, found[1:]):
        summary, _ = _profile_sizes(path)
        runs = summary["tasks"][MAIN_TASK]["runs"]
        for name in ("ddp-ac", "sdp-block-forward-c0.5", "sdp-neuron-forward-c0.5"):
            reference = counted[name][1] / counted["ddp"][1]
            assert runs[name]["memory"] == pytest.approx(reference, rel=0.10), (path, name)

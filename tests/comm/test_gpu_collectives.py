"""The engine's collectives on real `Work` objects over CUDA tensors, against the CPU.

Two processes run `_worker`: five SDP scenarios (both regimes, block and neuron level, the
gradient averaging in several buckets, the backward regime's refresh, parameter averaging
with sync_every=2), four optimizer steps each, then the full state (an all-reduce, and a
reduce with rank0_only), the consistency check (an all-gather), AdamW's full state and an
evaluation (the ensemble's all-reduce and the losses' all-gather). The step's collectives
are recorded as they are issued: each must return a real `Work` on a tensor of the run's
device, as many as the engine counted.

On a GPU rank r trains on cuda:(r % GPUs): with one GPU both ranks share cuda:0 over gloo,
which stages CUDA tensors through pinned host memory (NCCL cannot put two ranks on one
device); with two GPUs the same runs on NCCL. Every rank's parameters, full state and
optimizer state are compared with the same worker run on the CPU over gloo.

On the CPU (CI) that CPU run is checked against one-process references (sdp_reference.py:
the backward regime's SGD, with and without local SGD) and for agreement among holders, so
the worker the GPU test relies on is exercised everywhere.

Why gloo can carry every collective the engine issues on CUDA tensors (torch 2.11-2.14,
ProcessGroupGloo): allreduce (SUM; MAX too), broadcast, reduce and allgather each have a
CUDA work that copies to pinned host memory on a side stream, runs on the host and copies
back; `wait()` blocks the host until the host-side collective ends (the group's timeout
bounds it) and then makes the caller's current stream wait for the copy back, so the
unpack that follows is ordered after it. The engine's small host-read tensors (flags,
hashes, step counts) go to the CPU on gloo and to the GPU on NCCL
(collectives.staging_device). reduce_scatter, which gloo lacks on CUDA, is only FSDP2's
(shard_shared), not tested here.
"""
import contextlib
import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import subnet_ext as sx
from gpu_marks import needs_cuda, needs_two_gpus
from sdp_helpers import batch, make_model
from sdp_reference import backward_regime_sgd
from subnet_ext.comm import collectives
from subnet_ext.planning.pieces import global_pieces
from subnet_ext.testing import run_distributed

WORLD, STEPS, LR = 2, 4, 0.1
# AdamW's update g / (sqrt(v) + eps) flips with the sign of a gradient within rounding of 0; an eps
# well above rounding keeps the GPU's and the CPU's updates within the tolerance everywhere.
ADAMW_LR, ADAMW_EPS = 1e-2, 1e-4
BUCKET_CAP_MB = 0.00025  # 262 bytes: the shared parameters alone fill 2-5 buckets
# The engine makes its groups (the world's too) with this timeout and the step's waits pass none:
# a stuck collective fails as a CollectiveError naming it, before run_distributed gives up.
TIMEOUT = 45.0
# GPU vs CPU in fp32: the GEMMs and reductions add in other orders (~1e-6 relative per op);
# four steps of the same trajectory stay far inside this (fp32 vs fp64 on the CPU: < 1e-6, at
# most 1/25 of it on every entry).
RTOL, ATOL = 1e-4, 1e-5

SCENARIOS = {  # name: (regime, level, coverage, sync_every, optimizer)
    "forward_block": ("forward", "block", 0.5, 1, "sgd"),
    "backward_neuron_adamw": ("backward", "neuron", 0.5, 1, "adamw"),  # buckets + refresh every step
    "backward_neuron_all_owned": ("backward", "neuron", 1.0, 1, "sgd"),  # the masked kernel writes into buckets
    "forward_neuron_local_sgd": ("forward", "neuron", 0.5, 2, "sgd"),  # parameter averaging
    "backward_block_local_sgd": ("backward", "block", 0.5, 2, "sgd"),  # parameter averaging + refresh
}


# --------------------------------------------------------------------------- the worker
@contextlib.contextmanager
def recording_step_collectives(calls: list):
    """Record every dist.all_reduce / dist.broadcast issued inside the block (the engine's step
    collectives: buckets, refresh, parameter averaging) as (op, tensor device type, returned a
    Work). Patched on torch.distributed itself, which the engine calls through."""
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

    def recorder(name):
        def call(tensor, *args, **kwargs):
            work = originals[name](tensor, *args, **kwargs)
            calls.append((name, tensor.device.type, isinstance(work, dist.Work)))
            return work
        return call

    for name in originals:
        setattr(dist, name, recorder(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _cpu(tree):
    """Tensors of a (nested) dict moved to the CPU."""
    if torch.is_tensor(tree):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


def _scenario(rank, world, device, regime, level, coverage, sync_every, optimizer) -> dict:
    model = make_model().to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # coverage 1/K: "ranks share no unit" is this plan's point
        plan = sx.plan_subnetworks(model, world, coverage, level)
    sdp = sx.SubnetDataParallel(model, plan, regime=regime, sync_every=sync_every, bucket_cap_mb=BUCKET_CAP_MB,
                                timeout=TIMEOUT)
    opt = torch.optim.AdamW(sdp.parameters(), lr=ADAMW_LR, eps=ADAMW_EPS) if optimizer == "adamw" else \
        torch.optim.SGD(sdp.parameters(), lr=LR)
    calls = []
    with recording_step_collectives(calls):
        for step in range(STEPS):
            x, y = batch(rank, step)
            F.cross_entropy(sdp(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
    stats = sdp.comm_stats()
    out = {"calls": calls, "device": str(device)}
    out.update((k, stats[k]) for k in ("steps", "bytes", "collectives", "by_quantity", "buckets",
                                       "buckets_issued_during_backward", "direct_gradient_runs"))
    out["local"] = _cpu(sdp.local_full_state_dict())
    out["full"] = _cpu(sdp.full_state_dict())
    out["rank0"] = _cpu(sdp.full_state_dict(rank0_only=True))
    sdp.verify_consistency()  # raises ConsistencyError on every rank when owners disagree
    if optimizer == "adamw":
        out["optimizer"] = _cpu(sdp.full_optimizer_state_dict(opt)["state"])
    x, y = batch(99, 0)
    evaluated = sdp.evaluate(x.to(device), modes=("ensemble", "full"), loss_fn=F.cross_entropy,
                             targets=(y.to(device),))
    out["evaluate"] = _cpu({"ensemble": evaluated["ensemble"], "full": evaluated["full"],
                            "subnetwork_losses": evaluated["loss"]["subnetworks"]})
    return out


def _worker(rank, world, device_type):
    """{scenario: its results} (see _scenario), serialised with torch.save: hundreds of tensors
    through the result queue would each hold a shared-memory file descriptor."""
    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    out = {name: _scenario(rank, world, device, *spec) for name, spec in SCENARIOS.items()}
    blob = io.BytesIO()
    torch.save(out, blob)
    return blob.getvalue()


def run_worker(device_type: str, backend: str = "gloo") -> list:
    """[per rank: {scenario: results}] of `_worker` in 2 processes."""
    blobs = run_distributed(_worker, WORLD, device_type, backend=backend, timeout=2 * TIMEOUT)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]


# --------------------------------------------------------------------------- checks
def mismatches(label: str, got: dict, want: dict, rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """One line per entry of `want` that `got` lacks, or holds with another shape or NaN
    pattern, or beyond rtol/atol: `label`, the entry, the largest |difference| and where."""
    lines = []
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            lines.append(f"{label}: {name} missing")
            continue
        if isinstance(w, dict):
            lines += mismatches(f"{label}, {name}", g, w, rtol, atol)
            continue
        g, w = torch.as_tensor(g), torch.as_tensor(w)
        if g.shape != w.shape:
            lines.append(f"{label}: {name} has shape {tuple(g.shape)}, expected {tuple(w.shape)}")
            continue
        g, w = g.double(), w.double()
        if not torch.equal(torch.isnan(g), torch.isnan(w)):
            lines.append(f"{label}: {name} is NaN (not held) at {int((torch.isnan(g) ^ torch.isnan(w)).sum())} "
                         "other element(s)")
            continue
        if not torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True).all():
            diff = (g - w).abs().nan_to_num(0.0)
            where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
            lines.append(f"{label}: {name} max |diff| {diff.max().item():.3e} at {where} "
                         f"(got {g[where].item():.6g}, expected {w[where].item():.6g}; rtol {rtol:g}, atol {atol:g})")
    return lines


def structural_problems(results: list, device_type: str) -> list[str]:
    """What is wrong with one run's own results, apart from values: step collectives on
    another device, without a Work, or not as many as counted; no communication at all; the
    full state not identical on both ranks or rank0_only's reduce not rank 0's full state."""
    lines = []
    for name in SCENARIOS:
        for rank, r in enumerate(results):
            s, where = r[name], f"{name}, rank {rank}"
            devices = {d for _, d, _ in s["calls"]}
            if s["collectives"] == 0 or s["bytes"] == 0:
                lines.append(f"{where}: no collective was counted")
            if len(s["calls"]) != s["collectives"] or devices != {device_type}:
                lines.append(f"{where}: {len(s['calls'])} step collectives issued on {devices}, the engine counted "
                             f"{s['collectives']} (expected all on {device_type})")
            if not all(is_work for _, _, is_work in s["calls"]):
                lines.append(f"{where}: a step collective returned no Work")
            if rank == 0:
                lines += mismatches(f"{where}, rank0_only", s["rank0"], s["full"], rtol=0, atol=0)
            elif s["rank0"]:
                lines.append(f"{where}: rank0_only returned {len(s['rank0'])} entries on rank {rank}")
        lines += mismatches(f"{name}, full state rank 1 vs rank 0", results[1][name]["full"], results[0][name]["full"],
                            rtol=0, atol=0)
    return lines


COUNTS = ("steps", "bytes", "collectives", "by_quantity", "buckets", "buckets_issued_during_backward",
          "direct_gradient_runs")


def reference_problems(got: list, want: list) -> list[str]:
    """`got` (the GPU run) against `want` (the CPU run): every count equal; every rank's own
    values, full state, optimizer state and evaluation within RTOL/ATOL."""
    lines = []
    for name in SCENARIOS:
        for rank, (g, w) in enumerate(zip(got, want)):
            where = f"{name}, rank {rank}"
            lines += [f"{where}: {k} {g[name][k]!r} on {g[name]['device']}, {w[name][k]!r} on the CPU"
                      for k in COUNTS if g[name][k] != w[name][k]]
            for part in ("local", "full", "optimizer", "evaluate"):
                if part in w[name]:
                    lines += mismatches(f"{where}, {part}", g[name].get(part, {}), w[name][part])
    return lines


@pytest.fixture(scope="module")
def cpu_run():
    """The worker on the CPU over gloo: the CI check's subject and the GPU test's reference."""
    return run_worker("cpu")


# --------------------------------------------------------------------------- CPU (CI)
def _holders_agree(local_dicts: list) -> list[str]:
    """Entries some element of which no rank holds, or which two holders hold differently."""
    lines = []
    for name in local_dicts[0]:
        stack = torch.stack([d[name] for d in local_dicts])
        held = ~torch.isnan(stack)
        if not held.any(0).all():
            lines.append(f"{name}: some element held by no rank")
        first = torch.where(held[0], stack[0], stack[1])
        if not all(((stack[k] == first) | ~held[k]).all() for k in range(len(local_dicts))):
            lines.append(f"{name}: holders disagree")
    return lines


def _backward_reference(coverage: float, level: str, sync_every: int) -> list:
    """[per rank: state dict] after STEPS steps of the backward regime's SGD, from plain models."""
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sx.plan_subnetworks(model, WORLD, coverage, level)

    def loss_of(m, rank, step):
        x, y = batch(rank, step)
        return F.cross_entropy(m(x), y)

    return backward_regime_sgd(model, global_pieces(plan), WORLD, loss_of, STEPS, LR, sync_every)[-1]


def test_worker_on_cpu_matches_one_process_references(cpu_run):
    problems = structural_problems(cpu_run, "cpu")
    for name, (regime, level, coverage, sync_every, optimizer) in SCENARIOS.items():
        problems += [f"{name}: {line}" for line in _holders_agree([r[name]["local"] for r in cpu_run])]
        if regime == "backward" and optimizer == "sgd":
            reference = _backward_reference(coverage, level, sync_every)
            params = [n for n, _ in make_model().named_parameters()]
            for rank, r in enumerate(cpu_run):
                problems += mismatches(f"{name}, rank {rank} vs the one-process reference",
                                       {n: r[name]["local"][n] for n in params},
                                       {n: reference[rank][n] for n in params}, rtol=1e-5, atol=1e-6)
    assert not problems, "\n".join(problems)
    # The step collectives the scenarios are there for did run: refresh, parameter
    # averaging, buckets issued during the backward, gradients written into buckets.
    by_name = cpu_run[0]
    assert "refresh" in by_name["backward_neuron_adamw"]["by_quantity"]
    assert "refresh" in by_name["backward_block_local_sgd"]["by_quantity"]
    assert set(by_name["forward_neuron_local_sgd"]["by_quantity"]) == {"parameters"}
    assert by_name["forward_block"]["buckets"] >= 2 and by_name["forward_block"]["buckets_issued_during_backward"] > 0
    assert by_name["backward_neuron_all_owned"]["direct_gradient_runs"] > 0


def test_mismatch_report_names_rank_entry_and_difference(cpu_run):
    """The GPU test's report can fail, and says where: a changed element is found."""
    want = cpu_run[1]["forward_block"]["full"]
    got = copy.deepcopy(want)
    got["head.bias"][2] += 1e-3
    lines = mismatches("forward_block, rank 1, full", got, want)
    assert len(lines) == 1 and "rank 1" in lines[0] and "head.bias" in lines[0] and "1.000e-03" in lines[0] \
        and "(2,)" in lines[0], lines
    assert reference_problems(cpu_run, cpu_run) == []


def test_staging_device_follows_the_backend(monkeypatch):
    cuda = torch.device("cuda", 1)
    for backend, expected in (("gloo", "cpu"), ("nccl", cuda), ("cpu:gloo,cuda:nccl", "cpu"), ("cuda:nccl", cuda)):
        monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None, b=backend: b)
        assert collectives.staging_device(None, cuda) == torch.device(expected), backend


# --------------------------------------------------------------------------- GPU
def check_gpu_run(backend: str, cpu_run: list) -> None:
    """The worker on the GPU(s) over `backend`, against the CPU run."""
    gpu_run = run_worker("cuda", backend)
    problems = structural_problems(gpu_run, "cuda") + reference_problems(gpu_run, cpu_run)
    assert not problems, f"{backend}, {torch.cuda.device_count()} GPU(s):\n" + "\n".join(problems)


@needs_cuda
def test_gloo_on_cuda_tensors_matches_the_cpu(cpu_run):
    check_gpu_run("gloo", cpu_run)


@needs_two_gpus
def test_nccl_matches_the_cpu(cpu_run):
    check_gpu_run("nccl", cpu_run)

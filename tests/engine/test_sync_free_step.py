"""A training step through the engine reads nothing to the host and prepares no table.

After two warm-up steps (which allocate the buckets, the gradient homes and the refresh
buffer and prepare every segment table once), further steps of either regime, at block
and neuron level, with both bucket strategies, with gradient accumulation (no_sync),
clipping and `zero_grad(set_to_none=True)`:
- make no host read of a tensor value from subnet_ext's code (tests/host_reads.py);
- validate no segment table (the C++ counter of validations stands still), because every
  tensor the tables point into keeps its address. The test keeps the previous step's
  gradients alive, so that a fresh gradient can never reuse the old address by chance;
- on a GPU (the device='cuda' variant), run under torch.cuda.set_sync_debug_mode("error"):
  any synchronisation, from Python or from the C++ kernels, is an error.

The gradient reductions too: bf16 on the wire (reduce_dtype) and the low-rank comm hook
(after its warm-up, which draws its first Qs), whose matrix products and orthogonalisation
stay on the device.

The engine simulates rank 1 of 4 (simulate_rank): the collectives are counted, not sent,
so the whole data path but the wire runs in one process.
"""
import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from host_reads import counting_host_reads
from sdp_helpers import CLASSES, IN, make_model
from subnet_ext.comm.hooks import LowRankState, low_rank_hook
from subnet_ext.testing import DEVICES

CONFIGS = [("forward", "neuron", "groups", "fp32", None), ("backward", "neuron", "groups", "fp32", None),
           ("forward", "block", "groups", "fp32", None), ("backward", "block", "zero_filled", "fp32", None),
           ("backward", "neuron", "zero_filled", "fp32", None), ("backward", "neuron", "groups", "bf16", None),
           ("forward", "neuron", "groups", "fp32", "bf16_wire"), ("backward", "neuron", "groups", "fp32", "low_rank")]


def batches(device, n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, IN, generator=g).to(device), torch.randint(0, CLASSES, (8,), generator=g).to(device))
            for _ in range(n)]


def table_validations() -> int:
    return torch.ops.subnet_ext.segment_table_builds()


def step(sdp, opt, data, precision, kept):
    """One optimizer step of two micro-batches (the first under no_sync), clipped; keeps
    the finished step's gradients in `kept` (a user logging them would)."""
    dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]
    for i, (x, y) in enumerate(data):
        ctx = sdp.no_sync() if i == 0 else torch.enable_grad()
        with ctx:
            with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(sdp(x), y)
            loss.backward()
    sdp.clip_grad_norm_(1.0)
    opt.step()
    kept.append([p.grad for p in sdp.parameters()])
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("regime,level,strategy,precision,reduction", CONFIGS)
def test_steps_after_warm_up_read_nothing_and_prepare_nothing(device, regime, level, strategy, precision, reduction):
    model = make_model().to(device)
    plan = sx.plan_subnetworks(model, 4, 0.5, level)
    sdp = sx.SubnetDataParallel(model, plan, regime=regime, simulate_rank=1, strategy=strategy,
                                bucket_cap_mb=0.002, reduce_dtype="bfloat16" if reduction == "bf16_wire" else None)
    if reduction == "low_rank":
        sdp.register_comm_hook(LowRankState(matrix_rank=2), low_rank_hook)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.05, momentum=0.9)
    data = batches(device, 10)
    kept = []
    for s in range(2):  # warm-up
        step(sdp, opt, data[2 * s:2 * s + 2], precision, kept)
    assert sdp.comm_stats()["collectives"] > 0  # buckets (and, backward regime, the refresh) did run
    validations = table_validations()
    preparations = sdp.averager.prepared.preparations, sdp.refresh.prepared.preparations if sdp.refresh else 0
    sync = torch.cuda.set_sync_debug_mode if device == "cuda" else (lambda mode: None)
    with counting_host_reads() as host:
        sync("error")
        try:
            for s in range(2, 5):
                step(sdp, opt, data[2 * s:2 * s + 2], precision, kept)
        finally:
            sync("default")
    assert host.reads == [], host.reads
    assert table_validations() == validations
    assert (sdp.averager.prepared.preparations, sdp.refresh.prepared.preparations if sdp.refresh else 0) == \
        preparations

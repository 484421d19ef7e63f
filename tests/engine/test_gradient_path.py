"""A gradient's path from autograd to the collective, walked on a real backward (docs/architecture.md).

Every call torch.distributed.all_reduce receives during a backward is caught with its Python stack; the
path starts at the first frame autograd called (after torch's `_engine_run_backward`: a parameter's
post-accumulate-grad hook, the masked kernel's backward, or the end-of-backward callback) and ends at
the frame that called all_reduce. At most 8 frames over at most 4 files, in both regimes, at the neuron
level (the backward regime's masked kernel writing into its bucket) and the block level.
"""
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.models.gpt import GPT, GPTConfig
from subnet_ext.testing import run_distributed

PACKAGE = os.path.dirname(os.path.abspath(sx.__file__))


def _model():
    """A GPT without biases: a masked kernel's report is then the last of its bucket, and starts its collective."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, bias=False))


def _paths(rank, world, level, regime):
    plan = sx.plan_subnetworks(_model(), world, 0.5 if level == "block" else 1.0, level)
    # Small buckets: many collectives, started by every kind of report.
    sdp = sx.SubnetDataParallel(_model(), plan, regime=regime, bucket_cap_mb=0.0005)
    caught, original = [], dist.all_reduce

    def spy(*args, **kwargs):
        caught.append(traceback.extract_stack()[:-1])
        return original(*args, **kwargs)

    dist.all_reduce = spy
    try:
        ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))
        logits, _ = sdp(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1)).backward()
    finally:
        dist.all_reduce = original
    paths = []
    for stack in caught:  # from the first of the package's frames autograd reached (after torch's Function.apply)
        start = max(i for i, f in enumerate(stack) if f.name == "_engine_run_backward") + 1
        frames = [(os.path.relpath(f.filename, PACKAGE), f.name) for f in stack[start:]]
        while frames and frames[0][0].startswith(".."):
            frames.pop(0)
        paths.append(frames)
    return paths, sdp.comm_stats()["direct_gradient_runs"]


@pytest.mark.parametrize("level,regime", [("neuron", "backward"), ("neuron", "forward"), ("block", "forward")])
def test_a_gradient_reaches_its_collective_in_a_few_hops(level, regime):
    paths, direct = run_distributed(_paths, 2, level, regime, timeout=300)[0]
    assert paths, "no all-reduce during the backward"
    if (level, regime) == ("neuron", "backward"):  # the masked kernel writes runs into their buckets and reports
        assert direct > 0 and any(path[0] == ("engine/layers/owned_linear.py", "backward") for path in paths), paths
    entries = set()
    for path in paths:
        assert all(not f.startswith("..") for f, _ in path), path  # nothing but the package's own frames
        assert path[-1] == ("comm/communicator.py", "all_reduce"), path
        files = {f for f, _ in path}
        assert len(path) <= 8 and len(files) <= 4, path
        entries.add(path[0])
    assert entries <= {("comm/averaging.py", "__call__"), ("comm/averaging.py", "_after_backward"),
                       ("engine/layers/owned_linear.py", "backward")}, entries
    longest = max(paths, key=len)
    assert sum(f == "comm/averaging.py" for f, _ in longest) >= 2  # the averager is told directly: no detour

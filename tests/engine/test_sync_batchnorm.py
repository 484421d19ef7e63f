"""SyncBatchNorm under SDP: each one synchronises among the ranks that run it.

A ResNet-18 of width 8 converted with `nn.SyncBatchNorm.convert_sync_batchnorm`, block level,
forward regime, 4 gloo ranks at coverage 0.5 (every block has 2 owners; the stem's and the
shortcut projections' norms are shared):

- the groups it is given: each SyncBatchNorm's process_group holds exactly its block's owners
  (as the plan's owner matrix says), a shared one every rank; close() gives back None;
- on the CPU, where torch's SyncBatchNorm refuses to run, a stand-in (`CPUSyncBatchNorm`: the
  same statistics, summed with a differentiable all-reduce over its process_group) trains 3
  steps: every all-reduce it issued was on its block's owners, the steps complete (a
  SyncBatchNorm synchronising over the world would wait for ranks that skip its block), and the
  owners agree (verify_consistency);
- coverage 1 (every group the world): the same stand-in under SDP equals torch DDP bit for bit;
- a SyncBatchNorm sliced by channel units with different owners (a declared neuron group) is
  refused by name, before the model changes.

On a GPU (`cuda` mark) the same 4-rank run uses torch's SyncBatchNorm itself on CUDA tensors.
"""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import subnet_ext as sx
from gpu_marks import needs_cuda
from subnet_ext.models import resnet18
from subnet_ext.testing import run_distributed


class _CPUSyncStatistics:
    """SyncBatchNorm's training statistics on the CPU: per-channel sums over every rank of its
    process_group (a differentiable all-reduce, as torch's sync_batch_norm's), running
    statistics updated with the unbiased variance. Logs the ranks of every all-reduce."""

    log = []

    def forward(self, x):
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        self.num_batches_tracked.add_(1)
        group = self.process_group if self.process_group else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        channels, dims = x.shape[1], [0] + list(range(2, x.dim()))
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), torch.full((1,), x.numel() / channels)])
        if len(ranks) > 1:
            _CPUSyncStatistics.log.append((self.name, ranks))
            stats = dist_nn.all_reduce(stats, group=group)
        count = stats[-1]
        mean = stats[:channels] / count
        var = stats[channels:2 * channels] / count - mean * mean
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * count / (count - 1))
        shape = [1, channels] + [1] * (x.dim() - 2)
        return (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps) * self.weight.view(shape) + \
            self.bias.view(shape)


class CPUSyncBatchNorm(_CPUSyncStatistics, nn.SyncBatchNorm):
    """The stand-in SDP sees: a SyncBatchNorm, whose process_group the engine sets."""


class DDPTwin(_CPUSyncStatistics, nn.BatchNorm2d):
    """The same statistics for torch DDP, which refuses SyncBatchNorm on the CPU."""


def sync_resnet(norm=nn.SyncBatchNorm, device="cpu", process_group=None):
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(resnet18(num_classes=10, width=8), process_group)
    for name, module in model.named_modules():
        if isinstance(module, nn.SyncBatchNorm):
            module.__class__ = norm
            module.name = name
    return model.to(device)


def images(rank, step, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, 16, 16, generator=g).to(device), torch.randint(0, 10, (4,), generator=g).to(device)


def train(net, opt, rank, device, steps=3):
    for s in range(steps):
        x, y = images(rank, s, device)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()


def block_owners(plan):
    """{block path: its owners} from the plan's owner matrix."""
    return {g.path: tuple(torch.nonzero(plan.owners[:, a]).flatten().tolist())
            for g, (a, _) in zip(plan.groups, plan.unit_ranges)}


def expected_ranks(name, blocks, world):
    block = next((b for b in blocks if name.startswith(b + ".") and ".downsample." not in name), None)
    return blocks[block] if block is not None else tuple(range(world))


def _groups_and_steps(rank, world, norm, device):
    out = {}
    net = sync_resnet(norm, device)
    plan = sx.plan_subnetworks(net, world, 0.5, "block")
    sdp = sx.SubnetDataParallel(net, plan)
    blocks = block_owners(plan)
    given = {name: tuple(dist.get_process_group_ranks(m.process_group)) if m.process_group is not None
             else tuple(range(world)) for name, m in net.named_modules() if isinstance(m, nn.SyncBatchNorm)}
    out["given"] = {name: (ranks, expected_ranks(name, blocks, world)) for name, ranks in given.items()}
    out["sizes"] = sorted({len(ranks) for ranks, _ in out["given"].values()})
    _CPUSyncStatistics.log.clear()
    train(sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-2), rank, device)
    out["synchronised"] = [(name, ranks, expected_ranks(name, blocks, world)) for name, ranks in _CPUSyncStatistics.log]
    sdp.verify_consistency()
    sdp.close()
    out["closed"] = all(m.process_group is None for m in net.modules() if isinstance(m, nn.SyncBatchNorm))
    return out


def _worker(rank, world):
    out = _groups_and_steps(rank, world, CPUSyncBatchNorm, "cpu")
    # Coverage 1: every group is the world; equal to DDP with the same norm.
    group = dist.new_group(list(range(2)))
    if rank < 2:
        ddp = DDP(sync_resnet(DDPTwin, process_group=group), process_group=group)
        train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), rank, "cpu")
        net = sync_resnet(CPUSyncBatchNorm, process_group=group)  # the user's group, as convert_sync_batchnorm's
        sdp = sx.SubnetDataParallel(net, sx.plan_subnetworks(net, 2, 1.0, "block"), process_group=group)
        train(sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-2), rank, "cpu")
        mine, reference = sdp.full_state_dict(), ddp.module.state_dict()
        out["equals_ddp"] = all(torch.equal(mine[k], reference[k]) for k in reference)
    # Refused: channel units with different owners.
    net = sync_resnet(CPUSyncBatchNorm)
    plan = sx.plan_subnetworks(net, world, 0.5, "neuron",
                               neuron_groups=[("layer1.0.conv1", "layer1.0.conv2", "layer1.0.bn1")])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        sx.SubnetDataParallel(net, plan)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in net.state_dict().items()) and \
        list(before) == list(net.state_dict())
    return out


def _check_groups(results, world):
    for r in results:
        assert r["sizes"] == [2, world], r["sizes"]  # blocks of 2 owners, shared ones on every rank
        for name, (ranks, expected) in r["given"].items():
            assert ranks == expected, (name, ranks, expected)
        assert r["closed"]


def test_each_sync_batchnorm_synchronises_among_the_ranks_that_run_it():
    results = run_distributed(_worker, 4, timeout=300)
    _check_groups(results, 4)
    for rank, r in enumerate(results):
        assert r["synchronised"], rank
        for name, ranks, expected in r["synchronised"]:
            assert ranks == expected and rank in ranks, (name, ranks, expected)
        if rank < 2:
            assert r["equals_ddp"], rank
        message = r["refused"]
        assert message is not None and "SyncBatchNorm 'layer1.0.bn1' is sliced by neuron units" in message, message
        assert "level='block'" in message and r["unchanged"]


def _gpu_worker(rank, world):
    torch.cuda.set_device(0)
    return _groups_and_steps(rank, world, nn.SyncBatchNorm, "cuda")


@needs_cuda
def test_torch_sync_batchnorm_on_cuda_among_owners():
    """torch's own SyncBatchNorm on CUDA tensors, 4 ranks on one GPU over gloo."""
    _check_groups(run_distributed(_gpu_worker, 4, timeout=300), 4)

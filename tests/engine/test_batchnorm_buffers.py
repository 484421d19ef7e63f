"""BatchNorm buffers: the owners' average (the default) or the leader's, as torch DDP's, on 2 gloo ranks.

A ResNet-18 of width 8 (BatchNorm after every convolution), seeded, 5 AdamW steps on each
rank's own batches, coverage 1, neuron level (channel units: bn1's statistics are sliced
pieces; the others are shared):

- buffer_sync="broadcast": SDP equals torch DDP (broadcast_buffers=True) bit for bit: each
  rank's eval-mode logits equal DDP's on the same rank, `full_state_dict()` equals DDP rank 0's
  state dict (parameters, running statistics, num_batches_tracked), and an EMA with
  `use_buffers=True` equals rank 0's AveragedModel(use_buffers=True) over DDP;
- buffer_sync="average": the running statistics are the owners' mean after each backward,
  equal bit for bit to DDP with broadcast_buffers=False whose buffers the test all-reduces and
  halves after each backward; its eval differs from DDP's (the premise of the choice);
- coverage 0.5 with "broadcast": verify_consistency() passes after the steps (every owner holds
  its leader's statistics), and no collective is left to an evaluation: rank 0 alone runs an
  eval-mode forward between steps (as nanoGPT's master-only evaluation) and training goes on.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import subnet_ext as sx
from subnet_ext.models import resnet18
from subnet_ext.testing import run_distributed

STEPS, DECAY = 5, 0.9


def model():
    torch.manual_seed(0)
    return resnet18(num_classes=10, width=8)


def images(rank, step, n=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(net, opt, rank, after_backward=None, ema=None):
    for s in range(STEPS):
        x, y = images(rank, s)
        F.cross_entropy(net(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.update_parameters(net)


def eval_logits(net):
    net.eval()
    with torch.no_grad():
        out = net(images(0, 999, 8)[0])
    net.train()
    return out.numpy()  # an array: tensors do not travel back from the workers


def as_bytes(state):
    return {k: v.detach().cpu().contiguous().numpy().tobytes() for k, v in state.items()}


def _average_buffers(module, world):
    """The reference of buffer_sync="average" at coverage 1: every floating buffer, the ranks' mean."""
    def average():
        with torch.no_grad():
            for b in module.buffers():
                if b.is_floating_point():
                    dist.all_reduce(b)
                    b.mul_(1.0 / world)
    return average


def _worker(rank, world):
    out = {}
    ddp = DDP(model())
    ddp_ema = AveragedModel(ddp.module, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), rank, ema=ddp_ema)
    out["ddp"] = {"logits": eval_logits(ddp), "state": as_bytes(ddp.module.state_dict()),
                  "ema": as_bytes(ddp_ema.state_dict())}

    averaged = DDP(model(), broadcast_buffers=False)
    train(averaged, torch.optim.AdamW(averaged.parameters(), lr=1e-2), rank,
          after_backward=_average_buffers(averaged.module, world))
    out["reference_average"] = {"logits": eval_logits(averaged), "state": as_bytes(averaged.module.state_dict())}

    for mode in ("broadcast", "average"):
        net = model()
        sdp = sx.SubnetDataParallel(net, sx.plan_subnetworks(net, world, 1.0, "neuron"), buffer_sync=mode)
        ema = sx.ExponentialMovingAverage(sdp, DECAY, use_buffers=True)
        train(sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-2), rank, ema=ema)
        out[mode] = {"logits": eval_logits(sdp), "state": as_bytes(sdp.full_state_dict()),
                     "ema": as_bytes(ema.state_dict())}

    net = model()
    sdp = sx.SubnetDataParallel(net, sx.plan_subnetworks(net, world, 0.5, "neuron"), buffer_sync="broadcast")
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    train(sdp, opt, rank)
    sdp.verify_consistency()
    if rank == 0:  # a master-only evaluation: no collective in it
        eval_logits(sdp)
    train(sdp, opt, rank)
    sdp.verify_consistency()
    out["half_consistent"] = True
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=300)


def test_broadcast_equals_ddp(results):
    rank0_state, rank0_ema = results[0]["ddp"]["state"], results[0]["ddp"]["ema"]
    assert any("running_mean" in k for k in rank0_state) and any("num_batches_tracked" in k for k in rank0_state)
    for rank, r in enumerate(results):
        assert (r["broadcast"]["logits"] == r["ddp"]["logits"]).all(), rank  # eval, on every rank
        assert r["broadcast"]["state"] == rank0_state, [k for k in rank0_state if r["broadcast"]["state"][k] !=
                                                       rank0_state[k]]
        assert r["broadcast"]["ema"] == rank0_ema, [k for k in rank0_ema if r["broadcast"]["ema"][k] != rank0_ema[k]]


def test_average_is_the_owners_mean_and_differs_from_ddp(results):
    for rank, r in enumerate(results):
        reference = r["reference_average"]["state"]
        assert r["average"]["state"] == reference, [k for k in reference if r["average"]["state"][k] != reference[k]]
        assert (r["average"]["logits"] == r["reference_average"]["logits"]).all(), rank
        difference = float(abs(r["average"]["logits"] - r["ddp"]["logits"]).max())
        assert difference > 1e-4, difference  # the rule matters: DDP's eval is rank 0's statistics


def test_broadcast_at_half_coverage_keeps_owners_consistent(results):
    assert all(r["half_consistent"] for r in results)

"""The engine on one GPU (skipped without one): NCCL with a single rank, and rank r of K
simulated on the device, each checked against the same computation on the CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F

import subnet_ext as sx
from subnet_ext.models import ResidualMLP
from subnet_ext.testing import cuda_ready

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cuda_ready(), reason="needs a GPU and the CUDA kernels")]

IN, CLASSES = 12, 5


def make_model(device):
    torch.manual_seed(0)
    return ResidualMLP(in_features=IN, num_classes=CLASSES, width=16, depth=4, hidden=32).to(device)


def batches(device, steps=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, IN, generator=g).to(device), torch.randint(0, CLASSES, (8,), generator=g).to(device))
            for _ in range(steps)]


def train(sdp, device):
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    for x, y in batches(device):
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("regime,level", [("forward", "block"), ("forward", "neuron"), ("backward", "block"),
                                          ("backward", "neuron")])
def test_simulated_rank_on_gpu_matches_cpu(regime, level):
    results = {}
    for device in ("cpu", "cuda"):
        model = make_model(device)
        plan = sx.plan_subnetworks(model, world_size=4, coverage=0.5, level=level)
        sdp = sx.SubnetDataParallel(model, plan, regime=regime, simulate_rank=1, bucket_cap_mb=0.001)
        opt = train(sdp, device)
        results[device] = (sdp.local_full_state_dict(), sdp.comm_stats()["bytes_per_step"],
                           sdp.memory_report(opt)["model_state"])
    (cpu_sd, cpu_bytes, cpu_mem), (gpu_sd, gpu_bytes, gpu_mem) = results["cpu"], results["cuda"]
    assert cpu_bytes == gpu_bytes and cpu_mem == gpu_mem
    for name, value in cpu_sd.items():
        if value.is_floating_point():
            torch.testing.assert_close(gpu_sd[name].cpu(), value, equal_nan=True, rtol=1e-4, atol=1e-5)


def test_nccl_single_rank_equals_plain_training():
    import torch.distributed as dist

    from subnet_ext.jobs.launch import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for regime, level in (("forward", "block"), ("backward", "neuron")):
            model = make_model("cuda")
            reference = copy.deepcopy(model)
            sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 1, 1.0, level), regime=regime)
            train(sdp, "cuda")
            opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            for x, y in batches("cuda"):
                F.cross_entropy(reference(x), y).backward()
                opt.step()
                opt.zero_grad()
            full = sdp.full_state_dict()
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("regime,level", [("forward", "neuron"), ("backward", "neuron"), ("backward", "block")])
def test_training_step_never_synchronises(regime, level):
    """After two warm-up steps (tables prepared, buffers allocated), a whole training step —
    forward, backward with the masked kernels and the bucketed averaging, optimizer step,
    the engine's post-step work — must not wait for the GPU (no index validation copies, no
    per-call table uploads). Rank 1 of 4 simulated: the engine's own work, no collectives."""
    model = make_model("cuda")
    plan = sx.plan_subnetworks(model, world_size=4, coverage=0.5, level=level)
    sdp = sx.SubnetDataParallel(model, plan, regime=regime, simulate_rank=1, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1, foreach=True)
    steps = batches("cuda", steps=3)
    for x, y in steps[:2]:
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    x, y = steps[2]
    torch.cuda.set_sync_debug_mode("error")
    try:
        F.cross_entropy(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sdp.comm_stats()["steps"] == 3

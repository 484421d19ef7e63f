"""shard_shared=True: the plan's shared parameters (here the tied embedding / LM head and
the final norm of a tiny LLaMA) sharded by torch's FSDP2, the units averaged by SDP.

References: torch DDP at coverage 1.0 (AdamW); at coverage 0.5 the one-process
owner-mean reference of test_tied_weights (units averaged among owners, shared
parameters over all ranks, SGD); the shared-parameter bytes counted here from the
local shards; a checkpoint written sharded and read back unsharded on another world size.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import subnet_ext as sx
from subnet_ext.state.checkpoint import load_subnet_checkpoint, save_subnet_checkpoint
from subnet_ext.testing import run_distributed
from test_tied_weights import LR, STEPS, TIED, layer_owners, lm_loss, reference, tied_llama, tokens


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _ddp_worker(rank, world, regime):
    """Coverage 1.0 with sharded shared parameters against torch DDP, AdamW, 3 steps."""
    sdp = sx.SubnetDataParallel(tied_llama(), sx.plan_subnetworks(tied_llama(), world, 1.0, "block"),
                                regime=regime, shard_shared=True)
    ddp = DDP(tied_llama())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sdp, ddp)]
    for step in range(STEPS):
        for m, opt in zip((sdp, ddp), opts):
            if step == 1:  # no_sync: the accumulated sum is averaged by the next backward
                with m.no_sync():
                    lm_loss(m, tokens(rank, 10 + step)).backward()
            lm_loss(m, tokens(rank, step)).backward()
            opt.step()
            opt.zero_grad()
    full = sdp.full_state_dict()
    return {"diff": _max_diff(full, ddp.module.state_dict()), "tied": full[TIED[0]] is full[TIED[1]],
            "sharded": sorted(sdp.layout.sharded)}


@pytest.mark.parametrize("regime", ["forward", "backward"])
def test_coverage_one_equals_ddp(regime):
    for res in run_distributed(_ddp_worker, 2, regime, timeout=300):
        assert res["diff"] < 1e-5, res
        assert res["tied"], res
        assert res["sharded"] == ["model.embed_tokens.weight", "model.norm.weight"], res


def _owner_mean_worker(rank, world, folder):
    model = tied_llama()
    plan = sx.plan_subnetworks(model, world, 0.5, "block")
    ref_model = reference(model, layer_owners(plan, world), world)
    expected = ref_model.state_dict()
    results = {}
    for shard in (False, True):
        sdp = sx.SubnetDataParallel(tied_llama(), plan, regime="forward", strategy="groups", shard_shared=shard)
        opt = torch.optim.SGD(sdp.parameters(), lr=LR)
        for step in range(STEPS):
            lm_loss(sdp, tokens(rank, step)).backward()
            opt.step()
            opt.zero_grad()
        full = sdp.full_state_dict()
        results[shard] = {"diff": _max_diff(full, expected), "memory": sdp.memory_report(opt),
                          "comm": sdp.comm_stats(), "predicted": sdp.predicted_model_state_bytes(0.0)}
        if shard:
            shards = [p.to_local() for p in sdp.shared_shards.parameters()]
            results["counted_shard_bytes"] = sum(t.numel() * t.element_size() for t in shards)
            results["shared_full_bytes"] = sum(full[n].numel() * 4 for n in sdp.layout.sharded)
            ids = tokens(99, 0)
            results["eval"] = {k: v for k, v in sdp.evaluate(ids).items()}
            with torch.no_grad():
                results["eval_ref"] = ref_model.eval()(ids)
            save_subnet_checkpoint(folder, 3, sdp, opt)
    return results


def _resume_worker(rank, world, folder, expected):
    """Unsharded engine on another world size resumes the sharded checkpoint."""
    model = tied_llama()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 1.0, "block"))
    opt = torch.optim.SGD(sdp.parameters(), lr=LR)
    load_subnet_checkpoint(folder, sdp, opt)
    return _max_diff(sdp.full_state_dict(), expected)


def test_coverage_half_owner_mean_memory_and_checkpoint(tmp_path):
    world = 4
    results = run_distributed(_owner_mean_worker, world, str(tmp_path), timeout=400)
    for rank, res in enumerate(results):
        assert res[True]["diff"] < 1e-5 and res[False]["diff"] < 1e-5, (rank, res[True]["diff"])
        # Parameters: the shared part shrinks to this rank's shard, counted here from the shards.
        shard = res["counted_shard_bytes"]
        assert shard == res["shared_full_bytes"] // world, (shard, res["shared_full_bytes"])
        assert res[True]["memory"]["sharded_shared"] == shard
        assert res[False]["memory"]["parameters"] - res[True]["memory"]["parameters"] == \
            res["shared_full_bytes"] - shard
        assert res[True]["memory"]["parameters"] == res[True]["predicted"] / 2  # params + grads, SGD no state
        # SDP no longer communicates the shared parameters; FSDP2's bytes are predicted.
        assert res[True]["comm"]["bytes_per_step"] == \
            res[False]["comm"]["bytes_per_step"] - res["shared_full_bytes"]  # their world bucket is gone
        fsdp = res[True]["comm"]["fsdp"]
        assert fsdp["collectives"] == 3 and fsdp["bytes"] == 3 * res["shared_full_bytes"]
        assert (res["eval"]["full"] - res["eval_ref"]).abs().max() < 1e-5
        assert res["eval"]["ensemble"].shape == res["eval_ref"].shape
    model = tied_llama()
    ref = reference(model, layer_owners(sx.plan_subnetworks(model, world, 0.5, "block"), world), world).state_dict()
    for diff in run_distributed(_resume_worker, 2, str(tmp_path), ref, timeout=300):
        assert diff < 1e-6, diff


def test_refused_combinations():
    model = tied_llama()
    plan = sx.plan_subnetworks(model, 2, 0.5, "block")
    with pytest.raises(ValueError, match="simulate_rank"):
        sx.SubnetDataParallel(model, plan, simulate_rank=0, shard_shared=True)
    with pytest.raises(ValueError, match="sync_every=1"):
        sx.SubnetDataParallel(model, plan, sync_every=2, shard_shared=True)

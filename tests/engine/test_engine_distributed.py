"""SubnetDataParallel with real gloo processes (2 and 4 ranks, one thread each).

Each test spawns its processes once and checks several properties inside them, to keep
process start-up (importing torch) within the CI budget on 2 cores.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model, train
from subnet_ext.planning.pieces import global_pieces
from subnet_ext.testing import run_distributed



def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def holders_agree(local_dicts):
    """(every element held by someone, every held element bit-identical across holders)."""
    covered, agree = True, True
    for name in local_dicts[0]:
        stack = torch.stack([d[name] for d in local_dicts])
        if not stack.is_floating_point():
            continue
        held = ~torch.isnan(stack)
        covered &= bool(held.any(0).all())
        ref = torch.zeros_like(stack[0])
        done = torch.zeros_like(held[0])
        for k in range(stack.shape[0]):
            take = held[k] & ~done
            ref[take] = stack[k][take]
            done |= take
        agree &= bool(((stack == ref) | ~held).all())
    return covered, agree


# --------------------------------------------------------------------------- 2 ranks
def _two_rank_worker(rank, world):
    out = {}
    # Coverage 1.0 reproduces torch DDP (AdamW, fp32).
    for regime, level in (("forward", "block"), ("backward", "neuron")):
        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 1.0, level), regime=regime)
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        dopt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for s in range(4):
            x, y = batch(rank, s)
            F.cross_entropy(ddp(x), y).backward()
            dopt.step()
            dopt.zero_grad()
        train(sdp, opt, rank, 4)
        full, ref = sdp.full_state_dict(), ddp.module.state_dict()
        out[f"ddp_diff_{regime}_{level}"] = max((full[k] - ref[k]).abs().max().item() for k in ref)

    # no_sync(): a micro-batch accumulated without communication, then one averaged backward,
    # equals torch DDP's no_sync at coverage 1.0 (including the backward regime's gradients
    # written straight into the buckets); nothing is communicated inside the context.
    for regime, level in (("forward", "block"), ("backward", "neuron")):
        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 1.0, level), regime=regime,
                                    bucket_cap_mb=0.001)
        silent = True
        for module, opt in ((ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)),
                            (sdp, torch.optim.AdamW(sdp.parameters(), lr=1e-2))):
            for s in range(2):
                x0, y0 = batch(rank, 2 * s)
                x1, y1 = batch(rank, 2 * s + 1)
                before = sdp.comm_stats()["collectives"]
                with module.no_sync():
                    F.cross_entropy(module(x0), y0).backward()
                silent &= sdp.comm_stats()["collectives"] == before
                F.cross_entropy(module(x1), y1).backward()
                opt.step()
                opt.zero_grad()
        full, ref = sdp.full_state_dict(), ddp.module.state_dict()
        out[f"no_sync_diff_{regime}_{level}"] = max((full[k] - ref[k]).abs().max().item() for k in ref)
        out[f"no_sync_silent_{regime}_{level}"] = silent and sdp.comm_stats()["collectives"] > 0

    # full_state_dict loads into the original, unmasked model; evaluate("full") is that model.
    model = make_model()
    plan = sx.plan_subnetworks(model, world, 0.5, "block")
    sdp = sx.SubnetDataParallel(model, plan, regime="forward")
    train(sdp, torch.optim.SGD(sdp.parameters(), lr=0.1), rank, 2)
    original = make_model()
    original.load_state_dict(sdp.full_state_dict())
    x, _ = batch(99, 0)
    original.eval()
    out["full_eval_diff"] = (sdp.evaluate(x)["full"] - original(x)).abs().max().item()

    # Bad input: clear errors on every rank, and nobody left hanging.
    errors = {}
    for key, make in {
        "world": lambda: sx.SubnetDataParallel(make_model(), sx.plan_subnetworks(make_model(), 4, 0.5)),
        "model": lambda: sx.SubnetDataParallel(make_model(width=24), sx.plan_subnetworks(make_model(), world, 0.5)),
        "group": lambda: sx.SubnetDataParallel(make_model(), sx.plan_subnetworks(make_model(), world, 0.5),
                                               process_group=singles[rank]),
        "checkpoint": lambda: sdp.load_full_state_dict(make_model(width=24).state_dict()),
    }.items():
        if key == "group":
            singles = [dist.new_group([r]) for r in range(world)]
        try:
            make()
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    out["errors"] = errors
    dist.barrier()  # every rank got here: no one is stuck in a collective
    return out


def test_two_ranks_ddp_equivalence_export_and_errors():
    results = run_distributed(_two_rank_worker, 2)
    for r in results:
        assert r["ddp_diff_forward_block"] < 1e-6, r
        assert r["ddp_diff_backward_neuron"] < 1e-6, r
        assert r["no_sync_diff_forward_block"] < 1e-6 and r["no_sync_diff_backward_neuron"] < 1e-6, r
        assert r["no_sync_silent_forward_block"] and r["no_sync_silent_backward_neuron"], r
        assert r["full_eval_diff"] < 1e-6, r
        e = r["errors"]
        assert e["world"] and "world size 4" in e["world"] and "2 ranks" in e["world"]
        assert e["model"] and "another model" in e["model"]
        assert e["group"] and "world size 2" in e["group"] and "1 ranks" in e["group"]
        assert e["checkpoint"] and "does not belong to this model" in e["checkpoint"]


# --------------------------------------------------------------------------- 4 ranks
CONFIGS = [("forward", "block"), ("forward", "neuron"), ("backward", "block"), ("backward", "neuron")]


def _four_rank_worker(rank, world):
    out = {}
    xe, _ = batch(77, 0)
    for regime, level in CONFIGS:
        key = f"{regime}_{level}"
        model = make_model()
        plan = sx.plan_subnetworks(model, world, 0.5, level)
        sdp = sx.SubnetDataParallel(model, plan, regime=regime)
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        train(sdp, opt, rank, 2)
        x, y = batch(rank, 2)
        F.cross_entropy(sdp(x), y).backward()
        memory = sdp.memory_report(opt)  # gradients still held
        opt.step()
        opt.zero_grad()
        covered, agree = holders_agree(gather(sdp.local_full_state_dict()))
        stats = sdp.comm_stats()
        sdp.module.eval()
        with torch.no_grad():
            mine = sdp.module(xe)
        sdp.module.train()
        outs = gather(mine)
        ev = sdp.evaluate(xe)
        out[key] = {
            "covered": covered, "agree": agree,
            "bytes_per_step": stats["bytes_per_step"], "predicted": stats["predicted_per_sync"],
            "collectives_per_step": stats["collectives_per_step"],
            "model_state": memory["model_state"], "predicted_state": sdp.predicted_model_state_bytes(),
            "ddp_state": 4 * plan.full_bytes,
            "ensemble_diff": (ev["ensemble"] - torch.stack(outs).mean(0)).abs().max().item(),
        }

    # Backward regime: one SGD step = theta - lr * mean over owners of full-model gradients.
    for level in ("block", "neuron"):
        model = make_model()
        reference = copy.deepcopy(model)
        plan = sx.plan_subnetworks(model, world, 0.5, level)
        sdp = sx.SubnetDataParallel(model, plan, regime="backward")
        theta0 = sdp.full_state_dict()
        train(sdp, torch.optim.SGD(sdp.parameters(), lr=0.1), rank, 1)
        theta1 = sdp.full_state_dict()
        grads = []
        for q in range(world):  # each rank's full-model gradient, in this one process
            m = copy.deepcopy(reference)
            x, y = batch(q, 0)
            F.cross_entropy(m(x), y).backward()
            grads.append({n: p.grad for n, p in m.named_parameters()})
        worst = 0.0
        for p in global_pieces(sdp.plan):
            if not p.is_param:
                continue
            g = torch.stack([grads[q][p.name].narrow(p.dim, p.start, p.length) if grads[q][p.name].dim() else
                             grads[q][p.name] for q in p.owners]).mean(0)
            t0 = theta0[p.name].narrow(p.dim, p.start, p.length) if theta0[p.name].dim() else theta0[p.name]
            t1 = theta1[p.name].narrow(p.dim, p.start, p.length) if theta1[p.name].dim() else theta1[p.name]
            worst = max(worst, (t1 - (t0 - 0.1 * g)).abs().max().item())
        out[f"sgd_{level}"] = worst

    # Overlapped bucketed averaging (tiny buckets: many collectives, issued during backward)
    # equals the non-overlapped path bit for bit; a simulated rank measures what the real one does.
    for regime, level in CONFIGS:
        finals = {}
        for overlap in (True, False):
            model = make_model()
            sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, level), regime=regime,
                                        bucket_cap_mb=0.001, overlap=overlap)
            opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
            train(sdp, opt, rank, 2)
            finals[overlap] = sdp.full_state_dict()
            stats = sdp.comm_stats()
            out[f"overlap_{regime}_{level}_{overlap}"] = (stats["buckets"], stats["buckets_issued_during_backward"],
                                                          stats["bytes_per_step"], stats["predicted_per_sync"])
            out[f"direct_{regime}_{level}"] = stats["direct_gradient_runs"]
            real_memory = sdp.memory_report(opt)["model_state"]
        out[f"overlap_diff_{regime}_{level}"] = max((finals[True][k] - finals[False][k]).abs().max().item()
                                                    for k in finals[True] if finals[True][k].is_floating_point())
        model = make_model()
        sim = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, level), regime=regime,
                                    bucket_cap_mb=0.001, simulate_rank=rank)
        sim_opt = torch.optim.AdamW(sim.parameters(), lr=1e-2)
        train(sim, sim_opt, rank, 2)
        out[f"simulated_{regime}_{level}"] = (sim.memory_report(sim_opt)["model_state"], real_memory,
                                              sim.comm_stats()["bytes_per_step"], stats["bytes_per_step"])

    # sync_every=2: owners agree after every second step; the zero-filled path equals the per-group one.
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "block"), sync_every=2)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    train(sdp, opt, rank, 4)
    out["local_sgd_agree"] = holders_agree(gather(sdp.local_full_state_dict()))
    finals = {}
    for strategy in ("groups", "zero_filled"):
        model = make_model()
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "neuron"), strategy=strategy)
        train(sdp, torch.optim.SGD(sdp.parameters(), lr=0.1), rank, 2)
        finals[strategy] = sdp.full_state_dict()
        out[f"bytes_{strategy}"] = (sdp.comm_stats()["bytes_per_step"], sdp.comm_stats()["predicted_per_sync"])
    out["strategy_diff"] = max((finals["groups"][k] - finals["zero_filled"][k]).abs().max().item()
                               for k in finals["groups"])
    return out


@pytest.fixture(scope="module")
def four_rank_results():
    return run_distributed(_four_rank_worker, 4, timeout=300)


@pytest.mark.parametrize("regime,level", CONFIGS)
def test_four_ranks_owners_agree_and_costs(four_rank_results, regime, level):
    for rank, res in enumerate(four_rank_results):
        r = res[f"{regime}_{level}"]
        assert r["covered"], f"rank {rank}: some element is held by no rank"
        assert r["agree"], f"rank {rank}: owners' copies differ"
        assert r["bytes_per_step"] == r["predicted"]["bytes"], r
        assert r["collectives_per_step"] == r["predicted"]["collectives"], r
        assert r["ensemble_diff"] < 1e-5, r
        if regime == "forward":
            assert abs(r["model_state"] / r["predicted_state"] - 1) < 0.05, r
            assert r["model_state"] <= 0.6 * r["ddp_state"], r


def test_four_ranks_backward_regime_step_is_owner_mean(four_rank_results):
    for res in four_rank_results:
        assert res["sgd_block"] < 1e-6 and res["sgd_neuron"] < 1e-6, res


@pytest.mark.parametrize("regime,level", CONFIGS)
def test_four_ranks_overlap_is_bit_identical_and_simulation_matches(four_rank_results, regime, level):
    for res in four_rank_results:
        assert res[f"overlap_diff_{regime}_{level}"] == 0.0, res
        buckets, early, measured, predicted = res[f"overlap_{regime}_{level}_True"]
        assert buckets > 1 and early > 0, (buckets, early)
        assert measured == predicted["bytes"]
        _, early_off, _, _ = res[f"overlap_{regime}_{level}_False"]
        assert early_off == 0
        if (regime, level) == ("backward", "neuron"):  # the masked kernel wrote into the buckets
            assert res[f"direct_{regime}_{level}"] > 0
        sim_memory, real_memory, sim_bytes, real_bytes = res[f"simulated_{regime}_{level}"]
        assert sim_memory == real_memory and sim_bytes == real_bytes


def test_four_ranks_local_sgd_and_zero_filled(four_rank_results):
    for res in four_rank_results:
        assert res["local_sgd_agree"] == (True, True)
        assert res["strategy_diff"] < 1e-6
        for s in ("groups", "zero_filled"):
            measured, predicted = res[f"bytes_{s}"]
            assert measured == predicted["bytes"], (s, measured, predicted)

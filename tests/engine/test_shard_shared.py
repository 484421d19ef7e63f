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
from subnet_ext.checkpoint import load_subnet_checkpoint, save_subnet_checkpoint
from subnet_ext.testing import run_distributed
from test_tied_weights import LR, STEPS, TIED, _Skip, layer_owners, lm_loss, reference, tied_llama, tokens


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _ddp_worker(rank, world, level, regime, folder):
    """Coverage 1.0 with sharded shared parameters against torch DDP, AdamW, 3 steps; then
    the optimizer state against DDP's, and a sharded checkpoint / full state dict read back
    into fresh sharded engines."""
    plan = sx.plan_subnetworks(tied_llama(), world, 1.0, level)
    sdp = sx.SubnetDataParallel(tied_llama(), plan, regime=regime, shard_shared=True)
    ddp = DDP(tied_llama())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sdp, ddp)]
    norms = []
    for step in range(STEPS):
        for m, opt in zip((sdp, ddp), opts):
            if step == 1:  # no_sync: the accumulated sum is averaged by the next backward
                with m.no_sync():
                    lm_loss(m, tokens(rank, 10 + step)).backward()
            lm_loss(m, tokens(rank, step)).backward()
            if step == 2:  # clipping: the shards' norm counted once (each rank its rows)
                norms.append(m.clip_grad_norm_(0.05) if m is sdp else torch.nn.utils.clip_grad_norm_(m.parameters(),
                                                                                                    0.05))
            opt.step()
            opt.zero_grad()
    full = sdp.full_state_dict()
    out = {"diff": _max_diff(full, ddp.module.state_dict()), "tied": full[TIED[0]] is full[TIED[1]],
           "sharded": sorted(sdp.layout.sharded), "norms": [float(n) for n in norms]}
    optim = sdp.full_optimizer_state_dict(opts[0])["state"]
    ddp_state = {n: opts[1].state[p] for n, p in ddp.module.named_parameters()}
    out["optim_diff"] = max((optim[n][k] - ddp_state[n][k]).abs().max().item()
                            for n in ddp_state for k in ("exp_avg", "exp_avg_sq"))
    save_subnet_checkpoint(folder, 3, sdp, opts[0])
    fresh = sx.SubnetDataParallel(tied_llama(), plan, regime=regime, shard_shared=True)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_subnet_checkpoint(folder, fresh, fresh_opt)
    out["resume_diff"] = _max_diff(fresh.full_state_dict(), full)
    resumed = fresh.full_optimizer_state_dict(fresh_opt)["state"]
    out["resume_optim_diff"] = max((resumed[n][k] - optim[n][k]).abs().max().item() for n in optim for k in optim[n])
    again = sx.SubnetDataParallel(tied_llama(), plan, regime=regime, shard_shared=True)
    again.load_full_state_dict(full)
    out["load_full_diff"] = _max_diff(again.full_state_dict(), full)
    out["fsdp_counted"], out["fsdp_predicted"] = _count_fsdp_step(again, rank), again.comm_stats()["fsdp"]
    return out


# The c10d functions FSDP2 calls: all_gather_single / reduce_scatter_single where torch has
# them (2.14; there all_gather_into_tensor / reduce_scatter_tensor are deprecated aliases that
# call them), all_gather_into_tensor / reduce_scatter_tensor before (2.11). Wrapping the
# newest present counts each collective once either way; a torch whose FSDP2 called neither
# would count nothing, and the comparison with comm_stats' prediction fails.
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def _count_fsdp_step(sdp, rank) -> dict:
    """FSDP2's collectives in one forward + backward, counted by wrapping the c10d calls it makes."""
    counted = {"collectives": 0, "all_gather_bytes": 0, "reduce_scatter_bytes": 0}
    originals = getattr(dist, GATHER), getattr(dist, SCATTER)

    def gather(output, input, *args, **kwargs):
        counted["collectives"] += 1
        counted["all_gather_bytes"] += output.numel() * output.element_size()
        return originals[0](output, input, *args, **kwargs)

    def scatter(*args, **kwargs):
        counted["collectives"] += 1
        inp = kwargs["input"] if "input" in kwargs else args[1]
        counted["reduce_scatter_bytes"] += inp.numel() * inp.element_size()
        return originals[1](*args, **kwargs)

    setattr(dist, GATHER, gather)
    setattr(dist, SCATTER, scatter)
    try:
        lm_loss(sdp, tokens(rank, 0)).backward()
    finally:
        setattr(dist, GATHER, originals[0])
        setattr(dist, SCATTER, originals[1])
    return counted


@pytest.mark.parametrize("level,regime", [("block", "forward"), ("block", "backward"), ("neuron", "backward")])
def test_coverage_one_equals_ddp(level, regime, tmp_path):
    for res in run_distributed(_ddp_worker, 2, level, regime, str(tmp_path), timeout=400):
        assert res["diff"] < 1e-5 and res["optim_diff"] < 1e-6, res
        assert res["norms"][0] == pytest.approx(res["norms"][1], rel=1e-5) and res["norms"][1] > 0.05, res["norms"]
        assert res["resume_diff"] == 0 and res["resume_optim_diff"] == 0 and res["load_full_diff"] == 0, res
        predicted = res["fsdp_predicted"]  # comm_stats' FSDP2 numbers are predicted: check them against a count
        assert res["fsdp_counted"] == {k: predicted[k] for k in res["fsdp_counted"]}, res
        assert res["tied"], res
        # Shared: the tied embedding (once) and the final norm; at neuron level the layers' norms too.
        expected = [n for n, _ in tied_llama().named_parameters()
                    if not n.startswith("model.layers.") or (level == "neuron" and "layernorm" in n)]
        assert res["sharded"] == sorted(expected), res


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
            outputs = sdp.evaluate(ids)
            with torch.no_grad():
                want = ref_model.eval()(ids)
            # floats only: tensors in the result queue race with the worker's exit
            results["eval_full_diff"] = (outputs["full"] - want).abs().max().item()
            ensemble = _ensemble_reference(ref_model, plan, world, ids)
            results["ensemble_diff"] = (outputs["ensemble"] - ensemble).abs().max().item()
            sdp.verify_consistency()  # units' owners agree; the shards have one holder each
            local = sdp.local_full_state_dict()
            results["local_rows"] = {n: (~torch.isnan(local[n].reshape(local[n].shape[0], -1)[:, 0])).nonzero()
                                     .flatten().tolist() for n in sdp.layout.sharded}
            results["local_match"] = all(torch.equal(local[n][r], full[n][r]) for n, r in results["local_rows"].items())
            save_subnet_checkpoint(folder, 3, sdp, opt)
    return results


def _ensemble_reference(ref_model, plan, world, ids):
    """Mean over ranks of the reference model with the layers rank q does not own skipped."""
    outs = []
    for q, ranks in [(q, layer_owners(plan, world)) for q in range(world)]:
        m = copy.deepcopy(ref_model).eval()
        for i, owners in ranks.items():
            if q not in owners:
                m.model.layers[i] = _Skip()
        with torch.no_grad():
            outs.append(m(ids).float())
    return torch.stack(outs).mean(0)


def _resume_worker(rank, world, folder, expected):
    """Engines on another world size and coverage, unsharded and sharded, resume the
    sharded checkpoint."""
    diffs = []
    for shard in (False, True):
        model = tied_llama()
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 1.0, "block"), shard_shared=shard)
        opt = torch.optim.SGD(sdp.parameters(), lr=LR)
        load_subnet_checkpoint(folder, sdp, opt)
        diffs.append(_max_diff(sdp.full_state_dict(), expected))
    return diffs


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
        assert fsdp["collectives"] == 2 and fsdp["bytes"] == 2 * res["shared_full_bytes"]  # all-gather + RS
        assert res["eval_full_diff"] < 1e-5 and res["ensemble_diff"] < 1e-5, res["ensemble_diff"]
        # local_full_state_dict: this rank's shard rows (torch.chunk over dim 0), NaN elsewhere
        for name, rows in res["local_rows"].items():
            chunk = -(-{"model.embed_tokens.weight": 64, "model.norm.weight": 32}[name] // world)
            assert rows == list(range(rank * chunk, (rank + 1) * chunk)), (name, rows)
        assert res["local_match"]
    model = tied_llama()
    ref = reference(model, layer_owners(sx.plan_subnetworks(model, world, 0.5, "block"), world), world).state_dict()
    for diffs in run_distributed(_resume_worker, 2, str(tmp_path), ref, timeout=300):
        assert max(diffs) < 1e-5, diffs


def test_refused_combinations():
    model = tied_llama()
    plan = sx.plan_subnetworks(model, 2, 0.5, "block")
    with pytest.raises(ValueError, match="simulate_rank"):
        sx.SubnetDataParallel(model, plan, simulate_rank=0, shard_shared=True)
    with pytest.raises(ValueError, match="sync_every=1"):
        sx.SubnetDataParallel(model, plan, sync_every=2, shard_shared=True)


@pytest.mark.parametrize("argv,message", [
    (["--shard-shared", "--method", "ddp"], "--shard-shared applies to --method sdp"),
    (["--shard-shared", "--sync-every", "2"], "--sync-every 2"),
    (["--shard-shared", "--simulate-rank", "0", "--world-size", "2"], "--simulate-rank 0"),
])
def test_cli_refuses_unsupported_combinations(argv, message, capsys):
    from subnet_ext.cli.train import build_parser, check_args

    parser = build_parser()
    with pytest.raises(SystemExit):
        check_args(parser, parser.parse_args(argv))
    assert message in capsys.readouterr().err


def test_cli_end_to_end_and_plan_prediction(tmp_path, capsys):
    import json
    import os

    from subnet_ext.cli.plan import main as plan_main
    from subnet_ext.cli.train import main

    out = str(tmp_path / "out")
    assert main(["--model", "mlp", "--data", "digits", "--steps", "4", "--batch-size", "16", "--nproc", "2",
                 "--shard-shared", "--out", out]) == 0
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    assert len(report["history"]["loss"]) == 4 and "ensemble" in report["final"]
    assert report["comm"]["fsdp"]["collectives"] == 2
    assert plan_main(["--preset", "tiny", "--world-size", "2", "--coverage", "0.5", "--shard-shared"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| sdp (")]
    assert len(rows) == 2 and "shard-shared" in rows[1]
    assert float(rows[1].split("|")[2]) < float(rows[0].split("|")[2])  # model state MiB/rank shrinks


def test_cli_resume_with_sharded_shared_matches_uninterrupted(tmp_path):
    """subnet-train --shard-shared: stopped at step 4 and resumed from the sharded checkpoint,
    the losses equal an uninterrupted run's (AdamW state saved as DTensor shards)."""
    import json

    from subnet_ext.cli.train import main

    tiny = ["--model", "mlp", "--data", "digits", "--steps", "6", "--batch-size", "16", "--nproc", "2",
            "--method", "sdp", "--shard-shared", "--save-every", "2"]

    def losses(out, *extra):
        assert main([*tiny, "--out", str(tmp_path / out), *extra]) == 0
        with open(tmp_path / out / "report.json") as f:
            return json.load(f)["history"]["loss"]

    whole = losses("whole", "--save-dir", str(tmp_path / "ck_whole"))
    assert main([*tiny, "--save-dir", str(tmp_path / "ck"), "--stop-after", "4", "--out", str(tmp_path / "first")]) == 0
    resumed = losses("resumed", "--save-dir", str(tmp_path / "ck"), "--resume")
    assert resumed == pytest.approx(whole, rel=1e-6, abs=1e-7)

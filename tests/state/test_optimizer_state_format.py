"""The full optimizer state is torch.distributed.checkpoint's: checkpoints move between DDP,
FSDP2 and SDP. A nanoGPT-style GPT (tied wte / lm_head, AdamW with a weight-decay and a
no-decay param group), 2 gloo ranks, coverage 1.0 (where SDP is data parallelism):

- DDP trains 3 steps and saves get_optimizer_state_dict(full_state_dict=True); SDP loads
  it into an optimizer built with other settings and the groups in the other order, takes
  step 4, and its update equals DDP's own step 4; the same from FSDP2; the reverse, SDP's
  state loaded into DDP (and FSDP2) by torch's set_optimizer_state_dict;
- SDP's dict has torch's structure: the same names (the tied tensor once, under torch's
  name), the same param_groups (names, settings), also at coverage 0.5 where each rank
  holds half of the blocks;
- ranks whose optimizers have different settings are refused when saving;
- a wrong format (torch's index-keyed optimizer.state_dict(), DCP's flattened form, a
  sharded one, an older form without names, a missing entry, another model's state) is
  refused with an error naming what was expected and what was given.
"""
import copy
import io

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import subnet_ext as sx
from sdp_helpers import make_model, value_error
from subnet_ext.models.gpt import GPT, GPTConfig
from subnet_ext.testing import run_distributed

CFG = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
BLOCKS = [f"transformer.h.{i}" for i in range(CFG.n_layer)]
LR, DECAY, TRAINED = 1e-2, 0.1, 3
FULL = StateDictOptions(full_state_dict=True)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def adamw(named, weight_decay=DECAY, lr=LR, reverse=False) -> torch.optim.AdamW:
    """nanoGPT's optimizer: decay on 2-D tensors, none on the rest (groups reversed on request)."""
    named = [(n, p) for n, p in named if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups[::-1] if reverse else groups, lr=lr, betas=(0.9, 0.95))


def train_step(model, opt, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    model(idx, targets)[1].backward()
    opt.step()
    opt.zero_grad()


def sdp_gpt(world, coverage=1.0):
    model = gpt()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, coverage, "block", blocks=BLOCKS))
    return sdp


def fsdp_gpt():
    model = gpt()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def update_error(before, after, expected) -> float:
    """max over tensors of |(after - before) - (expected - before)| / |expected - before|
    (2-norms, float64): the relative error of one step's update."""
    worst = 0.0
    for n, b in before.items():
        mine, want = after[n].double() - b.double(), expected[n].double() - b.double()
        worst = max(worst, ((mine - want).norm() / want.norm().clamp_min(1e-30)).item())
    return worst


def clone(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def _torch_to_sdp(rank, world, source):
    """A DDP or FSDP2 run's checkpoint after 3 steps, step 4 under SDP vs its own step 4."""
    model = DDP(gpt()) if source == "ddp" else fsdp_gpt()
    opt = adamw(model.named_parameters())
    for s in range(TRAINED):
        train_step(model, opt, rank, s)
    state = clone(get_model_state_dict(model, options=FULL))
    optim = copy.deepcopy(get_optimizer_state_dict(model, opt, options=FULL))  # torch's holds the live tensors
    train_step(model, opt, rank, TRAINED)
    expected = clone(get_model_state_dict(model, options=FULL))
    sdp = sdp_gpt(world)
    sdp.load_full_state_dict(state)
    sdp_opt = adamw(sdp.module.named_parameters(), weight_decay=0.0, lr=1.0, reverse=True)  # settings come from the file
    sdp.load_full_optimizer_state_dict(sdp_opt, optim)
    train_step(sdp, sdp_opt, rank, TRAINED)
    return update_error(state, sdp.full_state_dict(), expected), optim


def _sdp_to_torch(rank, world, target):
    """SDP's state after 3 steps loaded by torch into DDP or FSDP2, step 4 vs SDP's own."""
    sdp = sdp_gpt(world)
    opt = adamw(sdp.module.named_parameters())
    for s in range(TRAINED):
        train_step(sdp, opt, rank, s)
    state, optim = clone(sdp.full_state_dict()), sdp.full_optimizer_state_dict(opt)
    train_step(sdp, opt, rank, TRAINED)
    expected = sdp.full_state_dict()
    model = DDP(gpt()) if target == "ddp" else fsdp_gpt()
    set_model_state_dict(model, clone(state), options=FULL)  # torch renames the keys of what it is given
    torch_opt = adamw(model.named_parameters(), weight_decay=0.0, lr=1.0, reverse=True)
    set_optimizer_state_dict(model, torch_opt, copy.deepcopy(optim), options=FULL)
    train_step(model, torch_opt, rank, TRAINED)
    return update_error(state, clone(get_model_state_dict(model, options=FULL)), expected), optim


def _wrong_formats(world, ddp_state):
    """{case: the error's message (or None when accepted)} for loads SDP must refuse."""
    sdp = sdp_gpt(world)
    opt = adamw(sdp.module.named_parameters())
    indexed = DDP(gpt())
    indexed_opt = adamw(indexed.named_parameters())
    indexed(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    indexed_opt.step()
    missing = {"state": {n: v for n, v in ddp_state["state"].items() if n != "transformer.h.1.mlp.c_fc.weight"},
               "param_groups": ddp_state["param_groups"]}
    other = DDP(make_model())
    other_opt = torch.optim.AdamW(other.parameters())
    nn.functional.cross_entropy(other(torch.randn(2, 12)), torch.tensor([0, 1])).backward()
    other_opt.step()
    cases = {
        "indexed": indexed_opt.state_dict(),
        "flattened": get_optimizer_state_dict(indexed, indexed_opt, options=StateDictOptions(
            full_state_dict=True, flatten_optimizer_state_dict=True)),
        "older_form": {"state": ddp_state["state"], "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in ddp_state["param_groups"]]},
        "missing": missing,
        "other_model": get_optimizer_state_dict(other, other_opt, options=FULL),
    }
    out = {case: value_error(lambda: sdp.load_full_optimizer_state_dict(opt, state)) for case, state in cases.items()}
    sdp.load_full_optimizer_state_dict(opt, missing, strict=False)  # torch's strict=False: accepted
    return out


def _sharded_fsdp_state(rank):
    """A sharded (full_state_dict=False) FSDP2 optimizer state, which holds DTensors."""
    model = fsdp_gpt()
    opt = adamw(model.named_parameters())
    train_step(model, opt, rank, 0)
    return get_optimizer_state_dict(model, opt)


def as_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _worker(rank, world):
    out = {}
    out["ddp_to_sdp"], ddp_state = _torch_to_sdp(rank, world, "ddp")
    out["fsdp_to_sdp"], fsdp_state = _torch_to_sdp(rank, world, "fsdp")
    out["sdp_to_ddp"], sdp_state = _sdp_to_torch(rank, world, "ddp")
    out["sdp_to_fsdp"], _ = _sdp_to_torch(rank, world, "fsdp")
    # Both dicts describe 3 AdamW steps from the same start on the same batches.
    out["states"] = {"ddp": ddp_state, "fsdp": fsdp_state, "sdp": sdp_state}
    half = sdp_gpt(world, 0.5)  # each rank holds one of the two blocks
    half_opt = adamw(half.module.named_parameters())
    train_step(half, half_opt, rank, 0)
    out["states"]["sdp_half"] = half.full_optimizer_state_dict(half_opt)
    out["states"] = as_bytes(out["states"])  # tensors in the result queue would be shared memory of a dead worker
    out["wrong"] = _wrong_formats(world, ddp_state)
    uneven = sdp_gpt(world)  # each rank a different lr: owners would diverge, so saving refuses
    out["differing_settings"] = value_error(lambda: uneven.full_optimizer_state_dict(
        adamw(uneven.module.named_parameters(), lr=LR * (1 + rank))))
    sdp, sharded = sdp_gpt(world), _sharded_fsdp_state(rank)
    out["wrong"]["sharded"] = value_error(lambda: sdp.load_full_optimizer_state_dict(
        adamw(sdp.module.named_parameters()), sharded))
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=600)


@pytest.mark.parametrize("case", ["ddp_to_sdp", "fsdp_to_sdp", "sdp_to_ddp", "sdp_to_fsdp"])
def test_a_checkpoint_resumes_with_the_same_update(results, case):
    for rank, res in enumerate(results):
        assert res[case] <= 1e-6, (rank, case, res[case])


def test_sdp_writes_torchs_format(results):
    states = torch.load(io.BytesIO(results[0]["states"]))
    ddp, fsdp, sdp, half = states["ddp"], states["fsdp"], states["sdp"], states["sdp_half"]
    assert "lm_head.weight" not in ddp["state"] and "transformer.wte.weight" in ddp["state"]  # the tie, torch's way
    for theirs in (fsdp, sdp, half):
        assert list(theirs["state"]) == list(ddp["state"])
        assert theirs["param_groups"] == ddp["param_groups"], (theirs["param_groups"], ddp["param_groups"])
        for n, entries in ddp["state"].items():
            assert sorted(theirs["state"][n]) == sorted(entries), n
            assert all(type(theirs["state"][n][k]) is torch.Tensor and theirs["state"][n][k].shape == v.shape
                       for k, v in entries.items()), n
    for n, entries in ddp["state"].items():  # the same 3 steps: the same state
        for k, v in entries.items():
            assert torch.allclose(sdp["state"][n][k], v, rtol=1e-5, atol=1e-7), (n, k)
    assert all(float(e["step"]) == 1.0 for e in half["state"].values())


@pytest.mark.parametrize("case, given", [
    ("indexed", "keyed by parameter index"),
    ("flattened", "flattened form"),
    ("older_form", "without 'params'"),
    ("missing", "'transformer.h.1.mlp.c_fc.weight'"),
    ("other_model", "names this model does not have"),
    ("sharded", "sharded values"),
])
def test_a_wrong_format_is_named(results, case, given):
    for res in results:
        message = res["wrong"][case]
        assert message is not None, case
        assert given in message, message
        if case != "missing":
            assert "get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))" \
                in message, message


def test_ranks_with_different_settings_are_refused(results):
    for res in results:
        message = res["differing_settings"]
        assert message is not None and "param group 0 has different settings" in message, message
        assert f"lr: [{LR}, {2 * LR}]" in message, message

"""The silent traps of a DDP script ported to SDP now raise or behave as in DDP.

- An optimizer built before wrapping (nanoGPT's `configure_optimizers` order) holds the
  Parameters the engine replaced or does not train: refused at its first step, naming one.
- `sdp.module.state_dict()` / `sdp.state_dict()` / `load_state_dict()` of a rank's
  subnetwork raise, pointing to full_state_dict(); where the rank holds the whole model
  unchanged they work and load strictly into a fresh model.
- DDP's `require_backward_grad_sync` attribute: the collectives counted by wrapping
  torch.distributed's functions equal no_sync()'s, and the gradients are the same.

One process (a simulated rank of a 2-rank plan: the same surgery as a real rank) for the
first two; 2 gloo ranks for the attribute.
"""
import pytest
import torch
import torch.distributed as dist

import subnet_ext as sx
from subnet_ext.engine.guards.optimizer_guard import StaleOptimizerError
from subnet_ext.engine.guards.state_dict_guard import PartialStateError
from subnet_ext.models.gpt import GPT, GPTConfig
from subnet_ext.testing import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:SubnetPlan")

CFG = GPTConfig(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32)
VARIANTS = [("block", "forward"), ("block", "backward"), ("neuron", "forward"), ("neuron", "backward")]


def gpt(seed=0, parallel=False):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG.__dict__, "parallel_residual": parallel}))


def tokens(step, rank=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, CFG.vocab_size, (4, 16), generator=g)


def one_step(module, opt, step=0):
    x = tokens(step)
    _, loss = module(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad()


def wrap(model, coverage, level, regime):
    return sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 2, coverage, level), regime=regime, simulate_rank=0)


def unit_names(model):
    """The state-dict names of the GPT's units (everything under transformer.h)."""
    return {n for n, _ in model.named_parameters() if n.startswith("transformer.h.")}


# --------------------------------------------------------------------------- optimizer built before wrapping
@pytest.mark.parametrize("level,regime", VARIANTS)
def test_optimizer_built_before_wrapping_is_refused_at_its_first_step(level, regime):
    model = gpt()
    units = unit_names(model)
    opt = model.configure_optimizers(0.1, 1e-2)  # nanoGPT: before wrapping
    sdp = wrap(model, 0.5, level, regime)
    x = tokens(0)
    sdp(x, x)[1].backward()
    with pytest.raises(StaleOptimizerError) as info:
        opt.step()
    message = str(info.value)
    named = [n for n in units if n in message]
    assert named, message  # names a unit parameter by its model name
    assert "sdp.parameters()" in message and "sdp.named_parameters()" in message and "after" in message, message
    # Built after wrapping, from the engine's named parameters, the same optimizer steps and
    # trains the units (their values change).
    opt = sdp.module.configure_optimizers(0.1, 1e-2, params=sdp.named_parameters())
    before = [p.detach().clone() for p in sdp.parameters()]
    opt.step()
    moved = [n for (n, p), b in zip(sdp.named_parameters(), before) if not torch.equal(p, b)]
    assert any(".h." in n for n in moved), moved


def test_optimizer_over_a_subset_or_another_model_passes():
    model, other = gpt(), gpt(seed=1)
    before_wrapping = list(model.parameters())
    sdp = wrap(model, 0.5, "neuron", "forward")
    trained = {id(p) for p in sdp.parameters()}
    shared = [p for n, p in sdp.named_parameters() if ".h." not in n]
    for opt in (torch.optim.SGD(shared, lr=0.1),
                torch.optim.SGD(list(sdp.parameters()) + list(other.parameters()), lr=0.1)):
        one_step(sdp, opt)
    # Param groups added later are checked at the next step.
    opt = torch.optim.SGD(shared, lr=0.1)
    one_step(sdp, opt)
    opt.add_param_group({"params": [next(other.parameters())]})  # a model the engine never saw: fine
    one_step(sdp, opt)
    opt.add_param_group({"params": [p for p in before_wrapping if id(p) not in trained]})
    with pytest.raises(StaleOptimizerError, match=r"transformer\.h\.0\.attn\.c_attn\.weight"):
        one_step(sdp, opt)


def test_optimizer_built_before_wrapping_at_block_level_coverage_one_is_unchanged():
    """Nothing is replaced at block level, coverage 1: the pre-wrap optimizer is the same as
    one built after wrapping, and trains the same values."""
    results = []
    for before in (True, False):
        model = gpt()
        opt = model.configure_optimizers(0.1, 1e-2) if before else None
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 1, 1.0, "block"))
        opt = opt or sdp.module.configure_optimizers(0.1, 1e-2, params=sdp.named_parameters())
        for s in range(3):
            one_step(sdp, opt, s)
        results.append(sdp.full_state_dict())
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


# --------------------------------------------------------------------------- the wrapped model's state dict
@pytest.mark.parametrize("level,regime", [("block", "forward"), ("neuron", "forward"), ("neuron", "backward")])
def test_subnetwork_state_dict_raises_pointing_to_full_state_dict(level, regime):
    model = gpt()
    sdp = wrap(model, 0.5, level, regime)
    for call in (sdp.module.state_dict, sdp.state_dict, torch.compile(sdp).state_dict):
        with pytest.raises(PartialStateError, match="full_state_dict"):
            call()
    for module in (sdp.module, sdp):
        with pytest.raises(PartialStateError, match="load_full_state_dict"):
            module.load_state_dict(gpt(seed=1).state_dict())
    # The engine's own views still work: the local full-shape state has every original entry.
    assert set(sdp.local_full_state_dict()) == set(gpt().state_dict())


@pytest.mark.parametrize("coverage,level,regime", [(1.0, "block", "forward"), (1.0, "neuron", "forward"),
                                                   (0.5, "block", "backward")])
def test_state_dict_of_a_whole_model_loads_strictly(coverage, level, regime):
    """This rank holds every tensor with its original name and shape: the state dict is the
    model's (as DDP's), loads strictly into a fresh GPT, and loading it works both ways."""
    model = gpt()
    sdp = wrap(model, coverage, level, regime)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    one_step(sdp, opt)
    state = sdp.module.state_dict()
    fresh = gpt(seed=1)
    fresh.load_state_dict(state, strict=True)
    x = tokens(5)
    assert torch.equal(fresh(x)[0], sdp(x)[0])
    assert list(sdp.state_dict()) == [f"module.{n}" for n in state]  # DDP's names
    sdp.module.load_state_dict(gpt(seed=2).state_dict())
    assert torch.equal(sdp(x)[0], gpt(seed=2)(x)[0])


# --------------------------------------------------------------------------- require_backward_grad_sync (2 ranks)
COLLECTIVES = [name for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                                  "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                                  "reduce_scatter", "all_to_all_single") if hasattr(dist, name)]


class CountedCollectives:
    """Counts calls of torch.distributed's collective functions (the engine and FSDP2 call
    them through the module), whatever the engine's own counter says."""

    def __init__(self):
        self.count, self.originals = 0, {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = self.originals[name] = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _accumulate(rank, world, level, regime, shard_shared, parallel, how, micro_steps=3):
    """The micro-batches of one optimizer step; returns (collectives during them, gradients
    after them, the attribute's value at the end)."""
    model = gpt(parallel=parallel)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, level), regime=regime, shard_shared=shard_shared)
    with CountedCollectives() as counted:
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            x = tokens(micro, rank)
            if how == "attribute":
                sdp.require_backward_grad_sync = last  # nanoGPT's line
            context = sdp.no_sync() if how == "no_sync" and not last else torch.enable_grad()
            with context:
                (sdp(x, x)[1] / micro_steps).backward()
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()  # FSDP2: this rank's shard
             for n, p in sdp.named_parameters()}
    return counted.count, grads, sdp.require_backward_grad_sync


def _attribute_worker(rank, world):
    out = {}
    for level, regime, shard, parallel in (("block", "forward", False, False), ("neuron", "backward", False, True),
                                           ("block", "forward", True, False)):
        runs = {how: _accumulate(rank, world, level, regime, shard, parallel, how)
                for how in ("attribute", "no_sync", "plain")}
        out[(level, regime, shard)] = {
            "counts": {how: r[0] for how, r in runs.items()},
            "same_grads": all(torch.equal(runs["attribute"][1][n], runs["no_sync"][1][n]) for n in runs["no_sync"][1]),
            "flag_after": {how: r[2] for how, r in runs.items()}}
        if shard:  # the FSDP2 shards are not the model's tensors either
            model = gpt()
            sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 1.0, "block"), shard_shared=True)
            try:
                sdp.module.state_dict()
                out["shard_state_dict"] = "no error"
            except PartialStateError as e:
                out["shard_state_dict"] = str(e)
    return out


def test_require_backward_grad_sync_communicates_like_no_sync():
    for r in run_distributed(_attribute_worker, 2):
        for key, v in ((k, v) for k, v in r.items() if isinstance(k, tuple)):
            counts = v["counts"]
            assert counts["attribute"] == counts["no_sync"] < counts["plain"], (key, counts)
            assert counts["no_sync"] > 0, (key, counts)
            assert v["same_grads"], key
            assert v["flag_after"] == {"attribute": True, "no_sync": True, "plain": True}, (key, v["flag_after"])
        assert "DTensor" in r["shard_state_dict"] and "full_state_dict" in r["shard_state_dict"], r["shard_state_dict"]


# ------------------------------------------------------------------------- the documented import spellings
def test_checkpoint_module_imports_as_the_readme_writes_it():
    import subprocess
    import sys

    code = ("import subnet_ext.checkpoint\n"
            "from subnet_ext.checkpoint import save_subnet_checkpoint, load_subnet_checkpoint\n"
            "import subnet_ext\n"
            "assert subnet_ext.checkpoint.save_subnet_checkpoint is save_subnet_checkpoint\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)  # a fresh interpreter
    assert done.returncode == 0, done.stderr

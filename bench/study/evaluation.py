"""Validation loss of the models a user could keep after training (all collective).

- every method: the full model. Replicas (DDP) and plain copies each evaluate 1/K of the
  held-out batches and the sums are all-reduced; FSDP2 runs its sharded model likewise.
- stochastic depth: the full model with its branches scaled by the survival probability
  (the paper's rule, "full") and without ("full_unscaled").
- SDP: the assembled union ("full"); the union with each block's residual branches scaled
  by its owner fraction c_u/K ("full_scaled", block level: stochastic depth's rule, placed in
  the weights by engine/regimes/residual_scale.py); each rank's subnetwork cut from the assembled
  state ("subnetworks", one loss per rank; in the forward regime what the rank trained, in
  the backward regime the full model with the blocks or neurons the rank does not own
  removed); and their ensemble ("ensemble": the mean of the subnetworks' logits).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from subnet_ext.jobs.methods import eval_mode
from subnet_ext.jobs.tasks import logits_of
from subnet_ext.engine.regimes.residual_scale import scale_full_state


def _all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _add(sums: list[float], score: tuple) -> list[float]:
    """Running [summed loss, correct, count] plus one task.score() result."""
    return [a + b for a, b in zip(sums, score)]


@torch.no_grad()
def _sums(model, task, batches, device) -> list[float]:
    sums = [0.0, 0.0, 0.0]
    with eval_mode(model):
        for x, y in batches:
            sums = _add(sums, task.score(model(x.to(device)), y.to(device)))
    return sums


def sharded_metrics(model, task, batches: list, device, pad: bool = False) -> tuple[float, float]:
    """(mean loss in nats per token or sample, accuracy) of `model` over `batches`, each rank scoring
    batches[rank::K] (collective). pad: ranks with fewer batches run one more forward on a batch they
    do not score, so every rank calls the model equally often (FSDP2's forwards are collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = batches[rank::world]
    sums = _sums(model, task, mine, device)
    if pad and len(mine) < -(-len(batches) // world):
        _sums(model, task, batches[:1], device)
    loss, correct, count = _all_sum(sums, device)
    return loss / count, correct / count


def subnetwork_of(full: torch.nn.Module, plan, rank: int) -> torch.nn.Module:
    """Rank `rank`'s subnetwork of the plan, cut from a copy of the full model (forward-regime surgery)."""
    from subnet_ext.engine.regimes.module_swaps import ModuleSwaps
    from subnet_ext.engine.regimes.surgery import materialise_forward
    from subnet_ext.planning.pieces import global_pieces

    sub = copy.deepcopy(full)  # a copy: its swaps (width-kept projections) are never undone
    materialise_forward(sub, plan, global_pieces(plan), rank, "none", ModuleSwaps())
    return sub


@torch.no_grad()
def subnetworks_and_ensemble(sub, task, batches, device) -> tuple[list[tuple], tuple]:
    """([(loss, accuracy) of every rank's subnetwork], (loss, accuracy) of the ensemble): each rank
    runs its subnetwork on every batch; the logits' mean over ranks is one all-reduce per batch
    (collective)."""
    world = dist.get_world_size()
    own, ens = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    with eval_mode(sub):
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            logits = logits_of(sub(x)).float()
            own = _add(own, task.score(logits, y))
            dist.all_reduce(logits)
            ens = _add(ens, task.score(logits / world, y))
    gathered = [None] * world
    dist.all_gather_object(gathered, own)
    return [(s[0] / s[2], s[1] / s[2]) for s in gathered], (ens[0] / ens[2], ens[1] / ens[2])


def evaluate_method(kind: str, method, task, batches: list, device, stochastic=None, every_model=True) -> dict:
    """{"loss": {mode: value}, "accuracy": {mode: value}} of the run's models, plus for SDP
    "subnetworks": {"loss": [per rank], "accuracy": [per rank]}; collective.
    kind: "ddp", "fsdp" or "sdp"; stochastic: the run's StochasticDepth, if any;
    every_model False: the full model only (the curves' points between the protocols' marks)."""
    if kind == "fsdp":
        return _as_metrics({"full": sharded_metrics(method.module, task, batches, device, pad=True)})
    if kind == "ddp":
        out = {"full": sharded_metrics(method.module, task, batches, device)}
        if stochastic is not None and every_model:
            stochastic.scale_at_eval = False
            try:
                out["full_unscaled"] = sharded_metrics(method.module, task, batches, device)
            finally:
                stochastic.scale_at_eval = True
        return _as_metrics(out)
    plan, sdp = method.plan, method.sdp
    full = sdp.full_model()  # collective: the assembled union of the subnetworks
    out = {"full": sharded_metrics(full, task, batches, device)}
    if not every_model:
        return _as_metrics(out)
    if plan.level == "block":  # stochastic depth's rule in the weights (engine/regimes/residual_scale.py), on a copy
        scaled = copy.deepcopy(full)
        scaled.load_state_dict(scale_full_state(full.state_dict(), plan, full, "owner_fraction"))
        out["full_scaled"] = sharded_metrics(scaled, task, batches, device)
    sub = subnetwork_of(full, plan, dist.get_rank())
    subnetworks, out["ensemble"] = subnetworks_and_ensemble(sub, task, batches, device)
    metrics = _as_metrics(out)
    if method.sdp.config.regime == "forward":  # the cut equals what the rank trained: checked on one batch
        metrics["subnetwork_check"] = _max_difference(sub, method.sdp.module, batches[0][0].to(device))
    metrics["subnetworks"] = {"loss": [s[0] for s in subnetworks], "accuracy": [s[1] for s in subnetworks]}
    return metrics


@torch.no_grad()
def _max_difference(a, b, x) -> float:
    """Largest |a(x) - b(x)| of two models' logits in eval mode, over all ranks (collective)."""
    with eval_mode(a), eval_mode(b):
        diff = (logits_of(a(x)).float() - logits_of(b(x)).float()).abs().max().reshape(1).double()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff.item())


def _as_metrics(pairs: dict) -> dict:
    """{mode: (loss, accuracy)} -> {"loss": {mode: loss}, "accuracy": {mode: accuracy}}."""
    return {"loss": {m: v[0] for m, v in pairs.items()}, "accuracy": {m: v[1] for m, v in pairs.items()}}

"""torch.compile over a wrapped engine: `torch.compile(sdp)` (wrap first, then compile).

Forward regime: the subnetwork compiles into one graph (fullgraph=True: no graph break)
and follows the eager loss trajectory. Backward regime: runs correctly, with graph breaks
where the owned linear layers' autograd.Function writes gradients straight into the
communication buckets (a side effect dynamo does not trace); the writes happen once per
use, as in eager. The masked op compiles without a break, forward and backward.

One process: the engine simulates rank 0 of 2 (collectives are no-ops that count), a
tiny model, 3 steps. Backend "aot_eager" (dynamo capture + AOT autograd, the parts that
decide graph breaks and correctness) keeps compile time small on 2 cores; inductor was
checked by hand (docs/user-guide.md, torch.compile).
"""
import torch
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, counting_direct_writes, make_model

BACKEND = "aot_eager"


def _trajectory(regime, level, coverage, compile_kwargs=None):
    """(losses of 3 SGD steps, DirectGradient.write calls, collectives issued, graph breaks)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model(width=8)
    plan = sx.plan_subnetworks(model, 2, coverage, level)
    sdp = sx.SubnetDataParallel(model, plan, regime=regime, simulate_rank=0)
    run = sdp if compile_kwargs is None else torch.compile(sdp, backend=BACKEND, **compile_kwargs)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.5)
    losses = []
    with counting_direct_writes() as writes:
        for s in range(3):
            x, y = batch(0, s)
            loss = F.cross_entropy(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert sdp.comm_stats()["steps"] == 3
    return losses, writes[0], sdp.comm_stats()["collectives"], sum(counters["graph_break"].values())


def _close(a, b):
    return all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b))


def test_compiled_forward_regime_is_one_graph_and_matches_eager():
    eager = _trajectory("forward", "neuron", 0.5)
    compiled = _trajectory("forward", "neuron", 0.5, {"fullgraph": True})  # raises on any graph break
    assert compiled[3] == 0 and _close(eager[0], compiled[0]), (eager, compiled)
    assert compiled[2] == eager[2] > 0  # the same averaging collectives


def test_compiled_backward_regime_matches_eager():
    eager = _trajectory("backward", "neuron", 1.0)  # coverage 1.0: owners {0, 1}, direct writes
    compiled = _trajectory("backward", "neuron", 1.0, {})
    assert eager[1] > 0 and compiled[1] == eager[1], (eager, compiled)  # once per use, not per trace
    assert compiled[2] == eager[2] and _close(eager[0], compiled[0]), (eager, compiled)


def test_masked_linear_compiles_without_graph_break():
    torch._dynamo.reset()
    rows, cols = torch.tensor([0, 2, 3]), torch.tensor([1, 4])
    x, w = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)

    def f(x, w):
        return sx.masked_linear(x, w, None, rows, cols).square().sum()

    f(x, w).backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    torch.compile(f, backend=BACKEND, fullgraph=True)(x, w).backward()
    assert torch.allclose(x.grad, expected[0]) and torch.allclose(w.grad, expected[1])

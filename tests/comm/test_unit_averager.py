"""BucketedAverager and CopyRefresher in one process: K ranks as K threads, each with its own
model after the engine's surgery (simulate_rank) and its own averager, meeting in a
communicator that sums their buffers in memory. No process group.

Reference: each rank's gradients and values are drawn in full-model coordinates; the
expected result of averaging among owners is computed from the plan's pieces alone
(tests/rank_views.py), and compared with what each rank's local tensors hold after."""
import copy
import threading

import pytest
import torch

import subnet_ext as sx
from rank_views import local_views, owners_mean
from sdp_helpers import make_model
from subnet_ext.comm.averaging import BucketedAverager
from subnet_ext.comm.communicator import CommCounter, Communicator, PendingCollective, SimulatedCommunicator
from subnet_ext.comm.refresh import CopyRefresher
from subnet_ext.planning.buckets import refresh_broadcasts
from subnet_ext.planning.buckets import build_buckets
from subnet_ext.planning.pieces import global_pieces

WORLD = 4


class Exchange:
    """Where the threads' collectives meet: the n-th collective on an owner set (or from a
    source) collects every participant's buffer, and each waits for the others."""

    def __init__(self):
        self.cond, self.parts = threading.Condition(), {}

    def put(self, key, rank, buffer):
        with self.cond:
            self.parts.setdefault(key, {})[rank] = buffer.clone()
            self.cond.notify_all()

    def wait_all(self, key, ranks) -> dict:
        with self.cond:
            if not self.cond.wait_for(lambda: set(self.parts.get(key, {})) >= set(ranks), timeout=60):
                raise TimeoutError(f"collective {key} never completed: {sorted(self.parts.get(key, {}))} of {ranks}")
            return self.parts[key]


class _Pending(PendingCollective):
    def __init__(self, exchange, key, owners, buffer):
        super().__init__(None, "all_reduce", str(owners), None)
        self.exchange, self.key, self.owners, self.buffer = exchange, key, owners, buffer

    def wait(self):
        parts = self.exchange.wait_all(self.key, self.owners)
        self.buffer.copy_(torch.stack([parts[r] for r in self.owners]).sum(0))


class ThreadCommunicator(Communicator):
    """A real (not simulated) communicator whose collectives are sums over the threads' buffers."""

    simulated = False

    def __init__(self, exchange: Exchange, world_size: int, rank: int):
        self.world_size, self.rank, self.process_group, self.counter = world_size, rank, None, CommCounter()
        self.timeout, self.groups, self.world_group = None, {}, None
        self.exchange, self.calls = exchange, {}

    def _key(self, what):
        n = self.calls[what] = self.calls.get(what, 0) + 1
        return what, n

    def all_reduce(self, buffer, owners, quantity):
        self.counter.add(quantity, buffer)
        key = self._key(("all_reduce", owners))
        self.exchange.put(key, self.rank, buffer)
        return _Pending(self.exchange, key, owners, buffer)

    def broadcast(self, buffer, src, quantity):
        self.counter.add(quantity, buffer)
        key = self._key(("broadcast", src))
        self.exchange.put(key, self.rank, buffer)
        buffer.copy_(self.exchange.wait_all(key, range(self.world_size))[src])


def ranks_of(level, regime, strategy, cap_mb=0.002):
    """[(engine simulating rank r, its own averager on the threads' communicator)] for r < WORLD."""
    model = make_model()
    plan = sx.plan_subnetworks(copy.deepcopy(model), WORLD, 0.5, level)
    buckets = build_buckets(plan, global_pieces(plan), strategy, cap_mb * 2**20)
    exchange, out = Exchange(), []
    for r in range(WORLD):
        sdp = sx.SubnetDataParallel(copy.deepcopy(model), plan, regime=regime, simulate_rank=r)
        averager = BucketedAverager(buckets, r, ThreadCommunicator(exchange, WORLD, r), torch.device("cpu"),
                                    sdp.layout.averaging_places())
        out.append((sdp, averager))
    return plan, out


def on_threads(fns):
    """Run fns[r]() on one thread each; re-raise the first error."""
    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def full_draws(plan, seed):
    """[{name: full-shape random tensor}] per rank (float parameters)."""
    out = []
    for r in range(WORLD):
        g = torch.Generator().manual_seed(seed + r)
        out.append({n: torch.randn(shape, generator=g) for n, shape in plan.tensor_shapes.items()
                    if n in plan.param_names})
    return out


@pytest.mark.parametrize("strategy", ["groups", "zero_filled"])
@pytest.mark.parametrize("level,regime", [("block", "forward"), ("neuron", "forward"), ("neuron", "backward")])
def test_gradients_are_averaged_among_owners(level, regime, strategy):
    plan, ranks = ranks_of(level, regime, strategy)
    grads = full_draws(plan, 100)
    missing = "head.weight"  # shared; rank 0's gets no gradient this backward: its zeros join the mean
    grads[0][missing] = torch.zeros_like(grads[0][missing])
    for r, (sdp, _) in enumerate(ranks):
        for param, name, view in local_views(plan, r, sdp.module):
            if param.requires_grad:
                param.grad = None if (r == 0 and name == missing) else view(grads[r][name]).clone()
    on_threads([lambda a=a: a.average_now("gradients") for _, a in ranks])
    expected = owners_mean(plan, grads)
    for r, (sdp, averager) in enumerate(ranks):
        homes = averager._homes
        for param, name, view in local_views(plan, r, sdp.module):
            if not param.requires_grad:
                continue
            assert param.grad is not None, (r, name)
            torch.testing.assert_close(param.grad, view(expected[name]), rtol=1e-6, atol=1e-6, msg=f"{r} {name}")
            if id(param) in homes:  # communicated: the gradient now lives in the averager's home
                assert param.grad.data_ptr() == homes[id(param)].data_ptr(), (r, name)
    assert sum(a.comm.counter.collectives for _, a in ranks) > WORLD  # several buckets per rank


@pytest.mark.parametrize("level,regime", [("block", "forward"), ("neuron", "backward")])
def test_parameters_are_averaged_among_owners(level, regime):
    plan, ranks = ranks_of(level, regime, "groups")
    values = full_draws(plan, 200)
    for r, (sdp, _) in enumerate(ranks):
        with torch.no_grad():
            for param, name, view in local_views(plan, r, sdp.module):
                if regime == "backward":  # full tensors: the owned-slice Parameters are views of them
                    sdp.layout.value_of(name).copy_(values[r][name])
                else:
                    param.copy_(view(values[r][name]))
    on_threads([lambda a=a: a.average_now("parameters") for _, a in ranks])
    expected = owners_mean(plan, values)
    for r, (sdp, _) in enumerate(ranks):
        for param, name, view in local_views(plan, r, sdp.module):
            if regime == "forward" or param.requires_grad:  # owned: averaged among its owners
                torch.testing.assert_close(param.detach(), view(expected[name]), rtol=1e-6, atol=1e-6)


def test_simulated_rank_keeps_its_own_gradients():
    plan, ranks = ranks_of("neuron", "forward", "groups")
    sdp = ranks[1][0]
    averager = BucketedAverager(build_buckets(plan, global_pieces(plan), "groups", 0.002 * 2**20), 1,
                                SimulatedCommunicator(WORLD, 1, CommCounter()), torch.device("cpu"),
                                sdp.layout.averaging_places())
    grads = full_draws(plan, 300)[1]
    for param, name, view in local_views(plan, 1, sdp.module):
        param.grad = view(grads[name]).clone()
    averager.average_now("gradients")
    for param, name, view in local_views(plan, 1, sdp.module):
        assert torch.equal(param.grad, view(grads[name])), name  # "as if every owner held this rank's values"
    assert averager.comm.counter.collectives > 0


def test_refresh_gives_every_rank_the_leaders_values():
    plan, ranks = ranks_of("neuron", "backward", "groups")
    values = full_draws(plan, 400)
    refreshers = []
    for r, (sdp, _) in enumerate(ranks):
        layout = sdp.layout
        with torch.no_grad():
            for name in plan.param_names:
                layout.value_of(name).copy_(values[r][name])
        refreshers.append(CopyRefresher(refresh_broadcasts(plan, layout.pieces), r, layout.averaging_places(),
                                        ThreadCommunicator(ranks[0][1].comm.exchange, WORLD, r)))
    on_threads(refreshers)
    for r, (sdp, _) in enumerate(ranks):
        for p in global_pieces(plan):
            if not p.is_param or len(p.owners) == WORLD:
                continue  # every rank owns it: nothing to refresh
            source = r if r in p.owners else p.leader  # owners keep their own; the others take the leader's
            got = sdp.layout.value_of(p.name).narrow(p.dim, p.start, p.length)
            assert torch.equal(got, values[source][p.name].narrow(p.dim, p.start, p.length)), (r, p)

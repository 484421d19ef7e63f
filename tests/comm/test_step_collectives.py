"""The training step's collectives wait without a host deadline; their deadline is their
process group's timeout, set when the engine makes its groups.

On NCCL, `work.wait(timeout)` makes the host wait for the collective (once per bucket),
while `work.wait()` only orders the current stream after it. Here torch.distributed is
replaced by a recorder (no processes): which groups the Communicator makes, with which
timeout, and how it waits. That a dead peer is still an error within the timeout is
tests/engine/test_reliability_distributed.py::test_absent_peer_times_out_naming_op_and_group.
"""
import datetime

import pytest
import torch

from subnet_ext.comm import collectives, communicator
from subnet_ext.comm.communicator import CommCounter, Communicator


class RecordingWork:
    """A finished collective that records how it was waited on."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self, *args, **kwargs):
        self.log.append((self.name, "wait", args, kwargs))
        return True


class FailingWork:
    def wait(self, *args, **kwargs):
        raise RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete")


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed as the Communicator sees it: world of 4, default group, recorded calls."""
    log = []
    d = communicator.dist
    monkeypatch.setattr(d, "new_group", lambda ranks, **kw: log.append(("new_group", tuple(ranks), kw))
                        or f"group{tuple(ranks)}")
    monkeypatch.setattr(d, "all_reduce", lambda t, group=None, async_op=False, **kw: RecordingWork(log, group))
    monkeypatch.setattr(d, "broadcast", lambda t, src, group=None, async_op=False: RecordingWork(log, group))
    return log


def test_groups_carry_the_timeout_and_waits_pass_none(fake_dist):
    comm = Communicator([(0, 1), (2, 3), (0, 1, 2, 3)], 4, 0, None, CommCounter(), timeout=7.0)
    made = {call[1]: call[2] for call in fake_dist if call[0] == "new_group"}
    # Every owner set, the world included (the world group's own timeout must not apply).
    assert set(made) == {(0, 1), (2, 3), (0, 1, 2, 3)}, made
    assert all(kw["timeout"] == datetime.timedelta(seconds=7.0) for kw in made.values()), made
    fake_dist.clear()
    comm.all_reduce(torch.zeros(3), (0, 1), "gradients").wait()
    comm.all_reduce(torch.zeros(3), (0, 1, 2, 3), "gradients").wait()
    comm.broadcast(torch.zeros(3), 2, "refresh")
    waits = [c for c in fake_dist if c[1] == "wait"]
    assert [w[0] for w in waits] == ["group(0, 1)", "group(0, 1, 2, 3)", "group(0, 1, 2, 3)"], waits
    assert all(w[2] == () and w[3] == {} for w in waits), waits  # no timeout handed to work.wait


def test_without_a_timeout_the_world_group_is_reused(fake_dist):
    comm = Communicator([(0, 1), (0, 1, 2, 3)], 4, 0, None, CommCounter(), timeout=None)
    made = [call[1] for call in fake_dist if call[0] == "new_group"]
    assert made == [(0, 1)], made
    assert comm.groups[(0, 1, 2, 3)] is communicator.dist.group.WORLD


def test_a_failed_wait_names_the_operation_group_and_timeout():
    pending = communicator.PendingCollective(FailingWork(), "all_reduce of gradients", "owner set (0, 3)", 3.0)
    with pytest.raises(collectives.CollectiveError) as e:
        pending.wait()
    assert e.value.operation == "all_reduce of gradients" and e.value.group == "owner set (0, 3)"
    assert "did not complete within 3 s" in str(e.value)


def test_off_step_wait_keeps_its_host_deadline():
    log = []
    collectives.wait(RecordingWork(log, "g"), "all_reduce", "world (2 ranks)", timeout=5.0)
    assert log == [("g", "wait", (datetime.timedelta(seconds=5.0),), {})]

"""A script that passes `timeout=` to SubnetDataParallel ends cleanly.

With a timeout the engine makes process groups of its own. Held by the engine after
`destroy_process_group()`, a gloo group used to be destroyed during the interpreter's
teardown, where its threads could abort the process ("terminate called without an active
exception", SIGABRT) after a run that succeeded: about 3 runs in 10 of the script below
(C = 1, `timeout=5`), so torchrun reported a failure and `--max-restarts` restarted a
finished job. The groups are now released at exit, before the teardown
(comm/communicator.py, `release_groups`).

RUNS consecutive 2-rank runs of a user's script (init, wrap with timeout=5, train, destroy the
group, fall off the end, the store in another process as under torchrun): every process exits
0 without "terminate called", and an exit handler the script registered before importing
subnet_ext (so it runs after the engine's) finds none of the engine's groups alive any more
(deterministic: without the release it finds one on every run).
"""
import os
import subprocess
import sys
import tempfile

import torch.distributed as dist

from subnet_ext.jobs.launch import free_port

RUNS = 5  # the same script ran 50 times in a row without an abort (docs/porting.md)
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)


# What a user writes, at the top level of the script (its engine lives in the module's globals
# until the interpreter tears them down): no `del sdp`, no os._exit.
USER_SCRIPT = """
import atexit, sys, weakref
made = []  # the engine's groups, weakly: registered before subnet_ext, this check runs after its exit handler
atexit.register(lambda: print(f"groups held at exit: {sum(g() is not None for g in made)}", flush=True))
import torch, torch.distributed as dist, torch.nn.functional as F
import subnet_ext as sx
from sdp_helpers import batch, make_model

timeout, coverage = float(sys.argv[1]), float(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = make_model()
plan = sx.plan_subnetworks(model, dist.get_world_size(), coverage, "neuron")
sdp = sx.SubnetDataParallel(model, plan, timeout=timeout)
made += [weakref.ref(g) for g in sdp.communicator.groups.values()]
opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
for step in range(10):
    x, y = batch(rank, step)
    F.cross_entropy(sdp(x), y).backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
"""


def launch(runs: int = RUNS, timeout: float = 5.0, coverage: float = 1.0) -> list:
    """`runs` consecutive 2-rank runs of USER_SCRIPT; [(run, rank, exit code, stderr tail)] of the bad ones."""
    bad = []
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "train.py")
        with open(script, "w") as f:
            f.write(USER_SCRIPT)
        for run in range(runs):
            bad += _run_once(run, script, timeout, coverage)
    return bad


def _run_once(run: int, script: str, timeout: float, coverage: float) -> list:
    """One 2-rank run of `script`; [(run, rank, exit code, stderr tail)] of the ranks that did not end cleanly.
    As under torchrun, the store lives in another process (here this one) and the workers are its clients."""
    port, procs, bad = free_port(), [], []
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, script, str(timeout), str(coverage)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        if p.returncode != 0 or "terminate called" in err or f"rank {rank} done" not in out or \
                "groups held at exit: 0" not in out:
            bad.append((run, rank, p.returncode, out[-300:] + err[-2000:]))
    del store
    return bad


def test_a_script_with_a_timeout_exits_cleanly_every_time():
    bad = launch()
    assert not bad, bad

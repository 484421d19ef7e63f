"""check_indices=False with an index out of range: an error, never an access outside the tensors.

The unchecked path skips the value validation (the engine validated its plan once), but a
bad index must still not read or write out of bounds. On CPU the op body checks the range
in one pass over the index and raises a ValueError naming the op and the values; on CUDA
the kernels assert every index on the device, which aborts the CUDA context, so that test
runs the op in a child process and reads its exit status and the assertion it printed.
Reference: the bounds each case breaks are written here by hand from the shapes.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import subnet_ext as sx
from subnet_ext.testing import DEVICES

OUT, IN, ROWS = 6, 8, 4

# (name, in_idx, out_idx, compact_weight, scatter_width, what the message names)
BAD_CASES = [
    ("in_idx past the end", [0, IN], [1, 2], False, None, "in_idx"),
    ("in_idx negative", [-1, 3], [1, 2], False, None, "in_idx"),
    ("out_idx past the weight's rows", [0, 3], [1, OUT], False, None, "out_idx"),
    ("out_idx past the scatter width", [0, 3], [1, OUT + 3], True, OUT, "out_idx"),
]


def _operands(in_idx, out_idx, compact, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, IN, generator=gen).to(device)
    rows, cols = (len(out_idx), len(in_idx)) if compact else (OUT, IN)
    w = torch.randn(rows, cols, generator=gen).to(device)
    index = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return x, w, index(in_idx), index(out_idx)


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_unchecked_bad_index_raises_on_cpu(case):
    _, in_idx, out_idx, compact, width, name = case
    x, w, ii, oi = _operands(in_idx, out_idx, compact, "cpu")
    message = rf"{name} has values in \[.*\] but must lie in \[0, \d+\) \(check_indices=False"
    with pytest.raises(ValueError, match=message):
        sx.masked_linear(x, w, None, oi, ii, compact_weight=compact, scatter_width=width, check_indices=False)
    g = torch.randn(ROWS, width if width is not None else len(out_idx))
    with pytest.raises(ValueError, match=message):
        sx.masked_linear_backward(g, x, w, oi, ii, compact_weight=compact, grad_out_full=width is not None,
                                  check_indices=False)
    if name == "in_idx" or width is not None:  # grad_weight_ bounds out_idx only by a full grad_out
        with pytest.raises(ValueError, match=message):
            sx.masked_linear_grad_weight_(torch.zeros(len(out_idx), len(in_idx)), g, x, oi, ii,
                                          grad_out_full=width is not None, check_indices=False)


_CHILD = textwrap.dedent("""
    import ast, sys, torch, subnet_ext as sx
    in_idx, out_idx, compact, width = ast.literal_eval(sys.argv[1])
    x = torch.randn(4, 8, device="cuda")
    rows, cols = (len(out_idx), len(in_idx)) if compact else (6, 8)
    w = torch.randn(rows, cols, device="cuda")
    ii, oi = (torch.tensor(v, device="cuda") for v in (in_idx, out_idx))
    sx.masked_linear(x, w, None, oi, ii, compact_weight=compact, scatter_width=width, check_indices=False)
    torch.cuda.synchronize()
    print("finished without an assert")
""")


def _start_child(in_idx, out_idx, compact, width):
    args = repr((in_idx, out_idx, compact, width))
    return subprocess.Popen([sys.executable, "-c", _CHILD, args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))


@pytest.fixture(scope="module")
def children():
    """{case name: (exit code, output) of the bad child, (exit code, output) of the same child
    with valid indices}: all children start at once (each one loads torch and a CUDA
    context: seconds), then are waited for."""
    started = {case[0]: (_start_child(*case[1:5]), _start_child([0, 3], [1, 2], case[3], case[4]))
               for case in BAD_CASES}
    done = {}
    for name, pair in started.items():
        outcome = []
        for proc in pair:
            out, _ = proc.communicate(timeout=300)
            outcome.append((proc.returncode, out))
        done[name] = tuple(outcome)
    return done


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_unchecked_bad_index_trips_the_device_assert(case, children):
    (bad_code, bad), (good_code, good) = children[case[0]]
    assert good_code == 0 and "finished without an assert" in good, good  # the same child with valid indices
    assert bad_code != 0, bad
    assert "finished without an assert" not in bad, bad
    # The kernel's own assertion fired and stopped the op at that kernel's launch check
    # (CUDA_LAUNCH_BLOCKING: without it the error surfaced at whichever later call met the
    # dead context first, e.g. cuBLAS failing to create a handle, and the kernel's message
    # could be lost with the process).
    assert "device-side assert triggered" in bad, bad
    assert "Assertion `subnet_ext.masked_linear: " in bad and "index is out of range` failed" in bad, bad

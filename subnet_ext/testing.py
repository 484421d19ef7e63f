"""Device and dtype lists every kernel test is parametrised over, and the tolerance rule.

CUDA variants appear only where a GPU is visible and the CUDA kernels were built.
"""
from __future__ import annotations

import contextlib

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HALF_DTYPES = (torch.float16, torch.bfloat16)


def cuda_ready() -> bool:
    """A GPU is visible and this build registered CUDA kernels.

    The compiled library is loaded first: importing subnet_ext does not load it, and the
    dispatcher knows the ops only once it is (asking before raises "operator
    subnet_ext::masked_linear does not exist", which on a GPU machine broke collection).
    """
    from .ops.build_info import build_info

    return torch.cuda.is_available() and build_info()["cuda_kernels_registered"]


DEVICES = ["cpu"] + (["cuda"] if cuda_ready() else [])


@contextlib.contextmanager
def max_grid_blocks(blocks: int):
    """Within the block, the CUDA index kernels launch at most `blocks` blocks per grid
    dimension (65535 otherwise), so that their grid-stride loops make several passes even
    on small inputs. Results must not change: any grid computes the same thing."""
    from .ops.build_info import load_library

    load_library()
    previous = torch.ops.subnet_ext._set_max_grid_blocks(blocks)
    try:
        yield
    finally:
        torch.ops.subnet_ext._set_max_grid_blocks(previous)


def kernel_path_count(path: str) -> int:
    """How many times this process's CUDA kernels took `path` (csrc/ops.h KernelPath): per
    launch for the masked linear's "gather_rows_vector", "gather_columns_vector",
    "gather_elements", "scatter_columns_vector", "scatter_columns_elements"; per segment of a
    work table built for pack / unpack, "segments_vector" and "segments_elements". Tests take
    it before and after a call to see which path ran (ValueError for an unknown name)."""
    from .ops.build_info import load_library

    load_library()
    return torch.ops.subnet_ext._kernel_path_count(path)


def assert_close_to_reference(out: torch.Tensor, exact: torch.Tensor, torch_at_dtype: torch.Tensor, name: str = ""):
    """Flash-attention rule for half types, tight tolerance otherwise.

    Args:
        out: the kernel's result, any dtype.
        exact: the same quantity computed in float64 (the truth).
        torch_at_dtype: PyTorch's own composition at out's dtype; its error against
            `exact` is the yardstick: the kernel may be at most twice as wrong (plus a
            floor for results that are exactly representable).
    """
    exact = exact.double()
    err = (out.double() - exact).abs().max().item() if out.numel() else 0.0
    if out.dtype in HALF_DTYPES:
        base = (torch_at_dtype.double() - exact).abs().max().item() if out.numel() else 0.0
        scale = exact.abs().max().item() if out.numel() else 0.0
        bound = 2 * base + 1e-3 * scale + 1e-5
    else:
        eps = torch.finfo(out.dtype).eps
        scale = exact.abs().max().item() if out.numel() else 0.0
        bound = 64 * eps * max(scale, 1.0)
    assert err <= bound, f"{name}: max error {err:.3e} exceeds bound {bound:.3e} ({out.dtype})"


def _distributed_entry(rank, world_size, port, fn, args, queue, backend="gloo"):
    import os

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank, current before the group exists (as launch.pick_backend)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as e:  # report, do not hang the parent
        import traceback

        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        from .jobs.launch import exit_worker, shutdown_distributed

        shutdown_distributed()
        queue.close()
        queue.join_thread()  # the result is in the pipe before the process ends
    exit_worker(0)  # the outcome travels in the queue


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, backend: str = "gloo") -> list:
    """Run fn(rank, world_size, *args) in `world_size` processes on 127.0.0.1.

    Each process gets one thread and a fresh free port, so tests never collide. `backend`:
    "gloo" (CPU tensors, and CUDA tensors staged through host memory) or "nccl" (rank r
    on cuda:(r % GPUs), made current before init_process_group).
    Returns the per-rank results; raises RuntimeError with every failing rank's
    traceback, or after `timeout` seconds (killing the workers) instead of hanging.
    """
    import queue as queue_mod
    import time

    import torch.multiprocessing as mp

    from .jobs.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_distributed_entry, args=(r, world_size, port, fn, args, q, backend),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    first_error = None
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if errors and first_error is not None and time.monotonic() - first_error > 15:
                break  # the others are likely waiting on the failed rank in a collective
            if left <= 0:
                raise RuntimeError(f"run_distributed: {world_size - len(results) - len(errors)} rank(s) did not "
                                   f"finish within {timeout:.0f} s (results from {sorted(results)})")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not any(i in results or i in errors for i in dead):
                    raise RuntimeError(f"run_distributed: rank(s) {dead} died (exit codes "
                                       f"{[procs[i].exitcode for i in dead]})")
                continue
            (results if status == "ok" else errors)[rank] = value
            if status != "ok" and first_error is None:
                first_error = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]

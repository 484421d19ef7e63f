"""Gradient reductions with real gloo processes: reduce_dtype and the comm hooks.

One spawn of 4 ranks and one of 2 for the module (module-scoped fixtures). Each rank trains
the same small model (neuron level, forward regime, small buckets) under several engines in
turn, 3 SGD steps each, and at every step takes its own gradient of the step's batch under
no_sync() before the averaged one. Against references the test computes from those own
gradients, gathered from every rank in full-model coordinates:

- bf16 / fp16 on the wire (reduce_dtype, the fp16 hook, zero-filled buckets too): each
  averaged gradient equals the owners' gradients divided by the group's size, rounded to the
  wire dtype, summed in fp32 and rounded again (exact for two owners: one rounding of one
  sum), times group size / owner count; for more owners within the rounding of each
  addition, and still a value of the wire dtype.
- the low-rank hook: owners' averaged gradients bit-identical (and verify_consistency), the
  averaged gradients of the 3 steps and each owner's error memory against a one-process
  PowerSGD written here (QR, error feedback, warm start), which without error feedback would
  differ; with overlap off (every bucket issued at the end of the backward) the same bits.
- counted bytes: comm_stats() == the bytes the test sees handed to torch.distributed.all_reduce
  == the cost model's prediction per step, for fp32, bf16, fp16 and low-rank.
- a user hook: called once per bucket of this rank per backward, in the global bucket order,
  with the bucket's owner set and a process group of exactly those ranks; its mean is the
  default reduction's to the bit.
- on a GPU (`cuda` mark): the bf16 wire and the low-rank hook with the model, its buckets and
  the hook's matrices on cuda:0 (two gloo ranks sharing the GPU; gloo stages CUDA tensors
  through the host), against the same references.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import subnet_ext as sx
from gpu_marks import needs_cuda
from rank_views import to_full
from sdp_helpers import batch, make_model
from subnet_ext.comm.hooks import LowRankState, fp16_compress_hook, low_rank_hook
from subnet_ext.comm.hooks.low_rank import approximation_rank, draw_seed
from subnet_ext.planning.buckets import build_buckets
from subnet_ext.planning.pieces import full_rectangle, global_pieces
from subnet_ext.testing import run_distributed

CAP_MB = 0.002
STEPS = 3
ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


# ----------------------------------------------------------------------------- helpers (in the workers)
def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rect(full: torch.Tensor, plan, piece) -> torch.Tensor:
    """The piece's [rows, columns] rectangle of a full-shape tensor (as a bucket stores it)."""
    r0, r1, c0, c1 = full_rectangle(plan, piece)
    return full.reshape(full.shape[0] if full.dim() else 1, -1)[r0:r1, c0:c1]


@contextlib.contextmanager
def handed_to_all_reduce():
    """Records the bytes of every tensor handed to torch.distributed.all_reduce inside."""
    seen, original = [], dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        yield seen
    finally:
        dist.all_reduce = original


def _grad(p):
    return None if p.grad is None else p.grad.cpu()


def train(rank, world, coverage=0.5, strategy="groups", hook=None, state=None, device="cpu", **options):
    """3 steps of one engine on `device`: (plan, [own gradients per step, every rank's, on the
    CPU], [averaged, every rank's], comm_stats, bytes handed to all_reduce, engine)."""
    model = make_model().to(device)
    plan = sx.plan_subnetworks(model, world, coverage, "neuron")
    sdp = sx.SubnetDataParallel(model, plan, bucket_cap_mb=CAP_MB, strategy=strategy, **options)
    if hook is not None:
        sdp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    own, averaged = [], []
    with handed_to_all_reduce() as handed:
        for s in range(STEPS):
            x, y = (t.to(device) for t in batch(rank, s))
            opt.zero_grad(set_to_none=True)
            with sdp.no_sync():
                F.cross_entropy(sdp(x), y).backward()
            mine = to_full(plan, rank, sdp.module, _grad)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(sdp(x), y).backward()
            averaged.append(to_full(plan, rank, sdp.module, _grad))
            own.append(mine)
            opt.step()
    sdp.verify_consistency()  # raises unless every unit's owners hold bit-identical values
    own = [gather(o) for o in own]
    averaged = [gather(a) for a in averaged]
    return plan, own, averaged, sdp.comm_stats(), handed, sdp


def byte_counts(stats, handed) -> dict:
    """What the communicator counted, what dist.all_reduce was handed, and the prediction x steps."""
    counted = stats["by_quantity"]["gradients"]
    predicted = stats["predicted_per_sync"]
    return {"counted": counted, "handed": (sum(handed), len(handed)),
            "predicted": (predicted["bytes"] * STEPS, predicted["collectives"] * STEPS)}


def wire_mismatches(plan, own, averaged, dtype, strategy) -> list:
    """Every piece of every rank whose averaged gradient differs from the wire reference."""
    out = []
    for step in range(STEPS):
        for p in global_pieces(plan):
            if p.name not in own[step][0]:
                continue
            group = len(p.owners) if strategy == "groups" else plan.world_size
            w = [(rect(own[step][k][p.name], plan, p) * (1.0 / group)).to(dtype).float() for k in p.owners]
            summed = w[0]
            for t in w[1:]:
                summed = summed + t
            factor = group / len(p.owners)
            expected = summed.to(dtype).float() * factor if len(p.owners) > 1 else rect(own[step][p.owners[0]][p.name],
                                                                                          plan, p)
            for k in p.owners:
                got = rect(averaged[step][k][p.name], plan, p)
                if len(p.owners) <= 2:
                    ok = torch.equal(got, expected)
                else:
                    bound = (len(p.owners) - 1) * ROUNDOFF[dtype] * sum(t.abs() for t in w) * factor
                    on_wire = got / factor
                    ok = bool(((got - summed * factor).abs() <= bound + 1e-30).all()) and \
                        torch.equal(on_wire.to(dtype).float(), on_wire)
                if not ok:
                    out.append(f"step {step} rank {k} {p.name}[{p.start}:{p.start + p.length}] owners {p.owners}: "
                               f"max |got - expected| {(got - expected).abs().max().item():.3g}")
    return out


def low_rank_reference(plan, buckets, own, matrix_rank, error_feedback=True):
    """PowerSGD over the buckets, one process: ([{(bucket, piece): mean}] per step,
    {(bucket, piece, owner): error} after the last step). QR orthogonalises (the hook uses
    Gram-Schmidt: the mean does not depend on the columns' signs)."""
    q_last, errors, means = {}, {}, []
    for step_own in own:
        means.append({})
        for b_index, b in enumerate(buckets):
            group = len(b.owners)
            for i, (p, (rows, cols)) in enumerate(zip(b.pieces, b.shapes)):
                mats = {k: rect(step_own[k][p.name], plan, p) for k in b.owners}
                r = approximation_rank(rows, cols, matrix_rank, 2.0)
                if r == 0:
                    means[-1][(b_index, i)] = sum(mats.values()) / group
                    continue
                if error_feedback:
                    mats = {k: m + errors.get((b_index, i, k), 0.0) for k, m in mats.items()}
                q = q_last.get((b_index, i))
                if q is None:
                    q = torch.randn(cols, r, generator=torch.Generator().manual_seed(draw_seed(0, b_index, i, 0)))
                q = torch.linalg.qr(q).Q
                p_hat = torch.linalg.qr(sum(m @ q for m in mats.values())).Q
                q_own = {k: m.T @ p_hat for k, m in mats.items()}
                for k, m in mats.items():
                    errors[(b_index, i, k)] = m - p_hat @ q_own[k].T
                q_last[(b_index, i)] = sum(q_own.values())
                means[-1][(b_index, i)] = p_hat @ q_last[(b_index, i)].T / group
    return means, errors


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN (not held) where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def low_rank_findings(rank, plan, own, averaged, state) -> dict:
    """Largest relative differences from the reference (means, this rank's errors), the same
    without error feedback, owners bit-identical, and how many pieces were compressed."""
    buckets = build_buckets(plan, global_pieces(plan), "groups", CAP_MB * 2**20)
    means, errors = low_rank_reference(plan, buckets, own, 2)
    plain, _ = low_rank_reference(plan, buckets, own, 2, error_feedback=False)
    worst = worst_plain = worst_error = 0.0
    identical, compressed = True, 0
    for b_index, b in enumerate(buckets):
        if rank not in b.owners:
            continue
        memory, j = state.memory[b_index], 0
        for i, (p, (rows, cols)) in enumerate(zip(b.pieces, b.shapes)):
            for step in range(STEPS):
                got = rect(averaged[step][rank][p.name], plan, p)
                worst = max(worst, relative(got, means[step][(b_index, i)]))
                worst_plain = max(worst_plain, relative(got, plain[step][(b_index, i)]))
                identical &= all(torch.equal(got, rect(averaged[step][k][p.name], plan, p)) for k in b.owners)
            if approximation_rank(rows, cols, 2, 2.0):
                worst_error = max(worst_error, relative(memory.errors[j].cpu(), errors[(b_index, i, rank)]))
                j, compressed = j + 1, compressed + 1
    return {"mean": worst, "mean_without_error_feedback": worst_plain, "error": worst_error,
            "owners_identical": identical, "compressed": compressed}


class RecordingHook:
    """A user's hook: the plain mean, recording (bucket index, owners, the process group's ranks,
    group size, scale) of every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, state, bucket):
        group = dist.get_process_group_ranks(bucket.process_group)
        self.calls.append((bucket.index(), bucket.owners, tuple(group), bucket.group_size, bucket.scale))
        return bucket.all_reduce(bucket.buffer().mul_(bucket.scale))


# ----------------------------------------------------------------------------- the workers
def _four_ranks(rank, world):
    out = {}
    for name, options in (("bf16", dict(reduce_dtype=torch.bfloat16)),
                          ("bf16_zero_filled", dict(reduce_dtype="bfloat16", strategy="zero_filled")),
                          ("fp16_hook", dict(hook=fp16_compress_hook))):
        plan, own, averaged, stats, handed, _ = train(rank, world, **options)
        dtype = torch.float16 if name == "fp16_hook" else torch.bfloat16
        out[name] = wire_mismatches(plan, own, averaged, dtype, options.get("strategy", "groups"))
        out[f"{name}_bytes"] = byte_counts(stats, handed)
    state = LowRankState(matrix_rank=2)
    plan, own, averaged, stats, handed, _ = train(rank, world, hook=low_rank_hook, state=state)
    out["low_rank"] = low_rank_findings(rank, plan, own, averaged, state)
    _, _, serial, _, _, _ = train(rank, world, hook=low_rank_hook, state=LowRankState(matrix_rank=2), overlap=False)
    out["low_rank_overlap_off_same"] = all(same(serial[s][rank][n], averaged[s][rank][n])
                                           for s in range(STEPS) for n in averaged[s][rank])
    out["low_rank_bytes"] = byte_counts(stats, handed)
    out["low_rank_full_bytes"] = stats["by_quantity"]["gradients"][0]
    plan, own, default, stats, handed, _ = train(rank, world)
    out["fp32_bytes"] = byte_counts(stats, handed)
    out["fp32_full_bytes"] = stats["by_quantity"]["gradients"][0]
    hook = RecordingHook()
    _, _, hooked, stats, _, _ = train(rank, world, hook=hook, state="user state")
    buckets = build_buckets(plan, global_pieces(plan), "groups", CAP_MB * 2**20)
    out["hook_calls"] = hook.calls
    out["hook_expected_calls"] = [(i, b.owners, b.owners, len(b.owners), 1.0 / len(b.owners))
                                  for i, b in enumerate(buckets) if rank in b.owners] * STEPS
    out["hook_equals_default"] = all(same(hooked[s][rank][n], default[s][rank][n])
                                     for s in range(STEPS) for n in default[s][rank])
    out["hook_prediction"] = stats["predicted_per_sync"]["bytes"]
    return out


def _two_ranks(rank, world):
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        plan, own, averaged, stats, handed, _ = train(rank, world, coverage=1.0, reduce_dtype=dtype)
        out[name] = wire_mismatches(plan, own, averaged, dtype, "groups")
        out[f"{name}_bytes"] = byte_counts(stats, handed)
        out[f"{name}_pieces"] = len(global_pieces(plan))
    return out


def _two_ranks_on_cuda(rank, world):
    torch.cuda.set_device(0)  # both ranks share the one GPU (gloo, not NCCL, allows that)
    plan, own, averaged, _, _, _ = train(rank, world, coverage=1.0, reduce_dtype=torch.bfloat16, device="cuda")
    out = {"bf16": wire_mismatches(plan, own, averaged, torch.bfloat16, "groups")}
    state = LowRankState(matrix_rank=2)
    plan, own, averaged, _, _, _ = train(rank, world, coverage=1.0, hook=low_rank_hook, state=state, device="cuda")
    out["low_rank"] = low_rank_findings(rank, plan, own, averaged, state)
    return out


@pytest.fixture(scope="module")
def four():
    return run_distributed(_four_ranks, 4, timeout=600)


@pytest.fixture(scope="module")
def two():
    return run_distributed(_two_ranks, 2, timeout=300)


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", ["bf16", "bf16_zero_filled", "fp16_hook"])
def test_half_precision_wire_at_four_ranks_equals_the_rounded_mean(four, name):
    for rank, out in enumerate(four):
        assert out[name] == [], (rank, out[name][:5])


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_half_precision_wire_at_two_ranks_is_exactly_the_rounded_mean(two, name):
    for rank, out in enumerate(two):
        assert out[name] == [], (rank, out[name][:5])


def test_low_rank_hook_keeps_owners_identical_and_feeds_back_its_error(four):
    for rank, out in enumerate(four):
        found = out["low_rank"]
        assert found["owners_identical"], rank
        assert found["compressed"] > 0, found
        assert found["mean"] < 1e-4 and found["error"] < 1e-4, (rank, found)
        # The reference distinguishes: without error feedback steps 2 and 3 would differ.
        assert found["mean_without_error_feedback"] > 1e-2, (rank, found)
        assert out["low_rank_overlap_off_same"], rank  # every bucket issued at the end: the same bits


@pytest.mark.parametrize("name", ["fp32", "bf16", "bf16_zero_filled", "fp16_hook", "low_rank"])
def test_counted_bytes_are_the_handed_bytes_and_the_prediction_at_four_ranks(four, name):
    for rank, out in enumerate(four):
        counts = out[f"{name}_bytes"]
        assert counts["counted"] == counts["handed"] == counts["predicted"], (rank, counts)
    if name in ("bf16", "fp16_hook"):
        assert all(out[f"{name}_bytes"]["counted"][0] * 2 == out["fp32_full_bytes"] for out in four)
    if name == "low_rank":
        assert all(out["low_rank_full_bytes"] < out["fp32_full_bytes"] for out in four)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_counted_bytes_are_the_handed_bytes_and_the_prediction_at_two_ranks(two, name):
    for out in two:
        assert out[f"{name}_bytes"]["counted"] == out[f"{name}_bytes"]["handed"] == out[f"{name}_bytes"]["predicted"]


def test_user_hook_is_called_once_per_bucket_with_its_owner_group(four):
    for rank, out in enumerate(four):
        assert out["hook_calls"] == out["hook_expected_calls"], rank
        assert out["hook_equals_default"], rank
        assert out["hook_prediction"] is None  # a function hook that does not say its bytes


@needs_cuda
def test_bf16_wire_and_low_rank_hook_on_cuda_tensors():
    for rank, out in enumerate(run_distributed(_two_ranks_on_cuda, 2, timeout=300)):
        assert out["bf16"] == [], (rank, out["bf16"][:5])
        found = out["low_rank"]
        assert found["owners_identical"] and found["compressed"] > 0, (rank, found)
        # The hook's products and orthogonalisation run on the GPU, the reference's on the CPU.
        assert found["mean"] < 1e-3 and found["error"] < 1e-3, (rank, found)
        assert found["mean_without_error_feedback"] > 1e-2, (rank, found)

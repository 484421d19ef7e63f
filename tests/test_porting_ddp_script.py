"""A nanoGPT-style DDP training loop, ported to SDP as docs/porting.md says.

The loop (`nanogpt_loop`) is nanoGPT's train.py reduced to its habits: a per-rank seed
(rank 0's values are broadcast by the wrapper), AdamW with weight-decay groups from
`configure_optimizers`, a warmup + cosine learning rate set on the param groups, gradient
accumulation through `model.require_backward_grad_sync`, gradient clipping, evaluation and
logging under `if master_process:`, and a checkpoint saved by rank 0 and loaded later into a
fresh GPT. The DDP run keeps nanoGPT's order (optimizer built before wrapping,
`raw_model.state_dict()`); the SDP run differs only where docs/porting.md says it must: the
optimizer is built after wrapping from `sdp.named_parameters()`, clipping is
`sdp.clip_grad_norm_`, and the checkpoint is `sdp.full_state_dict()`, called on every rank.

2 gloo ranks, the GPT of subnet_ext/models/gpt.py (2 layers, 32 wide, vocabulary 65,
context 32) with pre-LN and parallel-residual blocks, on a Markov token source:
- coverage 1.0 equals torch DDP bit for bit (every logged loss of each rank, every
  evaluation, the saved checkpoint) at block and neuron level, forward and backward regime;
- coverage 0.5 at block and neuron level, forward and backward: the training loss falls, the
  checkpoint loads strictly into a fresh GPT holding every value this rank trained, and in
  the backward regime (full forward, unbiased gradients) the full model's loss falls too.
The planner recognises the GPT's blocks, heads and MLP neurons by itself (nothing declared).
"""
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import subnet_ext as sx
from subnet_ext.data.tokens import SyntheticTokens
from subnet_ext.models.gpt import GPT, GPTConfig
from subnet_ext.testing import run_distributed

CONFIG = dict(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
DATA = SyntheticTokens(vocab_size=65, seq_len=32, seed=0)
MAX_ITERS, ACCUMULATION, BATCH, EVAL_INTERVAL, EVAL_ITERS = 16, 2, 4, 8, 2
LEARNING_RATE, MIN_LR, WARMUP_ITERS, WEIGHT_DECAY, BETAS = 1e-2, 1e-3, 2, 0.1, (0.9, 0.95)
# Above every gradient norm of these runs (at most 1.41): the clipping call runs, computes the
# whole model's norm (compared with DDP's below) and scales by exactly 1. A step it did scale
# would differ from DDP's in the last bits of the coefficient (torch and SDP sum the norm in
# different orders); tests/test_training_loop.py compares active clipping with DDP's.
GRAD_CLIP = 1.5


def get_lr(it):
    """nanoGPT's schedule: linear warmup, then cosine decay to MIN_LR at MAX_ITERS."""
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    ratio = (it - WARMUP_ITERS) / (MAX_ITERS - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


def get_batch(split, rank, it, micro_step):
    """(X, Y) int64 [BATCH, 32]: this rank's micro-batch (train) or a batch all ranks share (val)."""
    seed = 10_000 + 97 * it + micro_step if split == "val" else 1_000_000 * rank + 1000 * it + micro_step
    return DATA.batch(BATCH, torch.Generator().manual_seed(seed))


def nanogpt_loop(model, optimizer, rank, clip_gradients, checkpoint_state):
    """nanoGPT's training loop on `model` (the DDP or SDP wrapper).

    clip_gradients(max_norm): the wrapper's clipping; checkpoint_state(): the model's state
    dict, called on every rank (collective for SDP), saved by rank 0.
    Returns (logged training losses, evaluation losses, the checkpoint rank 0 saved or None,
    the gradient norms before clipping).
    """
    master_process = rank == 0
    losses, evaluations, checkpoint, norms = [], [], None, []
    X, Y = get_batch("train", rank, 0, 0)
    for iter_num in range(MAX_ITERS + 1):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0:
            state = checkpoint_state()  # every rank: a collective under SDP
            if master_process:
                evaluations.append(estimate_loss(model, iter_num))
                checkpoint = {"model": state, "iter_num": iter_num}
        if iter_num == MAX_ITERS:
            break
        for micro_step in range(ACCUMULATION):
            model.require_backward_grad_sync = micro_step == ACCUMULATION - 1
            logits, loss = model(X, Y)
            loss = loss / ACCUMULATION
            X, Y = get_batch("train", rank, iter_num, micro_step + 1)
            loss.backward()
        norms.append(float(clip_gradients(GRAD_CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * ACCUMULATION)  # nanoGPT logs this on the master process
    return losses, evaluations, checkpoint, norms


@torch.no_grad()
def estimate_loss(model, iter_num):
    """Mean validation loss of `model`'s forward (DDP: the replica; SDP: this rank's subnetwork)."""
    model.eval()
    out = sum(model(*get_batch("val", 0, iter_num, k))[1].item() for k in range(EVAL_ITERS)) / EVAL_ITERS
    model.train()
    return out


def build_gpt(rank, parallel):
    torch.manual_seed(1337 + rank)  # nanoGPT's seed_offset: the wrappers broadcast rank 0's values
    return GPT(GPTConfig(**CONFIG, parallel_residual=parallel))


def train_ddp(rank, parallel):
    """nanoGPT's order: the optimizer from the bare model, then the DDP wrapper."""
    model = build_gpt(rank, parallel)
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS)
    model = DDP(model)
    raw_model = model.module
    clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # noqa: E731
    return nanogpt_loop(model, optimizer, rank, clip, raw_model.state_dict)


def train_sdp(rank, world, parallel, coverage, level, regime, folder):
    """The port: wrap first, optimizer from sdp.named_parameters(), sdp.clip_grad_norm_,
    full_state_dict() on every rank. Also saves rank 0's checkpoint to `folder`."""
    model = build_gpt(rank, parallel)
    plan = sx.plan_subnetworks(model, world, coverage, level)
    model = sx.SubnetDataParallel(model, plan, regime=regime)
    raw_model = model.module
    optimizer = raw_model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS, params=model.named_parameters())
    losses, evaluations, checkpoint, norms = nanogpt_loop(model, optimizer, rank, model.clip_grad_norm_,
                                                          model.full_state_dict)
    optimizer_state = model.full_optimizer_state_dict(optimizer)  # collective, like full_state_dict
    path = os.path.join(folder, f"ckpt-{parallel}-{coverage}-{level}-{regime}.pt")
    if rank == 0:
        torch.save({**checkpoint, "optimizer": optimizer_state}, path)
    dist.barrier()
    return losses, evaluations, path, model, norms


def as_bytes(state):
    """{name: raw bytes}: a state dict the spawning process can compare (tensors do not travel)."""
    return {n: t.detach().contiguous().numpy().tobytes() for n, t in state.items()}


def validation_loss(state, parallel):
    """The loss of a fresh GPT loaded strictly from `state`, on a batch no rank trained on."""
    fresh = GPT(GPTConfig(**CONFIG, parallel_residual=parallel))
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        return fresh(*get_batch("val", 0, 999, 0))[1].item()


VARIANTS = [("block", "forward"), ("block", "backward"), ("neuron", "forward"), ("neuron", "backward")]


def _worker(rank, world, folder):
    out = {}
    for parallel in (False, True):
        ddp_losses, ddp_evals, ddp_checkpoint, ddp_norms = train_ddp(rank, parallel)
        out[("ddp", parallel, rank)] = {"losses": ddp_losses}
        for level, regime in VARIANTS:
            losses, evals, path, _, norms = train_sdp(rank, world, parallel, 1.0, level, regime, folder)
            entry = {"losses": losses, "ddp_losses": ddp_losses, "evals": evals, "ddp_evals": ddp_evals,
                     "norms": norms, "ddp_norms": ddp_norms}
            if rank == 0:  # the checkpoints rank 0 saved
                saved = torch.load(path)["model"]
                entry.update(state=as_bytes(saved), ddp_state=as_bytes(ddp_checkpoint["model"]))
            out[(parallel, 1.0, level, regime, rank)] = entry
        initial = validation_loss(build_gpt(0, parallel).state_dict(), parallel)
        for level, regime in VARIANTS:
            losses, _, path, sdp, _ = train_sdp(rank, world, parallel, 0.5, level, regime, folder)
            saved = torch.load(path)["model"]  # rank 0's file, read by every rank from the shared folder
            own = sdp.local_full_state_dict()  # this rank's values, NaN where it holds nothing
            held = {n: ~torch.isnan(v) if v.is_floating_point() else torch.ones_like(v, dtype=torch.bool)
                    for n, v in own.items()}
            out[(parallel, 0.5, level, regime, rank)] = {
                "losses": losses, "initial_validation": initial, "validation": validation_loss(saved, parallel),
                "holds_own_values": all(torch.equal(saved[n][held[n]], own[n][held[n]]) for n in own),
                "held_fraction": sum(int(h.sum()) for h in held.values()) / sum(h.numel() for h in held.values())}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    merged = {}
    for r in run_distributed(_worker, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=900):
        merged.update(r)
    return merged


@pytest.mark.parametrize("parallel", [False, True], ids=["pre_ln", "parallel"])
@pytest.mark.parametrize("level,regime", VARIANTS)
def test_full_coverage_equals_ddp(results, parallel, level, regime):
    for rank in range(2):
        r = results[(parallel, 1.0, level, regime, rank)]
        assert len(r["losses"]) == MAX_ITERS and len(r["evals"]) == (1 + MAX_ITERS // EVAL_INTERVAL) * (rank == 0)
        assert r["losses"] == r["ddp_losses"]  # bit for bit, every logged loss of every rank
        assert r["evals"] == r["ddp_evals"]
        assert max(r["ddp_norms"]) < GRAD_CLIP, r["ddp_norms"]  # the premise of bit-exactness (see GRAD_CLIP)
        assert r["norms"] == pytest.approx(r["ddp_norms"], rel=1e-6)  # the whole model's gradient norm
    r = results[(parallel, 1.0, level, regime, 0)]
    assert list(r["state"]) == list(r["ddp_state"])  # the checkpoint: the same names, in the same order ...
    assert r["state"] == r["ddp_state"]  # ... and the same bytes


@pytest.mark.parametrize("parallel", [False, True], ids=["pre_ln", "parallel"])
@pytest.mark.parametrize("level,regime", VARIANTS)
def test_half_coverage_trains_and_its_checkpoint_loads_into_a_fresh_gpt(results, parallel, level, regime):
    uniform = math.log(CONFIG["vocab_size"])
    for rank in range(2):
        r = results[(parallel, 0.5, level, regime, rank)]
        first, last = sum(r["losses"][:3]) / 3, sum(r["losses"][-3:]) / 3
        assert first > uniform - 0.3 and last < first - 0.5, (rank, r["losses"])  # the loss falls
        assert r["holds_own_values"], rank
        # The forward regime holds part of the model; the backward regime all of it (refreshed copies).
        assert (0.3 < r["held_fraction"] < 1.0) if regime == "forward" else r["held_fraction"] == 1.0, r
        assert math.isfinite(r["validation"]), r
        if regime == "backward":  # the full forward trains the full model
            assert r["validation"] < r["initial_validation"] - 0.5, (r["initial_validation"], r["validation"])


def test_the_ddp_reference_trains(results):
    """The reference itself learns (else equality with it would say little)."""
    for parallel in (False, True):
        for rank in range(2):
            losses = results[("ddp", parallel, rank)]["losses"]
            assert losses[-1] < losses[0] - 0.5, losses

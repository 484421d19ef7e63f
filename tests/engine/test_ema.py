"""`sx.ExponentialMovingAverage(sdp, decay)`: the EMA of the model an SDP engine trains, on 2 gloo ranks.

- coverage 1: its state dict equals torch's `AveragedModel(ddp.module,
  multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=...)` over torch DDP bit for bit
  (every key, n_averaged, tied entries), after every update, `n_averaged.fill_(0)` (torchvision's
  warmup restart) included: a ResidualMLP at neuron level
  (forward regime) and the GPT with its tied lm_head at block level (backward regime, buffers
  averaged);
- coverage 0.5, forward and backward regime: equal bit for bit to AveragedModel over a plain
  model loaded with the assembled full state after each step (torch's own EMA of the model the
  ranks train); each rank averages only the elements it owns (its subnetwork's parameters in
  the forward regime, its owned units in the backward regime), fewer than the model's;
- it checkpoints (AveragedModel's format) and resumes: saved at step 2 with the engine's full
  and optimizer state, loaded into a fresh engine and EMA, trained on to step 5: the same
  state as without the interruption, bit for bit;
- it evaluates: `ema(x)` and `ema.module(x)` equal a fresh model loaded from its state dict;
- copying: `copy.deepcopy(sdp)` and `AveragedModel(sdp)` raise TypeError naming
  ExponentialMovingAverage; `copy.deepcopy(sdp.module)` of a subnetwork raises
  PartialStateError; where the rank holds the whole model unchanged it copies.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import subnet_ext as sx
from sdp_helpers import batch, make_model
from subnet_ext.models.gpt import GPT, GPTConfig
from subnet_ext.testing import run_distributed

DECAY = 0.9
GPT_CONFIG = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32)


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPT_CONFIG)


def step(model, opt, rank, s, kind):
    if kind == "gpt":
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randint(0, 65, (4, 16), generator=g)
        model(x, x)[1].backward()
    else:
        x, y = batch(rank, s)
        F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def as_bytes(state):
    return {k: v.detach().cpu().contiguous().numpy().tobytes() for k, v in state.items()}


def _against_ddp(rank, world, kind, level, regime, use_buffers):
    """[(SDP EMA state, DDP AveragedModel state)] as bytes, after each of 4 steps, coverage 1."""
    build = gpt if kind == "gpt" else make_model
    ddp = DDP(build())
    reference = AveragedModel(ddp.module, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=use_buffers)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    model = build()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 1.0, level), regime=regime)
    ema = sx.ExponentialMovingAverage(sdp, DECAY, use_buffers=use_buffers)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    out = []
    for s in range(4):
        step(ddp, ddp_opt, rank, s, kind)
        reference.update_parameters(ddp)
        step(sdp, opt, rank, s, kind)
        ema.update_parameters(sdp)
        if s == 1:  # torchvision's loop restarts the average during the learning-rate warmup
            reference.n_averaged.fill_(0)
            ema.n_averaged.fill_(0)
        out.append((as_bytes(ema.state_dict()), as_bytes(reference.state_dict())))
    return out


def _half_coverage(rank, world, regime):
    """Coverage 0.5: the EMA against AveragedModel over the assembled model, memory, evaluation."""
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "neuron"), regime=regime)
    ema = sx.ExponentialMovingAverage(sdp, DECAY)
    opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
    plain = make_model(seed=7)
    plain.load_state_dict(sdp.full_state_dict())
    reference = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    equal = []
    for s in range(3):
        step(sdp, opt, rank, s, "mlp")
        ema.update_parameters()
        plain.load_state_dict(sdp.full_state_dict())
        reference.update_parameters(plain)
        equal.append(as_bytes(ema.state_dict()) == as_bytes(reference.state_dict()))
    owned = int(sdp.plan.params_per_rank[rank])  # the plan's count: shared parameters + this rank's units
    elements = sum(t.numel() for t in ema._averages.values())
    fresh = make_model(seed=7)
    fresh.load_state_dict({k[len("module."):]: v for k, v in ema.state_dict().items() if k.startswith("module.")})
    x, _ = batch(rank, 900)
    ema.eval()
    with torch.no_grad():
        evaluated = torch.equal(ema(x), fresh(x)) and torch.equal(ema.module(x), fresh(x))
    return {"equal": equal, "elements": elements, "owned": owned, "total": sdp.plan.total_params,
            "evaluated": evaluated}


def _resume(rank, world, folder):
    """Saved at step 2 and resumed in a fresh engine: the step-5 EMA, bit for bit."""
    def run(stop, resume_from=None):
        model = make_model()
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "neuron"))
        ema = sx.ExponentialMovingAverage(sdp, DECAY)
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        start = 0
        if resume_from is not None:
            saved = torch.load(resume_from)
            sdp.load_full_state_dict(saved["model"])
            sdp.load_full_optimizer_state_dict(opt, saved["optimizer"])
            ema.load_state_dict(saved["model_ema"])
            start = saved["step"]
        for s in range(start, stop):
            step(sdp, opt, rank, s, "mlp")
            ema.update_parameters(sdp)
        checkpoint = {"model": sdp.full_state_dict(), "optimizer": sdp.full_optimizer_state_dict(opt),
                      "model_ema": ema.state_dict(), "step": stop}  # every rank builds it, as torchvision does
        return checkpoint

    path = f"{folder}/ema-step2.pt"
    saved = run(2)
    if rank == 0:
        torch.save(saved, path)
    dist.barrier()
    whole, resumed = run(5), run(5, resume_from=path)
    return as_bytes(whole["model_ema"]) == as_bytes(resumed["model_ema"]) and int(whole["model_ema"]["n_averaged"]) == 5


def _copies(rank, world):
    model = make_model()
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "neuron"))
    out = {}
    for label, call in (("deepcopy", lambda: copy.deepcopy(sdp)), ("averaged_model", lambda: AveragedModel(sdp)),
                        ("module", lambda: copy.deepcopy(sdp.module))):
        try:
            call()
            out[label] = None
        except (TypeError, sx.PartialStateError) as e:
            out[label] = (type(e).__name__, str(e))
    whole = make_model()
    whole_sdp = sx.SubnetDataParallel(whole, sx.plan_subnetworks(whole, world, 1.0, "block"))
    out["whole_module_copies"] = isinstance(copy.deepcopy(whole_sdp.module), type(whole))
    return out


def _worker(rank, world, folder):
    return {
        "mlp_forward": _against_ddp(rank, world, "mlp", "neuron", "forward", False),
        "gpt_backward_buffers": _against_ddp(rank, world, "gpt", "block", "backward", True),
        "half_forward": _half_coverage(rank, world, "forward"),
        "half_backward": _half_coverage(rank, world, "backward"),
        "resume": _resume(rank, world, folder),
        "copies": _copies(rank, world),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("ema")), timeout=300)


@pytest.mark.parametrize("label", ["mlp_forward", "gpt_backward_buffers"])
def test_coverage_one_equals_averaged_model_over_ddp(results, label):
    for r in results:
        for mine, reference in r[label]:
            assert list(mine) == list(reference)  # the same keys (n_averaged, module.*, tied ones), in order
            assert mine == reference, [k for k in mine if mine[k] != reference[k]]
    assert "module.lm_head.weight" in results[0]["gpt_backward_buffers"][0][0]


@pytest.mark.parametrize("regime", ["forward", "backward"])
def test_half_coverage_averages_owned_pieces_as_averaged_model_over_the_assembled_model(results, regime):
    for r in results:
        h = r[f"half_{regime}"]
        assert all(h["equal"]), h["equal"]
        assert h["elements"] == h["owned"] < h["total"], h
        assert h["evaluated"]


def test_checkpoint_and_resume(results):
    assert all(r["resume"] for r in results)


def test_copies_are_refused_with_the_way_out(results):
    for r in results:
        c = r["copies"]
        for label in ("deepcopy", "averaged_model"):
            kind, message = c[label]
            assert kind == "TypeError" and "subnet_ext.ExponentialMovingAverage(sdp, decay)" in message, c[label]
        kind, message = c["module"]
        assert kind == "PartialStateError" and "ExponentialMovingAverage" in message and "subnetwork" in message
        assert c["whole_module_copies"]

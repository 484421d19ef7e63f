"""NonFiniteGuard's device-side path in one process: a step handed a set flag leaves the
parameters and every optimizer state tensor as they were (checked against snapshots the
test takes), an unset flag steps as torch's plain AdamW does, an optimizer that cannot
take the flag is refused, and `settle` counts the skipped steps the flags say and raises
past max_skipped naming them."""
import pytest
import torch

from subnet_ext.engine.guards.nonfinite_guard import NonFiniteGuard, TooManySkippedSteps, step_unless


def params_with_grads(seed: int, bad: bool = False) -> list[torch.nn.Parameter]:
    """Two parameters [3, 4] and [5] with gradients from `seed`; `bad` puts a NaN in the first."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    if bad:
        params[0].grad[1, 2] = float("nan")
    return params


def snapshot(params, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params] + [v.clone() for p in params for v in opt.state[p].values()]


def test_a_flagged_step_changes_nothing_and_a_clear_one_steps_as_adamw():
    params = params_with_grads(0)
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)
    ref = torch.optim.AdamW(plain, lr=0.1, weight_decay=0.1)
    for step in range(3):
        grads = [p.grad for p in params_with_grads(step + 1, bad=step == 1)]
        for p, q, g in zip(params, plain, grads):
            p.grad, q.grad = g.clone(), g.clone()
        flag = NonFiniteGuard().check(params, step + 1)  # one process: this rank's own flag
        before = snapshot(params, opt) if opt.state else None
        step_unless(opt, flag)
        if step == 1:  # the NaN step: parameters, exp_avg, exp_avg_sq and step all as before
            after = snapshot(params, opt)
            assert all(torch.equal(a, b) for a, b in zip(before, after))
        else:
            ref.step()
    assert float(opt.state[params[0]]["step"]) == 2.0  # the test's own count: 3 steps, one spoiled
    for p, q in zip(params, plain):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not hasattr(opt, "found_inf")  # handed for one step only


def test_an_optimizer_that_cannot_take_the_flag_is_refused():
    params = params_with_grads(0)
    with pytest.raises(ValueError, match=r"AdamW \(fused=None\) cannot skip a step on the device.*fused=True"):
        step_unless(torch.optim.AdamW(params), torch.zeros(()))
    with pytest.raises(ValueError, match=r"0-d float32 tensor, got shape \[1\] and dtype torch.float32"):
        step_unless(torch.optim.AdamW(params, fused=True), torch.zeros(1))


def test_settle_counts_the_flagged_steps_and_raises_past_the_limit():
    guard = NonFiniteGuard(max_skipped=2)
    for step, value in [(1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0)]:
        guard.record(torch.tensor(value), step)
    assert guard.skipped == 0 and len(guard.pending_flags()) == 4  # nothing known before settling
    assert guard.settle() == [2, 4] and guard.skipped_steps == [2, 4] and guard.pending_flags() == []
    guard.record(torch.tensor(0.0), 5)
    guard.record(torch.tensor(1.0), 6)
    with pytest.raises(TooManySkippedSteps, match=r"3 step\(s\).*latest: \[2, 4, 6\].*the 2 allowed"):
        guard.settle(values=[0.0, 1.0])  # the caller's own read of the pending flags

"""SDPConfig and SubnetDataParallel's public surface, in one process (no process group)."""
import dataclasses
import re

import pytest
import torch.nn as nn

import subnet_ext as sx
from sdp_helpers import make_model, value_error


def plan_for(model, level="block"):
    return sx.plan_subnetworks(model, 4, 0.5, level)


@pytest.mark.parametrize("options,message", [
    ({"regime": "sideways"}, "regime must be 'forward' or 'backward', got 'sideways'"),
    ({"sync_every": 0}, "sync_every must be an int >= 1, got 0"),
    ({"sync_every": True}, "sync_every must be an int >= 1, got True"),
    ({"scale": "double"}, "scale must be 'none' or 'inverse', got 'double'"),
    ({"strategy": "ring"}, "strategy must be one of"),
    ({"latency_bytes": -1}, "latency_bytes must be a finite number >= 0, got -1"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a positive number, got 0"),
    ({"overlap": "yes"}, "overlap must be True or False, got 'yes'"),
    ({"timeout": -5}, "timeout must be a positive, finite number of seconds, got -5"),
    ({"shard_shared": True, "sync_every": 2}, "needs sync_every=1, got sync_every=2"),
    ({"reduce_dtype": "int8"}, "reduce_dtype must be a floating torch.dtype (torch.bfloat16, torch.float16, ...) "
                               "or its name, or None, got 'int8'"),
    ({"reduce_dtype": "bfloat16", "sync_every": 4}, "reduce_dtype=torch.bfloat16 is the dtype gradients travel in, "
                                                    "so it needs sync_every=1, got sync_every=4"),
    ({"reduce_dtype": "float16", "shard_shared": True}, "with shard_shared=True FSDP2 reduces the shared parameters' "
                                                        "gradients in their own dtype"),
])
def test_config_refuses_bad_values_by_name(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sx.SDPConfig(**options)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):  # the keyword form too
        sx.SubnetDataParallel(make_model(), plan_for(make_model()), simulate_rank=0, **options)


def test_config_is_frozen_and_the_keyword_form_builds_the_same():
    config = sx.SDPConfig(regime="backward", sync_every=2, bucket_cap_mb=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.regime = "forward"
    assert dataclasses.replace(config, regime="forward").regime == "forward" and config.regime == "backward"
    by_config = sx.SubnetDataParallel(make_model(), plan_for(make_model()), config, simulate_rank=1)
    by_keywords = sx.SubnetDataParallel(make_model(), plan_for(make_model()), regime="backward", sync_every=2,
                                        bucket_cap_mb=0.5, simulate_rank=1)
    assert by_config.config == by_keywords.config == config
    assert sx.SubnetDataParallel(make_model(), plan_for(make_model()), simulate_rank=0).config == sx.SDPConfig()


def test_options_that_need_every_rank_are_refused_for_a_simulated_rank():
    message = value_error(lambda: sx.SubnetDataParallel(make_model(), plan_for(make_model()), simulate_rank=0,
                                                        eval_forward="full"))
    assert "eval_forward='full'" in message and "simulate_rank" in message, message
    assert "eval_forward must be 'subnetwork' or 'full', got 'model'" in value_error(
        lambda: sx.SDPConfig(eval_forward="model"))
    assert "buffer_sync must be 'average' or 'broadcast', got 'rank0'" in value_error(
        lambda: sx.SDPConfig(buffer_sync="rank0"))


def test_config_checks_against_the_plan():
    with pytest.raises(ValueError, match="scale='inverse' applies to the neuron level in the forward regime"):
        sx.SubnetDataParallel(make_model(), plan_for(make_model(), "block"), scale="inverse", simulate_rank=0)
    with pytest.raises(ValueError, match="plan must be a SubnetPlan, got dict"):
        sx.SubnetDataParallel(make_model(), {}, simulate_rank=0)


def test_a_multi_rank_plan_without_torch_distributed_says_how_to_start():
    """A plan for 4 ranks in a process that never called init_process_group: the error names
    the fix (initialise torch.distributed, or simulate a rank), not a one-rank plan."""
    message = value_error(lambda: sx.SubnetDataParallel(make_model(), plan_for(make_model())))
    assert "the plan is for 4 ranks, but torch.distributed is not initialised" in message, message
    assert "init_process_group()" in message and "torchrun --nproc-per-node 4" in message, message
    assert "simulate_rank=r" in message and "world_size=1" not in message, message


@pytest.mark.parametrize("options,message", [
    ({"sync_every": "2"}, "sync_every must be an int >= 1, got str '2'"),
    ({"timeout": "5"}, "timeout must be a number of seconds (or None), got str '5'"),
    ({"bucket_cap_mb": "25"}, "bucket_cap_mb must be a number, got str '25'"),
    ({"latency_bytes": None}, "latency_bytes must be a number, got NoneType None"),
])
def test_non_numeric_options_are_type_errors(options, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        sx.SDPConfig(**options)


def test_misplaced_options_are_named():
    model, plan = make_model(), plan_for(make_model())
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['regim'\].*'regime'"):
        sx.SubnetDataParallel(model, plan, regim="forward", simulate_rank=0)
    with pytest.raises(TypeError, match="config must be an SDPConfig, got str 'backward'"):
        sx.SubnetDataParallel(model, plan, "backward", simulate_rank=0)
    with pytest.raises(TypeError, match=r"both config= and the options \['sync_every'\]"):
        sx.SubnetDataParallel(model, plan, sx.SDPConfig(), sync_every=2, simulate_rank=0)


def test_public_surface_is_the_documented_one():
    """Beyond nn.Module's own names: the documented attributes and methods, nothing else."""
    sdp = sx.SubnetDataParallel(make_model(), plan_for(make_model()), simulate_rank=0)
    public = sorted(a for a in set(dir(sdp)) - set(dir(nn.Module())) if not a.startswith("_"))
    assert public == sorted([
        "module", "plan", "config", "rank", "world_size",
        "device", "skeleton", "layout", "communicator", "averager", "refresh", "shared_shards",  # read-only parts
        "call_ledger", "drift_check", "state_access", "check_not_simulated",  # for code beside the engine (EMA, checkpoints)
        "no_sync", "require_backward_grad_sync", "after_step", "full_state_dict", "local_full_state_dict",
        "load_full_state_dict", "full_optimizer_state_dict", "load_full_optimizer_state_dict",
        "verify_consistency", "gradients_finite", "clip_grad_norm_", "full_model", "evaluate", "comm_stats",
        "memory_report", "predicted_model_state_bytes", "close", "remove_hooks", "register_comm_hook",
        "base_plan", "schedule", "steps", "set_step", "register_reassign_hook", "refreshes",  # ownership in time
        "summary", "width_kept"])

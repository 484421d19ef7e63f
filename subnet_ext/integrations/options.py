"""What an integration needs to know to train with SDP, in one frozen, validated object.

    SDPOptions(coverage=0.5, level="neuron", config=SDPConfig(regime="forward"))
    options_from(None, {"coverage": 0.5, "level": "neuron", "regime": "forward"})   # the same
    options_of({"coverage": 0.5, "level": "neuron", "regime": "forward"})          # a plain dict: the same

Lightning's `SDPStrategy(...)` and Hugging Face's `SDPTrainer(..., sdp=...)` both take
these options: how to plan (coverage, level, seed, the planner's declarations, or a ready
plan), how the engine trains (an SDPConfig) and which model evaluation runs ("full": the
union of the subnetworks; "ensemble": the mean of the ranks' subnetwork outputs). The
plan itself is made where the world size is known, when training starts (`plan_for`).
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..engine.config import OPTIONS as ENGINE_OPTIONS
from ..engine.config import SDPConfig, config_from
from ..planning.plan import SubnetPlan, plan_subnetworks
from ..vocabulary import LEVELS

EVALUATIONS = ("full", "ensemble")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SDPOptions:
    """How an integration plans, wraps and evaluates. Frozen: `dataclasses.replace` makes a changed copy.

    Attributes:
        coverage: C in (0, 1], the fraction of ranks that own each unit (plan_subnetworks'), or one value
            per rank. Required (unless `plan` is given): no setting is a default, since which one
            trains well depends on the model and data (the study, docs/results.md, measures them on
            Tiny Shakespeare).
        level: "block" (residual blocks) or "neuron" (MLP neurons, attention heads, channels); required
            as coverage is.
        seed: the planner's seed (relabels the ranks; 0 = identity).
        plan: a ready SubnetPlan instead of planning (coverage, level and seed then unused);
            its world size must equal the number of processes.
        blocks, neuron_groups, sample_input: passed to plan_subnetworks (units the planner
            does not recognise; one input to balance by FLOPs).
        evaluation: what validation, test, prediction and evaluation run: "full" (the union
            of the subnetworks, the original model on the assembled state) or "ensemble"
            (the mean of the K subnetworks' floating outputs, each rank on its own data).
        config: the engine's SDPConfig (regime, sync_every, bucket_cap_mb, ...).
    Raises:
        ValueError (when made) naming the option, its value and the values it takes.
    """

    coverage: float | tuple | None = None
    level: str | None = None
    seed: int = 0
    plan: SubnetPlan | None = None
    blocks: tuple | None = None
    neuron_groups: tuple | None = None
    sample_input: object = None
    evaluation: str = "full"
    config: SDPConfig = field(default_factory=SDPConfig)

    def __post_init__(self):
        if self.plan is None and (self.coverage is None or self.level is None):
            missing = " and ".join(n for n in ("level", "coverage") if getattr(self, n) is None)
            raise ValueError(f"SDP options need {missing} (or a ready plan=): no SDP setting is a default, since which "
                             "one trains well depends on the model and data (docs/results.md#the-study measures them "
                             "on Tiny Shakespeare); e.g. level='neuron', coverage=0.5")
        if self.coverage is not None:
            values = self.coverage if isinstance(self.coverage, (list, tuple)) else [self.coverage]
            if not values or not all(_is_number(c) and 0 < c <= 1 for c in values):
                raise ValueError(f"coverage must be a number in (0, 1] (or one per rank), got {self.coverage!r}")
            if isinstance(self.coverage, list):
                object.__setattr__(self, "coverage", tuple(self.coverage))
        if self.level is not None and self.level not in LEVELS:
            raise ValueError(f"level must be 'block' or 'neuron', got {self.level!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.plan is not None and not isinstance(self.plan, SubnetPlan):
            raise ValueError(f"plan must be a SubnetPlan (sx.plan_subnetworks or SubnetPlan.from_json), got "
                             f"{type(self.plan).__name__}")
        if self.evaluation not in EVALUATIONS:
            raise ValueError(f"evaluation must be 'full' or 'ensemble', got {self.evaluation!r}")
        if not isinstance(self.config, SDPConfig):
            raise ValueError(f"config must be an SDPConfig, got {type(self.config).__name__}")
        if self.config.shard_shared:
            raise ValueError("shard_shared=True is not supported by the Lightning and Hugging Face integrations yet "
                             "(the model is given back unsharded when training ends); use shard_shared=False, or "
                             "SubnetDataParallel in your own loop")

    def check_world_size(self, world_size: int) -> None:
        """ValueError when a ready plan was made for another number of processes than `world_size`."""
        if self.plan is not None and self.plan.world_size != world_size:
            raise ValueError(f"the plan was made for world size {self.plan.world_size}, but this run has {world_size} "
                             f"process(es) (devices x nodes); start {self.plan.world_size} processes, or plan for "
                             f"{world_size} (plan_subnetworks(model, world_size={world_size}, ...), or pass coverage= "
                             "and level= instead of plan=)")

    def plan_for(self, model: nn.Module, world_size: int, example_input=None) -> SubnetPlan:
        """The plan for `model` on `world_size` ranks: the ready plan (checked) or a new one.
        Deterministic from the model's structure and these options, so every rank makes the same.

        example_input: the framework's example of the model's input (Lightning's
        example_input_array, transformers' dummy_inputs), a tensor: when planning without a
        sample_input fails (a block torch.fx cannot trace), the planner traces the model's
        call on it instead; the error is then the one planning with it raises."""
        self.check_world_size(world_size)
        if self.plan is not None:
            return self.plan

        def plan(sample):
            return plan_subnetworks(model, world_size, self.coverage, self.level, seed=self.seed, blocks=self.blocks,
                                    neuron_groups=self.neuron_groups, sample_input=sample)

        if self.sample_input is not None or not isinstance(example_input, torch.Tensor):
            return plan(self.sample_input)
        try:
            return plan(None)
        except ValueError:
            return plan(example_input)


PLAN_OPTIONS = tuple(f.name for f in dataclasses.fields(SDPOptions) if f.name != "config")


def options_from(options: SDPOptions | Mapping | None, keywords: dict, where: str) -> SDPOptions:
    """SDPOptions from `options` (an SDPOptions or a plain dict, options_of) or from keywords:
    SDPOptions' fields and the engine's options (SDPConfig's fields, e.g. regime=). TypeError for
    an unknown keyword, or both forms at once.

    Args:
        where: the caller's name, for the messages (e.g. "SDPStrategy").
    """
    unknown = sorted(set(keywords) - set(PLAN_OPTIONS) - set(ENGINE_OPTIONS) - {"config"})
    if unknown:
        raise TypeError(f"{where} got unexpected keyword argument(s) {unknown}; its options are {list(PLAN_OPTIONS)}, "
                        f"config=SDPConfig(...) or the engine's options {list(ENGINE_OPTIONS)}")
    if isinstance(options, Mapping):
        if keywords:
            raise TypeError(f"{where} got both options= and the keywords {sorted(keywords)}; give them in one place")
        return options_of(options, where)
    if options is not None:
        if not isinstance(options, SDPOptions):
            raise TypeError(f"{where}: options must be an SDPOptions or a dict, got {type(options).__name__}")
        if keywords:
            raise TypeError(f"{where} got both options= and the keywords {sorted(keywords)}; give them in one place: "
                            "dataclasses.replace(options, ...)")
        return options
    engine = {k: v for k, v in keywords.items() if k in ENGINE_OPTIONS}
    config = config_from(keywords.get("config"), engine)
    return SDPOptions(config=config, **{k: v for k, v in keywords.items() if k in PLAN_OPTIONS})


def _sample_from_json(value, where: str):
    """A sample input written as JSON writes it, [shape, "int64"], as (shape, torch.int64)."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[1], str)):
        return value
    dtype = getattr(torch, value[1].removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: sample_input's dtype {value[1]!r} is not a torch dtype (e.g. \"int64\", "
                         "\"float32\")")
    return tuple(value[0]) if isinstance(value[0], list) else value[0], dtype


def options_of(options, where: str) -> SDPOptions:
    """SDPOptions from what an integration was given: None (refused: level and coverage are required), an
    SDPOptions, or a
    plain dict of the same options, as Hugging Face users pass `fsdp_config` (and as JSON holds
    it): SDPOptions' fields and the engine's options at the top level, or the engine's under
    "config" (a dict or an SDPConfig); a sample_input of [shape, dtype name] is read as
    (shape, dtype).

        options_of({"coverage": 0.5, "level": "neuron", "regime": "backward"}, "SDPTrainer(sdp=...)")

    Raises:
        TypeError: another type than these.
        ValueError: an unknown key (with the closest one), or a bad value (SDPOptions' and
            SDPConfig's own checks, naming it).
    """
    if options is None:
        return SDPOptions()
    if isinstance(options, SDPOptions):
        return options
    if not isinstance(options, Mapping):
        raise TypeError(f"{where}: the options are an SDPOptions or a dict of them, got {type(options).__name__}")
    keys = list(PLAN_OPTIONS) + ["config"] + list(ENGINE_OPTIONS)
    unknown = [k for k in options if k not in keys]
    if unknown:
        hints = {k: difflib.get_close_matches(str(k), keys, n=1) for k in unknown}
        said = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
        raise ValueError(f"{where}: unknown option(s) {said}; the options are {list(PLAN_OPTIONS)}, 'config', and "
                         f"the engine's {list(ENGINE_OPTIONS)}")
    entries = dict(options)
    config = entries.get("config")
    if isinstance(config, Mapping):  # the engine's options nested, as a JSON file would hold an SDPConfig
        inner = [k for k in config if k not in ENGINE_OPTIONS]
        if inner:
            raise ValueError(f"{where}: unknown engine option(s) {inner} under 'config'; they are "
                             f"{list(ENGINE_OPTIONS)}")
        both = sorted(set(config) & set(entries))
        if both:
            raise ValueError(f"{where}: {both} given both at the top level and under 'config'; give each once")
        entries.pop("config")
        entries.update(config)
    for name in ("blocks", "neuron_groups"):
        if isinstance(entries.get(name), list):
            entries[name] = tuple(tuple(d) if isinstance(d, list) else d for d in entries[name])
    if "sample_input" in entries:
        entries["sample_input"] = _sample_from_json(entries["sample_input"], where)
    try:
        return options_from(None, entries, where)
    except (TypeError, ValueError) as e:  # a bad value of the dict (config=42, coverage=2): said where
        raise ValueError(f"{where}: {e}") from None

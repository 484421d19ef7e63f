"""The integrations' options and the errors a wrong configuration meets before any process starts:
SDPOptions, the "sdp" strategy name, unsupported precisions, a plan for another number of
processes, and the import boundary (importing subnet_ext imports no framework)."""
import subprocess
import sys

import pytest

from integration_launch import ROOT, require_extra
from sdp_helpers import make_model

require_extra(("lightning", "transformers", "accelerate"), "lightning,hf")

# K = 2 at coverage 0.5 gives each unit one owner; the planner says so, rightly, every time.
pytestmark = pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")

import subnet_ext as sx  # noqa: E402
from subnet_ext.integrations import SDPOptions  # noqa: E402
from subnet_ext.integrations._extras import import_extra  # noqa: E402
from subnet_ext.integrations.options import options_from  # noqa: E402


def test_importing_subnet_ext_imports_no_framework():
    code = ("import sys, subnet_ext, subnet_ext.integrations, subnet_ext.integrations.options, "
            "subnet_ext.integrations.subnetwork_ensemble; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'transformers', 'accelerate')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_missing_extra_names_what_to_install():
    from unittest import mock

    from subnet_ext.integrations import _extras

    missing = ImportError("No module named 'transformers'")
    with mock.patch.object(_extras.importlib, "import_module", side_effect=missing):
        with pytest.raises(ImportError, match=r'needs transformers: pip install "subnet_ext\[hf\]"'):
            import_extra("transformers", "Hugging Face")


def test_options_are_checked_when_made():
    for bad, message in ((dict(coverage=0), "coverage"), (dict(coverage=1.5), "coverage"),
                         (dict(level="layer"), "level"), (dict(evaluation="mean"), "evaluation"),
                         (dict(plan="plan.json"), "plan must be a SubnetPlan"),
                         (dict(config=sx.SDPConfig(shard_shared=True)), "shard_shared")):
        with pytest.raises(ValueError, match=message):
            SDPOptions(**dict(dict(level="block", coverage=0.5), **bad))
    for given, missing in ((dict(), "level and coverage"), (dict(level="block"), "coverage"),
                           (dict(coverage=0.5), "level")):  # no setting is a default
        with pytest.raises(ValueError, match=rf"need {missing} \(or a ready plan=\)"):
            SDPOptions(**given)
    assert SDPOptions(level="neuron", coverage=[1, 0.5]).coverage == (1, 0.5)


def test_keywords_split_between_planning_and_the_engine():
    options = options_from(None, {"coverage": 0.25, "level": "neuron", "regime": "backward", "sync_every": 2}, "X")
    assert (options.coverage, options.level) == (0.25, "neuron")
    assert options.config == sx.SDPConfig(regime="backward", sync_every=2)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        options_from(None, {"coverge": 0.5}, "X")
    with pytest.raises(TypeError, match="both options= and the keywords"):
        options_from(SDPOptions(level="block", coverage=0.5), {"coverage": 0.5}, "X")


def test_a_ready_plan_must_match_the_number_of_processes():
    plan = sx.plan_subnetworks(make_model(), 2, 0.5, "block")
    options = SDPOptions(plan=plan)
    assert options.plan_for(make_model(), 2) is plan
    with pytest.raises(ValueError, match=r"made for world size 2, but this run has 1 process"):
        options.plan_for(make_model(), 1)


def _trainer(**kwargs):
    import lightning.pytorch as pl

    options = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    options.update(kwargs)
    return pl.Trainer(**options)


def test_the_sdp_strategy_name_and_its_defaults():
    from subnet_ext.integrations.lightning import SDPStrategy, SDPPrecision

    for name in ("sdp", "sdp_spawn"):  # registered, but no setting is a default: the error says what to give
        with pytest.raises(ValueError, match="need level and coverage"):
            _trainer(strategy=name)
    trainer = _trainer(strategy=SDPStrategy(level="block", coverage=0.5))
    assert type(trainer.strategy) is SDPStrategy and trainer.strategy._start_method == "popen"
    assert trainer.strategy.sdp_options == SDPOptions(coverage=0.5, level="block", evaluation="full")
    assert trainer.strategy.sdp_options.config.regime == "forward"
    assert isinstance(trainer.precision_plugin, SDPPrecision)


def test_lightning_precisions():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from subnet_ext.integrations.lightning import SDPStrategy
    from subnet_ext.integrations.lightning_precision import SDPMixedPrecision

    assert isinstance(_trainer(strategy=SDPStrategy(level="block", coverage=0.5), precision="bf16-mixed").precision_plugin, SDPMixedPrecision)
    fp16 = _trainer(strategy=SDPStrategy(level="block", coverage=0.5), plugins=[MixedPrecision("16-mixed", "cpu")]).precision_plugin
    assert isinstance(fp16, SDPMixedPrecision) and isinstance(fp16.scaler, sx.GradScaler)
    for precision in ("64-true", "bf16-true", "16-true"):
        with pytest.raises(ValueError, match=f"does not support precision '{precision}'"):
            _trainer(strategy=SDPStrategy(level="block", coverage=0.5), precision=precision)


def test_lightning_devices_must_match_a_ready_plan():
    from subnet_ext.integrations.lightning import SDPStrategy

    plan = sx.plan_subnetworks(make_model(), 2, 0.5, "block")
    assert _trainer(strategy=SDPStrategy(plan=plan)).strategy.sdp_options.plan is plan
    with pytest.raises(ValueError, match=r"made for world size 2, but this run has 3 process"):
        _trainer(strategy=SDPStrategy(plan=plan), devices=3)


def test_hf_trainer_checks(tmp_path):
    from transformers import TrainingArguments

    from subnet_ext.integrations.huggingface import SDPTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match="the options are an SDPOptions or a dict of them, got str"):
        SDPTrainer(model=make_model(), args=args, sdp="block")
    plan = sx.plan_subnetworks(make_model(), 2, 0.5, "block")
    with pytest.raises(ValueError, match=r"made for world size 2, but this run has 1 process"):
        SDPTrainer(model=make_model(), args=args, sdp=SDPOptions(plan=plan))


def test_hf_trainer_takes_its_options_as_a_plain_dict(tmp_path):
    """As Hugging Face users pass fsdp_config: a dict, checked key by key and value by value."""
    from transformers import TrainingArguments

    from subnet_ext.integrations.huggingface import SDPTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = SDPTrainer(model=make_model(), args=args, sdp={"coverage": 0.25, "level": "neuron", "regime": "backward",
                                                             "evaluation": "ensemble"})
    assert trainer.sdp_options == SDPOptions(coverage=0.25, level="neuron", evaluation="ensemble",
                                             config=sx.SDPConfig(regime="backward"))
    for bad, error, message in (({"coverge": 0.5}, ValueError, r"unknown option\(s\) 'coverge' \(did you mean "
                                                                   r"'coverage'\?\); the options are \["),
                                ({"coverage": 2, "level": "block"}, ValueError,
                                 r"^SDPTrainer\(sdp=...\): coverage must be a number in \(0, 1\] \(or one per rank\), "
                                 r"got 2"),
                                ({"regime": "sideways", "level": "block", "coverage": 0.5}, ValueError, "regime"),
                                ({"config": 42, "level": "block", "coverage": 0.5}, ValueError,
                                 r"SDPTrainer\(sdp=...\): config must be an SDPConfig"),
                                ({"regime": "forward"}, ValueError, r"need level and coverage")):
        with pytest.raises(error, match=message):
            SDPTrainer(model=make_model(), args=args, sdp=bad)


def test_options_as_json_holds_them():
    import json

    import torch

    from subnet_ext.integrations.options import options_of

    text = ('{"level": "block", "coverage": 0.5, "sample_input": [[1, 8], "int64"], '
            '"config": {"regime": "backward", "sync_every": 2}}')
    options = options_of(json.loads(text), "X")
    assert options.sample_input == ((1, 8), torch.int64)
    assert options.config == sx.SDPConfig(regime="backward", sync_every=2)
    assert options_of({"blocks": ["blocks.0", "blocks.1"], "level": "block", "coverage": 0.5}, "X").blocks == \
        ("blocks.0", "blocks.1")
    for bad, message in (({"config": {"regim": "forward"}}, r"unknown engine option\(s\) \['regim'\] under 'config'"),
                         ({"regime": "forward", "config": {"regime": "backward"}}, "given both at the top level"),
                         ({"sample_input": [[1, 8], "int65"]}, "sample_input's dtype 'int65' is not a torch dtype")):
        with pytest.raises(ValueError, match=message):
            options_of(bad, "X")
    from subnet_ext.integrations.lightning import SDPStrategy

    assert SDPStrategy({"coverage": 0.25, "level": "block"}).sdp_options == SDPOptions(coverage=0.25, level="block")


def test_an_untraceable_block_is_named_at_the_first_attempt():
    """The integrations plan through SDPOptions.plan_for: a block torch.fx cannot trace is named with
    the call it failed on the first time; with the framework's example input it is traced instead
    (Lightning's example_input_array, transformers' dummy_inputs)."""
    import torch

    from subnet_ext.integrations.huggingface import _dummy_input
    from user_blocks import build

    options = SDPOptions(level="block", coverage=0.5)
    with pytest.raises(ValueError) as refused:
        options.plan_for(build("pre_ln_mha"), 2)
    message = str(refused.value)
    assert message.startswith("TokenLM has no block-level unit the planner could read. candidate block 'blocks.0' "
                              "and 1 more (blocks.*) (PreLNBlock): torch.fx cannot trace it (TypeError: ones()"), message
    assert "sample_input=" in message
    example = torch.zeros(1, 8, dtype=torch.long)
    assert [g.path for g in options.plan_for(build("pre_ln_mha"), 2, example_input=example).groups] == \
        ["blocks.0", "blocks.1"]
    opt = build("hf_opt")
    with pytest.raises(ValueError, match=r"candidate block 'model.decoder.layers.0' and 1 more .* \(OPTDecoderLayer\)"):
        options.plan_for(opt, 2)
    planned = options.plan_for(opt, 2, example_input=_dummy_input(opt))
    assert [g.path for g in planned.groups] == ["model.decoder.layers.0", "model.decoder.layers.1"]

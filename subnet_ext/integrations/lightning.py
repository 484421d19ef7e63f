"""SDP as a PyTorch Lightning strategy: `Trainer(strategy=SDPStrategy(...))` or `strategy="sdp"`.

    import subnet_ext.integrations.lightning          # registers "sdp" and "sdp_spawn"
    trainer = lightning.pytorch.Trainer(strategy=SDPStrategy(coverage=0.5, level="neuron", regime="forward"),
                                        accelerator="gpu", devices=4)
    trainer.fit(lit_module, datamodule)               # the LightningModule written for DDP, unchanged

A subclass of Lightning's DDPStrategy (its launchers, process group set-up, gloo on CPU and
NCCL on GPU, reductions for `self.log(..., sync_dist=True)`, barriers and samplers) that
wraps the LightningModule in SubnetDataParallel instead of DDP, at the point DDP wraps it
(`setup`, after `configure_model`, when fitting). Where Lightning meets the engine:

- `configure_optimizers` runs with the module's `parameters()` / `named_parameters()` being
  the ones this rank trains; an optimizer over anything else (`self.net.parameters()` in the
  backward regime) is refused at its first step by the engine's optimizer guard.
- gradient clipping by norm: the whole model's norm (lightning_precision.py);
  `accumulate_grad_batches`: the engine's `no_sync()` between optimizer steps.
- precision "32-true", "bf16-mixed" and "16-mixed" (subnet_ext.GradScaler); others refused.
- validation, test and predict run the full model or the ensemble (`evaluation=`;
  lightning_evaluation.py); checkpoints hold the full state (it loads strictly into the plain
  LightningModule) and the full optimizer state in torch's full format (parameter names as
  keys), so `fit(ckpt_path=...)` resumes on any world size.
- when fitting ends the engine gives the module back (`close()`): plain, holding the trained
  full model. After an exception it is left as this rank's subnetwork (closing is collective).
"""
from __future__ import annotations

import contextlib
from datetime import timedelta

from ._extras import import_extra

import_extra("lightning", "lightning")

import torch.nn as nn  # noqa: E402
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from lightning.fabric.utilities.optimizer import _optimizers_to_device  # noqa: E402

from ..engine.data_parallel import SubnetDataParallel  # noqa: E402
from .lightning_evaluation import EvaluatedModel  # noqa: E402
from .lightning_precision import SDPPrecision, for_sdp  # noqa: E402
from .options import SDPOptions, options_from  # noqa: E402


class SDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with SubnetDataParallel in place of DDP.

    The other arguments (accelerator, parallel_devices, cluster_environment, checkpoint_io,
    precision_plugin, process_group_backend, timeout, start_method) are DDPStrategy's:
    start_method "popen" re-runs the script per process, "spawn" starts the processes from
    the Trainer call.

    Args:
        options: an SDPOptions (or a plain dict of them), or instead the same as keywords:
            coverage (0.5), level ("block"), seed, plan, blocks, neuron_groups, sample_input,
            evaluation ("full" or "ensemble": what validation, test and predict run), config,
            and the engine's options (regime ("forward"), sync_every, bucket_cap_mb, timeout,
            ...). Without a sample_input, a block torch.fx cannot trace is traced on the
            LightningModule's `example_input_array` (a tensor).

    Attributes:
        sdp_options: the SDPOptions. engine: the SubnetDataParallel while fitting, else None.
        plan: the plan of the current (or last) run, None before the first.

    Raises:
        ValueError: when the Trainer is made, a bad option, a ready plan whose world size is
        not devices x nodes, or an unsupported precision; when fitting starts, sync_batchnorm.
    """

    strategy_name = "sdp"

    def __init__(self, options: SDPOptions | None = None, *, accelerator=None, parallel_devices=None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", **sdp_options):
        self.sdp_options = options_from(options, sdp_options, "SDPStrategy")
        self._engine: SubnetDataParallel | None = None
        self.plan = None
        self._evaluated: EvaluatedModel | None = None
        self._closing_is_unsafe = False
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)

    @property
    def engine(self) -> SubnetDataParallel | None:
        """The SubnetDataParallel wrapping the LightningModule while fitting (None otherwise), for
        its reports and checks (comm_stats(), memory_report(), verify_consistency(), ...)."""
        return self._engine

    # ------------------------------------------------------------------ configuration
    @property
    def precision_plugin(self):
        """The precision plugin, in its SDP form (lightning_precision.for_sdp)."""
        if self._precision_plugin is None:
            self._precision_plugin = SDPPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Lightning sets the plugin it chose; unsupported precisions are refused here, at Trainer(...)."""
        self._precision_plugin = None if plugin is None else for_sdp(plugin)

    def set_world_ranks(self) -> None:
        """DDPStrategy's, then: a ready plan must be for devices x nodes processes."""
        super().set_world_ranks()
        if self.parallel_devices:
            self.sdp_options.check_world_size(self.num_nodes * self.num_processes)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer) -> None:
        """Plan the LightningModule (after configure_model) and, when fitting, wrap it in
        SubnetDataParallel, then build the optimizers over what this rank trains."""
        assert self.accelerator is not None and self.model is not None
        if self._layer_sync is not None:
            raise ValueError("SDPStrategy does not support sync_batchnorm=True: a BatchNorm inside a unit is held by "
                             "its owners only, so its statistics cannot be synchronised over every rank; use "
                             "sync_batchnorm=False")
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        module = self.lightning_module
        self.plan = self.sdp_options.plan_for(module, self.world_size, example_input=module.example_input_array)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._closing_is_unsafe = False
            self._engine = SubnetDataParallel(module, self.plan, config=self.sdp_options.config)
            self.model = self._engine
            self.precision_plugin.engine = self._engine
            self.setup_optimizers(trainer)
        else:
            _sync_module_states(module)  # as DDP: evaluation without wrapping
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def setup_optimizers(self, trainer) -> None:
        """Lightning's, with the module's parameters() and named_parameters() limited to the
        parameters this rank trains while configure_optimizers runs."""
        with _trained_parameters_only(self.lightning_module, self._engine):
            super().setup_optimizers(trainer)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: the backward passes inside accumulate without communicating."""
        if self._engine is None:
            yield
            return
        with self._engine.no_sync():
            yield

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict:
        """The full model's state dict (original names and shapes) on rank 0, on the CPU ({} on
        the others, which Lightning does not write). Collective while fitting."""
        if self._engine is None:
            return super().lightning_module_state_dict()
        return self._engine.full_state_dict(rank0_only=True, cpu_offload=True)

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer's full state in torch's full format (parameter names as keys) on rank 0,
        on the CPU ({} elsewhere). Collective while fitting."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._engine is None:
            return super().optimizer_state(optimizer)
        return self._engine.full_optimizer_state_dict(optimizer, rank0_only=True, cpu_offload=True)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """The checkpoint's full state into the module (before wrapping, as Lightning restores it) or
        into the engine's pieces (after)."""
        if self._engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._engine.load_full_state_dict(checkpoint["state_dict"])

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Each optimizer's share of its full state in the checkpoint (any world size or coverage)."""
        if self._engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._engine.load_full_optimizer_state_dict(optimizer, state)

    # ------------------------------------------------------------------ evaluation
    def _start_evaluation(self) -> None:
        self._evaluated = EvaluatedModel(self.lightning_module, self._engine, self.plan, self.sdp_options.config,
                                         self.sdp_options.evaluation)

    def _end_evaluation(self) -> None:
        self._evaluated = None

    def on_validation_start(self) -> None:
        """Assemble the model validation runs (collective while fitting)."""
        self._start_evaluation()

    def on_test_start(self) -> None:
        """Assemble the model testing runs (collective while fitting)."""
        self._start_evaluation()

    def on_predict_start(self) -> None:
        """Assemble the model prediction runs."""
        self._start_evaluation()

    def on_validation_end(self) -> None:
        """Release the evaluated model."""
        self._end_evaluation()

    def on_test_end(self) -> None:
        """Release the evaluated model."""
        self._end_evaluation()

    def on_predict_end(self) -> None:
        """Release the evaluated model."""
        self._end_evaluation()

    def _evaluation_step(self, name: str, context, args, kwargs):
        evaluated = self._evaluated or EvaluatedModel(self.lightning_module, None, self.plan,
                                                      self.sdp_options.config, "full")
        with context, evaluated.inside():
            return getattr(self.lightning_module, name)(*args, **kwargs)

    def validation_step(self, *args, **kwargs):
        """The LightningModule's validation_step on the evaluated model (full or ensemble)."""
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context(), args, kwargs)

    def test_step(self, *args, **kwargs):
        """The LightningModule's test_step on the evaluated model (full or ensemble)."""
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context(), args, kwargs)

    def predict_step(self, *args, **kwargs):
        """The LightningModule's predict_step on the evaluated model (full or ensemble)."""
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context(), args, kwargs)

    # ------------------------------------------------------------------ the end
    def on_exception(self, exception: BaseException) -> None:
        """After an exception the ranks may not reach teardown together: it will not close the engine."""
        self._closing_is_unsafe = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Give the LightningModule back as the plain model holding the trained values (the
        engine's collective close()), unless an exception interrupted the run."""
        engine, self._engine, self._evaluated = self._engine, None, None
        if engine is not None:
            self.precision_plugin.engine = None
            self.model = self.lightning_module
            if not self._closing_is_unsafe:
                engine.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register "sdp" (processes started by re-running the script, as "ddp") and "sdp_spawn"
        (started from the Trainer call, as "ddp_spawn"). SDP has no default setting (SDPOptions), so
        these names raise an error saying to pass SDPStrategy(level=..., coverage=...) instead."""
        for name, start_method in (("sdp", "popen"), ("sdp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"Subnetwork Data Parallelism, start_method "
                                           f"{start_method!r} (needs level and coverage: use SDPStrategy(...))",
                                           start_method=start_method)


@contextlib.contextmanager
def _trained_parameters_only(module: nn.Module, engine: SubnetDataParallel | None):
    """Within: module.parameters() and module.named_parameters() yield only what `engine` trains."""
    if engine is None:
        yield
        return
    trained = {id(p) for p in engine.parameters()}

    def parameters(recurse: bool = True):
        return (p for p in nn.Module.parameters(module, recurse) if id(p) in trained)

    def named_parameters(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        named = nn.Module.named_parameters(module, prefix, recurse, remove_duplicate)
        return ((n, p) for n, p in named if id(p) in trained)

    module.__dict__.update(parameters=parameters, named_parameters=named_parameters)
    try:
        yield
    finally:
        module.__dict__.pop("parameters", None)
        module.__dict__.pop("named_parameters", None)


SDPStrategy.register_strategies(StrategyRegistry)

"""SDP in the Hugging Face Trainer: `SDPTrainer` in place of `transformers.Trainer`.

    from subnet_ext.integrations.huggingface import SDPTrainer
    trainer = SDPTrainer(model=model, args=TrainingArguments(...), train_dataset=train, eval_dataset=val,
                         sdp=SDPOptions(coverage=0.5, level="block", config=SDPConfig(regime="forward")))
    trainer.train(); trainer.save_model()           # launched with torchrun / accelerate launch, as for DDP

accelerate's `prepare` puts DDP around the model in a multi-process run. SDPTrainer wraps the
model in SubnetDataParallel itself when training starts (before the optimizer is made), so
the Trainer treats it as a model that is already wrapped: accelerate prepares the optimizer
(and the dataloaders) but never the model, so there is no second wrapper. Where the Trainer
meets the engine:

- the optimizer is made from the engine's parameters (what this rank trains, with the
  Trainer's weight-decay groups by name); one passed in `optimizers=` and built before
  training is refused at its first step by the engine's optimizer guard;
- gradient accumulation: accelerate's `no_sync(model)` reaches the engine's `no_sync()`;
- `max_grad_norm`: clipped, and `grad_norm` logged, by the whole model's norm;
- bf16 / fp16: the Trainer's autocast comes from accelerate as `accelerator.autocast()`
  around each forward and loss (accelerate would have patched the forward of the model it
  prepares); fp16 scales the loss with subnet_ext.GradScaler (agreed skips);
- evaluation and prediction run the full model (the union of the subnetworks) or the
  ensemble of the ranks' subnetworks (`SDPOptions.evaluation`), each rank on its shard;
- `save_model()` (and each checkpoint) writes the full model with `save_pretrained`, so
  `AutoModelForCausalLM.from_pretrained` loads it; checkpoints hold the full optimizer state
  (parameter names as keys) and resume on any world size;
- when training ends the engine gives the model back (`close()`), plain and trained.
"""
from __future__ import annotations

import os

from ._extras import import_extra

import_extra("transformers", "Hugging Face")
import_extra("accelerate", "Hugging Face")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME  # noqa: E402

from ..engine.data_parallel import SubnetDataParallel  # noqa: E402
from .subnetwork_ensemble import SubnetworkEnsemble  # noqa: E402
from .loss_scaling import agreed_scaler  # noqa: E402
from .options import SDPOptions, options_of  # noqa: E402


# The Trainer's methods SDPTrainer takes over: the training loop as transformers 5 splits it.
TRAINER_HOOKS = ("_prepare_for_training", "_finalize_training", "_wrap_model", "_clip_grad_norm", "_get_grad_norm",
                 "_save", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
                 "autocast_smart_context_manager", "create_optimizer")
_missing_hooks = [name for name in TRAINER_HOOKS if not hasattr(Trainer, name)]
if _missing_hooks:
    raise ImportError(f"SDPTrainer needs a transformers Trainer with {_missing_hooks} (transformers 5; tested with "
                      f"5.25), but transformers {transformers.__version__} is installed: pip install -U "
                      "\"transformers>=5\"")

LOSS_KEYWORDS = ("num_items_in_batch", "shift_labels", "ignore_index")


class CausalLMEnsemble(SubnetworkEnsemble):
    """SubnetworkEnsemble for a transformers causal LM: with `labels` among the inputs, the output's
    loss is the model's loss of the ensemble's logits (not the mean of the subnetworks' losses), with
    the loss keywords the Trainer passes (num_items_in_batch: the tokens counted over every rank)."""

    def forward(self, *args, **kwargs):
        """As SubnetworkEnsemble's; loss recomputed from the mean logits [B, T, V] when labels are given."""
        out = super().forward(*args, **kwargs)
        labels, model = kwargs.get("labels"), self.members[0]
        model = model.module if isinstance(model, SubnetDataParallel) else model
        if labels is not None and getattr(out, "logits", None) is not None and hasattr(model, "loss_function"):
            loss_kwargs = {k: kwargs[k] for k in LOSS_KEYWORDS if k in kwargs}  # the Trainer's token count
            out.loss = model.loss_function(logits=out.logits, labels=labels, vocab_size=model.config.vocab_size,
                                           **loss_kwargs).float()
        return out


def _dummy_input(model: nn.Module):
    """transformers' example of the model's main input (`dummy_inputs`, e.g. input_ids [3, 5]), or None."""
    try:
        value = model.dummy_inputs.get(getattr(model, "main_input_name", "input_ids"))
    except Exception:  # noqa: BLE001 - a model without them, or whose property fails: none
        return None
    return value if isinstance(value, torch.Tensor) else None


def _inner(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


class SDPTrainer(Trainer):
    """transformers.Trainer that trains the model with SubnetDataParallel instead of DDP.

    The positional and other keyword arguments are transformers.Trainer's (model, args,
    datasets, collator, callbacks, ...).

    Args:
        sdp: the SDPOptions (level and coverage required: SDP has no default setting), or the same
            as a plain dict, as `fsdp_config` is passed:
            {"coverage": 0.5, "level": "neuron", "regime": "backward"} (options.options_of).
            Without a sample_input, a block torch.fx cannot trace is traced on the model's
            `dummy_inputs`.

    Attributes:
        sdp_options: the SDPOptions. engine: the SubnetDataParallel while training, else None.
        sdp_plan: the plan of the current (or last) training, None before the first.

    Raises:
        ValueError: DeepSpeed, FSDP or several GPUs in one process (DataParallel), which SDP
            does not combine with; a ready plan whose world size is not the number of processes;
            an unknown key or a bad value in `sdp`.
    """

    def __init__(self, *args, sdp: SDPOptions | dict | None = None, **kwargs):
        self.sdp_options = options_of(sdp, "SDPTrainer(sdp=...)")
        self._engine: SubnetDataParallel | None = None
        self.sdp_plan = None
        self._made_optimizer = False
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or self.args.n_gpu > 1:
            raise ValueError("SDPTrainer trains one process per device with SubnetDataParallel; it does not combine "
                             "with DeepSpeed, FSDP or DataParallel (several GPUs in one process): launch one process "
                             "per device with torchrun or accelerate launch, without a DeepSpeed or FSDP config")
        self.sdp_options.check_world_size(self.args.world_size)

    @property
    def engine(self) -> SubnetDataParallel | None:
        """The SubnetDataParallel wrapping the model while training (None otherwise)."""
        return self._engine

    # ------------------------------------------------------------------ training
    def _wrap_for_sdp(self) -> None:
        """Plan the model and wrap it (once per train()); make the loss scaler one every rank agrees on."""
        if self._engine is not None:
            return
        world = self.args.world_size
        if world > 1 and not dist.is_initialized():
            raise RuntimeError(f"SDPTrainer: TrainingArguments say {world} processes but torch.distributed is not "
                               "initialised; launch with torchrun or accelerate launch")
        self.sdp_plan = self.sdp_options.plan_for(self.model, world, example_input=_dummy_input(self.model))
        if self._made_optimizer:
            self.optimizer, self._made_optimizer = None, False  # it holds the previous wrapping's parameters
        self._engine = SubnetDataParallel(self.model, self.sdp_plan, config=self.sdp_options.config)
        self.model_wrapped = self._engine
        if self.accelerator.scaler is not None:
            self.accelerator.scaler = agreed_scaler(self.accelerator.scaler, self.accelerator.device.type)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Wrap the model in SubnetDataParallel, then the Trainer's preparation (it sees a wrapped
        model, so accelerate prepares the optimizer and not the model)."""
        self._wrap_for_sdp()
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, over the parameters this rank trains (the engine's)."""
        if self._engine is not None and model is None:
            self._made_optimizer = self._made_optimizer or self.optimizer is None
            model = self._engine
        return super().create_optimizer(model)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """accelerate's autocast (bf16 / fp16 training), around every forward and loss."""
        return self.accelerator.autocast()

    def _clip_grad_norm(self, model):
        """max_grad_norm: clip by the whole model's gradient norm (returned, the same on every rank)."""
        if self._engine is None:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return self._engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged grad_norm: the whole model's."""
        if self._engine is not None and grad_norm is None:
            self.accelerator.unscale_gradients()
            grad_norm = self._engine.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def _finalize_training(self, trial, num_train_samples, start_time):
        """Give the model back (collective close(): plain, holding the trained full model), then the
        Trainer's end of training (best-model loading, callbacks)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
            self.model_wrapped = self.model
        return super()._finalize_training(trial, num_train_samples, start_time)

    # ------------------------------------------------------------------ evaluation
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        """Training: the engine. Evaluation and prediction: the full model (collective while
        training) or the ensemble of the subnetworks (SDPOptions.evaluation)."""
        if self._engine is not None:
            return self._engine if training else self._evaluation_model()
        if not training and self.sdp_options.evaluation == "ensemble":
            return self._evaluation_model()
        return super()._wrap_model(model, training, dataloader)

    def _evaluation_model(self) -> nn.Module:
        full = self._engine.full_model() if self._engine is not None else self.model
        if self.sdp_options.evaluation == "full":
            return full
        plan = self.sdp_plan or self.sdp_options.plan_for(self.model, self.args.world_size,
                                                          example_input=_dummy_input(self.model))
        return CausalLMEnsemble(full, plan, self.sdp_options.config)

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full model with save_pretrained (from_pretrained loads it), written by the main
        process. Collective while training: every process calls it, as the Trainer does."""
        if self._engine is None:
            return super().save_model(output_dir, _internal_call)
        state = self._engine.full_state_dict(rank0_only=True, cpu_offload=True)
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The full optimizer state (torch's full format) and the scheduler's, written by the main process."""
        if self._engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        state = self._engine.full_optimizer_state_dict(_inner(self.optimizer), rank0_only=True, cpu_offload=True)
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Each rank's share of the checkpoint's full optimizer state (any world size or coverage)."""
        if self._engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer_file, scheduler_file = (os.path.join(checkpoint, n) for n in (OPTIMIZER_NAME, SCHEDULER_NAME))
        if not (os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file)):
            return  # as the Trainer: a checkpoint without them resumes the model only
        state = torch.load(optimizer_file, map_location="cpu", weights_only=True)
        self._engine.load_full_optimizer_state_dict(_inner(self.optimizer), state)
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

"""Hugging Face Trainer runs for test_hf_trainer.py: one process per rank, started by the test with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as `torchrun
hf_runs.py` would. accelerate sets up the gloo process group from it.

    python hf_runs.py OUT_DIR          # every rank of the CPU runs (gloo)
    python hf_runs.py OUT_DIR gpu      # one process on one GPU: SDP at coverage 1 against the plain Trainer

The same script is a Trainer script written for DDP: the SDP runs change the Trainer class
(SDPTrainer) and nothing else. A tiny LLaMA-style causal LM is built from a config (no download).
Each rank saves what it recorded to OUT_DIR/main-rank<r>.pt; models and checkpoints go under OUT_DIR.
"""
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import subnet_ext as sx
from subnet_ext.engine.config import SDPConfig
from subnet_ext.integrations import SDPOptions
from subnet_ext.integrations.huggingface import SDPTrainer

VOCAB, SEQ = 32, 12


def make_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


class Sequences(torch.utils.data.Dataset):
    """Counting sequences (start, start + step, ...) mod VOCAB: learnable, so the loss falls."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        starts, steps = torch.randint(0, VOCAB, (n,), generator=g), torch.randint(1, 4, (n,), generator=g)
        self.ids = (starts[:, None] + steps[:, None] * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Watch(TrainerCallback):
    """All-reduces issued in the first micro-batch of each step and in the rest of it up to the
    optimizer step (counted at torch.distributed), and the type of the model the Trainer trains."""

    def __init__(self):
        self.first_micro_batch, self.last_micro_batch, self.wrappers, self.calls = [], [], set(), []
        self.inconsistent = []
        self.original = torch.distributed.all_reduce

    def on_step_begin(self, args, state, control, **kwargs):
        self.calls = []
        torch.distributed.all_reduce = lambda *a, **k: self.calls.append(1) or self.original(*a, **k)

    def on_substep_end(self, args, state, control, **kwargs):
        self.first_micro_batch.append(len(self.calls))
        self.calls.clear()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        torch.distributed.all_reduce = self.original
        self.last_micro_batch.append(len(self.calls))

    def on_step_end(self, args, state, control, **kwargs):
        engine = getattr(self.trainer, "engine", None)
        if engine is not None:
            try:
                engine.verify_consistency()  # owners bit-identical after every step (collective)
            except sx.ConsistencyError as e:
                self.inconsistent.append(f"step {state.global_step}: {e}")
        wrapped = self.trainer.model_wrapped
        ddp = [type(m).__name__ for m in wrapped.modules() if isinstance(m, DistributedDataParallel)]
        self.wrappers.add((type(wrapped).__name__, tuple(ddp)))


class InjectInf(TrainerCallback):
    """An inf in the gradient of a block only rank `rank` owns, during optimizer step `step` (a
    tensor hook, so it is there before the loss scaler looks); the scale and an embedding row after
    each step."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank, self.handle, self.scales, self.embedding = step, rank, None, [], []

    def on_step_begin(self, args, state, control, **kwargs):
        engine = self.trainer.engine
        if state.global_step == self.step and engine.rank == self.rank:
            plan = engine.plan
            only_mine = next(g.path for g, (a, _) in zip(plan.groups, plan.unit_ranges)
                             if plan.owners[self.rank, a] and plan.owners[:, a].sum() == 1)
            weight = engine.module.get_submodule(only_mine).mlp.down_proj.weight
            self.handle = weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.scales.append(self.trainer.accelerator.scaler.get_scale())
        self.embedding.append(self.trainer.model.model.embed_tokens.weight[0].detach().clone())


def arguments(out_dir, name, **changes):
    options = dict(output_dir=os.path.join(out_dir, name), per_device_train_batch_size=2,
                   per_device_eval_batch_size=4, gradient_accumulation_steps=2, max_steps=6, learning_rate=3e-3,
                   lr_scheduler_type="constant", max_grad_norm=1e3, logging_steps=1, eval_strategy="steps",
                   eval_steps=3, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                   disable_tqdm=True, dataloader_num_workers=0)
    options.update(changes)
    return TrainingArguments(**options)


def train(trainer_class, out, name, args, resume=None, callbacks=(), **sdp):
    model = make_model()
    watch = Watch()
    kwargs = {"sdp": SDPOptions(**sdp)} if trainer_class is SDPTrainer else {}
    trainer = trainer_class(model=model, args=args, train_dataset=Sequences(48, 1), eval_dataset=Sequences(16, 2),
                            callbacks=[watch, *callbacks], **kwargs)
    for callback in (watch, *callbacks):
        callback.trainer = trainer
    if args.fp16:  # a user's scaler settings: low enough that only the injected inf overflows
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    out[name] = {"loss": [h["loss"] for h in history if "loss" in h],
                 "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
                 "eval_loss": [h["eval_loss"] for h in history if "eval_loss" in h],
                 "first_micro_batch": watch.first_micro_batch,
                 "last_micro_batch": watch.last_micro_batch, "wrappers": sorted(watch.wrappers),
                 "inconsistent": watch.inconsistent,
                 "final": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                 "plan": trainer.sdp_plan.to_json() if trainer_class is SDPTrainer else None}
    return trainer


def main(out_dir, out):
    train(Trainer, out, "ddp", arguments(out_dir, "ddp"))
    train(SDPTrainer, out, "sdp_c1", arguments(out_dir, "sdp_c1"), coverage=1.0, level="neuron")
    clip_bf16 = dict(bf16=True, max_grad_norm=0.5)
    train(Trainer, out, "ddp_bf16", arguments(out_dir, "ddp_bf16", **clip_bf16))
    train(SDPTrainer, out, "sdp_c1_bf16", arguments(out_dir, "sdp_c1_bf16", **clip_bf16), coverage=1.0,
          level="block")

    half = dict(coverage=0.5, level="block", config=SDPConfig(regime="forward"))
    saving = dict(save_strategy="steps", save_steps=3, **clip_bf16)
    trainer = train(SDPTrainer, out, "sdp_c05", arguments(out_dir, "sdp_c05", **saving), **half)
    out["evaluate_after"] = trainer.evaluate()["eval_loss"]  # the plain model the engine gave back
    trainer.save_model(os.path.join(out_dir, "saved"))
    checkpoint = os.path.join(out_dir, "sdp_c05", "checkpoint-3")
    train(SDPTrainer, out, "sdp_c05_resumed", arguments(out_dir, "sdp_c05_resumed", **saving), resume=checkpoint,
          **half)
    inject = InjectInf(step=2, rank=1)
    train(SDPTrainer, out, "sdp_c05_fp16", arguments(out_dir, "sdp_c05_fp16", fp16=True, eval_strategy="no"),
          callbacks=[inject], **half)
    out["sdp_c05_fp16"].update(scales=inject.scales, embedding=inject.embedding)
    # The trained weights in a fresh model: accelerate leaves its bf16 autocast wrapper on the trained
    # model's forward (seen with accelerate 1.15-1.16), so the ensemble would run in bf16, the reference in fp32.
    final = make_model()
    final.load_state_dict(trainer.model.state_dict())
    ensemble = SDPTrainer(model=final, args=arguments(out_dir, "ensemble"), eval_dataset=Sequences(16, 2),
                          sdp=SDPOptions(evaluation="ensemble", **half))
    out["evaluate_ensemble"] = ensemble.evaluate()["eval_loss"]


def gpu_main(out_dir, out):
    """One process on one GPU (the process group accelerate makes from torchrun's environment, if
    any): SDPTrainer at coverage 1 against the plain Trainer, fp32 and bf16 with clipping."""
    gpu = dict(use_cpu=False)
    train(Trainer, out, "ddp", arguments(out_dir, "ddp", **gpu))
    train(SDPTrainer, out, "sdp_c1", arguments(out_dir, "sdp_c1", **gpu), coverage=1.0, level="neuron")
    clip_bf16 = dict(bf16=True, max_grad_norm=0.5, **gpu)
    train(Trainer, out, "ddp_bf16", arguments(out_dir, "ddp_bf16", **clip_bf16))
    train(SDPTrainer, out, "sdp_c1_bf16", arguments(out_dir, "sdp_c1_bf16", **clip_bf16), coverage=1.0)
    out["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    out["device"] = str(next(iter(out["sdp_c1_bf16"]["final"].values())).device)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "main")
    results = {}
    (gpu_main if mode == "gpu" else main)(out_dir, results)
    initialized = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if initialized else 0
    torch.save(results, os.path.join(out_dir, f"{mode}-rank{rank}.pt"))
    if initialized:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    print(f"hf runs: rank {rank} done", flush=True)

"""Lightning runs for test_lightning_strategy.py, started as a script so Lightning's own launcher
(the "ddp"-style popen launcher: rank 0 re-runs this script for rank 1) starts the processes.

    python lightning_runs.py OUT_DIR main      # 2 processes: DDP references and SDP runs
    python lightning_runs.py OUT_DIR resume    # 1 process: resume main's checkpoint on world size 1
    python lightning_runs.py OUT_DIR gpu       # 1 process on one GPU (NCCL): SDP at coverage 1 against DDP

Every Trainer of a mode runs in the same processes, one after the other (Lightning keeps the
process group between them), so the processes start once. Each rank saves what it recorded to
OUT_DIR/<mode>-rank<r>.pt; the test compares.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

import subnet_ext as sx
from subnet_ext.integrations.lightning import SDPStrategy
from subnet_ext.models import ResidualMLP

IN, CLASSES, N_TRAIN, N_VAL, BATCH = 8, 4, 64, 32, 4
CLIP = 0.1  # below the gradient norms here: every step clips


class LitResidual(pl.LightningModule):
    """A LightningModule as written for DDP: forward, steps, logging, optimizers from self.parameters()."""

    def __init__(self, lr: float = 0.1, optimizer_params: str = "self"):
        super().__init__()
        self.save_hyperparameters()
        self.net = ResidualMLP(IN, CLASSES, width=16, depth=4, hidden=32)
        self.inject_inf_at_step = None  # (optimizer step, rank): an inf in that rank's owned unit's gradient

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def on_after_backward(self):
        if self.inject_inf_at_step == (self.trainer.global_step, self.global_rank):
            engine = self.trainer.strategy.engine
            owned = next(g.path for g, (a, _) in zip(engine.plan.groups, engine.plan.unit_ranges)
                         if engine.plan.owners[self.global_rank, a] and engine.plan.owners[:, a].sum() == 1)
            self.get_submodule(owned).fc1.weight.grad.fill_(float("inf"))

    def configure_optimizers(self):
        params = self.parameters() if self.hparams.optimizer_params == "self" else self.net.blocks.parameters()
        return torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.9)


VOCAB, WIDTH, HEADS, SEQ, LM_BATCH, LM_SEQUENCES = 32, 16, 2, 8, 2, 16


class SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)

    def forward(self, x, mask):
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


class PreLNBlock(torch.nn.Module):
    """Issue 40's block: the causal mask built in forward, attention by nn.MultiheadAttention."""

    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = torch.nn.LayerNorm(WIDTH), SelfAttention(), torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        T = x.shape[1]  # noqa: N806
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class LitLM(pl.LightningModule):
    """A token model as written for DDP: a ModuleList of PreLNBlocks, no SDP declaration; Lightning's
    example_input_array (which the model summary uses) is its only example of an input."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.lr = lr
        self.emb, self.pos = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)
        self.blocks = torch.nn.ModuleList([PreLNBlock() for _ in range(4)])
        self.ln_f, self.head = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, VOCAB)
        self.example_input_array = torch.zeros(1, SEQ, dtype=torch.long)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[:ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = F.cross_entropy(self(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def lm_data():
    return TensorDataset(torch.randint(0, VOCAB, (LM_SEQUENCES, SEQ + 1), generator=torch.Generator().manual_seed(5)))


def data(n, seed):
    """Inputs and labels from a fixed random teacher, so a model can learn them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(123))
    return TensorDataset(x, (x @ teacher).argmax(1))


def loaders():
    return (DataLoader(data(N_TRAIN, 1), batch_size=BATCH, shuffle=False),
            DataLoader(data(N_VAL, 2), batch_size=BATCH, shuffle=False))


class Record(Callback):
    """Every logged loss (after sync_dist), the loss scale, the stem's weight after each batch, the
    all-reduces each backward issued (counted here, at torch.distributed), and checks at the end."""

    def __init__(self):
        self.train_loss, self.val_loss, self.scales, self.stem, self.backward_all_reduces = [], [], [], [], []
        self.end = {}
        self._calls = None

    def on_before_backward(self, trainer, module, loss):
        self._calls, all_reduce = [], torch.distributed.all_reduce
        torch.distributed.all_reduce = lambda *a, **k: self._calls.append(1) or all_reduce(*a, **k)
        self._all_reduce = all_reduce

    def on_after_backward(self, trainer, module):
        torch.distributed.all_reduce = self._all_reduce
        self.backward_all_reduces.append(len(self._calls))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train_loss.append(trainer.callback_metrics["train_loss"].item())
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(scaler.get_scale())
        self.stem.append(module.net.stem.weight.detach().clone())

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.val_loss.append(trainer.callback_metrics["val_loss"].item())

    def on_train_end(self, trainer, module):
        engine = trainer.strategy.engine if isinstance(trainer.strategy, SDPStrategy) else None
        if engine is not None:
            try:
                engine.verify_consistency()  # owners bit-identical (collective)
                self.end["consistency"] = "consistent"
            except sx.ConsistencyError as e:
                self.end["consistency"] = str(e)
            self.end["full_state"] = engine.full_state_dict()
            self.end["optimizer"] = engine.full_optimizer_state_dict(trainer.optimizers[0])


def fit(strategy, out, name, *, epochs=1, module=None, ckpt_path=None, callbacks=(), **trainer_options):
    """Fit a fresh LitResidual (seeded: the same on every rank and in every run) and record it."""
    torch.manual_seed(0)
    module = module or LitResidual()
    record = Record()
    options = dict(accelerator="cpu", devices=trainer_options.pop("devices", 2), max_epochs=epochs, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=None)
    options.update(trainer_options)
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        options["enable_checkpointing"] = True
    trainer = pl.Trainer(strategy=strategy, callbacks=[record, *callbacks], **options)
    train, val = loaders()
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    out[name] = {"train_loss": record.train_loss, "val_loss": record.val_loss, "scales": record.scales,
                 "backward_all_reduces": record.backward_all_reduces, "stem": record.stem, "final": {k: v.detach().clone() for k, v in module.state_dict().items()},
                 "plan": strategy.plan.to_json() if isinstance(strategy, SDPStrategy) else None, **record.end}
    return module


def fit_lm(out):
    """LitLM under SDPStrategy at block level, nothing declared: each rank's local losses and the mean logged."""
    class Losses(Callback):
        def __init__(self):
            self.logged, self.local, self.batches = [], [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.logged.append(trainer.callback_metrics["train_loss"].item())
            self.local.append(outputs["loss"].item())
            self.batches.append(batch[0].clone())  # Lightning's distributed sampler shuffles the training data

    torch.manual_seed(0)
    module, losses = LitLM(), Losses()
    out["lm_initial"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    strategy = SDPStrategy(coverage=0.5, level="block")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[losses])
    trainer.fit(module, DataLoader(lm_data(), batch_size=LM_BATCH, shuffle=False))
    out["lm"] = {"logged": losses.logged, "local": losses.local, "batches": losses.batches,
                 "plan": strategy.plan.to_json(),
                 "final": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def validate(strategy, module, devices=2):
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    return trainer.validate(module, loaders()[1], verbose=False)[0]["val_loss"]


def main_runs(out_dir, out):
    """2 processes: coverage 1 against DDP, then coverage 0.5 with checkpoints, resume, evaluation, precision."""
    same = dict(accumulate_grad_batches=2)
    fit("ddp", out, "ddp", **same)
    fit(SDPStrategy(coverage=1.0, level="neuron", regime="forward"), out, "sdp_c1_neuron_forward", **same)
    fit(SDPStrategy(coverage=1.0, level="block", regime="backward"), out, "sdp_c1_block_backward", **same)
    fit("ddp", out, "ddp_clip", gradient_clip_val=0.05, **same)
    fit(SDPStrategy(coverage=1.0, level="block"), out, "sdp_c1_clip", gradient_clip_val=0.05, **same)
    fit("ddp", out, "ddp_bf16", precision="bf16-mixed", **same)
    fit(SDPStrategy(coverage=1.0, level="neuron"), out, "sdp_c1_bf16", precision="bf16-mixed", **same)

    ckpts = os.path.join(out_dir, "ckpts")
    every_epoch = ModelCheckpoint(dirpath=ckpts, filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                                  save_on_train_epoch_end=True)
    trained = fit(SDPStrategy(coverage=0.5, level="block", regime="forward"), out, "sdp_c05", epochs=3, callbacks=[every_epoch], gradient_clip_val=CLIP, **same)
    fit(SDPStrategy(coverage=0.5, level="block", regime="forward"), out, "sdp_c05_resumed", epochs=3,
        ckpt_path=os.path.join(ckpts, "epoch=0.ckpt"), gradient_clip_val=CLIP, **same)
    out["validate_ddp"] = validate("ddp", trained)  # the plain module given back, under DDP
    out["validate_ensemble"] = validate(SDPStrategy(coverage=0.5, level="block", evaluation="ensemble"), trained)
    tester = pl.Trainer(strategy=SDPStrategy(coverage=0.5, level="block"), accelerator="cpu", devices=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    out["test_full"] = tester.test(trained, loaders()[1], verbose=False)[0]["test_loss"]
    predict = pl.Trainer(strategy=SDPStrategy(coverage=0.5, level="block", evaluation="ensemble"), accelerator="cpu", devices=2,
                         logger=False, enable_progress_bar=False)
    out["predict_ensemble"] = torch.cat(predict.predict(trained, loaders()[1]))

    fit(SDPStrategy(coverage=0.5, level="neuron", evaluation="ensemble"), out, "sdp_c05_neuron_ensemble", **same)
    try:
        fit(SDPStrategy(coverage=0.5, level="block", regime="backward"), out, "sdp_c05_backward", **same)
    except Exception as e:  # recorded, so the other runs' checks still run
        out["sdp_c05_backward"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        torch.manual_seed(0)
        fit(SDPStrategy(coverage=0.5, level="block", regime="backward"), out, "stale",
            module=LitResidual(optimizer_params="blocks"))
    except Exception as e:  # the optimizer guard, at the first step, on every rank
        out["stale_error"] = f"{type(e).__name__}: {e}"

    fit_lm(out)

    torch.manual_seed(0)
    fp16 = LitResidual()
    fp16.inject_inf_at_step = (2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # low enough that only the injected inf overflows
    fit(SDPStrategy(coverage=0.5, level="block"), out, "sdp_c05_fp16", module=fp16,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])


def resume_runs(out_dir, out):
    """1 process: resume the 2-process coverage-0.5 checkpoint on world size 1."""
    class Loaded(Callback):
        def on_train_start(self, trainer, module):
            engine = trainer.strategy.engine
            out["loaded_state"] = engine.full_state_dict()
            out["loaded_optimizer"] = engine.full_optimizer_state_dict(trainer.optimizers[0])

    fit(SDPStrategy(coverage=0.5, level="block", regime="forward"), out, "resumed_k1", epochs=2, devices=1,
        ckpt_path=os.path.join(out_dir, "ckpts", "epoch=0.ckpt"), callbacks=[Loaded()], accumulate_grad_batches=2)


def gpu_runs(out_dir, out):
    """1 process on one GPU, Lightning's DDP and SDPStrategy over NCCL (world size 1): coverage 1
    against DDP, fp32 (neuron level forward, block level backward with clipping) and bf16-mixed."""
    gpu = dict(accelerator="gpu", devices=1, accumulate_grad_batches=2)
    fit("ddp", out, "ddp", **gpu)
    fit(SDPStrategy(coverage=1.0, level="neuron", regime="forward"), out, "sdp_neuron_forward", **gpu)
    fit("ddp", out, "ddp_clip", gradient_clip_val=0.05, **gpu)
    fit(SDPStrategy(coverage=1.0, level="block", regime="backward"), out, "sdp_block_backward_clip",
        gradient_clip_val=0.05, **gpu)
    fit("ddp", out, "ddp_bf16", precision="bf16-mixed", **gpu)
    fit(SDPStrategy(coverage=1.0, level="neuron"), out, "sdp_bf16", precision="bf16-mixed", **gpu)
    out["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    out["device"] = str(next(iter(out["sdp_bf16"]["final"].values())).device)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, mode = sys.argv[1], sys.argv[2]
    results = {}
    {"main": main_runs, "resume": resume_runs, "gpu": gpu_runs}[mode](out_dir, results)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.save(results, os.path.join(out_dir, f"{mode}-rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    print(f"{sx.__name__} lightning runs: {mode} rank {rank} done", flush=True)

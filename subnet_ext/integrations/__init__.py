"""SDP where users already train: a PyTorch Lightning strategy and a Hugging Face Trainer.

    from subnet_ext.integrations.lightning import SDPStrategy      # needs the [lightning] extra
    trainer = lightning.pytorch.Trainer(strategy=SDPStrategy(coverage=0.5, level="neuron"), devices=2)

    from subnet_ext.integrations.huggingface import SDPTrainer     # needs the [hf] extra
    trainer = SDPTrainer(model=model, args=training_args, train_dataset=data)

A layer above the engine and below the command line (docs/architecture.md). Importing
`subnet_ext` or this package imports neither Lightning nor transformers: each framework
is imported by its own module (`lightning.py`, `huggingface.py`), only when that module
is. What both share is torch-only: the options (`options.py`: coverage, level, plan,
engine config, evaluation mode) and the evaluated models (`subnetwork_ensemble.py`: the full model
and the ensemble of the ranks' subnetworks). See docs/integrations.md.
"""
from .options import EVALUATIONS, SDPOptions

__all__ = ["SDPOptions", "EVALUATIONS"]

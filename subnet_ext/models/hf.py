"""transformers causal LMs as `subnet-train` models (`--model hf:DIR`), an optional extra.

DIR holds a causal LM's config.json, and optionally its weights (*.safetensors or
pytorch_model*.bin): with weights the model is `AutoModelForCausalLM.from_pretrained(DIR)`,
without them a fresh initialisation from the config (under the caller's torch seed, so
every rank builds the same model). transformers is imported only here, only when asked.
"""
from __future__ import annotations

import glob
import json
import os

import torch
import torch.nn as nn

INSTALL_HINT = 'pip install "subnet_ext[hf]"'
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"--model hf:DIR needs the optional transformers extra: {INSTALL_HINT} "
                          f"(import failed: {e})") from e
    return transformers


def _config_path(folder: str) -> str:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model hf:{folder}: no config.json in that folder (save one with "
                         "config.save_pretrained(DIR) or model.save_pretrained(DIR))")
    return path


def hf_vocab_size(folder: str) -> int:
    """The vocabulary size in DIR/config.json (read without importing transformers).

    Raises:
        ValueError: no config.json, or one without a positive integer vocab_size.
    """
    with open(_config_path(folder)) as f:
        config = json.load(f)
    vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"--model hf:{folder}: config.json has no positive integer vocab_size (got {vocab!r})")
    return vocab


def has_weights(folder: str) -> bool:
    """True when `folder` holds weight files transformers can load (safetensors or .bin)."""
    return any(glob.glob(os.path.join(folder, pattern)) for pattern in _WEIGHT_PATTERNS)


class HFCausalLM(nn.Module):
    """A transformers causal LM whose forward returns the logits tensor, as the tasks expect.

    input_ids int64 [B, T] -> logits [B, T, vocab_size]. The transformers model is the
    child `model`, so its parameter names are "model." + its own (its units are found
    by the planner like those of the project's llama).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [B, T] -> logits [B, T, vocab_size]."""
        # No KV cache: a training forward; the output object's logits only.
        return self.model(input_ids=input_ids, use_cache=False).logits

    def gradient_checkpointing_enable(self) -> None:
        """transformers' own activation checkpointing (non-reentrant) of every decoder layer."""
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_hf_causal_lm(folder: str) -> HFCausalLM:
    """The causal LM of DIR: pretrained weights when DIR has them, else fresh from config.json.

    Raises:
        ImportError: transformers is not installed (names the extra to install).
        ValueError: DIR has no config.json.
    """
    _config_path(folder)
    transformers = _transformers()
    if has_weights(folder):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        config = transformers.AutoConfig.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return HFCausalLM(model)

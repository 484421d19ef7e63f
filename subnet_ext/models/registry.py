"""build_model(name, preset=None, **kw): the models the CLI and benchmarks know by name."""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from .gpt import GPT, GPT_PRESETS
from .llama import LLAMA_PRESETS, LlamaForCausalLM
from .residual_mlp import ResidualMLP, plain_mlp
from .resnet import resnet18

MODEL_NAMES = ("mlp", "plain_mlp", "resnet", "llama", "gpt")


def build_model(name: str, preset: str | None = None, **kw) -> nn.Module:
    """mlp: ResidualMLP(in_features, num_classes, width=128); plain_mlp(in_features, num_classes);
    resnet: resnet18(num_classes, in_channels, width=16 for 1 channel else 64);
    llama: LlamaForCausalLM(LLAMA_PRESETS[preset or "tiny"]);
    gpt: GPT(GPT_PRESETS[preset or "tiny"]), with vocab_size / block_size / parallel_residual
    overridden when given.

    Raises:
        ValueError: unknown name or preset, or an option the model does not take.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    width = kw.pop("width", None)
    if name == "llama":
        if preset not in (None, *LLAMA_PRESETS):
            raise ValueError(f"unknown llama preset {preset!r}; choose one of {', '.join(LLAMA_PRESETS)}")
        if width is not None:
            raise ValueError("--width does not apply to llama; pick a --preset instead")
        return LlamaForCausalLM(LLAMA_PRESETS[preset or "tiny"])
    if name == "gpt":
        if preset not in (None, *GPT_PRESETS):
            raise ValueError(f"unknown gpt preset {preset!r}; choose one of {', '.join(GPT_PRESETS)}")
        if width is not None:
            raise ValueError("--width does not apply to gpt; pick a --preset instead")
        allowed = {"vocab_size", "block_size", "parallel_residual", "dropout"}
        extra = sorted(set(kw) - allowed)
        if extra:
            raise ValueError(f"gpt takes only {sorted(allowed)} as overrides, got {extra}")
        return GPT(dataclasses.replace(GPT_PRESETS[preset or "tiny"], **kw))
    if preset is not None:
        raise ValueError(f"--preset applies to llama and gpt only, got --preset {preset} for {name}")
    if name == "mlp":
        return ResidualMLP(kw["in_features"], kw["num_classes"], width=width or 128)
    if name == "plain_mlp":
        return plain_mlp(kw["in_features"], kw["num_classes"])
    in_ch = kw.get("in_channels", 3)
    return resnet18(kw["num_classes"], in_ch, width=width or (16 if in_ch == 1 else 64))

"""Models SDP recognises without help: residual and plain MLPs, ResNet, LLaMA, a nanoGPT-style GPT."""
from .gpt import GPT, GPT_PRESETS, GPTConfig
from .llama import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM
from .registry import MODEL_NAMES, build_model
from .residual_mlp import ResidualMLP, ResidualMLPBlock, plain_mlp
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18

__all__ = ["GPT", "GPT_PRESETS", "GPTConfig", "LLAMA_PRESETS", "LlamaConfig", "LlamaForCausalLM", "MODEL_NAMES", "build_model", "ResidualMLP",
           "ResidualMLPBlock", "plain_mlp", "BasicBlock", "Bottleneck", "ResNet", "resnet18"]

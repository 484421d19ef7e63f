"""A LLaMA-style decoder: RMSNorm, rotary embeddings, grouped-query attention, gated MLP,
with Hugging Face parameter names (model.layers.0.self_attn.q_proj.weight, ...).

Head counts are read from the projection shapes at run time (n_heads = rows of q_proj /
head_dim), and the query heads of kv head j are the contiguous heads j*g .. (j+1)*g-1,
so a model whose projections were sliced to some kv-head groups (rows of q/k/v, columns
of o_proj) or to some MLP neurons still runs: that is how SDP materialises a subnetwork.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-style model: vocabulary, hidden width, MLP width, layers, query and
    key/value heads, head_dim; rope_theta, RMSNorm eps, maximum positions, tied embeddings."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def num_parameters(self) -> int:
        """Number of parameters (embeddings, lm_head unless tied, layers, final norm)."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h


def _preset(vocab, hidden, inter, layers, heads, kv):
    return LlamaConfig(vocab, hidden, inter, layers, heads, kv, hidden // heads)


# tiny/small/medium: CPU tests and benchmarks. 134m: the SDP paper's LLaMA-134M shape
# (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000, untied: ~134M).
# 1b: TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads / 4 kv heads, 5632).
LLAMA_PRESETS = {
    "tiny": _preset(256, 64, 176, 2, 4, 2),
    "small": _preset(2048, 256, 688, 4, 8, 4),
    "medium": _preset(8192, 512, 1376, 6, 8, 4),
    "134m": _preset(32000, 768, 2048, 12, 12, 12),
    "1b": _preset(32000, 2048, 5632, 22, 32, 4),
}


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2, -1) + eps) * weight, computed in float32; weight: [dim]."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim], same dtype as x."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Rotary(nn.Module):
    """cos/sin tables [T, head_dim], computed on the fly (not state: nothing to average)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)

    def forward(self, t: int, device, dtype):
        """(cos, sin) tables, each [t, head_dim] in `dtype` on `device`, for positions 0 .. t-1."""
        freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with rotary embeddings (q/k/v/o projections, no bias)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden], cos/sin: [T, head_dim] -> [B, T, hidden]; head counts read from
        the (possibly sliced) projection shapes."""
        b, t, _ = x.shape
        hd = self.head_dim
        n_heads, n_kv = self.q_proj.weight.shape[0] // hd, self.k_proj.weight.shape[0] // hd
        q = self.q_proj(x).view(b, t, n_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, n_kv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, n_kv, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if n_heads != n_kv:
            k = k.repeat_interleave(n_heads // n_kv, dim=1)
            v = v.repeat_interleave(n_heads // n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, n_heads * hd))


class LlamaMLP(nn.Module):
    """Gated MLP: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden] (the intermediate width may be sliced)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). Returns a tensor, so a skipped layer is the identity."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden], cos/sin: [T, head_dim] -> [B, T, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Token embedding, decoder layers and final RMSNorm (no lm_head)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [B, T] -> hidden states [B, T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """input_ids int64 [B, T] -> logits [B, T, vocab_size]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.device.type != "meta":
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [B, T] -> logits [B, T, vocab_size]."""
        return self.lm_head(self.model(input_ids))

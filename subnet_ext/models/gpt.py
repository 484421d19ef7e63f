"""A small character/token GPT with the structure and names of the most common hand-written
GPT training scripts (nanoGPT-style): `transformer.wte/wpe/drop/h/ln_f`, pre-LN blocks
`ln_1, attn, ln_2, mlp`, a fused `c_attn` qkv Linear and `c_proj` output Linear, an MLP of
`c_fc` / `c_proj` Linears, `lm_head` tied to `wte`, and `forward(idx, targets=None)`
returning `(logits, loss)`.

`parallel_residual=True` gives the parallel block of GPT-J / PaLM,
`x + attn(ln_1(x)) + mlp(ln_1(x))` (one norm, both branches read the same input).

Head counts are read from the (possibly sliced) `c_attn` width at run time, so a model
whose heads or MLP neurons were sliced to a subnetwork still runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT: context length, vocabulary, layers, heads, embedding width;
    dropout, biases in Linears and LayerNorms, and the block layout. head_dim (default
    n_embd / n_head) and n_inner (the MLP's hidden width, default 4 x n_embd) let a block be
    narrower than the residual stream, as a neuron-level subnetwork is."""

    block_size: int = 128
    vocab_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    parallel_residual: bool = False
    head_dim: int | None = None
    n_inner: int | None = None

    @property
    def attn_width(self) -> int:
        """n_head x head_dim: the width of q, k, v and of c_proj's input."""
        return self.n_head * (self.head_dim or self.n_embd // self.n_head)

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width (n_inner, default 4 x n_embd)."""
        return self.n_inner or 4 * self.n_embd

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters (tied lm_head counted once); non_embedding drops the position table."""
        e, v, a, h = self.n_embd, self.vocab_size, self.attn_width, self.mlp_width
        ln = 2 * e if self.bias else e
        attn = 3 * a * e + a * e + (3 * a + e if self.bias else 0)
        mlp = 2 * e * h + (h + e if self.bias else 0)
        per_layer = attn + mlp + (1 if self.parallel_residual else 2) * ln
        total = v * e + self.block_size * e + self.n_layer * per_layer + ln
        return total - self.block_size * e if non_embedding else total


# nanoGPT's Tiny Shakespeare CPU recipe (subnet_ext/data/shakespeare.py): 4 layers x 128, 4 heads,
# context 64, the 65 characters, no biases.
_SHAKESPEARE = GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, bias=False)
GPT_PRESETS = {
    "tiny": GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(block_size=128, vocab_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=256, vocab_size=128, n_layer=6, n_head=6, n_embd=192),
    # small's parameter count in 16 blocks: block-level SDP at C = 0.5 keeps 8 blocks per subnetwork
    "deep": GPTConfig(block_size=128, vocab_size=128, n_layer=16, n_head=4, n_embd=64),
    "shakespeare": _SHAKESPEARE,
    "shakespeare-deep": replace(_SHAKESPEARE, n_layer=8),
    # Dense models of one SDP subnetwork's size (the study's smaller-dense controls): block level at
    # C = 0.5 / 0.25 keeps 2 / 1 of the 4 blocks; neuron level keeps 2 / 1 of the 4 heads (head
    # width 32) and 256 / 128 of the 512 MLP neurons, the residual stream staying 128 wide.
    "shakespeare-half-depth": replace(_SHAKESPEARE, n_layer=2),
    "shakespeare-quarter-depth": replace(_SHAKESPEARE, n_layer=1),
    "shakespeare-half-width": replace(_SHAKESPEARE, n_head=2, head_dim=32, n_inner=256),
    "shakespeare-quarter-width": replace(_SHAKESPEARE, n_head=1, head_dim=32, n_inner=128),
    # Twice as wide, context 128: a shape where model state, not activations, fills a step's memory at a
    # micro-batch of 1 x 128 (the study's bf16 memory measurement).
    "shakespeare-d256": replace(_SHAKESPEARE, n_embd=256, block_size=128),
}


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (torch's has no bias=False before 2.1); x: [..., ndim]."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., ndim] -> [..., ndim]."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with one fused qkv projection `c_attn` [3A, E]
    (rows: q heads, then k heads, then v heads; A = n_head x head_dim, E by default) and an
    output projection `c_proj` [E, A]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.head_dim is None and cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}; set head_dim")
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.attn_width, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.attn_width, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.head_dim = cfg.attn_width // cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, E] -> [B, T, E]; the head count is c_attn's width / (3 * head_dim)."""
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim)))


class MLP(nn.Module):
    """c_proj(gelu(c_fc(x))): E -> H -> E, H = n_inner (4E by default; the hidden width may be sliced)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, E] -> [B, T, E]."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then + mlp(ln_2(.)). Two residual adds."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, E] -> [B, T, E]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelBlock(nn.Module):
    """Parallel-residual block: x + attn(ln_1(x)) + mlp(ln_1(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, E] -> [B, T, E]."""
        h = self.ln_1(x)
        return x + self.attn(h) + self.mlp(h)


class GPT(nn.Module):
    """idx int64 [B, T] (T <= block_size) -> (logits [B, T, vocab], loss or None).

    With targets int64 [B, T] the loss is the mean cross-entropy (targets == -1 ignored);
    without, logits are computed for every position (nanoGPT computes only the last one at
    inference; a full-sequence output keeps evaluation simple)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        block = ParallelBlock if cfg.parallel_residual else Block
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(block(cfg) for _ in range(cfg.n_layer)),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") and p.device.type != "meta":
                # Residual projections scaled by 1/sqrt(2 * layers) (GPT-2's initialisation).
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if not isinstance(m, (nn.Linear, nn.Embedding)) or m.weight.device.type == "meta":
            return
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx [B, T] -> (logits [B, T, vocab], mean cross-entropy over targets [B, T] or None)."""
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas=(0.9, 0.95),
                             params=None) -> torch.optim.AdamW:
        """AdamW with weight decay on 2-D tensors (matmul weights, embeddings) and none on
        biases and norms, as nanoGPT. `params`: the (name, parameter) pairs to optimise
        (default: the model's own; pass `sdp.named_parameters()` under SDP)."""
        named = dict(self.named_parameters() if params is None else params)
        named = {n: p for n, p in named.items() if p.requires_grad}
        decay = [p for p in named.values() if p.dim() >= 2]
        no_decay = [p for p in named.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

"""Residual blocks as users write them, in tiny token models, for the tests of the planner's
traced calls (planning/test_traced_calls.py) and of training them (models/test_traced_blocks.py).

NEED_A_CALL are those torch.fx cannot trace: the causal mask built in forward from the input's
length (`torch.ones(T, T)`, issue 40's block, with nn.MultiheadAttention and with
F.scaled_dot_product_attention(is_causal=True)), a branch on a size, a parallel attention + MLP
block, Hugging Face decoder layers (OPT, GPT-NeoX with its parallel residual, GPT-J) called
with keyword arguments. torch.fx traces the others: a timm-style block written out (drop path,
layer scale, its shape unpacked), timm's own ViT blocks, and a block its parent calls with
keywords only (`hidden_states=`).

    build(name) -> model (seeded); loss_of(name, model, rank, step) -> scalar; SAMPLE: the sample
    input every model takes ((1, SEQ) token ids).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, SEQ, LAYERS = 32, 16, 2, 8, 2
SAMPLE = ((1, SEQ), torch.long)


def causal_mask(x):
    """[T, T] bool, True above the diagonal (masked), built as users build it."""
    T = x.shape[1]  # noqa: N806 - the users' name
    return torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)


class SelfAttention(nn.Module):
    """nn.MultiheadAttention behind a module of the user's: attn(x, mask) -> [B, T, E]."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)

    def forward(self, x, mask):
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def mlp():
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))


class PreLNBlock(nn.Module):
    """Issue 40's block: the causal mask from T = x.shape[1], torch.ones(T, T) (torch.fx: TypeError)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(WIDTH), SelfAttention(), nn.LayerNorm(WIDTH), mlp()

    def forward(self, x):
        T = x.shape[1]  # noqa: N806
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class SdpaAttention(nn.Module):
    """Causal attention by F.scaled_dot_product_attention(is_causal=True), its heads unpacked from the
    shape; takes the block's mask for the same call as SelfAttention (is_causal applies the same mask)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask):
        B, T, C = x.shape  # noqa: N806
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SdpaBlock(PreLNBlock):
    """Issue 40's block with attention by F.scaled_dot_product_attention(is_causal=True)."""

    def __init__(self):
        super().__init__()
        self.attn = SdpaAttention()


class BranchBlock(nn.Module):
    """A branch on a size: the MLP only for sequences longer than 4 (every one here)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(WIDTH), SelfAttention(), nn.LayerNorm(WIDTH), mlp()

    def forward(self, x):
        x = x + self.attn(self.ln1(x), causal_mask(x))
        if x.size(1) > 4:
            x = x + self.mlp(self.ln2(x))
        return x


class TimmStyleBlock(nn.Module):
    """timm's Block written out: timm's Attention and Mlp, LayerScale, DropPath (0.1), shape unpacked."""

    def __init__(self):
        super().__init__()
        from timm.layers import Attention, DropPath, LayerScale, Mlp

        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention(WIDTH, HEADS, qkv_bias=True)
        self.ls1, self.drop_path1 = LayerScale(WIDTH, 0.5), DropPath(0.1)
        self.norm2, self.mlp = nn.LayerNorm(WIDTH), Mlp(WIDTH, 2 * WIDTH)
        self.ls2, self.drop_path2 = LayerScale(WIDTH, 0.5), DropPath(0.1)

    def forward(self, x):
        B, N, C = x.shape  # noqa: N806
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)).reshape(B, N, C)))


class ParallelBlock(nn.Module):
    """Parallel attention + MLP from one norm (GPT-J, PaLM), causal mask built in forward."""

    def __init__(self):
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(WIDTH), SelfAttention(), mlp()

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h, causal_mask(x)) + self.mlp(h)


class KeywordBlock(nn.Module):
    """A block its parent calls with keywords only: block(hidden_states=..., attention_mask=...)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(WIDTH), SelfAttention(), nn.LayerNorm(WIDTH), mlp()

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.attn(self.ln1(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.ln2(hidden_states))


class TokenLM(nn.Module):
    """ids [B, T] -> logits [B, T, VOCAB] through a ModuleList of blocks."""

    def __init__(self, block, keywords=False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)
        self.blocks = nn.ModuleList([block() for _ in range(LAYERS)])
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.keywords = keywords

    def forward(self, ids):
        x = self.emb(ids) + self.pos[:ids.shape[1]]
        mask = causal_mask(x) if self.keywords else None
        for block in self.blocks:
            x = block(hidden_states=x, attention_mask=mask) if self.keywords else block(x)
        return self.head(self.ln_f(x))


def _hf(name):
    import transformers as tf

    common = dict(vocab_size=VOCAB, max_position_embeddings=2 * SEQ)
    if name == "hf_opt":
        return tf.OPTForCausalLM(tf.OPTConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS, ffn_dim=2 * WIDTH,
                                              num_attention_heads=HEADS, word_embed_proj_dim=WIDTH, dropout=0.0,
                                              attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2, **common))
    if name == "hf_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                                      intermediate_size=2 * WIDTH, num_attention_heads=HEADS,
                                                      use_parallel_residual=True, bos_token_id=1, eos_token_id=2,
                                                      **common))
    return tf.GPTJForCausalLM(tf.GPTJConfig(n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=2 * SEQ,
                                            rotary_dim=4, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))


def _timm_vit():
    from timm.models.vision_transformer import Block

    class TimmViT(TokenLM):  # timm's own Block (recognised by structure), drop path and layer scale
        def __init__(self):
            super().__init__(lambda: Block(WIDTH, HEADS, mlp_ratio=2.0, init_values=0.5, drop_path=0.1))

    return TimmViT()


USER_BLOCKS = {"pre_ln_mha": PreLNBlock, "sdpa": SdpaBlock, "size_branch": BranchBlock, "timm_style": TimmStyleBlock,
               "parallel": ParallelBlock}
HF = ("hf_opt", "hf_neox", "hf_gptj")
NAMES = tuple(USER_BLOCKS) + ("keyword", "timm_vit") + HF
# Those torch.fx cannot trace: without a sample input the planner names them.
NEED_A_CALL = ("pre_ln_mha", "sdpa", "size_branch", "parallel") + HF


def build(name):
    """The model `name` (NAMES), seeded: the same weights in every process."""
    torch.manual_seed(0)
    if name in USER_BLOCKS:
        return TokenLM(USER_BLOCKS[name])
    if name == "keyword":
        return TokenLM(KeywordBlock, keywords=True)
    if name == "timm_vit":
        return _timm_vit()
    return _hf(name)


def block_paths(name):
    """The module paths of the model's blocks."""
    prefix = {"hf_opt": "model.decoder.layers", "hf_neox": "gpt_neox.layers", "hf_gptj": "transformer.h"}
    return [f"{prefix.get(name, 'blocks')}.{i}" for i in range(LAYERS)]


def tokens(rank, step, n=3):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)


def loss_of(name, model, rank, step):
    """Next-token cross-entropy on this rank's batch of this step (drop path seeded by step)."""
    ids = tokens(rank, step)
    torch.manual_seed(10_000 + 100 * step + rank)  # the same drop-path draws in every emulation of a rank
    out = model(ids[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

"""transformers' gradient_checkpointing_enable (non-reentrant) on a tiny LLaMA under SDP:
the same gradients as without it in both regimes and levels, and the backward regime's
direct gradient writes happen once per use. One process, the engine simulating rank 0
of 2. Needs transformers (an optional dependency of the tests only)."""
import pytest
import torch

import subnet_ext as sx
from sdp_helpers import counting_direct_writes

transformers = pytest.importorskip("transformers")


def make_llama(checkpointing: bool):
    """LlamaForCausalLM with 2 layers of width 16 (vocab 32), the same weights every call."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _grads(regime, level, coverage, checkpointing):
    """({name: gradient} after one backward, DirectGradient.write calls)."""
    model = make_llama(checkpointing)
    sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, 2, coverage, level), regime=regime,
                                simulate_rank=0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with counting_direct_writes() as writes:
        sdp(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in sdp.module.named_parameters() if p.grad is not None}, writes[0]


@pytest.mark.parametrize("regime,level,coverage", [("forward", "block", 0.5), ("forward", "neuron", 0.5),
                                                   ("backward", "block", 0.5), ("backward", "neuron", 1.0)])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gradient_checkpointing_enable_gives_the_same_gradients(regime, level, coverage):
    plain, plain_writes = _grads(regime, level, coverage, False)
    ckpt, ckpt_writes = _grads(regime, level, coverage, True)
    assert plain and plain.keys() == ckpt.keys()
    assert max((plain[n] - ckpt[n]).abs().max().item() for n in plain) <= 1e-6
    assert plain_writes == ckpt_writes
    if (regime, level) == ("backward", "neuron"):
        assert plain_writes > 0

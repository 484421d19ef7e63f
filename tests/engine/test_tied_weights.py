"""Tied weights (lm_head.weight is embed_tokens.weight): one tensor, one set of owners,
averaged once, and every export keeps the tie. Tiny LLaMA, 3 gloo ranks, block level
coverage 0.5 (2 owners per layer), forward regime, 3 SGD steps, against a one-process
reference of owner-averaged subnetwork steps and a byte count made here."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import make_model
from subnet_ext.models.llama import LlamaConfig, LlamaForCausalLM
from subnet_ext.testing import run_distributed

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
LR, STEPS, TIED = 0.1, 3, ("lm_head.weight", "model.embed_tokens.weight")


def tied_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG)


def tokens(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, CFG.vocab_size, (2, 6), generator=g)


def lm_loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1))


class _Skip(nn.Module):
    def forward(self, x, *args):
        return x


def layer_owners(plan, world):
    """{layer index: ranks owning it}, read off the plan's owner matrix."""
    return {int(g.path.rsplit(".", 1)[1]): [q for q in range(world) if plan.owners[q, a]]
            for g, (a, _) in zip(plan.groups, plan.unit_ranges)}


def reference(model, owners, world):
    """SGD on owner-mean subnetwork gradients: rank q skips the layers it does not own;
    shared parameters (the tied embedding once) average over all ranks."""
    model = copy.deepcopy(model)
    for step in range(STEPS):
        grads = []
        for q in range(world):
            m = copy.deepcopy(model)
            for i, ranks in owners.items():
                if q not in ranks:
                    m.model.layers[i] = _Skip()
            lm_loss(m, tokens(q, step)).backward()
            grads.append({n: p.grad for n, p in m.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                ranks = owners[int(n.split(".")[2])] if n.startswith("model.layers.") else range(world)
                p -= LR * torch.stack([grads[q][n] for q in ranks]).mean(0)
    return model


def _worker(rank, world):
    model = tied_llama()
    ref_model = reference(model, layer_owners(sx.plan_subnetworks(model, world, 0.5, "block"), world), world)
    plan = sx.plan_subnetworks(model, world, 0.5, "block")
    sdp = sx.SubnetDataParallel(model, plan, regime="forward", strategy="groups")
    opt = torch.optim.SGD(sdp.parameters(), lr=LR)
    for step in range(STEPS):
        lm_loss(sdp, tokens(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    out = {"aliases": plan.aliases}
    # Bytes one step hands to all-reduces: each distinct parameter this rank trains, once.
    owners = layer_owners(plan, world)
    mine = [p for n, p in tied_llama().named_parameters()
            if not n.startswith("model.layers.") or rank in owners[int(n.split(".")[2])]]
    out["bytes"] = (sdp.comm_stats()["bytes_per_step"], 4 * sum(p.numel() for p in mine))
    sdp.verify_consistency()
    full = sdp.full_state_dict()
    expected = ref_model.state_dict()
    out["keys"] = list(full) == list(expected)
    out["ref_diff"] = max((full[k] - expected[k]).abs().max().item() for k in expected)
    out["export_tied"] = full[TIED[0]] is full[TIED[1]]
    fresh = LlamaForCausalLM(CFG)
    fresh.load_state_dict(full, strict=True)
    out["fresh_tied"] = fresh.lm_head.weight is fresh.model.embed_tokens.weight
    ids = tokens(99, 0)
    with torch.no_grad():
        want = ref_model.eval()(ids)
    out["eval_diff"] = (sdp.evaluate(ids, modes=("full",))["full"] - want).abs().max().item()
    fm = sdp.full_model()
    out["full_model_tied"] = fm.lm_head.weight is fm.model.embed_tokens.weight
    with torch.no_grad():
        out["full_model_diff"] = (fm.eval()(ids) - want).abs().max().item()
    local = sdp.local_full_state_dict()
    out["local_alias"] = torch.equal(local[TIED[0]], local[TIED[1]])
    adam = torch.optim.Adam(sdp.parameters(), lr=0.0)  # a step gives it state; lr 0 keeps the values
    lm_loss(sdp, tokens(rank, 0)).backward()
    adam.step()
    adam.zero_grad()
    state = sdp.full_optimizer_state_dict(adam)
    out["optim_names"] = (TIED[1] in state["state"], TIED[0] in state["state"])
    sdp.load_full_state_dict(full)  # both names, same values: accepted
    untied = {k: v.clone() for k, v in full.items()}
    untied[TIED[0]] += 1
    try:
        sdp.load_full_state_dict(untied)
        out["untied_error"] = None
    except ValueError as e:
        out["untied_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 3, timeout=300)


def test_tied_embedding_is_communicated_once_and_matches_reference(results):
    for rank, res in enumerate(results):
        assert res["aliases"] == {TIED[0]: TIED[1]}
        measured, counted = res["bytes"]
        assert measured == counted, (rank, measured, counted)
        assert res["ref_diff"] < 1e-5, res


def test_tied_exports_stay_tied(results):
    for res in results:
        assert res["keys"] and res["export_tied"] and res["fresh_tied"] and res["full_model_tied"], res
        assert res["eval_diff"] < 1e-5 and res["full_model_diff"] < 1e-5, res
        assert res["local_alias"], res
        assert res["optim_names"] == (True, False), res  # the tensor's state is saved once
        assert res["untied_error"] and TIED[0] in res["untied_error"], res


def test_plan_json_records_aliases_and_refuses_ties_across_units():
    model = tied_llama()
    plan = sx.plan_subnetworks(model, 3, 0.5, "block")
    again = sx.SubnetPlan.from_json(plan.to_json())
    assert again.aliases == {TIED[0]: TIED[1]} and TIED[0] not in again.tensor_shapes
    assert again.fingerprint == plan.fingerprint
    import json
    bad = json.loads(plan.to_json())
    bad["aliases"] = {TIED[1]: TIED[0]}  # canonical after its alias
    with pytest.raises(ValueError, match="alias"):
        sx.SubnetPlan.from_json(json.dumps(bad))
    mlp = make_model()
    mlp.blocks[1].fc1.weight = mlp.blocks[0].fc1.weight  # one tensor in two blocks
    with pytest.raises(ValueError, match="tied"):
        sx.plan_subnetworks(mlp, 2, 0.5, "block")

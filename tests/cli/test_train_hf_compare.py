"""`--model hf:DIR` (a transformers causal LM) under sdp and ddp, the missing-extra error,
and `subnet-train compare --seeds` (through training_args, mean ± std, paired Δ)."""
import json
import statistics
import sys

import pytest
import torch

from subnet_ext.cli import compare, train
from subnet_ext.jobs import runner
from subnet_ext.jobs.report import seeds_table

transformers = pytest.importorskip("transformers")  # the [hf] extra; in the Makefile's DEPS, so CI has it


def tiny_llama_dir(path, weights=False):
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      tie_word_embeddings=False)
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


@pytest.mark.parametrize("method,nproc,extra", [("sdp", 2, ["--precision", "bf16", "--activation-checkpointing"]),
                                                ("ddp", 1, [])])
def test_hf_model_trains(tmp_path, method, nproc, extra):
    folder = tiny_llama_dir(tmp_path / "llama")
    out = tmp_path / "out"
    assert train.main(["--model", f"hf:{folder}", "--data", "synthetic", "--method", method, "--nproc", str(nproc),
                       "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--out", str(out), *extra]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["task"] == "language" and len(report["history"]["loss"]) == 3
    assert all(abs(loss - torch.log(torch.tensor(64.0)).item()) < 1.0 for loss in report["history"]["loss"][:1])
    if method == "sdp":
        assert report["plan"] and "ensemble" in report["final"]


def test_hf_pretrained_weights_are_loaded(tmp_path):
    from subnet_ext.models.hf import load_hf_causal_lm

    folder = tiny_llama_dir(tmp_path / "llama", weights=True)
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    torch.manual_seed(123)  # a fresh initialisation would differ
    loaded = load_hf_causal_lm(str(folder))
    for k, v in saved.items():
        torch.testing.assert_close(loaded.model.state_dict()[k], v)
    ids = torch.randint(0, 64, (2, 5))
    assert loaded(ids).shape == (2, 5, 64)


def test_missing_transformers_names_the_extra(tmp_path, monkeypatch):
    from subnet_ext.models.hf import load_hf_causal_lm

    folder = tiny_llama_dir(tmp_path / "llama")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ImportError, match=r'pip install "subnet_ext\[hf\]"'):
        load_hf_causal_lm(str(folder))


def _fake_report(label, acc):
    return {"label": label, "task": "classification", "final": {"full": {"loss": 1.0, "accuracy": acc}},
            "per_rank": [{"memory": {}, "activation_bytes": 0, "peak_rss_bytes": 0}],
            "comm": {"bytes_per_step": 1, "collectives_per_step": 1}, "step_time_s": 1.0, "throughput_per_s": 1.0,
            "throughput_unit": "samples", "history": {"step": [1], "loss": [1.0]}, "training": {"lr": 0.1}}


def test_compare_seeds_builds_runs_with_training_args_and_tabulates(tmp_path, monkeypatch):
    accuracy = {("ddp", 0): 0.90, ("ddp", 1): 0.80, ("ddp", 2): 0.85}
    seen = []

    def fake_run(args):
        assert isinstance(args, type(train.training_args()))  # a Namespace from training_args, no argv
        label = args.method if args.method != "sdp" else f"sdp-{args.level}-{args.regime}"
        seen.append((label, args.seed, args.steps))
        return _fake_report(label, accuracy.get((label, args.seed), 0.70 + 0.01 * args.seed))

    monkeypatch.setattr(runner, "run", fake_run)  # what compare calls
    monkeypatch.setattr(compare, "VARIANTS", [("ddp", None, None), ("sdp", "block", "forward")])
    assert compare.main(["--seeds", "3", "--steps", "7", "--out", str(tmp_path)]) == 0
    assert sorted(seen) == sorted((lbl, s, 7) for lbl in ("ddp", "sdp-block-forward") for s in range(3))
    text = (tmp_path / "compare.md").read_text()
    sdp = [0.70, 0.71, 0.72]
    ddp = [0.90, 0.80, 0.85]
    diffs = [100 * (a - b) for a, b in zip(sdp, ddp)]
    row = (f"| sdp-block-forward | {100 * statistics.mean(sdp):.2f} ± {100 * statistics.stdev(sdp):.2f} "
           f"| {statistics.mean(diffs):+.2f} ± {statistics.stdev(diffs):.2f} pp | 3 |")
    assert row in text
    assert f"| ddp | {100 * statistics.mean(ddp):.2f} ± {100 * statistics.stdev(ddp):.2f} | +0.00 ± 0.00 pp | 3 |" in text


def test_seeds_table_for_losses_uses_plain_differences():
    by_seed = {s: [dict(_fake_report("ddp", 0), task="language", final={"full": {"loss": 2.0 + s}}),
                   dict(_fake_report("sdp", 0), task="language", final={"full": {"loss": 2.5 + 2 * s}})]
               for s in (0, 1)}
    text = seeds_table(by_seed)
    assert "| sdp | 3.5000 ± 1.4142 | +1.0000 ± 0.7071 | 2 |" in text

"""bench/memory_1b.py at its CPU size (`--device cpu --size tiny`): the same code the GPU runs
at 1B parameters (bench/gpu_check.sh's memory-1b step), every configuration measured with
StepMemoryMeter beside the memory model's prediction.

Checked independently of the script: the configurations are the issue's (DDP, DDP with
checkpointing, FSDP2, SDP block and neuron level in both regimes at C = 0.5 and 0.25, SDP with
checkpointing); DDP's peak holds at least its model state as counted here from the shapes
(parameters, gradients, AdamW's two moments: 16 bytes per parameter); FSDP2's holds less
than a quarter of that (the state sharded over 8); SDP at C = 0.25 on blocks in the forward
regime peaks below DDP; every prediction lies within 10% of the meter (DDP and FSDP2 from
planning/costs/replicated_memory.py, SDP from planning/costs/memory_model.py, all under bf16 autocast
and AdamW's foreach update).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["ddp", "ddp +checkpointing", "fsdp"] + [
    f"sdp {level}/{regime} C={c}" for c in ("0.5", "0.25") for level in ("block", "neuron")
    for regime in ("forward", "backward")] + [f"sdp {level}/forward C=0.5 +checkpointing" for level in ("block", "neuron")]


def run(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("GPU_CHECK_COMMIT", None)
    return subprocess.run([sys.executable, "bench/memory_1b.py", "--device", "cpu", "--size", "tiny", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_1b") / "memory-tiny.md"
    proc = run(out.parent, "--warmup", "1", "--steps", "1", "--out", str(out))
    return proc, out.read_text() if out.exists() else "", json.loads(out.with_suffix(".json").read_text())


def test_every_configuration_ran_and_is_predicted_within_ten_percent(tiny):
    proc, text, results = tiny
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(results) == sorted(ROWS)
    for name, r in results.items():
        predicted, peak = r["predicted"]["total"], r["measured"]["peak"]
        assert abs(predicted / peak - 1) <= 0.10, (name, predicted, peak, r["measured"]["meter"])
        assert r["measured"]["step_s"] > 0
    assert "[summary] 13 of 13 rows ran; memory model within 10% of the measured peak: 13 of 13 rows (PASS)" \
        in proc.stdout


def test_peaks_against_the_model_state_counted_here(tiny):
    from subnet_ext.models.llama import LLAMA_PRESETS

    import dataclasses

    _, _, results = tiny
    cfg = dataclasses.replace(LLAMA_PRESETS["tiny"], num_hidden_layers=8, num_key_value_heads=4)
    state = 16 * cfg.num_parameters()  # fp32 parameters and gradients, AdamW's exp_avg and exp_avg_sq
    peak = {name: r["measured"]["peak"] for name, r in results.items()}
    assert peak["ddp"] >= state and peak["ddp +checkpointing"] >= state
    assert peak["fsdp"] >= state / 8 and peak["fsdp"] < peak["ddp"]
    assert peak["sdp block/forward C=0.25"] < peak["sdp block/forward C=0.5"] < peak["ddp"]


def test_the_report_names_its_command_commit_and_the_papers_figures(tiny):
    _, text, _ = tiny
    assert "Command: `python bench/memory_1b.py --device cpu --size tiny --warmup 1 --steps 1 --out " in text
    assert "commit " in text
    assert "torch's fake process group" in text and "simulated" in text
    for name in ROWS:
        assert f"| {name} | " in text
    assert "-28% peak memory per device at coverage 0.5" in text and "28-60%" in text


def test_a_time_limit_leaves_the_rest_out_and_says_so(tmp_path):
    out = tmp_path / "m.md"
    proc = run(tmp_path, "--time-limit", "0", "--rows", "ddp", "--out", str(out))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "- not run: ddp (time limit)" in out.read_text() and "0 of 2 rows ran" in proc.stdout


def _script():
    sys.path.insert(0, str(ROOT / "bench"))
    import memory_1b

    return memory_1b


def test_the_docs_show_the_gpu_results_file_or_say_it_has_not_run(tmp_path):
    """docs/results.md's block is what the script makes of bench/results/h200/memory-1b.md
    (stale docs fail here); given a results file, the block holds its table verbatim."""
    memory_1b = _script()
    doc = (ROOT / "docs" / "results.md").read_text()
    assert memory_1b.docs_block() in doc, "docs/results.md is stale: run python bench/memory_1b.py --write-docs"
    if not os.path.exists(memory_1b.RESULTS):
        assert "Not run yet: it needs a GPU" in memory_1b.docs_block()
    fake = tmp_path / "memory-1b.md"
    fake.write_text("# Peak memory\n\nCommand: `x`\n\n| configuration | peak GiB |\n|---|---:|\n| ddp | 29.500 |\n")
    block = memory_1b.docs_block(str(fake))
    assert "| ddp | 29.500 |" in block and "# Peak memory" not in block and "Not run yet" not in block
    assert "-28% peak memory per device at coverage 0.5" in block

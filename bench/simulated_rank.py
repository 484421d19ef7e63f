"""One rank of a K-rank SDP job against a full replica, on one device.

    python bench/simulated_rank.py --preset 1b --dtype bf16 --world-size 8 --rank 0 --coverage 0.25
    python bench/simulated_rank.py --preset small --device cpu --steps 3          # a quick look on CPU

Both train the same LLaMA preset with AdamW on the same per-rank batch of synthetic
tokens: "full replica" is the plain model (what every DDP rank holds and computes);
"sdp rank r of K" is SubnetDataParallel(simulate_rank=r), which materialises only rank
r's subnetwork and replaces its collectives with no-ops that count bytes. Reported:
median step time and tokens/s, peak memory of training (CUDA allocator peak on GPU,
resident-memory growth on CPU; measured from after the model is built), model-state
bytes, and the ratios, with the GPU targets.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from subnet_ext.measure.storage import proc_status_bytes
from subnet_ext.vocabulary import LEVELS, REGIMES


def _peak_start(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return proc_status_bytes("VmRSS")


def _peak_end(device, start):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)  # the allocator's peak, model state included
    return proc_status_bytes("VmHWM") - start


def run(opts, sdp: bool, device, dtype) -> dict:
    from subnet_ext import plan_subnetworks
    from subnet_ext.data.tokens import SyntheticTokens
    from subnet_ext.models.llama import LLAMA_PRESETS, LlamaForCausalLM
    from subnet_ext.jobs.methods import Method, SDPMethod

    torch.manual_seed(0)
    cfg = LLAMA_PRESETS[opts.preset]
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    if sdp:
        plan = plan_subnetworks(model, world_size=opts.world_size, coverage=opts.coverage, level=opts.level,
                                seed=opts.seed)
        method = SDPMethod(model, plan, opts.regime, 1, "none", simulate_rank=opts.rank)
    else:
        method = Method(model)  # the plain model: what every DDP rank holds and computes
    # Peak from here: training (model state, activations, workspace), not the one-off
    # construction of the full model that the SDP wrapper then cuts down.
    start = _peak_start(device)
    optimizer = torch.optim.AdamW(method.parameters(), lr=1e-4)
    source = SyntheticTokens(cfg.vocab_size, opts.seq_len, seed=0)
    gen = torch.Generator().manual_seed(opts.rank)
    times, state = [], None
    for step in range(opts.warmup + opts.steps):
        x, y = (t.to(device) for t in source.batch(opts.batch_size, gen))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        logits = method(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        if state is None:
            state = method.memory(optimizer)["model_state"]  # gradients still allocated
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= opts.warmup:
            times.append(time.perf_counter() - t0)
        del logits, loss
    comm = method.comm()["bytes_per_step"] if sdp else None
    peak = _peak_end(device, start)
    step_s = statistics.median(times)
    del method, model, optimizer
    return {"step_s": step_s, "tokens_per_s": opts.batch_size * opts.seq_len / step_s, "peak": peak,
            "model_state": state, "comm_bytes_per_step": comm}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1b")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--coverage", type=float, default=0.25)
    p.add_argument("--level", default="block", choices=LEVELS)
    p.add_argument("--regime", default="forward", choices=REGIMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    opts = p.parse_args(argv)
    use_cuda = torch.cuda.is_available() if opts.device == "auto" else opts.device == "cuda"
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    full = run(opts, False, device, dtype)
    sdp = run(opts, True, device, dtype)
    label = f"sdp rank {opts.rank} of {opts.world_size} ({opts.level} {opts.regime}, coverage {opts.coverage:g})"
    peak_name = "peak allocated" if device.type == "cuda" else "peak RSS growth"
    gib = lambda b: f"{b / 2**30:.3f}"  # noqa: E731
    print(f"Command: `python bench/simulated_rank.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
          f"llama {opts.preset}, {opts.dtype}, {device.type}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"batch {opts.batch_size} × {opts.seq_len} tokens, AdamW, {opts.warmup} warm-up + {opts.steps} timed "
          f"steps (medians), torch {torch.__version__}.\n")
    print(f"| run | step ms | tokens/s | {peak_name} GiB | model state GiB | comm MiB/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in (("full replica", full), (label, sdp)):
        comm = "-" if r["comm_bytes_per_step"] is None else f"{r['comm_bytes_per_step'] / 2**20:.1f}"
        print(f"| {name} | {1e3 * r['step_s']:.1f} | {r['tokens_per_s']:.0f} | {gib(r['peak'])} | "
              f"{gib(r['model_state'])} | {comm} |")
    mem, speed = sdp["peak"] / full["peak"], sdp["tokens_per_s"] / full["tokens_per_s"]
    print(f"\n- {peak_name}: {mem:.3f}× the full replica (target ≤ 0.4): {'PASS' if mem <= 0.4 else 'FAIL'}")
    print(f"- tokens/s: {speed:.2f}× the full replica (target ≥ 2.5): {'PASS' if speed >= 2.5 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

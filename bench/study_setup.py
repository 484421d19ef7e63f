"""The report's Setup section: command, machine, seeds, corpus, model, sizes, protocols and
what the memory meter counts, all from the run's record and profile."""
from __future__ import annotations

from study_results import Results


def _task_line(task: str, sizes: dict) -> str:
    if task == "pysrc":
        from subnet_ext.data.pysrc import load_pysrc
        from subnet_ext.models.gpt import GPT_PRESETS

        d = load_pysrc().describe()
        corpus = (f"Python {d['python']}'s standard library, {d['files']['train']} training / {d['files']['val']} "
                  f"validation files (split by file), {d['characters']['train']:,} / {d['characters']['val']:,} "
                  f"characters, vocabulary {d['vocab_size']} (bytes 0-127), {d['skipped_non_ascii_files']} "
                  f"non-ASCII files skipped, SHA-256 {d['sha256'][:16]}…; held out: {sizes['eval_sequences']} "
                  f"windows of {sizes['seq_len']} characters evenly spaced over the validation files")
        cfg = GPT_PRESETS[sizes["preset"]]
        model = (f"GPT `{sizes['preset']}` preset (subnet_ext/models/gpt.py: {cfg.n_layer} pre-LN blocks x "
                 f"{cfg.n_embd}, {cfg.n_head} heads, context {cfg.block_size}, tied embedding, "
                 f"{cfg.num_parameters() / 1e6:.2f} M parameters)")
        batch = f"{sizes['batch_size']} x {sizes['seq_len']} characters"
    else:
        from subnet_ext.models import build_model

        corpus = "scikit-learn's bundled digits (1,437 training / 360 test images, stratified split)"
        mlp = build_model("mlp", in_features=64, num_classes=10)
        model = (f"residual MLP (width {mlp.stem.out_features}, {len(mlp.blocks)} pre-LN blocks with hidden "
                 f"width {mlp.blocks[0].fc1.out_features}, {sum(p.numel() for p in mlp.parameters()) / 1e6:.2f} M "
                 "parameters)")
        batch = f"{sizes['batch_size']} images"
    return (f"- **{task}**: {model}; {corpus}. Batch {batch} per rank; DDP's equal-tokens mark at {sizes['steps']} "
            f"steps; AdamW, peak lr {sizes['lr']} (linear warmup {sizes['warmup_steps']} steps), weight decay "
            f"{sizes['weight_decay']}; the stable trajectory evaluated every {sizes['eval_every']} steps (full model), "
            "every model a user could keep at each mark.")


def setup_section(res: Results, record: dict) -> str:
    """Commit, command, machine, seeds, corpus, sizes, protocols and the meter of the run the report comes from."""
    profile = record.get("profile", {})
    start, end = record.get("machine_at_start", {}), record.get("machine_at_end", {})
    lines = ["## Setup", "",
             f"- Command: `{record.get('command', 'bench/study.py')}` (profile `{profile.get('name')}`), commit "
             f"`{start.get('commit')}`{' (with uncommitted changes)' if start.get('dirty') else ''}; wall time of "
             f"this invocation {record.get('seconds', 0) / 60:.1f} min.",
             f"- Machine: {start.get('cpu')}, {start.get('cores')} cores, {start.get('platform')}; Python "
             f"{start.get('python')}, torch {start.get('torch')}; load average at start {start.get('load_average')}, "
             f"at end {end.get('load_average')}.",
             f"- CPU time of the configurations (every rank's process time, summed): {res.cpu_seconds() / 60:.1f} "
             "core-minutes.",
             f"- Seeds: {record.get('seeds')}, K = 4 ranks. \"a ± b\" is a mean over seeds ± the sample standard "
             "deviation of the per-seed values; Δ is the mean paired difference (per seed, the run minus the "
             "reference of that seed) with its 95% confidence interval [lo, hi] (Student's t)."]
    lines += [_task_line(task, sizes) for task, sizes in profile.get("tasks", {}).items() if task in res.tasks()]
    lines += [
        "- Protocols (bench/study_runs.py): *equal tokens* reads a run at the step where its training tokens "
        "(samples on digits) reach DDP's; *equal FLOPs* at the first step where its FLOPs (counted by torch's "
        "FlopCounterMode on a real step, summed over ranks) reach DDP's. Every mark is read after a cooldown: a "
        f"branch from the stable trajectory {profile.get('cooldown', 0):.0%} of the mark's steps before it, the "
        "learning rate decaying linearly from the peak to 1/d of it over those d steps (warmup-stable-decay), for "
        "every method alike. Wall time is not a protocol on these CPUs (the ranks share the cores).",
        "- Derived runs (`fsdp`, `ddp-ac`, `sdp-*-ac-*`) compute the same updates as the run named in their row "
        "(FSDP2 and checkpointing change where tensors live, not the arithmetic; the CI test checks that they train "
        "DDP's model): their loss is that run's trajectory read at their own marks (equal FLOPs differs: "
        "checkpointing recomputes), and their memory, FLOPs and communication are measured on "
        f"{profile.get('measure_steps')} steps of their own.",
        "- Memory: subnet_ext.engine.memory_meter.StepMemoryMeter over one whole step (forward, backward, "
        "optimizer) of every run, the same code for every method: live tensor storage followed through the "
        "dispatcher (allocations, frees, FSDP2's storage resizes), its peak split into model state (parameters, "
        "gradients, optimizer state, buffers), activations (tensors autograd saved for backward, never a "
        "parameter or a view of one) and transient (gathered parameters, gradient and communication buffers, "
        "recomputed activations, temporaries). The worst rank, metered on its third step (stochastic depth: on the "
        "step that keeps the most blocks before its first mark). Not counted: memory that is not a tensor "
        "(allocator overhead, torch's own footprint: see peak RSS).", ""]
    return "\n".join(lines)

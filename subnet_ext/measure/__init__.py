"""Measuring memory, the same way for every method: the peak of one whole training step by
category (step_memory.py: StepMemoryMeter, measure_step) and the storage meters (storage.py:
bytes of tensors, optimizer state, saved activations and the process's resident memory).
Depends on torch alone, so that the engine, the command line and the benchmarks share it."""

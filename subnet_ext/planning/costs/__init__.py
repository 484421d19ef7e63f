"""What a plan costs: per-unit bytes and FLOPs, the communication cost model, the per-rank memory
model (SDP, DDP and FSDP2), activation traces, and the memory-budget planner."""

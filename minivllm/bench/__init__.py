"""`minivllm bench`: the workloads (workloads.py), the CPU comparison with transformers
(cpu.py) and what both share (common.py)."""

"""`minivllm bench`: the workloads (workloads.py), the CPU comparison with transformers
(cpu.py) and what both share (common.py); the faces' benchmarks: `minivllm bench serve`
(serve.py) and `minivllm-chat --bench` (chat_app.py)."""

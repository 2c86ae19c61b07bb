"""`minivllm bench`: the workloads (workloads.py; the cold start in coldstart.py), the
comparisons with transformers (hf.py, and on a CPU cpu.py) and what they share
(common.py); the faces' benchmarks: `minivllm bench serve` (serve.py) and
`minivllm-chat --bench` (chat_app.py, with bench_tokenizer.py for models without one)."""

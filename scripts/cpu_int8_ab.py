"""fp32 against int8 activations in the CPU's q4_1 / q8_0 products (`cpu_decode_dtype`), in
one process, interleaved round by round: SmolLM2-135M-Instruct with its own Q4_1 / Q8_0
weights (`compact`), decode steps at 1 and 8 sequences (median ms a step), and where a
step goes: every linear of the model's (its 30 layers' four and the LM head) run alone on
random activations of 1 and 8 rows.

    .venv/bin/python scripts/cpu_int8_ab.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.layers.cpu_linear import LowpWeight

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def step_ms(llm: LLMEngine, batch: int, steps: int, rng: random.Random) -> float:
    """Median wall ms of `steps` decode steps with `batch` sequences of ~128 context."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        llm.add_prompt([rng.randrange(1000, 40000) for _ in range(128)], params)
    while any(s.num_completion_tokens == 0 for s in llm.scheduler.running) or (
            llm.scheduler.waiting):
        llm.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.step()
        times.append((time.perf_counter() - t) * 1e3)
    while not llm.scheduler.is_finished():
        llm.step()
    return statistics.median(times)


def products_ms(llm: LLMEngine, rows: int) -> tuple[float, float]:
    """(decoder layers' linears, LM head) ms for `rows` rows, each product once."""
    model = llm.runner.model
    layers = [m.lowp for m in model.model.modules() if isinstance(getattr(m, "lowp", None),
                                                                   LowpWeight)]
    head = model.lm_head.lowp
    xs: dict[int, torch.Tensor] = {}

    def run(lowp: LowpWeight) -> None:
        k = lowp.packed.shape[1]
        x = xs.setdefault(k, torch.randn(rows, k))
        lowp.kernel_product(x, None)

    best = (float("inf"), float("inf"))
    for _ in range(5):
        t0 = time.perf_counter()
        for lowp in layers:
            run(lowp)
        t1 = time.perf_counter()
        run(head)
        t2 = time.perf_counter()
        best = min(best, ((t1 - t0) * 1e3, (t2 - t1) * 1e3))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    opts = parser.parse_args()
    engines = {
        dtype: LLMEngine({"model_name_or_path": MODEL, "device": "cpu",
                          "cpu_weight_dtype": "compact", "cpu_decode_dtype": dtype,
                          "max_model_length": 1024})
        for dtype in ("float32", "int8")
    }
    rng = random.Random(0)
    figures: dict[str, dict[str, list[float]]] = {d: {} for d in engines}
    for r in range(opts.rounds):
        for dtype, llm in engines.items():
            got = figures[dtype]
            for batch in (1, 8):
                got.setdefault(f"step b{batch}", []).append(step_ms(llm, batch, opts.steps, rng))
                layers, head = products_ms(llm, batch)
                got.setdefault(f"linears b{batch}", []).append(layers)
                got.setdefault(f"LM head b{batch}", []).append(head)
            print(f"round {r + 1} {dtype:8} " + "  ".join(
                f"{k} {v[-1]:6.2f}" for k, v in got.items()), flush=True)
    print("\nms, medians over rounds (steps: wall time of an engine step; linears and LM head:"
          " each product once on random rows)")
    keys = list(figures["float32"])
    print(f"{'activations':12}" + "".join(f"{k:>14}" for k in keys))
    for dtype, got in figures.items():
        print(f"{dtype:12}" + "".join(f"{statistics.median(got[k]):14.2f}" for k in keys))
    for llm in engines.values():
        llm.exit()


if __name__ == "__main__":
    main()

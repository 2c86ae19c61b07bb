"""Before/after of the CPU step work (issue 10) in one process, interleaved round by round.

before: the model's eager decode, row-major weights, 3-D SDPA in prefill attention;
after: the compiled decode step (engine/cpu_step.py), column-major wide weights, 4-D SDPA.
Two engines in one process (SmolLM2-135M-Instruct, fp32; the first with
MINIVLLM_CPU_COMPILE=1, the second with 0); each round times batch-1 decode, batch-8
decode and a 512-token prefill on one, then on the other. CPU time of this process and
wall time are both printed: on a machine shared with other work, CPU time is the steadier
figure.

    .venv/bin/python scripts/cpu_step_ab.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import types

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=33)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import minivllm.kernels.prefill_attention as prefill
    from minivllm import LLMEngine, SamplingParams
    from minivllm.loader import resolve_model

    def engine(compiled: bool) -> LLMEngine:
        os.environ["MINIVLLM_CPU_COMPILE"] = "1" if compiled else "0"
        path = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        config = {"model_name_or_path": str(path), "device": "cpu", "dtype": "float32",
                  "max_model_length": 1024}
        return LLMEngine(config)

    start = time.perf_counter()
    engines = {"after": engine(True)}
    startup = time.perf_counter() - start
    step = engines["after"].runner.cpu_step
    assert step is not None, "the decode step did not compile here"
    compiling = step.compile_seconds
    print(f"start-up {startup:.1f} s (compiling the decode step: {compiling:.1f} s)")
    engines["before"] = engine(False)
    sdpa = F.scaled_dot_product_attention

    def sdpa_3d(q, k, v, **kw):  # the call as it was: 3-D inputs (SDPA's math path on CPU)
        return sdpa(q[0], k[0], v[0], **kw)[None]

    # NOTE: a stand-in for the module prefill attention calls, not a patch of
    # torch.nn.functional: the compiled step's guards watch that module's attributes.
    functional_3d = types.SimpleNamespace(scaled_dot_product_attention=sdpa_3d)

    llm = engines["after"]

    def use(after: bool) -> None:
        nonlocal llm
        llm = engines["after" if after else "before"]
        prefill.F = F if after else functional_3d

    rng = random.Random(0)
    vocab = llm.config.model.vocab_size

    def decode(batch: int) -> tuple[float, float]:  # ms a step after the prefill step
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        for _ in range(batch):
            llm.add_prompt([rng.randrange(vocab) for _ in range(128)], params)
        llm.step()
        cpu, wall, steps = time.process_time(), time.perf_counter(), 0
        while not llm.scheduler.is_finished():
            llm.step()
            steps += 1
        return (time.process_time() - cpu) * 1e3 / steps, (time.perf_counter() - wall) * 1e3 / steps

    def ttft() -> tuple[float, float]:
        prompt = [rng.randrange(vocab) for _ in range(512)]
        cpu, wall = time.process_time(), time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        return (time.process_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3

    figures = {"batch-1 ms/token": lambda: decode(1), "batch-8 ms/step": lambda: decode(8),
               "TTFT-512 ms": ttft}
    results = {(v, f): [] for v in ("before", "after") for f in figures}
    for after in (False, True):  # untimed warm-up of each variant
        use(after)
        decode(1), decode(8), ttft()
    for _ in range(args.rounds):
        for after in (False, True):
            use(after)
            for name, fn in figures.items():
                results[("after" if after else "before", name)].append(fn())
    use(True)
    engines["before"].exit()
    print(f"{args.rounds} interleaved rounds, {args.threads} thread(s); median CPU ms (wall ms)")
    for name in figures:
        cells = []
        for variant in ("before", "after"):
            xs = results[(variant, name)]
            cpu = statistics.median(x[0] for x in xs)
            wall = statistics.median(x[1] for x in xs)
            cells.append(f"{variant} {cpu:,.1f} ({wall:,.1f})")
        print(f"{name:18s} " + " | ".join(cells))
    llm.exit()


if __name__ == "__main__":
    main()

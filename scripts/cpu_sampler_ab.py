"""The CPU sampler's top-p over candidates against the whole-vocabulary sort, in one
process, interleaved: SmolLM2-135M-Instruct as `minivllm-chat` runs it (compact weights,
the app's temperature 0.7 and top-p 0.95), four chat prompts decoding together; median ms
of a decode step, and the share of rows whose cut fell past the candidates.

    .venv/bin/python scripts/cpu_sampler_ab.py [--rounds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

from minivllm import LLMEngine, SamplingParams
from minivllm.layers import sampler as S

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTIONS = ["Write a short poem about the sea.", "Explain how a bicycle stays upright.",
             "What should I cook for dinner tonight?", "Tell me a story about a lost robot."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    opts = parser.parse_args()
    llm = LLMEngine({"model_name_or_path": MODEL, "device": "cpu",
                     "cpu_weight_dtype": "compact", "max_model_length": 1024})
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                 add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS]
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=opts.steps + 8,
                            ignore_eos=True)
    fast = S.Sampler._sample_candidates
    fits_seen = []

    def counting(self, logits, t):
        _, _, fits = S.candidate_nucleus(logits, t.top_ks, t.top_ps, t.needs_top_k,
                                         t.needs_top_p)
        fits_seen.extend(fits.tolist())
        return fast(self, logits, t)

    def whole(self, logits, t):  # the path every device took before
        return self._draw(S._top_k_top_p(logits, t.top_ks, t.top_ps, t.needs_top_k,
                                          t.needs_top_p), t.seeds)

    results: dict[str, list[float]] = {"whole vocabulary": [], "candidates": []}
    for _ in range(opts.rounds):
        for name, method in (("whole vocabulary", whole), ("candidates", counting)):
            S.Sampler._sample_candidates = method
            for p in prompts:
                llm.add_prompt(p, params)
            while llm.scheduler.waiting or any(
                    s.num_completion_tokens == 0 for s in llm.scheduler.running):
                llm.step()
            times = []
            for _ in range(opts.steps):
                t = time.perf_counter()
                llm.step()
                times.append((time.perf_counter() - t) * 1e3)
            while not llm.scheduler.is_finished():
                llm.step()
            results[name].append(statistics.median(times))
            print(f"{name:17} {results[name][-1]:6.2f} ms a step", flush=True)
    S.Sampler._sample_candidates = fast
    for name, ms in results.items():
        print(f"{name:17} median {statistics.median(ms):6.2f} ms a batch-4 decode step")
    print(f"rows whose cut fell among the {S.CANDIDATES} candidates: "
          f"{sum(fits_seen)} / {len(fits_seen)}")
    llm.exit()


if __name__ == "__main__":
    main()

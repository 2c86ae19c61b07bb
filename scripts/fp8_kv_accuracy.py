"""How close an fp8 KV cache (`kv_cache_dtype` fp8) stays to an fp32 one on
SmolLM2-135M-Instruct (fp32 weights, CPU): 64 greedy tokens on 24 chat prompts.

Prints greedy agreement, whether the first divergence is in the other run's top-5 (both
ways: both runs share the prefix up to it), and the mean |delta logprob| of the chosen
tokens over the shared prefixes. `--scales` compares how the fp8 scales are set: static
1.0, or calibrated from the fp32 run's K/V maxima per layer or per KV head.

    .venv/bin/python scripts/fp8_kv_accuracy.py [--tokens 64] [--scales static layer head]
"""

from __future__ import annotations

import argparse
import statistics

import torch

# The weight-format comparison's 24 chat prompts (this folder is on sys.path when a
# script here runs).
from cpu_weight_accuracy import PROMPTS


def compare(ref: dict, got: dict) -> dict:
    """Agreement figures of `got` against `ref` (two `generate` outputs with logprobs)."""
    same = 0
    prefix = []
    in_top5 = [0, 0]  # got's token in ref's top-5; ref's token in got's top-5
    diverged = 0
    deltas = []
    for w, g, lw, lg in zip(ref["token_ids"], got["token_ids"], ref["logprobs"],
                            got["logprobs"], strict=True):
        d = next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        n = len(w) if d is None else d
        prefix.append(n)
        deltas += [abs(lw[i].logprob - lg[i].logprob) for i in range(n)]
        if d is None:
            same += 1
            continue
        diverged += 1
        in_top5[0] += g[d] in lw[d].top
        in_top5[1] += w[d] in lg[d].top
    return dict(same=same, prompts=len(prefix), mean_prefix=statistics.mean(prefix),
                diverged=diverged, got_in_ref_top5=in_top5[0], ref_in_got_top5=in_top5[1],
                mean_abs_dlogprob=statistics.mean(deltas), max_abs_dlogprob=max(deltas))


def calibrated_scales(engine, prompts: list[str], params, per_head: bool) -> list[tuple]:
    """Per-layer (k_scale, v_scale) from the K/V maxima of an fp32 run over `prompts`:
    amax / 448, per layer or per KV head ([heads, 1] tensors, which the torch references
    broadcast)."""
    from minivllm.layers.attention import Attention

    layers = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]
    amax = [[None, None] for _ in layers]

    def hook(i):
        def record(module, args):
            for j, x in enumerate(args[1:3]):
                if x is None:
                    continue
                m = x.detach().abs().amax(dim=(0, 2)) if per_head else x.detach().abs().max()
                amax[i][j] = m if amax[i][j] is None else torch.maximum(amax[i][j], m)
        return record

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        engine.generate(prompts, params)
    finally:
        for h in handles:
            h.remove()
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    out = []
    for k, v in amax:
        ks, vs = (k / fp8_max).clamp_min(1e-8), (v / fp8_max).clamp_min(1e-8)
        out.append((ks[:, None], vs[:, None]) if per_head else (float(ks), float(vs)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--scales", nargs="+", default=["static"],
                        choices=["static", "layer", "head"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from minivllm import LLMEngine, SamplingParams
    from minivllm.layers.attention import Attention
    from minivllm.loader import resolve_model

    path = str(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))

    def engine(kv: str) -> LLMEngine:
        return LLMEngine({"model_name_or_path": path, "device": "cpu", "dtype": "float32",
                          "kv_cache_dtype": kv, "max_model_length": 1024})

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                            logprobs=5)
    ref_engine = engine("auto")
    prompts = [
        ref_engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    ref = ref_engine.generate(prompts, params)
    scales = {"static": None}
    if "layer" in args.scales:
        scales["layer"] = calibrated_scales(ref_engine, prompts, params, per_head=False)
    if "head" in args.scales:
        scales["head"] = calibrated_scales(ref_engine, prompts, params, per_head=True)
    ref_engine.exit()
    fp8 = engine("fp8")
    layers = [m for m in fp8.runner.model.modules() if isinstance(m, Attention)]
    for name in args.scales:
        if scales[name] is not None:
            for layer, s in zip(layers, scales[name], strict=True):
                layer.kv_scales = s
        got = fp8.generate(prompts, params)
        r = compare(ref, got)
        print(f"{name:>6}: identical {r['same']}/{r['prompts']}, mean shared prefix "
              f"{r['mean_prefix']:.1f}/{args.tokens}; at the {r['diverged']} divergences "
              f"fp8's token in fp32's top-5: {r['got_in_ref_top5']}, fp32's in fp8's: "
              f"{r['ref_in_got_top5']}; |dlogprob| mean {r['mean_abs_dlogprob']:.4f} "
              f"max {r['max_abs_dlogprob']:.3f}")
    fp8.exit()


if __name__ == "__main__":
    main()

"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1, and the process lifecycle holds.

Equality: in fp32 on CPU the all-reduce of two partial sums can round differently from
one full sum, so greedy outputs are compared exactly, and where a token differs, the
token TP=2 chose must be among the top-5 of the reference (transformers' logits, which
equal TP=1's) at the first divergence; after it the continuations may differ.

Lifecycle: every test checks that no worker process and no /dev/shm entry is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2, step_loop, tiny_engine

from minivllm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.engine.worker import WorkerError, tp_device

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
WORKER_MARK = "minivllm.engine.worker import worker_main"


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def shared_prefix_prompts(n: int = 6, prefix_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 512, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, 512, (5 + 7 * i,), generator=g).tolist() for i in range(n)]


def assert_same_greedy(path, prompts, got, want) -> None:
    """Exact, or the first differing token is in the reference's top-5 (sum order)."""
    hf = None
    for prompt, g, w in zip(prompts, got, want, strict=True):
        assert len(g) == len(w)
        if g == w:
            continue
        if hf is None:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        i = next(k for k, (a, b) in enumerate(zip(g, w, strict=True)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + w[:i]])).logits[0, -1]
        top5 = logits.topk(5).indices.tolist()
        assert w[i] == top5[0], "the TP=1 reference is not transformers' greedy choice"
        assert g[i] in top5, f"TP=2 token {g[i]} at {i} not in the reference's top-5 {top5}"


# -- processes and /dev/shm ------------------------------------------------------------


def _proc_state(pid: int) -> str | None:
    """The process's state letter, or None when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def is_running(pid: int) -> bool:
    return _proc_state(pid) not in (None, "Z")


def workers_of(rank0_pid: int) -> list[int]:
    """Worker processes (not zombies) started by the engine process `rank0_pid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (
            any(WORKER_MARK in a for a in argv)
            and str(rank0_pid) in argv
            and is_running(int(entry))
        ):
            pids.append(int(entry))
    return pids


def wait_until(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"still not true after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(autouse=True, scope="module")
def one_thread_per_rank():
    """Workers take cores // world_size threads; rank 0 (this process) does the same
    here, so that several ranks on two cores do not fight over them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Engines owned by module fixtures; their workers may outlive a test.
_LIVE_ENGINES: list[LLMEngine] = []


@pytest.fixture(autouse=True)
def no_leftovers():
    shm_before = set(os.listdir("/dev/shm"))
    yield
    expected = {pid for llm in _LIVE_ENGINES for pid in llm.workers.pids}
    assert set(workers_of(os.getpid())) <= expected
    assert set(os.listdir("/dev/shm")) <= shm_before


def assert_gone(pids: list[int]) -> None:
    """Reaped: not even a zombie is left (rank 0 waited for them)."""
    for pid in pids:
        assert _proc_state(pid) is None, f"worker {pid} left behind ({_proc_state(pid)})"


# -- engines shared by the equality tests (also: two TP engines in one process) ---------


def _tp2_engine(path):
    llm = tiny_engine(path, world_size=2)
    _LIVE_ENGINES.append(llm)
    yield llm
    _LIVE_ENGINES.remove(llm)
    llm.exit()


@pytest.fixture(scope="module")
def tp2_qwen3(tiny_qwen3):
    yield from _tp2_engine(tiny_qwen3)


@pytest.fixture(scope="module")
def tp2_llama(tiny_llama):
    yield from _tp2_engine(tiny_llama)


def tp1_generate(path, prompts, params=GREEDY, **kw) -> list[list[int]]:
    llm = tiny_engine(path, **kw)
    try:
        return llm.generate(prompts, params)["token_ids"]
    finally:
        llm.exit()


# -- (1) TP=2 equals TP=1 ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tp2_generate_matches_tp1(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    llm = request.getfixturevalue(f"tp2_{arch}")
    assert llm.config.world_size == 2 and len(llm.workers.pids) == 1
    # Lengths cross the 16-token blocks (and, for llama, the llama3 rope scaling at 64).
    prompts = prompts_of((3, 16, 37, 90))
    got = llm.generate(prompts, GREEDY)["token_ids"]
    assert_same_greedy(path, prompts, got, tp1_generate(path, prompts))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tp2_step_loop_matches_tp1(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    llm = request.getfixturevalue(f"tp2_{arch}")
    prompts = prompts_of((5, 21, 48), seed=1)
    got = step_loop(llm, prompts, GREEDY)
    assert_same_greedy(path, prompts, got, tp1_generate(path, prompts))


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_tp2_new_families_match_tp1(arch, request):
    """Qwen2 (q/k/v biases split by head) and Mistral under TP=2; prompt logprobs need
    extra logits rows, which every rank must compute alike."""
    path = request.getfixturevalue(f"tiny_{arch}")
    prompts = prompts_of((4, 33, 70), seed=9)
    params = SamplingParams(**{**GREEDY.__dict__, "logprobs": 2, "prompt_logprobs": 2})
    llm = tiny_engine(path, world_size=2)
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.exit()
    llm = tiny_engine(path)
    try:
        want = llm.generate(prompts, params)
    finally:
        llm.exit()
    assert_same_greedy(path, prompts, got["token_ids"], want["token_ids"])
    for ours, ref in zip(got["prompt_logprobs"], want["prompt_logprobs"], strict=True):
        assert ours[0] is None and ref[0] is None
        for a, b in zip(ours[1:], ref[1:], strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_two_tp_engines_in_one_process(tp2_qwen3, tp2_llama, tiny_qwen3, tiny_llama):
    """Each engine has its own process group, port and workers; steps interleave."""
    assert set(tp2_qwen3.workers.pids).isdisjoint(tp2_llama.workers.pids)
    prompts = prompts_of((9, 30), seed=2)
    engines = (tp2_qwen3, tp2_llama)
    ids = [[llm.add_prompt(p, GREEDY) for p in prompts] for llm in engines]
    results: list[dict[int, list[int]]] = [{}, {}]
    while not all(llm.scheduler.is_finished() for llm in engines):
        for llm, res in zip(engines, results, strict=True):
            if not llm.scheduler.is_finished():
                res.update(dict(llm.step()[0]))
    for path, seq_ids, res in zip((tiny_qwen3, tiny_llama), ids, results, strict=True):
        got = [res[i] for i in seq_ids]
        assert_same_greedy(path, prompts, got, tp1_generate(path, prompts))


def test_worker_error_is_reported_with_its_traceback(tp2_llama, tiny_llama):
    """A command that fails on a worker raises with the worker's traceback; every reply
    was still read, so the group stays in step."""
    with pytest.raises(WorkerError, match=r"(?s)worker rank 1 failed:.*not a worker command"):
        tp2_llama.workers.run(object(), lambda: None)
    prompts = prompts_of((11,), seed=3)
    got = tp2_llama.generate(prompts, GREEDY)["token_ids"]
    assert_same_greedy(tiny_llama, prompts, got, tp1_generate(tiny_llama, prompts))


# -- (2) prefix caching, chunked prefill, preemption under TP=2 -------------------------


def test_tp2_prefix_cache_chunked_prefill_and_preemption(tiny_qwen3):
    prompts = shared_prefix_prompts()
    want = tp1_generate(
        tiny_qwen3, prompts, enable_prefix_caching=False, enable_chunked_prefill=False
    )
    # 9 blocks of 16 tokens for six ~70-token sequences: preemption is certain; a
    # 32-token budget chunks every prompt; the shared 40-token prefix is cached.
    llm = tiny_engine(
        tiny_qwen3,
        world_size=2,
        max_cached_blocks=9,
        max_num_batched_tokens=32,
        max_model_length=128,
    )
    try:
        got = llm.generate(prompts, GREEDY)["token_ids"]
        llm.async_scheduling = True  # overlapped: exactly the synchronous TP=2 tokens
        got_async = llm.generate(prompts, GREEDY)["token_ids"]
        stats = llm.stats()
    finally:
        llm.exit()
    assert got_async == got
    assert_same_greedy(tiny_qwen3, prompts, got, want)
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_rate > 0
    assert stats.num_steps > len(prompts) * GREEDY.max_tokens / 6  # chunked


# -- SmolLM2 (real weights) --------------------------------------------------------------


def test_smollm2_heads_not_divisible_by_two(smollm2_path):
    with pytest.raises(ValueError, match=r"num_heads=9 is not divisible by world_size=2"):
        LLMEngine({"model_name_or_path": SMOLLM2, "world_size": 2, "device": "cpu"})


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm2_path):
    """9 heads, 3 KV heads, intermediate 1536 and vocab 49152 all split three ways."""
    config = {
        "model_name_or_path": SMOLLM2,
        "device": "cpu",
        "max_model_length": 512,
        "block_size": 16,
        "max_cached_blocks": 64,
    }
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tp3 = LLMEngine({**config, "world_size": 3})
    try:
        tok = tp3.tokenizer
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
            for q in ("What is the capital of France?", "Name three colours.")
        ]
        out = tp3.generate(prompts, params)
        tp3.async_scheduling = True  # overlapped: exactly the synchronous TP=3 tokens
        assert tp3.generate(prompts, params) == out
    finally:
        tp3.exit()
    tp1 = LLMEngine(config)
    try:
        want = tp1.generate(prompts, params)["token_ids"]
    finally:
        tp1.exit()
    assert_same_greedy(smollm2_path, prompts, out["token_ids"], want)
    assert "Paris" in out["text"][0]


# -- (4) validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, field",
    [
        (dict(num_heads=3, num_kv_heads=1), "num_heads=3"),
        (dict(num_heads=4, num_kv_heads=1), "num_kv_heads=1"),
        (dict(intermediate_size=129), "intermediate_size=129"),
        (dict(vocab_size=511), "vocab_size=511"),
    ],
)
def test_not_divisible_by_world_size_names_the_field(arch, field):
    model = ModelConfig(
        **{"num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128, "vocab_size": 512, **arch}
    )
    with pytest.raises(ValueError, match=rf"{field} is not divisible by world_size=2"):
        EngineConfig(model_name_or_path="x", model=model, world_size=2, device="cpu")


def test_world_size_above_gpu_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"world_size=2 needs 2 CUDA GPUs but 1 is visible"):
        tp_device(torch.device("cuda"), 2)
    assert tp_device(torch.device("cpu"), 4) == torch.device("cpu")  # gloo: any N


# -- (3) faults and lifecycle --------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_worker_killed_mid_generation(tiny_llama, async_scheduling):
    llm = tiny_engine(tiny_llama, world_size=2, async_scheduling=async_scheduling)
    (pid,) = llm.workers.pids
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    for p in prompts_of((7, 40, 13)):
        llm.add_prompt(p, params)
    llm.step()
    threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()  # lands mid-step
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        while time.monotonic() - start < 30:
            llm.step()
    assert time.monotonic() - start < 10
    assert_gone([pid])
    with pytest.raises(EngineDeadError, match="tensor-parallel"):
        llm.add_prompt([1, 2, 3])
    llm.exit()
    llm.exit()


def test_exit_twice_and_mid_generation(tiny_qwen3, capfd):
    llm = tiny_engine(tiny_qwen3, world_size=2)
    pids = llm.workers.pids
    for p in prompts_of((12, 50)):
        llm.add_prompt(p, GREEDY)
    llm.step()
    llm.step()
    assert not llm.scheduler.is_finished()
    llm.exit()
    assert_gone(pids)
    llm.exit()
    with pytest.raises(RuntimeError, match="exit"):
        llm.add_prompt([1, 2, 3])
    # A normal shutdown prints nothing (the workers share our stderr).
    assert "Traceback" not in capfd.readouterr().err


# Rank 0 in a child process, so the test can kill or interrupt it.
RANK0_SCRIPT = """
import os, sys, time
from minivllm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
path, mode = sys.argv[1], sys.argv[2]

def progress(stage, fraction):
    print("stage:", stage, flush=True)

try:
    config = EngineConfig(model_name_or_path=path, model=ModelConfig.from_checkpoint(path),
                          model_path=path, device="cpu", block_size=16, max_cached_blocks=64,
                          world_size=2)
    llm = LLMEngine(config, on_progress=progress)
    print("workers:", *llm.workers.pids, flush=True)
    llm.add_prompt(list(range(1, 30)), SamplingParams(temperature=0, max_tokens=1000,
                                                      ignore_eos=True))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        llm.step()
        print("decoding", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def start_rank0(path: Path, mode: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANK0_SCRIPT, str(path), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        preexec_fn=default_sigint,
    )


def default_sigint() -> None:
    """In a child before it execs: Ctrl-C's default disposition. An ignored SIGINT is
    inherited, and the test process may have been left ignoring it by an earlier test's
    library; the child would then never see the Ctrl-C these tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_until(proc: subprocess.Popen, prefix: str) -> str:
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"rank 0 ended before printing {prefix!r}: {proc.stderr.read()}")


def test_rank0_killed_workers_exit(tiny_llama):
    proc = start_rank0(tiny_llama)
    try:
        pids = [int(p) for p in read_until(proc, "workers:").split()[1:]]
        read_until(proc, "decoding")
        proc.kill()
        proc.wait()
        took = wait_until(lambda: not any(is_running(p) for p in pids), timeout=10)
        assert took < 10
        # The workers shared rank 0's stderr: leaving quietly, they printed nothing.
        _, err = proc.communicate(timeout=10)
        assert "Traceback" not in err, err
    finally:
        proc.kill()


@pytest.mark.parametrize("when", ["load", "decode"])
def test_ctrl_c_leaves_nothing_behind(tiny_llama, when):
    proc = start_rank0(tiny_llama)
    try:
        if when == "load":
            read_until(proc, "stage: starting the tensor-parallel workers")
            time.sleep(0.5)  # the workers exist, rank 0 waits for them
        else:
            read_until(proc, "decoding")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "interrupted" in out
    if when == "load":
        assert "workers:" not in out  # the interrupt did land during the load
    assert proc.returncode == 0
    assert "Traceback" not in err, err  # neither rank 0 nor a worker printed one
    assert workers_of(proc.pid) == []

"""The CPU decode step without per-op Python: native (every decoder layer in one C++ call,
the default) or compiled (torch.compile / inductor, the way vLLM's CPU backend runs).

Eager, a SmolLM2 decode token issues ~1,100 torch ops from Python, a large share of the
token's time on a CPU.

`NativeCPUDecodeStep` hands the whole step's layers to `minivllm_cpu::decode_layers`
(kernels/cpu_decode_step.cpp): the norms, rotary, K/V store and grouped attention are plain
loops over a token's few thousand floats, the products MKL's or the weight-only kernel's.
Three torch ops a step, nothing to compile at start-up beyond the extension (built once per
machine). It needs fp32 activations and cache.

`CPUDecodeStep` serves the rest (a bf16 model): one function, `decode_layer`, is a whole
decoder layer; it is compiled once and called for every layer with that layer's weights as
arguments, so dynamo traces one layer, not thirty (start-up: a few seconds with warm caches),
and a step is ~30 calls into inductor's generated C++ plus ~15 eager ops. The matrix
products stay the eager ones: MKL's for fp32 weights, or the weight-only bf16 / int8 kernel
(kernels/cpu_lowp_linear.py, one opaque torch op with a fake implementation) where
`cpu_weight_dtype` asks for it.

The compiled layer only reads the KV cache: it returns the layer's new K/V, and the caller
stores all layers' K/V with two `index_copy_` afterwards (an in-place store into the pool
inside the graph is a mutated graph input, which inductor may copy whole). Each sequence
attends to its cached context then its new key, the order the eager step reads back from
the cache after its store, so both steps equal the eager one up to fp32 rounding
(tests/test_cpu_step.py).

Shapes: the batch size and the context length are unbacked (dynamic, 1 included), the pool
and the weights static: start-up compiles one graph for every step. Prefill stays eager
(its time is in the matrix products).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minivllm.kernels.rms_norm import rms_norm_ref
from minivllm.kernels.rotary import apply_rotary_folded, folded_cos_sin_at
from minivllm.kernels.silu_and_mul import silu_and_mul_ref

from ..envs import read
from ..layers import cpu_linear
from ..layers.attention import AttentionMetadata

# Which CPU decode step runs: "native" (NativeCPUDecodeStep), "compiled" (CPUDecodeStep)
# or "eager"; and whether inductor may compile at all (minivllm.envs declares both).
STEP_ENV = "MINIVLLM_CPU_STEP"
COMPILE_ENV = "MINIVLLM_CPU_COMPILE"
# NOTE: inductor's pattern matcher rewrites the attention into SDPA and fails on the dynamic
# context length there (torch 2.13: "Attempting to broadcast a dimension of length s9 + 1");
# the step has nothing else for it to fuse (the matrix products stay MKL's).
COMPILE_OPTIONS = {"pattern_matcher": False}


def _linear(x, lin):
    """`lin`: a linear's (weight, bias, oneDNN packed, weight-only copy), `_linear_weights`."""
    return cpu_linear.linear(x, *lin)


def decode_layer(
    x: torch.Tensor,  # [num_seqs, hidden]: the previous layer's output
    residual: torch.Tensor,  # [num_seqs, hidden]: the residual stream (zeros at layer 0)
    w: tuple,  # the layer's tensors, `layer_weights` order
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]: this layer's pool
    v_cache: torch.Tensor,
    prev_slots: torch.Tensor,  # [num_seqs, max_prev]: cache slots of the cached context
    cos: torch.Tensor,  # [num_seqs, 1, head_dim] from `folded_cos_sin_at`
    sin: torch.Tensor,
    valid: torch.Tensor,  # [num_seqs, max_prev + 1]: which context positions to attend to
    shape: tuple[int, int, int],  # num_heads, num_kv_heads, head_dim
    scale: float,
    eps: float,
    qk_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer of a decode step; returns (output, residual, new k, new v), the
    new K/V [num_seqs, num_kv_heads, head_dim] in the cache's dtype. The cache is only read:
    each sequence attends to its context, then its new token (the eager order)."""
    ln1, qkv, q_norm, k_norm, o_proj, ln2, gate_up, down = w
    num_heads, num_kv_heads, head_dim = shape
    num_seqs = x.shape[0]
    # Facts the unbacked sizes cannot tell the compiler (_mark_dynamic); the caller pads
    # a one-column context to two.
    torch._check(prev_slots.shape[1] >= 2)
    torch._check(num_seqs >= 1)
    group = num_heads // num_kv_heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    h, residual = rms_norm_ref(x, ln1, eps, residual)
    q, k, v = _linear(h, qkv).split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_seqs, num_heads, head_dim)
    k = k.reshape(num_seqs, num_kv_heads, head_dim)
    v = v.reshape(num_seqs, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_ref(q.reshape(-1, head_dim), q_norm, qk_eps)[0].view_as(q)
        k = rms_norm_ref(k.reshape(-1, head_dim), k_norm, qk_eps)[0].view_as(k)
    q, k = apply_rotary_folded(q, k, cos, sin)
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    # Attention is batched over (KV head, sequence), KV head first: the context gathered
    # from the [num_slots, num_kv_heads, head_dim] pool as [num_kv_heads, num_seqs,
    # max_prev, head_dim] is then plain matrices with head_dim contiguous, which the batched
    # products read as they are (sequence-first, inductor gathered K transposed, element by
    # element, several times slower at batch 8).
    k_context = k_cache.transpose(0, 1)[:, prev_slots]
    v_context = v_cache.transpose(0, 1)[:, prev_slots]
    # [num_kv_heads, num_seqs, group, head_dim]
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).to(k_cache.dtype)
    k_new = k.transpose(0, 1)[:, :, None]  # [num_kv_heads, num_seqs, 1, head_dim]
    # Scores over the context, then the new key's, as one row [.., group, max_prev + 1].
    scores = torch.cat(
        [torch.matmul(qg, k_context.transpose(2, 3)), (qg * k_new).sum(-1)[..., None]], dim=-1
    ).float() * scale
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(v_cache.dtype)
    o = torch.matmul(probs[..., :-1], v_context) + probs[..., -1:] * v.transpose(0, 1)[:, :, None]
    o = o.transpose(0, 1)  # [num_seqs, num_kv_heads, group, head_dim]
    x = _linear(o.reshape(num_seqs, q_size).to(x.dtype), o_proj)
    h, residual = rms_norm_ref(x, ln2, eps, residual)
    x = _linear(silu_and_mul_ref(_linear(h, gate_up)), down)
    return x, residual, k, v


def _mark_dynamic(x, residual, prev_slots, cos, sin, valid) -> None:
    """The sizes that vary from step to step: the batch size and the context length.

    Marked unbacked, not just dynamic: torch would specialise a dynamic size of 1 (batch 1,
    a one-token context) into a graph of its own; an unbacked size takes any value, so one
    graph serves every step. Only the compiling call needs the marks."""
    for t, dims in (
        (x, [0]),
        (residual, [0]),
        (prev_slots, [0, 1]),
        (cos, [0]),
        (sin, [0]),
        (valid, [0, 1]),
    ):
        for dim in dims:
            torch._dynamo.decorators.mark_unbacked(t, dim)


def _skip_guards(skip: bool):
    """Skip dynamo's guard checks on the compiled layer's calls (one a layer, each a visible
    share of a CPU step): after warm-up there is one graph and every call passes the same kinds of
    tensors (the weights, this pool, the step's index tensors), so nothing is left to check.
    """
    if skip:
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def layer_weights(layer: torch.nn.Module) -> tuple:
    """A decoder layer's tensors in `decode_layer`'s order (None where the model has none)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        layer.input_layernorm.weight,
        _linear_weights(attn.qkv_proj),
        attn.q_norm.weight if attn.qk_norm else None,
        attn.k_norm.weight if attn.qk_norm else None,
        _linear_weights(attn.o_proj),
        layer.post_attention_layernorm.weight,
        _linear_weights(mlp.gate_up_proj),
        _linear_weights(mlp.down_proj),
    )


def layer_constants(layer: torch.nn.Module) -> tuple[tuple[int, int, int], float, float, float]:
    """((num_heads, num_kv_heads, head_dim), attention scale, norm eps, q/k norm eps)."""
    attn = layer.self_attn
    qk_eps = float(attn.q_norm.eps) if attn.qk_norm else 0.0
    shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    return shape, float(attn.attn.scale), float(layer.input_layernorm.eps), qk_eps


def _linear_weights(linear: torch.nn.Module) -> tuple:
    """(weight, bias, oneDNN packed, weight-only copy): `cpu_linear.linear`'s arguments.

    NOTE: without the oneDNN-packed copy: inductor (torch 2.13) fails to lower
    `mkldnn._linear_pointwise` on it (LoweringException on the packed weight's layout), which
    left a bf16 model's decode eager on AVX-512 BF16 CPUs; given the plain bf16 weight,
    inductor picks its own oneDNN product. So, for a weight-only copy, without its packed
    bf16 copy for prefill (a decode step's rows are few)."""
    lowp = linear.lowp
    if lowp is not None and lowp.wide is not None:
        lowp = lowp._replace(wide=None)
    return (linear.weight, linear.bias, None, lowp)


def compile_unavailable_reason() -> str | None:
    """Why inductor cannot compile here (None: it can). It needs a C++ compiler."""
    if read(COMPILE_ENV) == "0":
        return f"{COMPILE_ENV}=0"
    cxx = os.environ.get("CXX")
    if not any(shutil.which(c) for c in ((cxx,) if cxx else ("g++", "c++", "clang++"))):
        return "no C++ compiler (g++, c++ or clang++) on PATH"
    return None


class CPUDecodeStep:
    """Runs decode steps on CPU: a few eager ops around one `decode_layer` call per layer,
    that function compiled once and shared by every layer (its weights are arguments).

    Built once the KV pool exists; `warm_up` compiles the graph, so that no request pays
    for compilation.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor) -> None:
        m = model.model
        self.model = model
        self.kv_cache = kv_cache
        self.embedding = m.embed_tokens.weight
        self.final_norm = m.norm
        self.weights = [layer_weights(layer) for layer in m.layers]
        self.cos_sin_cache = m.layers[0].self_attn.rotary_emb.cos_sin_cache
        self.shape, self.scale, self.eps, self.qk_eps = layer_constants(m.layers[0])
        self.skip_guards = True  # see _skip_guards
        self.layer = torch.compile(decode_layer, fullgraph=True, options=COMPILE_OPTIONS)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        prev_slots: torch.Tensor,  # [num_seqs, max_prev]: cache slots of the cached context
        seq_lens: torch.Tensor,  # [num_seqs]: context length after this step
        layer: Callable | None = None,  # `decode_layer` or its compiled form (default)
        mark_dynamic: bool = False,  # when compiling: which sizes vary from step to step
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(final hidden [num_seqs, hidden], new K, new V [num_layers, num_seqs, kv_heads,
        head_dim]); the cache is only read."""
        layer = layer or self.layer
        if prev_slots.shape[1] < 2:
            # The graph assumes two context columns or more (`decode_layer`'s _check): a
            # padded column (slot 0) is masked out like any position past a sequence's end.
            prev_slots = F.pad(prev_slots, (0, 2 - prev_slots.shape[1]))
        num_seqs, max_prev = prev_slots.shape
        cache = self.kv_cache.flatten(2, 3)  # [2, num_layers, num_slots, kv_heads, head_dim]
        # Cached positions 0 .. seq_len - 2, then the new token (the last column).
        prev = torch.arange(max_prev)[None, :] < (seq_lens[:, None] - 1)
        valid = torch.cat([prev, prev.new_ones(num_seqs, 1)], dim=1)  # [num_seqs, ctx]
        cos, sin = folded_cos_sin_at(self.cos_sin_cache, positions)
        x = F.embedding(input_ids, self.embedding)  # [num_seqs, hidden]
        residual = torch.zeros_like(x)  # x + 0 == x: layer 0 takes the same graph
        if mark_dynamic:
            _mark_dynamic(x, residual, prev_slots, cos, sin, valid)
        args = (prev_slots, cos, sin, valid, self.shape, self.scale, self.eps, self.qk_eps)
        skip = self.skip_guards and layer is self.layer and not mark_dynamic
        try:
            with _skip_guards(skip):
                x, residual, new_k, new_v = self._layers(layer, x, residual, cache, args)
        except RuntimeError as e:
            if not skip or "skip_guard_eval_unsafe" not in str(e):
                raise
            # Something the graph depends on changed since warm-up (a patched torch
            # module, say): check guards from now on (dynamo recompiles once) and redo
            # the step, which has written nothing yet.
            self.skip_guards = False
            x, residual, new_k, new_v = self._layers(layer, x, residual, cache, args)
        hidden, _ = rms_norm_ref(x, self.final_norm.weight, self.final_norm.eps, residual)
        return hidden, new_k, new_v

    def _layers(self, layer: Callable, x, residual, cache, args) -> tuple:
        """Every decoder layer: (last output, residual, new K, new V [num_layers, ...])."""
        new_k, new_v = [], []
        for i, w in enumerate(self.weights):
            x, residual, k, v = layer(x, residual, w, cache[0, i], cache[1, i], *args)
            new_k.append(k)
            new_v.append(v)
        return x, residual, torch.stack(new_k), torch.stack(new_v)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_seqs, hidden]
        assert meta.context_slots is not None
        # The new token's own slot is the last column of the longest sequence: drop it.
        # NOTE: copied into a fresh tensor, not `.contiguous()`: with one sequence the slice
        # counts as contiguous and keeps its row stride (max_prev + 1), which fails the
        # graph's stride guard and recompiled the step at the first batch-1 decode.
        context = meta.context_slots
        prev_slots = context.new_empty(context.shape[0], context.shape[1] - 1)
        prev_slots.copy_(context[:, :-1])
        hidden, new_k, new_v = self.forward(input_ids, positions, prev_slots, meta.seq_lens)
        # This step's K/V into the pool: one copy for K and one for V over all layers.
        cache = self.kv_cache.flatten(2, 3)  # [2, num_layers, num_slots, kv_heads, head_dim]
        cache[0].index_copy_(1, meta.slot_mapping, new_k)
        cache[1].index_copy_(1, meta.slot_mapping, new_v)
        return hidden

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the graph on dummy inputs (the cache is only read). Raises what inductor
        raises where it cannot compile."""
        ids = torch.zeros(3, dtype=torch.long)
        prev = torch.zeros(3, 5, dtype=torch.long)
        self.forward(ids, ids, prev, torch.full((3,), 6, dtype=torch.long), mark_dynamic=True)


class NativeCPUDecodeStep:
    """Runs decode steps on CPU with every decoder layer in one C++ call
    (kernels/cpu_decode_step.cpp): the embedding lookup, one `decode_layers` call and the
    final norm, three ops a step whatever the depth.

    Why not only the compiled step: with its per-op Python gone, a compiled SmolLM2 token
    still spent as long outside the matrix products (inductor's code for the norm, rotary
    and attention of 30 layers, dynamo's per-layer call, OpenMP fork/join per generated
    kernel, the K/V copies) as in the int8 weights' products themselves. The same work
    written as plain loops over one token's few thousand floats costs a small fraction of
    that, and nothing compiles at start-up. fp32 activations and KV cache only
    (the compiled step serves a bf16 model); each linear runs MKL on an fp32 weight (the
    call `F.linear` makes) or the weight-only kernel on a bf16 / int8 copy, or on q4_1 /
    q8_0 weights with fp32 or (`cpu_decode_dtype`) int8 activations.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor) -> None:
        m = model.model
        self.kv_cache = kv_cache
        self.embedding = m.embed_tokens.weight
        self.final_norm = m.norm
        norms, qk_norms, weights, scales, mins, biases = [], [], [], [], [], []
        self.int8_activations = False  # the q4_1 / q8_0 products' (`cpu_decode_dtype`)
        for layer in m.layers:
            ln1, qkv, q_norm, k_norm, o_proj, ln2, gate_up, down = layer_weights(layer)
            norms += [ln1, ln2]
            qk_norms += [q_norm, k_norm]
            for weight, bias, _, lowp in (qkv, o_proj, gate_up, down):
                weights.append(weight if lowp is None else lowp.packed)
                scales.append(None if lowp is None else lowp.scales)
                mins.append(None if lowp is None else lowp.mins)
                biases.append(bias)
                self.int8_activations |= lowp is not None and lowp.int8_act
        self.layers = (norms, qk_norms, weights, scales, mins, biases)
        rotary = m.layers[0].self_attn.rotary_emb
        self.cos_sin_cache = rotary.cos_sin_cache.float().contiguous()
        (self.num_heads, _, _), self.scale, self.eps, self.qk_eps = layer_constants(m.layers[0])

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,  # [num_seqs]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks]
        seq_lens: torch.Tensor,  # [num_seqs]: context length after this step
    ) -> torch.Tensor:  # [num_seqs, hidden]; the new K/V are in the pool
        x = F.embedding(input_ids, self.embedding)
        x, residual = torch.ops.minivllm_cpu.decode_layers(
            x, *self.layers, self.kv_cache, block_tables, seq_lens, positions,
            self.cos_sin_cache, self.num_heads, self.scale, self.eps, self.qk_eps,
            self.int8_activations,
        )  # fmt: skip
        return rms_norm_ref(x, self.final_norm.weight, self.final_norm.eps, residual)[0]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.forward(input_ids, positions, meta.block_tables, meta.seq_lens)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the OS maps on first touch.

    `torch.zeros` writes every byte up front: seconds for the CPU's default 2 GiB pool (the
    page faults of 2 GiB), and the whole pool resident from the start.
    An anonymous mapping reads as zeros and costs memory only for the blocks in use.
    """
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)  # anonymous, page-aligned, zero-filled on first touch
    # The tensor keeps the mapping alive (torch.frombuffer holds the buffer).
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def native_unavailable_reason(kv_cache: torch.Tensor) -> str | None:
    """Why the native step cannot run here (None: it can), building its extension."""
    if kv_cache.dtype != torch.float32:
        return f"it runs fp32 activations, the engine's dtype is {kv_cache.dtype}"
    from minivllm.kernels import cpu_lowp_linear

    return cpu_lowp_linear.unavailable_reason()


def _compiled_dtype_problem(dtype: torch.dtype) -> str | None:
    """Why the compiled step must not run this dtype here (None: it may).

    NOTE: the compiled bf16 step is verified only where the CPU multiplies bf16 (AVX-512 BF16,
    where `dtype="auto"` picks bf16). Elsewhere bf16 runs only when asked for, and what could
    be checked here failed: with ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host (torch 2.13)
    the compiled step returned NaNs for some batches (fp32 too, which passes on a real AVX2
    host, so that emulation is suspect). Until checked on such a CPU, a bf16 model keeps its
    eager step there.
    """
    from ..cpu_features import has_fast_bf16

    if dtype == torch.bfloat16 and not has_fast_bf16():
        return "a compiled bf16 step is not verified on a CPU without AVX-512 BF16 / AMX"
    return None


def cpu_decode_step(
    model: torch.nn.Module, kv_cache: torch.Tensor, enforce_eager: bool
) -> NativeCPUDecodeStep | CPUDecodeStep | None:
    """The CPU decode step for this model: the native one (`STEP_ENV=native`, the default),
    else the compiled one, else None where the model's own eager forward runs:
    `enforce_eager`, `STEP_ENV=eager`, tensor parallelism (the all-reduce is in neither),
    an fp8 KV cache,
    a model without the Llama layout, or neither step available (then with a one-line
    warning, unless eager was asked for)."""
    from ..distributed import get_tp_size

    if enforce_eager or get_tp_size() > 1 or not hasattr(getattr(model, "model", None), "layers"):
        return None
    if kv_cache.element_size() == 1:
        return None  # an fp8 cache: only the eager attention upcasts it (and applies scales)
    kind = read(STEP_ENV)
    if kind == "eager":
        return None
    reasons = []
    if kind == "native":
        reason = native_unavailable_reason(kv_cache)
        if reason is None:
            transpose_wide_weights(model)  # MKL's one-row products, fp32 weights
            return NativeCPUDecodeStep(model, kv_cache)
        reasons.append(f"no native step: {reason}")
    reason = compile_unavailable_reason() or _compiled_dtype_problem(kv_cache.dtype)
    if reason is None:
        # Before compiling: the graph is specialised to the weights' strides.
        transposed = transpose_wide_weights(model)
        step = CPUDecodeStep(model, kv_cache)
        try:
            step.warm_up()
            return step
        except Exception as e:  # noqa: BLE001 - whatever inductor raises: run eager
            for w in transposed:  # the eager path keeps its row-major (parity) layout
                w.data = w.data.contiguous()
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            reason = f"torch.compile failed: {type(e).__name__}: {first_line}"
    reasons.append(f"not compiled: {reason}")
    if read(COMPILE_ENV) != "0" or kind == "native":
        message = "; ".join(reasons)
        warnings.warn(f"the CPU decode step runs eager ({message})", RuntimeWarning, stacklevel=2)
    return None


def transpose_wide_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Store each weight with more outputs than inputs column-major ([in, out] in memory,
    the same [out, in] tensor to every caller); returns them. MKL's one-row product reads
    such a weight faster column-major on AVX2 (qkv, gate_up, the LM head); prefill's
    products take either layout at the same speed."""
    done: list[torch.nn.Parameter] = []
    lowp = {
        id(m.weight) for m in model.modules() if getattr(m, "lowp", None) is not None
    }
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.nn.Parameter) or w.dim() != 2 or w.shape[0] <= w.shape[1]:
            continue
        # A tied weight (embedding = LM head) is met twice; a packed one has its own layout;
        # where a weight-only copy serves the products, the weight is only looked up by row.
        if w.is_contiguous() and id(w) not in lowp and getattr(module, "packed", None) is None:
            w.data = w.data.t().contiguous().t()
            done.append(w)
    return done

"""Which kernels to run: Triton on CUDA, the pure-torch references elsewhere.

Triton is optional, and imported only where it can run: a GPU build of torch, or Triton's
interpreter asked for (TRITON_INTERPRET=1, or MINIVLLM_TRITON=1 to have it imported
anyway). A CPU build of torch never launches a Triton kernel, so its start does not pay
Triton's import (~0.2-0.3 s). Kernel modules import `triton` and `tl` from here: without
Triton they get a stand-in whose `jit` still decorates (so the modules import and their
references stay usable) and whose kernels raise a clear error if launched.

NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is
first imported; set it before importing `minivllm.kernels.*` to run kernels on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

from ..envs import read

_INSTALLED = importlib.util.find_spec("triton") is not None
# Triton's interpreter runs the kernels on the CPU (tests): read, as Triton does, at import.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# Whether Triton is loaded here, the kernels' condition (`use_triton`).
HAS_TRITON = _INSTALLED and bool(
    torch.version.cuda
    or torch.version.hip
    or INTERPRETING
    or read("MINIVLLM_TRITON") == "1"
)

if HAS_TRITON:
    import triton
    import triton.language as tl
else:
    _WHY = ("needs Triton: pip install triton" if not _INSTALLED else
            "is not loaded: this torch build has no GPU (set TRITON_INTERPRET=1 and "
            "MINIVLLM_TRITON=1 before importing minivllm to interpret it on the CPU)")

    class _UnavailableKernel:
        """A kernel defined without Triton: launching it says why it cannot run."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> _UnavailableKernel:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"Triton kernel {self.name} {_WHY}")

    class _NoTriton:
        """Stands in for `triton` and `triton.language` where Triton is not loaded."""

        def jit(self, fn: Any = None, **kwargs: Any) -> Any:
            if fn is None:
                return self.jit
            return _UnavailableKernel(fn.__name__)

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"triton.{name} {_WHY}")

    triton = tl = _NoTriton()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "triton", "tl", "use_triton", "require_triton", "num_sms"]


def use_triton(device: torch.device | str | torch.Tensor) -> bool:
    """True when kernels on `device` should be the Triton ones: CUDA with Triton installed,
    or the CPU under Triton's interpreter when asked for explicitly (TRITON_INTERPRET=1 and
    MINIVLLM_TRITON=1; slow, for tests)."""
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRETING and read("MINIVLLM_TRITON") == "1"


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the Triton kernels need Triton (pip install triton); "
                           "use the *_ref functions on machines without it")


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device`; a small stand-in on the CPU interpreter."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)  # an fp8 cache: kernels/store_kvcache.py


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    device: torch.device | None = None,
) -> None:
    """Wrapper-side input check: rank, dtype, device, unit stride on the last dimension
    (every kernel vectorises along it)."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {dtypes}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, "
                         f"got strides {t.stride()}")


INDEX_DTYPES = (torch.int32, torch.int64)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Checks a layer's paged cache pair; returns (block_size, num_kv_heads, head_dim)."""
    check_tensor("k_cache", k_cache, 4, KV_DTYPES)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match "
                         f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous "
                         "[num_blocks, block_size, num_kv_heads, head_dim] tensors")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_size must be a power of two from 16 to 256, got {block_size}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two from 16 to 256, got {head_dim}")
    return block_size, num_kv_heads, head_dim


def check_paged_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    q: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_heads: int = 0,  # without q
) -> None:
    """The checks decode and prefill attention share: the cache pair, q (when the caller
    has one) on the cache's device with its head_dim, whole GQA groups, the index tensors.
    The per-kernel row counts are the caller's."""
    require_triton()
    _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    device = k_cache.device
    if q is not None:
        check_tensor("q", q, 3, device=device)
        if q.shape[2] != head_dim:
            raise ValueError(f"q has head_dim {q.shape[2]}, the cache {head_dim}")
        num_heads = q.shape[1]
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, device=device)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device=device)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")

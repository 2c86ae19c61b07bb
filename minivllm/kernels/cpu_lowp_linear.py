"""Weight-only low precision linear for the CPU: bf16 or int8 weights, fp32 activations and
sums (the C++ kernel in cpu_lowp_linear.cpp, its packing, and the torch reference).

A decode token on the CPU reads every weight once (SmolLM2-135M's are 540 MB in fp32), so
the memory bandwidth, not the arithmetic, sets its time. bf16 weights halve the bytes and
int8 weights (one fp32 scale per output channel) quarter them; torch's own kernels do not
turn that into speed on a CPU without AVX-512 BF16 (bf16 `F.linear` and
`_weight_int8pack_mm` are slower than fp32 `F.linear` at one row), so
the product is our own kernel: each weight is widened to fp32 in registers and multiplied
with fp32 activations, i.e. the same sums as `F.linear(x, dequantize(w))`.

The extension is compiled at first use with torch.utils.cpp_extension (g++ and ninja)
into torch's extensions folder, under a name hashed from everything the binary depends on
(the sources, the flags, this CPU's features since it is built -march=native, the torch
install and Python), so a later start of any checkout with the same inputs loads the
library directly: no compiler, no ninja, no source hashing. It is registered as the torch
op `minivllm_cpu::lowp_linear`, with a fake implementation, so the inductor-compiled decode
step (engine/cpu_step.py) calls it as one opaque op.

Packed layout: [num_blocks, K, L], L = `block_width()` (8 with AVX2, 16 with AVX-512):
block b holds output channels b*L .. b*L+L-1, zero-padded at the end.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from ..envs import read

SOURCE = Path(__file__).with_name("cpu_lowp_linear.cpp")
# Built with it, in one translation unit: the whole CPU decode step (cpu_decode_step.cpp,
# engine/cpu_step.py's NativeCPUDecodeStep), which calls this kernel for its products.
STEP_SOURCE = Path(__file__).with_name("cpu_decode_step.cpp")
OP = "minivllm_cpu::lowp_linear"
GROUP_OP = "minivllm_cpu::group_linear"
# llama.cpp's group formats: weights in groups of GROUP along the input dimension, one fp16
# scale per group (Q4_1: and a minimum).
GROUP = 32


@contextlib.contextmanager
def _ninja_on_path():
    """torch's build runs `ninja` from PATH; the `ninja` package (a dependency) puts it in
    the virtualenv's bin folder, which is not on PATH when the venv is not activated."""
    old = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, old])
        except (ImportError, AttributeError):
            pass  # the build reports that ninja is missing
    try:
        yield
    finally:
        os.environ["PATH"] = old


CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Written into the build folder once the library built and loaded: a folder without it
# holds an unfinished or failed build, which is built again.
BUILT_MARKER = "minivllm-built"


@functools.cache
def extension_name() -> str:
    """The library's name: a hash of what the binary depends on. A checkout with other
    sources, another torch or another CPU gets its own build instead of rebuilding a
    shared one (torch's own versioning rebuilds in place whenever the compile line, which
    names the virtualenv's include folders, differs)."""
    from minivllm.cpu_features import cpu_flags

    digest = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        STEP_SOURCE.read_bytes(),
        " ".join(CFLAGS + LDFLAGS).encode(),
        " ".join(sorted(cpu_flags())).encode(),
        f"{torch.__version__} {Path(torch.__file__).parent} {sys.version}".encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return f"minivllm_cpu_lowp_{digest.hexdigest()[:16]}"


def build_directory() -> Path:
    """This library's folder in torch's extensions cache ($TORCH_EXTENSIONS_DIR, else
    torch_extensions in the user's cache folder)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        root = os.path.join(cache, "torch_extensions")
    return Path(root).expanduser() / extension_name()


def is_built() -> bool:
    """Whether the library is in the cache, so that loading it compiles nothing."""
    folder = build_directory()
    return (folder / BUILT_MARKER).is_file() and (folder / f"{extension_name()}.so").is_file()


def _compile(folder: Path) -> None:
    """Compile and load the library into `folder` (torch's lock file there keeps two
    processes from building it at once).

    NOTE: the two sources are joined into one file in `folder`, compiled as it is:
    `load_inline` would put `#include <torch/extension.h>` (all of torch's C++ API,
    pybind11 and Python) in front, whose parsing was over half of the build's ~45 s of g++;
    the sources include only the ATen headers they use.
    """
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    main = folder / f"{extension_name()}.cpp"
    source = "\n".join([SOURCE.read_text(), STEP_SOURCE.read_text()])
    if not main.is_file() or main.read_text() != source:  # unchanged: ninja builds nothing
        main.write_text(source)
    with _ninja_on_path():
        cpp_extension.load(
            name=extension_name(),
            sources=[str(main)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            is_python_module=False,
            verbose=read("MINIVLLM_VERBOSE_BUILD") == "1",
        )
    (folder / BUILT_MARKER).write_text(f"{torch.__version__}\n")


_BUILD_LOCK = threading.Lock()


def _build() -> str | None:
    """Load the library once per process, compiling it first where it is not in the
    cache; None on success, else why not. A build already running on another thread
    (`build_in_background`) is waited for."""
    with _BUILD_LOCK:
        return _load_or_compile()


def build_in_background() -> threading.Thread:
    """Start `_build` on a thread: a first start compiles (g++, in its own processes) while
    it does its other work, such as converting the GGUF; the first use of the kernel
    waits for the build. The caller must use the kernel (or join the thread) before it
    exits: a build cut short leaves torch's lock file in the build folder."""
    thread = threading.Thread(target=_build, name="cpu-kernel-build", daemon=True)
    thread.start()
    return thread


@functools.cache
def _load_or_compile() -> str | None:
    try:
        if is_built():
            torch.ops.load_library(str(build_directory() / f"{extension_name()}.so"))
        else:
            _compile(build_directory())
    except Exception as e:  # noqa: BLE001 - a missing compiler, ninja, or a failed build
        lines = str(e).strip().splitlines() or [type(e).__name__]
        return f"{type(e).__name__}: {lines[-1][:200]}"

    @torch.library.register_fake(OP)
    def _(x, packed, scales, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(GROUP_OP)
    def _(x, values, scales, mins, bias, n, int8_activations=False):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("minivllm_cpu::qkv_rotary_store_rows")
    def _(positions, qkv, num_heads, cos_sin_cache, k_cache, v_cache, slot_mapping, q_norm,
          k_norm, eps):
        return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[3])

    return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can), building it on first call."""
    return _build()


def block_width() -> int:
    """Output channels per packed block (the kernel's vector width in floats)."""
    reason = _build()
    if reason is not None:
        raise RuntimeError(f"the CPU low-precision kernel is unavailable: {reason}")
    return int(torch.ops.minivllm_cpu.block_width())


def _blocks(w: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width], zero rows padding the last block."""
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, -n % width))
    return w.view(-1, width, k).transpose(1, 2).contiguous()


def pack_bf16(weight: torch.Tensor, width: int) -> torch.Tensor:
    """bf16 copy of `weight` [N, K] in the packed layout (round to nearest even)."""
    return _blocks(weight.detach().to(torch.bfloat16), width)


def quantize_int8(weight: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (packed int8 [blocks, K, width], fp32 scales
    [blocks * width]) with weight ~= q * scale, scale = max|row| / 127."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return _blocks(q, width), F.pad(scales, (0, -len(scales) % width)).contiguous()


def _group_blocks(t: torch.Tensor, width: int) -> torch.Tensor:
    """Per-group [N, K / GROUP] -> [ceil(N / width), K / GROUP, width] fp16, zero-padded."""
    return _blocks(t, width).to(torch.float16)


def _groups(weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach().float()
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features={k} is not a multiple of the group size {GROUP}")
    return w.view(n, k // GROUP, GROUP)


def quantize_q8_0(weight: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0: per group of 32 inputs, d = max|w| / 127 in fp16, q = round(w / d).
    Returns (int8 values [blocks, K, width], fp16 scales [blocks, K / 32, width])."""
    g = _groups(weight)
    d = (g.abs().amax(-1) / 127).half().float()
    q = torch.where(d[..., None] > 0, g / d[..., None], torch.zeros_like(g))
    q = q.round_().clamp_(-127, 127).to(torch.int8).flatten(1)
    return _blocks(q, width), _group_blocks(d, width)


def quantize_q4_1(
    weight: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1: per group of 32 inputs, m = min(w) and d = (max - min) / 15, both
    fp16, q = round((w - m) / d) in 0..15. A weight that came from a Q4_1 file (dequantized)
    is recovered exactly. Returns (values [blocks, K, width / 2] uint8, two 4-bit values a
    byte: output j low, j + width / 2 high; fp16 scales and mins [blocks, K / 32, width])."""
    g = _groups(weight)
    m = g.amin(-1).half().float()
    d = ((g.amax(-1) - m) / 15).half().float()
    q = torch.where(d[..., None] > 0, (g - m[..., None]) / d[..., None], torch.zeros_like(g))
    q = _blocks(q.round_().clamp_(0, 15).to(torch.uint8).flatten(1), width)
    half = width // 2
    values = q[..., :half] | (q[..., half:] << 4)
    return values.contiguous(), _group_blocks(d, width), _group_blocks(m, width)


def dequantize_group(
    values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int
) -> torch.Tensor:
    """The fp32 weight [n, K] a Q8_0 (mins None) or Q4_1 weight stands for."""
    blocks, k, _ = values.shape
    width = scales.shape[2]
    if mins is not None:  # unpack the nibbles: low = outputs 0 .. width/2 - 1
        values = torch.cat([values & 0x0F, values >> 4], dim=2)
    q = values.transpose(1, 2).reshape(blocks * width, k)[:n].float()
    per_group = q.view(n, k // GROUP, GROUP)
    w = per_group * _per_output(scales, n).float()[..., None]
    if mins is not None:
        w = w + _per_output(mins, n).float()[..., None]
    return w.view(n, k)


def _per_output(t: torch.Tensor, n: int) -> torch.Tensor:
    """Group scales (or mins) [blocks, K / 32, width] -> [n, K / 32], one row an output."""
    blocks, groups, width = t.shape
    return t.transpose(1, 2).reshape(blocks * width, groups)[:n]


def group_linear_ref(x, values, scales, mins, bias, n):
    return F.linear(x, dequantize_group(values, scales, mins, n), bias)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the kernel's int8 activations take them: per group of 32,
    s = max|x| / 127 and xq = round(x * (127 / max|x|)) (0 for an all-zero group).
    Returns (xq [M, K / 32, 32] int8 values as fp32, s [M, K / 32, 1])."""
    g = x.float().view(x.shape[0], -1, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (g * inv).round_().clamp_(-127, 127), amax / 127


def group_linear_i8_ref(x, values, scales, mins, bias, n):
    """`group_linear(..., int8_activations=True)` in float64: each group's sum of int8 values
    is exact, then d * s * sum(q * xq) (+ m * the group's fp32 sum of x)."""
    xq, s = quantize_activations(x)  # [M, G, 32], [M, G, 1]
    k = values.shape[1]
    unit = torch.ones_like(scales)
    q = dequantize_group(values, unit, None if mins is None else torch.zeros_like(mins), n)
    q = q.double().view(n, k // GROUP, GROUP)  # the integer values: d = 1, m = 0
    sums = torch.einsum("mgk,ngk->mng", xq.double(), q)  # [M, n, groups], exact integers
    d = _per_output(scales, n).double()
    y = (sums * d[None] * s.double().squeeze(-1)[:, None, :]).sum(-1)
    if mins is not None:
        xsum = x.double().view(x.shape[0], -1, GROUP).sum(-1)  # [M, groups]
        y = y + xsum @ _per_output(mins, n).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()


def int8_activations_available() -> bool:
    """Whether `group_linear` can take int8 activations here (AVX512-VNNI and -VBMI)."""
    return _build() is None and bool(torch.ops.minivllm_cpu.int8_activations())


def group_linear(
    x: torch.Tensor,  # [M, K] fp32, unit stride in K
    values: torch.Tensor,  # int8 (Q8_0) or uint8 (Q4_1) from quantize_q8_0 / quantize_q4_1
    scales: torch.Tensor,
    mins: torch.Tensor | None,  # Q4_1 only
    bias: torch.Tensor | None,
    n: int,
    int8_activations: bool = False,  # `group_linear_i8_ref`'s arithmetic (llama.cpp's)
) -> torch.Tensor:  # [M, n] fp32
    return torch.ops.minivllm_cpu.group_linear(x, values, scales, mins, bias, n,
                                               int8_activations)


def dequantize(packed: torch.Tensor, scales: torch.Tensor | None, n: int) -> torch.Tensor:
    """The fp32 weight [n, K] the packed one stands for."""
    blocks, k, width = packed.shape
    w = packed.transpose(1, 2).reshape(blocks * width, k)[:n].float()
    if scales is not None:
        w = w * scales[:n, None]
    return w


def lowp_linear_ref(
    x: torch.Tensor,  # [M, K] fp32
    packed: torch.Tensor,  # [blocks, K, width] bf16 or int8
    scales: torch.Tensor | None,  # [blocks * width] fp32 for int8, None for bf16
    bias: torch.Tensor | None,  # [n] fp32
    n: int,
) -> torch.Tensor:  # [M, n] fp32
    return F.linear(x, dequantize(packed, scales, n), bias)


def lowp_linear(
    x: torch.Tensor,  # [M, K] fp32, unit stride in K
    packed: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:  # [M, n] fp32
    """The kernel (call `unavailable_reason()` first: it builds the extension)."""
    return torch.ops.minivllm_cpu.lowp_linear(x, packed, scales, bias, n)


def check_available() -> bool:
    """Whether the kernel runs here; warns once with the reason where it does not."""
    reason = _build()
    if reason is not None:
        warnings.warn(
            f"the CPU low-precision weight kernel did not build ({reason}): weights stay fp32",
            RuntimeWarning,
            stacklevel=2,
        )
    return reason is None

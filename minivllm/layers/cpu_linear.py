"""CPU linears: oneDNN-packed weights (bf16 compute) or weight-only bf16 / int8 weights with
fp32 compute (kernels/cpu_lowp_linear.py), chosen once when the engine loads the model.

`F.linear` at one token per step reorders nothing and runs at ~14 GB/s; a weight packed into
oneDNN's blocked layout at load time halves the time of SmolLM2's linears where the CPU
multiplies bf16 (PERF.md). The two ops are private to torch (`torch.ops.mkldnn`), so every
use goes through `pack_weight` / `linear`: where they are missing or refuse the dtype, the
layer keeps `F.linear`, and tests/test_cpu_path.py checks the two agree.

Weight-only formats (`cpu_weight_dtype`): the fp32 weight is replaced by a packed bf16,
int8, Q8_0 or Q4_1 copy (`LowpWeight`), and every product with it runs our kernel: a decode
token reads half to a sixth of fp32's bytes. Where the CPU multiplies bf16 (AMX: ~2 TFLOP/s
on two cores against the kernel's ~0.2), a prefill's products are compute-bound, not
bandwidth-bound, so such a weight also keeps a oneDNN-packed bf16 copy for products of many
rows (`cpu_prefill_dtype`, `add_wide_copies`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class WideRows:
    """Which rows of an eager CPU step take the linears' bf16 copies: those of its prefill
    chunks (sequences with more than one query this step). A decode row keeps the
    weight-only kernel's fp32 sums whatever shares its step, so a reply's tokens do not
    depend on another request's prefill beside it. (The bf16 copies win from about 16 rows
    on; a prefill of a few tokens loses a little to them, and keeps the precision of a
    longer one.)"""

    every: bool  # every row; else the two index tensors
    wide: torch.Tensor | None = None
    narrow: torch.Tensor | None = None

    @staticmethod
    def of(cu_seqlens_q: list[int]) -> WideRows | None:
        """The split of a step whose sequences' rows start at `cu_seqlens_q`; None where no
        sequence has more than one query."""
        spans = list(itertools.pairwise(cu_seqlens_q))
        if all(end - start > 1 for start, end in spans if end > start):
            return WideRows(every=True) if cu_seqlens_q[-1] > 0 else None
        wide = [r for start, end in spans if end - start > 1 for r in range(start, end)]
        if not wide:
            return None
        narrow = [start for start, end in spans if end - start == 1]
        return WideRows(False, torch.tensor(wide), torch.tensor(narrow))


_WIDE_ROWS: ContextVar[WideRows | None] = ContextVar("wide_rows", default=None)


@contextlib.contextmanager
def wide_rows(rows: WideRows | None) -> Iterator[None]:
    """Within it, products of linears with a bf16 copy run `rows` on it (model_runner sets
    it around an eager CPU step's forward)."""
    token = _WIDE_ROWS.set(rows)
    try:
        yield
    finally:
        _WIDE_ROWS.reset(token)


# llama.cpp's group formats (kernels/cpu_lowp_linear.py's group_linear), in the order
# `compact` tries them.
GROUP_FORMATS = ("q4_1", "q8_0")


class LowpWeight(NamedTuple):
    """A linear's weight in a weight-only format (kernels/cpu_lowp_linear.py's layouts)."""

    # [blocks, in, width] bf16 or int8 (int8, q8_0); [blocks, in, width / 2] uint8 (q4_1)
    packed: torch.Tensor
    # int8: [blocks * width] fp32 per output channel; q8_0 / q4_1: [blocks, in / 32, width]
    # fp16 per group of 32 inputs; bf16: None
    scales: torch.Tensor | None
    out_features: int
    mins: torch.Tensor | None = None  # q4_1: like its scales
    fmt: str = "bfloat16"  # bfloat16, int8, q8_0 or q4_1
    # The same weight in bf16 or fp32, packed by oneDNN, for a prefill's rows
    # (`add_wide_copies`, `WideRows`): the packed tensor, or a `WideCopy` that packs it at
    # its first use; None: every product runs the weight-only kernel.
    wide: torch.Tensor | WideCopy | None = None
    # q8_0 / q4_1: the kernel quantizes the activations to int8 per group of 32
    # (`cpu_decode_dtype`, `int8_activations`); else fp32 activations and sums.
    int8_act: bool = False
    # A prefill's product on a bf16 wide copy comes back in bf16, not widened to fp32: the
    # MLP's gate_up, whose SiLU reads bf16 rows (kernels/cpu_ops.py) and gives the down
    # product the bf16 rows it takes (2 x intermediate columns not widened and narrowed).
    wide_keeps_dtype: bool = False

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, in] fp32 (unit stride in `in`; bf16 on the wide copy) @ weight^T (+ bias):
        [M, out] fp32, or bf16 where every row is wide and `wide_keeps_dtype`."""
        rows = _WIDE_ROWS.get() if self.wide is not None else None
        if rows is None:
            return self.kernel_product(x, bias)
        if rows.every:
            return self.wide_product(x, bias)
        y = x.new_empty(x.shape[0], self.out_features)
        y[rows.narrow] = self.kernel_product(x[rows.narrow], bias)
        y[rows.wide] = self.wide_product(x[rows.wide], bias).float()
        return y

    def wide_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product on the wide copy: x in the copy's dtype (bf16: rounded; fp32: as
        is), fp32 sums, out in that dtype, as fp32 (or as is: `wide_keeps_dtype`)."""
        wide = self.wide.get() if isinstance(self.wide, WideCopy) else self.wide
        if wide.layout == torch.strided:  # a plain fp32 weight (`WideCopy`): MKL's product
            y = F.linear(x.to(wide.dtype), wide)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x.to(wide.dtype), wide, None, "none", [], "")
        if self.wide_keeps_dtype and bias is None:
            return y
        y = y.float()
        return y if bias is None else y + bias

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in] this copy stands for."""
        from minivllm.kernels import cpu_lowp_linear as kernel

        if self.fmt in GROUP_FORMATS:
            return kernel.dequantize_group(self.packed, self.scales, self.mins,
                                           self.out_features)
        return kernel.dequantize(self.packed, self.scales, self.out_features)

    def kernel_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The weight-only kernel's product: fp32 activations and sums, or with `int8_act`
        int8 activations per group of 32 and int32 group sums."""
        from minivllm.kernels import cpu_lowp_linear as kernel

        if self.fmt in GROUP_FORMATS:
            return kernel.group_linear(x, self.packed, self.scales, self.mins, bias,
                                       self.out_features, self.int8_act)
        return kernel.lowp_linear(x, self.packed, self.scales, bias, self.out_features)


class WideCopy:
    """A weight-only linear's `dtype` copy for a prefill's products, made at its first use.

    The copy is the weight dense in `dtype` (what the weight-only one stands for) from the
    model's `DenseCopies`, used as it is in fp32 (MKL's products of many rows on a plain
    weight run as fast as oneDNN's on a packed one: AVX2, 128-512 rows) and packed by
    oneDNN in bf16. Made when a prefill first needs it, a start and the decode-only
    requests never pay for it.
    """

    def __init__(self, weight: LowpWeight, dtype: torch.dtype,
                 dense: DenseCopies | None = None, name: str = "") -> None:
        self.dtype = dtype
        self._weight: LowpWeight | None = weight._replace(wide=None)
        self._dense, self._name = dense, name
        self._packed: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._packed is None:
            assert self._weight is not None
            if self._dense is not None:
                weight = self._dense.get(self._name)
            else:
                weight = self._weight.dequantized().to(self.dtype)
            packed = weight if self.dtype == torch.float32 else pack_weight(weight)
            if packed is None:  # `add_wide_copies` checked that oneDNN packs this dtype
                raise RuntimeError(f"oneDNN cannot pack a {self.dtype} weight here")
            self._packed, self._weight, self._dense = packed, None, None
        return self._packed


class DenseCopies:
    """Every weight-only linear's weight dense in `dtype` ([out, in], what its weight-only
    copy stands for), made for the model's first prefill, all at once: mapped from `file`
    where an earlier start wrote it (SmolLM2-135M in fp32: 425 MB, the OS reads pages as
    they are used), else dequantized (seconds) and written to `file` for the next start.
    A file that cannot be read, or is not this model's, is written again with a one-line
    note on stderr."""

    def __init__(self, weights: dict[str, LowpWeight], dtype: torch.dtype,
                 file: Path | None) -> None:
        self.dtype, self.file = dtype, file
        self._weights: dict[str, LowpWeight] | None = weights
        self._dense: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def get(self, name: str) -> torch.Tensor:
        with self._lock:
            if self._dense is None:
                self._dense = self._read() or self._make()
                self._weights = None
            return self._dense[name]

    def _read(self) -> dict[str, torch.Tensor] | None:
        from ..loader import map_safetensors

        if self.file is None or not self.file.is_file():
            return None
        assert self._weights is not None
        try:
            tensors, _ = map_safetensors(self.file)
        except ValueError:
            size = self.file.stat().st_size
            _note(f"{self.file}: unreadable ({size} bytes); dequantizing the weights again")
            return None
        if set(tensors) != set(self._weights) or any(
            tensors[name].dtype != self.dtype
            or tuple(tensors[name].shape) != (lowp.out_features, lowp.packed.shape[1])
            for name, lowp in self._weights.items()
        ):
            _note(f"{self.file}: not this model's prefill weights; dequantizing them again")
            return None
        return tensors

    def _make(self) -> dict[str, torch.Tensor]:
        assert self._weights is not None
        dense = {
            name: lowp.dequantized().to(self.dtype).contiguous()
            for name, lowp in self._weights.items()
        }
        if self.file is not None:
            with contextlib.suppress(OSError):  # a read-only cache: dequantize next time
                _save_atomically(dense, {}, self.file)
                # The file's pages instead of the copies: the OS may drop them when idle.
                return self._read() or dense
        return dense


def _note(message: str) -> None:
    print(f"minivllm: {message}", file=sys.stderr, flush=True)


def _ops_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight` [out, in], or None where it cannot be used (not a
    CPU tensor, a dtype this CPU's oneDNN refuses, e.g. bf16 without AVX-512, or a torch
    without the ops)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not _ops_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        # One tiny product proves the packed weight runs here before the model relies on it.
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return None
    return packed


def linear(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor | None,  # [out, in]; None where `lowp` replaced it
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,  # from pack_weight(weight), or None for F.linear
    lowp: LowpWeight | None = None,
) -> torch.Tensor:  # [num_tokens, out]
    if lowp is not None:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = lowp.product(x2, bias)
        return y.view(*x.shape[:-1], lowp.out_features)
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Pack the weight of every layer that has a `packed` slot; returns how many were packed."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed") and isinstance(getattr(module, "weight", None), torch.Tensor):
            module.packed = pack_weight(module.weight)
            count += module.packed is not None
    return count


def weight_format(cpu_weight_dtype: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The weight-only format the engine's CPU linears take ("bfloat16", "int8", "q8_0",
    "q4_1", "compact"), or None where weights stay in the compute dtype. Raises ValueError
    for a format that needs fp32 activations when the compute dtype is not fp32 ("compact"
    then keeps the compute dtype: it asks for the best the machine runs)."""
    if device.type != "cpu" or cpu_weight_dtype in ("auto", str(dtype).removeprefix("torch.")):
        return None
    if dtype != torch.float32 and cpu_weight_dtype == "compact":
        return None
    if dtype != torch.float32:
        raise ValueError(
            f"cpu_weight_dtype={cpu_weight_dtype!r} needs dtype='float32' (its kernel "
            f"multiplies fp32 activations); the engine's dtype is "
            f"{str(dtype).removeprefix('torch.')!r}"
        )
    return None if cpu_weight_dtype == "float32" else cpu_weight_dtype


def lowp_linears(model: torch.nn.Module, fmt: str) -> str | None:
    """Replace the fp32 weight of every linear (and the LM head) by its `fmt` copy; returns
    the formats taken ("q4_1/q8_0"), None where none was. `fmt`: "bfloat16", "int8", "q8_0",
    "q4_1" (the LM head in q8_0, as llama.cpp's Q4_1 files ship it) or "compact" (per
    weight, the first of q4_1 / q8_0 that holds it exactly, else bfloat16: a model
    converted from such a GGUF keeps its own weights, at its own size). A weight the LM
    head shares with the token embedding stays (the embedding looks rows up in it). Does
    nothing, with a warning, where the kernel cannot be built here. Raises ValueError for a
    group format on a weight whose inputs are not a multiple of 32."""
    from minivllm.kernels import cpu_lowp_linear as kernel

    if not kernel.check_available():
        return None
    width = kernel.block_width()
    shared = {
        id(m.weight) for m in model.modules() if not hasattr(m, "lowp") and hasattr(m, "weight")
    }
    head = getattr(model, "lm_head", None)
    taken: list[str] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "lowp") or not isinstance(weight, torch.Tensor):
            continue
        assert weight.dtype == torch.float32 and weight.dim() == 2, weight.shape
        choice = fmt
        if fmt == "q4_1" and module is head:
            choice = "q8_0"
        try:
            module.lowp = _lowp_weight(kernel, weight, choice, width)
        except ValueError as e:
            raise ValueError(f"cpu_weight_dtype={fmt!r}: {name}: {e}") from None
        if id(weight) not in shared:
            module.weight = None  # the fp32 copy is never read again: free it
        if module.lowp.fmt not in taken:
            taken.append(module.lowp.fmt)
    return "/".join(taken) or None


def prefill_dtype(cpu_prefill_dtype: str, dtype: str, fmt: str | None) -> torch.dtype | None:
    """The dtype of a weight-only model's prefill products (on oneDNN-packed copies of the
    weights) and attention, or None where they stay on the weight-only kernel (fp32
    activations and sums, no copies). `cpu_prefill_dtype` "auto", where the engine's dtype
    was left at "auto": bf16 where the CPU multiplies bf16 (AMX, AVX-512 BF16), else fp32
    copies (oneDNN's fp32 products of many rows outrun the kernel's: AVX2, 128-512 rows,
    ~1.5x); "bfloat16" asks for bf16 anywhere; "float32", or `dtype="float32"` asked for,
    keeps the kernel. `fmt`: the format taken (None: the linears keep their own dtype, and
    so do their products)."""
    if fmt is None or cpu_prefill_dtype == "float32":
        return None
    if cpu_prefill_dtype == "bfloat16":
        return torch.bfloat16
    if dtype != "auto":
        return None
    from ..cpu_features import has_fast_bf16

    return torch.bfloat16 if has_fast_bf16() else torch.float32


def decode_dtype(cpu_decode_dtype: str, dtype: str, fmt: str | None) -> str | None:
    """"int8" where the weight-only kernel's products with q4_1 / q8_0 weights take int8
    activations, else None (fp32 activations: the exact sums). "auto" takes int8 where the
    engine's dtype was left at "auto" and the CPU has AVX512-VNNI and -VBMI; "int8" asks
    for it (a ValueError where it cannot run); "float32", or `dtype="float32"` asked for,
    keeps fp32. `fmt`: the formats taken ("q4_1/q8_0"; None: no weight-only format)."""
    from minivllm.kernels import cpu_lowp_linear as kernel

    groups = fmt is not None and any(f in GROUP_FORMATS for f in fmt.split("/"))
    if cpu_decode_dtype == "float32" or (cpu_decode_dtype == "auto" and dtype != "auto"):
        return None
    available = groups and kernel.int8_activations_available()
    if cpu_decode_dtype == "int8" and not available:
        raise ValueError(
            "cpu_decode_dtype='int8' needs q4_1 / q8_0 weights (cpu_weight_dtype='compact' "
            f"on a GGUF model; these are {fmt or 'not weight-only'}) and a CPU with "
            "AVX512-VNNI and AVX512-VBMI"
        )
    return "int8" if available else None


def int8_activations(model: torch.nn.Module) -> int:
    """Every q4_1 / q8_0 linear's products take int8 activations; returns how many."""
    count = 0
    for module in model.modules():
        lowp = getattr(module, "lowp", None)
        if isinstance(lowp, LowpWeight) and lowp.fmt in GROUP_FORMATS:
            module.lowp = lowp._replace(int8_act=True)
            count += 1
    return count


def add_wide_copies(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, cache: Path | None = None
) -> int:
    """Give every weight-only linear but the LM head (one row a sequence) a `dtype` copy of
    its weight for a prefill's products, made at its first use (`WideCopy`) from the
    model's dense copies, cached in a file beside `cache` (the packed weights' file; None:
    nothing cached); returns how many took one (none where oneDNN cannot pack `dtype`
    here). Costs 2 bytes a weight in bf16, 4 in fp32 (SmolLM2-135M: ~210 / ~420 MB), once
    used."""
    if pack_weight(torch.zeros(16, 64, dtype=dtype)) is None:  # oneDNN refuses the dtype
        return 0
    head = getattr(model, "lm_head", None)
    slots = {
        name: module for name, module in model.named_modules()
        if getattr(module, "lowp", None) is not None and module is not head
    }
    file = None if cache is None else cache.with_name(
        f"{cache.stem}-prefill-{str(dtype).removeprefix('torch.')}.safetensors"
    )
    dense = DenseCopies({name: m.lowp for name, m in slots.items()}, dtype, file)
    for name, module in slots.items():
        module.lowp = module.lowp._replace(wide=WideCopy(module.lowp, dtype, dense, name),
                                           wide_keeps_dtype=name.endswith("mlp.gate_up_proj"))
    return len(slots)


# -- the packed weights cached on disk ---------------------------------------------------


def packing_tag(fmt: str) -> str:
    """Names a cache of packed weights: the format asked for, the kernel's block width, and
    a hash of the code that packs them and of torch (another version packs anew)."""
    from minivllm.kernels import cpu_lowp_linear as kernel

    digest = hashlib.sha256()
    for source in (Path(kernel.__file__), Path(__file__)):
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    return f"{fmt}-w{kernel.block_width()}-{digest.hexdigest()[:12]}"


def lowp_slots(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules `lowp_linears` gives a weight-only copy, by name."""
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lowp") and isinstance(getattr(module, "weight", None), torch.Tensor)
    }


def replaced_weights(model: torch.nn.Module) -> frozenset[str]:
    """The parameters a weight-only copy replaces: every linear's weight but one shared
    with a module that reads it (the token embedding tied to the LM head)."""
    shared = {
        id(m.weight) for m in model.modules() if not hasattr(m, "lowp") and hasattr(m, "weight")
    }
    return frozenset(
        f"{name}.weight" for name, module in lowp_slots(model).items()
        if id(module.weight) not in shared
    )


def save_lowp_linears(model: torch.nn.Module, file: Path) -> None:
    """Write every linear's weight-only copy to `file` (written aside, then renamed)."""
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for name, module in model.named_modules():
        lowp = getattr(module, "lowp", None)
        if not isinstance(lowp, LowpWeight):
            continue
        metadata[name] = f"{lowp.fmt}:{lowp.out_features}"
        for part in ("packed", "scales", "mins"):
            if getattr(lowp, part) is not None:
                tensors[f"{name}.{part}"] = getattr(lowp, part)
    _save_atomically(tensors, metadata, file)


def _save_atomically(tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                     file: Path) -> None:
    """Write a safetensors file aside, then rename it into place: a reader never maps a
    half-written file, and two writers leave one whole file."""
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def read_lowp_linears(model: torch.nn.Module, file: Path) -> dict[str, LowpWeight] | None:
    """The weight-only copies `save_lowp_linears` wrote for this model, as views of the
    mapped file; None where the file is missing, or (with a one-line note: the caller
    packs and writes it again) unreadable or not this model's."""
    from ..loader import map_safetensors

    if not file.is_file():
        return None
    try:
        tensors, metadata = map_safetensors(file)
    except ValueError:
        _note(f"{file}: unreadable ({file.stat().st_size} bytes); packing the weights again")
        return None
    slots = lowp_slots(model)
    copies: dict[str, LowpWeight] = {}
    for name, module in slots.items():
        fmt, _, n = metadata.get(name, "").partition(":")
        packed = tensors.get(f"{name}.packed")
        if packed is None or not n.isdigit() or int(n) != module.weight.shape[0]:
            break
        copies[name] = LowpWeight(
            packed, tensors.get(f"{name}.scales"), int(n), tensors.get(f"{name}.mins"), fmt
        )
    if set(metadata) != set(slots) or len(copies) != len(slots):
        _note(f"{file}: not this model's packed weights; packing them again")
        return None
    return copies


def use_lowp_linears(model: torch.nn.Module, copies: dict[str, LowpWeight]) -> str | None:
    """Give each linear its copy from `read_lowp_linears`, dropping the weights they
    replace; returns the formats taken, as `lowp_linears` does."""
    keep = {
        id(m.weight) for m in model.modules() if not hasattr(m, "lowp") and hasattr(m, "weight")
    }
    taken: list[str] = []
    for name, module in lowp_slots(model).items():
        module.lowp = copies[name]
        if id(module.weight) not in keep:
            module.weight = None
        if module.lowp.fmt not in taken:
            taken.append(module.lowp.fmt)
    return "/".join(taken) or None


def _lowp_weight(kernel, weight: torch.Tensor, fmt: str, width: int) -> LowpWeight:
    n = weight.shape[0]
    if fmt == "compact":
        exact = _exact_group_weight(kernel, weight, width)
        return exact or _lowp_weight(kernel, weight, "bfloat16", width)
    if fmt == "bfloat16":
        return LowpWeight(kernel.pack_bf16(weight, width), None, n, fmt=fmt)
    if fmt == "int8":
        return LowpWeight(*kernel.quantize_int8(weight, width), n, fmt=fmt)
    if fmt == "q8_0":
        return LowpWeight(*kernel.quantize_q8_0(weight, width), n, fmt=fmt)
    values, scales, mins = kernel.quantize_q4_1(weight, width)
    return LowpWeight(values, scales, n, mins, fmt)


def _exact_group_weight(kernel, weight: torch.Tensor, width: int) -> LowpWeight | None:
    """`weight` in the first of q4_1 / q8_0 that holds it exactly, or None. Each format is
    tried on the first row before the whole weight: a weight that did not come from such a
    file fails there, without quantizing all of it (start-up)."""
    if weight.shape[1] % kernel.GROUP:
        return None

    def exact(lowp: LowpWeight, w: torch.Tensor) -> bool:
        return torch.equal(lowp.dequantized(), w.detach())

    for fmt in GROUP_FORMATS:
        if exact(_lowp_weight(kernel, weight[:1], fmt, width), weight[:1]):
            lowp = _lowp_weight(kernel, weight, fmt, width)
            if exact(lowp, weight):
                return lowp
    return None

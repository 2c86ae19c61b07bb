"""Matrix-vector products for small batches (1-8 rows): y = x @ W^T (+ bias).

Decode at batch 1 reads every weight once per token, so a projection is bound by the bytes
of W. Each program owns BLOCK_N output columns and streams their rows of W in
[BLOCK_N, BLOCK_K] tiles (few, large tiles keep many loads in flight); the few rows of x
come from L2. No split-K: every output is reduced by one program in a fixed order, so the
result does not depend on scheduling (graph replays equal eager steps).

Two optional fusions, both for the decode step of a Llama-style layer:
- NORM: RMSNorm of (x + residual) computed in the prologue (each program recomputes the
  row's rms from L2; program 0 writes the new residual), so the norm costs no launch;
- SILU_MUL: the weight is gate_up ([gate; up] rows) and the output is silu(gate) * up.

Rounding follows the references step by step (sums and normed values rounded to the
activation dtype where they would be written to memory), so results equal
`rms_norm_ref` + `F.linear` + `silu_and_mul_ref` up to accumulation order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minivllm.kernels.dispatch import (
    HAS_TRITON,
    check_tensor,
    num_sms,
    require_triton,
    tl,
    triton,
)
from minivllm.kernels.pdl import gemv_pdl
from minivllm.kernels.rms_norm import check_norm_inputs, rms_norm_ref
from minivllm.kernels.silu_and_mul import silu_and_mul_ref
from minivllm.kernels.tuning import gemv_max_k_tile, gemv_silu_tile, gemv_wide

MAX_ROWS = 8  # larger batches are matrix-matrix products: cuBLAS


def gemv_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    return F.linear(x, weight, bias)


def rms_norm_gemv_ref(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K] ([2 * inter, K] with silu_mul)
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, N] or [M, N // 2], new residual [M, K])
    normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    y = F.linear(normed, weight, bias)
    return (silu_and_mul_ref(y) if silu_mul else y), (x if residual is None else new_residual)


@triton.jit
def _gemv_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    residual_out_ptr,
    M,
    N,  # output columns (per half of the weight with SILU_MUL)
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    eps,
    BLOCK_M: tl.constexpr,  # >= M; 16 with USE_DOT
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor cores for several rows; else multiply-and-sum
    DOT_PRECISION: tl.constexpr,
    ONE_TILE: tl.constexpr,  # BLOCK_K >= K
    PDL: tl.constexpr,  # launched with programmatic dependent launch (Hopper+)
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    k_range = tl.arange(0, BLOCK_K)
    act_dtype = x_ptr.dtype.element_ty
    if PDL:
        # The next kernel may start once every program got here; it waits for this one
        # to finish (its own gdc_wait) before it reads anything this one writes.
        tl.extra.cuda.gdc_launch_dependents()

    if ONE_TILE:
        # All of K in one tile: W's loads go out first and overlap the norm's prologue
        # and, with PDL, the end of the previous kernel (W is never written).
        w_mask = col_mask[:, None] & (k_range < K)[None, :]
        w_offsets = cols[:, None].to(tl.int64) * stride_wn + k_range[None, :]
        w_first = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        if SILU_MUL:
            w_up_first = tl.load(w_ptr + w_offsets + N * stride_wn, mask=w_mask, other=0.0)
    if PDL:
        # Everything below reads the previous kernels' outputs or writes memory they
        # may still read: wait until they are complete and visible.
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if ONE_TILE:
        # The whole row in one tile: h = x + residual is loaded once and kept for both the
        # rms and the product (one L2 round trip after the wait instead of two).
        x_mask = row_mask[:, None] & (k_range < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k_range[None, :], mask=x_mask,
                    other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + rows[:, None] * stride_rm + k_range[None, :],
                            mask=x_mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(act_dtype)
                writer = (rows * 0 + pid) == 0  # [BLOCK_M]: program 0 writes
                tl.store(residual_out_ptr + rows[:, None] * K + k_range[None, :], x,
                         mask=x_mask & writer[:, None])
            hf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)  # [BLOCK_M]
            nw = tl.load(norm_weight_ptr + k_range, mask=k_range < K, other=0.0).to(tl.float32)
            normed = (hf * rstd[:, None]).to(act_dtype).to(tl.float32)
            x = (normed * nw[None, :]).to(act_dtype)
        if USE_DOT:
            acc += tl.dot(x.to(w_first.dtype), tl.trans(w_first), input_precision=DOT_PRECISION)
            if SILU_MUL:
                acc_up += tl.dot(x.to(w_up_first.dtype), tl.trans(w_up_first),
                                 input_precision=DOT_PRECISION)
        else:
            xf = x.to(tl.float32)
            acc += tl.sum(xf[:, None, :] * w_first.to(tl.float32)[None, :, :], axis=2)
            if SILU_MUL:
                acc_up += tl.sum(xf[:, None, :] * w_up_first.to(tl.float32)[None, :, :], axis=2)
    else:
        if NORM:
            # Pass 1: the rms of each row of h = x + residual (rounded as the reference
            # writes it); program 0 also writes h as the new residual.
            sum_sq = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + k_range
                mask = row_mask[:, None] & (ks < K)[None, :]
                h = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask,
                            other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(residual_ptr + rows[:, None] * stride_rm + ks[None, :],
                                mask=mask, other=0.0)
                    h = (h.to(tl.float32) + r.to(tl.float32)).to(act_dtype)
                    writer = (rows * 0 + pid) == 0  # [BLOCK_M]: program 0 writes
                    tl.store(residual_out_ptr + rows[:, None] * K + ks[None, :], h,
                             mask=mask & writer[:, None])
                hf = h.to(tl.float32)
                sum_sq += tl.sum(hf * hf, axis=1)
            rstd = tl.rsqrt(sum_sq / K + eps)  # [BLOCK_M]
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + k_range
            k_mask = ks < K
            x_mask = row_mask[:, None] & k_mask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask,
                        other=0.0)
            if NORM:
                if HAS_RESIDUAL:
                    r = tl.load(residual_ptr + rows[:, None] * stride_rm + ks[None, :],
                                mask=x_mask, other=0.0)
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(act_dtype)
                nw = tl.load(norm_weight_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
                normed = (x.to(tl.float32) * rstd[:, None]).to(act_dtype).to(tl.float32)
                x = (normed * nw[None, :]).to(act_dtype)
            w_mask = col_mask[:, None] & k_mask[None, :]
            w_offsets = cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
            w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
            if USE_DOT:
                acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision=DOT_PRECISION)
            else:
                xf = x.to(tl.float32)
                acc += tl.sum(xf[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            if SILU_MUL:
                w_up = tl.load(w_ptr + w_offsets + N * stride_wn, mask=w_mask, other=0.0)
                if USE_DOT:
                    acc_up += tl.dot(x.to(w_up.dtype), tl.trans(w_up),
                                     input_precision=DOT_PRECISION)
                else:
                    acc_up += tl.sum(xf[:, None, :] * w_up.to(tl.float32)[None, :, :], axis=2)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[
                None, :
            ]
    if SILU_MUL:
        # The projection's output is rounded before the activation, as when it is written.
        gate = acc.to(act_dtype).to(tl.float32)
        up = acc_up.to(act_dtype).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
    else:
        y = acc
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=out_mask)


def default_config(
    m: int, n: int, k: int, dtype: torch.dtype, sms: int = 132, silu_mul: bool = False
) -> dict:
    return _default_config(m, n, k, dtype, sms, silu_mul, gemv_max_k_tile(), gemv_silu_tile())


@functools.cache
def _default_config(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    sms: int,
    silu_mul: bool,
    max_k_tile: int = 2048,
    silu_tile: int = 4096,
) -> dict:
    """Tiles per shape; `n` counts output columns (half the weight's rows with silu_mul).

    The fastest on an H200 (`scripts/bench_kernels.py`, graph replays):
    - one row: multiply-and-sum in fp32 over ~8K elements of W a program (16 KB: N8 K1024
      or N4 K2048, 4 warps), at least ~2 programs an SM; 16K-element tiles with 8 warps
      were slower;
    - several rows: tensor-core dots with x padded to 16 rows; N32 K256 with 3 stages for
      wide outputs, N16 K512 for outputs of 2048 or fewer (fewer, longer programs lost).
    Several rows use one configuration whatever their number, so a row's result never
    depends on how many rows share the launch. One row's widest K tile is `max_k_tile`
    (kernels/tuning.py): a projection that fits one tile streams its weights before the
    PDL wait; `silu_tile` is the size of each of gate_up's two tiles (8192: half as many
    programs, 8 warps)."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    if m > 1:
        block_n, block_k = (32, 256) if n > 2048 else (16, 512)
        return dict(BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=True, DOT_PRECISION=precision,
                    num_warps=4, num_stages=3)
    block_k = min(triton.next_power_of_2(k), max_k_tile)
    budget = silu_tile if silu_mul else 8192  # elements of W a tile (silu_mul loads two)
    block_n = max(budget // block_k, 1)
    while block_n > 2 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    warps = 8 if silu_mul and block_n * block_k > 4096 else 4
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=False, DOT_PRECISION=precision,
                num_warps=warps, num_stages=1)


# Where the Triton GEMV beats cuBLAS: (row bucket, N, K) -> bool, measured on an H200
# by `python scripts/bench_kernels.py --only decode-fused` (graph replays, weights rotated
# past L2). Shapes not listed follow `_wins_by_default`. One row: every
# projection of the three models but Llama-3.2-1B's gate_up and SmolLM2's LM head
# (K = 576 pads to a 1024 tile). Several rows: the narrow projections (o, down: cuBLAS
# ran at 0.3-0.9 TB/s there) and Qwen3's LM head; cuBLAS keeps the wide ones.
MEASURED_WINS: dict[tuple[int, int, int], bool] = {
    **{(1, n, k): True for n, k in (
        (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),  # Qwen3
        (3072, 2048), (2048, 2048), (2048, 8192), (128256, 2048),  # Llama-3.2-1B
        (960, 576), (576, 576), (3072, 576), (576, 1536),  # SmolLM2-135M
    )},
    (1, 16384, 2048): False,
    (1, 49152, 576): False,
    **{(m, n, k): True for m in (2, 4, 8) for n, k in (
        (1024, 2048), (1024, 3072), (151936, 1024), (2048, 2048), (960, 576), (576, 576),
        (576, 1536),
    )},
    **{(m, n, k): False for m in (2, 4, 8) for n, k in (
        (4096, 1024), (6144, 1024), (3072, 2048), (16384, 2048), (2048, 8192),
        (128256, 2048), (3072, 576), (49152, 576),
    )},
}


def _wins_by_default(m: int) -> bool:
    # Unmeasured shapes: one row is a pure bandwidth problem where the GEMV won on 13 of
    # the 15 measured shapes; several rows are GEMMs cuBLAS mostly handles as well.
    return m == 1


def gemv_wins(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    return _gemv_wins(m, n, k, dtype, gemv_wide())


@functools.cache
def _gemv_wins(m: int, n: int, k: int, dtype: torch.dtype, wide: bool = False) -> bool:
    """Whether `gemv` should replace F.linear for an [m, k] x [n, k]^T product on CUDA.

    Decided per power-of-two row bucket (1, 2, 4, 8: the CUDA-graph buckets), so a batch
    padded to its bucket in a graph and the same batch run eagerly take the same kernel
    (with the same tiles: rows never change another row's sums). fp32 stays on cuBLAS
    (no decode target there; keeps fp32 parity with transformers)."""
    if not HAS_TRITON or dtype not in (torch.bfloat16, torch.float16) or not 1 <= m <= MAX_ROWS:
        return False
    bucket = 1 << (m - 1).bit_length()  # the next power of two
    if bucket > 1 and wide and n <= 16384:
        # MINIVLLM_GEMV_WIDE=1: several rows take the GEMV for every projection, so the
        # layer keeps its norm and SiLU fused (five launches, not eight).
        return True
    return MEASURED_WINS.get((bucket, n, k), _wins_by_default(bucket))


def _launch(x, residual, norm_weight, weight, bias, out, residual_out, n, eps, config, *,
            norm, silu_mul) -> None:
    m, k = x.shape
    cfg = dict(config or default_config(m, n, k, x.dtype, num_sms(x.device), silu_mul))
    explicit = cfg.pop("PDL", None)  # tests and benchmarks may force it either way
    pdl = gemv_pdl(x.device) if explicit is None else explicit
    block_n = cfg.pop("BLOCK_N")
    use_dot = cfg["USE_DOT"]
    block_m = 16 if use_dot else max(1, triton.next_power_of_2(m))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        x if residual is None else residual,
        weight if norm_weight is None else norm_weight,
        weight,
        weight if bias is None else bias,
        out,
        out if residual_out is None else residual_out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NORM=norm,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        ONE_TILE=cfg["BLOCK_K"] >= k,
        PDL=pdl,
        **cfg,
        **({"launch_pdl": True} if pdl else {}),
    )


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tensor("x", x, 2)
    check_tensor("weight", weight, 2, (x.dtype,), device=x.device)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not take x {tuple(x.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got x {tuple(x.shape)}")
    if bias is not None:
        check_tensor("bias", bias, 1, device=x.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} elements for {weight.shape[0]} outputs")


def gemv(
    x: torch.Tensor,  # [M, K], M <= 8
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: dict | None = None,
    check: bool = True,
) -> torch.Tensor:  # [M, N]
    """Triton version of `gemv_ref` (fp32 accumulation); `config` overrides the tiles.
    `check=False` skips the input checks (an engine checks each kernel's first launch)."""
    if check:
        require_triton()
        _check(x, weight, bias)
    n = weight.shape[0]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _launch(x, None, None, weight, bias, out, None, n, 0.0, config, norm=False, silu_mul=False)
    return out


def rms_norm_gemv(
    x: torch.Tensor,  # [M, K], M <= 8
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K] ([2 * inter, K] with silu_mul)
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: dict | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (out, new residual)
    """Triton version of `rms_norm_gemv_ref`: one launch for add + RMSNorm + projection
    (+ SiLU-and-mul). The new residual is a new tensor (x when residual is None).
    `check=False` skips the input checks (an engine checks each kernel's first launch)."""
    m, k = x.shape
    n = weight.shape[0]
    if check:
        require_triton()
        _check(x, weight, bias)
        check_norm_inputs(x, "norm_weight", norm_weight, residual)
        if silu_mul and n % 2:
            raise ValueError(f"silu_mul needs an even number of outputs (gate, up), got {n}")
    if silu_mul:
        n //= 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    _launch(x, residual, norm_weight, weight, bias, out, residual_out, n, eps, config,
            norm=True, silu_mul=silu_mul)
    return out, (x if residual_out is None else residual_out)

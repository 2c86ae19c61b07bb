"""Kernels: each file holds one Triton kernel, its Python wrapper and the pure-torch
reference it is tested against. The references are also the CPU path of the engine.
Device code several kernels share (the attention tile step) is in attention_tile.py.

Paged KV cache layout (one pool per layer):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens] int, slot = block_id * block_size + offset; -1 = skip
    block_tables:     [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens:         [num_seqs] int32, context length including this step's tokens
    cu_seqlens_q:     [num_seqs + 1] int32, prefix sums of this step's query lengths;
                      sequence i's queries sit at the last q_len_i positions of its context
"""

if __name__ == "kernels":
    # This folder installs as `minivllm.kernels`. It is imported as a bare `kernels` only
    # when a minivllm clone's root is on sys.path (`python -m ...` run from the clone), and
    # that name belongs to Hugging Face's package, which transformers imports when it is
    # installed. Hand the name over to the installed package, or fail as its absence would.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _clone = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _clone]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _real = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _real  # what `import kernels` returns once this file ends
    _spec.loader.exec_module(_real)

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

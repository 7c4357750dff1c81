"""Test-only stand-in for SGLang's kernel package `sgl_kernel`, in pure torch; never shipped in shardprep.

SGLang's CPU path imports `sgl_kernel` at module level (`srt/mem_cache/allocation.py`), and no CPU build of it is
published (sglang-kernel 0.4.10 and sgl-kernel 0.3.21: CUDA wheels only, no sdist), so without this module SGLang
does not start on a CPU machine at all. On the tiny models of tests/sglang_engines/ with
`attention_backend="torch_native"`, the only kernel SGLang calls is `assign_req_to_token_pool_cpu`, written here
from what SGLang's Triton kernel of the same name does (`assign_req_to_token_pool` in the same file). The other
names below are imported at module level by SGLang's CPU path (KV-cache moves, speculative decoding) and never
called by these engines: each raises if it ever is, so a test cannot pass on a kernel that does nothing. The engine
runner (sglang_runs.py) puts this folder on PYTHONPATH; nothing else does.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Write each request's new KV-cache slots into its `req_to_token` row: request i's slots
    `out_cache_loc[sum of the earlier requests' lengths:][:end_offset[i] - start_offset[i]]` go to
    `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]` (`pool_len`, the row length, is implied by
    `req_to_token` here).

    >>> pool = torch.zeros(2, 4, dtype=torch.int32)
    >>> assign_req_to_token_pool_cpu(torch.tensor([1]), pool, torch.tensor([1]), torch.tensor([3]),
    ...                              torch.tensor([7, 8]), 4)
    >>> pool[1].tolist()
    [0, 7, 8, 0]
    """
    del pool_len
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[at:at + end - start].to(req_to_token.dtype)
        at += end - start


def not_stood_in(name: str):
    """A kernel SGLang imports but these tests never run: calling it raises, naming it."""
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no stand-in in tests/sglang_engines/stand_ins/sgl_kernel.py")
    kernel.__name__ = name
    return kernel


# Imported at module level on the CPU (kernels/ops/kvcache/cache_move.py, kernels/ops/speculative/*.py).
copy_all_layer_kv_cache_cpu = not_stood_in("copy_all_layer_kv_cache_cpu")
rotate_input_ids_cpu = not_stood_in("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = not_stood_in("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = not_stood_in("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = not_stood_in("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = not_stood_in("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = not_stood_in("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = not_stood_in("verify_tree_greedy_cpu")

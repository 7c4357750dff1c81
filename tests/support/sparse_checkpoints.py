"""Checkpoints at their published size whose data is a hole: real safetensors headers over sparse files.

Only the JSON headers are written (by this file, in the safetensors format: an 8-byte length, the JSON
padded with spaces to a multiple of 8); each file is then extended to its full size with `truncate`, so
it takes a few kilobytes of disk. Tests on them read headers only: no test may read or write their data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}

DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
"""DeepSeek-V3's config.json as published (deepseek-ai/DeepSeek-V3), the fields that shape its tensors."""


def deepseek_v3_tensors(c: dict) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """Every tensor of a DeepSeek-V3 checkpoint with config `c`, by file: {file: {name: (dtype, shape)}}.

    One file per decoder layer (the MTP layer, index num_hidden_layers, included) plus one for the embedding,
    the final norm and the head. Linear weights are block FP8 with an F32 `weight_scale_inv` per 128×128
    block, as published (BF16 without scales when `c` has no quantization_config); norms, the router, the
    embedding, the head and the MTP layer's eh_proj are BF16.
    """
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    quantized = "quantization_config" in c
    block = c["quantization_config"]["weight_block_size"][0] if quantized else 0
    bf16 = "BF16"

    def fp8(name: str, rows: int, cols: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        if not quantized:
            return {f"{name}.weight": (bf16, (rows, cols))}
        return {f"{name}.weight": ("F8_E4M3", (rows, cols)),
                f"{name}.weight_scale_inv": ("F32", (math.ceil(rows / block), math.ceil(cols / block)))}

    def mlp(prefix: str, inter: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {**fp8(f"{prefix}.gate_proj", inter, h), **fp8(f"{prefix}.up_proj", inter, h),
                **fp8(f"{prefix}.down_proj", h, inter)}

    total = layers + c["num_nextn_predict_layers"]
    files: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    name = f"model-{{:05d}}-of-{total + 1:05d}.safetensors"
    files[name.format(1)] = {"model.embed_tokens.weight": (bf16, (c["vocab_size"], h)),
                             "model.norm.weight": (bf16, (h,)), "lm_head.weight": (bf16, (c["vocab_size"], h))}
    for i in range(total):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out = {f"{p}input_layernorm.weight": (bf16, (h,)), f"{p}post_attention_layernorm.weight": (bf16, (h,)),
               **fp8(f"{a}q_a_proj", c["q_lora_rank"], h), f"{a}q_a_layernorm.weight": (bf16, (c["q_lora_rank"],)),
               **fp8(f"{a}q_b_proj", heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]), c["q_lora_rank"]),
               **fp8(f"{a}kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
               f"{a}kv_a_layernorm.weight": (bf16, (c["kv_lora_rank"],)),
               **fp8(f"{a}kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
               **fp8(f"{a}o_proj", h, heads * c["v_head_dim"])}
        if i < c["first_k_dense_replace"]:
            out |= mlp(f"{p}mlp", c["intermediate_size"])
        else:
            experts = c["n_routed_experts"]
            out |= {f"{p}mlp.gate.weight": (bf16, (experts, h)),
                    f"{p}mlp.gate.e_score_correction_bias": ("F32", (experts,))}
            out |= mlp(f"{p}mlp.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"])
            for e in range(experts):
                out |= mlp(f"{p}mlp.experts.{e}", c["moe_intermediate_size"])
        if i >= layers:  # the MTP layer's own modules around its decoder layer
            out |= {f"{p}embed_tokens.weight": (bf16, (c["vocab_size"], h)), f"{p}enorm.weight": (bf16, (h,)),
                    f"{p}hnorm.weight": (bf16, (h,)), f"{p}eh_proj.weight": (bf16, (h, 2 * h)),
                    f"{p}shared_head.norm.weight": (bf16, (h,)),
                    f"{p}shared_head.head.weight": (bf16, (c["vocab_size"], h))}
        files[name.format(i + 2)] = out
    return files


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPE_BYTES[dtype] * math.prod(shape)


def write_sparse_file(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """A safetensors file of `tensors` whose data region is a hole; returns its size."""
    header, at = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + at)
    return 8 + len(raw) + at


def write_sparse_checkpoint(directory: Path, config: dict,
                            files: dict[str, dict[str, tuple[str, tuple[int, ...]]]]) -> Path:
    """config.json, the index and every file of `files` as a sparse safetensors file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for file, tensors in files.items():
        write_sparse_file(directory / file, tensors)
    weight_map = {name: file for file, tensors in files.items() for name in tensors}
    total = sum(nbytes(*t) for tensors in files.values() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return directory

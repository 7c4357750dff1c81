"""KV-cache bytes per token from the config.json that transformers writes, and what a saving buys."""

import json

import pytest

from shardprep.errors import SourceError
from shardprep.planning.accounting import account_layers
from shardprep.planning.capacity import capacity
from shardprep.planning.kv_cache import kv_cache_shape


def config_of(checkpoint_cache, arch):
    return json.loads((checkpoint_cache(arch) / "config.json").read_text())


def test_grouped_query_attention_keeps_keys_and_values_of_every_kv_head(checkpoint_cache):
    c = config_of(checkpoint_cache, "llama")
    kv = kv_cache_shape(c)
    assert kv.kind == "mha" and kv.dtype_bytes == 2
    assert kv.bytes_per_token == c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2


def test_mla_keeps_the_latent_and_the_rotary_key(checkpoint_cache):
    c = config_of(checkpoint_cache, "deepseek-v3")
    kv = kv_cache_shape(c)
    assert kv.kind == "mla"
    assert kv.bytes_per_token == c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2


def test_fp8_kv_cache_halves_the_bytes_and_an_unknown_dtype_is_refused(checkpoint_cache):
    c = config_of(checkpoint_cache, "qwen3-moe")
    assert kv_cache_shape(c, "fp8").bytes_per_token * 2 == kv_cache_shape(c).bytes_per_token
    with pytest.raises(SourceError, match="KV-cache dtype 'int3' is unknown"):
        kv_cache_shape(c, "int3")


def test_encoder_only_models_keep_no_kv_cache(checkpoint_cache):
    assert kv_cache_shape(config_of(checkpoint_cache, "bert")) is None


def test_a_multimodal_wrapper_is_sized_from_its_text_config(checkpoint_cache):
    text = config_of(checkpoint_cache, "llama")
    wrapper = {"architectures": ["LlavaForConditionalGeneration"], "text_config": text}
    assert kv_cache_shape(wrapper).bytes_per_token == kv_cache_shape(text).bytes_per_token


def test_saved_memory_becomes_tokens_and_requests():
    kv = kv_cache_shape({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80, "num_attention_heads": 64,
                         "num_key_value_heads": 8, "hidden_size": 8192, "torch_dtype": "bfloat16"})
    memory = account_layers([416 * 1 << 20] * 80, world_size=8)  # about Llama-70B's attention per layer
    cap = capacity(memory, kv, replicated_part_bytes=10 << 30, context_len=4096, hbm_bytes=141 * 10**9)
    assert cap.kv_tokens == memory.saved_bytes // kv.bytes_per_token
    assert cap.extra_requests == cap.kv_tokens // 4096
    assert cap.startup_peak_bytes == memory.resident_bytes + (10 << 30)
    assert cap.kv_room_sharded_bytes - cap.kv_room_replicated_bytes == memory.saved_bytes


@pytest.mark.parametrize("arch, attention_layers", [("kimi-linear", 1), ("kimi-k3", 1)])
def test_linear_attention_layers_keep_no_per_token_cache(checkpoint_cache, arch, attention_layers):
    # Three layers, of which layer 2 is MLA and the others KDA (a fixed state per request): transformers' Kimi-Linear
    # names them in layer_types, vLLM's Kimi K3 config in linear_attn_config.full_attn_layers.
    c = json.loads((checkpoint_cache(arch, layers=3) / "config.json").read_text())
    kv = kv_cache_shape(c)
    assert (kv.kind, kv.layers) == ("mla", attention_layers)
    assert kv.bytes_per_token == attention_layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2

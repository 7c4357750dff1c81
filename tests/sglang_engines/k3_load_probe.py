"""Test-only SGLang plugin: inside an engine's scheduler processes, load Kimi K3 every way the tests compare (SGLang's
own loader, shardprep's full mode, its sharded mode), record what they hold, and stop the engine; never shipped.

K3's forward does not run on this CPU (its KDA and short-convolution kernels are Triton), so a K3 engine cannot
serve a token, and the tests compare K3 by loading and binding. What they need is SGLang's own processes under DP
attention: its parallel state, its server arguments, its loaders. One engine (tp_size=2, dp_size=2,
enable_dp_attention) is started on K3 as published, with SGLang's own loader; where SHARDPREP_TEST_K3_PROBE names a
plan, an AFTER hook on `ModelRunner.load_model` then runs `probe` in each scheduler process (DP rank), which builds
and loads the other models with SGLang's `get_model_loader` as SGLang's model runner does, writes the rank's results
(`plan["results"]` with the rank), waits for the other rank, and raises, so the engine stops before it sizes a KV
pool for a model that cannot run (the runner's `refusal` run notes the scheduler's failure).

PLAN: {"results": path with {rank}, "published": {"full", "sharded", "refused"}, "text": {"source", "full",
"sharded"}}: output directories (`refused`: one whose targets SGLang splits over TP). Declared by the engine runner
(sglang_runs.py); `write_published` writes K3 as published, for the tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

NAME = "shardprep_test_k3_load_probe"
ENV = "SHARDPREP_TEST_K3_PROBE"
TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"

TINY_VISION = {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
               "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 32,
               "vt_intermediate_size": 64, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2]}
"""A tiny K3 vision tower (MoonViT3d) and projector; K3's other vision settings as SGLang's defaults."""


class ProbeDone(RuntimeError):
    """Raised once the results are written: the engine must not go on to serve a model whose forward cannot run."""


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`); does nothing without a probe plan."""
    if not os.environ.get(ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, after_load, HookType.AFTER)


def after_load(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """The AFTER hook: probe, write this rank's results, wait for the other rank, stop."""
    plan = json.loads(Path(os.environ[ENV]).read_text())
    rank = torch.distributed.get_rank()
    Path(plan["results"].format(rank=rank)).write_text(json.dumps(probe(runner, plan)))
    torch.distributed.barrier()  # both ranks' results are written before either scheduler fails
    raise ProbeDone("k3_load_probe: results written; K3's forward cannot run on the CPU, so the engine stops here")


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def held(model: torch.nn.Module) -> dict[str, bytes]:
    """Every parameter's bytes under each of its names (K3 keeps f_b_proj's weight as `_bfa_f_b_w` too), and each
    KDA layer's merged [f_a; b] buffer (`<module>._bfa_w`), which its forward reads instead of f_a_proj and b_proj."""
    state = {name: as_bytes(p) for name, p in model.named_parameters(remove_duplicate=False)}
    state |= {f"{name}._bfa_w": as_bytes(m._bfa_w) for name, m in model.named_modules()
              if getattr(m, "_bfa_w", None) is not None}
    return state


def probe(runner: Any, plan: dict) -> dict[str, Any]:
    """SGLang's own model (the engine's: K3 as published) against full and sharded mode, then the text layout's."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.runtime_context import get_parallel

    def load(path: str, load_format: str = "auto", extra: dict | None = None) -> tuple[torch.nn.Module, Any]:
        model_config = adjust_config_with_unaligned_cpu_tp(ModelConfig.from_server_args(
            runner.server_args, model_path=path), runner.load_config, get_parallel().tp_size)
        loader = get_model_loader(LoadConfig(load_format=load_format, model_loader_extra_config=extra or {}))
        return loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu")), loader

    def refusal(path: str) -> str | None:
        try:
            load(path, "shardprep", {"shard_weights": True})
        except Exception as exc:  # the loader's refusal, as SGLang would report it
            return f"{type(exc).__name__}: {exc}"
        return None

    results: dict[str, Any] = {}
    for layout, own in (("published", runner.model), ("text", None)):
        paths = plan[layout]
        if own is None:
            own = load(paths["source"])[0]
        ref = held(own)
        got = held(load(paths["full"], "shardprep")[0])
        results[layout] = {
            "class": type(own).__name__, "parameters": sum(1 for _ in own.named_parameters()),
            "vision_parameters": sum(n.startswith(("vision_tower.", "mm_projector.")) for n, _ in
                                     own.named_parameters()),
            "merged_buffers": sum(n.endswith("._bfa_w") for n in ref),
            "full_mode_differs": sorted(n for n in ref.keys() | got.keys() if ref.get(n) != got.get(n)),
            "sharded": sharded(*load(paths["sharded"], "shardprep", {"shard_weights": True}), paths["sharded"], ref),
        }
    results["published"]["refused"] = refusal(plan["published"]["refused"])
    return results


def sharded(model: torch.nn.Module, loader: Any, directory: str, ref: dict[str, bytes]) -> dict[str, Any]:
    """What sharded mode bound, and whether after each layer's gather every bound target, and every merged buffer
    SGLang's forward reads, holds `ref`'s bytes (SGLang's own loader's); the replicated parameters too."""
    from shardprep.integrations.sharded_load import startup_line

    binding = loader.binding
    # A parameter's module name (the last of its names: K3 lists f_b_proj's weight as `_bfa_f_b_w` first).
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    bound = {id(p) for p in binding.target_parameters.values()}
    merged = {name: m for name, m in model.named_modules()
              if getattr(m, "_bfa_w", None) is not None and id(m.f_a_proj.weight) in bound}
    gathered: dict[str, bool] = {}
    merged_equal: dict[str, bool] = {}
    gatherer = binding.gatherer
    gatherer.begin()
    for layer in gatherer.layers:
        gatherer.wait(layer)
        for target, param in binding.target_parameters.items():
            if f".{layer}." in target and target not in gathered:
                gathered[target] = as_bytes(param) == ref[names[id(param)]]
        for name, module in merged.items():
            if f".{layer}." in f"{name}.":
                merged_equal[name] = as_bytes(module._bfa_w) == ref[f"{name}._bfa_w"]
        gatherer.done(layer)
    return {
        "startup_line": startup_line(binding, directory),
        "bound": {target: names[id(p)] for target, p in binding.target_parameters.items()},
        "built_without_storage": sorted(name for name, _ in loader.target.built),
        "gathered_equal": gathered,
        "merged_equal": merged_equal,
        "merged_over_gathered_bytes": sorted(name for name, m in merged.items()
                                             if m._bfa_w.data_ptr() == m.f_a_proj.weight.data_ptr()),
        "replicated_differs": sorted(name for name, p in model.named_parameters(remove_duplicate=False)
                                     if id(p) not in bound and as_bytes(p) != ref[name]),
        "local_chunk_bytes": sum(binding.shards.chunk(layer).numel() for layer in gatherer.layers),
        "slot_bytes": gatherer.slot_bytes,
        "gathered_layers": list(gatherer.layers),
    }


def write_published(text: Path, directory: Path) -> None:
    """Kimi K3 in its published layout, as SGLang 0.5.23 reads it: config.json by SGLang's `KimiK3Config` around
    `text`'s config, the vision tower and projector built by SGLang's own classes (`KimiK3VisionTower`,
    `KimiK3MultiModalProjector`: `vision_tower.*`, `mm_projector.proj.0/2`, `mm_projector.post_norm`, the names
    SGLang loads them by), random, and `text`'s tensors under `language_model.*`, its decoder layers as
    `language_model.layers.N` (SGLang's `hf_to_sglang_mapper` maps them to `language_model.model.layers.N`, and
    `block_sparse_moe` to `mlp`), as tests/vllm_engines/k3_loading.py writes K3 for vLLM."""
    from safetensors.torch import load_file, save_file
    from sglang.srt.configs.kimi_k3 import KimiK3Config
    from sglang.srt.models.kimi_k3_vl import KimiK3MultiModalProjector, KimiK3VisionTower

    directory.mkdir(parents=True)
    text_config = json.loads((text / "config.json").read_text())
    config = KimiK3Config(text_config=text_config, vision_config=TINY_VISION, media_placeholder_token_id=127,
                          architectures=["KimiK3ForConditionalGeneration"], torch_dtype="bfloat16")
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for prefix, module in (("vision_tower.", KimiK3VisionTower(config.vision_config)),
                           ("mm_projector.", KimiK3MultiModalProjector(config.vision_config))):
        for name, p in module.named_parameters():
            tensors[prefix + name] = (torch.randn(p.shape, generator=generator) * 0.02).to(torch.bfloat16)
    for name, t in load_file(text / "model.safetensors").items():
        tensors["language_model." + (name.removeprefix("model.") if name.startswith("model.layers.") else name)] = t
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for tokenizer_file in text.glob("tokenizer*"):
        (directory / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    for extra in ("special_tokens_map.json", "generation_config.json"):
        if (text / extra).exists():
            (directory / extra).write_bytes((text / extra).read_bytes())

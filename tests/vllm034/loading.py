"""shardprep's loading on vLLM 0.34.0's own wheel (tests/vllm034/shims.py), one process for every model: each model
is built on the CPU as vLLM's worker builds it and loaded three ways, then every parameter's bytes are compared.

- vLLM's own `DefaultModelLoader` on the source checkpoint: the reference;
- shardprep's full mode on a two-rank convert output (`create_model`, `load_weights`);
- shardprep's sharded mode on a one-rank convert output (DP=1, one process: `load_model`, vLLM's post-load
  processing and the loader's checks after it included), then every layer gathered and its bound targets read.

Models: Qwen3-MoE; DeepSeek-V3 (MLA) with its MTP draft (`deepseek_mtp`); Kimi K3 (text model, KDA and MLA; vLLM
0.34 pads its fused KDA projection `in_proj_qkvgfab` to a multiple of 16 rows); a DFlash draft on Qwen3-MoE. A draft
is built and loaded after its target, as vLLM's proposer does (`k3_loading.build_draft`).

`python tests/vllm034/loading.py PLAN.json RESULTS.json` inside the vLLM 0.34 venv (test_vllm034_loading.py starts
it). PLAN: {"port", "models": [{"name", "source", "full", "sharded", "spec": speculative_config or null,
"draft": {"source", "full", "sharded"} or null, "own_load_weights": see `reference`}]}. RESULTS, per model name:
parameter counts, the names whose bytes differ (full mode; sharded mode's resident parameters), the bound targets
and whether each gathered target equals the reference, for the target and its draft; or the model's error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import shims

shims.apply()  # before anything imports vLLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_engines"))
import torch  # noqa: E402
from k3_loading import as_bytes, build, build_draft, keep_kv_b_proj_weight  # noqa: E402


def engine_config(model: str, load_format: str, spec: dict | None, sharded: bool = False):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0,
                      enable_prefix_caching=False, skip_tokenizer_init=True, load_format=load_format,
                      model_loader_extra_config={"shard_weights": True} if sharded else {},
                      **({"speculative_config": spec} if spec else {}))
    return args.create_engine_config()


def differs(ref: dict[str, bytes], got: dict[str, bytes], names: set[str] | None = None) -> list[str]:
    """The parameters (all, or `names`) whose bytes differ, or that one side lacks."""
    names = ref.keys() | got.keys() if names is None else names
    return sorted(n for n in names if ref.get(n) != got.get(n))


def model_bytes(model: torch.nn.Module, draft: bool = False) -> dict[str, bytes]:
    """Every parameter's bytes, by name; but a `draft`'s parameters that vLLM replaces with the target's after
    loading (DFlash's embed_tokens and lm_head, when its checkpoint has none: `VllmAdapter._shared_with_target`): no
    loader fills them, so their bytes are whatever memory the constructor got. Drafts only: a target that supports
    EAGLE (Qwen3-MoE) inherits `has_own_lm_head = False` too, and its embedding and head are loaded and compared."""
    from shardprep.integrations.vllm.adapter import VllmAdapter

    shared = set(VllmAdapter._shared_with_target(model)) if draft else set()
    return {name: as_bytes(p) for name, p in model.named_parameters() if name not in shared}


def reference(source: str, spec: dict | None, own_load_weights: bool) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """vLLM's own loader on the source checkpoint: the target's bytes, and the draft's (empty without one).

    `own_load_weights`: the target's own `load_weights` on vLLM's loader's tensors, without the loader's check that
    every parameter was filled. Kimi K3 needs it on 0.34: its fused KDA projection carries pad rows as a seventh
    output (`in_proj_padding`, kda.py), which no checkpoint tensor fills, so vLLM's loader refuses its own model
    ("weights were not initialized from checkpoint: ...in_proj_qkvgfab.weight.6"); the constructor zeroes them.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import DefaultModelLoader
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = engine_config(source, "safetensors", spec)
    loader = DefaultModelLoader(config.load_config)
    if own_load_weights:
        with set_current_vllm_config(config):
            with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
                model = loader.create_model(config, config.model_config)
            model.load_weights(loader.get_all_weights(config.model_config, model))
        target = model_bytes(model)
    else:
        target = model_bytes(build(config, loader, full_load=False))
    draft = model_bytes(build_draft(config, full_load=False)[0], draft=True) if spec else {}
    return target, draft


def full_mode(case: dict, spec: dict | None) -> tuple[dict[str, bytes], dict[str, bytes]]:
    from shardprep.integrations.vllm.model_loader import ShardprepModelLoader

    config = engine_config(case["full"], "shardprep", spec)
    target = model_bytes(build(config, ShardprepModelLoader(config.load_config), full_load=False))
    draft = model_bytes(build_draft(config, full_load=False)[0], draft=True) if spec else {}
    return target, draft


def sharded_mode(case: dict, spec: dict | None, ref: dict[str, dict[str, bytes]]) -> dict[str, Any]:
    """Sharded mode through `load_model` (the target, then its draft), every layer gathered in order: what each
    target bound to, whether its gathered bytes equal the reference, and the non-targets that differ."""
    from shardprep.integrations.vllm.model_loader import ShardprepModelLoader

    config = engine_config(case["sharded"], "shardprep", spec, sharded=True)
    loader = ShardprepModelLoader(config.load_config)
    models = {"target": build(config, loader, full_load=True)}
    if spec:
        models["draft"] = build_draft(config, full_load=True)[0]
    binding = loader.binding
    assert binding is not None
    names = {id(p): (role, name) for role, model in models.items() for name, p in model.named_parameters()}
    bound = {**binding.target_parameters, **binding.draft_parameters}
    by_layer = {bound_layer.index: bound_layer.params for bound_layer in [*binding.layers, *binding.draft_layers]}
    gathered: dict[str, bool] = {}
    gatherer = binding.gatherer
    gatherer.begin()
    for layer in gatherer.layers:
        gatherer.wait(layer)  # the layer's targets now view its gathered bytes, until done(layer)
        for param, name in by_layer[layer]:
            role, model_name = names[id(param)]
            gathered[name] = as_bytes(param) == ref[role][model_name]
        gatherer.done(layer)
    # Every reference parameter not bound is resident: compared as is. What vLLM's post-load processing adds
    # (MLA's W_UK_T and W_UV, made from the resident kv_b_proj) the reference, loaded without it, has not.
    bound_names = {names[id(p)] for p in bound.values()}
    got = {role: model_bytes(model, draft=role == "draft") for role, model in models.items()}
    resident = {role: differs(ref[role], got[role], {n for n in ref[role] if (role, n) not in bound_names})
                for role in models}
    added = {role: sorted(n for n in got[role] if n not in ref[role]) for role in models}
    # Kimi K3's fused KDA projections and their pad rows (vLLM 0.34 pads each to a multiple of 16 rows).
    padded = {f"{name}.in_proj_qkvgfab.weight": module.in_proj_padding
              for name, module in models["target"].named_modules() if getattr(module, "in_proj_padding", 0)}
    return {"bound": {name: list(names[id(p)]) for name, p in bound.items()}, "gathered_equal": gathered,
            "padded_rows": padded,
            "gathered_layers": list(gatherer.layers), "resident_differs": resident, "added_after_loading": added}


def check(case: dict) -> dict[str, Any]:
    spec = case["spec"]
    if spec and case["draft"]:
        spec = {**spec, "model": case["draft"]["source"]}
    ref_target, ref_draft = reference(case["source"], spec, case.get("own_load_weights", False))
    full_spec = {**spec, "model": case["draft"]["full"]} if spec and case["draft"] else spec
    got_target, got_draft = full_mode(case, full_spec)
    sharded_spec = {**spec, "model": case["draft"]["sharded"]} if spec and case["draft"] else spec
    return {"parameters": len(ref_target), "draft_parameters": len(ref_draft),
            "full_mode_differs": differs(ref_target, got_target),
            "draft_full_mode_differs": differs(ref_draft, got_draft),
            "sharded": sharded_mode(case, sharded_spec, {"target": ref_target, "draft": ref_draft})}


def main(plan_path: str, results_path: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    plan = json.loads(Path(plan_path).read_text())
    keep_kv_b_proj_weight()
    first = plan["models"][0]
    with set_current_vllm_config(engine_config(first["source"], "safetensors", None)):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{plan['port']}")
        initialize_model_parallel(1, 1)
    results: dict[str, Any] = {}
    for case in plan["models"]:
        try:
            results[case["name"]] = check(case)
        except Exception as exc:  # one model's failure is reported by name; the others still run
            results[case["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
        Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

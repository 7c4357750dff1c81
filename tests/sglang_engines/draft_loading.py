"""Build SGLang 0.5.23's target and draft models on the CPU, without an engine, as its scheduler does, and load
them: with SGLang's own loader from the source checkpoints, with shardprep's full mode, and with its sharded mode;
then gather every bound layer (the target's and the draft's) and read the bound parameters' bytes.

`python tests/sglang_engines/draft_loading.py PLAN.json RESULTS.json` (inside the SGLang virtual environment), one
process per DP rank (the test starts them, test_sglang_drafts.py). Both ranks run the plan's runs in the same order.

No engine and no forward: no SGLang draft runs a forward on the CPU (a NextN/EAGLE draft needs an attention backend
of EAGLE's: "EAGLE is not supported in attention backend torch_native"; DFlash's draft attention is a GPU backend's),
and an engine would stop there after its load, at a cost of 20-60 s per engine on two cores. So each process does
what SGLang's scheduler process does up to its draft worker (`Scheduler.__init__`, `run_scheduler_process`):
`publish` the ServerArgs as the scheduler's (its rank placement under DP attention: DP rank = TP rank), build the
parallel groups once (`bootstrap.init_parallel_runtime`, gloo on the CPU through the test plugin gloo_groups.py),
size the model's DP buffers (`bootstrap.init_layer_runtime`), build the target worker (`TpModelWorker`: its
ModelRunner builds the LoadConfig and calls the load format's loader) and then the draft worker the speculative
algorithm names (`create_worker`: EAGLEWorkerV2 for NEXTN, DFlashWorkerV2 for DFLASH; each builds its draft's
ModelRunner with `is_draft_worker`, SGLang's draft load format and model path). It stops before the KV pools and
attention backends. Each run publishes its own ServerArgs (SGLang's last-publish-wins), on the groups of the first.

The DFLASH runs need the test plugin dflash_on_cpu.py (SGLang refuses DFLASH on the CPU while it resolves its
arguments), declared by the test, only to build and load.

PLAN: {"layout" (ServerArgs: tp_size = dp_size, enable_dp_attention), "dp_rank", "port", "runs": [{"name",
"model", "algorithm" (NEXTN | DFLASH), "draft" (DFLASH: the draft's path), "load_format", "sharded",
"draft_load_format" (optional)}]}. RESULTS: {run name: what `record` returns, or {"error": "Type: message"}}.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

BASE = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True, "dtype": "bfloat16",
        "context_length": 128, "max_running_requests": 8, "random_seed": 0, "skip_tokenizer_init": True,
        "disable_radix_cache": True, "mem_fraction_static": 0.3, "max_total_tokens": 4096}
"""What every run shares with the engine tests' (sglang_runs.py BASE): the CPU, torch-native attention, eager, bf16."""
SPECULATIVE = {
    "NEXTN": {"speculative_algorithm": "NEXTN", "speculative_num_steps": 1, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 2},
    # SGLang's DFlash under DP attention requires the LM head per DP rank (its draft borrows the target's head).
    "DFLASH": {"speculative_algorithm": "DFLASH", "enable_dp_lm_head": True},
}
KV_INPUT_ROWS = 3
"""Rows of the hidden states each DFlash layer's context K/V projection is computed on (`kv_proj_only`)."""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:32]


class Lines(logging.Handler):
    """Collects what shardprep logs (its startup lines) while a run loads."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def build(run: dict, dp: tuple[dict, int, int], first: bool) -> tuple[Any, Any]:
    """The target worker and the speculative worker of `run`, built as SGLang's scheduler builds them, on this DP
    rank of `dp` (the layout: tp_size = dp_size under DP attention; the rank; the rendezvous port)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.runtime_context import SpawnRanks, get_resources, get_spec, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    layout, rank, port = dp
    kwargs: dict[str, Any] = {**BASE, **layout, **SPECULATIVE[run["algorithm"]], "model_path": run["model"],
                              "load_format": run["load_format"]}
    if run.get("draft"):
        kwargs["speculative_draft_model_path"] = run["draft"]
    if run.get("draft_load_format"):
        kwargs["speculative_draft_load_format"] = run["draft_load_format"]
    if run.get("sharded"):
        kwargs["model_loader_extra_config"] = json.dumps({"shard_weights": True})
    args = ServerArgs(**kwargs)
    # What run_scheduler_process does under DP attention: DP rank = TP rank, one rank per process.
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=rank, gpu_id=rank))
    if first:
        bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=port)
    else:  # a scheduler process sets these once; one engine after another in a process sets them again
        get_resources().expert_location_metadata = None
        get_resources().expert_distribution_recorder = None
    bootstrap.init_layer_runtime(model_config=ModelConfig.from_server_args(args))
    target = TpModelWorker(server_args=args, gpu_id=rank, nccl_port=port)
    algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    worker = algorithm.create_worker(args)(server_args=args, gpu_id=rank, nccl_port=port, target_worker=target)
    return target, worker


def draft_runner(worker: Any) -> Any:
    """The draft's ModelRunner inside SGLang's speculative worker (EAGLEWorkerV2's or DFlashWorkerV2's)."""
    inner = getattr(worker, "draft_worker", None)
    return inner.draft_runner if inner is not None else worker.draft_model_runner


def kv_projections(model: torch.nn.Module) -> dict[str, str]:
    """For a DFlash draft: each layer's context K/V projection (`self_attn.kv_proj_only`, what SGLang's DFlash worker
    computes for the target's hidden states before the draft's layers run), on fixed hidden states; {} otherwise."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not hasattr(layers[0].self_attn, "kv_proj_only"):
        return {}
    hidden = torch.randn(KV_INPUT_ROWS, model.config.hidden_size, generator=torch.Generator().manual_seed(5)
                         ).to(torch.bfloat16)
    out = {}
    for i, layer in enumerate(layers):
        k, v = layer.self_attn.kv_proj_only(hidden)
        out[f"layers.{i}"] = digest(torch.cat([k, v], dim=-1))
    return out


def record(target: Any, worker: Any, lines: list[str]) -> dict[str, Any]:
    """What the test asserts on: every parameter's bytes (a digest) of the target and the draft, and in sharded mode
    what each bound parameter holds after its layer's gather, in gather order (the target's layers, then the
    draft's), what was bound, built without storage, and the startup lines."""
    runner = draft_runner(worker)
    models = {"target": target.model_runner.model, "draft": runner.model}
    loaders = {"target": target.model_runner.loader, "draft": runner.loader}
    names = {id(p): (role, name) for role, model in models.items() for name, p in model.named_parameters()}
    result: dict[str, Any] = {
        "classes": {role: type(model).__name__ for role, model in models.items()},
        "parameters": {role: {name: digest(p) for name, p in model.named_parameters()}
                       for role, model in models.items()},
        "lines": lines,
    }
    binding = getattr(loaders["target"], "binding", None)
    if binding is None:
        result["kv_projections"] = kv_projections(models["draft"])
    else:
        gathered: dict[str, str] = {}
        order = []
        gatherer = binding.gatherer
        gatherer.begin()
        for layer in [*binding.layers, *binding.draft_layers]:
            if layer is (binding.draft_layers or [None])[0]:
                # Where SGLang's DFlash worker projects the context K/V: after the target's forward, before the
                # draft's layers run (the draft's first gather dispatched, its slots holding other layers' bytes).
                result["kv_projections"] = kv_projections(models["draft"])
            gatherer.wait(layer.index)
            order.append(layer.index)
            for param, _ in layer.params:
                role, name = names[id(param)]
                gathered[f"{role}:{name}"] = digest(param)
            gatherer.done(layer.index)
        result["sharded"] = {
            "gather_order": order,
            "gathered": gathered,
            "bound": {role: {manifest_name: names[id(p)][1] for manifest_name, p in parameters.items()}
                      for role, parameters in (("target", binding.target_parameters),
                                               ("draft", binding.draft_parameters))},
            # A draft loaded apart (another load format) has no shardprep load.
            "built_without_storage": {role: sorted(name for name, _ in getattr(load, "built", ())) for role, load in
                                      (("target", loaders["target"].target),
                                       ("draft", getattr(loaders["draft"], "draft", None)))},
        }
    return result


def main(plan_path: str, results_path: str) -> None:
    from sglang.srt.plugins import load_plugins

    plan = json.loads(Path(plan_path).read_text())
    dp = (plan["layout"], plan["dp_rank"], plan["port"])
    load_plugins()  # shardprep's entry point and the test plugins the test declared, as SGLang's processes do
    shardprep_log = logging.getLogger("sglang.shardprep")
    shardprep_log.setLevel(logging.INFO)
    results: dict[str, Any] = {}
    for number, run in enumerate(plan["runs"]):
        handler = Lines()
        shardprep_log.addHandler(handler)
        target = worker = None
        try:
            target, worker = build(run, dp, first=number == 0)
            results[run["name"]] = record(target, worker, handler.lines)
        except Exception as exc:  # recorded: the refusal runs expect one
            traceback.print_exc()
            results[run["name"]] = {"error": f"{type(exc).__name__}: {exc}", "lines": handler.lines}
        finally:
            shardprep_log.removeHandler(handler)
            del target, worker
            gc.collect()
        print(f"draft_loading: rank {dp[1]} done {run['name']!r}", flush=True)
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""A vLLM plugin for the tests: what a draft model computed, so that a sharded draft's weights are compared, not only
the target's tokens.

Greedy speculative decoding gives the target's tokens whatever the draft proposes, and a tiny random model's draft
has its proposals rejected anyway, so tokens and log-probabilities say nothing of the draft's weights. With
SHARDPREP_TEST_DRAFT_PROBE in a plan's environment the probe is installed: vLLM's DeepSeek MTP layer
(`DeepSeekMultiTokenPredictorLayer`, which runs `eh_proj`, the gathered `mtp_block` and the norms), DFlash's model
(`DFlashQwen3Model`: its layers over the context K/V its fused projection wrote) and EAGLE-3's (`llama_eagle3.
LlamaModel`: its midlayer and norm) then append, for every eager forward of an engine whose own `env` sets the
variable to a path, one digest of the hidden states they return (their bytes) to `PATH.dpR` (R: the DP rank).
Equal files for a full-mode and a sharded engine mean the draft computed the same values, bit for bit, at every
pass, dummy passes of idle ranks included. A traced forward
(Dynamo) records nothing. Checked by hand once (DP=1, full mode, deepseek_mtp k=1): with the MTP layer's o_proj
doubled in the checkpoint, the tokens and log-probabilities stayed equal and every digest changed.

With SHARDPREP_TEST_UNBOUND_DRAFT=1 in an engine's `env`, sharded mode's draft-model load binds nothing
(`drafts.bind_draft` returns no layer): what shardprep did before draft models had a record, when a converted DFlash
draft ran on uninitialized weights with no error. The load check (integrations/load_check.py) must refuse it.

Registered as a `vllm.general_plugins` entry point by `engine_runs.run_engines`.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

ENV = "SHARDPREP_TEST_DRAFT_PROBE"
UNBOUND = "SHARDPREP_TEST_UNBOUND_DRAFT"
ARMED = {ENV: ""}
"""A plan's `env`: the probe installed, recording in no engine unless a run's own `env` is `record(path)`."""
NAME = "shardprep_draft_probe"


def record(path: Path) -> dict[str, str]:
    """A run's `env`: its draft's digests go to `path`.dp0, `path`.dp1, ..."""
    return {ENV: str(path)}


def digests(path: Path, dp_rank: int) -> list[str]:
    """The digests one engine's DP rank recorded, in order ([] if it recorded none)."""
    file = Path(f"{path}.dp{dp_rank}")
    return file.read_text().split() if file.exists() else []


def register() -> None:
    if ENV not in os.environ:  # plugins load once per process: installed for the plan, recording per engine
        return
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMultiTokenPredictorLayer
    from vllm.model_executor.models.llama_eagle3 import LlamaModel as Eagle3Model
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    probe(DeepSeekMultiTokenPredictorLayer)
    for cls in (DFlashQwen3Model, Eagle3Model):
        probe(cls, dummy_digests=False)
    _unbind_on_request()


def _unbind_on_request() -> None:
    from shardprep.integrations import drafts

    bind_draft = drafts.bind_draft
    if getattr(bind_draft, "_shardprep_probe", False):
        return

    def maybe_unbound(*args: Any, **kwargs: Any) -> Any:
        return [] if os.environ.get(UNBOUND) == "1" else bind_draft(*args, **kwargs)

    maybe_unbound._shardprep_probe = True  # type: ignore[attr-defined]
    drafts.bind_draft = maybe_unbound  # type: ignore[assignment]


def probe(layer_class: type, dummy_digests: bool = True) -> None:
    """Record, from now on, a digest of what `layer_class.forward` returns (its first output if a tuple) at every
    eager forward of an engine that asks (once per class). Kimi K3's MTP layer is probed by k3_kernels.py, once
    K3's modules may be imported. With `dummy_digests` False, a dummy pass (vLLM's `dummy_run`: no attention
    metadata) records `dummy` instead: a DFlash or EAGLE-3 dummy pass reads the proposer's buffers as a real pass left
    them, or as allocated (seen: the same engine twice at DP=1 gives equal digests, but an idle DP rank's dummy pass
    differs from run to run), so only its place in the sequence of passes is compared."""
    import torch
    from vllm.forward_context import get_forward_context

    forward = layer_class.forward
    if getattr(forward, "_shardprep_probe", False):
        return

    # wraps: vLLM reads the forward's signature (`support_torch_compile`'s dynamic dimensions, a subclass's too)
    @functools.wraps(forward)
    def probed(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, *args, **kwargs)
        if torch.compiler.is_compiling() or not os.environ.get(ENV):
            return out
        hidden = out[0] if isinstance(out, tuple) else out
        digest = hashlib.sha256(hidden.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]
        if not dummy_digests and get_forward_context().attn_metadata is None:
            digest = "dummy"
        with open(f"{os.environ[ENV]}.dp{os.environ.get('VLLM_DP_RANK', '0')}", "a") as f:
            f.write(digest + "\n")
        return out

    probed._shardprep_probe = True  # type: ignore[attr-defined]
    layer_class.forward = probed  # type: ignore[attr-defined]

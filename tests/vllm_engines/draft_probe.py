"""A vLLM plugin for the tests: what the MTP draft computed, so that a sharded draft's weights are compared, not only
the target's tokens.

Greedy speculative decoding gives the target's tokens whatever the draft proposes, and a tiny random model's draft
has its proposals rejected anyway, so tokens and log-probabilities say nothing of the draft's weights. With
SHARDPREP_TEST_DRAFT_PROBE in a plan's environment the probe is installed: vLLM's DeepSeek MTP layer
(`DeepSeekMultiTokenPredictorLayer`, which runs `eh_proj`, the gathered `mtp_block` and the norms) then appends, for
every eager forward of an engine whose own `env` sets the variable to a path, one digest of the hidden states it
returns (their bytes) to `PATH.dpR` (R: the DP rank). Equal files for a full-mode and a sharded engine mean the draft
computed the same values, bit for bit, at every pass, dummy passes of idle ranks included. A traced forward
(Dynamo) records nothing. Checked by hand once (DP=1, full mode, deepseek_mtp k=1): with the MTP layer's o_proj
doubled in the checkpoint, the tokens and log-probabilities stayed equal and every digest changed.

Registered as a `vllm.general_plugins` entry point by `engine_runs.run_engines`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

ENV = "SHARDPREP_TEST_DRAFT_PROBE"
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

    probe(DeepSeekMultiTokenPredictorLayer)


def probe(layer_class: type) -> None:
    """Record, from now on, a digest of what `layer_class.forward` returns (its first output if a tuple) at every
    eager forward of an engine that asks (once per class). Kimi K3's MTP layer is probed by k3_kernels.py, once
    K3's modules may be imported."""
    import torch

    forward = layer_class.forward
    if getattr(forward, "_shardprep_probe", False):
        return

    def probed(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, *args, **kwargs)
        if torch.compiler.is_compiling() or not os.environ.get(ENV):
            return out
        hidden = out[0] if isinstance(out, tuple) else out
        digest = hashlib.sha256(hidden.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]
        with open(f"{os.environ[ENV]}.dp{os.environ.get('VLLM_DP_RANK', '0')}", "a") as f:
            f.write(digest + "\n")
        return out

    probed._shardprep_probe = True  # type: ignore[attr-defined]
    layer_class.forward = probed  # type: ignore[attr-defined]

"""`VllmAdapter.defaulted_parameters`: the parameters a checkpoint may lack, which the load checks of full and sharded
mode accept unloaded. A draft's embeddings and LM head, which vLLM takes from the target after loading, are among
them; a target's are not, although vLLM's EAGLE-3 interface sets `has_own_embed_tokens = False` on every target
class that can serve such a draft (Qwen3-MoE and Llama among them). No engine: a stand-in module carries the flags.
Run inside the vLLM venv; skipped where vLLM is not installed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from shardprep.integrations.vllm.adapter import VllmAdapter  # noqa: E402


class EagleCapable(nn.Module):
    """What vLLM's EAGLE interface leaves on a model: both flags False, as a class default."""

    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.proj = nn.Linear(4, 4, bias=False)


def defaulted(runner: str) -> set[str]:
    return VllmAdapter(model_config=SimpleNamespace(runner_type=runner)).defaulted_parameters(EagleCapable())


def test_a_drafts_embeddings_and_lm_head_may_be_missing_from_its_checkpoint():
    assert defaulted("draft") == {"model.embed_tokens.weight", "lm_head.weight"}


def test_a_targets_embeddings_and_lm_head_must_be_in_its_checkpoint_whatever_its_class_says():
    assert defaulted("generate") == set()


def test_an_empty_placeholder_may_be_missing_from_a_targets_checkpoint_too():
    model = EagleCapable()
    model.proj.register_parameter("input_scale", nn.Parameter(torch.empty(0), requires_grad=False))
    adapter = VllmAdapter(model_config=SimpleNamespace(runner_type="generate"))
    assert adapter.defaulted_parameters(model) == {"proj.input_scale"}

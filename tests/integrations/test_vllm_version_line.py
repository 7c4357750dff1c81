"""The vLLM plugin's start-up line: the tested vLLM versions, info on one of them, a warning (never a refusal) on
another. Runs without vLLM: the running version is faked as an imported `vllm` module."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from shardprep.integrations.vllm import TESTED_VLLM, announce_version


@pytest.fixture
def fake_vllm(monkeypatch):
    def install(version: str) -> None:
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))

    return install


@pytest.mark.parametrize("version", ["0.32.0+cpu", "0.34.0"])
def test_a_tested_version_is_one_info_line(fake_vllm, caplog, version):
    fake_vllm(version)
    with caplog.at_level(logging.INFO, logger="vllm.shardprep"):
        line = announce_version()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, line)]
    assert line.endswith(f"running {version}")
    assert all(v in line for v in TESTED_VLLM)


def test_another_version_is_one_warning_and_no_refusal(fake_vllm, caplog):
    fake_vllm("0.35.1")
    with caplog.at_level(logging.INFO, logger="vllm.shardprep"):
        line = announce_version()  # returns: warned, not refused
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, line)]
    assert "running 0.35.1, not a tested version" in line
    assert "0.32.0" in line and "0.34.0" in line
    assert "\n" not in line


def test_a_vllm_without_a_version_is_warned_about(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace())
    with caplog.at_level(logging.INFO, logger="vllm.shardprep"):
        line = announce_version()
    assert "running unknown, not a tested version" in line
    assert [r.levelno for r in caplog.records] == [logging.WARNING]

"""Placeholder wired into convert; requantization planning lands with the requant module."""

from __future__ import annotations


def plan_requant(ckpt, targets, **options):
    return None


def reference_overrides(ckpt, manifest):
    return {}

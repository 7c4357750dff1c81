"""The profile file (`shardprep profile --out profile.json`): what was measured, as `plan` reads it.

Schema `shardprep/profile/1`, documented in docs/planning.md. Every per-token-count list is aligned
with `tokens`. Times are milliseconds, medians over the measured iterations, of the slowest rank.
Pure: dataclasses and JSON (de)serialization, validated once when parsed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ProfileError
from .step_time import Interference, Segment

PROFILE_SCHEMA = "shardprep/profile/1"
COMPUTE_MODES = ("cuda-graph", "eager")
"""How a profile timed its forwards: CUDA-graph replays (CUDA, the default) or eager forwards."""


@dataclass(frozen=True)
class LayerTimes:
    """One decoder layer (by position in the model): its compute time alone per token count, with
    replicated weights, and its |T| when the profiled directory shards it."""

    layer: int
    compute_ms: tuple[float, ...]
    total_bytes: int | None = None


@dataclass(frozen=True)
class BackendTimes:
    """One gather backend on the profiled directory.

    - `gather_ms`: each sharded layer's gather alone (layer → ms);
    - `gather_only_ms`: one forward's gathers back to back with no compute (`idle_step`);
    - `compute_slowdown`/`gather_slowdown` (κ, λ per token count): how much slower compute runs while
      this backend's gathers stream beside it, and the gathers while compute runs;
    - `sharded_step_ms`: the profiled directory's step with this backend, per token count.
    """

    name: str
    gather_ms: dict[int, float]
    gather_only_ms: float
    recv_bytes_per_forward: int
    compute_slowdown: tuple[float, ...]
    gather_slowdown: tuple[float, ...]
    sharded_step_ms: tuple[float, ...]

    @property
    def recv_gbps(self) -> float:
        """Gather-only bandwidth: bytes received per forward / gather-only time, in GB/s."""
        return self.recv_bytes_per_forward / (self.gather_only_ms * 1e6) if self.gather_only_ms > 0 else 0.0

    def interference(self, token_index: int) -> Interference:
        return Interference(self.compute_slowdown[token_index], self.gather_slowdown[token_index])

    def estimate_gather_ms(self, layer: int, recv_bytes: int) -> float:
        """The layer's measured gather time, or (for a layer the profile did not shard) its received
        bytes at the gather-only bandwidth.

        >>> b = BackendTimes("ce", {1: 0.5}, 1.0, 2_000_000, (0.0,), (0.0,), (1.0,))
        >>> b.estimate_gather_ms(1, 0), b.estimate_gather_ms(2, 1_000_000)
        (0.5, 0.5)
        """
        if layer in self.gather_ms:
            return self.gather_ms[layer]
        if self.recv_bytes_per_forward <= 0:
            raise ProfileError(f"backend {self.name!r} has no gather bandwidth to estimate layer {layer}'s gather")
        return recv_bytes * self.gather_only_ms / self.recv_bytes_per_forward


@dataclass(frozen=True)
class Profile:
    """What `shardprep profile` measured on one model and machine. See docs/planning.md."""

    world_size: int
    device: str
    tokens: tuple[int, ...]
    layers: tuple[LayerTimes, ...]
    head_ms: tuple[float, ...]
    tail_ms: tuple[float, ...]
    replicated_step_ms: tuple[float, ...]
    backends: tuple[BackendTimes, ...]
    iters: int = 0
    dry_run: bool = False
    source: str = ""
    environment: dict[str, str] = field(default_factory=dict)
    compute_mode: str = "eager"  # how forwards were timed: "cuda-graph" replays or "eager" forwards
    compute_mode_note: str = ""  # why eager, where it is

    def token_index(self, tokens: int) -> int:
        try:
            return self.tokens.index(tokens)
        except ValueError:
            measured = ", ".join(map(str, self.tokens))
            raise ProfileError(f"the profile has no measurement at {tokens} tokens (it has {measured}); "
                               "re-run `shardprep profile --tokens ...`") from None

    def backend(self, name: str | None = None) -> BackendTimes:
        """The named backend's times; None: the first one profiled (what `auto` picked, if it was asked)."""
        if not self.backends:
            raise ProfileError("the profile measured no gather backend")
        if name is None:
            return self.backends[0]
        for b in self.backends:
            if b.name == name:
                return b
        raise ProfileError(f"the profile has no backend {name!r} (it has {', '.join(b.name for b in self.backends)})")

    def segments(self, token_index: int, gather_ms: Mapping[int, float]) -> list[Segment]:
        """The forward at one token count as step-model segments: head, every layer, tail; the layers in
        `gather_ms` (layer → gather ms) are sharded.

        >>> p = Profile(1, "cpu", (8,), (LayerTimes(0, (1.0,)), LayerTimes(1, (2.0,))), (0.1,), (0.2,), (3.3,), ())
        >>> [(s.compute_ms, s.gather_ms) for s in p.segments(0, {1: 0.5})]
        [(0.1, None), (1.0, None), (2.0, 0.5), (0.2, None)]
        """
        middle = [Segment(lay.compute_ms[token_index], gather_ms.get(lay.layer)) for lay in self.layers]
        return [Segment(self.head_ms[token_index]), *middle, Segment(self.tail_ms[token_index])]

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": PROFILE_SCHEMA,
            "world_size": self.world_size,
            "device": self.device,
            "dry_run": self.dry_run,
            "source": self.source,
            "iters": self.iters,
            "environment": dict(self.environment),
            "compute_mode": self.compute_mode,
            "compute_mode_note": self.compute_mode_note,
            "tokens": list(self.tokens),
            "head_ms": list(self.head_ms),
            "tail_ms": list(self.tail_ms),
            "replicated_step_ms": list(self.replicated_step_ms),
            "layers": [{"layer": lay.layer, "compute_ms": list(lay.compute_ms), "total_bytes": lay.total_bytes}
                       for lay in self.layers],
            "backends": [
                {
                    "name": b.name,
                    "gather_ms": [{"layer": layer, "ms": ms} for layer, ms in sorted(b.gather_ms.items())],
                    "gather_only_ms": b.gather_only_ms,
                    "recv_bytes_per_forward": b.recv_bytes_per_forward,
                    "recv_gbps": b.recv_gbps,
                    "compute_slowdown": list(b.compute_slowdown),
                    "gather_slowdown": list(b.gather_slowdown),
                    "sharded_step_ms": list(b.sharded_step_ms),
                }
                for b in self.backends
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "profile") -> Profile:
        """Parse and check a profile (schema tag, then every list's length against `tokens`).

        >>> p = Profile(1, "cpu", (8,), (LayerTimes(0, (1.0,)),), (0.1,), (0.2,), (1.3,), ())
        >>> Profile.from_dict(p.to_dict()) == p
        True
        """
        if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ProfileError(f"{where}: schema {got!r} is not {PROFILE_SCHEMA!r}; "
                               "write the file with `shardprep profile`")
        try:
            tokens = tuple(int(t) for t in data["tokens"])
            profile = cls(
                world_size=int(data["world_size"]),
                device=str(data["device"]),
                tokens=tokens,
                layers=tuple(LayerTimes(int(lay["layer"]), _floats(lay["compute_ms"]),
                                        None if lay.get("total_bytes") is None else int(lay["total_bytes"]))
                             for lay in data["layers"]),
                head_ms=_floats(data["head_ms"]),
                tail_ms=_floats(data["tail_ms"]),
                replicated_step_ms=_floats(data["replicated_step_ms"]),
                backends=tuple(
                    BackendTimes(
                        name=str(b["name"]),
                        gather_ms={int(g["layer"]): float(g["ms"]) for g in b["gather_ms"]},
                        gather_only_ms=float(b["gather_only_ms"]),
                        recv_bytes_per_forward=int(b["recv_bytes_per_forward"]),
                        compute_slowdown=_floats(b["compute_slowdown"]),
                        gather_slowdown=_floats(b["gather_slowdown"]),
                        sharded_step_ms=_floats(b["sharded_step_ms"]),
                    )
                    for b in data["backends"]
                ),
                iters=int(data.get("iters", 0)),
                dry_run=bool(data.get("dry_run", False)),
                source=str(data.get("source", "")),
                environment={str(k): str(v) for k, v in (data.get("environment") or {}).items()},
                # Profiles written before graphs were timed have no key: they timed eager forwards.
                compute_mode=str(data.get("compute_mode", "eager")),
                compute_mode_note=str(data.get("compute_mode_note", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{where}: not a complete {PROFILE_SCHEMA} profile "
                               f"({type(exc).__name__}: {exc})") from None
        if profile.compute_mode not in COMPUTE_MODES:
            raise ProfileError(f"{where}: compute_mode {profile.compute_mode!r} is not one of "
                               f"{', '.join(COMPUTE_MODES)}")
        per_token = [("head_ms", profile.head_ms), ("tail_ms", profile.tail_ms),
                     ("replicated_step_ms", profile.replicated_step_ms)]
        per_token += [(f"layer {lay.layer} compute_ms", lay.compute_ms) for lay in profile.layers]
        for b in profile.backends:
            per_token += [(f"{b.name} {k}", getattr(b, k))
                          for k in ("compute_slowdown", "gather_slowdown", "sharded_step_ms")]
        for name, values in per_token:
            if len(values) != len(tokens):
                raise ProfileError(f"{where}: {name} has {len(values)} values for {len(tokens)} token counts")
        return profile


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile JSON file.

    >>> load_profile("profile.json").tokens  # doctest: +SKIP
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: not found; write one with `shardprep profile OUT --out {path}`") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return Profile.from_dict(data, where=str(path))


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)

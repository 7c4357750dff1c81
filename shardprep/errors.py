"""Typed exceptions. The library raises these; only the CLI turns them into one-line messages."""

from __future__ import annotations


class ShardprepError(Exception):
    """Base class of every error shardprep raises on purpose.

    The message is one line that names the tensor or file at fault and, where there is one, the fix.
    """


class SourceError(ShardprepError):
    """The source checkpoint is missing, unreadable or malformed."""


class HubError(SourceError):
    """The hub (or whatever answers at HF_ENDPOINT: a mirror, a proxy, a captive portal) cannot give what a hub
    repo id needs, or answered out of bounds.

    `reason` is a stable snake_case word for what happened (docs/reliability.md lists them: `offline`,
    `dns`, `unreachable`, `timeout`, `gated`, `unauthorized`, `forbidden`, `repo_not_found`,
    `revision_not_found`, `entry_not_found`, `rate_limited`, `server_error`, `broken_body`, `too_many_redirects`,
    `too_large`, `out_of_range`, `encoded`, `not_a_hub`, `bad_answer`).
    """

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


class SelectionError(ShardprepError):
    """Target selection (globs, presets, layers, fused groups) is invalid or matches nothing."""


class LayoutError(ShardprepError):
    """Tensors cannot be laid out as asked (fused members that do not fit together, for example)."""


class ManifestError(ShardprepError):
    """A manifest does not follow the schema or breaks a layout invariant.

    `code` is the stable problem code `validate --json` reports (docs/reliability.md lists them).
    """

    def __init__(self, message: str, *, code: str = "manifest_invalid"):
        super().__init__(message)
        self.code = code


class IntegrityError(ShardprepError):
    """A file does not hold what the format says: missing, truncated, corrupt, unsafe path, checksum mismatch.

    `code` is a stable snake_case problem code (docs/reliability.md); `file`, `layer` and `tensor` say
    where, when known. `validate` reports these as problems; loaders raise them.
    """

    def __init__(self, message: str, *, code: str = "corrupt_file", file: str | None = None,
                 layer: int | None = None, tensor: str | None = None):
        super().__init__(message)
        self.code, self.file, self.layer, self.tensor = code, file, layer, tensor


class OutputError(ShardprepError):
    """The output directory cannot be written as asked."""


class RequantError(ShardprepError):
    """Block-FP8 requantization refused a tensor (non-finite values, bad scale shape, ...)."""


class RuntimeShardError(ShardprepError):
    """The runtime cannot load or gather as asked (rank mismatch, collective misalignment, ...)."""


class OptionsMismatchError(RuntimeShardError):
    """The ranks of one launch were started with different options; every rank raises the same message, which
    names the option and the ranks and nodes on each side."""


class ProfileError(ShardprepError):
    """A profile file is unreadable, of another schema, or does not describe the model being planned."""

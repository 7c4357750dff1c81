"""The local HF cache: a whole snapshot downloaded into it (`convert --keep-source`), or one found in it offline.

huggingface_hub lays a repo out as `models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> blobs/...}`;
a snapshot directory's name is the commit it holds, whatever ref was typed.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import SourceError

SNAPSHOT_PATTERNS = ("*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.py", "*.jinja", "*.md")
"""What `convert` takes of a repo: the weights in safetensors and every small file a server or tokenizer reads."""


def download_snapshot(repo_id: str, revision: str | None) -> Path:
    """The repo's snapshot at `revision` in the HF cache, downloaded whole where it is not there yet
    (huggingface_hub's `snapshot_download`; HF_HUB_OFFLINE=1 reads the cache alone). Every failure is one
    SourceError line.

    >>> download_snapshot("Qwen/Qwen3-30B-A3B", None).name  # the commit  # doctest: +SKIP
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(SNAPSHOT_PATTERNS)))
    except LocalEntryNotFoundError:
        raise SourceError(f"{repo_id}: not in the local HF cache and the hub cannot be reached "
                          "(HF_HUB_OFFLINE is set or no network); download it first") from None
    except GatedRepoError:  # a subclass of RepositoryNotFoundError: the repo exists, the token cannot read it
        raise SourceError(f"{repo_id}: a gated repository: ask for access on its hub page, then set HF_TOKEN (or "
                          "run `hf auth login`) to a token of that account") from None
    except RepositoryNotFoundError:
        raise SourceError(f"{repo_id}: no such repository on the hub (or it is private)") from None
    except RevisionNotFoundError:
        raise SourceError(f"{repo_id}: the hub has no revision {revision!r}") from None
    except Exception as exc:  # whatever the HTTP library beneath raises: its kinds vary by version
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise SourceError(f"{repo_id}: cannot fetch from the hub: {type(exc).__name__}: {first}") from None


def cached_snapshot(repo_id: str, revision: str | None, names: tuple[str, ...]) -> Path | None:
    """The snapshot directory in the HF cache that holds the first of `names` it has at `revision`; None when
    the cache has none of them (or `repo_id` is not one huggingface_hub accepts). Whether the snapshot is
    complete is the caller's question: a cache may hold config.json alone.

    >>> cached_snapshot("deepseek-ai/DeepSeek-V3", None, ("config.json",))  # doctest: +SKIP
    """
    from huggingface_hub import try_to_load_from_cache

    for name in names:
        try:
            found = try_to_load_from_cache(repo_id, name, revision=revision)
        except ValueError:  # not a repo id huggingface_hub accepts
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None

"""The input of `reshard`: an output directory, opened strictly before anything is written.

Checked up front, so that a broken input is refused before NEW's staging directory exists: the manifest
(schema, invariants, its own checksum, format version 2), every rank file (present, exactly the size the
manifest implies, its header byte for byte) and every other file the manifest lists (present, its size).
Every path must resolve inside OUT, or for a huggingface_hub snapshot inside the repo's cache directory
(`source.source_boundary`), so no symlink leads reshard out of OUT. The checksums of the chunks and of
the files are checked as reshard reads them (`reshard.py`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import IntegrityError, ManifestError, ShardprepError
from ..manifests.exact_read import open_for_reading, read_exact
from ..manifests.manifest import MANIFEST_NAME, Manifest, load_manifest
from ..manifests.paths import files_under
from ..manifests.rank_file import check_rank_header
from .output_dir import is_staging_dir
from .source import source_boundary


@dataclass(frozen=True)
class ReshardInput:
    """An output directory checked for reshard: its manifest, its rank files, the files it does not list."""

    root: Path
    manifest: Manifest
    rank_paths: tuple[Path, ...]
    unlisted_files: tuple[str, ...]

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME


def open_reshard_input(out: str | Path, *, purpose: str = "resharded") -> ReshardInput:
    """Open the output directory `out` for reshard (or export: `purpose` words the refusal of version 1);
    raises a ShardprepError naming the file at fault.

    >>> open_reshard_input("out-8/").manifest.world_size  # doctest: +SKIP
    """
    root = Path(out)
    if not root.is_dir():
        raise ShardprepError(f"{root}: no such directory; OUT must be an output directory of `shardprep convert`")
    if is_staging_dir(root):
        raise ShardprepError(f"{root}: a staging directory of an interrupted or unfinished write, not an output")
    manifest = load_manifest(root)
    if manifest.version < 2:
        raise ManifestError(f"{root / MANIFEST_NAME}: format version {manifest.version} cannot be {purpose} (its "
                            "replicated files have no checksums to verify, and it records no selection); re-run "
                            "`shardprep convert` from the source, which writes version 2", code="manifest_version")
    boundary = source_boundary(root)
    rank_paths = tuple(_rank_file(root, boundary, rel, r, manifest) for r, rel in enumerate(manifest.rank_files))
    for f in manifest.replicated_files:
        if f.path.split("/")[0] == "shards":
            raise ManifestError(f"{root / MANIFEST_NAME}: lists {f.path!r}, inside shards/ where the rank files go; "
                                "not an output of `shardprep convert`", code="manifest_invariant")
        path = _inside(root, boundary, f.path)
        size = _regular_file_size(path, "listed in the manifest but missing; copy the whole output directory")
        if size != f.size:
            raise IntegrityError(f"{path}: {size} bytes, the manifest says {f.size} (truncated or modified); copy it "
                                 "again", code="file_size", file=f.path)
    listed = {MANIFEST_NAME, *manifest.rank_files, *(f.path for f in manifest.replicated_files)}
    return ReshardInput(root, manifest, rank_paths, tuple(rel for rel in files_under(root) if rel not in listed))


def _rank_file(root: Path, boundary: Path, rel: str, rank: int, manifest: Manifest) -> Path:
    path = _inside(root, boundary, rel)
    size = _regular_file_size(path, f"rank {rank}'s file is missing; copy the whole output directory")
    if size != manifest.rank_file_bytes:
        raise IntegrityError(f"{path}: {size} bytes, the manifest says {manifest.rank_file_bytes} (truncated or "
                             "damaged); copy it again", code="rank_file_size", file=rel)
    header = manifest.rank_header
    with open_for_reading(path, "rank file") as fd:
        check_rank_header(read_exact(fd, len(header), 0, path), header, path, rel)
    return path


def _inside(root: Path, boundary: Path, rel: str) -> Path:
    # The manifest's invariants already refused absolute paths and `..`; this catches symlinks.
    path = root / rel
    real = path.resolve()
    if not real.is_relative_to(boundary):
        raise IntegrityError(f"{path}: is a symlink to {real}, outside {root}; copy the file into the directory "
                             "instead of linking it", code="unsafe_path", file=rel)
    return path


def _regular_file_size(path: Path, missing: str) -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise IntegrityError(f"{path}: {missing}", code="missing_file", file=str(path)) from None
    except OSError as exc:
        raise IntegrityError(f"{path}: cannot read ({exc.strerror or exc})", code="unreadable_file",
                             file=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise IntegrityError(f"{path}: not a regular file", code="unreadable_file", file=str(path))
    return st.st_size

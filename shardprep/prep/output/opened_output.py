"""An output directory opened for reading it back whole (reshard, export), checked before anything is written.

Checked up front, so that a broken output is refused before the command's staging directory exists: the
manifest (schema, invariants, its own checksum, format version 2), every rank file (present, exactly the size
the manifest implies, its header byte for byte) and every other file the manifest lists (present, its size).
Every path must resolve inside OUT, or for a huggingface_hub snapshot inside the repo's cache directory
(`source.source_boundary`), so no symlink leads a reader out of OUT. The checksums of the chunks are checked
as `read_layer` reads them, those of the other files where they land (`carried_files.py`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ...errors import IntegrityError, ManifestError, ShardprepError
from ...manifests.exact_read import open_for_reading, read_exact
from ...manifests.layout import chunk_range
from ...manifests.manifest import MANIFEST_NAME, LayerRecord, Manifest, load_manifest, read_chunk
from ...manifests.paths import files_under
from ...manifests.rank_file import check_rank_header
from ..source import source_boundary
from .output_dir import is_staging_dir


@dataclass(frozen=True)
class OpenedOutput:
    """An output directory checked for reading back: its manifest, its rank files, the files it does not list."""

    root: Path
    manifest: Manifest
    rank_paths: tuple[Path, ...]
    unlisted_files: tuple[str, ...]

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME


def open_output(out: str | Path, *, purpose: str) -> OpenedOutput:
    """Open the output directory `out` to read it back whole; raises a ShardprepError naming the file at fault.
    `purpose` words the refusal of format version 1 ("resharded", "exported").

    >>> open_output("out-8/", purpose="resharded").manifest.world_size  # doctest: +SKIP
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
    return OpenedOutput(root, manifest, rank_paths, tuple(rel for rel in files_under(root) if rel not in listed))


def read_layer(source: OpenedOutput, record: LayerRecord, flat: memoryview) -> None:
    """T of one layer from its N chunks, each checked against its checksum, into `flat` (|T| bytes).

    >>> read_layer(open_output("out/", purpose="exported"), manifest.layers[0], buffer)  # doctest: +SKIP
    """
    for r, path in enumerate(source.rank_paths):
        lo, hi = chunk_range(r, record.chunk_bytes)
        with open_for_reading(path, "rank file") as fd:
            read_chunk(fd, path, record, r, flat[lo:hi])


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

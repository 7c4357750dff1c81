"""Reading HF safetensors checkpoints, local or from the hub cache, without loading any tensor.

Only headers are parsed here; tensor bytes are read later, one layer at a time, straight from the
file at the offsets recorded in `SourceTensor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, SourceError
from ..manifests.exact_read import pread_exact
from ..manifests.paths import is_safe_relpath
from ..manifests.problems import quoted
from ..manifests.safetensors_header import SafetensorsHeader
from ..manifests.safetensors_header import read_safetensors_header as read_header_strictly
from ..manifests.strict_json import parse_json, read_capped
from ..planning.config_figures import check_config_figures
from .hub.cache import download_snapshot
from .hub.repo_id import hub_repo_id, why_a_path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# config.json and index files of real checkpoints are kilobytes to a few MB; larger ones are refused unread.
MAX_CONFIG_BYTES = 16 << 20
MAX_INDEX_BYTES = 256 << 20
# Weights in other frameworks' formats: never copied next to the converted safetensors.
OTHER_WEIGHT_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf")


@dataclass(frozen=True)
class SourceTensor:
    """Where one tensor's bytes are: `file` at absolute byte `start`, `nbytes` long."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    nbytes: int


@dataclass
class SourceFile:
    """One safetensors file: relative name, path on disk, size, and its tensors in header order."""

    name: str
    path: Path
    size: int
    tensors: list[str]
    metadata: dict[str, str] | None = None


@dataclass
class SourceCheckpoint:
    """A parsed HF checkpoint directory: its safetensors files, every tensor's location, and other files."""

    root: Path
    files: dict[str, SourceFile]
    tensors: dict[str, SourceTensor]
    other_files: list[str]
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    index_metadata: dict[str, Any] = field(default_factory=dict)
    read_range: Callable[[str, int, int], bytes] | None = None
    """For a checkpoint read from its headers alone (`header_source.py`): reads (file, start, nbytes) remotely."""
    fetched_bytes: Callable[[], int] | None = None
    """For a checkpoint read from its headers alone: the bytes fetched from the hub so far."""
    remote_config: dict[str, Any] | None = None
    """For a checkpoint read from its headers alone: its config.json, fetched and checked (None: it has none)."""

    @property
    def config(self) -> dict[str, Any] | None:
        """config.json as a dict (None when there is none); a file that is not a JSON object, or whose figures
        no model has (`check_config_figures`), is a SourceError."""
        if self.read_range is not None:
            return self.remote_config
        return read_config(self.root)

    def read_tensor(self, name: str) -> bytes:
        """One tensor's bytes, straight from its file.

        >>> ckpt.read_tensor("model.norm.weight")[:4]  # doctest: +SKIP
        """
        t = self.tensors[name]
        if self.read_range is not None:
            return self.read_range(t.file, t.start, t.nbytes)
        data = bytearray(t.nbytes)
        with open(self.files[t.file].path, "rb") as f:
            pread_exact(f.fileno(), memoryview(data), t.start, self.files[t.file].path)
        return bytes(data)

    def describe(self) -> dict[str, Any]:
        """The manifest's `source` record: where the checkpoint came from (absolute path or repo id, the
        revision as typed and the commit it resolved to) and its files' sizes."""
        return {
            "path": None if self.repo_id else str(self.root.resolve()),
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "files": [{"name": f.name, "size": f.size} for f in self.files.values()],
        }


def read_safetensors_header(path: str | Path, *, whole_file: bool = True) -> SafetensorsHeader:
    """Parse and check a source safetensors header strictly (the rules the safetensors library enforces).

    Every tensor's dtype, shape and byte range are checked against each other and (unless `whole_file`
    is False: see `manifests.safetensors_header.read_safetensors_header`) the file size, so a truncated
    or corrupt file fails here with a SourceError naming the file and the tensor.

    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> header.tensors["lm_head.weight"].dtype  # doctest: +SKIP
    """
    try:
        return read_header_strictly(path, whole_file=whole_file)
    except IntegrityError as exc:
        raise SourceError(str(exc)) from None


def read_config(directory: Path) -> dict[str, Any] | None:
    """`directory`'s config.json as a dict, None when there is none; a file that is not a JSON object (or
    is too large, or has bad JSON, or figures no model has) is a SourceError naming it.

    >>> read_config(Path("out/"))["model_type"]  # doctest: +SKIP
    """
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        raw = read_capped(path, max_bytes=MAX_CONFIG_BYTES, what="config.json")
    except IntegrityError as exc:
        raise SourceError(str(exc)) from None
    return parse_config(raw, str(path))


def parse_config(raw: bytes, where: str) -> dict[str, Any]:
    """A config.json's bytes as a dict, checked: JSON (duplicate keys allowed, as transformers reads them), an
    object, and sensible figures (`check_config_figures`); a SourceError naming `where` otherwise.

    >>> parse_config(b'{"num_hidden_layers": 61}', "config.json")
    {'num_hidden_layers': 61}
    >>> parse_config(b'{"num_hidden_layers": -3}', "config.json")
    Traceback (most recent call last):
    ...
    shardprep.errors.SourceError: config.json: num_hidden_layers is -3; a model's is a whole number from 1 to 10000
    """
    try:
        data = parse_json(raw, where, allow_duplicate_keys=True)
    except IntegrityError as exc:
        raise SourceError(str(exc)) from None
    if not isinstance(data, dict):
        raise SourceError(f"{where}: not a JSON object")
    check_config_figures(data, where)
    return data


@dataclass(frozen=True)
class ResolvedSource:
    """Where a source is on disk, and where it came from: a repo id, the revision as typed, the commit used."""

    root: Path
    repo_id: str | None
    revision: str | None
    commit: str | None


def resolve_source(src: str | Path, revision: str | None = None) -> ResolvedSource:
    """A local directory, or a hub repo id resolved through huggingface_hub's cache.

    For a repo id, `revision` is what the user typed (a branch, tag, commit, or None for the default
    branch) and `commit` the snapshot it resolved to. HF_HUB_OFFLINE=1 is honoured: the snapshot must
    then already be in the cache. What is a path and what a repo id: `hub_repo_id`.

    >>> resolve_source("my-model/")  # doctest: +SKIP
    """
    text = str(src)
    if "\x00" in text:
        raise SourceError(f"{quoted(text)}: a path cannot contain a NUL byte")
    repo_id = hub_repo_id(src)
    if repo_id is None:
        path = Path(src).expanduser()
        if not path.exists():
            raise SourceError(f"{src}: no such directory{why_a_path(text)}")
        if not path.is_dir():
            raise SourceError(f"{path}: is a file; SRC must be a model directory or a hub repo id")
        return ResolvedSource(path, None, revision, None)
    local_path = download_snapshot(repo_id, revision)
    # The cache lays a snapshot out as snapshots/<commit>: the commit actually used, whatever ref was typed.
    return ResolvedSource(local_path, text, revision, local_path.name)


def source_boundary(root: Path) -> Path:
    """The directory a source's symlinks may point into: the source itself, or for a huggingface_hub
    snapshot (`models--org--name/snapshots/<commit>/`) the whole repo cache directory, whose blobs/ the
    snapshot's files link to.

    >>> source_boundary(Path("~/.cache/huggingface/hub/models--org--name/snapshots/abc123"))  # doctest: +SKIP
    """
    real = root.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        return real.parent.parent
    return real


def check_inside(path: Path, root: Path, boundary: Path) -> None:
    """Refuse a source file that is (or passes through) a symlink leading out of `boundary`.

    Convert copies what it reads into OUT, so following such a link would publish an unrelated file
    (a `config.json -> /etc/...`) next to the weights.

    >>> root = Path("my-model")
    >>> check_inside(root / "config.json", root, source_boundary(root))  # doctest: +SKIP
    """
    real = path.resolve()
    if not real.is_relative_to(boundary):
        raise SourceError(f"{path}: is a symlink to {real}, outside the source {root}; "
                          "copy the file into the model directory instead of linking it")


def open_source(src: str | Path, revision: str | None = None, *, whole_files: bool = True) -> SourceCheckpoint:
    """Parse a checkpoint's safetensors headers (single file or sharded with an index).

    `whole_files=False` accepts files that end after their header (`validate --manifest-only --source`
    reads headers alone, so a copy of them is enough); each file's `size` is then the one its header implies.

    >>> ckpt = open_source("my-model/")  # doctest: +SKIP
    >>> ckpt.tensors["model.layers.1.self_attn.o_proj.weight"].shape  # doctest: +SKIP
    """
    resolved = resolve_source(src, revision)
    root = resolved.root
    boundary = source_boundary(root)
    index_path = root / INDEX_NAME
    index_metadata: dict[str, Any] = {}
    weight_map: dict[str, str] | None
    if index_path.exists():
        check_inside(index_path, root, boundary)
        weight_map, index_metadata = read_source_index(index_path)
        names = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).exists():
        weight_map, names = None, [SINGLE_NAME]
    else:
        found = sorted(p.name for p in root.glob("*.safetensors"))
        if len(found) != 1:
            raise SourceError(f"{root}: no {INDEX_NAME} or {SINGLE_NAME}"
                              + (f" (found {len(found)} safetensors files without an index)" if found else ""))
        weight_map, names = None, found

    def header_of(name: str) -> SafetensorsHeader:
        path = root / name
        if not path.exists():
            raise SourceError(f"{index_path}: names shard {name!r}, which is missing from {root}")
        check_inside(path, root, boundary)
        return read_safetensors_header(path, whole_file=whole_files)

    files, tensors = tensors_of(root, names, header_of, weight_map)
    weight_files = set(files) | {INDEX_NAME}
    other = sorted(
        str(p.relative_to(root)) for p in root.rglob("*")
        if (p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
            and str(p.relative_to(root)) not in weight_files
            and not any(p.match(g) for g in OTHER_WEIGHT_GLOBS))
    )
    for rel in other:
        check_inside(root / rel, root, boundary)
    return SourceCheckpoint(root, files, tensors, other, resolved.repo_id, resolved.revision, resolved.commit,
                            index_metadata)


def tensors_of(root: Path, names: list[str], header_of: Callable[[str], SafetensorsHeader],
               weight_map: dict[str, str] | None) -> tuple[dict[str, SourceFile], dict[str, SourceTensor]]:
    """The files `names` of a checkpoint at `root` and every tensor's location, from each file's header
    (`header_of(name)`: read from disk, or from the hub by `header_source.py`), checked against the index.

    >>> files, tensors = tensors_of(root, ["model.safetensors"], header_of, None)  # doctest: +SKIP
    """
    where = root / INDEX_NAME
    check_shard_names(names, str(where))
    files: dict[str, SourceFile] = {}
    tensors: dict[str, SourceTensor] = {}
    for name in names:
        path = root / name
        header = header_of(name)
        files[name] = SourceFile(name, path, header.file_size, list(header.tensors), header.metadata)
        for tname, info in header.tensors.items():
            if tname in tensors:
                raise SourceError(f"tensor {quoted(tname)} is stored twice ({tensors[tname].file} and {name})")
            tensors[tname] = SourceTensor(tname, info.dtype, info.shape, name, header.data_start + info.begin,
                                          info.nbytes)
    if weight_map is not None:
        for tname, fname in weight_map.items():
            if tname not in tensors or tensors[tname].file != fname:
                raise SourceError(f"{where}: tensor {quoted(tname)} is mapped to {quoted(fname)}, which does "
                                  "not hold it")
        extra = set(tensors) - set(weight_map)
        if extra:
            raise SourceError(f"{where}: tensor {quoted(sorted(extra)[0])} is in a shard but not in the index")
    return files, tensors


def check_shard_names(names: list[str], where: str) -> None:
    """Refuse an index naming a shard outside the model directory (`../x`, `/etc/x`, `a\\b`), before any of
    them is read or fetched; `where` is the index, for the message.

    Hub snapshots are symlinks into blobs/, so only the name is checked here, not where it resolves.

    >>> check_shard_names(["model-00001-of-00002.safetensors"], "index.json")
    >>> check_shard_names(["../../etc/passwd"], "index.json")
    Traceback (most recent call last):
    ...
    shardprep.errors.SourceError: index.json: shard '../../etc/passwd' is outside the model directory
    """
    for name in names:
        if not is_safe_relpath(name):
            raise SourceError(f"{where}: shard {quoted(name)} is outside the model directory")


def read_source_index(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """A checkpoint's safetensors index: its weight map (tensor → file) and its metadata, checked.

    >>> weight_map, metadata = read_source_index(Path("my-model/model.safetensors.index.json"))  # doctest: +SKIP
    """
    try:
        raw = read_capped(path, max_bytes=MAX_INDEX_BYTES, what="safetensors index")
    except IntegrityError as exc:
        raise SourceError(str(exc)) from None
    return parse_source_index(raw, str(path))


def parse_source_index(raw: bytes, where: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A safetensors index's bytes as its weight map (tensor → file) and its metadata, checked; a SourceError
    naming `where` otherwise.

    >>> parse_source_index(b'{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}', "index.json")
    ({'lm_head.weight': 'model-00001-of-00002.safetensors'}, {})
    """
    try:
        index = parse_json(raw, where)
    except IntegrityError as exc:
        raise SourceError(str(exc)) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    metadata = (index.get("metadata") if isinstance(index, dict) else None) or {}
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(f"{where}: not a valid safetensors index (needs a 'weight_map' of tensor name → file name)")
    if not isinstance(metadata, dict):
        raise SourceError(f"{where}: not a valid safetensors index ('metadata' must be an object)")
    return weight_map, metadata

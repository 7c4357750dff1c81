"""Reading HF safetensors checkpoints, local or from the hub cache, without loading any tensor.

Only headers are parsed here; tensor bytes are read later, one layer at a time, straight from the
file at the offsets recorded in `SourceTensor`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SourceError
from ..manifests.dtypes import DTYPE_SIZES, tensor_nbytes

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# A header larger than this is not a real checkpoint header but a corrupt length field.
MAX_HEADER_BYTES = 256 << 20
# Weights in other frameworks' formats: never copied next to the converted safetensors.
OTHER_WEIGHT_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


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
    index_metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any] | None:
        path = self.root / "config.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None

    def read_tensor(self, name: str) -> bytes:
        """One tensor's bytes, straight from its file.

        >>> ckpt.read_tensor("model.norm.weight")[:4]  # doctest: +SKIP
        """
        t = self.tensors[name]
        data = bytearray(t.nbytes)
        with open(self.files[t.file].path, "rb") as f:
            pread_exact(f.fileno(), memoryview(data), t.start, self.files[t.file].path)
        return bytes(data)

    def describe(self) -> dict[str, Any]:
        """The manifest's `source` record: where the checkpoint came from and its files' sizes."""
        return {
            "path": None if self.repo_id else str(self.root),
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": [{"name": f.name, "size": f.size} for f in self.files.values()],
        }


def pread_exact(fd: int, dest: memoryview, offset: int, path: str | Path) -> None:
    """Fill `dest` with the file's bytes from `offset` on (preadv until done); a short file is a SourceError.

    >>> pread_exact(fd, memoryview(buffer), 4096, "model.safetensors")  # doctest: +SKIP
    """
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n == 0:
            raise SourceError(f"{path}: truncated (ended while reading at byte {offset + done})")
        done += n


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], dict[str, str] | None, int]:
    """Parse and check a safetensors header: (tensors by name, __metadata__, absolute data start).

    Every tensor's dtype, shape and byte range are checked against each other and the file size,
    so a truncated or corrupt file fails here, naming the file and the tensor.

    >>> tensors, meta, data_start = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> tensors["lm_head.weight"]["dtype"]  # doctest: +SKIP
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SourceError(
                    f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise SourceError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise SourceError(f"{path}: is a directory, expected a safetensors file") from None
    except PermissionError:
        raise SourceError(f"{path}: permission denied") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SourceError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise SourceError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    data_start = 8 + n
    data_size = size - data_start
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise SourceError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in DTYPE_SIZES:
            tensor_nbytes(dtype, shape, tensor=f"{name}' in '{path}")  # raises the unsupported-dtype error
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise SourceError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
        if tensor_nbytes(dtype, shape, tensor=name) != end - begin or begin < 0:
            raise SourceError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not match {dtype}{shape}")
        if end > data_size:
            raise SourceError(f"{path}: truncated file: tensor {name!r} ends at byte {data_start + end}, "
                              f"file has {size}")
        spans.append((begin, end, name))
    spans.sort()
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SourceError(f"{path}: tensors {a!r} and {b!r} overlap")
    return header, metadata, data_start


def resolve_source(src: str | Path, revision: str | None = None) -> tuple[Path, str | None, str | None]:
    """A local directory, or a hub repo id resolved through huggingface_hub's cache: (dir, repo_id, revision).

    HF_HUB_OFFLINE=1 is honoured: the snapshot must then already be in the cache.

    >>> resolve_source("my-model/")  # doctest: +SKIP
    """
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{path}: is a file; SRC must be a model directory or a hub repo id")
        return path, None, revision
    text = str(src)
    if not REPO_ID.match(text) or text.startswith((".", "/")):
        raise SourceError(f"{src}: no such directory (and not a hub repo id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.py", "*.jinja", "*.md"]
    try:
        local = snapshot_download(text, revision=revision, allow_patterns=patterns)
    except LocalEntryNotFoundError:
        raise SourceError(f"{src}: not in the local HF cache and the hub cannot be reached "
                          "(HF_HUB_OFFLINE is set or no network); download it first") from None
    except RepositoryNotFoundError:
        raise SourceError(f"{src}: no such repository on the hub (or it is private)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise SourceError(f"{src}: cannot fetch from the hub: {str(exc).splitlines()[0]}") from None
    local_path = Path(local)
    # snapshots/<commit>: record the commit actually used, not just the ref the user typed.
    return local_path, text, local_path.name if revision is None or revision != local_path.name else revision


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


def open_source(src: str | Path, revision: str | None = None) -> SourceCheckpoint:
    """Parse a checkpoint's safetensors headers (single file or sharded with an index).

    >>> ckpt = open_source("my-model/")  # doctest: +SKIP
    >>> ckpt.tensors["model.layers.1.self_attn.o_proj.weight"].shape  # doctest: +SKIP
    """
    root, repo_id, rev = resolve_source(src, revision)
    boundary = source_boundary(root)
    index_path = root / INDEX_NAME
    index_metadata: dict[str, Any] = {}
    if index_path.exists():
        check_inside(index_path, root, boundary)
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            index_metadata = index.get("metadata") or {}
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SourceError(f"{index_path}: not a valid safetensors index (needs a 'weight_map')") from None
        names = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).exists():
        weight_map, names = None, [SINGLE_NAME]
    else:
        found = sorted(p.name for p in root.glob("*.safetensors"))
        if len(found) != 1:
            raise SourceError(f"{root}: no {INDEX_NAME} or {SINGLE_NAME}"
                              + (f" (found {len(found)} safetensors files without an index)" if found else ""))
        weight_map, names = None, found

    files: dict[str, SourceFile] = {}
    tensors: dict[str, SourceTensor] = {}
    for name in names:
        path = root / name
        if not Path(os.path.normpath(path)).is_relative_to(os.path.normpath(root)):
            raise SourceError(f"{index_path}: shard {name!r} is outside the model directory")
        if not path.exists():
            raise SourceError(f"{index_path}: names shard {name!r}, which is missing from {root}")
        check_inside(path, root, boundary)
        header, metadata, data_start = read_safetensors_header(path)
        files[name] = SourceFile(name, path, path.stat().st_size, list(header), metadata)
        for tname, info in header.items():
            if tname in tensors:
                raise SourceError(f"tensor {tname!r} is stored twice ({tensors[tname].file} and {name})")
            begin, end = info["data_offsets"]
            tensors[tname] = SourceTensor(tname, info["dtype"], tuple(info["shape"]), name, data_start + begin,
                                          end - begin)
    if weight_map is not None:
        for tname, fname in weight_map.items():
            if tname not in tensors or tensors[tname].file != fname:
                raise SourceError(f"{index_path}: tensor {tname!r} is mapped to {fname}, which does not hold it")
        extra = set(tensors) - set(weight_map)
        if extra:
            raise SourceError(f"{index_path}: tensor {sorted(extra)[0]!r} is in a shard but not in the index")
    weight_files = set(files) | {INDEX_NAME}
    other = sorted(
        str(p.relative_to(root)) for p in root.rglob("*")
        if (p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
            and str(p.relative_to(root)) not in weight_files
            and not any(p.match(g) for g in OTHER_WEIGHT_GLOBS))
    )
    for rel in other:
        check_inside(root / rel, root, boundary)
    return SourceCheckpoint(root, files, tensors, other, repo_id, rev, index_metadata)

"""The rank file (format version 2): a safetensors file whose header is byte-identical on every rank.

`shards/rank-{r:05d}-of-{N:05d}.safetensors` holds one `U8` tensor `layer.{ℓ}` of `chunk_bytes` bytes per
sharded layer, at absolute byte `file_offset`, the same in every rank's file. The header is padded with
spaces up to the first chunk; safetensors allows no hole between tensors, so the zero bytes between
two chunks (alignment) are a `U8` tensor named `pad.{ℓ}` (ℓ: the layer that follows). Everything here
is pure: the header follows from the layers and their sizes alone, so a reader can rebuild it and
compare it byte for byte.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

from ..errors import IntegrityError
from .layout import align_up

RANK_FILE_FORMAT = "shardprep/rank-file"


def rank_file_name(rank: int, world_size: int) -> str:
    """Relative path of a rank's file inside an output directory (format version 2).

    >>> rank_file_name(0, 8)
    'shards/rank-00000-of-00008.safetensors'
    """
    return f"shards/rank-{rank:05d}-of-{world_size:05d}.safetensors"


def layer_tensor_name(layer: int) -> str:
    """Name of layer ℓ's chunk inside a rank file.

    >>> layer_tensor_name(3)
    'layer.3'
    """
    return f"layer.{layer}"


def pad_tensor_name(layer: int) -> str:
    """Name of the zero bytes just before layer ℓ's chunk inside a rank file.

    >>> pad_tensor_name(3)
    'pad.3'
    """
    return f"pad.{layer}"


def rank_file_header(layers: Sequence[tuple[int, int, int]], world_size: int) -> bytes:
    """The bytes of every rank file before the first chunk: the 8-byte length, the JSON header, spaces.

    `layers` lists (layer, file_offset, chunk_bytes) in file order. The JSON is compact and the header is
    padded with spaces up to the first layer's `file_offset`, where the data region starts, so the first
    chunk is the first tensor and no tensor's offsets depend on the header's length. Raises ValueError
    if the JSON does not fit before the first chunk (`plan_rank_file` places chunks so that it does).

    >>> h = rank_file_header([(1, 4096, 32)], world_size=2)
    >>> len(h), h[8:60]
    (4096, b'{"__metadata__":{"format":"shardprep/rank-file","ver')
    """
    text = header_json(layers, world_size)
    data_start = layers[0][1] if layers else 8 + len(text)
    if 8 + len(text) > data_start:
        raise ValueError(f"a rank file header of {len(text)} bytes does not fit before byte {data_start}")
    return struct.pack("<Q", data_start - 8) + text + b" " * (data_start - 8 - len(text))


def header_json(layers: Sequence[tuple[int, int, int]], world_size: int) -> bytes:
    """The rank file's JSON header, before padding (see docs/format.md for its exact form).

    >>> tensors = json.loads(header_json([(1, 4096, 32), (2, 8192, 16)], 2))
    >>> [(name, t["data_offsets"]) for name, t in tensors.items() if name != "__metadata__"]
    [('layer.1', [0, 32]), ('pad.2', [32, 4096]), ('layer.2', [4096, 4112])]
    """
    header: dict[str, object] = {
        "__metadata__": {"format": RANK_FILE_FORMAT, "version": "2", "world_size": str(world_size),
                         "manifest": "../shard_manifest.json"},
    }
    data_start = layers[0][1] if layers else 0
    at = data_start
    for layer, offset, chunk in layers:
        if offset > at:
            header[pad_tensor_name(layer)] = _u8(at - data_start, offset - data_start)
        header[layer_tensor_name(layer)] = _u8(offset - data_start, offset + chunk - data_start)
        at = offset + chunk
    return json.dumps(header, separators=(",", ":")).encode()


def plan_rank_file(chunks: Sequence[tuple[int, int]], world_size: int,
                   file_alignment: int) -> tuple[list[int], bytes]:
    """Where each layer's chunk goes in every rank file, and the header before them.

    `chunks` lists (layer, chunk_bytes) in file order. The first chunk starts at the end of the JSON
    header rounded up to `file_alignment`; each next one at the previous chunk's end rounded up the same way.

    >>> offsets, header = plan_rank_file([(1, 10), (2, 5000)], world_size=2, file_alignment=4096)
    >>> offsets, len(header)
    ([4096, 8192], 4096)
    """
    relative, at = [], 0
    for _, c in chunks:
        at = align_up(at, file_alignment)
        relative.append(at)
        at += c
    # Offsets relative to the first chunk do not depend on where it lands, so neither does the JSON.
    text = header_json([(layer, off, c) for (layer, c), off in zip(chunks, relative)], world_size)
    first = align_up(8 + len(text), file_alignment)
    offsets = [first + off for off in relative]
    return offsets, rank_file_header([(layer, off, c) for (layer, c), off in zip(chunks, offsets)], world_size)


def _u8(begin: int, end: int) -> dict[str, object]:
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


def header_json_bytes(header: bytes) -> int:
    """8 + the JSON's length: the rank file header without the spaces that pad it to the first chunk.

    >>> header_json_bytes(rank_file_header([(1, 4096, 32)], world_size=2)) < 4096
    True
    """
    return len(header.rstrip(b" "))


def check_rank_header(head: bytes, expected: bytes, path: object, file: str) -> None:
    """Refuse a rank file whose first bytes `head` are not the header `expected` (the manifest's
    `rank_header`): IntegrityError naming `path`, with `file` as the problem's file.

    >>> check_rank_header(b"abc", b"abc", "shards/rank-00000-of-00002.safetensors", "rank-0")
    """
    if head != expected:
        raise IntegrityError(f"{path}: its safetensors header is not the one the manifest implies (a rank file of "
                             "another conversion, or corrupt); copy it again", code="rank_header_mismatch",
                             file=file)

"""Independent reader for tests: rebuild targets from rank files using only the manifest JSON and numpy-free bytes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
          "U8": torch.uint8, "I64": torch.int64, "F64": torch.float64, "I32": torch.int32}


def rebuild_layers(out: str | Path) -> dict[str, torch.Tensor]:
    """name -> tensor for every target entry and fused view, read straight from the rank files."""
    out = Path(out)
    m = json.loads((out / "shard_manifest.json").read_text())
    files = [(out / rel).read_bytes() for rel in m["rank_files"]]
    result = {}
    for layer in m["layers"]:
        off, c = layer["file_offset"], layer["chunk_bytes"]
        flat = b"".join(f[off:off + c] for f in files)
        assert len(flat) == layer["total_bytes"]
        for e in [*layer["entries"], *layer["views"]]:
            dtype = DTYPES[e["dtype"]]
            n = 1
            for d in e["shape"]:
                n *= d
            nbytes = n * torch.tensor([], dtype=dtype).element_size()
            raw = bytearray(flat[e["offset"]:e["offset"] + nbytes])
            result[e["name"]] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(e["shape"])
    return result

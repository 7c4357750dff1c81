import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_cache(tmp_path_factory):
    """Session-wide cache of tiny checkpoints: (arch, sharded, layers) -> directory. Treat them as read-only."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("checkpoints")

    def get(arch: str = "llama", *, sharded: bool = False, layers: int = 3, **kw) -> Path:
        key = (arch, sharded, layers, tuple(sorted(kw.items())))
        if key not in cache:
            name = f"{arch}-{'sharded' if sharded else 'single'}-{layers}-{len(cache)}"
            cache[key] = make_checkpoint(root / name, arch, sharded=sharded, layers=layers, **kw)
        return cache[key]

    return get


@pytest.fixture
def world_of_one():
    """A torch.distributed gloo group of this process alone (for code that builds its own subgroup)."""
    import gc

    import torch.distributed as dist
    from spawn_group import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    gc.collect()  # the gatherer holds the group: free it before the group goes
    dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device; CI has none")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)

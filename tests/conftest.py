import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support.checkpoints import make_checkpoint  # noqa: E402


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


@pytest.fixture(scope="session")
def conversion_cache(tmp_path_factory):
    """Session-wide cache of conversions: (source, ranks, preset, options) -> OUT, converted once and shared.

    Each process converts a given argument set once (each xdist worker has its own cache) and hands every
    caller the same OUT. Read it; a test that writes into it (damage, an overwrite, a reshard into it) copies it
    first (shutil.copytree). A cached OUT that changed (a path added or gone, a file's inode, size or mtime)
    fails its next caller and the session's teardown, naming the tests it was handed to: chmod cannot guard it,
    as the suite may run as root.

    >>> out = conversion_cache(checkpoint_cache("llama", layers=4), 3, preset="llama")  # doctest: +SKIP
    """
    import shardprep

    cache: dict = {}
    root = tmp_path_factory.mktemp("conversions")

    def get(src: Path, ranks: int, *, preset: str | None = None, **options) -> Path:
        shared_badly = {"overwrite", "dry_run", "progress"} & options.keys()
        if shared_badly:
            raise TypeError(f"conversion_cache(): {', '.join(sorted(shared_badly))} has no place in a shared output; "
                            "call convert() for it")
        key = (str(src), ranks, preset, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in cache:
            out = root / f"{len(cache)}-{Path(src).name}-n{ranks}" / "out"
            out.parent.mkdir()  # a parent of its own: OUT's readers put their lock file beside it
            shardprep.convert(src, out, ranks, preset=preset, **options)
            cache[key] = _CachedOutput(out, _fingerprint(out))
        cached = cache[key]
        cached.check()
        cached.holders.append(os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0])
        return cached.out

    yield get
    changed = []
    for cached in cache.values():
        try:
            cached.check()
        except AssertionError as exc:
            changed.append(str(exc))
    assert not changed, "\n".join(changed)


def _fingerprint(out: Path) -> dict[str, tuple[int, int, int]]:
    # Not the mode: a test may chmod its own output's config.json, a hard link to the shared source's.
    seen = {}
    for path in sorted(out.rglob("*")):
        st = path.lstat()
        seen[path.relative_to(out).as_posix()] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return seen


@dataclass
class _CachedOutput:
    out: Path
    fingerprint: dict[str, tuple[int, int, int]]
    holders: list[str] = field(default_factory=list)  # the tests it was handed to, for the error

    def check(self) -> None:
        now = _fingerprint(self.out)
        differ = sorted(p for p in self.fingerprint.keys() | now.keys() if self.fingerprint.get(p) != now.get(p))
        # Hard links (copy mode auto) share files with the source checkpoint: a write there shows here too.
        assert not differ, (f"{self.out}: a shared conversion (conversion_cache) changed: {', '.join(differ)}; "
                            f"handed to {', '.join(self.holders)}: a test that writes copies it first")


@pytest.fixture
def world_of_one():
    """A torch.distributed gloo group of this process alone (for code that builds its own subgroup)."""
    import gc

    import torch.distributed as dist
    from support.spawn_group import free_port

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

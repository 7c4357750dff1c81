"""A local huggingface_hub cache holding a checkpoint as the hub's client lays one out, for the offline hub tests."""

import hashlib
import os


def make_hub_cache(cache, repo_id, src, commit="0123456789abcdef0123456789abcdef01234567"):
    """models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/main}."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        data = path.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / path.name)
    (repo_dir / "refs" / "main").write_text(commit)
    return commit

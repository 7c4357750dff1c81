"""The hub, in one place: what names a repo (`repo_id.py`), the local HF cache (`cache.py`), bounded HTTP reads of a
repo's files (`http.py`), and a repo's shard files fetched a window at a time for `convert` (`stream.py`).

Nothing here is imported by this package's `__init__`: `prep/source.py` imports `repo_id` and `cache`, and
`cache` may not import `source` back.
"""

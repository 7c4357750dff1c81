"""Does sharding pay: the arithmetic `plan`, `inspect`, the runtime's profile and the startup line share.

Per-rank memory (`accounting.py`), what a saving buys (`kv_cache.py`, `capacity.py`), the deployment's parallel
layout per GPU (`expert_parallel.py`), the step-time model (`step_time.py`), the profile file (`profile_format.py`),
the layer choice (`layer_choice.py`), and the plan drawn as a page (`report.py`, returning the page's text). Pure: no
torch, no file writes; it reads the format (`manifests/`).
"""

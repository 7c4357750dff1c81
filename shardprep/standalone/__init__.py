"""shardprep's own host, on the runtime without a server: `shardprep run` (launch, runner, the transformers
model, block-FP8 layers) and `shardprep profile` (profile, timing, resident weights).

>>> from shardprep.standalone.runner import serve  # doctest: +SKIP
"""

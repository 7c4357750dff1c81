"""The offline tools: read a HF checkpoint, plan where every byte goes, write the output; validate; inspect.

Nothing here imports torch (block-FP8 requantization on the CPU is numpy), so `pip install shardprep`
without torch converts, validates and inspects.
"""

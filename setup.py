"""The one compiled piece: the requant of one block-FP8 matrix (shardprep/requant/_block_requant.c).

Optional: without a C compiler the build goes on without it, and the requant runs in numpy instead
(same bytes, slower). Everything else is in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardprep.requant._block_requant",
            ["shardprep/requant/_block_requant.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
            optional=True,
        )
    ]
)

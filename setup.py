"""The one compiled piece: the requant's block loops (shardprep/requant/_block_lookup.c).

Optional: without a C compiler the build goes on without it, and the requant runs in numpy instead
(same bytes, slower). Everything else is in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardprep.requant._block_lookup",
            ["shardprep/requant/_block_lookup.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
            optional=True,
        )
    ]
)

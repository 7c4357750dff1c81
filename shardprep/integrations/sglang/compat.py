"""Everything that depends on SGLang's version (0.5.23): how a load format is registered.

SGLang's named load formats are a closed enum (`LoadFormat(name)` raises on an unknown name), but a `LoadConfig`
may carry a loader class instead (`get_model_loader`: `isinstance(load_format, type)`). So the name is added to
the command line's choices (`add_load_format_choices`, SGLang's own extension point), and a HookRegistry BEFORE
hook on `LoadConfig._verify_load_format` turns the name into the class before the enum sees it.
"""

from __future__ import annotations

from typing import Any

VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"


def register_load_format(name: str, loader: type) -> None:
    """Make `load_format=name` (Engine keyword, `--load-format` flag) select `loader`; idempotent.

    >>> register_load_format("shardprep", ShardprepModelLoader)  # doctest: +SKIP
    """
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if name in LOAD_FORMAT_CHOICES:
        return

    def name_to_class(config: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(config.load_format, str) and config.load_format.lower() == name:
            config.load_format = loader
        return None

    add_load_format_choices([name])
    HookRegistry.register(VERIFY_LOAD_FORMAT, name_to_class, HookType.BEFORE)

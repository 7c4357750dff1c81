"""docs/recipes.md read as data: each recipe's section (title, status, prose) and its block's commands, split as a
shell splits them. tests/project/test_recipes.py holds the recipes to shardprep's command line and to each other;
tests/vllm_engines/test_vllm_recipes.py and tests/sglang_engines/test_sglang_recipes.py to the servers' own
argument parsers and to the engine tests' configurations.
"""

from __future__ import annotations

import json
import re
import shlex
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
BLOCK = re.compile(r"^```bash recipe=(?P<id>[\w-]+)\n(?P<body>.*?)^```$", re.S | re.M)
NODE = re.compile(r"^# node (\d+)\b")


@dataclass
class Command:
    """One command of a block: its environment assignments, its argv, and the node it runs on (None: any)."""

    env: dict[str, str]
    argv: list[str]
    node: int | None

    @property
    def program(self) -> str:
        """`shardprep`, `vllm` or `sglang` (`python -m sglang.launch_server`)."""
        if self.argv[:3] == ["python", "-m", "sglang.launch_server"]:
            return "sglang"
        return self.argv[0]

    def server_args(self) -> list[str]:
        """The arguments after the program: `vllm serve MODEL ...`'s after `serve`, launch_server's after it."""
        return self.argv[3:] if self.program == "sglang" else self.argv[1:]

    def option(self, name: str) -> str | None:
        """The value given to `--name` (the last one), or None."""
        values = [self.argv[i + 1] for i, a in enumerate(self.argv[:-1]) if a == name]
        return values[-1] if values else None


@dataclass
class Recipe:
    id: str
    title: str
    server: str  # the `## ` section it sits in: vLLM, SGLang
    text: str  # the prose between its heading and its block
    commands: list[Command] = field(default_factory=list)

    @property
    def supported(self) -> bool:
        return self.text.lstrip().startswith("**Supported")

    def served(self) -> list[Command]:
        return [c for c in self.commands if c.program in ("vllm", "sglang")]

    def shardprep(self, command: str) -> Command | None:
        return next((c for c in self.commands if c.argv[:2] == ["shardprep", command]), None)


def commands(body: str) -> list[Command]:
    """A block's commands: continuation lines joined, `# node K:` comments placing the commands after them.

    >>> [(c.env, c.argv[:2], c.node) for c in commands("a 1\\n# node 0 (x):\\nX=1 b \\\\\\n  --c d\\n")]
    [({}, ['a', '1'], None), ({'X': '1'}, ['b', '--c'], 0)]
    """
    found, node, pending = [], None, ""
    for line in body.splitlines():
        if not pending and line.startswith("#"):
            match = NODE.match(line)
            node = int(match.group(1)) if match else node
            continue
        pending += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        argv = shlex.split(pending)
        pending = ""
        env = {}
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        if argv:
            found.append(Command(env, argv, node))
    return found


def read_recipes(page: Path = PAGE) -> dict[str, Recipe]:
    """Every recipe of the page by id, in order; a recipe without a block (one not yet supported) by its heading."""
    text = page.read_text()
    recipes: dict[str, Recipe] = {}
    server = ""
    for section in re.split(r"^(?=##+ )", text, flags=re.M):
        heading = section.splitlines()[0] if section.strip() else ""
        if heading.startswith("## "):
            server = heading[3:].strip()
        if not heading.startswith("### "):
            continue
        title = heading[4:].strip()
        block = BLOCK.search(section)
        prose = section[len(heading):block.start() if block else len(section)]
        key = block.group("id") if block else re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        recipes[key] = Recipe(key, title, server, prose.strip(), commands(block.group("body")) if block else [])
    return recipes


def configure_each(in_path: str, out_path: str, configure: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The servers' recipe_configs.py scripts: `configure(job)` for every job of IN (a JSON object of named jobs),
    each result, or the job's refusal as {"error": "Type: message"}, written to OUT by name."""
    results = {}
    for name, job in json.loads(open(in_path).read()).items():
        try:
            results[name] = configure(job)
        except BaseException as exc:  # argparse exits; any refusal is a result to compare
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)

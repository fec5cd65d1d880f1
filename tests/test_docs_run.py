"""Every ```python block of README.md and docs/*.md runs as written, in a fresh interpreter.

A block runs alone (its own imports, its own inputs) unless its first line says which block
it continues, in one of two forms:

    # continues the block above      the previous ```python block of the same page
    # continues the first block      the first ```python block of the same page

The continued block's own continuation is followed too, so a block runs after the chain of
blocks it rests on and nothing else. Any other first line that starts with `# continues` is
an error, as is a continuation with nothing to continue. Code that is not meant to run
(shell commands, output, signatures) sits in a fence that names another language
(```bash, ```text); a fence without a language is refused.

Each block runs in a fresh process after the blocks it continues, with no XLA_FLAGS and no
JAX_* variable (a block that another continues from above runs within that one's run,
ahead of it, rather than once more on its own): a block that needs 8 host devices makes
them itself (`jax.config.update("jax_num_cpu_devices", 8)` before JAX computes anything),
as a reader's script would.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

ABOVE, FIRST = "# continues the block above", "# continues the first block"
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# Packages of the optional extras (and beyond them) a block may import: a block that imports
# one missing here is skipped with the package named, never passed. `jax_dsrelu.flax` needs flax.
OPTIONAL = {"flax": "flax", "optax": "optax", "transformers": "transformers", "torch": "torch",
            "safetensors": "safetensors", "matplotlib": "matplotlib", "jax_dsrelu.flax": "flax"}
CPU_DEVICES = re.compile(r"""jax\.config\.update\(\s*["']jax_num_cpu_devices["']\s*,\s*(\d+)\s*\)""")
TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Block:
    name: str        # the page, relative to the repository root
    number: int      # 1-based among the page's ```python blocks
    line: int        # the Markdown line of the block's first line of code
    source: str
    continues: int | None  # the number of the block it continues, or None: it runs alone

    @property
    def id(self) -> str:
        return f"{self.name}-block{self.number}-line{self.line}"


def fences(text: str) -> list[tuple[str, int, str]]:
    """(info string, first code line, code) of every fenced code block, in order."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            # CommonMark: a fence indented by n spaces takes up to n spaces off each line.
            body.append(re.sub(rf"^ {{0,{indent}}}", "", lines[j]))
            j += 1
        found.append((opening["info"].strip(), i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return found


def python_blocks(text: str, name: str) -> list[Block]:
    """The page's ```python blocks, each with the block it continues; ValueError for a fence
    without a language or a continuation that names no earlier block."""
    blocks = []
    for info, line, code in fences(text):
        language = info.split()[0].lower() if info else ""
        if not language:
            raise ValueError(f"{name}:{line - 1}: a code fence without a language; name one "
                             "(```python to run it, ```bash or ```text otherwise)")
        if language not in ("python", "py", "python3"):
            continue
        number = len(blocks) + 1
        first = code.split("\n", 1)[0].strip()
        continues = None
        if first == ABOVE:
            continues = number - 1
        elif first == FIRST:
            continues = 1
        elif first.startswith("# continue"):
            raise ValueError(f"{name}:{line}: {first!r} is neither {ABOVE!r} nor {FIRST!r}")
        if continues is not None and not 1 <= continues < number:
            raise ValueError(f"{name}:{line}: {first!r}, but it is the page's first ```python block")
        blocks.append(Block(name, number, line, code, continues))
    return blocks


def chain(blocks: list[Block], block: Block) -> list[Block]:
    """The blocks to run for `block`, in order: what it continues, transitively, then itself."""
    run = [block]
    while run[0].continues is not None:
        run.insert(0, blocks[run[0].continues - 1])
    return run


def program(run: list[Block]) -> str:
    """One script that runs the blocks in one namespace; each is compiled under its page's
    name with its own line numbers, so a traceback points at the Markdown line."""
    padded = ["\n" * (b.line - 1) + b.source for b in run]
    steps = [f"exec(compile({code!r}, {b.name!r}, 'exec'), namespace)" for b, code in zip(run, padded)]
    return "namespace = {'__name__': '__main__'}\n" + "\n".join(steps) + "\n"


def fresh_environment() -> dict[str, str]:
    """This process's environment without what configures JAX before it starts (conftest.py
    sets XLA_FLAGS for 8 host devices; a block must not lean on it)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_")}
    # On a GPU this process already holds JAX's default share of the card: the block takes
    # what it uses instead. Where memory comes from, not what the block computes.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def run_blocks(run: list[Block]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", program(run)], cwd=ROOT, env=fresh_environment(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def report(run: list[Block], result: subprocess.CompletedProcess) -> str:
    ran = " then ".join(f"{b.name}:{b.line}" for b in run)
    return f"ran {ran}: exit status {result.returncode}\n{result.stderr[-6000:]}"


def missing_packages(run: list[Block]) -> list[str]:
    missing = set()
    for block in run:
        for node in ast.walk(ast.parse(block.source)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in modules:
                for prefix in (module, module.split(".")[0]):
                    if prefix in OPTIONAL and importlib.util.find_spec(OPTIONAL[prefix]) is None:
                        missing.add(OPTIONAL[prefix])
    return sorted(missing)


def read_pages() -> tuple[dict[str, list[Block]], list[str]]:
    pages, errors = {}, []
    for path in DOCUMENTS:
        try:
            pages[str(path.relative_to(ROOT))] = python_blocks(path.read_text(), str(path.relative_to(ROOT)))
        except ValueError as error:
            errors.append(str(error))
    return pages, errors


def runs(blocks: list[Block]) -> list[list[Block]]:
    """The chains to run so that each block runs after exactly the blocks it continues: a
    chain that begins a longer one (a block and what continues it from above) runs only as
    part of it, since each block of a run executes before any block after it. (A block that
    several others continue still runs in each of their chains.)"""
    chains = [chain(blocks, b) for b in blocks]
    return [c for c in chains if not any(len(o) > len(c) and o[:len(c)] == c for o in chains)]


PAGES, PAGE_ERRORS = read_pages()
BLOCKS = [b for blocks in PAGES.values() for b in blocks]
RUNS = [run for blocks in PAGES.values() for run in runs(blocks)]


def test_every_fence_names_its_language_and_every_continuation_an_earlier_block():
    assert not PAGE_ERRORS


def test_the_pages_hold_python_to_run():
    # So that the test below cannot pass by finding nothing to run.
    counts = {name: len(blocks) for name, blocks in PAGES.items() if blocks}
    assert counts.get("README.md", 0) >= 2 and counts.get("docs/moe.md", 0) >= 7, counts
    assert any(b.continues for b in BLOCKS) and any(CPU_DEVICES.search(b.source) for b in BLOCKS)


@pytest.mark.parametrize("run", RUNS, ids=lambda run: "+".join(b.id for b in run))
def test_blocks_run_in_a_fresh_interpreter(run):
    if missing := missing_packages(run):
        pytest.skip(f"imports {', '.join(missing)}, not installed here")
    needed = max((int(n) for b in run for n in CPU_DEVICES.findall(b.source)), default=1)
    if jax.default_backend() != "cpu" and jax.device_count() < needed:
        # The block makes its host devices itself; on an accelerator the mesh is built from
        # the accelerator's devices, as the page says.
        pytest.skip(f"needs {needed} devices: {needed} host devices on a CPU, but JAX's "
                    f"default backend here is {jax.default_backend()} with {jax.device_count()}")
    result = run_blocks(run)
    if result.returncode != 0:
        pytest.fail(report(run, result), pytrace=False)


# The test can fail: synthetic pages.

PAGE = """\
Text.

```python
x = 1
```

```bash
exit 1
```

```python
# continues the block above
assert x == 1
```

```python
assert "x" not in dir()
```

```python
# continues the first block
raise RuntimeError(f"x is {x}")
```
"""


def test_a_page_is_split_into_blocks_and_chains():
    blocks = python_blocks(PAGE, "page.md")
    assert [(b.number, b.line, b.continues) for b in blocks] == [(1, 4, None), (2, 12, 1), (3, 17, None), (4, 21, 1)]
    assert [b.number for b in chain(blocks, blocks[3])] == [1, 4]
    # Block 1 runs within block 2's run, before it: not on its own again.
    assert [[b.number for b in run] for run in runs(blocks)] == [[1, 2], [3], [1, 4]]
    assert all(run_blocks(chain(blocks, b)).returncode == 0 for b in blocks[:3])


def test_a_failing_block_is_reported_at_its_markdown_line():
    blocks = python_blocks(PAGE, "page.md")
    result = run_blocks(chain(blocks, blocks[3]))
    assert result.returncode != 0
    assert 'File "page.md", line 22' in result.stderr and "RuntimeError: x is 1" in result.stderr


def test_a_block_that_leans_on_another_without_saying_so_fails():
    page = "```python\nx = 1\n```\n\n```python\nprint(x)\n```\n"
    blocks = python_blocks(page, "page.md")
    assert blocks[1].continues is None
    result = run_blocks(chain(blocks, blocks[1]))
    assert result.returncode != 0 and "NameError" in result.stderr


def test_host_devices_come_from_the_block_not_from_this_process():
    # This process runs with XLA_FLAGS asking for 8 host devices (conftest.py); a block does not.
    assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")
    page = ("```python\nimport jax\nassert jax.device_count('cpu') == 8, jax.device_count('cpu')\n```\n\n"
            "```python\nimport jax\njax.config.update('jax_num_cpu_devices', 8)\n"
            "assert jax.device_count('cpu') == 8, jax.device_count('cpu')\n```\n")
    leaning, making = python_blocks(page, "page.md")
    result = run_blocks([leaning])
    assert result.returncode != 0 and "AssertionError: 1" in result.stderr
    assert run_blocks([making]).returncode == 0


@pytest.mark.parametrize("page, error", [
    ("```python\n# continues the block above\nx = 1\n```\n", "first ```python block"),
    ("```python\n# continues the first block\nx = 1\n```\n", "first ```python block"),
    ("```python\nx = 1\n```\n\n```python\n# continues the second block\n```\n", "is neither"),
    ("```\nx = 1\n```\n", "without a language"),
])
def test_a_continuation_to_nothing_or_an_unnamed_fence_is_refused(page, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        python_blocks(page, "page.md")


def test_optional_packages_are_named_when_missing(monkeypatch):
    (block,) = python_blocks("```python\nfrom jax_dsrelu.flax import MoE\nimport numpy\n```\n", "page.md")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert missing_packages([block]) == ["flax"]

"""Fails unless every test marked `compile` ran and passed in a pytest run's JUnit report.

Usage: python .ci/check_compile_tier.py JUNIT_XML

The tests marked `compile` are listed by pytest's own collection (`-m compile`), in this
interpreter, so the check needs no list of names kept by hand. A compile test that was
skipped (the GPU extras missing, CuTe DSL not importable), errored, failed or is absent
from the report fails the check, as does a collection that finds no compile test at all.
A whole test module skipped while collecting (`pytest.importorskip`) fails it too: its
compile tests, if any, are then not even collected, so nothing else here would see them.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ElementTree


def compile_tests() -> list[str]:
    """Node ids of the tests marked `compile`, as pytest collects them here."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "compile"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        sys.exit(f"collecting the compile tier failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return [line.strip() for line in done.stdout.splitlines() if "::" in line]


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) under which pytest's JUnit report records `node_id`."""
    path, *scopes, name = node_id.split("::")
    classname = path.removesuffix(".py").replace("/", ".")
    return ".".join([classname, *scopes]), name


def outcomes(junit_path: str) -> dict[tuple[str, str], str]:
    """(classname, name) -> "passed", "skipped", "error" or "failure"; a module skipped while
    collecting is recorded with classname "" and the module as its name."""
    results = {}
    for case in ElementTree.parse(junit_path).iter("testcase"):
        tags = [child.tag for child in case if child.tag in ("skipped", "error", "failure")]
        results[(case.get("classname"), case.get("name"))] = tags[0] if tags else "passed"
    return results


def main(junit_path: str) -> None:
    expected = compile_tests()
    if not expected:
        sys.exit("no test is marked `compile`: the compile tier cannot have run")
    recorded = outcomes(junit_path)
    skipped_modules = sorted(name for (classname, name), outcome in recorded.items() if not classname and outcome == "skipped")
    if skipped_modules:
        sys.exit(f"test modules skipped while collecting, with every extra installed: {', '.join(skipped_modules)}")
    bad = {node: recorded.get(junit_key(node), "absent from the report") for node in expected}
    bad = {node: outcome for node, outcome in bad.items() if outcome != "passed"}
    if bad:
        lines = "\n".join(f"  {node}: {outcome}" for node, outcome in sorted(bad.items()))
        sys.exit(f"{len(bad)} of {len(expected)} compile-tier tests did not pass:\n{lines}")
    print(f"compile tier: all {len(expected)} tests marked `compile` ran and passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

"""Tables of where the test suite's time goes, from pytest's JUnit XML (``pytest --junitxml=FILE``).

    python scripts/test_durations.py FILE [--top 40] [--wall SECONDS]

Prints Markdown: the total, the sum per test folder and the ``--top`` slowest test items (a test's time in the JUnit
file includes its set-up and tear-down, so a module-scoped fixture is charged to the first test that asks for it).
``--wall`` is the run's wall-clock time, for the line that compares it with the tests' summed time (they differ by
collection and, under pytest-xdist, by the workers running side by side). docs/testing.md holds its output.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def read_cases(path: str) -> list[tuple[str, str, float]]:
    """(test file, test name, seconds) per test item of a JUnit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # classname is the dotted path of the module (plus a class, when the test is a method)
        file_parts = [p for p in parts if not p[:1].isupper()]
        out.append(("/".join(file_parts) + ".py", case.get("name", ""), float(case.get("time", 0.0))))
    return out


def folder_of(test_file: str) -> str:
    """``tests/cluster/test_x.py`` -> ``tests/cluster``."""
    return test_file.rsplit("/", 1)[0]


def tables(cases: list[tuple[str, str, float]], top: int, wall: float | None = None) -> str:
    total = sum(t for *_, t in cases)
    per_folder: dict[str, list[float]] = collections.defaultdict(list)
    for f, _, t in cases:
        per_folder[folder_of(f)].append(t)
    lines = [f"{len(cases)} test items, {total:.0f} s summed ({total / 60:.1f} min)"
             + (f"; wall clock {wall:.0f} s ({wall / 60:.1f} min)" if wall else "") + ".", "",
             "| folder | tests | seconds | share |", "| --- | ---: | ---: | ---: |"]
    for folder, times in sorted(per_folder.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {folder} | {len(times)} | {sum(times):.1f} | {sum(times) / total:.0%} |")
    slowest = sorted(cases, key=lambda c: -c[2])[:top]
    share = sum(t for *_, t in slowest) / total if total else 0.0
    lines += ["", f"The {len(slowest)} slowest test items ({share:.0%} of the summed time):", "",
              "| seconds | test |", "| ---: | --- |"]
    lines += [f"| {t:.1f} | `{f}::{name}` |" for f, name, t in slowest]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit_xml")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--wall", type=float, default=None, help="the run's wall-clock seconds")
    args = ap.parse_args()
    print(tables(read_cases(args.junit_xml), args.top, args.wall))


if __name__ == "__main__":
    main()

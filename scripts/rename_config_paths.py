"""One-off rewrite of the old config paths to flag = attribute path (issue 26, part 1). Idempotent.

    python scripts/rename_config_paths.py [--check] [PATH ...]   # default: openrlhf_shape tests scripts benchmarks examples docs configs

Rewrites, from the table in ``openrlhf_shape/config/compat.py`` (``DEPRECATED``):

* accessors on a config object: ``cfg.trainer.num_steps`` -> ``cfg.train.num_steps``,
  ``self.cfg.megatron.lr`` -> ``self.cfg.actor.adam.lr`` (any receiver ending in ``cfg``/``config``);
* flag strings: ``--trainer.num_steps`` -> ``--train.num_steps`` (.py, .sh, .md, .yaml);
* quoted dotted keys in Python: ``"trainer.num_steps"`` -> ``"train.num_steps"``.

A line containing ``old-names`` (a test that the old names still work) is left as it is.

It cannot see a section bound to a local name (``r = cfg.rollout; r.rollout_batch_size``) nor a
whole section handed on (``cfg.sampling``, ``cfg.engine``): ``--check`` lists what is left to do by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openrlhf_shape.config.compat import DEPRECATED  # noqa: E402

# Accessors differ from flags where the new field is computed: the world size is a property now.
ACCESSORS = {**DEPRECATED, "megatron.world_size": "actor.world_size"}
FLAG_NAMES = {k: v for k, v in DEPRECATED.items() if "[" not in v}  # megatron.world_size N: N ranks on one node
assert not set(ACCESSORS.values()) & set(ACCESSORS), "a new path is also an old one: not idempotent"

_RECV = r"(\b(?:[A-Za-z_]\w*\.)*\w*(?:cfg|config)(?:\(\))?)"
ACCESSOR_RE = re.compile(_RECV + r"\.(" + "|".join(sorted(map(re.escape, ACCESSORS), key=len, reverse=True)) + r")\b(?![\w(])")
FLAG_RE = re.compile(r"--(" + "|".join(sorted(map(re.escape, FLAG_NAMES), key=len, reverse=True)) + r")\b(?![\w.])")
QUOTED_RE = re.compile(r"([\"'])(" + "|".join(sorted(map(re.escape, FLAG_NAMES), key=len, reverse=True)) + r")\1")
LEFT_RE = re.compile(r"\bcfg\.(sampling|engine|trainer)\b|\.probe_config\(\)|\bcfg\.rollout\.rollout_batch_size")
SUFFIXES = {".py", ".sh", ".md", ".yaml", ".yml"}
# the old-name tables themselves, and the eval command's own config (EvalConfig has an ``engine`` section)
SKIP = ("openrlhf_shape/config/compat.py", "openrlhf_shape/config/load.py", "scripts/rename_config_paths.py",
        "openrlhf_shape/eval/", "openrlhf_shape/cli/evaluate.py", "tests/eval/")


def rewrite(text: str, suffix: str) -> str:
    """``text`` with the old paths renamed; a line marked ``old-names`` (a test of them) is kept."""
    return "\n".join(line if "old-names" in line else _rewrite_line(line, suffix) for line in text.split("\n"))


def _rewrite_line(text: str, suffix: str) -> str:
    if suffix == ".py":
        text = ACCESSOR_RE.sub(lambda m: f"{m.group(1)}.{ACCESSORS[m.group(2)]}", text)
        text = QUOTED_RE.sub(lambda m: f"{m.group(1)}{FLAG_NAMES[m.group(2)]}{m.group(1)}", text)
    return FLAG_RE.sub(lambda m: f"--{FLAG_NAMES[m.group(1)]}", text)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    roots = [a for a in argv if a != "--check"] or ["openrlhf_shape", "tests", "scripts", "benchmarks", "examples",
                                                    "docs", "configs", "README.md"]
    changed, left = 0, []
    for root in roots:
        base = ROOT / root
        for path in ([base] if base.is_file() else sorted(base.rglob("*"))):
            rel = str(path.relative_to(ROOT))
            if path.suffix not in SUFFIXES or rel.startswith(SKIP) or not path.is_file():
                continue
            text = path.read_text()
            new = rewrite(text, path.suffix)
            if new != text:
                changed += 1
                if not check:
                    path.write_text(new)
                print(("would rewrite " if check else "rewrote ") + rel)
            if path.suffix == ".py":
                left += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(new.splitlines(), 1) if LEFT_RE.search(line)]
    print(f"{changed} file(s) {'to rewrite' if check else 'rewritten'}; {len(left)} line(s) to check by hand:")
    print("\n".join(left))
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

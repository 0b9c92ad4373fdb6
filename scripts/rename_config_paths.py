"""One-off rewrite of the old config paths to flag = attribute path (issue 26, part 1). Idempotent.

    python scripts/rename_config_paths.py [--check] [PATH ...]   # default: openrlhf_shape tests scripts benchmarks examples docs configs

Rewrites, from the table in ``openrlhf_shape/config/compat.py`` (``DEPRECATED``):

* accessors on a config object: ``cfg.trainer.num_steps`` -> ``cfg.train.num_steps``,
  ``self.cfg.megatron.lr`` -> ``self.cfg.actor.adam.lr`` (any receiver ending in ``cfg``/``config``);
* flag strings: ``--trainer.num_steps`` -> ``--train.num_steps`` (.py, .sh, .md, .yaml);
* quoted dotted keys in Python: ``"trainer.num_steps"`` -> ``"train.num_steps"``;
* the planner's former ``RunShape`` reads in ``openrlhf_shape/planner/``: ``rs.world_size`` -> ``cfg.actor.world_size``;
* YAML presets: the ``shape:`` keys that moved (``estimator`` -> ``algo.advantage``, ``num_probes`` /
  ``probe_max_tokens`` -> ``probe.num_probes`` / ``probe.max_tokens``); other old keys of a preset are listed.

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
RUN_SHAPE = {  # planner/run_shape.py's RunShape field -> the TrainConfig expression (the planner reads cfg now)
    "pretrain": "cfg.actor.model_name_or_path", "rollout_batch_size": "cfg.rollout.batch_size",
    "n_samples": "cfg.rollout.n_samples_per_prompt", "max_prompt_len": "cfg.data.max_prompt_len",
    "max_new_tokens": "cfg.rollout.max_new_tokens", "max_model_len": "cfg.max_model_len()",
    "num_engines": "cfg.vllm.num_engines", "engine_tp": "cfg.vllm.tensor_parallel_size",
    "gpu_memory_utilization": "cfg.vllm.gpu_memory_utilization", "kv_cache_gib": "cfg.vllm.kv_cache_gib",
    "colocate": "cfg.train.colocate_all", "train_batch_size": "cfg.train.batch_size", "max_epochs": "cfg.train.max_epochs",
    "micro_batch_max_tokens": "cfg.train.max_tokens_per_gpu", "entropy_chunk_size": "cfg.actor.entropy_chunk_size",
    "tp": "cfg.megatron.tensor_model_parallel_size", "pp": "cfg.megatron.pipeline_model_parallel_size",
    "world_size": "cfg.actor.world_size", "sequence_parallel": "cfg.megatron.sequence_parallel",
    "distributed_optimizer": "cfg.megatron.use_distributed_optimizer",
    "recompute": "cfg.actor.gradient_checkpointing_enable", "gpus_per_rank": "cfg.megatron.gpus_per_rank",
    "estimator": "cfg.algo.advantage.estimator", "num_segments": "cfg.shape.num_segments",
    "num_probes": "cfg.probe.num_probes", "probe_max_tokens": "cfg.probe.max_tokens",
    "think_suffix": "cfg.probe.think_suffix", "backend": "cfg.actor.backend", "zero_stage": "cfg.ds.zero_stage",
    "adam_offload": "cfg.ds.adam_offload",
}
RUN_SHAPE_RE = re.compile(r"\brs\.(" + "|".join(RUN_SHAPE) + r")\b(?!\()")
# the old-name tables themselves, and the eval command's own config (EvalConfig has an ``engine`` section)
SKIP = ("openrlhf_shape/config/compat.py", "openrlhf_shape/config/load.py", "scripts/rename_config_paths.py",
        "openrlhf_shape/eval/", "openrlhf_shape/cli/evaluate.py", "tests/eval/")


def rewrite(text: str, suffix: str, rel: str = "") -> str:
    """``text`` with the old paths renamed; a line marked ``old-names`` (a test of them) is kept."""
    if rel.startswith("openrlhf_shape/planner/"):
        text = RUN_SHAPE_RE.sub(lambda m: RUN_SHAPE[m.group(1)], text)
    if rel.startswith("configs/") and suffix in (".yaml", ".yml"):
        text = _preset(text)
    return "\n".join(line if "old-names" in line else _rewrite_line(line, suffix) for line in text.split("\n"))


def _preset(text: str) -> str:
    """Move ``shape.estimator`` / ``shape.num_probes`` / ``shape.probe_max_tokens`` of a preset (comments kept)."""
    moved: dict[str, str] = {}
    out, section = [], None
    for line in text.split("\n"):
        top = re.match(r"^(\w+):", line)
        section = top.group(1) if top else section
        key = re.match(r"^  (estimator|num_probes|probe_max_tokens):\s*(.*)$", line) if section == "shape" else None
        if key:
            moved[key.group(1)] = key.group(2)
            continue
        out.append(line)
    text = "\n".join(out)
    if "estimator" in moved:
        text = re.sub(r"(?m)^shape:", f"algo:\n  advantage:\n    estimator: {moved['estimator']}\nshape:", text, count=1)
    probe = "".join(f"  {new}: {moved[old]}\n" for old, new in (("num_probes", "num_probes"), ("probe_max_tokens", "max_tokens"))
                    if old in moved)
    if probe and re.search(r"(?m)^probe:\n", text):
        text = re.sub(r"(?m)^probe:\n", "probe:\n" + probe, text, count=1)
    elif probe:
        text = text.rstrip("\n") + "\nprobe:\n" + probe
    return text


def _rewrite_line(text: str, suffix: str) -> str:
    if suffix == ".py":
        text = ACCESSOR_RE.sub(lambda m: f"{m.group(1)}.{ACCESSORS[m.group(2)]}", text)
        text = QUOTED_RE.sub(lambda m: f"{m.group(1)}{FLAG_NAMES[m.group(2)]}{m.group(1)}", text)
    return FLAG_RE.sub(lambda m: f"--{FLAG_NAMES[m.group(1)]}", text)


def _old_preset_keys(text: str) -> list[str]:
    import yaml

    def walk(node, prefix=""):
        for k, v in (node or {}).items():
            if isinstance(v, dict) and f"{prefix}{k}" not in DEPRECATED:
                yield from walk(v, f"{prefix}{k}.")
            elif f"{prefix}{k}" in DEPRECATED:
                yield f"{prefix}{k}"

    return list(walk(yaml.safe_load(text)))


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
            new = rewrite(text, path.suffix, rel)
            if new != text:
                changed += 1
                if not check:
                    path.write_text(new)
                print(("would rewrite " if check else "rewrote ") + rel)
            if rel.startswith("configs/") and path.suffix == ".yaml":
                left += [f"{rel}: old key {k}" for k in _old_preset_keys(new)]
            if path.suffix == ".py":
                left += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(new.splitlines(), 1) if LEFT_RE.search(line)]
    print(f"{changed} file(s) {'to rewrite' if check else 'rewritten'}; {len(left)} line(s) to check by hand:")
    print("\n".join(left))
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Prompt datasets for RL rollouts, in OpenRLHF's data formats, and a resumable batch iterator.

Sources (``--data.prompt_dataset``): a local ``.jsonl`` / ``.json`` / ``.parquet`` file, or a
Hugging Face dataset id (only when the ``datasets`` package is importable). The options follow
OpenRLHF 0.11's flags where the meaning is the same:

    --data.prompt_dataset      path or HF dataset id
    --data.prompt_split        HF split (default "train"; a local file is one split)
    --data.input_key           field holding the prompt: a string, or a list of chat messages
                               ({"role", "content"}) when --data.apply_chat_template is on (default "input")
    --data.label_key           field holding the label (the reference answer); default none -> ""
    --data.apply_chat_template render with tokenizer.apply_chat_template(add_generation_prompt=True)
    --data.input_template      template with one "{}" (str.format, OpenRLHF's) or "{question}" for the
                               prompt text (:func:`fill_template`, shared with ``eval --prompt_template``)
    --data.system_prompt       optional system message (chat template only)
    --data.max_prompt_len      drop prompts longer than this many tokens (counted and logged)
    --data.max_samples         keep at most this many rows (before shuffling)

One departure from OpenRLHF: ``input_template`` is also applied to the user message when the chat
template is on (OpenRLHF ignores it then); this is how an instruction such as "put the final answer
in \\boxed{}" is added to a plain question set.

:class:`PromptBatcher` yields the dataset in a seeded per-epoch shuffle; ``state_dict()`` holds
(epoch, position) so a resumed run continues with exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

logger = logging.getLogger(__name__)

_DATA_DIR = Path(__file__).resolve().parent
BUNDLED_SPLITS = ("train", "test")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def bundled_math_path(split: str | None = None) -> str:
    """Path of the bundled small maths set (fields id, question, answer, difficulty, split, source).

    ``split``: ``"train"`` (400 problems), ``"test"`` (100) or ``None`` for both in one file.
    Use it with ``input_key="question"``, ``label_key="answer"``.
    """
    if split is None:
        path = _DATA_DIR / "bundled_math.jsonl"
    elif split in BUNDLED_SPLITS:
        path = _DATA_DIR / f"bundled_math_{split}.jsonl"
    else:
        raise ValueError(f"bundled maths split {split!r} does not exist; choose one of {BUNDLED_SPLITS} or None")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the package; regenerate it with scripts/make_math_set.py")
    return str(path)


QUESTION_PLACEHOLDER = "{question}"


def fill_template(template: str | None, text: str) -> str:
    """``text`` inside ``template`` (None: ``text`` as is): the one prompt-template renderer of the
    training data (``--data.input_template``) and of ``eval`` (``--prompt_template``).

    Two placeholder forms: ``{question}`` (every other character literal, e.g. ``\\boxed{}``), or
    OpenRLHF's one ``{}`` filled by ``str.format`` (literal braces doubled, ``\\boxed{{}}``).
    """
    if template is None:
        return text
    if QUESTION_PLACEHOLDER in template:
        return template.replace(QUESTION_PLACEHOLDER, text)
    return template.format(text)


def check_template(template: str, flag: str) -> None:
    """Refuse a template :func:`fill_template` cannot fill, naming ``flag`` and the fix."""
    if QUESTION_PLACEHOLDER in template:
        return
    try:
        rendered = template.format("PROMPT")
    except (IndexError, KeyError, ValueError) as exc:
        raise ValueError(
            f"{flag} {template!r} must contain '{QUESTION_PLACEHOLDER}', or exactly one '{{}}' "
            f"(then literal braces doubled, e.g. '\\\\boxed{{{{}}}}'): {exc}"
        ) from None
    if "PROMPT" not in rendered:
        raise ValueError(f"{flag} {template!r} has no '{QUESTION_PLACEHOLDER}' or '{{}}' for the prompt")


@dataclass
class PromptDataConfig:
    """The ``--data.*`` options for prompt datasets (validated by :meth:`validate`)."""

    prompt_dataset: str = ""
    input_key: str = "input"
    label_key: str | None = None
    apply_chat_template: bool = False
    input_template: str | None = None
    system_prompt: str | None = None
    max_prompt_len: int | None = None
    prompt_split: str = "train"
    max_samples: int | None = None

    def validate(self) -> "PromptDataConfig":
        if not self.prompt_dataset:
            raise ValueError("--data.prompt_dataset is required (a .jsonl/.json/.parquet file or an HF dataset id)")
        if not self.input_key:
            raise ValueError("--data.input_key must name the prompt field, e.g. --data.input_key question")
        if self.input_template is not None:
            check_template(self.input_template, "--data.input_template")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("--data.system_prompt needs --data.apply_chat_template (a system message is a chat turn)")
        if self.max_prompt_len is not None and self.max_prompt_len <= 0:
            raise ValueError(f"--data.max_prompt_len must be a positive number of tokens, got {self.max_prompt_len}")
        if self.max_samples is not None and self.max_samples <= 0:
            raise ValueError(f"--data.max_samples must be positive, got {self.max_samples}")
        return self


@dataclass(frozen=True)
class PromptItem:
    """One prompt: ``index`` is its row in the source file (stable across shuffles and resumes)."""

    index: int
    prompt: str
    prompt_ids: tuple[int, ...]
    label: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def load_rows(source: str, split: str = "train") -> list[dict[str, Any]]:
    """Read the raw rows of a local jsonl/json/parquet file or an HF dataset id (``--data.prompt_dataset``)."""
    path = Path(source).expanduser()
    if path.is_file():
        return _load_local(path)
    if path.exists():
        raise ValueError(f"--data.prompt_dataset {source}: a directory is not supported; pass a file {LOCAL_SUFFIXES}")
    parts = source.split("/")
    hub_id = len(parts) == 2 and all(parts) and not source.startswith((".", "~"))
    if path.suffix in LOCAL_SUFFIXES or os.sep in source and not hub_id:
        raise FileNotFoundError(f"--data.prompt_dataset {source}: file not found")
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"--data.prompt_dataset {source!r} is not a local file, and loading a Hugging Face dataset id needs "
            f"the 'datasets' package: pip install datasets, or pass a local .jsonl/.json/.parquet file"
        ) from None
    return [dict(row) for row in datasets.load_dataset(source, split=split)]


def _load_local(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"--data.prompt_dataset {path}: line {lineno} is not valid JSON ({exc})") from None
    elif suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]} / {"train": [...]}
        if not isinstance(data, list):
            raise ValueError(f"--data.prompt_dataset {path}: a .json file must hold a list of objects")
        rows = data
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"--data.prompt_dataset {path}: unsupported file type {suffix!r}; use one of {LOCAL_SUFFIXES}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"--data.prompt_dataset {path}: row {i} is {type(row).__name__}, expected an object")
    return rows


def _render(row: dict[str, Any], cfg: PromptDataConfig, tokenizer, where: str) -> str:
    value = row[cfg.input_key]
    if cfg.apply_chat_template:
        if isinstance(value, str):
            text = fill_template(cfg.input_template, value)
            messages = [{"role": "user", "content": text}]
        elif isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
            messages = [dict(m) for m in value]
            if cfg.input_template:
                last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
                if last_user is not None:
                    messages[last_user]["content"] = fill_template(cfg.input_template, messages[last_user]["content"])
        else:
            raise ValueError(
                f"--data.input_key '{cfg.input_key}' in {where} must be a string or a list of "
                f"{{'role', 'content'}} messages, got {type(value).__name__}"
            )
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("--data.apply_chat_template: the tokenizer has no chat template")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(value, str):
        raise ValueError(
            f"--data.input_key '{cfg.input_key}' in {where} is a {type(value).__name__}; a list of chat "
            f"messages needs --data.apply_chat_template"
        )
    return fill_template(cfg.input_template, value)


class PromptDataset:
    """Rendered, tokenised, length-filtered prompts. ``len()`` and ``[i]`` give :class:`PromptItem`.

    ``tokenizer``: a Hugging Face tokenizer. Prompt token ids are those of the rendered text with no
    special tokens added (a chat template already writes them). ``num_filtered`` counts the prompts
    dropped by ``max_prompt_len``; ``num_rows`` the rows read.
    """

    def __init__(self, cfg: PromptDataConfig, tokenizer, *, rows: Sequence[dict[str, Any]] | None = None):
        self.cfg = cfg.validate()
        where = cfg.prompt_dataset
        raw = list(rows) if rows is not None else load_rows(cfg.prompt_dataset, cfg.prompt_split)
        if cfg.max_samples is not None:
            raw = raw[: cfg.max_samples]
        if not raw:
            raise ValueError(f"--data.prompt_dataset {where} holds no rows")
        keys = sorted(raw[0].keys())
        if cfg.input_key not in raw[0]:
            raise KeyError(f"--data.input_key '{cfg.input_key}' not found in {where} (keys: {', '.join(keys)})")
        if cfg.label_key is not None and cfg.label_key not in raw[0]:
            raise KeyError(f"--data.label_key '{cfg.label_key}' not found in {where} (keys: {', '.join(keys)})")
        self.num_rows = len(raw)
        self.num_filtered = 0
        self.items: list[PromptItem] = []
        for index, row in enumerate(raw):
            for key, flag in ((cfg.input_key, "input_key"), (cfg.label_key, "label_key")):
                if key is not None and key not in row:
                    raise KeyError(f"--data.{flag} '{key}' missing in row {index} of {where} (keys: {', '.join(sorted(row))})")
            prompt = _render(row, cfg, tokenizer, where)
            ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if cfg.max_prompt_len is not None and len(ids) > cfg.max_prompt_len:
                self.num_filtered += 1
                continue
            label = "" if cfg.label_key is None else row[cfg.label_key]
            label = label if isinstance(label, str) else json.dumps(label) if isinstance(label, (list, dict)) else str(label)
            extra = {k: v for k, v in row.items() if k not in (cfg.input_key, cfg.label_key)}
            self.items.append(PromptItem(index=index, prompt=prompt, prompt_ids=ids, label=label, extra=extra))
        if self.num_filtered:
            logger.warning(
                "--data.max_prompt_len %d dropped %d of %d prompts from %s",
                cfg.max_prompt_len, self.num_filtered, self.num_rows, where,
            )
        if not self.items:
            raise ValueError(
                f"--data.max_prompt_len {cfg.max_prompt_len} dropped all {self.num_rows} prompts of {where}; raise it"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


class PromptBatcher:
    """Endless batches of :class:`PromptItem` in a seeded shuffle that changes every epoch.

    Epoch ``e`` uses the permutation ``random.Random(seed + e)`` makes of ``range(len(dataset))``.
    Batches never straddle epochs: ``drop_last=True`` (default) skips the tail that does not fill a
    batch, so every batch has exactly the prompts asked for (``batch_size`` unless :meth:`next_batch` is given a
    size). ``state_dict()`` = {epoch, position, seed, dataset_size, batch_size}; loading it resumes with the very
    next batch.
    """

    def __init__(self, dataset: PromptDataset | Sequence[PromptItem], batch_size: int, seed: int = 42,
                 *, shuffle: bool = True, drop_last: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise ValueError(
                f"rollout batch size {batch_size} exceeds the {len(dataset)} prompts of the dataset; "
                "lower it or add prompts"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(order)
            self._order = order
        return self._order


    def next_batch(self, size: int | None = None) -> list[PromptItem]:
        """The next ``size`` prompts (default ``batch_size``; dynamic filtering's refills ask for the groups still
        missing); advances (epoch, position). Under ``drop_last`` an epoch's tail shorter than ``size`` is skipped."""
        size = self.batch_size if size is None else size
        if size < 1:
            raise ValueError(f"a batch of {size} prompts: ask for at least one")
        order = self._epoch_order()
        remaining = len(order) - self.position
        if remaining <= 0 or (self.drop_last and remaining < size):
            self.epoch += 1
            self.position = 0
            self._order = None
            order = self._epoch_order()
        picked = order[self.position : self.position + size]
        self.position += len(picked)
        return [self.dataset[i] for i in picked]

    def __iter__(self) -> Iterator[list[PromptItem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_size": len(self.dataset), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("dataset_size", len(self.dataset)) != len(self.dataset):
            raise ValueError(
                f"cannot resume the prompt order: the checkpoint saw {state['dataset_size']} prompts, the dataset now "
                f"has {len(self.dataset)} (did --data.prompt_dataset, --data.max_prompt_len or --data.max_samples change?)"
            )
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"cannot resume the prompt order: seed {state['seed']} in the checkpoint, {self.seed} now")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None


def build_prompt_dataset(cfg: PromptDataConfig, tokenizer) -> PromptDataset:
    """Load, render, tokenise and filter ``cfg.prompt_dataset`` (see :class:`PromptDataset`)."""
    return PromptDataset(cfg, tokenizer)

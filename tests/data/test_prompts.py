"""Prompt datasets: formats, key errors, chat template, length filter, resumable batch order."""

from __future__ import annotations

import json
import logging

import pytest

from openrlhf_shape.data.prompts import (
    PromptBatcher,
    PromptDataConfig,
    PromptDataset,
    bundled_math_path,
    load_rows,
)

ROWS = [
    {"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "level": i % 3} for i in range(23)
]


def _write(tmp_path, fmt: str, rows=ROWS):
    path = tmp_path / f"prompts.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_each_local_format_loads_the_same_items(tmp_path, tokenizer, fmt):
    path = _write(tmp_path, fmt)
    ds = PromptDataset(PromptDataConfig(str(path), input_key="question", label_key="answer"), tokenizer)
    assert len(ds) == len(ROWS) and ds.num_filtered == 0
    for item, row in zip(ds, ROWS):
        assert item.prompt == row["question"]
        assert item.label == row["answer"]
        assert list(item.prompt_ids) == tokenizer(row["question"], add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(list(item.prompt_ids)) == row["question"]
        assert item.extra == {"level": row["level"]}
    assert [it.index for it in ds] == list(range(len(ROWS)))


def test_json_wrapped_in_one_key_and_max_samples(tmp_path, tokenizer):
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"data": ROWS}))
    ds = PromptDataset(PromptDataConfig(str(path), input_key="question", max_samples=5), tokenizer)
    assert len(ds) == 5 and ds[0].label == ""


def test_missing_keys_name_the_flag_and_list_the_keys(tmp_path, tokenizer):
    path = _write(tmp_path, "jsonl")
    with pytest.raises(KeyError) as err:
        PromptDataset(PromptDataConfig(str(path)), tokenizer)  # OpenRLHF's default input_key "input"
    msg = str(err.value)
    assert "--data.input_key 'input' not found in" in msg and str(path) in msg and "answer, level, question" in msg
    with pytest.raises(KeyError, match="--data.label_key 'label' not found"):
        PromptDataset(PromptDataConfig(str(path), input_key="question", label_key="label"), tokenizer)


def test_bad_sources_and_options_raise_clear_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="--data.prompt_dataset"):
        load_rows(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_rows(str(bad))
    with pytest.raises(ValueError, match="--data.input_template"):
        PromptDataConfig("x.jsonl", input_template="no placeholder").validate()
    with pytest.raises(ValueError, match="--data.system_prompt needs --data.apply_chat_template"):
        PromptDataConfig("x.jsonl", system_prompt="be brief").validate()
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install datasets"):
            load_rows("someorg/some-dataset")


def test_chat_template_system_prompt_and_input_template(tmp_path, tokenizer):
    path = _write(tmp_path, "jsonl")
    cfg = PromptDataConfig(
        str(path), input_key="question", label_key="answer", apply_chat_template=True,
        input_template="{}\nPut the final answer in \\boxed{{}}.", system_prompt="You are careful.",
    )
    ds = PromptDataset(cfg, tokenizer)
    q = ROWS[3]["question"]
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are careful."},
         {"role": "user", "content": q + "\nPut the final answer in \\boxed{}."}],
        tokenize=False, add_generation_prompt=True,
    )
    assert ds[3].prompt == expected
    assert ds[3].prompt.startswith("<|im_start|>system\nYou are careful.<|im_end|>\n<|im_start|>user\n")
    assert ds[3].prompt.endswith("<|im_start|>assistant\n")
    # the ChatML special tokens are single ids in the prompt ids
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ds[3].prompt_ids.count(im_start) == 3


def test_chat_message_lists_are_accepted(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "label": "1"}]
    path = _write(tmp_path, "jsonl", rows)
    ds = PromptDataset(PromptDataConfig(str(path), input_key="messages", label_key="label",
                                        apply_chat_template=True), tokenizer)
    assert ds[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="needs --data.apply_chat_template"):
        PromptDataset(PromptDataConfig(str(path), input_key="messages"), tokenizer)


def test_length_filter_counts_and_logs(tmp_path, tokenizer, caplog):
    rows = [{"question": "one two " * n, "answer": str(n)} for n in range(1, 21)]
    path = _write(tmp_path, "jsonl", rows)
    lengths = [len(tokenizer(r["question"], add_special_tokens=False)["input_ids"]) for r in rows]
    limit = sorted(lengths)[12]
    with caplog.at_level(logging.WARNING, logger="openrlhf_shape.data.prompts"):
        ds = PromptDataset(PromptDataConfig(str(path), input_key="question", label_key="answer",
                                            max_prompt_len=limit), tokenizer)
    expected_kept = sum(n <= limit for n in lengths)
    assert len(ds) == expected_kept and ds.num_filtered == len(rows) - expected_kept > 0
    assert all(len(it.prompt_ids) <= limit for it in ds)
    assert f"dropped {ds.num_filtered} of 20 prompts" in caplog.text
    with pytest.raises(ValueError, match="dropped all 20"):
        PromptDataset(PromptDataConfig(str(path), input_key="question", max_prompt_len=1), tokenizer)


def _order(batcher: PromptBatcher, n: int) -> list[list[int]]:
    return [[it.index for it in batcher.next_batch()] for _ in range(n)]


@pytest.mark.parametrize("stop_after", [1, 4, 5, 9])
def test_resumed_batcher_continues_the_uninterrupted_order(tmp_path, tokenizer, stop_after):
    path = _write(tmp_path, "jsonl")
    ds = PromptDataset(PromptDataConfig(str(path), input_key="question", label_key="answer"), tokenizer)
    total = 12  # 23 prompts, batch 5 -> 4 batches per epoch: crosses two epoch boundaries
    full = _order(PromptBatcher(ds, batch_size=5, seed=7), total)

    first = PromptBatcher(ds, batch_size=5, seed=7)
    head = _order(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptBatcher(ds, batch_size=5, seed=7)
    resumed.load_state_dict(state)
    assert head + _order(resumed, total - stop_after) == full


def test_batcher_epochs_are_full_permutations_that_differ(tmp_path, tokenizer):
    path = _write(tmp_path, "jsonl")
    ds = PromptDataset(PromptDataConfig(str(path), input_key="question"), tokenizer)
    b = PromptBatcher(ds, batch_size=5, seed=0)
    epoch0 = sum(_order(b, 4), [])
    assert b.state_dict()["epoch"] == 0
    epoch1 = sum(_order(b, 4), [])
    assert b.state_dict()["epoch"] == 1
    assert len(set(epoch0)) == 20 and len(set(epoch1)) == 20 and epoch0 != epoch1
    assert PromptBatcher(ds, 5, seed=1).next_batch() != PromptBatcher(ds, 5, seed=0).next_batch()
    with pytest.raises(ValueError, match="dataset now has"):
        PromptBatcher(ds, 5, seed=0).load_state_dict({**b.state_dict(), "dataset_size": 99})


def test_bundled_math_loads_as_a_prompt_dataset(tokenizer):
    for split, n in (("train", 400), ("test", 100)):
        cfg = PromptDataConfig(bundled_math_path(split), input_key="question", label_key="answer",
                               apply_chat_template=True)
        ds = PromptDataset(cfg, tokenizer)
        assert len(ds) == n and all(it.extra["split"] == split for it in ds)
    with pytest.raises(ValueError, match="does not exist"):
        bundled_math_path("validation")


def test_one_template_renderer_for_training_data_and_eval():
    """``--data.input_template`` and ``eval --prompt_template`` go through one ``fill_template``:
    OpenRLHF's '{}' (str.format, braces doubled) or '{question}' (everything else literal)."""
    from openrlhf_shape.data.prompts import check_template, fill_template
    from openrlhf_shape.eval.config import DEFAULT_PROMPT_TEMPLATE, BenchmarkSpec, EvalConfig

    assert fill_template("{}\nPut it in \\boxed{{}}.", "1+1?") == "1+1?\nPut it in \\boxed{}."
    assert fill_template("{question}\nPut it in \\boxed{}.", "1+1?") == "1+1?\nPut it in \\boxed{}."
    assert fill_template(None, "1+1?") == "1+1?"
    assert fill_template(DEFAULT_PROMPT_TEMPLATE, "Q").startswith("Q\n") and "\\boxed{}" in fill_template(DEFAULT_PROMPT_TEMPLATE, "Q")
    for bad in ("no placeholder", "{} and {}", "{name}"):
        with pytest.raises(ValueError, match="--prompt_template"):
            check_template(bad, "--prompt_template")
    # the same rules reach both configs
    PromptDataConfig("x.jsonl", input_template="{question} -> \\boxed{}").validate()
    with pytest.raises(ValueError, match="--prompt_template"):
        EvalConfig(model_path="m", benchmarks=[BenchmarkSpec("b", "b.jsonl")], out_dir="o", preset="cpu",
                   prompt_template="no placeholder")
    EvalConfig(model_path="m", benchmarks=[BenchmarkSpec("b", "b.jsonl")], out_dir="o", preset="cpu",
               prompt_template="{}, boxed")


def test_num_episodes_sets_the_steps_and_the_lr_schedule_of_full_batches(tokenizer):
    """--train.num_episodes E: E x (prompts // --rollout.batch_size) steps, every one a full batch (a pass's tail
    skipped), so the LR schedule counts those steps' updates; with dynamic filtering the same count (its refills read
    further passes: said at load, tests/config/test_openrlhf_recipes.py)."""
    from openrlhf_shape.config import load_config
    from openrlhf_shape.trainer.setup import build_data

    for extra in ([], ["--algo.dynamic_filtering_enable"]):
        cfg = load_config(None, ["--data.max_samples", "10", "--rollout.batch_size", "4", "--train.num_episodes", "3",
                                 "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4", *extra])
        batcher, _ = build_data(cfg, tokenizer)
        assert len(batcher.dataset) == 10 and cfg.train.num_steps == 3 * 2  # 10 // 4 full batches per pass
        assert cfg.total_optimizer_steps() == 6 * 2 == cfg.optim_config().total_steps

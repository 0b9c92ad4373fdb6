"""A new advantage estimator, and a new segmentation mode, are one file each: a module written into a temporary
folder registers them at import, and nothing else changes. The real ``load_config`` then accepts their names (before
the import it refuses them), the experience maker's phases run them on a hand-made batch with real forwards of the
tiny Qwen3 (old log-probs, segments, advantages), and the actor's policy loss trains on the new estimator's
advantages: its gradient on each token's log-prob is -A_t / N, and one SGD step raises sum_t A_t log pi(y_t).

Before issue 47 the estimator was refused at load unless also listed in config/openrlhf.py, and a segmentation mode
needed a tuple in algorithms/config.py, a branch in algorithms/pipeline.py and one in trainer/experience.py."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from openrlhf_shape.actor.batching import build_micro_batch
from openrlhf_shape.actor.micro_batch_loss import micro_batch_loss
from openrlhf_shape.algorithms import ESTIMATOR_REGISTRY, SEGMENTATIONS
from openrlhf_shape.algorithms.segmentation import select_cutpoints_batched
from openrlhf_shape.batch import ExperienceBatch, length_mask
from openrlhf_shape.config import load_config
from openrlhf_shape.testing.hf_actor import HFActor
from openrlhf_shape.trainer.experience import ShapeExperienceMaker

PLUGIN = '''
"""Our plug-ins: an estimator and a segmentation mode."""
import torch

from openrlhf_shape.algorithms import AdvantageEstimator, Segmentation, register, register_segmentation

MARK = 7  # the token after which the mode below may cut


@register("centred_sign")
class CentredSign(AdvantageEstimator):
    """+1 on every token of a response above its prompt's mean outcome, -1 below, 0 at the mean."""

    needs_segments = False
    needs_group = True

    def token_advantages(self, x):
        r = torch.as_tensor(x.rewards, dtype=torch.float32).view(-1, x.group_size)
        sign = torch.sign(r - r.mean(-1, keepdim=True)).reshape(-1)
        return torch.where(x.mask, sign[:, None], torch.zeros(()))


@register_segmentation("after_mark")
class AfterMark(Segmentation):
    """Boundaries right after a MARK token."""

    needs_token_ids = True

    def candidates(self, entropy, mask, token_ids):
        cand = torch.zeros_like(mask)
        cand[:, 1:] = token_ids[:, :-1] == MARK
        return cand & mask
'''

PROMPT = [5, 9]
RESPONSES = [[11, 7, 13, 14, 7, 15, 16, 7, 17], [21, 22, 7, 23, 24], [31, 32, 33, 7, 34, 35], [41, 7, 42]]
R = [1.0, 0.0, 1.0, 1.0]  # two prompts, n = 2: signs +1, -1 | 0, 0


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Imports the plug-in module from a temporary folder when called; the registries as they were afterwards."""
    (tmp_path / "my_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dict(ESTIMATOR_REGISTRY), dict(SEGMENTATIONS)
    try:
        yield lambda: importlib.import_module("my_plugin")
    finally:
        sys.modules.pop("my_plugin", None)
        for registry, kept in zip((ESTIMATOR_REGISTRY, SEGMENTATIONS), before):
            registry.clear()
            registry.update(kept)


def _batch() -> ExperienceBatch:
    lengths = [len(r) for r in RESPONSES]
    return ExperienceBatch(items=[None] * 4, sequences=[PROMPT + r for r in RESPONSES], prompt_lens=[2] * 4,
                           texts=[""] * 4, response_mask=length_mask(lengths, max(lengths)), rewards=torch.tensor(R))


def _maker(cfg, actor: HFActor, tokenizer) -> ShapeExperienceMaker:
    return ShapeExperienceMaker(cfg.advantage_estimator(), cfg.rollout.sampling_config(), cfg.probe, engines=None,
                                logprobs_fn=actor.compute_logprobs_and_entropy, reward=None, tokenizer=tokenizer)


def _config(*flags: str):
    return load_config(None, ["--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "16", *flags],
                       check_paths=False)


def _log_probs(model, mb) -> torch.Tensor:
    """``[N]`` log-probs of the micro-batch's response tokens, with grad."""
    logits = model(mb.input_ids).logits[mb.resp_rows, mb.resp_pos]
    return torch.log_softmax(logits, -1).gather(1, mb.resp_targets[:, None])[:, 0]


def test_a_registered_estimator_loads_makes_advantages_and_trains(plugin, tiny_model_dir, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"--algo.advantage.estimator: unknown estimator 'centred_sign'; choose one of \('shape', 'mrt'"):
        _config("--algo.advantage.estimator", "centred_sign")  # not imported yet: refused, naming the registered
    plugin()
    cfg = _config("--algo.advantage.estimator", "centred_sign")
    actor = HFActor(tiny_model_dir)
    maker = _maker(cfg, actor, tiny_tokenizer)
    exp = maker.logprobs(_batch()).value
    assert maker.segment(exp).value is None  # needs_segments False: no segments, no probes
    out = maker.advantages(exp, None, None)
    exp, mask = out.value, _batch().response_mask
    want = torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None] * mask
    assert torch.equal(exp.advantages, want)
    assert out.metrics["adv/sequence/mean"] == 0.0

    # one update on these advantages: the loss's gradient on each log-prob is -A_t / N (ratio 1), and an SGD step
    # moves the policy toward the tokens with A > 0 and away from those with A < 0
    tb = exp.train_batch(range(4), temperature=1.0)
    mb = build_micro_batch(tb.sequences, tb.prompt_lens, list(range(4)))
    model = actor.model.train()
    lp = _log_probs(model, mb)
    lp.retain_grad()
    n = int(mask.sum())
    loss, stats = micro_batch_loss(lp, torch.zeros_like(lp), mb, tb, mask, n, eps_low=0.2, eps_high=0.2,
                                   dual_clip=None)
    loss.backward()
    adv = want[mask]
    torch.testing.assert_close(lp.grad, -adv / n, rtol=0, atol=1e-7)
    torch.optim.SGD(model.parameters(), lr=0.01).step()
    with torch.no_grad():
        moved = _log_probs(model, mb) - lp.detach()
    assert float((adv * moved).sum()) > 0
    assert float(moved[adv > 0].mean()) > 0 > float(moved[adv < 0].mean())


def test_a_registered_segmentation_mode_cuts_where_it_says(plugin, tiny_model_dir, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"--shape.segmentation: unknown segmentation 'after_mark'"):
        _config("--shape.segmentation", "after_mark")
    mark = plugin().MARK
    cfg = _config("--shape.segmentation", "after_mark", "--shape.num_segments", "3", "--shape.min_segment_len", "1")
    maker = _maker(cfg, HFActor(tiny_model_dir), tiny_tokenizer)
    exp = maker.logprobs(_batch()).value
    boundaries = maker.segment(exp).value
    ids = exp.response_ids()
    after_mark = torch.zeros_like(exp.response_mask)
    after_mark[:, 1:] = ids[:, :-1] == mark
    want = select_cutpoints_batched(after_mark & exp.response_mask, exp.response_mask.sum(-1), 3, 1)
    assert torch.equal(boundaries, want)
    assert boundaries.tolist() == [[2, 5], [3, -1], [4, -1], [2, -1]]  # right after each row's 7s, at most K-1

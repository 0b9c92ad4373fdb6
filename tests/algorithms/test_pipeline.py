"""Batched advantages equal the per-response public API, for every estimator and ablation."""

import pytest
import torch

from openrlhf_shape.algorithms import (
    ShapeConfig,
    boundaries_as_lists,
    boundaries_to_segment_ids,
    compute_token_advantages,
    gain_contribution_percent,
    get_estimator,
    grpo_advantages,
    mrt_segment_advantages,
    pad_potentials,
    redistribute_token_credit,
    segment_batch,
    shape_segment_advantages,
)


def _batch(seed=0, prompts=3, n=4, width=60):
    g = torch.Generator().manual_seed(seed)
    b = prompts * n
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ent = torch.rand(b, width, generator=g) * 3
    rewards = (torch.rand(b, generator=g) > 0.5).float()
    return mask, ent, rewards, lengths


def _potentials(boundaries, rewards, seed=0):
    g = torch.Generator().manual_seed(seed)
    per = []
    for row, r in zip(boundaries_as_lists(boundaries), rewards):
        inner = torch.randint(0, 9, (len(row) + 1,), generator=g).float() / 8  # Phi_0 .. Phi_{n-1}
        per.append(torch.cat([inner, r.view(1)]))
    return per


@pytest.mark.parametrize("estimator", ["shape", "mrt"])
@pytest.mark.parametrize("tcr", [True, False])
def test_batched_equals_per_response(estimator, tcr):
    cfg = ShapeConfig(num_segments=5, min_segment_len=4, tcr=tcr)
    mask, ent, rewards, lengths = _batch()
    bnd = segment_batch(ent, mask, cfg)
    per = _potentials(bnd, rewards)
    res = compute_token_advantages(get_estimator(estimator, cfg), mask, rewards, 4, max_response_len=60, entropy=ent, boundaries=bnd,
                                   potentials=pad_potentials(per, cfg.num_segments))
    l_ref = 60 / 5
    for i, row in enumerate(boundaries_as_lists(bnd)):
        t = int(lengths[i])
        edges = [0] + row + [t]
        seg_len = torch.tensor([edges[k + 1] - edges[k] for k in range(len(edges) - 1)], dtype=torch.float32)
        if estimator == "shape":
            a_k = shape_segment_advantages(per[i], seg_len, rewards[i], alpha=0.3, gamma_min=0.9, l_ref=l_ref)
        else:
            a_k = mrt_segment_advantages(per[i], rewards[i], alpha=0.3)
        seg_ids = boundaries_to_segment_ids(torch.tensor(row, dtype=torch.long), t)
        tok = a_k[seg_ids]
        if tcr:
            tok = redistribute_token_credit(tok, ent[i, :t], seg_ids, torch.ones(t, dtype=torch.bool))
        assert torch.allclose(res.token_advantages[i, :t], tok, atol=1e-6)
        assert (res.token_advantages[i, t:] == 0).all()
    m = res.metrics
    assert 0.0 <= m["shape/potential_drop_rate"] <= 1.0
    assert m["shape/segments_per_response/mean"] >= 1
    counts = sum(m[f"shape/gain_by_start/{r}/count"] for r in ("low", "mid_low", "mid_high", "high"))
    total_transitions = int(((bnd >= 0).sum(-1) + 1).sum())
    starts_at_one = sum(int((p[:-1] == 1.0).sum()) for p in per)
    assert counts == total_transitions - starts_at_one


def test_grpo_broadcast_and_outcome_baselines():
    mask, ent, rewards, _ = _batch(seed=3)
    res = compute_token_advantages(get_estimator("grpo", ShapeConfig()), mask, rewards, 4, max_response_len=60)
    seq = grpo_advantages(rewards.view(-1, 4)).reshape(-1)
    assert torch.allclose(res.token_advantages, torch.where(mask, seq[:, None].expand_as(mask), torch.zeros(())))
    cfg = ShapeConfig(outcome_baseline="group_mean", tcr=False, num_segments=3)
    bnd = segment_batch(ent, mask, cfg)
    per = _potentials(bnd, rewards)
    res_gm = compute_token_advantages(get_estimator("shape", cfg), mask, rewards, 4, 60, ent, bnd, pad_potentials(per, 3))
    cfg_none = ShapeConfig(outcome_baseline="none", tcr=False, num_segments=3)
    res_none = compute_token_advantages(get_estimator("shape", cfg_none), mask, rewards, 4, 60, ent, bnd, pad_potentials(per, 3))
    shift = rewards.view(-1, 4).mean(-1, keepdim=True).expand(-1, 4).reshape(-1)
    assert torch.allclose(res_gm.token_advantages, torch.where(mask, res_none.token_advantages - shift[:, None], 0.0),
                          atol=1e-6)


def test_pipeline_rejects_inconsistent_inputs():
    mask, ent, rewards, _ = _batch()
    cfg = ShapeConfig(num_segments=3)
    bnd = segment_batch(ent, mask, cfg)
    per = _potentials(bnd, rewards)
    phi = pad_potentials(per, 3)
    with pytest.raises(ValueError, match="group_size"):
        compute_token_advantages(get_estimator("shape", cfg), mask, rewards, 5, 60, ent, bnd, phi)
    bad = phi.clone()
    bad[:, 0] = 1.5
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compute_token_advantages(get_estimator("shape", cfg), mask, rewards, 4, 60, ent, bnd, bad)
    wrong_final = pad_potentials([torch.cat([p[:-1], 1 - p[-1:]]) for p in per], 3)
    with pytest.raises(ValueError, match="outcome"):
        compute_token_advantages(get_estimator("shape", cfg), mask, rewards, 4, 60, ent, bnd, wrong_final)
    with pytest.raises(ValueError, match="empty"):
        segment_batch(ent, torch.zeros_like(mask), cfg)


def test_gain_contribution_normalisation_appendix_b3():
    avg = {"mrt": {"low": -0.1, "high": 0.2}, "shape": {"low": 0.3, "high": 0.0}}
    pct = gain_contribution_percent(avg, eps=0.03)
    # G_min = -0.1 -> shift by +0.13: mrt 0.03 / 0.36, shape 0.43 / 0.56
    assert pct["mrt"]["low"] == pytest.approx(100 * 0.03 / 0.36)
    assert pct["shape"]["low"] == pytest.approx(100 * 0.43 / 0.56)
    assert sum(pct["shape"].values()) == pytest.approx(100.0)


def test_estimators_are_registered_objects():
    """The registry names every estimator, each bound by ``get_estimator``."""
    from openrlhf_shape.algorithms import ESTIMATOR_REGISTRY

    names = ("shape", "mrt", "grpo", "reinforce", "reinforce_baseline", "rloo", "dr_grpo", "flash_reinforce", "gae")
    assert tuple(ESTIMATOR_REGISTRY) == names
    assert get_estimator("grpo", ShapeConfig()).needs_segments is False
    assert get_estimator("shape", ShapeConfig()).needs_segments is True
    assert get_estimator("mrt", ShapeConfig()).name == "mrt"
    with pytest.raises(ValueError, match=r"--algo.advantage.estimator: unknown estimator 'ppo'; choose one of "
                                         r"\('shape', 'mrt', 'grpo', 'reinforce', 'reinforce_baseline', 'rloo', "
                                         r"'dr_grpo', 'flash_reinforce', 'gae'\)"):
        get_estimator("ppo", ShapeConfig())


def test_mrt_with_group_baseline_uses_baselined_lead_term_and_raw_outcome():
    cfg = ShapeConfig(num_segments=3, min_segment_len=4, tcr=False, outcome_baseline="group_mean")
    mask, ent, rewards, lengths = _batch(seed=3)
    bnd = segment_batch(ent, mask, cfg)
    per = _potentials(bnd, rewards, seed=3)
    res = compute_token_advantages(get_estimator("mrt", cfg), mask, rewards, 4, 60, ent, bnd, pad_potentials(per, 3))
    lead = rewards.view(-1, 4) - rewards.view(-1, 4).mean(-1, keepdim=True)
    for i, row in enumerate(boundaries_as_lists(bnd)):
        want = mrt_segment_advantages(per[i], rewards[i], alpha=0.3, outcome_term=lead.reshape(-1)[i])
        assert torch.allclose(res.segment_advantages[i, : len(row) + 1], want, atol=1e-6)


def test_mrt_credit_is_uniform_inside_a_segment_by_default():
    """The paper gives MRT the segment advantage on every token of the segment (section 3, "Uniform Token
    Credit"); TCR is SHAPE's by default, and ``--shape.tcr`` overrides either way.

    One response of 6 tokens, boundary at 3, Phi = [1/4, 1/2, R = 1], alpha 0.3: MRT A_0 = 1 + 0.3 * (1 - 1/4)
    = 1.225, A_1 = 1 + 0.3 * (1 - 1/2) = 1.15; SHAPE (fixed gamma 1) A_0 = 1 + 0.3 * (1/2 - 1/4) = 1.075,
    A_1 = 1 + 0.3 * (1 - 1/2) = 1.15."""
    mask = torch.ones(1, 6, dtype=torch.bool)
    ent = torch.tensor([[0.1, 2.0, 0.5, 3.0, 0.2, 1.0]])  # distinct entropies: TCR would change every token
    bnd, phi, r = torch.tensor([[3]]), torch.tensor([[0.25, 0.5, 1.0]]), torch.tensor([1.0])

    def tokens(name, **kw):
        est = get_estimator(name, ShapeConfig(num_segments=2, fixed_gamma=1.0, **kw))
        res = compute_token_advantages(est, mask, r, 1, 6, ent, bnd, phi)
        return res.token_advantages[0], res.metrics

    mrt, metrics = tokens("mrt")
    assert torch.allclose(mrt, torch.tensor([1.225] * 3 + [1.15] * 3))
    assert not any(k.startswith("shape/tcr_weight") for k in metrics)
    shape, metrics = tokens("shape")
    assert metrics["shape/tcr_weight/std"] > 0.1 and not torch.allclose(shape, torch.tensor([1.075] * 3 + [1.15] * 3))
    seg_ids = boundaries_to_segment_ids(torch.tensor([3]), 6)
    assert torch.allclose(shape, redistribute_token_credit(torch.tensor([1.075] * 3 + [1.15] * 3), ent[0], seg_ids,
                                                           mask[0]))
    # --shape.tcr overrides the default in both directions
    assert torch.allclose(tokens("mrt", tcr=True)[0], redistribute_token_credit(mrt, ent[0], seg_ids, mask[0]))
    assert torch.allclose(tokens("shape", tcr=False)[0], torch.tensor([1.075] * 3 + [1.15] * 3))
    assert get_estimator("mrt", ShapeConfig()).uses_tcr is False and get_estimator("shape", ShapeConfig()).uses_tcr

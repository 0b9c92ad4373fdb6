"""What recovery costs on a plan's layout (``planner/recovery.py``, issue 48): per engine failure an engine start +
its weights read + one weight sync, per rank failure a rank group start + the checkpoint load + a re-sync + the
steps since the last checkpoint. Each part follows its inputs: the model's size, the plan's own sync estimate and
step time, the ranks' nodes, ``--ckpt.save_steps`` and the ``--plan.*`` rates; the dry run prints them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_shape.cli.main import main
from openrlhf_shape.config import load_config
from openrlhf_shape.planner.assumptions import PlanOptions, parse_plan_options
from openrlhf_shape.planner.model import ModelShape
from openrlhf_shape.planner.plan import build_plan
from openrlhf_shape.planner.recovery import ADAM_BYTES, MASTER_BYTES, recovery_cost

REPO = Path(__file__).resolve().parents[2]
QWEN3_8B = json.loads((REPO / "configs" / "models" / "Qwen3-8B.json").read_text())


def plan_of(preset: str, *flags: str, plan_flags: tuple[str, ...] = ()):
    cfg = load_config(str(REPO / "configs" / preset), list(flags), check_paths=False)
    return build_plan(cfg, parse_plan_options(list(plan_flags)), f"configs/{preset}")


def _model(tmp_path: Path, **changes) -> tuple[ModelShape, str]:
    path = tmp_path / f"model_{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({**QWEN3_8B, **changes}))
    return ModelShape.from_file(path), str(path)


def test_each_part_follows_its_input(tmp_path) -> None:
    """Twice the parameters: the weights read, the CPU sync and the checkpoint load twice as long; the GPU sync is
    the plan's estimate as given; the redo follows --ckpt.save_steps and the step time; nodes share the load."""
    small, _ = _model(tmp_path)
    big, _ = _model(tmp_path, num_hidden_layers=2 * QWEN3_8B["num_hidden_layers"])
    ratio = big.total_params() / small.total_params()
    opt = PlanOptions()
    kw = dict(on_gpu=False, sync_s=None, rank_nodes=1, save_steps=10, step_s=None)
    a, b = recovery_cost(small, opt, **kw), recovery_cost(big, opt, **kw)
    for part in ("engine_load_s", "engine_sync_s", "resync_s", "ckpt_load_s", "ckpt_bytes"):
        assert getattr(b, part) == pytest.approx(ratio * getattr(a, part)), part
    assert a.engine_sync_s == pytest.approx(small.total_params() * 4 / (opt.cpu_sync_mbs * 1e6))  # fp32 on CPU
    assert a.ckpt_bytes == small.total_params() * (4 + ADAM_BYTES)
    assert (a.engine_start_s, a.rank_start_s) == (b.engine_start_s, b.rank_start_s)  # fixed parts: not the size
    assert a.redo_s is None  # no step time on CPU

    gpu = recovery_cost(small, opt, on_gpu=True, sync_s=2.5, rank_nodes=2, save_steps=20, step_s=100.0)
    assert gpu.engine_sync_s == gpu.resync_s == 2.5
    assert gpu.ckpt_bytes == small.total_params() * (2 + MASTER_BYTES + ADAM_BYTES)
    assert gpu.ckpt_load_s == pytest.approx(gpu.ckpt_bytes / (opt.disk_gbs * 1e9) / 2)  # two nodes read in parallel
    assert gpu.engine_failure_s == pytest.approx(gpu.engine_start_s + small.total_params() * 2 / 2e9 + 2.5)
    assert gpu.redo_s == (1000.0, 2000.0)
    twice = recovery_cost(small, opt, on_gpu=True, sync_s=5.0, rank_nodes=2, save_steps=40, step_s=100.0)
    assert twice.engine_sync_s == 2 * gpu.engine_sync_s and twice.redo_s == (2000.0, 4000.0)
    assert recovery_cost(small, opt, on_gpu=True, sync_s=2.5, rank_nodes=2, save_steps=0, step_s=100.0).redo_s is None
    # a standby engine (--rollout.engine_standby): the replacement's start is the engine's build alone, the rest equal
    for on_gpu in (False, True):
        cold, warm = (recovery_cost(small, opt, on_gpu=on_gpu, sync_s=2.5, rank_nodes=1, save_steps=20, step_s=None,
                                    standby=sb) for sb in (False, True))
        assert 0 < warm.engine_start_s < cold.engine_start_s
        assert warm.engine_failure_s - warm.engine_start_s == pytest.approx(cold.engine_failure_s - cold.engine_start_s)


def test_a_plan_prices_recovery_from_its_own_sync_estimate_step_time_and_options() -> None:
    plan = plan_of("qwen3-8b.yaml")
    rc = plan.recovery
    assert rc.engine_sync_s == rc.resync_s == plan.sync.seconds
    assert rc.step_s == plan.step_seconds and rc.save_steps == 20  # the preset's --ckpt.save_steps
    nodes = len({s.node for s in plan.placement.ranks})
    assert rc.ckpt_load_s == pytest.approx(rc.ckpt_bytes / (2e9 * nodes))
    faster = plan_of("qwen3-8b.yaml", "--ckpt.save_steps", "40",
                     plan_flags=("--plan.disk_gbs", "4", "--plan.engine_start_s", "30", "--plan.rank_start_s", "45"))
    f = faster.recovery
    assert f.engine_load_s == pytest.approx(rc.engine_load_s / 2) and f.ckpt_load_s == pytest.approx(rc.ckpt_load_s / 2)
    assert (f.engine_start_s, f.rank_start_s) == (30.0, 45.0)
    assert f.redo_s == pytest.approx((2 * rc.redo_s[0], 2 * rc.redo_s[1]))


def test_twice_the_model_doubles_the_sync_part_on_a_cpu_plan(tmp_path) -> None:
    """On a CPU config the sync is priced at --plan.cpu_sync_mbs: the model's size in, the sync part out."""
    _, small = _model(tmp_path)
    _, big = _model(tmp_path, num_hidden_layers=2 * QWEN3_8B["num_hidden_layers"])
    a = plan_of("cpu-smoke.yaml", plan_flags=("--plan.model_config", small))
    b = plan_of("cpu-smoke.yaml", plan_flags=("--plan.model_config", big))
    ratio = b.model.total_params() / a.model.total_params()
    assert b.recovery.engine_sync_s == pytest.approx(ratio * a.recovery.engine_sync_s)
    slower = plan_of("cpu-smoke.yaml", plan_flags=("--plan.model_config", small, "--plan.cpu_sync_mbs", "80"))
    assert slower.recovery.engine_sync_s == pytest.approx(2 * a.recovery.engine_sync_s)


def test_the_dry_run_prints_both_costs_with_their_parts(capsys) -> None:
    assert main(["train", "--config", str(REPO / "configs" / "qwen3-8b.yaml"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    rc = plan_of("qwen3-8b.yaml").recovery
    engine = next(ln for ln in out.splitlines() if ln.startswith("recovery per engine failure"))
    rank = next(ln for ln in out.splitlines() if ln.startswith("recovery per rank failure"))
    assert f"~{rc.engine_failure_s:.1f} s = engine start 60 s" in engine
    assert f"one weight sync to it {rc.engine_sync_s:.1f} s" in engine
    assert f"~{rc.rank_failure_s:.1f} s = rank group start 90 s" in rank
    assert f"--ckpt.save_steps 20 / 2 x {rc.step_s:.0f} s = {rc.redo_s[0]:.0f} s on average" in rank


def test_recovery_options_refuse_negative_times_and_rates() -> None:
    for flag in ("--plan.engine_start_s", "--plan.rank_start_s", "--plan.disk_gbs", "--plan.cpu_sync_mbs"):
        with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
            parse_plan_options([flag, "-1"])

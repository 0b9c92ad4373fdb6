"""The MoE layout and router flags, without launching ranks: ``--megatron.expert_tensor_parallel_size`` (megatron-core's
expert TP; unset = TP) is validated against the model and the world as megatron-core lays expert ranks out, and
``--megatron.routing_replay`` refuses ``--megatron.moe_router_fusion``, because megatron-core's fused top-k path
returns before its router-replay branch (held here against the installed megatron-core source). The ranks' side
(the value reaching parallel_state and TransformerConfig, parity and training at ETP 1) is in test_moe_on_cpu.py."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest

from openrlhf_shape.megatron.config import MegatronConfig
from openrlhf_shape.platform import cpu_platform

PRESET = Path(__file__).resolve().parents[2] / "configs" / "cpu-smoke.yaml"
# the tiny Qwen3-MoE's shapes (testing/tiny_models.py): 8 experts, expert FFN 32
MOE = types.SimpleNamespace(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                            vocab_size=1024, num_experts=8, moe_intermediate_size=32)
DENSE = types.SimpleNamespace(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                              vocab_size=1024)
TP2_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)


def test_expert_tensor_parallel_size_flag_reaches_the_rank_config():
    from openrlhf_shape.config import load_config

    cfg = load_config(str(PRESET), ["--megatron.expert_tensor_parallel_size", "1"], check_paths=False)
    assert cfg.megatron_config().expert_tensor_parallel_size == 1
    assert load_config(str(PRESET), [], check_paths=False).megatron_config().expert_tensor_parallel_size is None
    with pytest.raises(ValueError, match="--megatron.expert_tensor_parallel_size must be an integer >= 1 or None"):
        load_config(str(PRESET), ["--megatron.expert_tensor_parallel_size", "0"], check_paths=False)


def test_expert_tensor_parallel_defaults_to_tp_and_is_checked_against_the_layout():
    assert MegatronConfig(**TP2_SP).expert_tensor_parallel == 2  # unset: megatron-core's default, the TP size
    assert MegatronConfig(**TP2_SP, expert_tensor_parallel_size=1).expert_tensor_parallel == 1
    # EP2 over the two TP ranks of one replica: whole experts (ETP 1) lay out in a world of 2 ...
    MegatronConfig(**TP2_SP, expert_model_parallel_size=2, expert_tensor_parallel_size=1).validate_against_model(MOE, 2)
    # ... experts split over TP (ETP = TP = 2) need ETP x EP = 4 ranks
    with pytest.raises(ValueError, match=r"= 4 must divide the world size 2 .*--megatron.expert_tensor_parallel_size"):
        MegatronConfig(**TP2_SP, expert_model_parallel_size=2).validate_against_model(MOE, 2)
    MegatronConfig(**TP2_SP, expert_model_parallel_size=2).validate_against_model(MOE, 4)
    with pytest.raises(ValueError, match="expert tensor parallel size 3 .* must divide each expert's "
                                         "moe_intermediate_size=32"):
        MegatronConfig(expert_tensor_parallel_size=3).validate_against_model(MOE, 3)
    # experts whole on every TP rank without expert parallelism: megatron-core takes it, mbridge's export would gather
    # them over the TP group as TP shards
    with pytest.raises(ValueError, match="with expert_model_parallel_size=1: mbridge 0.15.1's export gathers"):
        MegatronConfig(**TP2_SP, expert_tensor_parallel_size=1).validate_against_model(MOE, 2)
    with pytest.raises(ValueError, match="no routed experts: .*--megatron.expert_tensor_parallel_size unset"):
        MegatronConfig(expert_tensor_parallel_size=1).validate_against_model(DENSE, 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"MegatronConfig\.expert_tensor_parallel_size must be an integer >= 1"):
            MegatronConfig(expert_tensor_parallel_size=bad)


def test_routing_replay_refuses_the_fused_router_naming_both_flags():
    from openrlhf_shape.config import load_config
    from openrlhf_shape.megatron.bridge import moe_config_overrides

    for mode in ("r2", "r3"):
        with pytest.raises(ValueError, match="moe_router_fusion=True: megatron-core's fused router returns its own "
                                             "top-k before router replay applies"):
            MegatronConfig(routing_replay=mode, moe_router_fusion=True)
    with pytest.raises(ValueError) as err:
        load_config(str(PRESET), ["--megatron.routing_replay", "r2", "--megatron.moe_router_fusion", "true"],
                    check_paths=False)
    msg = str(err.value)
    assert "--megatron.routing_replay='r2' with --megatron.moe_router_fusion=True" in msg
    assert "set --megatron.moe_router_fusion false (the default) to replay, or --megatron.routing_replay none" in msg
    # each alone is accepted, and the switch reaches Megatron's TransformerConfig
    assert moe_config_overrides(MegatronConfig(routing_replay="r2"))["moe_router_fusion"] is False
    assert moe_config_overrides(MegatronConfig(moe_router_fusion=True))["moe_router_fusion"] is True
    with pytest.raises(ValueError, match="moe_router_fusion=True needs transformer-engine's fused router kernel on a GPU"):
        MegatronConfig(moe_router_fusion=True).check_device(cpu_platform())


def test_megatron_cores_fused_top_k_returns_before_router_replay():
    """The line the refusal rests on: in ``topk_routing_with_score_function`` the ``if fused:`` branch returns the
    fused kernel's result before any use of ``router_replay``. If megatron-core moves replay ahead of it, this fails
    and the refusal can go."""
    from megatron.core.transformer.moe import moe_utils

    fn = ast.parse(inspect.getsource(moe_utils.topk_routing_with_score_function)).body[0]
    assert "router_replay" in [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    fused = [n for n in fn.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "fused"]
    assert fused, "megatron-core no longer branches on `fused` at the top of topk_routing_with_score_function"
    returns = [n for n in ast.walk(fused[0]) if isinstance(n, ast.Return)]
    assert returns and "fused_topk_with_score_function" in ast.unparse(returns[-1])
    replay_uses = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == "router_replay"]
    assert replay_uses and min(replay_uses) > fused[0].end_lineno  # replay is looked at only after the fused return

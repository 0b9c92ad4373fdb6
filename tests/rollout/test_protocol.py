"""The rollout protocols (``openrlhf_shape/rollout/protocol.py``) against the real collaborators the trainer hands
over: the engine group, the reward computer and a Hugging Face tokenizer take every protocol method with the
protocol's parameters, in its order and with its defaults; and the experience maker, the schedules and partial
rollouts type every argument they take (their collaborators with the protocols), so none reaches for another
object's attributes to learn what it holds."""

from __future__ import annotations

import inspect

import pytest

from openrlhf_shape.rewards.computer import RewardComputer
from openrlhf_shape.rollout.group import EngineGroup
from openrlhf_shape.rollout.protocol import Engines, Rewards, Tokenizer
from openrlhf_shape.trainer import partial, schedule
from openrlhf_shape.trainer.experience import ShapeExperienceMaker


def _named(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _check(protocol: type, impl: type) -> None:
    methods = [n for n, f in vars(protocol).items() if callable(f) and (not n.startswith("_") or n == "__len__")]
    assert methods, protocol
    for name in methods:
        want, got = _named(getattr(protocol, name)), _named(getattr(impl, name))
        assert [p.name for p in got[: len(want)]] == [p.name for p in want], f"{impl.__name__}.{name}"
        assert [p.default for p in got[: len(want)]] == [p.default for p in want], f"{impl.__name__}.{name}"


def test_the_engine_group_and_the_reward_computer_are_the_protocols() -> None:
    _check(Engines, EngineGroup)
    _check(Rewards, RewardComputer)


def test_a_hugging_face_tokenizer_is_the_tokenizer_protocol(tiny_tokenizer) -> None:
    _check(Tokenizer, type(tiny_tokenizer))
    assert len(tiny_tokenizer) > 0 and tiny_tokenizer.decode(tiny_tokenizer.encode("1 + 1", add_special_tokens=False))


@pytest.mark.parametrize("fn", [ShapeExperienceMaker.__init__, schedule.SyncSchedule.__init__,
                                schedule.OneStepOffSchedule.__init__, schedule.make_schedule,
                                partial.PartialRollouts.__init__], ids=lambda fn: fn.__qualname__)
def test_the_consumers_type_their_collaborators(fn) -> None:
    params = {p.name: p.annotation for p in _named(fn)}
    untyped = [n for n, a in params.items() if a is inspect.Parameter.empty]
    assert not untyped, f"{fn.__qualname__}: untyped {untyped}"
    for name, proto in (("engines", "Engines"), ("reward", "Rewards"), ("tokenizer", "Tokenizer")):
        if name in params:
            assert params[name] == proto, f"{fn.__qualname__}.{name}: {params[name]}"

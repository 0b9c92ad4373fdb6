"""A deliberate resume bug, for the negative control of the kill-and-resume tests (tests/trainer/test_train_e2e.py):
``python -m support.lossy_checkpoint train FLAGS`` runs ``openrlhf-shape train FLAGS`` (the command's own ``main``)
in a driver whose checkpoints leave the data position out: the batcher's state they keep says the data's start
(epoch 0, position 0), as a checkpoint that never recorded a position resumes (prime-rl's bug). Everything else (the
weights, the optimizer, the batches in flight, the metrics line) is saved as usual, so a run resumed from such a
checkpoint differs from the uninterrupted one only in the prompts it trains from then on."""

from __future__ import annotations

import sys

from openrlhf_shape.cli.main import main
from openrlhf_shape.data.prompts import PromptBatcher


_saved = PromptBatcher.state_dict


def _without_position(batcher: PromptBatcher) -> dict[str, int]:
    return {**_saved(batcher), "epoch": 0, "position": 0}

if __name__ == "__main__":
    PromptBatcher.state_dict = _without_position  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))

"""Engine settings checked where the engine runs."""

import pickle

import pytest

from openrlhf_shape.platform import detect_platform
from openrlhf_shape.rollout.engine import EngineConfig, VLLMEngine


def test_engine_refuses_a_model_dir_missing_on_its_node(tmp_path):
    """The driver checks the path on its node when the config is made; an engine actor on another node
    unpickles the config without that check, so the engine checks again where it runs."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = EngineConfig(model_path=str(model), max_model_len=256)
    shipped = pickle.dumps(cfg)  # what a Ray actor on another node receives
    (model / "config.json").unlink()  # ... where the directory does not exist
    with pytest.raises(FileNotFoundError, match="must be on a filesystem every node sees"):
        VLLMEngine(pickle.loads(shipped), platform=detect_platform())

"""Which model to evaluate: an HF directory as is, or one of our Megatron checkpoints exported to HF."""

from __future__ import annotations

import importlib
from pathlib import Path


def is_hf_model_dir(path: Path) -> bool:
    """config.json plus weights (safetensors or a PyTorch bin, sharded or not)."""
    if not (path / "config.json").is_file():
        return False
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def is_megatron_checkpoint(path: Path) -> bool:
    """Our Megatron checkpoints: a torch_dist checkpoint dir (``metadata.json`` with ``.distcp``
    shards), or a parent holding ``iter_*`` / ``step_*`` such checkpoints, or a
    ``latest_checkpointed_iteration.txt`` tracker."""
    if (path / "metadata.json").is_file() and any(path.glob("*.distcp")):
        return True
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return True
    return any(is_megatron_checkpoint(p) for p in path.iterdir() if p.is_dir() and p.name.startswith(("iter_", "step_")))


def resolve_model_path(model_path: str, export_dir: str | Path) -> str:
    """An HF directory vLLM can load: ``model_path`` itself, or its HF export in ``export_dir``.

    The export goes through ``openrlhf_shape.megatron.export_hf`` (the Megatron package's API) and
    is reused when ``export_dir`` already holds a complete HF model.
    """
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {model_path!r} is not a directory; pass an HF model directory or one of our "
            "Megatron checkpoint directories (nothing is downloaded from a hub)"
        )
    if is_hf_model_dir(path):
        return str(path)
    if not is_megatron_checkpoint(path):
        raise ValueError(
            f"--model {model_path!r} is neither an HF model directory (config.json + *.safetensors) nor a "
            "Megatron checkpoint (metadata.json + *.distcp, or iter_*/ subdirectories)"
        )
    export_dir = Path(export_dir)
    if is_hf_model_dir(export_dir):
        return str(export_dir)
    try:
        mod = importlib.import_module("openrlhf_shape.megatron")
        export_hf = getattr(mod, "export_hf")
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"{model_path!r} is a Megatron checkpoint, but openrlhf_shape.megatron.export_hf is not "
            "available in this build; export it with `openrlhf-shape convert` first and pass the HF "
            "directory to --model"
        ) from exc
    export_hf(str(path), str(export_dir))
    if not is_hf_model_dir(export_dir):
        raise RuntimeError(f"export_hf({path}, {export_dir}) did not write an HF model directory")
    return str(export_dir)

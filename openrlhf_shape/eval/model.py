"""Which model to evaluate: an HF directory as is, or one of our Megatron checkpoints exported to HF."""

from __future__ import annotations

from pathlib import Path


def is_hf_model_dir(path: Path) -> bool:
    """config.json plus weights (safetensors or a PyTorch bin, sharded or not)."""
    if not (path / "config.json").is_file():
        return False
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def is_megatron_checkpoint(path: Path) -> bool:
    """One of our Megatron checkpoints (``openrlhf_shape.megatron.checkpoint`` layout: ``dist/``,
    ``meta.json`` and the ``COMPLETE`` marker), or a directory of them (the newest complete one is used)."""
    if (path / "COMPLETE").is_file() and (path / "meta.json").is_file() and (path / "dist").is_dir():
        return True
    return any((p / "COMPLETE").is_file() and (p / "dist").is_dir() for p in path.iterdir() if p.is_dir())


def _pick_checkpoint(path: Path) -> Path:
    if (path / "COMPLETE").is_file():
        return path
    from openrlhf_shape.checkpoint_dir import latest_checkpoint

    found = latest_checkpoint(str(path))
    if found is None:
        raise ValueError(f"--model {path}: no complete Megatron checkpoint (with a COMPLETE marker) inside")
    return Path(found)


def resolve_model_path(model_path: str, export_dir: str | Path) -> str:
    """An HF directory vLLM can load: ``model_path`` itself, or its HF export in ``export_dir``.

    The export goes through ``openrlhf_shape.megatron.export_hf(ckpt_dir, out_dir)`` (the Megatron
    package's API) into ``export_dir/<checkpoint name>``, and is reused when that already holds a
    complete HF model.
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
            "Megatron checkpoint (dist/ + meta.json + COMPLETE, or a directory of such checkpoints)"
        )
    ckpt = _pick_checkpoint(path)
    export_dir = Path(export_dir) / ckpt.name
    if is_hf_model_dir(export_dir):
        return str(export_dir)
    try:
        from openrlhf_shape.megatron import export_hf
    except ImportError as exc:
        raise RuntimeError(
            f"{model_path!r} is a Megatron checkpoint, but openrlhf_shape.megatron.export_hf is not "
            "available in this build; export it with `openrlhf-shape convert` first and pass the HF "
            "directory to --model"
        ) from exc
    export_hf(str(ckpt), str(export_dir))
    if not is_hf_model_dir(export_dir):
        raise RuntimeError(f"export_hf({ckpt}, {export_dir}) did not write an HF model directory")
    return str(export_dir)

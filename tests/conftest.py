"""Shared pytest set-up: keep torch on few threads (2-core CI machine) and quiet third-party warnings."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")

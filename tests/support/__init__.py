"""The tests' own machinery, outside the package: the preloading rank spawner (``preload.py``, ``zygote.py``), engine
weight access, the HF reference log-probs, the tensor holder that sends through the real weight-sync senders,
simulated GPU clusters and their probes, the reference model's rank-side checks. ``tests/conftest.py`` puts
``tests/`` on every test process's path, so this imports as ``support``."""

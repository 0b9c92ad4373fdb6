"""Put on PYTHONPATH, this makes a process look like the lent GPU machine: torch, transformers and the
carried wheels import; Ray, vLLM and transformer-engine do not (an import raises ModuleNotFoundError).
The kit's smoke runs under it so a module the kit imports cannot start needing them unnoticed
(it did once: the kit imported the log-prob merge from the Ray rank group, and every section failed there)."""

import sys

ABSENT_ON_THE_GPU_MACHINE = ("ray", "vllm", "transformer_engine")


class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT_ON_THE_GPU_MACHINE:
            raise ModuleNotFoundError(f"No module named '{name}' (not on the GPU machine: tests/gpu_kit/gpu_machine_standin)")
        return None


sys.meta_path.insert(0, _Absent())

"""``tests/`` mirrors ``openrlhf_shape/`` folder for folder, so a reader finds a package's tests by its name.

A package folder without a test folder, and a test folder without a package folder, each needs a line below saying
why; the package's top-level modules (``platform.py``, ``batch.py``, ...) have their tests at ``tests/`` top level.
The tests' own machinery lives in ``tests/support/``, which the package never imports (``tests/test_layers.py``).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package folders with no tests/<name>/, and why
UNTESTED_HERE = {
    "cli": "the command lines are run end to end by tests/trainer (train, convert), tests/cluster (doctor) and "
           "tests/eval (eval, analyze)",
    "testing": "what tests, benchmarks and the GPU kit share (tiny models, batches, rank configs): every test "
               "folder exercises them",
}
# test folders that mirror no package folder, and what they hold
NOT_A_PACKAGE = {
    "contracts": "vLLM's installed source: the lines our GPU calls rely on",
    "gpu_kit": "benchmarks/gpu (the GPU verification kit), scripts/gpu_check.sh and the Docker image's lint",
    "support": "the tests' own machinery, not tests (the preloading rank spawner, engine weight access, simulated "
               "clusters); imported as `support` (tests/conftest.py)",
}
HELPERS_ONLY = {"support"}  # test folders holding no test file


def _folders(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}


def test_tests_mirror_the_package_folder_for_folder():
    package, tests = _folders(ROOT / "openrlhf_shape"), _folders(ROOT / "tests")
    assert package - tests == set(UNTESTED_HERE), f"package folders with no test folder: {sorted(package - tests)}"
    assert tests - package == set(NOT_A_PACKAGE), f"test folders with no package folder: {sorted(tests - package)}"


def test_every_test_folder_holds_tests():
    for name in _folders(ROOT / "tests") - HELPERS_ONLY:
        assert list((ROOT / "tests" / name).glob("test_*.py")), f"tests/{name} holds no test file"

from setuptools import find_packages, setup

setup(
    name="openrlhf-shape",
    version="0.1.0",
    description="SHAPE process-supervised RL for LLM reasoning on Megatron-core and vLLM",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["openrlhf_shape", "openrlhf_shape.*"]),
    package_data={"openrlhf_shape": ["data/*.jsonl", "py.typed"]},
    include_package_data=True,
    # The CPU and GPU stacks are pinned in requirements/cpu.txt and requirements/gpu.txt;
    # install one of those first. Only the light, stack-independent dependencies are listed here.
    install_requires=["torch", "pyyaml", "tqdm"],
    entry_points={"console_scripts": ["openrlhf-shape=openrlhf_shape.cli.main:main"]},
)

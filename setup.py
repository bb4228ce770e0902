from setuptools import find_namespace_packages, setup

# `megatron` is a namespace extension of the installed megatron-core package: we ship
# `megatron.training` only and must never ship a `megatron/__init__.py`.
setup(
    name="recover",
    version="0.1.0",
    description="ReCoVer: resilient Megatron-compatible GPT pre-training on megatron-core",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.training*", "recover_patches*"]),
    py_modules=["pretrain_gpt_recover"],
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "numpy",
        "tokenizers",
        "matplotlib",
        "tqdm",
        "tensorboard",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "wandb"],
        "gpu": ["transformer-engine"],
        "wandb": ["wandb"],
    },
)

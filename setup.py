"""torch_xla_patches: a shape-signature dynamo bridge for PyTorch/XLA."""
from setuptools import find_packages, setup

setup(
    name='torch_xla_patches',
    version='0.1.0',
    description=('Patches for the PyTorch/XLA dynamo bridge: one dynamo trace, '
                 'one compiled XLA program per shape signature.'),
    packages=find_packages(
        include=['torch_xla_patches', 'torch_xla_patches.*']),
    # The native fast path's source, built on the user's machine against
    # the torch installed there (see [Note: Building the native fast path]
    # in native.py); a library built here would fit only this torch.
    package_data={'torch_xla_patches': ['csrc/*.cpp']},
    # Every Python torch_xla 2.8.x and 2.9.0 ship wheels for.
    python_requires='>=3.10,<3.14',
    # The supported (torch, torch_xla) pairs are torch_xla_patches/versions.py's
    # SUPPORTED_PAIRS; `make setup TORCH_XLA=...` installs one exact pair.
    # torch.utils.cpp_extension.load() builds with ninja.
    install_requires=['torch>=2.8.0,<2.10', 'torch_xla>=2.8.0,<2.10', 'ninja'],
    entry_points={
        'console_scripts': [
            'torch-xla-patches-cache=torch_xla_patches.cache:main',
            'torch-xla-patches-native=torch_xla_patches.native:main',
        ],
    },
    extras_require={
        'test': [
            'pytest',
            # make test runs the suite on two processes (Makefile).
            'pytest-xdist',
            'expecttest',
            'hypothesis',
            'yapf==0.40.2',
            # The real client of serve(): tiny configurations built in code,
            # nothing downloaded. It does not depend on torch.
            'transformers>=5,<6'
        ],
        # Benchmark charts (tools/bench_warmup.py).
        'tools': ['matplotlib'],
        # The reference server's built-in model (python -m
        # torch_xla_patches.server); the package itself needs no transformers.
        'server': ['transformers>=5,<6'],
    },
)

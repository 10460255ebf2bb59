"""torch_xla_patches: one dynamo trace, one XLA program per shape signature.

  import torch_xla_patches
  torch_xla_patches.apply()

replaces `extract_compiled_graph` of torch_xla's dynamo bridge with the one in
`torch_xla_patches.dynamo_bridge`. `revert()` restores everything apply()
changed.
"""
import os
import threading
from typing import Any, Optional

from torch_xla_patches import _patching
from torch_xla_patches import config
from torch_xla_patches import versions
from torch_xla_patches.warmup import TensorSpec

# See [Note: Supported releases] in versions.py.
SUPPORTED_TORCH_XLA_VERSIONS = versions.SUPPORTED_TORCH_XLA_VERSIONS
SUPPORTED_TORCH_VERSIONS = versions.SUPPORTED_TORCH_VERSIONS

_registry = _patching.PatchRegistry()
_lock = threading.Lock()
_decompositions_installed = False


def is_applied() -> bool:
  return len(_registry) > 0


def original(owner: Any, name: str) -> Any:
  """What `owner.name` was before apply() (the current value if unpatched)."""
  return _registry.original(owner, name)


def apply(*,
          automatic_dynamic_shapes: Optional[bool] = None,
          cache_dir: Optional[str] = None,
          precompile_mode: Optional[str] = None,
          persistent_executables: Optional[bool] = None) -> None:
  """Installs the patched bridge. Safe to call more than once.

  Args:
    automatic_dynamic_shapes: turn dynamo's automatic dynamic shapes back on
      (see config.automatic_dynamic_shapes); None keeps the config value.
    cache_dir: directory of the persistent signature index
      (config.cache_dir, env XLA_PATCHES_CACHE_DIR).
    precompile_mode: 'sync', 'interleaved' or 'off' (config.precompile_mode).
    persistent_executables: also call xr.initialize_cache(<cache_dir>/xla);
      must happen before the first XLA compile of the process.
  """
  if precompile_mode is not None:
    if precompile_mode not in config.PRECOMPILE_MODES:
      raise ValueError(f'precompile_mode must be one of '
                       f'{config.PRECOMPILE_MODES}, got {precompile_mode!r}')
    config.precompile_mode = precompile_mode
  if cache_dir is not None:
    config.cache_dir = os.fspath(cache_dir)
  if persistent_executables is not None:
    config.persistent_executables = persistent_executables
  global _decompositions_installed
  import torch
  import torch._dynamo
  import torch_xla
  import torch_xla._dynamo.dynamo_bridge as upstream_bridge
  import torch_xla.core.dynamo_bridge as core_bridge

  with _lock:
    if is_applied():
      return
    versions.check_supported(torch.__version__, torch_xla.__version__)
    from torch_xla_patches import dynamo_bridge
    for module in (upstream_bridge, core_bridge):
      target = _patching.PatchTarget(module, 'extract_compiled_graph')
      current = getattr(module, 'extract_compiled_graph', None)
      if current is None:
        raise RuntimeError(
            f'torch_xla_patches cannot patch {target.describe()}: expected a '
            'function, found nothing.')
      _patching.check_signature(target, current, ('xla_model', 'xla_args'))
    for module in (upstream_bridge, core_bridge):
      _registry.set(module, 'extract_compiled_graph',
                    dynamo_bridge.extract_compiled_graph)
    if automatic_dynamic_shapes is None:
      automatic_dynamic_shapes = config.automatic_dynamic_shapes
    if automatic_dynamic_shapes:
      _registry.set(torch._dynamo.config, 'automatic_dynamic_shapes', True)
    if not config.cpp_symbolic_shape_guards:
      _registry.set(torch._dynamo.config, 'enable_cpp_symbolic_shape_guards',
                    False)
    if config.persistent_executables and config.cache_dir:
      _initialize_executable_cache(config.cache_dir)
    if config.install_decompositions:
      from torch_xla_patches import decompositions
      decompositions.install()
      _decompositions_installed = True
    if versions.has_torch_aot_compile():
      from torch_xla_patches import serialization
      serialization.register_backend()


def _initialize_executable_cache(cache_dir: str) -> None:
  import torch_xla
  import torch_xla.runtime as xr
  if torch_xla._XLAC._xla_computation_cache_is_initialized():
    raise RuntimeError(
        'torch_xla_patches.apply(persistent_executables=True) must run before '
        'the first XLA computation of the process.')
  xr.initialize_cache(os.path.join(cache_dir, 'xla'), readonly=False)


def precompile(compiled_fn, specs, progress: bool = True):
  """See torch_xla_patches.warmup.precompile."""
  from torch_xla_patches import warmup
  return warmup.precompile(compiled_fn, specs, progress=progress)


def save(compiled, path, example_inputs=None):
  """See torch_xla_patches.serialization.save."""
  from torch_xla_patches import serialization
  return serialization.save(compiled, path, example_inputs)


def load(path, model=None, precompile: bool = True):
  """See torch_xla_patches.serialization.load."""
  from torch_xla_patches import serialization
  return serialization.load(path, model=model, precompile=precompile)


def revert() -> None:
  """Undoes apply(). Safe to call more than once."""
  global _decompositions_installed
  with _lock:
    _registry.revert_all()
    from torch_xla_patches import serialization
    serialization.unregister_backend()
    if _decompositions_installed:
      from torch_xla_patches import decompositions
      decompositions.uninstall()
      _decompositions_installed = False

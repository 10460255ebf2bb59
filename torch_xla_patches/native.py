"""The served call's per-call work in C++ (csrc/fast_path.cpp; see [Note: The
native fast path] there), built here with the machine's C++ compiler.

[Note: Building the native fast path]
The module is compiled against the torch of this process, once per torch
release, Python and source, into config.native_dir (by default
~/.cache/torch_xla_patches/native), by `helpers()` on first use (serve()
and apply() call it) or ahead of time by `native.main()` (`make setup`
does). Its library is written under a temporary name and renamed, so a
process never loads a half-written one. Nothing about it can fail a user's
call: without a compiler, with the flag off (XLA_PATCHES_NATIVE=0), or where
the build or the load fails, `helpers()` returns None, says why once, and the
package runs the Python twin of each function, which gives the same answers.
"""
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from types import ModuleType
from typing import List, Optional

from torch_xla_patches import config

logger = logging.getLogger('torch_xla_patches.native')

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc',
                      'fast_path.cpp')
MODULE_NAME = 'torch_xla_patches._fast_path'
# A build that takes longer is stopped (and the Python twins used).
BUILD_TIMEOUT_SECONDS = 600

_lock = threading.Lock()
# The loaded module, once helpers() tried; None if it could not be had.
_module: Optional[ModuleType] = None
_tried = False
# Why there is no module, once known.
unavailable_reason: Optional[str] = None


class BuildError(RuntimeError):
  """The native module could not be compiled; the message says why."""


def default_dir() -> str:
  cache_home = os.environ.get('XDG_CACHE_HOME') or os.path.join(
      os.path.expanduser('~'), '.cache')
  return os.path.join(cache_home, 'torch_xla_patches', 'native')


def _compile_command(output: str) -> List[str]:
  import torch
  compiler = os.environ.get('CXX') or shutil.which('c++') or shutil.which('g++')
  if compiler is None:
    raise BuildError('no C++ compiler (c++ or g++ on PATH, or CXX)')
  abi = int(torch.compiled_with_cxx11_abi())
  root = os.path.dirname(os.path.abspath(torch.__file__))
  includes = [
      os.path.join(root, 'include'),
      os.path.join(root, 'include', 'torch', 'csrc', 'api', 'include'),
      sysconfig.get_paths()['include']
  ]
  libraries = [os.path.join(root, 'lib')]
  return ([
      compiler, '-O2', '-shared', '-fPIC', '-std=c++17',
      f'-D_GLIBCXX_USE_CXX11_ABI={abi}', '-w'
  ] + [f'-I{path}' for path in includes] + [SOURCE, '-o', output] +
          [f'-L{path}' for path in libraries] +
          [f'-Wl,-rpath,{path}' for path in libraries] +
          ['-ltorch_python', '-ltorch', '-ltorch_cpu', '-lc10'])


def library_path() -> str:
  """Where this process's build of the module lives (or will)."""
  import torch
  with open(SOURCE, 'rb') as f:
    digest = hashlib.sha256(f.read())
  # The command names the compiler, torch's include and library paths and
  # its ABI; the output name is left out of it.
  digest.update(' '.join(_compile_command('-')).encode())
  digest.update(sys.version.encode())
  suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
  directory = os.path.join(
      config.native_dir or default_dir(),
      f'torch-{torch.__version__}-{digest.hexdigest()[:16]}')
  return os.path.join(directory, '_fast_path' + suffix)


def build() -> str:
  """Compiles the module unless this build exists; returns its path. Raises
  BuildError."""
  path = library_path()
  if os.path.exists(path):
    return path
  directory = os.path.dirname(path)
  os.makedirs(directory, exist_ok=True)
  handle, partial = tempfile.mkstemp(dir=directory, suffix='.partial')
  os.close(handle)
  started = time.monotonic()
  try:
    try:
      done = subprocess.run(_compile_command(partial),
                            capture_output=True,
                            text=True,
                            timeout=BUILD_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as e:
      raise BuildError(f'the compiler did not run to the end: {e}') from e
    if done.returncode != 0:
      raise BuildError('the compiler failed:\n' + done.stderr[-2000:])
    os.replace(partial, path)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  logger.info('torch_xla_patches: built the native fast path in %.1f s: %s',
              time.monotonic() - started, path)
  return path


def _load(path: str) -> ModuleType:
  import torch  # the module links against torch's libraries
  import torch_xla
  loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, path)
  spec = importlib.util.spec_from_file_location(MODULE_NAME,
                                                path,
                                                loader=loader)
  module = importlib.util.module_from_spec(spec)
  loader.exec_module(module)
  module.init(torch_xla._XLAC._unique_id_for_ir_and_data,
              torch_xla._XLAC._xla_get_tensor_id)
  return module


def _load_or_rebuild() -> ModuleType:
  """Loads this process's build; one that exists but does not load (a file
  cut short or damaged) is built again, once."""
  path = library_path()
  existed = os.path.exists(path)
  try:
    return _load(build())
  except ImportError as e:
    if not existed:
      raise
    logger.info('torch_xla_patches: %s does not load (%s); building it again',
                path, e)
    os.remove(path)
    return _load(build())


def helpers() -> Optional[ModuleType]:
  """The native module, built if need be (see [Note: Building the native
  fast path]); None where it cannot be had or config.native_fast_path is
  off."""
  global _module, _tried, unavailable_reason
  if not config.native_fast_path:
    return None
  with _lock:
    if not _tried:
      _tried = True
      try:
        _module = _load_or_rebuild()
      except (BuildError, ImportError, OSError) as e:
        unavailable_reason = str(e)
        logger.warning(
            'torch_xla_patches: no native fast path (%s); served calls run '
            'its Python twin, with more host time per call', unavailable_reason)
  return _module


def loaded() -> Optional[ModuleType]:
  """The native module if this process has it and config.native_fast_path
  is on; never builds."""
  return _module if config.native_fast_path else None


def main() -> int:
  """Builds the module ahead of time and prints its path (`make setup`)."""
  logging.basicConfig(level=logging.INFO, format='%(message)s')
  try:
    _load_or_rebuild()
    path = library_path()
  except (BuildError, ImportError, OSError) as e:
    print(f'torch_xla_patches: no native fast path: {e}', file=sys.stderr)
    return 1
  print(path)
  return 0

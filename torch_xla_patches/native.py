"""The served call's per-call work in C++ (csrc/fast_path.cpp; see [Note: The
native fast path] there): built by an explicit step, loaded if built.

[Note: Building the native fast path]
`torch.utils.cpp_extension.load()` compiles csrc/fast_path.cpp (shipped as
package data, so a wheel has it) against the torch of the building process,
with ninja, its file lock and its up-to-date check, into a directory per torch
build, Python and source under config.native_dir (by default
~/.cache/torch_xla_patches/native). It runs only when asked:
`torch-xla-patches-native` (`main()`; `make setup` runs it), or `build()`.
`helpers()`, which apply() and serve() call, only loads a library that is
already there, so no call of the package ever waits for a compiler.

* The build runs in a child process. load() numbers a second build of one
  name in a process (`_fast_path_v1`, whose init function the library does
  not have), holds its lock until the compiler is done, and has no timeout;
  a child gets a fresh numbering, and is stopped with its compiler after
  BUILD_TIMEOUT_SECONDS.
* The library load() leaves in the build directory is then copied next to
  it under its import name and renamed into place, so a process never loads
  a half-written library, nor one that a later build rewrites in place.
* A lock left by a build that was stopped (load() keeps it in a file) is
  removed once it is older than any build may run.
* Nothing about it can fail a user's call: not built, the flag off
  (XLA_PATCHES_NATIVE=0) or a library that does not load, `helpers()`
  returns None, says why once, and the package runs the Python twin of each
  function, which gives the same answers.
"""
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from types import ModuleType
from typing import List, Optional, Tuple

from torch_xla_patches import config

logger = logging.getLogger('torch_xla_patches.native')

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc',
                      'fast_path.cpp')
# The extension's name: csrc/fast_path.cpp defines PyInit__fast_path.
EXTENSION_NAME = '_fast_path'
MODULE_NAME = 'torch_xla_patches.' + EXTENSION_NAME
# The command that builds it (setup.py's console script for main()).
BUILD_COMMAND = 'torch-xla-patches-native'
# A build that takes longer is stopped (and the Python twins used).
BUILD_TIMEOUT_SECONDS = 600
# Flags added to cpp_extension's own (which set no optimization level).
EXTRA_CFLAGS = ['-O2']

# What the child process runs: load() alone, which builds (or finds the build
# up to date), imports the library to check it, and prints where it is.
_BUILDER = '''
import sys
from torch.utils import cpp_extension
name, source, directory = sys.argv[1:]
module = cpp_extension.load(name=name, sources=[source],
                            build_directory=directory,
                            extra_cflags=%r)
print(module.__file__)
''' % EXTRA_CFLAGS

# [Note: native module state] One lock guards the three values below:
# helpers() looks for the library once per process (or after reset()).
_lock = threading.Lock()
# The loaded module, once helpers() looked; None if it could not be had.
_module: Optional[ModuleType] = None
_tried = False
# Why there is no module, once known.
unavailable_reason: Optional[str] = None


class BuildError(RuntimeError):
  """The native module could not be built; the message says why."""


def default_dir() -> str:
  cache_home = os.environ.get('XDG_CACHE_HOME') or os.path.join(
      os.path.expanduser('~'), '.cache')
  return os.path.join(cache_home, 'torch_xla_patches', 'native')


def _build_key_parts() -> List[Tuple[str, bytes]]:
  """What a build depends on, by name. The library links against this torch
  build's C++ API, so any change of torch (its git revision as well as its
  version), Python, compiler or source needs a build of its own."""
  import torch
  with open(SOURCE, 'rb') as f:
    source = f.read()
  return [
      ('source', source),
      ('torch', f'{torch.__version__} {torch.version.git_version}'.encode()),
      ('python',
       f'{sys.version} {sysconfig.get_config_var("EXT_SUFFIX")}'.encode()),
      # cpp_extension compiles with $CXX, else c++.
      ('compiler', os.environ.get('CXX', 'c++').encode()),
      ('flags', ' '.join(EXTRA_CFLAGS).encode()),
  ]


def build_dir() -> str:
  """The directory of this process's build: the library under its import
  name, and cpp_extension's build directory `build/` beside it."""
  import torch
  digest = hashlib.sha256()
  for name, value in _build_key_parts():
    digest.update(name.encode())
    digest.update(hashlib.sha256(value).digest())
  return os.path.join(config.native_dir or default_dir(),
                      f'torch-{torch.__version__}-{digest.hexdigest()[:16]}')


def library_path() -> str:
  """Where this process's build of the module lives (or will)."""
  return os.path.join(
      build_dir(), EXTENSION_NAME + importlib.machinery.EXTENSION_SUFFIXES[0])


def _remove_stale_lock(directory: str) -> None:
  lock = os.path.join(directory, 'lock')
  try:
    age = time.time() - os.stat(lock).st_mtime
  except FileNotFoundError:
    return
  # Every build is stopped at BUILD_TIMEOUT_SECONDS, so an older lock is one
  # that a stopped build left (load() would wait for it for ever).
  if age > BUILD_TIMEOUT_SECONDS:
    logger.warning(
        'torch_xla_patches: removing %s, left %.0f s ago by a build that '
        'did not finish', lock, age)
    try:
      os.remove(lock)
    except FileNotFoundError:
      pass


def _run_builder(directory: str, timeout: float) -> str:
  """Runs load() in a child process; returns the library it built."""
  env = dict(os.environ)
  # load() runs `ninja` from PATH; a ninja that pip installed next to this
  # Python is found even where its environment is not activated.
  env['PATH'] = os.pathsep.join(
      [os.path.dirname(sys.executable),
       env.get('PATH', os.defpath)])
  command = [sys.executable, '-c', _BUILDER, EXTENSION_NAME, SOURCE, directory]
  try:
    # A session of its own, so that a stopped build stops its compiler too.
    child = subprocess.Popen(command,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             text=True,
                             env=env,
                             start_new_session=True)
  except OSError as e:
    raise BuildError(f'the build did not start: {e}') from e
  try:
    out, err = child.communicate(timeout=timeout)
  except subprocess.TimeoutExpired as e:
    os.killpg(child.pid, signal.SIGKILL)
    child.communicate()
    raise BuildError(f'the build took more than {timeout:.0f} s') from e
  lines = out.strip().splitlines()
  if child.returncode != 0 or not lines:
    raise BuildError('torch.utils.cpp_extension.load() failed:\n' +
                     (out + err)[-3000:])
  return lines[-1]


def build(timeout: float = BUILD_TIMEOUT_SECONDS) -> str:
  """Builds the module unless this build exists; returns its path. Raises
  BuildError. See [Note: Building the native fast path]. A timeout above
  BUILD_TIMEOUT_SECONDS is cut to it (the age of a stale lock)."""
  timeout = min(timeout, BUILD_TIMEOUT_SECONDS)
  if not os.path.exists(SOURCE):
    raise BuildError(f'its source {SOURCE} is not installed')
  path = library_path()
  if os.path.exists(path):
    return path
  directory = os.path.dirname(path)
  work = os.path.join(directory, 'build')
  os.makedirs(work, exist_ok=True)
  _remove_stale_lock(work)
  started = time.monotonic()
  built = _run_builder(work, timeout)
  handle, partial = tempfile.mkstemp(dir=directory, suffix='.partial')
  os.close(handle)
  try:
    # mkstemp's file is private; the library gets the built one's mode.
    shutil.copy2(built, partial)
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


def _find() -> ModuleType:
  """Loads this process's build if there is one; raises ImportError saying
  why not."""
  if not os.path.exists(SOURCE):
    raise ImportError(f'its source {SOURCE} is not installed')
  path = library_path()
  if not os.path.exists(path):
    raise ImportError(f'it is not built for this torch and Python; '
                      f'`{BUILD_COMMAND}` builds it')
  try:
    return _load(path)
  except (ImportError, OSError) as e:
    raise ImportError(f'{path} does not load ({e}); `{BUILD_COMMAND}` '
                      'builds it again') from e


def helpers() -> Optional[ModuleType]:
  """The native module if it is built (see [Note: Building the native fast
  path]); None where it is not, or does not load, or config.native_fast_path
  is off. Never builds."""
  global _module, _tried, unavailable_reason
  if not config.native_fast_path:
    return None
  with _lock:
    if not _tried:
      _tried = True
      try:
        _module = _find()
      except ImportError as e:
        unavailable_reason = str(e)
        logger.warning(
            'torch_xla_patches: no native fast path (%s); served calls run '
            'its Python twin, with more host time per call, and counters are '
            'bumped through torch_xla, which keeps 64 bytes per bump',
            unavailable_reason)
  return _module


def loaded() -> Optional[ModuleType]:
  """The native module if this process has it and config.native_fast_path
  is on; never builds, nor looks for a build."""
  return _module if config.native_fast_path else None


def reset() -> None:
  """Forgets what helpers() found, as in a new process (the library stays
  loaded)."""
  global _module, _tried, unavailable_reason
  with _lock:
    _module, _tried, unavailable_reason = None, False, None


def ensure_built(timeout: float = BUILD_TIMEOUT_SECONDS) -> str:
  """Builds the module if need be and loads it to check it. A library that
  does not load (a file cut short or damaged) is copied again from the
  build directory, and if that fails too, built again from nothing. Returns
  the library's path; raises BuildError."""
  path = build(timeout)
  try:
    _load(path)
    return path
  except (ImportError, OSError) as e:
    logger.warning(
        'torch_xla_patches: %s does not load (%s); building it '
        'again', path, e)
  os.remove(path)
  try:
    path = build(timeout)
    _load(path)
    return path
  except (BuildError, ImportError, OSError) as e:
    logger.warning(
        'torch_xla_patches: its build directory gives no library '
        'that loads either (%s); building it from nothing', e)
  shutil.rmtree(os.path.dirname(path), ignore_errors=True)
  path = build(timeout)
  try:
    _load(path)
  except (ImportError, OSError) as e:
    raise BuildError(f'{path} was built but does not load: {e}') from e
  return path


def main() -> int:
  """Builds the module ahead of time and prints its path (`make setup`,
  `torch-xla-patches-native`)."""
  logging.basicConfig(level=logging.INFO, format='%(message)s')
  try:
    path = ensure_built()
  except BuildError as e:
    print(f'torch_xla_patches: no native fast path: {e}', file=sys.stderr)
    return 1
  print(path)
  return 0

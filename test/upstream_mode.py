"""Run the repo's tests, or upstream's, against another bridge.

Two modes, each switched on at interpreter start by a `sitecustomize.py`
that `write_sitecustomize()` puts in a temporary directory (prepend that
directory and this one to PYTHONPATH):

  rendered  `install_rendered(dir)`: the files tools/make_upstream_patch.py
            wrote to `dir` take the place of torch_xla's own
            torch_xla/_dynamo/dynamo_bridge.py and config.py (and add its new
            torch_xla/_dynamo modules), as if the pull request were merged.
            torch_xla_patches.apply() and revert() become no-ops, and the
            package's bridge, signature, config and companion modules are
            aliased to the rendered ones, so tests that import them and
            monkeypatch config flags act on the code under test.
  patched   `torch_xla_patches.apply()` at start (for upstream's tests).

[Note: What the rendered mode replaces]
`import torch_xla` already imports torch_xla._dynamo.dynamo_bridge and
config. The rendered directory is put first on torch_xla._dynamo.__path__ and
the bridge is imported again from there; the rendered config runs inside the
existing config module object, so every earlier `from torch_xla._dynamo
import config` sees the new flags. torch_xla/core/dynamo_bridge.py is only
`from torch_xla._dynamo.dynamo_bridge import *`; if it is loaded, its names
are bound again (names only the old bridge had are deleted). dynamo's
openxla backend imports the core module lazily, on the first compile.
"""
import importlib
import os
import sys
import types
from typing import Dict, List

MODE_ENV = 'XLA_PATCHES_TEST_MODE'  # 'rendered' or 'patched'
RENDERED_DIR_ENV = 'XLA_PATCHES_RENDERED_DIR'
PACKAGE = 'torch_xla_patches'
_MANIFEST = 'MANIFEST'

# site.py reports an exception of sitecustomize and goes on, which would run
# a column unpatched under the column's name: the hook ends the process.
SITECUSTOMIZE = '''\
# Written by test/upstream_mode.py; switched by {mode_env}.
import os
if os.environ.get({mode_env!r}):
  try:
    import upstream_mode
    upstream_mode.install_from_env()
  except Exception:
    import traceback
    traceback.print_exc()
    raise SystemExit('{mode_env}: the start-up hook failed; refusing to run '
                     'the test unpatched')
'''


def write_sitecustomize(directory: str) -> str:
  """Writes the start-up hook into `directory`; returns its path."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, 'sitecustomize.py')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(SITECUSTOMIZE.format(mode_env=MODE_ENV))
  return path


def subprocess_env(mode: str,
                   hook_dir: str,
                   rendered_dir: str = None,
                   base: Dict[str, str] = None) -> Dict[str, str]:
  """The environment for a child process running in `mode` ('' = plain)."""
  env = dict(os.environ if base is None else base)
  env.setdefault('PJRT_DEVICE', 'CPU')
  here = os.path.dirname(os.path.abspath(__file__))
  repo = os.path.dirname(here)
  paths = [hook_dir, here, repo
          ] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
  env['PYTHONPATH'] = os.pathsep.join(paths)
  env.pop(MODE_ENV, None)
  if mode:
    env[MODE_ENV] = mode
  if rendered_dir:
    env[RENDERED_DIR_ENV] = os.path.abspath(rendered_dir)
  return env


def install_from_env() -> None:
  mode = os.environ.get(MODE_ENV, '')
  if mode == 'patched':
    import torch_xla_patches
    torch_xla_patches.apply()
  elif mode == 'rendered':
    install_rendered(os.environ[RENDERED_DIR_ENV])
  elif mode:
    raise ValueError(
        f'{MODE_ENV} must be "patched" or "rendered", got {mode!r}')


def _companions(rendered_dir: str) -> List[str]:
  with open(os.path.join(rendered_dir, _MANIFEST), encoding='utf-8') as f:
    names = [line.strip() for line in f if line.strip().endswith('.py')]
  return [
      name[:-3]
      for name in names
      if name not in ('dynamo_bridge.py', 'config.py')
  ]


def install_rendered(rendered_dir: str) -> types.ModuleType:
  """Loads the rendered bridge in place of torch_xla's; returns it."""
  rendered_dir = os.path.abspath(rendered_dir)
  for name in ('dynamo_bridge.py', 'config.py', _MANIFEST):
    if not os.path.exists(os.path.join(rendered_dir, name)):
      raise FileNotFoundError(
          f'{rendered_dir} has no {name}; run tools/make_upstream_patch.py '
          f'--out {rendered_dir} first')
  import torch_xla
  import torch_xla._dynamo as dynamo_package
  import torch_xla._dynamo.config as upstream_config
  import torch_xla._dynamo.dynamo_bridge as old_bridge

  dynamo_package.__path__.insert(0, rendered_dir)
  config_path = os.path.join(rendered_dir, 'config.py')
  with open(config_path, encoding='utf-8') as f:
    exec(compile(f.read(), config_path, 'exec'), upstream_config.__dict__)

  del sys.modules['torch_xla._dynamo.dynamo_bridge']
  bridge = importlib.import_module('torch_xla._dynamo.dynamo_bridge')
  if os.path.dirname(os.path.abspath(bridge.__file__)) != rendered_dir:
    raise RuntimeError(f'loaded {bridge.__file__}, not the rendered bridge')
  dynamo_package.dynamo_bridge = bridge
  core = sys.modules.get('torch_xla.core.dynamo_bridge')
  if core is not None:
    _rebind_star_import(core, old_bridge, bridge)
  companions = {
      name: importlib.import_module(f'torch_xla._dynamo.{name}')
      for name in _companions(rendered_dir)
  }
  _alias_package(bridge, upstream_config, companions)
  return bridge


def _public(module: types.ModuleType) -> Dict[str, object]:
  names = getattr(module, '__all__', None)
  if names is None:
    names = [n for n in vars(module) if not n.startswith('_')]
  return {n: getattr(module, n) for n in names}


def _rebind_star_import(target: types.ModuleType, old: types.ModuleType,
                        new: types.ModuleType) -> None:
  for name, value in _public(old).items():
    if getattr(target, name, None) is value:
      delattr(target, name)
  vars(target).update(_public(new))


def _alias_package(bridge, upstream_config, companions) -> None:
  """Points torch_xla_patches' modules at the rendered ones and turns
  apply()/revert() into no-ops."""
  import torch_xla_patches
  from torch_xla_patches import config as our_config

  # Flags only apply() reads are not rendered; keep them readable.
  for name, value in vars(our_config).items():
    if not name.startswith('__') and not hasattr(upstream_config, name):
      setattr(upstream_config, name, value)
  aliases = {'dynamo_bridge': bridge, 'config': upstream_config}
  aliases.update(companions)
  for name, module in aliases.items():
    sys.modules[f'{PACKAGE}.{name}'] = module
    setattr(torch_xla_patches, name, module)

  def apply(*args, **kwargs):
    """No-op: the rendered bridge is already torch_xla's bridge."""

  def revert():
    """No-op: see apply()."""

  torch_xla_patches.apply = apply
  torch_xla_patches.revert = revert
  torch_xla_patches.UPSTREAM_MODE = 'rendered'

"""Every package module's `__all__` names only what the module defines, so
`from torch_xla_patches.<module> import *` works."""
import importlib
import os
import sys
import types

import pytest

import torch_xla_patches

PACKAGE_DIR = os.path.dirname(torch_xla_patches.__file__)
MODULES = sorted(
    'torch_xla_patches' if name == '__init__.py' else 'torch_xla_patches.' +
    name[:-3] for name in os.listdir(PACKAGE_DIR) if name.endswith('.py'))


def missing_exports(module: types.ModuleType):
  """The names of `module.__all__` that the module does not have."""
  return [
      name for name in getattr(module, '__all__', ())
      if not hasattr(module, name)
  ]


def test_every_module_is_listed():
  assert len(MODULES) > 20
  assert 'torch_xla_patches.serialization' in MODULES


@pytest.mark.parametrize('name', MODULES)
def test_star_import_works(name):
  module = importlib.import_module(name)
  assert missing_exports(module) == []
  namespace = {}
  exec(f'from {name} import *', namespace)  # pylint: disable=exec-used
  exported = getattr(module, '__all__', None)
  if exported is not None:
    assert set(namespace) - {'__builtins__'} == set(exported)


def test_a_stale_name_is_found(monkeypatch):
  module = types.ModuleType('stale')
  module.kept = 1
  module.__all__ = ['kept', 'removed']
  assert missing_exports(module) == ['removed']
  monkeypatch.setitem(sys.modules, 'stale', module)
  with pytest.raises(AttributeError, match="has no attribute 'removed'"):
    exec('from stale import *', {})  # pylint: disable=exec-used


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

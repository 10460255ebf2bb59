"""Dependencies inside the package run one way: a module imports only the
modules below it in LAYERS (function-level imports included)."""
import ast
import os
import sys

import pytest

import torch_xla_patches

# Bottom first. The order README's layout lists.
LAYERS = (
    'versions',
    'config',
    '_patching',
    'signature',
    'io_utils',
    'fingerprint',
    'persistent',
    'dynamo_bridge',
    'decompositions',
    'warmup',
    'torch_internals',
    'source_digest',
    'artifact',
    'serializable_backend',
    'serialization',
    'cache',
    '__init__',
)
PACKAGE_DIR = os.path.dirname(torch_xla_patches.__file__)


def package_imports(module: str):
  """The package modules `module` imports anywhere in its source."""
  with open(os.path.join(PACKAGE_DIR, module + '.py')) as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == 'torch_xla_patches':
        found.update(alias.name for alias in node.names)
      elif node.module.startswith('torch_xla_patches.'):
        found.add(node.module.split('.')[1])
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith('torch_xla_patches.'):
          found.add(alias.name.split('.')[1])
  return found


def test_every_module_has_a_layer():
  modules = {
      name[:-3] for name in os.listdir(PACKAGE_DIR) if name.endswith('.py')
  }
  assert modules == set(LAYERS)


@pytest.mark.parametrize('module', LAYERS)
def test_imports_only_lower_layers(module):
  higher = {
      name for name in package_imports(module)
      if LAYERS.index(name) >= LAYERS.index(module)
  }
  assert not higher, f'{module} imports {sorted(higher)}, which sit above it'


def test_the_bridge_imports_neither_warmup_nor_serialization():
  assert not package_imports('dynamo_bridge') & {
      'warmup', 'serialization', 'serializable_backend', 'artifact'
  }


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

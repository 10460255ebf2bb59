"""The package's architecture, written down: which layer each module belongs
to, and the rules its imports follow.

  * A module imports only modules of its own layer or of lower layers
    (function-level imports included), and the imports inside one layer
    form no cycle.
  * A module never reaches into another package module's private names
    (`other._name`, `from other import _name`): it uses public functions and
    methods.
README and CONTRIBUTING point here rather than repeating the layers.
"""
import ast
import os
import sys
from typing import Dict, Set

import pytest

import torch_xla_patches

# Bottom first.
LAYERS = (
    ('foundation', {
        'runtime', 'versions', 'config', '_patching', 'io_utils',
        'torch_internals', 'native'
    }),
    # What each graph input is, and the per-call key; a served call's
    # structure.
    ('signature', {'signature', 'call_spec'}),
    # What is kept on disk: records (index and artifact alike), the index,
    # graph fingerprints.
    ('records and index', {'record', 'signature_index', 'fingerprint'}),
    # The bridge, by job, each module importing only those before it:
    # counters -> execution (the lock, runs, syncs) -> donation ->
    # handover_sync (a new graph's pending arguments synced off the lock) ->
    # tracing ->
    # placeholder_trace -> fallback_probe (the look-ahead's fallback and
    # value-reading ops) -> program_run (one run and its write-back) ->
    # compile_window -> bound_program -> backlog -> signature_cache ->
    # graph_updates (which nodes update tensors in place) -> dynamo_bridge; and the SymInt-safe kernels tracing needs
    # (decompositions).
    ('bridge', {
        'counters', 'execution', 'donation', 'handover_sync', 'tracing',
        'placeholder_trace', 'fallback_probe', 'program_run', 'compile_window',
        'bound_program', 'backlog', 'signature_cache', 'graph_updates',
        'dynamo_bridge', 'decompositions'
    }),
    # Users of the bridge, through its public methods.
    # The artifact: its key, file format and backend; aot_compile, save and
    # load.
    ('serialization', {
        'source_digest', 'serve_key', 'artifact', 'serializable_backend',
        'serialization'
    }),
    # A served call, from its key to its result: the results the captured
    # code builds (captured_results) -> the plan that runs it without that
    # code (call_plan) -> fast_dispatch -> served_model.
    ('served calls',
     {'captured_results', 'call_plan', 'fast_dispatch', 'served_model'}),
    # Warm-up calls what it is handed: a served model, or any compiled
    # callable.
    ('warm-up', {'warmup'}),
    # serve(), which goes down these layers in one pass (serving.serve), and
    # the cache CLI.
    ('serving and tools', {'serving', 'cache'}),
    # Generation over serve(): slots of one KV cache (slot_cache), an engine
    # loop (generation).
    ('generation', {'slot_cache', 'generation'}),
    # The reference HTTP server over the generation engine.
    ('reference server', {'server'}),
    ('package API', {'__init__'}),
)
LAYER_OF = {
    module: number for number, (_, modules) in enumerate(LAYERS)
    for module in modules
}
PACKAGE_DIR = os.path.dirname(torch_xla_patches.__file__)


def _tree(module: str) -> ast.AST:
  with open(os.path.join(PACKAGE_DIR, module + '.py')) as f:
    return ast.parse(f.read())


def package_imports(module: str) -> Set[str]:
  """The package modules `module` imports anywhere in its source."""
  return imports_in(_tree(module))


def imports_in(tree: ast.AST) -> Set[str]:
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
  return found & set(LAYER_OF)


def private_uses(tree: ast.AST) -> Set[str]:
  """`other._name` and `from other import _name` for package modules."""
  # Local name -> package module, from this module's imports.
  aliases: Dict[str, str] = {}
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      target = node.module.split('.')
      if target[0] != 'torch_xla_patches':
        continue
      for alias in node.names:
        if len(target) == 1 and alias.name in LAYER_OF:
          aliases[alias.asname or alias.name] = alias.name
        elif alias.name.startswith('_') and len(target) == 2:
          found.add(f'{target[1]}.{alias.name}')
    elif isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split('.')
        if parts[0] == 'torch_xla_patches' and len(parts) == 2 and alias.asname:
          aliases[alias.asname] = parts[1]
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and
        node.value.id in aliases and node.attr.startswith('_') and
        not node.attr.startswith('__')):
      found.add(f'{aliases[node.value.id]}.{node.attr}')
  return found


def test_every_module_has_exactly_one_layer():
  modules = {
      name[:-3] for name in os.listdir(PACKAGE_DIR) if name.endswith('.py')
  }
  assert modules == set(LAYER_OF)
  assert sum(len(m) for _, m in LAYERS) == len(LAYER_OF)


@pytest.mark.parametrize('module', sorted(LAYER_OF))
def test_imports_only_its_own_or_lower_layers(module):
  higher = {
      name for name in package_imports(module)
      if LAYER_OF[name] > LAYER_OF[module]
  }
  assert not higher, (f'{module} ({LAYERS[LAYER_OF[module]][0]}) imports '
                      f'{sorted(higher)}, which sit above it')


def test_no_import_cycle_inside_a_layer():
  for name, modules in LAYERS:
    graph = {m: package_imports(m) & modules - {m} for m in modules}
    done: Set[str] = set()

    def visit(module, path):
      assert module not in path, (f'import cycle in layer {name}: '
                                  f'{" -> ".join(path + [module])}')
      if module in done:
        return
      for dependency in graph[module]:
        visit(dependency, path + [module])
      done.add(module)

    for module in modules:
      visit(module, [])


@pytest.mark.parametrize('module', sorted(LAYER_OF))
def test_no_module_uses_another_modules_private_names(module):
  assert not private_uses(_tree(module))


def test_the_checks_see_violations():
  tree = ast.parse('from torch_xla_patches import record as r, signature\n'
                   'from torch_xla_patches.backlog import _Budget, Backlog\n'
                   'import torch_xla_patches.serialization as s\n'
                   'r._short(1); signature.tuple_getter; s._warm_up\n')
  assert private_uses(tree) == {
      'record._short', 'backlog._Budget', 'serialization._warm_up'
  }
  assert imports_in(tree) == {'record', 'signature', 'backlog', 'serialization'}


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

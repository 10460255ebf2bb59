"""torch_internals.py: the private torch APIs other modules reach through it,
and the rule of [Note: Private torch APIs]: no package module but
torch_internals.py and dynamo_bridge.py names a private torch API."""
import ast
import os
import sys
import threading
from typing import Dict, List, Optional, Tuple

import pytest

import test_layering
import torch
import torch._dynamo
import torch_xla  # noqa: F401  registers the AutogradXLA kernels
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_xla_patches
from torch_xla_patches import torch_internals

PACKAGE_DIR = os.path.dirname(torch_xla_patches.__file__)
# See [Note: Private torch APIs].
# donation.py carries the bridge's own uses (functionalization's replace and
# commit, AOTAutograd's tracing context) into the rendered pull request, where
# torch_internals.py does not go; so does fallback_probe.py (the look-ahead's
# dispatch mode, dispatch-key and pytree calls, moved out of the bridge).
NOT_SCANNED = ('torch_internals.py', 'dynamo_bridge.py', 'donation.py',
               'fallback_probe.py')
# (module file, use as private_torch_uses names it) -> why it cannot go
# through torch_internals.
_COMPILE_LOCK_REASON = (
    "a trace's restore takes dynamo's compile lock (see [Note: Restores and "
    "dynamo's compiles]); tracing.py goes into the rendered pull request, "
    'where torch_internals.py does not')
EXCEPTIONS: Dict[Tuple[str, str], str] = {
    ('tracing.py', 'import torch._dynamo.convert_frame'):
        _COMPILE_LOCK_REASON,
    ('tracing.py', 'torch._dynamo.convert_frame.compile_lock'):
        _COMPILE_LOCK_REASON,
}


def _is_private(name: str) -> bool:
  return name.startswith('_') and not (name.startswith('__') and
                                       name.endswith('__'))


def _dotted(node: ast.AST) -> Optional[List[str]]:
  """['torch', '_dynamo', 'config'] for `torch._dynamo.config`, or None if
  the chain does not start at a name."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  return [node.id] + parts[::-1]


def _private_module(module: str) -> bool:
  parts = module.split('.')
  return parts[0] == 'torch' and any(_is_private(p) for p in parts[1:])


def private_torch_uses(source: str) -> List[str]:
  """'line N: USE' for each private torch API `source` names: an attribute
  chain from the name `torch` with a private component (the longest chain
  only), and `import torch._x` / `from torch._x import ...`. The namespace
  and op name of `torch.ops.NS.OP` are op names (`aten._to_copy`), not
  Python API."""
  tree = ast.parse(source)
  inner = {
      id(node.value)
      for node in ast.walk(tree)
      if isinstance(node, ast.Attribute)
  }
  uses = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and id(node) not in inner:
      parts = _dotted(node)
      if not parts or parts[0] != 'torch':
        continue
      checked = parts[1:]
      if checked[0] == 'ops':
        checked = checked[3:]
      if any(_is_private(p) for p in checked):
        uses.append((node.lineno, '.'.join(parts)))
    elif isinstance(node, ast.Import):
      uses += [(node.lineno, f'import {alias.name}')
               for alias in node.names
               if _private_module(alias.name)]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = ', '.join(alias.name for alias in node.names)
      if _private_module(node.module) or (node.module == 'torch' and any(
          _is_private(alias.name) for alias in node.names)):
        uses.append((node.lineno, f'from {node.module} import {names}'))
  return [f'line {line}: {use}' for line, use in sorted(uses)]


def _scanned_modules() -> List[str]:
  return sorted(name for name in os.listdir(PACKAGE_DIR)
                if name.endswith('.py') and name not in NOT_SCANNED)


def _uses_in(module: str) -> List[str]:
  with open(os.path.join(PACKAGE_DIR, module)) as f:
    return private_torch_uses(f.read())


def _use_of(found: str) -> str:
  return found.split(': ', 1)[1]


def test_the_scan_finds_each_kind_of_use():
  source = '\n'.join([
      'import torch',
      'import torch._dynamo',
      'from torch._C import DispatchKey',
      'from torch import _C',
      'torch._dynamo.config.patch(x=1)',
      'k = torch._decomp.decomposition_table[op]',
      'v = torch.__version__',
      'm = torch.nn.Module',
      'c = torch.ops.aten._to_copy.default',
      'd = torch.ops.aten.add.Tensor._op_dk',
      'from .x import _y',
  ])
  assert private_torch_uses(source) == [
      'line 2: import torch._dynamo',
      'line 3: from torch._C import DispatchKey',
      'line 4: from torch import _C',
      'line 5: torch._dynamo.config.patch',
      'line 6: torch._decomp.decomposition_table',
      'line 10: torch.ops.aten.add.Tensor._op_dk',
  ]


@pytest.mark.parametrize('module', _scanned_modules())
def test_no_private_torch_api_outside_torch_internals(module):
  found = [
      use for use in _uses_in(module)
      if (module, _use_of(use)) not in EXCEPTIONS
  ]
  assert not found, (f'{module} uses private torch APIs; give each a function '
                     'in torch_internals.py (see [Note: Private torch '
                     'APIs]):\n  ' + '\n  '.join(found))


def test_every_exception_is_still_needed():
  for module, use in EXCEPTIONS:
    assert use in [_use_of(u) for u in _uses_in(module)], (module, use)


def test_torch_internals_imports_only_versions_from_the_package():
  assert test_layering.package_imports('torch_internals') <= {'versions'}


def test_unwrapped_module():
  model = torch.nn.Linear(2, 2)
  assert torch_internals.unwrapped_module(torch.compile(model)) is model
  assert torch_internals.unwrapped_module(model) is model
  assert torch_internals.unwrapped_module(len) is len


def test_graph_loading_fake_mode_has_a_shape_env_of_its_own():
  first = torch_internals.graph_loading_fake_mode()
  second = torch_internals.graph_loading_fake_mode()
  assert isinstance(first, FakeTensorMode)
  assert first.shape_env is not None
  assert first.shape_env is not second.shape_env


def test_dynamo_config_names_a_missing_flag():
  assert torch_internals.dynamo_config(
      'automatic_dynamic_shapes',
      'enable_cpp_symbolic_shape_guards') is torch._dynamo.config
  with pytest.raises(torch_internals.TorchInternalsError) as info:
    torch_internals.dynamo_config('automatic_dynamic_shapes', 'no_such_flag')
  assert str(info.value) == (
      'torch_xla_patches: the config flag torch._dynamo.config.no_such_flag '
      f'is missing from torch {torch.__version__}; torch_xla_patches needs '
      'the torch releases listed in torch_xla_patches/versions.py.')


def test_dispatch_helpers():
  op = torch.ops.aten.native_layer_norm.default
  key = torch_internals.autograd_xla_key()
  assert key == torch._C.DispatchKey.AutogradXLA
  assert torch_internals.has_cpp_kernel(op, key)
  # torch_xla registers no autograd kernel of its own for add.
  assert not torch_internals.has_cpp_kernel(torch.ops.aten.add.Tensor, key)
  x = torch.randn(3, 4)
  expected = op(x, [4], None, None, 1e-5)
  actual = torch_internals.decomposition(op)(x, [4], None, None, 1e-5)
  for a, e in zip(actual, expected):
    torch.testing.assert_close(a, e)
  assert not torch_internals.has_symbolic_sizes_strides(x)
  # The CPU kernel, called directly.
  cpu = torch_internals.cpp_kernel(op, torch._C.DispatchKey.CPU)
  for a, e in zip(cpu(x, [4], None, None, 1e-5), expected):
    torch.testing.assert_close(a, e)


def test_fx_tracing_flag_users_are_the_ones_dynamo_and_fx_use():
  # See [Note: FX tracing seen per thread]: Tracer.trace is what sets FX's
  # flag, and dynamo binds the check it names when torch.compile wraps a
  # function (is_fx_symbolic_tracing on torch 2.9, is_fx_tracing on 2.8).
  import inspect
  from torch._dynamo import eval_frame
  from torch.fx import _symbolic_trace
  tracer, module, name = torch_internals.fx_tracing_flag_users()
  assert tracer is torch.fx.Tracer and module is _symbolic_trace
  assert '_is_fx_tracing_flag = True' in inspect.getsource(tracer.trace)
  assert (f'torch.fx._symbolic_trace.{name}\n'
          in inspect.getsource(eval_frame._TorchDynamoContext.__call__))


def test_fx_tracing_on_this_thread_counts_each_threads_traces():
  flag = [False]

  class Tracer:

    def trace(self, then):
      # As FX's Tracer.trace sets its flag.
      old, flag[0] = flag[0], True
      try:
        return then()
      finally:
        flag[0] = old

  check = torch_internals.fx_tracing_on_this_thread(lambda: flag[0], Tracer)
  trace = Tracer.trace
  Tracer.trace = torch_internals.counting_fx_traces(trace)
  try:
    assert not check()
    assert Tracer().trace(check)
    # Nested traces, and the count back to 0 after one raised.
    assert Tracer().trace(lambda: Tracer().trace(check) and check())
    with pytest.raises(ZeroDivisionError):
      Tracer().trace(lambda: 1 / 0)
    assert Tracer().trace(check)
    # The flag set by a trace of another thread.
    seen = []
    other = threading.Thread(target=lambda: seen.append(check()))
    flag[0] = True
    other.start()
    other.join()
    assert seen == [False]
  finally:
    flag[0] = False
    Tracer.trace = trace
  # Without the counting wrapper in place, the check is the flag's.
  flag[0] = True
  assert check()


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

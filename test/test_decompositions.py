"""torch_xla_patches.decompositions: scoped to symbolic inputs, removable.

See [Note: Scoping the decompositions to symbolic inputs]: eager XLA calls and
static-shape compiles must produce the same IR, graphs and XLA programs with
the overrides installed as without them.
"""
import copy
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch_xla
from torch._C import DispatchKey
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.torchxla import openxla_eval_boxed

from torch_xla_patches import decompositions

KEY = DispatchKey.AutogradXLA


def _maxpool_input(*shape):
  return lambda: torch.randn(*shape, requires_grad=True)


# One module per overridden op: (op name, module factory, input factory).
# Inputs require grad so the AutogradXLA kernels take their autograd path.
MODULES = {
    'aten::native_layer_norm':
        (lambda: nn.LayerNorm(8),
         lambda: torch.randn(3, 5, 8, requires_grad=True)),
    'aten::native_group_norm':
        (lambda: nn.GroupNorm(2, 4),
         lambda: torch.randn(3, 4, 5, requires_grad=True)),
    'aten::max_pool2d': (lambda: nn.MaxPool2d(2), _maxpool_input(2, 3, 6, 8)),
    'aten::max_pool3d': (lambda: nn.MaxPool3d(2), _maxpool_input(2, 3, 4, 6,
                                                                 8)),
}


@pytest.fixture
def uninstalled():
  decompositions.uninstall()
  decompositions.reset_calls()  # call counts start at zero in every test
  torch._dynamo.reset()
  yield
  decompositions.uninstall()
  torch._dynamo.reset()


def test_every_override_has_a_module_here():
  assert set(MODULES) == {o.op.name() for o in decompositions.OVERRIDES}


def test_install_is_idempotent_and_uninstall_removes(uninstalled):
  ops = [o.op for o in decompositions.OVERRIDES]
  assert not any(KEY in op.py_kernels for op in ops)
  decompositions.install()
  kernels = {op: op.py_kernels[KEY] for op in ops}
  decompositions.install()
  assert {op: op.py_kernels[KEY] for op in ops} == kernels
  assert decompositions.installed_ops() == ops
  decompositions.uninstall()
  assert not decompositions.is_installed()
  for op in ops:
    assert KEY not in op.py_kernels
    assert op._dispatch_cache.get(KEY) is not kernels[op]
  decompositions.uninstall()  # safe twice


def test_install_refuses_a_foreign_kernel(uninstalled):
  op = decompositions.OVERRIDES[-1].op
  foreign = lambda *args, **kwargs: None
  op.py_kernels[KEY] = foreign
  try:
    with pytest.raises(RuntimeError, match='already has a Python'):
      decompositions.install()
    # All or nothing: no other op got a kernel either.
    assert not decompositions.is_installed()
    assert not any(
        KEY in o.op.py_kernels for o in decompositions.OVERRIDES[:-1])
  finally:
    del op.py_kernels[KEY]
    op._dispatch_cache.clear()


def _layer_norm_dynamic(device):
  torch._dynamo.reset()
  ln = torch.compile(nn.LayerNorm(8).to(device),
                     backend='openxla',
                     dynamic=True)
  return ln(torch.randn(3, 5, 8, device=device, requires_grad=True))


def test_uninstall_restores_upstream_behaviour(uninstalled):
  device = torch_xla.device()
  ops = [o.op for o in decompositions.OVERRIDES]
  decompositions.install()
  kernels = {op: op.py_kernels[KEY] for op in ops}
  _layer_norm_dynamic(device)
  assert decompositions.calls()['aten::native_layer_norm']['symbolic'] > 0
  # Calls with the Python dispatcher on cache every op's dispatch decision:
  # the installed kernel.
  for name in sorted(MODULES):
    _lazy_ir(name, python_dispatcher=True)
  assert all(op._dispatch_cache.get(KEY) is kernels[op] for op in ops)
  decompositions.uninstall()
  decompositions.reset_calls()
  # Now the same calls reach torch_xla's kernels, not the removed ones (which
  # a stale dispatch cache would still call).
  for name in sorted(MODULES):
    _lazy_ir(name, python_dispatcher=True)
  assert decompositions.calls() == {}
  # The upstream failure this module exists for is back.
  with pytest.raises(Exception, match='numel'):
    _layer_norm_dynamic(device)
  assert decompositions.calls() == {}


def _lazy_ir(name: str, python_dispatcher: bool):
  """IR text and graph hash of an eager XLA forward + backward."""
  device = torch_xla.device()
  make_module, make_input = MODULES[name]
  torch.manual_seed(0)
  module = make_module().to(device)
  x = make_input().detach().to(device).requires_grad_()
  torch_xla.sync()
  if python_dispatcher:
    with enable_python_dispatcher():
      out = module(x)
  else:
    out = module(x)
  out.sum().backward()
  tensors = [out, x.grad] + [p.grad for p in module.parameters()]
  text = torch_xla._XLAC._get_xla_tensors_text(tensors)
  graph_hash = torch_xla._XLAC._get_graph_hash(tensors)
  torch_xla.sync()
  return text, graph_hash


@pytest.mark.parametrize('name', sorted(MODULES))
def test_eager_ir_unchanged(uninstalled, name):
  before = _lazy_ir(name, python_dispatcher=False)
  decompositions.install()
  decompositions.reset_calls()
  assert _lazy_ir(name, python_dispatcher=False) == before
  # Eager dispatch never reaches the Python kernels.
  assert decompositions.calls() == {}
  # With the Python dispatcher on (as while tracing) it does, and concrete
  # inputs go to torch_xla's own kernel: same IR.
  assert _lazy_ir(name, python_dispatcher=True) == before
  assert decompositions.calls()[name] == {'original': 1}


class _Recorder:
  """An openxla backend that records FX graphs and XLA graph hashes."""

  def __init__(self, monkeypatch):
    self.codes = []
    self.hashes = []
    get_hash = torch_xla._XLAC._get_graph_hash

    def recording_get_hash(tensors):
      h = get_hash(tensors)
      self.hashes.append(h)
      return h

    monkeypatch.setattr(torch_xla._XLAC, '_get_graph_hash', recording_get_hash)

    def compiler(gm, example_inputs):
      self.codes.append(gm.code)
      return openxla_eval_boxed(gm, example_inputs)

    self.backend = aot_autograd(fw_compiler=compiler)


def _static_compile(name, monkeypatch):
  device = torch_xla.device()
  make_module, make_input = MODULES[name]
  torch.manual_seed(0)
  cpu_module = make_module()
  module = copy.deepcopy(cpu_module).to(device)
  recorder = _Recorder(monkeypatch)
  torch._dynamo.reset()
  compiled = torch.compile(module, backend=recorder.backend, dynamic=False)
  x_cpu = make_input()
  x = x_cpu.detach().to(device).requires_grad_()
  out = compiled(x)
  out.sum().backward()
  expected = cpu_module(x_cpu)
  expected.sum().backward()
  torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
  torch.testing.assert_close(x.grad.cpu(), x_cpu.grad, atol=1e-5, rtol=1e-5)
  monkeypatch.undo()
  return recorder.codes, recorder.hashes


def _static_outcome(name, monkeypatch):
  try:
    return _static_compile(name, monkeypatch)
  except torch._dynamo.exc.TorchRuntimeError as e:
    # MaxPool3d: torch_xla's AutogradXLA kernel rejects fake tensors ("Expected
    # XLA tensor"), so static compiles fail upstream; they must keep failing
    # the same way, not change silently.
    # torch_xla 2.8 appends a C++ stack trace (with addresses) to the message.
    monkeypatch.undo()
    message = str(e).split('from user code')[0]
    return 'error', message.split('*** Begin stack trace ***')[0]


@pytest.mark.parametrize('name', sorted(MODULES))
def test_static_compile_unchanged(uninstalled, monkeypatch, name):
  before = _static_outcome(name, monkeypatch)
  decompositions.install()
  decompositions.reset_calls()
  assert _static_outcome(name, monkeypatch) == before
  # Not vacuous: the kernel ran during tracing and chose torch_xla's own,
  # never the symbolic one.
  calls = decompositions.calls()[name]
  assert list(calls) == ['original'] and calls['original'] > 0, calls


# Three shapes per module for the dynamic tests; feature dims stay fixed.
NO_GRAD_SHAPES = {
    'aten::native_layer_norm': [(3, 5, 8), (4, 7, 8), (6, 9, 8)],
    'aten::native_group_norm': [(3, 4, 5), (4, 4, 7), (6, 4, 9)],
    'aten::max_pool2d': [(2, 3, 6, 8), (3, 3, 8, 10), (5, 3, 4, 12)],
    'aten::max_pool3d': [(2, 3, 4, 6, 8), (3, 3, 6, 8, 4), (4, 3, 8, 4, 6)],
}


@pytest.mark.parametrize('name', sorted(MODULES))
def test_dynamic_no_grad(uninstalled, name):
  # Under no_grad AOTAutograd traces an inference graph, not a joint one: the
  # AutogradXLA kernels still run first and must take the symbolic path.
  decompositions.install()
  device = torch_xla.device()
  make_module, _ = MODULES[name]
  torch.manual_seed(0)
  module = make_module()
  compiled = torch.compile(copy.deepcopy(module).to(device),
                           backend='openxla',
                           dynamic=True)
  for shape in NO_GRAD_SHAPES[name]:
    x = torch.randn(*shape)
    with torch.no_grad():
      out = compiled(x.to(device))
    torch.testing.assert_close(out.cpu(), module(x).detach())
  assert decompositions.calls()[name]['symbolic'] > 0


def test_max_pool3d_dynamic(uninstalled):
  # MaxPool3d is not in the module survey; check its decomposition here.
  decompositions.install()
  device = torch_xla.device()
  module = nn.MaxPool3d(2)
  compiled = torch.compile(module, backend='openxla', dynamic=True)
  for shape in [(2, 3, 4, 6, 8), (3, 3, 6, 8, 4), (4, 3, 8, 4, 6)]:
    x_cpu = torch.randn(*shape, requires_grad=True)
    x = x_cpu.detach().to(device).requires_grad_()
    out = compiled(x)
    expected = module(x_cpu)
    torch.testing.assert_close(out.cpu(), expected)
    w = torch.randn(expected.shape)
    (out * w.to(device)).sum().backward()
    (expected * w).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad)
  assert decompositions.calls()['aten::max_pool3d']['symbolic'] > 0


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

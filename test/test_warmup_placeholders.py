"""What a warm-up traces with holds no device buffer (see [Note:
Placeholder tensors] in io_utils.py), and a sync of the device on another
thread waits for the graphs it leaves pending (see [Note: Syncs wait for
placeholder graphs] in warmup.py)."""
import threading
import time

import pytest
import torch
import torch_xla

import torch_xla_patches
from torch_xla_patches import (CallSpec, TensorSpec, compile_window,
                               dynamo_bridge, fallback_probe, io_utils, warmup)

pytestmark = pytest.mark.usefixtures('patched_bridge')

SLOTS, WIDTH = 64, 8


class CacheStep(torch.nn.Module):
  """A decode step writing its rows of a cache passed as an argument."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(WIDTH, WIDTH)

  def forward(self, x, slots, cache):
    cache.index_copy_(0, slots, self.proj(x))
    return cache.sum(0) + x.sum(0)


def buckets():
  return [
      CallSpec(TensorSpec((rows, WIDTH)),
               slots=TensorSpec((rows,), torch.long),
               cache=TensorSpec((SLOTS, WIDTH))) for rows in (2, 4)
  ]


def models():
  torch.manual_seed(0)
  cpu = CacheStep().eval()
  model = CacheStep().eval()
  model.load_state_dict(cpu.state_dict())
  return cpu, model.to(torch_xla.device())


def check(served, cpu, rows):
  x = torch.randn(rows, WIDTH)
  slots = torch.randperm(SLOTS)[:rows]
  cache = torch.randn(SLOTS, WIDTH)
  with torch.no_grad():
    expected = cpu(x, slots, cache.clone())
    device = torch_xla.device()
    got = served(x.to(device), slots=slots.to(device), cache=cache.to(device))
  torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_placeholder_has_a_shape_and_no_buffer_to_sync():
  tensor = io_utils.placeholder((3, 5), torch.bfloat16)
  assert (tensor.shape, tensor.dtype) == ((3, 5), torch.bfloat16)
  assert io_utils.is_placeholder(tensor)
  assert not io_utils.is_placeholder(torch.zeros(3, 5))
  tensor.add_(1)
  assert torch_xla._XLAC._check_tensor_need_materialization([tensor]) == [True]
  io_utils.reset_placeholder(tensor)
  assert torch_xla._XLAC._check_tensor_need_materialization([tensor]) == [False]
  assert io_utils.is_placeholder(tensor)


def test_a_warm_up_makes_no_tensor_with_a_buffer(monkeypatch):
  made = []
  zeros = io_utils.zeros_on_device

  def noted_zeros(shape, dtype, device):
    made.append(tuple(shape))
    return zeros(shape, dtype, device)

  monkeypatch.setattr(io_utils, 'zeros_on_device', noted_zeros)
  cpu, model = models()
  served = torch_xla_patches.serve(model, buckets(), wait=True)
  assert made == []
  assert served.readiness().ready == 2
  for rows in (2, 4, 2):
    check(served, cpu, rows)
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  report = torch_xla_patches.precompile(compiled, buckets(), progress=False)
  assert len(report) == 2 and made == []


def test_a_sync_on_another_thread_waits_for_a_placeholder_compile(monkeypatch):
  compile_graph = compile_window.compile_graph
  compiling, release = threading.Event(), threading.Event()

  def held_compile(graph_tensors):
    compiling.set()
    release.wait()
    compile_graph(graph_tensors)

  monkeypatch.setattr(compile_window, 'compile_graph', held_compile)
  cpu, model = models()
  served = torch_xla_patches.serve(model, buckets()[:1], wait=False)
  synced = []
  other = torch.ones(3, device=torch_xla.device()) * 2

  def sync():
    torch_xla.sync()
    synced.append(other.cpu())

  syncing = threading.Thread(target=sync)
  try:
    assert compiling.wait(timeout=120)
    syncing.start()
    # Polled until the sync waits (a bound, not a wait that decides).
    deadline = time.monotonic() + 120
    while (io_utils.placeholder_traces.syncs_waiting() == 0 and
           time.monotonic() < deadline):
      time.sleep(0.01)
    assert io_utils.placeholder_traces.syncs_waiting() == 1
    assert synced == []
  finally:
    release.set()
  syncing.join(timeout=120)
  assert not syncing.is_alive()
  torch.testing.assert_close(synced[0], torch.full((3,), 2.0))
  assert served.wait_ready(timeout=120)
  check(served, cpu, 2)


def test_another_threads_read_runs_while_a_look_ahead_is_on_placeholders(
    monkeypatch):
  # The look-ahead on placeholders refuses nothing to other threads (see
  # [Note: Look-ahead on placeholders] in dynamo_bridge.py).
  run_node = dynamo_bridge.UnsupportedNodesCollector.run_node
  looking, release = threading.Event(), threading.Event()

  def held_run_node(collector, node):
    if collector._ops.placeholders and node.op == 'call_function':
      looking.set()
      assert release.wait(timeout=120)
    return run_node(collector, node)

  monkeypatch.setattr(dynamo_bridge.UnsupportedNodesCollector, 'run_node',
                      held_run_node)
  cpu, model = models()
  served = torch_xla_patches.serve(model, buckets()[:1], wait=False)
  try:
    assert looking.wait(timeout=120)
    pending = torch.arange(3.0, device=torch_xla.device()) * 2
    torch.testing.assert_close(pending.cpu(), torch.tensor([0.0, 2.0, 4.0]))
  finally:
    release.set()
  assert served.wait_ready(timeout=120)
  assert served.readiness().ready == 1
  check(served, cpu, 2)


def test_what_reads_values_is_known_before_a_look_ahead_runs():
  aten = torch.ops.aten
  device = torch_xla.device()
  x = torch.zeros(4, 3, device=device)
  mask = torch.zeros(4, dtype=torch.bool, device=device)
  rows = torch.zeros(2, dtype=torch.long, device=device)
  assert fallback_probe._reads_values(aten.index.Tensor, (x, [mask]), {})
  assert not fallback_probe._reads_values(aten.index.Tensor, (x, [rows]), {})
  assert fallback_probe._reads_values(aten.nonzero.default, (x,), {})
  assert not fallback_probe._reads_values(aten.mm.default, (x, x.T), {})
  # Kernels of torch_xla that fall back to the CPU for some arguments.
  bias = torch.zeros(3, device=device)
  assert fallback_probe._reads_values(aten.addmm.default, (bias, x, x.T[:, :3]),
                                      {'beta': 2})
  assert not fallback_probe._reads_values(aten.addmm.default,
                                          (bias, x, x.T[:, :3]), {})
  assert fallback_probe._reads_values(aten.as_strided.default,
                                      (x, (2, 3), (6, 2)), {})
  assert not fallback_probe._reads_values(aten.as_strided.default,
                                          (x, (2, 3), (3, 1)), {})
  image = torch.zeros(1, 1, 5, 5, device=device)
  assert fallback_probe._reads_values(
      aten._adaptive_avg_pool2d_backward.default, (image, image), {})

  def traced(fn):
    return torch.fx.symbolic_trace(fn).graph

  assert fallback_probe.graph_reads_values(
      traced(lambda t: torch.nonzero(t) + 1))
  assert fallback_probe.graph_reads_values(traced(lambda t: t.sum().item()))
  assert not fallback_probe.graph_reads_values(traced(lambda t: t.mm(t.T)))


def test_a_probe_of_a_backend_free_op_compiles_nothing(monkeypatch):
  # A look-ahead on placeholders asks whether a backend-free kernel falls
  # back (see _falls_back); the answer costs no XLA program.
  import torch_xla.debug.metrics as met
  monkeypatch.setattr(fallback_probe, '_falls_back_by_op', {})
  x = torch.zeros(4, 3, device=torch_xla.device())

  def compiles():
    data = met.metric_data('CompileTime')
    return data[0] if data else 0

  before = compiles()
  aten = torch.ops.aten
  assert fallback_probe._falls_back(aten.logcumsumexp.default, (x, 0), {})
  assert not fallback_probe._falls_back(aten._safe_softmax.default, (x, -1), {})
  assert compiles() == before


STAND_IN_SCRIPT = r'''
import json
import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
xr.use_spmd()
from torch_xla_patches import TensorSpec, io_utils
mesh = xs.Mesh(np.arange(4), (4,), ('data',))
spec = TensorSpec((64, 8), sharding=(mesh, ('data', None)))
tensor = spec.for_trace(torch_xla.device())
def runs():
  data = met.metric_data('ExecuteReplicatedTime')
  return data[0] if data else 0
before = runs()
tensor.index_copy_(0, torch.tensor([3], device=tensor.device),
                   torch.ones(1, 8, device=tensor.device))
io_utils.reset_placeholder(tensor)
report = dict(
    placeholder=io_utils.is_placeholder(tensor),
    stand_in=io_utils.is_stand_in(tensor),
    pending=torch_xla._XLAC._check_tensor_need_materialization([tensor])[0],
    runs=runs() - before,
    sharding=torch_xla._XLAC._get_xla_sharding_spec(tensor))
report['sum'] = float(tensor.sum())
print(json.dumps(report))
'''


def test_a_sharded_stand_in_is_reset_to_its_data_running_nothing():
  # A placeholder cannot be sharded; a sharded TensorSpec traces on a
  # stand-in whose restore runs nothing (see [Note: Placeholder tensors]).
  import json
  from bridge_testing import run_python
  proc = run_python(STAND_IN_SCRIPT, env={'CPU_NUM_DEVICES': '4'})
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report == dict(placeholder=True,
                        stand_in=True,
                        pending=False,
                        runs=0,
                        sharding='{devices=[4,1]0,1,2,3}',
                        sum=0.0)

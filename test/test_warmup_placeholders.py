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
from torch_xla_patches import (CallSpec, TensorSpec, compile_window, io_utils,
                               warmup)

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

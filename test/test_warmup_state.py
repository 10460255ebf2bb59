"""A warm-up compiles and never runs (see [Note: Compile-only calls]):
after serve(), precompile() and a restart from an artifact, every
parameter, buffer and attribute-held tensor of the model is bit for bit
what it was, and the model then answers as eager does from that state."""
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from torch_xla_patches import CallSpec, TensorSpec, versions, warmup
from torch_xla_patches import counters as bridge_counters

pytestmark = pytest.mark.usefixtures('patched_bridge')

BATCHES = (2, 3, 4)


class StatefulStep(torch.nn.Module):
  """Writes its state in place on every call: a counter buffer, rows of a
  KV buffer, and a tensor held in a plain attribute (no buffer)."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(6, 6)
    self.register_buffer('calls', torch.zeros((), dtype=torch.int64))
    self.register_buffer('kv', torch.arange(48.).reshape(8, 6) / 7)
    self.scratch = torch.full((6,), 0.5)

  def forward(self, x):
    self.calls.add_(1)
    rows = torch.arange(x.shape[0], device=x.device)
    self.kv.index_copy_(0, rows, x)
    self.scratch.mul_(2.0).add_(x.sum(0))
    return self.proj(x) + self.kv.sum(0) + self.scratch


def state_of(module):
  """Every tensor of the module's state, copied to the CPU, by name."""
  tensors = dict(module.named_parameters())
  tensors.update(module.named_buffers())
  tensors['scratch'] = module.scratch
  return {name: t.detach().cpu().clone() for name, t in tensors.items()}


def assert_same_state(before, after):
  assert before.keys() == after.keys()
  for name in before:
    assert torch.equal(before[name], after[name]), name


def step_pair():
  """(cpu module, XLA module) with equal state."""
  torch.manual_seed(0)
  cpu = StatefulStep()
  module = StatefulStep()
  module.load_state_dict(cpu.state_dict())
  module.to(torch_xla.device())
  module.scratch = cpu.scratch.to(torch_xla.device())
  return cpu, module


def answers_as_eager(cpu, served):
  """Two calls per batch size; the served results and state equal eager's."""
  for batch in BATCHES + BATCHES:
    x = torch.randn(batch, 6)
    expected = cpu(x)
    got = served(x.to(torch_xla.device()))
    torch.testing.assert_close(got.detach().cpu(), expected.detach())


BUCKETS = [(TensorSpec((batch, 6), torch.float32),) for batch in BATCHES]


def test_serve_leaves_the_state_as_it_was():
  cpu, module = step_pair()
  before = state_of(module)
  served = torch_xla_patches.serve(module, BUCKETS, wait=True)
  assert served.readiness() == warmup.Readiness(ready=3, total=3, failed=())
  assert_same_state(before, state_of(module))
  answers_as_eager(cpu, served)
  assert_same_state(state_of(cpu), state_of(module))


@pytest.mark.parametrize('grad', [False, True], ids=['no_grad', 'grad'])
def test_precompile_leaves_the_state_as_it_was(grad):
  # With grad on, AOTAutograd makes a training graph, whose updates of the
  # buffers its epilogue writes after the graph.
  cpu, module = step_pair()
  before = state_of(module)
  compiled = torch.compile(module, backend='openxla', dynamic=True)
  with torch.set_grad_enabled(grad):
    report = torch_xla_patches.precompile(compiled, BUCKETS, progress=False)
  assert len(report) == len(BUCKETS)
  assert_same_state(before, state_of(module))
  met.clear_all()
  with torch.set_grad_enabled(grad):
    answers_as_eager(cpu, compiled)
  # Every call ran a program the warm-up compiled.
  assert not met.counter_value(bridge_counters.COUNTER_MISS)
  assert_same_state(state_of(cpu), state_of(module))


def test_a_restart_leaves_the_state_as_it_was(tmp_path):
  cpu, module = step_pair()
  first = torch_xla_patches.serve(module,
                                  BUCKETS,
                                  cache_dir=tmp_path,
                                  wait=True)
  assert not first.loaded
  before = state_of(module)
  again = torch_xla_patches.serve(module,
                                  BUCKETS,
                                  cache_dir=tmp_path,
                                  wait=True)
  # torch 2.8 has no artifact: the restart replays the signature index.
  assert again.loaded == versions.has_torch_aot_compile()
  assert_same_state(before, state_of(module))
  answers_as_eager(cpu, again)
  assert_same_state(state_of(cpu), state_of(module))


class Keyworded(StatefulStep):
  """StatefulStep with a keyword-only argument."""

  def forward(self, x, *, scale):
    return super().forward(x) * scale


def test_call_spec_buckets_with_keywords_leave_the_state_as_it_was():
  torch.manual_seed(0)
  cpu = Keyworded()
  module = Keyworded()
  module.load_state_dict(cpu.state_dict())
  module.to(torch_xla.device())
  module.scratch = cpu.scratch.to(torch_xla.device())
  before = state_of(module)
  served = torch_xla_patches.serve(module, [
      CallSpec(TensorSpec((batch, 6), torch.float32), scale=2.0)
      for batch in BATCHES
  ],
                                   wait=True)
  assert served.readiness().ready == len(BATCHES)
  assert_same_state(before, state_of(module))
  x = torch.randn(3, 6)
  torch.testing.assert_close(
      served(x.to(torch_xla.device()), scale=2.0).cpu(),
      cpu(x, scale=2.0).detach())

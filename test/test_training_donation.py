"""A whole training step under torch.compile (forward, backward and the
optimizer's step in one compiled function, as upstream's
DynamoTrainingOptimizerTest writes it), with donation on and off: the same
parameters, optimizer state and BatchNorm statistics after 10 steps, no more
XLA compiles, and the optimizer's parameter updates donated (see [Note:
Donating in-place updates])."""
import os
import sys

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from bridge_testing import run_python
from torch_xla_patches import counters as bridge_counters

STEPS = 10
# Every graph of the step is traced in the first two steps (the optimizer's
# state exists from the second on).
WARM_STEPS = 3
TEST_DIR = os.path.dirname(os.path.abspath(__file__))


class ConvNet(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    self.norm = torch.nn.BatchNorm2d(8)
    self.head = torch.nn.Linear(8 * 6 * 6, 5)

  def forward(self, x):
    return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


OPTIMIZERS = {
    'sgd-momentum':
        lambda params, foreach: torch.optim.SGD(
            params, lr=0.05, momentum=0.9, foreach=foreach),
    'adam':
        lambda params, foreach: torch.optim.Adam(
            params, lr=1e-2, foreach=foreach),
    'adamw':
        lambda params, foreach: torch.optim.AdamW(
            params, lr=1e-2, weight_decay=0.1, foreach=foreach),
}


def compiled_step(optimizer_name: str, foreach: bool, device: torch.device):
  """(model, optimizer, the training step compiled): forward, backward and
  the optimizer's step in one function, as upstream's
  DynamoTrainingOptimizerTest writes it; tools/bench_training.py times it."""
  torch.manual_seed(0)
  model = ConvNet().to(device).train()
  optimizer = OPTIMIZERS[optimizer_name](model.parameters(), foreach)
  loss_fn = torch.nn.CrossEntropyLoss()

  def step(x, target):
    optimizer.zero_grad(True)
    loss = loss_fn(model(x), target)
    loss.backward()
    optimizer.step()
    return loss

  return model, optimizer, torch.compile(step, backend='openxla')


# The counters that say what donation did.
DONATION_COUNTERS = (bridge_counters.COUNTER_DONATED,
                     bridge_counters.COUNTER_DONATION_VIEW,
                     bridge_counters.COUNTER_DONATION_ALIAS,
                     bridge_counters.COUNTER_DONATION_SMALL,
                     bridge_counters.COUNTER_DONATION_FALLBACK,
                     bridge_counters.COUNTER_DONATION_EPILOGUE,
                     bridge_counters.COUNTER_DONATION_COPIED,
                     bridge_counters.COUNTER_DONATION_COPIED_READ,
                     bridge_counters.COUNTER_DONATION_READERS_SYNCED)


def train(optimizer_name: str, foreach: bool, out: str) -> None:
  """STEPS compiled training steps from fixed weights and data, in a process
  of their own (XLA's compile cache is the process's): saves the model's
  state, the optimizer's state (tensors on the CPU), the XLA compiles and
  the patch's donation counters to `out`."""
  torch_xla_patches.apply()
  device = torch_xla.device()
  model, optimizer, compiled = compiled_step(optimizer_name, foreach, device)
  generator = torch.Generator().manual_seed(1)
  met.clear_all()

  def donation_counters():
    return {
        name: met.counter_value(name)
        for name in DONATION_COUNTERS
        if name in met.counter_names()
    }

  for step_index in range(STEPS):
    if step_index == WARM_STEPS:
      warm = donation_counters()
    x = torch.randn(4, 3, 6, 6, generator=generator).to(device)
    target = torch.randint(0, 5, (4,), generator=generator).to(device)
    compiled(x, target)
    torch_xla.sync()
  torch.save(
      {
          'model': {
              k: v.cpu() for k, v in model.state_dict().items()
          },
          'optimizer': [{
              name: value.cpu()
              for name, value in state.items()
              if isinstance(value, torch.Tensor)
          }
                        for state in optimizer.state.values()],
          'compiles': met.metric_data('CompileTime')[0],
          'counters': donation_counters(),
          'warm_counters': warm,
      }, out)


def trained(optimizer_name, foreach, donate, tmp_path):
  out = str(tmp_path / f'{optimizer_name}-{foreach}-{donate}.pt')
  proc = run_python(
      f'import test_training_donation as t; '
      f't.train({optimizer_name!r}, {foreach!r}, {out!r})',
      env={
          'XLA_PATCHES_DONATE': '1' if donate else '0',
          # Traced on the arguments: on placeholders, the first step's
          # copies depend on timing (docs/known-limits.md).
          'XLA_PATCHES_TRACE_ON_PLACEHOLDERS': '0',
          'PYTHONPATH': TEST_DIR
      })
  assert proc.returncode == 0, proc.stderr[-3000:]
  return torch.load(out)


# Adam's steps are AdamW's without decoupled weight decay (torch 2.8 and 2.9
# define AdamW as Adam with decoupled_weight_decay=True), and the assertions
# below are the same for both: the suite runs AdamW's, tools/bench_training.py
# times all three.
TESTED_OPTIMIZERS = ('sgd-momentum', 'adamw')


@pytest.mark.parametrize('foreach', [False, True], ids=['for-loop', 'foreach'])
@pytest.mark.parametrize('optimizer_name', TESTED_OPTIMIZERS)
def test_a_compiled_training_step_equals_the_step_without_donation(
    optimizer_name, foreach, tmp_path):
  off = trained(optimizer_name, foreach, False, tmp_path)
  on = trained(optimizer_name, foreach, True, tmp_path)
  # The programs differ (an update kept in the graph or written after it),
  # so XLA may fuse differently: equal within float tolerance.
  assert on['model'].keys() == off['model'].keys()
  for name in off['model']:
    torch.testing.assert_close(on['model'][name],
                               off['model'][name],
                               rtol=1e-4,
                               atol=1e-5,
                               msg=name)
  assert len(on['optimizer']) == len(off['optimizer']) == 6
  for state_on, state_off in zip(on['optimizer'], off['optimizer']):
    assert state_on.keys() == state_off.keys()
    for name in state_off:
      torch.testing.assert_close(state_on[name],
                                 state_off[name],
                                 rtol=1e-4,
                                 atol=1e-5,
                                 msg=name)
  assert on['compiles'] <= off['compiles']
  assert off['counters'] == {}
  counters = on['counters']
  # BatchNorm's running statistics (and its batch count) are written by
  # AOTAutograd's epilogue after the forward: never donated, counted once
  # for the forward's one signature.
  assert counters[bridge_counters.COUNTER_DONATION_EPILOGUE] == 3
  if optimizer_name == 'sgd-momentum':
    # The first step's graph updates the 6 parameters, the later steps'
    # graph (momentum buffers exist from then on) the 6 parameters and
    # their 6 momentum buffers: all donated. The parameters were moved to
    # the device with `to`, which reads as read: the first run takes private
    # copies of them, through the host (no XLA compile: compiles above).
    # The momentum buffers are the first graph's outputs, data the caller
    # holds, which the bridge cannot vouch for: the second graph's first run
    # copies them the same way, and syncs nothing else of the device.
    # Every later step donates what the step before gave, with no copy.
    assert counters[bridge_counters.COUNTER_DONATED] == 6 + 12
    assert counters[bridge_counters.COUNTER_DONATION_COPIED_READ] == 6 + 6
    assert bridge_counters.COUNTER_DONATION_READERS_SYNCED not in counters
    assert counters == on['warm_counters']
  else:
    # Adam keeps its step counts on the CPU: the graph is partitioned around
    # them, and its 6 parameters, 12 moments and 6 step counts are written
    # after the parts, as AOTAutograd's epilogue would write them (see
    # [Note: Input updates in a partitioned graph]).
    assert bridge_counters.COUNTER_DONATED not in counters
    assert counters[bridge_counters.COUNTER_DONATION_FALLBACK] == 24


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

"""Training with a dynamic batch: loss, grads and updated weights equal eager
on CPU; dynamo traces forward and backward once."""
import copy
import sys

import pytest
import torch
import torch_xla

from bridge_testing import FrameCounter, counters, xla


class Classifier(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.embed = torch.nn.Linear(6, 16)
    self.hidden = torch.nn.Linear(16, 16)
    self.head = torch.nn.Linear(16, 3)

  def forward(self, x):
    h = torch.nn.functional.gelu(self.embed(x))
    h = h + torch.relu(self.hidden(h))
    return self.head(h)


pytestmark = pytest.mark.usefixtures('patched_bridge')


def test_dynamic_batch_training_matches_eager():
  torch.manual_seed(0)
  model = Classifier()
  model_xla = copy.deepcopy(model).to(torch_xla.device())
  frames = FrameCounter()
  compiled = torch.compile(model_xla, backend=frames, dynamic=True)
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  opt_xla = torch.optim.SGD(model_xla.parameters(), lr=0.1)
  batches = [4, 7, 4, 12, 7, 3]
  for batch in batches:
    x = torch.randn(batch, 6)
    target = torch.randint(0, 3, (batch,))
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss_xla = torch.nn.functional.cross_entropy(compiled(xla(x)), xla(target))
    opt.zero_grad()
    opt_xla.zero_grad()
    loss.backward()
    loss_xla.backward()
    torch.testing.assert_close(loss_xla.cpu(), loss.detach())
    for (name, p), p_xla in zip(model.named_parameters(),
                                model_xla.parameters()):
      torch.testing.assert_close(p_xla.grad.cpu(),
                                 p.grad,
                                 rtol=1e-4,
                                 atol=1e-5,
                                 msg=name)
    opt.step()
    opt_xla.step()
    torch_xla.sync()
  for p, p_xla in zip(model.parameters(), model_xla.parameters()):
    torch.testing.assert_close(p_xla.detach().cpu(), p.detach())
  assert frames.frames == 1
  got = counters()
  # Forward and backward graphs, one compile each per distinct batch size.
  assert got['DynamoExtractCompiledGraph'] == 2
  assert got['DynamoSignatureMiss'] == 2 * len(set(batches))


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

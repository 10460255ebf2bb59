"""SPMD on 4 virtual CPU devices: dynamic shapes work and input sharding is
part of the shape signature."""
import sys

import pytest

from bridge_testing import run_counters

SPMD_SCRIPT = r'''
import numpy as np
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
import torch_xla_patches
xr.use_spmd()
torch_xla_patches.apply()
device = torch_xla.device()
mesh = xs.Mesh(np.arange(4), (4, 1), ('data', 'model'))

def fn(x, w):
  return torch.relu(x @ w) + x.shape[0]

compiled = torch.compile(fn, backend='openxla', dynamic=True)
w = torch.randn(8, 8)
w_xla = w.to(device)
xs.mark_sharding(w_xla, mesh, (None, None))
# Sizes differ from w's, so dynamo's duck sizing does not tie them together.
for n, spec in [(4, ('data', None)), (12, ('data', None)), (4, ('data', None)),
                (4, (None, None)), (12, ('data', None))]:
  x = torch.randn(n, 8)
  x_xla = x.to(device)
  xs.mark_sharding(x_xla, mesh, spec)
  torch.testing.assert_close(compiled(x_xla, w_xla).cpu(), fn(x, w),
                             rtol=1e-4, atol=1e-4)
print('misses', met.counter_value('DynamoSignatureMiss'))
print('hits', met.counter_value('DynamoSignatureHit'))
'''


def test_spmd_dynamic_shapes_and_sharding_in_signature():
  values = run_counters(SPMD_SCRIPT, env={'CPU_NUM_DEVICES': '4'})
  # (4, data), (12, data) and (4, replicated) are the distinct signatures.
  assert values['misses'] == 3
  assert values['hits'] == 5 - 3 + 1


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

"""XLA's computation cache evicting a signature's program: no crash, the
signature is re-traced transparently and counted."""
import sys

import pytest

from bridge_testing import run_counters

EVICTION_SCRIPT = r'''
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
torch_xla_patches.apply()
device = torch_xla.device()

def fn(x, w):
  return torch.tanh(x @ w).sum(dim=0) + x.shape[0]

compiled = torch.compile(fn, backend='openxla', dynamic=True)
w = torch.randn(8, 4)
sizes = list(range(2, 12))  # 10 signatures, cache holds 4 programs
for round_ in range(2):
  for n in sizes:
    x = torch.randn(n, 8)
    got = compiled(x.to(device), w.to(device)).cpu()
    torch.testing.assert_close(got, fn(x, w), rtol=1e-4, atol=1e-4)
print('misses', met.counter_value('DynamoSignatureMiss'))
print('retraces', met.counter_value('DynamoEvictedRetrace'))
print('hits', met.counter_value('DynamoSignatureHit'))
'''


def test_evicted_programs_are_retraced_not_crashed():
  values = run_counters(EVICTION_SCRIPT,
                        env={'XLA_COMPILATION_CACHE_SIZE': '4'})
  assert values['misses'] == 10
  # Round two finds all 10 signatures known but their programs evicted
  # (only 4 fit), so every one of them is re-traced.
  assert values['retraces'] == 10
  assert values['hits'] == 20 - 10 + 1


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

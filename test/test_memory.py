"""No device memory pinned per signature: RSS growth over 30+ signatures, each
first seen with a fresh 8 MiB input that the graph updates in place, stays far
below one copy of that input. (Upstream's cache entry keeps the trace-time
input alive, so it grows by about 8 MiB per signature.)"""
import os
import sys

import pytest

from bridge_testing import run_python

MEMORY_SCRIPT = r'''
import ctypes, gc, torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
PATCH

def rss_mib():
  # Hand freed heap pages back to the OS first, so RSS shows live memory
  # rather than how fragmented glibc's heap happens to be.
  ctypes.CDLL('libc.so.6').malloc_trim(0)
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmRSS:'):
        return int(line.split()[1]) / 1024

def fn(x, state):
  state.add_(x.sum())
  return state[:4] * x.shape[0]

device = torch_xla.device()
compiled = torch.compile(fn, backend='openxla', dynamic=True)

def call(n):
  # A fresh 8 MiB state per call, as a server does with per-request buffers.
  state = torch.full((2 * 1024 * 1024,), float(n), device=device)
  x = torch.full((n, 3), 0.5)
  out = compiled(x.to(device), state).cpu()
  expected = n + 1.5 * n
  assert torch.allclose(out, torch.full((4,), expected * n))
  assert state[-1].item() == expected

for n in (2, 3):
  call(n)
xm.wait_device_ops(); gc.collect()
start = rss_mib()
signatures = list(range(4, 36))
for n in signatures:
  call(n)
xm.wait_device_ops(); gc.collect()
print('per_signature_mib', (rss_mib() - start) / len(signatures))
print('misses', met.counter_value('DynamoSignatureMiss') or 0)
'''


def growth_per_signature(patch_line: str):
  """(RSS growth per signature in MiB, signatures the bridge compiled)."""
  proc = run_python(MEMORY_SCRIPT.replace('PATCH', patch_line))
  assert proc.returncode == 0, proc.stderr[-3000:]
  values = dict(line.split()
                for line in proc.stdout.splitlines()
                if line.startswith(('per_signature_mib ', 'misses ')))
  return float(values['per_signature_mib']), int(values['misses'])


def test_rss_growth_per_signature_is_below_2_mib():
  growth, misses = growth_per_signature(
      'import torch_xla_patches; torch_xla_patches.apply()')
  print(f'patched: {growth:.2f} MiB per signature')
  # Every shape was a signature of its own, traced and compiled: the growth
  # is measured over 32 of them, not over calls that compiled nothing.
  assert misses == 2 + 32
  assert growth < 2.0


@pytest.mark.skipif(os.environ.get('XLA_PATCHES_COMPARE_UPSTREAM') != '1',
                    reason='comparison run; set XLA_PATCHES_COMPARE_UPSTREAM=1')
def test_upstream_for_comparison():
  growth, _ = growth_per_signature('pass')
  print(f'upstream: {growth:.2f} MiB per signature')
  assert growth > 6.0


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q', '-s']))

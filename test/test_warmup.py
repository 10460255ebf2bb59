"""precompile(): one dynamo trace, one XLA compile per signature, then every
served call is a hit; progress lines name each signature."""
import logging
import sys

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from torch_xla_patches import TensorSpec, warmup
from bridge_testing import FrameCounter, counters, xla

pytestmark = pytest.mark.usefixtures('patched_bridge')


def embed_sum(tokens, table):
  return table[tokens].sum(dim=1) * tokens.shape[1]


def test_precompile_then_serve_without_compiling(caplog):
  frames = FrameCounter()
  compiled = torch.compile(embed_sum, backend=frames, dynamic=True)
  table = xla(torch.randn(50, 8))
  grid = [(b, s) for b in (2, 3) for s in (5, 7, 9)]
  with caplog.at_level(logging.INFO, logger='torch_xla_patches.precompile'):
    report = warmup.precompile(
        compiled, [(TensorSpec((b, s), torch.long), table) for b, s in grid],
        progress=True)
  assert [r.xla_compiles for r in report] == [1] * len(grid)
  assert all(r.compile_seconds > 0 for r in report)
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) == len(grid)
  assert lines[0].startswith('[precompile 1/6] int64[2, 5] float32[50, 8]')
  assert 'ETA' in lines[-1]

  met.clear_all()
  for b, s in grid:
    tokens = torch.randint(0, 50, (b, s))
    got = compiled(xla(tokens), table)
    torch.testing.assert_close(got.cpu(), embed_sum(tokens, table.cpu()))
  assert 'CompileTime' not in met.metric_names()
  # Every call ran a precompiled program (nothing compiled, nothing missed).
  assert counters()['DynamoSignatureHit'] == len(grid)
  assert counters()['DynamoSignatureMiss'] == 0
  assert frames.frames == 1


def test_precompile_accepts_tensors_and_numbers():

  def fn(x, k):
    # An op mix no other test compiles, so XLA's cache cannot answer.
    return torch.sin(x) * k - 3.25

  compiled = torch.compile(fn, backend='openxla', dynamic=True)
  report = torch_xla_patches.precompile(compiled, [(torch.ones(3), 2.0),
                                                   (torch.ones(4), 2.0)],
                                        progress=False)
  assert [r.description for r in report] == ['float32[3] 2.0', 'float32[4] 2.0']
  assert [r.xla_compiles for r in report] == [1, 1]
  met.clear_all()
  for n in (4, 3):
    x = torch.randn(n)
    torch.testing.assert_close(compiled(xla(x), 2.0).cpu(), fn(x, 2.0))
  assert 'CompileTime' not in met.metric_names()
  assert counters()['DynamoSignatureHit'] == 2


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

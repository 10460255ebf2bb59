"""ArgLayout classification and the per-call key, without XLA programs."""
import sys

import pytest
import torch
import torch_xla
from expecttest import assert_expected_inline

from torch_xla_patches.signature import (ArgKind, ArgLayout, ShapeSignature,
                                         UnsupportedGraphInput)

DEVICE = torch_xla.device()


def graph_with_placeholders(*fake_values):
  graph = torch.fx.Graph()
  for i, value in enumerate(fake_values):
    node = graph.placeholder(f'arg{i}')
    node.meta['val'] = value
  graph.output(None)
  return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_layout_from_fake_values():
  from torch._subclasses.fake_tensor import FakeTensorMode
  from torch.fx.experimental.symbolic_shapes import ShapeEnv
  mode = FakeTensorMode(shape_env=ShapeEnv())
  s0 = mode.shape_env.create_unbacked_symint()
  with mode:
    dynamic = torch.empty(s0, 4)
    static = torch.empty(3)
  param = torch.nn.Parameter(torch.ones(2, device=DEVICE))
  gm = graph_with_placeholders(param, s0, dynamic, static, 0.5)
  args = [
      param, 5,
      torch.ones(5, 4, device=DEVICE),
      torch.ones(3, device=DEVICE), 0.5
  ]
  layout = ArgLayout.from_graph(gm, args)
  assert layout.kinds == (ArgKind.PARAMETER, ArgKind.SHAPE,
                          ArgKind.DYNAMIC_TENSOR, ArgKind.TENSOR,
                          ArgKind.SCALAR)
  key_of = layout.key_function()
  assert key_of(args) == ((5, 0.5), ((5, 4),))
  other = list(args)
  other[1], other[2] = 7, torch.ones(7, 4, device=DEVICE)
  assert key_of(other) != key_of(args)
  # A static tensor and the parameter are not looked at per call.
  other = list(args)
  other[3] = torch.zeros(3, device=DEVICE)
  assert key_of(other) == key_of(args)


def test_without_metadata_every_tensor_shape_is_in_the_key():
  args = [torch.ones(2, 3, device=DEVICE), 4]
  layout = ArgLayout.from_graph(None, args)
  assert layout.kinds == (ArgKind.DYNAMIC_TENSOR, ArgKind.SHAPE)
  assert layout.key_function()(args) == ((4,), ((2, 3),))


def test_signature_differences_read_before_and_after():
  before = ShapeSignature(((0, 3),), (), ((1, (3, 2)),), ())
  after = ShapeSignature(((0, 5),), (), ((1, (5, 2)),), ())
  assert_expected_inline(
      '\n'.join(after.differences(before)), """\
shape_values[input 0]: 3 -> 5
tensor_shapes[input 1]: (3, 2) -> (5, 2)""")


def test_symbolic_value_at_run_time_is_refused():
  from torch.fx.experimental.symbolic_shapes import ShapeEnv
  symbolic = ShapeEnv().create_unbacked_symint()
  with pytest.raises(UnsupportedGraphInput, match='symbolic at run time'):
    ArgLayout.from_graph(None, [symbolic])


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

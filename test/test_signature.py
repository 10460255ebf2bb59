"""ArgLayout classification and the per-call key, without XLA programs."""
import sys

import pytest
import torch
import torch_xla
from expecttest import assert_expected_inline
from hypothesis import given, strategies as st

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


_KEYED_KINDS = [
    ArgKind.SHAPE, ArgKind.SCALAR, ArgKind.DYNAMIC_TENSOR, ArgKind.TENSOR,
    ArgKind.PARAMETER
]


def _example_arg(kind: ArgKind, draw_size: int):
  if kind == ArgKind.SHAPE:
    return draw_size
  if kind == ArgKind.SCALAR:
    return draw_size / 2
  return torch.empty(draw_size, 2)


@given(kinds=st.lists(st.sampled_from(_KEYED_KINDS), max_size=5),
       sizes=st.lists(st.integers(0, 4), min_size=5, max_size=5))
def test_the_key_is_the_scalar_values_and_the_dynamic_shapes(kinds, sizes):
  """Every form of the key function (one size and one dynamic tensor read
  inline included) gives [Note: Shape signatures]' key: the size and scalar
  values in position order, then the dynamic tensors' shapes; static
  tensors and parameters are not in it."""
  layout = ArgLayout(kinds=tuple(kinds))
  args = [_example_arg(kind, size) for kind, size in zip(kinds, sizes)]
  values = tuple(args[i] for i in layout.scalar_positions)
  shapes = tuple(args[i].shape for i in layout.dynamic_tensor_positions)
  expected = (values, shapes) if shapes else values
  key = layout.key_function()(args)
  assert key == expected
  assert type(key) is tuple
  if shapes:
    assert [type(part) for part in key] == [tuple, tuple]
  assert hash(key) == hash(expected)


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

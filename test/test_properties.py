"""Property tests over random shapes: every result equals eager on CPU, dynamo
compiles each frame once, XLA compiles once per distinct signature, and a
repeated signature compiles nothing.

Profiles (HYPOTHESIS_PROFILE): ci (derandomized), dev, debug; see conftest.py.
"""
import dataclasses
import sys
from typing import Callable, Dict, Set, Tuple

import pytest
import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config
import torch_xla
import torch_xla.debug.metrics as met
from hypothesis import given, strategies as st

import torch_xla_patches
from bridge_testing import FrameCounter, xla
from torch_xla_patches import donation


def reduce_broadcast(x):
  shifted = x - x.amax(dim=-1, keepdim=True)
  return shifted.sum(dim=0) * x.shape[0]


def matmul(x, w):
  return torch.tanh(x.reshape(-1, x.shape[-1]) @ w).amax(dim=0)


def inplace_accumulate(x, acc):
  acc.add_(x.sum(dim=0))
  return acc * 2


def symint_outputs(x):
  return x.sum(), x.shape[0] * x.shape[-1], x.abs().max()


def cpu_fallback(x):
  return torch.logcumsumexp(x, dim=0) + x.shape[0]


@dataclasses.dataclass(frozen=True)
class Family:
  fn: Callable
  # Builds the CPU arguments for one input shape.
  make_args: Callable[[Tuple[int, ...]], tuple]
  # Number of XLA graphs one signature compiles (a fallback op splits it).
  graphs_per_signature: int = 1


FAMILIES = {
    'reduce_broadcast':
        Family(reduce_broadcast, lambda s: (torch.randn(s),)),
    'matmul':
        Family(matmul, lambda s: (torch.randn(s), torch.randn(s[-1], 3))),
    'inplace_accumulate':
        Family(
            inplace_accumulate, lambda s: (torch.randn(s), torch.randn(s[1:])
                                           if len(s) > 1 else torch.randn(()))),
    'symint_outputs':
        Family(symint_outputs, lambda s: (torch.randn(s),)),
    # logcumsumexp runs on the CPU; the graph is split around it, and here
    # only the part after it compiles (the part before is empty).
    'cpu_fallback':
        Family(cpu_fallback, lambda s: (torch.randn(s),)),
}


class CompiledFamily:
  """One compiled function per (family, rank), shared by all examples."""

  def __init__(self, family: Family):
    self.family = family
    self.frames = FrameCounter()
    self.compiled = torch.compile(family.fn, backend=self.frames, dynamic=True)
    self.seen: Set[Tuple[int, ...]] = set()


_compiled: Dict[Tuple[str, int], CompiledFamily] = {}


@pytest.fixture(scope='module', autouse=True)
def patched_bridge():
  torch_xla_patches.apply()
  torch._dynamo.reset()
  # The program that copies a 0-dim argument holding data the caller set for
  # a donating run, compiled once per process: compiled before any count.
  scalar = torch.zeros((), device=torch_xla.device())
  torch_xla.sync()
  donation.private_copy(scalar)
  # Distinct sizes that happen to be equal must not be tied together by
  # dynamo's duck sizing, or it would re-trace when they part.
  with fx_config.patch(use_duck_shape=False):
    yield
  torch_xla_patches.revert()
  torch._dynamo.reset()


def assert_same(got, expected, atol=1e-4):
  if isinstance(expected, torch.Tensor):
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=atol)
  elif isinstance(expected, (tuple, list)):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
      assert_same(g, e, atol)
  else:
    assert got == expected


def reduction_atol(args) -> float:
  """The absolute tolerance of a result reduced from `args`: a float32 sum
  of n values of unit size, summed in another order, differs by up to about
  n * eps (a sum of 57,456 normal values came 5.2e-4 from eager's)."""
  numel = max((a.numel() for a in args if isinstance(a, torch.Tensor)),
              default=1)
  return max(1e-4, numel * torch.finfo(torch.float32).eps)


def run_and_check(compiled: CompiledFamily, shape: Tuple[int, ...]):
  cpu_args = compiled.family.make_args(shape)
  xla_args = [xla(a) for a in cpu_args]
  # Device data of their own: a tensor moved with `to` holds its data in an
  # IR node, which a donating run copies on the device (one more small
  # program per shape; see [Note: Donating in-place updates]). Synced, a
  # donated argument holds data the caller set, which a donating run copies
  # through the host, but a 0-dim one (compiled by the fixture). This
  # property counts the graph's programs.
  torch_xla.sync()
  got = compiled.compiled(*xla_args)
  expected = compiled.family.fn(*cpu_args)
  assert_same(got, expected, reduction_atol(cpu_args))
  for cpu_arg, xla_arg in zip(cpu_args, xla_args):
    torch.testing.assert_close(xla_arg.cpu(), cpu_arg, rtol=1e-4, atol=1e-4)


def compile_count() -> int:
  return met.metric_data('CompileTime')[0] if 'CompileTime' in (
      met.metric_names()) else 0


shapes_by_rank = st.integers(
    min_value=1, max_value=3).flatmap(lambda rank: st.lists(st.tuples(
        *[st.integers(min_value=2, max_value=64)] * rank),
                                                            min_size=1,
                                                            max_size=4))


@pytest.mark.parametrize('name', sorted(FAMILIES))
@given(shapes=shapes_by_rank)
def test_dynamic_shapes_match_eager_and_compile_once_per_signature(
    name, shapes):
  rank = len(shapes[0])
  key = (name, rank)
  if key not in _compiled:
    _compiled[key] = CompiledFamily(FAMILIES[name])
  compiled = _compiled[key]
  new_signatures = len(set(shapes) - compiled.seen)
  met.clear_all()

  for shape in shapes:
    # Recorded first: a failing example's replay must see the same state.
    compiled.seen.add(shape)
    run_and_check(compiled, shape)

  assert compiled.frames.frames == 1
  misses = met.counter_value('DynamoSignatureMiss') or 0
  graphs = compiled.family.graphs_per_signature
  assert misses == new_signatures * graphs
  assert compile_count() == misses

  # A repeated signature compiles and traces nothing: every call runs its
  # program.
  met.clear_all()
  for shape in shapes:
    run_and_check(compiled, shape)
  assert compile_count() == 0
  assert (met.counter_value('DynamoSignatureMiss') or 0) == 0
  assert met.counter_value('DynamoSignatureHit') == len(shapes) * graphs


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

"""The fast path of served calls: after every change dynamo's guards would
see, the result equals eager and the counters say which path served it."""
import dataclasses
import functools
import os
from typing import Any

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from hypothesis import given, strategies as st

import torch_xla_patches
from torch_xla_patches import TensorSpec, call_plan, call_spec, config, fast_dispatch

import served_modules

pytestmark = pytest.mark.requires('torch_aot_compile')

WIDTH = 8


class Net(torch.nn.Module):
  """Deterministic in both modes; BatchNorm reads `training`."""

  def __init__(self, width=WIDTH):
    super().__init__()
    self.first = torch.nn.Linear(width, width)
    self.norm = torch.nn.BatchNorm1d(width)
    self.second = torch.nn.Linear(width, width)

  def forward(self, x):
    x = x.to(self.first.weight.dtype)
    return self.second(torch.relu(self.norm(self.first(x))))


class Pair(torch.nn.Module):
  """Returns a dict and an argument: the result is rebuilt, not the graph's
  output tuple."""

  def __init__(self, width=WIDTH):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)

  def forward(self, x, y):
    return {'sum': self.proj(x) + y.sum(), 'y': y}, self.proj(x).relu()


class Swapped(torch.nn.Module):
  """Reads its second argument first: the graph's argument order is not
  the call's."""

  def __init__(self, width=WIDTH):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)

  def forward(self, x, y):
    scale = y.sum(dim=0)
    return self.proj(x) * scale


class Counting(torch.nn.Module):
  """A side effect dynamo's code replays after the graph."""

  def __init__(self, width=WIDTH):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)
    self.calls = 0

  def forward(self, x):
    self.calls += 1
    return self.proj(x)


class Noisy(torch.nn.Module):
  """Draws random numbers: its program takes a fresh seed per call."""

  def __init__(self, width=WIDTH):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)

  def forward(self, x):
    return self.proj(x) + torch.rand_like(x)


SERVE_COUNTERS = (
    fast_dispatch.COUNTER_FALLBACK_GLOBAL_STATE,
    fast_dispatch.COUNTER_FALLBACK_MODULE,
    fast_dispatch.COUNTER_FALLBACK_ARGUMENTS,
    fast_dispatch.COUNTER_FALLBACK_NO_PLAN,
    fast_dispatch.COUNTER_BRIDGE_RECOVERY,
    fast_dispatch.COUNTER_RETRACE,
    fast_dispatch.COUNTER_CAPTURED_AGAIN,
    fast_dispatch.COUNTER_VERIFY_MISMATCH,
)


class Paths:
  """Which paths served the calls since the last look: the fast calls and
  the counters that changed."""

  def __init__(self, served):
    self._served = served
    self._last = self._now()

  def _now(self):
    values = {name: met.counter_value(name) or 0 for name in SERVE_COUNTERS}
    values['fast'] = self._served.fast_calls
    return values

  def since_last(self):
    now = self._now()
    changed = {
        name: now[name] - self._last[name]
        for name in now
        if now[name] != self._last[name]
    }
    self._last = now
    return changed


def xla(t):
  return t.to(torch_xla.device())


def served_model(cls, signatures, first_calls=True):
  """(a CPU copy, the XLA model, what serve() returns), in eval mode, with
  the same weights. With `first_calls`, each bucket has been called once, as
  a server's first requests would: the warm-up compiles without running, so
  it learns no run, and the first call of each bucket takes the full path
  and learns it (test_bucket_calls_take_the_fast_path)."""
  torch.manual_seed(0)
  cpu = cls().eval()
  model = cls().to(torch_xla.device()).eval()
  model.load_state_dict(cpu.state_dict())
  served = torch_xla_patches.serve(model, signatures)
  if first_calls:
    for bucket in signatures:
      served(*(xla(torch.randn(spec.shape)) for spec in bucket))
  return cpu, model, served


def served_net(buckets=(4, 6, WIDTH), first_calls=True):
  return served_model(
      Net, [(TensorSpec((b, WIDTH), torch.float32),) for b in buckets],
      first_calls)


def check(served, cpu, x, **tolerances):
  with torch.no_grad():
    expected = cpu(x)
  result = served(xla(x))
  assert not result.requires_grad
  torch.testing.assert_close(result.cpu(), expected, **tolerances)


def served_after_a_fast_call():
  """served_net(), and the Paths of a bucket call (the fast path)."""
  cpu, model, served = served_net()
  paths = Paths(served)
  check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {'fast': 1}
  return cpu, model, served, paths


def check_calls(served, cpu, count, batch=4):
  for _ in range(count):
    check(served, cpu, torch.randn(batch, WIDTH))


def full_then_fast(paths, served, cpu, batch, counter):
  """Two calls of one batch size after a change: the first served by the
  full path (counted by `counter`), the second by the fast path."""
  check(served, cpu, torch.randn(batch, WIDTH))
  check(served, cpu, torch.randn(batch, WIDTH))
  assert paths.since_last() == {counter: 1, 'fast': 1}


def test_bucket_calls_take_the_fast_path(patched_bridge):
  # Batch WIDTH equals the Linear's width: captured with duck sizing, that
  # bucket would specialize the graph and every other bucket re-trace.
  cpu, _, served = served_net(first_calls=False)
  paths = Paths(served)
  # The first call of each bucket takes the full path and learns its run.
  for batch in (4, 6, WIDTH):
    check(served, cpu, torch.randn(batch, WIDTH))
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_NO_PLAN: 1,
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 2
  }
  for batch in (4, 6, WIDTH, 4):
    check(served, cpu, torch.randn(batch, WIDTH))
  assert paths.since_last() == {'fast': 4}
  # A new shape is served by the full path once (dynamo's shape guards
  # accept it), then by the fast path.
  full_then_fast(paths, served, cpu, 5,
                 fast_dispatch.COUNTER_FALLBACK_ARGUMENTS)


def test_train_and_eval(patched_bridge):
  cpu, model, served, paths = served_after_a_fast_call()
  # BatchNorm normalizes by the batch and updates its running statistics in
  # training mode: dynamo's guard on `training` fails, and the model is
  # captured again in training mode (see [Note: One capture per guard set]).
  model.train()
  cpu.train()
  x = torch.randn(4, WIDTH)
  check(served, cpu, x, rtol=1e-4, atol=1e-4)
  torch.testing.assert_close(model.norm.running_mean.cpu(),
                             cpu.norm.running_mean)
  # torch_xla's BatchNorm updates running_var with the biased batch variance
  # (eager on XLA does the same), CPU with the unbiased one.
  cpu.norm.running_var.copy_(model.norm.running_var.cpu())
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_MODULE: 1,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }
  model.eval()
  cpu.eval()
  # The call's key leads to the training capture, whose learned run the
  # change drops; its guards refuse the call, the first capture's accept it
  # (its plan was dropped by the change to training mode), and the next call
  # of the key is fast on the first capture again.
  full_then_fast(paths, served, cpu, 4, fast_dispatch.COUNTER_FALLBACK_MODULE)
  assert len(served.captures()) == 2


def test_an_in_place_weight_update(patched_bridge):
  cpu, model, served, paths = served_after_a_fast_call()
  with torch.no_grad():
    model.first.weight.mul_(-2.0)
    cpu.first.weight.mul_(-2.0)
  # The weight has pending IR: XLA refuses the bound program, the bridge
  # syncs it and runs; the next call learns the program again.
  check_calls(served, cpu, 3)
  assert paths.since_last() == {
      'fast': 2,
      fast_dispatch.COUNTER_BRIDGE_RECOVERY: 1,
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 1
  }


def test_a_swapped_parameter_and_a_replaced_submodule(patched_bridge):
  cpu, model, served, paths = served_after_a_fast_call()
  weight = torch.randn(WIDTH, WIDTH)
  model.first.weight = torch.nn.Parameter(xla(weight))
  cpu.first.weight = torch.nn.Parameter(weight)
  check_calls(served, cpu, 2)
  assert paths.since_last() == {
      'fast': 1,
      fast_dispatch.COUNTER_FALLBACK_MODULE: 1
  }
  torch.manual_seed(1)
  second = torch.nn.Linear(WIDTH, WIDTH)
  cpu.second = second
  model.second = torch.nn.Linear(WIDTH, WIDTH).to(torch_xla.device())
  model.second.load_state_dict(second.state_dict())
  # An unused new submodule changes nothing the graph reads.
  model.extra = torch.nn.Linear(2, 2)
  full_then_fast(paths, served, cpu, 6, fast_dispatch.COUNTER_FALLBACK_MODULE)
  # The new submodule is watched too.
  weight = torch.randn(WIDTH, WIDTH)
  model.second.weight = torch.nn.Parameter(xla(weight))
  cpu.second.weight = torch.nn.Parameter(weight)
  check(served, cpu, torch.randn(6, WIDTH))
  assert paths.since_last() == {fast_dispatch.COUNTER_FALLBACK_MODULE: 1}


def test_grad_mode_autocast_and_function_modes(patched_bridge):
  cpu, _, served = served_net()
  paths = Paths(served)
  # Served calls run without autograd in any grad mode, so the fast path
  # serves both.
  with torch.no_grad():
    check(served, cpu, torch.randn(4, WIDTH))
  with torch.enable_grad():
    check(served, cpu, torch.randn(4, WIDTH))
  with torch.inference_mode():
    check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {'fast': 3}
  x = torch.randn(4, WIDTH)
  with torch.autocast('xla', dtype=torch.bfloat16):
    result = served(xla(x))
  with torch.autocast('cpu', dtype=torch.bfloat16), torch.no_grad():
    expected = cpu(x)
  assert result.dtype == expected.dtype == torch.bfloat16
  torch.testing.assert_close(result.cpu(), expected, rtol=0.05, atol=0.05)
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_GLOBAL_STATE: 1,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }

  class Negate(torch.overrides.TorchFunctionMode):

    def __torch_function__(self, func, types, args=(), kwargs=None):
      result = func(*args, **(kwargs or {}))
      return -result if func is torch.nn.functional.linear else result

  x = torch.randn(4, WIDTH)
  with Negate(), torch.no_grad():
    expected = cpu(x)
    result = served(xla(x))
  torch.testing.assert_close(result.cpu(), expected)
  # dynamo's guards refuse the mode the captures did not have, and a capture
  # under a mode defined in a function cannot be saved: a re-trace.
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_GLOBAL_STATE: 1,
      fast_dispatch.COUNTER_RETRACE: 1
  }


def test_another_dtype_device_or_requires_grad(patched_bridge):
  cpu, _, served, paths = served_after_a_fast_call()
  check(served, cpu, torch.randn(4, WIDTH, dtype=torch.float64))
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 1,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }
  check(served, cpu, torch.randn(4, WIDTH).requires_grad_())
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 1,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }
  # Eager refuses a CPU input to a model on the XLA device; so does a served
  # call, whichever path it takes: dynamo's guards refuse the CPU tensor, and
  # the re-trace fails in dynamo's run of the graph on fake tensors.
  with pytest.raises(RuntimeError, match='Expected XLA tensor'):
    cpu.to(torch_xla.device())(torch.randn(4, WIDTH))
  with pytest.raises(torch._dynamo.exc.TorchRuntimeError,
                     match='found two different devices cpu, xla:0'):
    served(torch.randn(4, WIDTH))
  # The capture on the CPU tensor fails the same way: a re-trace.
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 1,
      fast_dispatch.COUNTER_RETRACE: 1
  }


def test_a_dtype_conversion_of_the_model(patched_bridge):
  cpu, model, served, paths = served_after_a_fast_call()
  # to(dtype) replaces each parameter's data in place: no registration hook
  # sees it, the module watch does.
  model.double()
  cpu.double()
  check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_MODULE: 1,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }


def test_random_shapes_equal_eager(patched_bridge):
  cpu, _, served = served_net(buckets=(4,))
  paths = Paths(served)
  seen = {4}
  calls = [0]

  @given(batches=st.lists(st.integers(2, 12), min_size=1, max_size=6))
  def check_batches(batches):
    for batch in batches:
      check(served, cpu, torch.randn(batch, WIDTH), rtol=1e-4, atol=1e-4)
      calls[0] += 1
      seen.add(batch)

  check_batches()
  # Each new size took the full path once; every other call the fast path.
  counted = paths.since_last()
  new_sizes = len(seen) - 1
  assert counted.get(fast_dispatch.COUNTER_FALLBACK_ARGUMENTS, 0) == new_sizes
  assert counted.get('fast', 0) == calls[0] - new_sizes
  assert set(counted) <= {'fast', fast_dispatch.COUNTER_FALLBACK_ARGUMENTS}


def test_a_dict_result_and_a_returned_argument(patched_bridge):
  cpu, model, served = served_model(Pair, [(TensorSpec(
      (4, WIDTH), torch.float32), TensorSpec((3,), torch.float32))])
  paths = Paths(served)
  for _ in range(2):
    x, y = torch.randn(4, WIDTH), torch.randn(3)
    y_xla = xla(y)
    (parts, relu) = served(xla(x), y_xla)
    with torch.no_grad():
      (expected_parts, expected_relu) = cpu(x, y)
    assert sorted(parts) == ['sum', 'y']
    assert parts['y'] is y_xla
    torch.testing.assert_close(parts['sum'].cpu(), expected_parts['sum'])
    torch.testing.assert_close(relu.cpu(), expected_relu)
  assert paths.since_last() == {'fast': 2}


def test_arguments_the_graph_takes_in_another_order(patched_bridge):
  cpu, model, served = served_model(Swapped, [(TensorSpec(
      (4, WIDTH), torch.float32), TensorSpec((4, WIDTH), torch.float32))])
  paths = Paths(served)
  for _ in range(2):
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    with torch.no_grad():
      expected = cpu(x, y)
    torch.testing.assert_close(served(xla(x), xla(y)).cpu(), expected)
  assert paths.since_last() == {'fast': 2}


def test_captured_side_effects_keep_the_full_path(patched_bridge, caplog):
  torch.manual_seed(0)
  model = Counting().to(torch_xla.device())
  served = torch_xla_patches.serve(model, [(TensorSpec(
      (4, WIDTH), torch.float32),)])
  assert 'does more than call the graph' in served.calls.disabled_reason
  paths = Paths(served)
  calls = model.calls
  x = xla(torch.randn(4, WIDTH))
  torch.testing.assert_close(served(x).cpu(), model.proj(x).detach().cpu())
  served(x)
  # The warm-up compiled without running: the counter is the user's.
  assert calls == 0 and model.calls == 2
  # dynamo guards the counter's value: the captured code serves the first
  # call; once the counter changed, torch.compile serves such calls.
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_NO_PLAN: 2,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }


def test_a_python_whose_bytecode_is_not_read_keeps_the_full_path(
    patched_bridge, monkeypatch):
  # See [Note: Captured code the fast path can stand in for]: 3.10's and
  # 3.13's calls lay out the stack otherwise, so their code is not read.
  monkeypatch.setattr(call_plan, '_READ_PYTHONS', ())
  torch.manual_seed(0)
  model = Net().to(torch_xla.device()).eval()
  served = torch_xla_patches.serve(model, [(TensorSpec(
      (4, WIDTH), torch.float32),)])
  assert 'is not read (only )' in served.calls.disabled_reason
  x = xla(torch.randn(4, WIDTH))
  for _ in range(2):
    torch.testing.assert_close(served(x).cpu(), model(x).detach().cpu())
  assert served.fast_calls == 0


def test_random_ops_draw_a_seed_per_call(patched_bridge):
  torch.manual_seed(0)
  model = Noisy().to(torch_xla.device())
  served = torch_xla_patches.serve(model, [(TensorSpec(
      (4, WIDTH), torch.float32),)])
  x = xla(torch.randn(4, WIDTH))
  # The first call takes the full path and learns.
  served(x)
  paths = Paths(served)
  first, second = served(x).cpu(), served(x).cpu()
  noise = first - model.proj(x).detach().cpu()
  assert not torch.equal(first, second)
  assert bool(((noise >= 0) & (noise < 1)).all())
  assert paths.since_last() == {'fast': 2}


def test_verify_mode_finds_a_change_the_fast_path_cannot_see(
    patched_bridge, monkeypatch, caplog):
  cpu, model, served, paths = served_after_a_fast_call()
  # Assigning `training` directly (not through train()) is not watched.
  monkeypatch.setattr(config, 'serve_verify', True)
  model.norm.training = True
  cpu.norm.training = True
  check(served, cpu, torch.randn(4, WIDTH), rtol=1e-4, atol=1e-4)
  assert 'guards refused a call of Net that the fast path would have' in (
      caplog.text)
  assert paths.since_last() == {
      fast_dispatch.COUNTER_VERIFY_MISMATCH: 1,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }


def test_verify_mode_accepts_an_unchanged_call(patched_bridge, monkeypatch):
  # dynamo's guards are checked on the call as it was captured: bound to the
  # forward's parameter names.
  cpu, model, served, paths = served_after_a_fast_call()
  monkeypatch.setattr(config, 'serve_verify', True)
  check(served, cpu, torch.randn(4, WIDTH), rtol=1e-4, atol=1e-4)
  assert paths.since_last() == {'fast': 1}


def test_revert_ends_the_fast_path(patched_bridge):
  cpu, _, served, paths = served_after_a_fast_call()
  torch_xla_patches.revert()
  check_calls(served, cpu, 2)
  # The first call drops what was learned; nothing is learned again.
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_MODULE: 1,
      fast_dispatch.COUNTER_FALLBACK_NO_PLAN: 1
  }


def test_a_loaded_artifact_takes_the_fast_path(patched_bridge, tmp_path):
  cpu, model, first = served_net(buckets=(4, 6))
  assert not first.loaded
  served = torch_xla_patches.serve(
      model, [(TensorSpec((b, WIDTH), torch.float32),) for b in (4, 6)],
      cache_dir=tmp_path)
  again = torch_xla_patches.serve(
      model, [(TensorSpec((b, WIDTH), torch.float32),) for b in (4, 6)],
      cache_dir=tmp_path)
  assert again.loaded and not served.loaded
  paths = Paths(again)
  for batch in (4, 6, 4, 6):
    check(again, cpu, torch.randn(batch, WIDTH))
  # The first call of each bucket learns its run.
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_NO_PLAN: 1,
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 1,
      'fast': 2
  }


def test_the_plan_is_checked_against_the_full_path():
  model = torch.nn.Linear(2, 2)
  x = torch.randn(3, 2)
  stray = torch.randn(2)
  with pytest.raises(call_plan.PlanError,
                     match=r'graph argument 1 is a tensor \(float32\[2\]\) '
                     r'that is neither a call argument .* nor a parameter or '
                     r'buffer of the model: .* initialized lazily .*'
                     r'`cache.early_initialization'):
    call_plan.ArgumentPlan.of_call(model, (x,), (x, stray), [])
  with pytest.raises(call_plan.PlanError,
                     match=r'graph argument 1 \(int\) is not a size of a call '
                     'argument'):
    call_plan.ArgumentPlan.of_call(model, (x,), (x, 3), [])
  plan = call_plan.ArgumentPlan.of_call(model, (x,),
                                        (model.weight, x, model.bias), [])
  assert plan.user_positions == ((1, 0),)
  y = torch.randn(5, 2)
  rebuilt = plan.graph_args((y,))
  assert rebuilt[0] is model.weight and rebuilt[1] is y
  assert rebuilt[2] is model.bias


def test_a_global_forward_hook_takes_the_full_path(patched_bridge):
  cpu, _, served = served_net()
  paths = Paths(served)
  # A hook that returns None leaves every output as it is.
  handle = torch.nn.modules.module.register_module_forward_hook(
      lambda module, args, output: None)
  try:
    check(served, cpu, torch.randn(4, WIDTH))
    check(served, cpu, torch.randn(4, WIDTH))
  finally:
    handle.remove()
  check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {
      'fast': 1,
      fast_dispatch.COUNTER_FALLBACK_GLOBAL_STATE: 2
  }


def test_aliased_arguments_take_the_full_path(patched_bridge):
  cpu, model, served = served_model(Pair, [(TensorSpec(
      (WIDTH, WIDTH), torch.float32), TensorSpec(
          (WIDTH, WIDTH), torch.float32))])
  paths = Paths(served)
  x = torch.randn(WIDTH, WIDTH)
  for _ in range(2):
    x_xla = xla(x)
    parts, _ = served(x_xla, x_xla)
    with torch.no_grad():
      expected, _ = cpu(x, x)
    assert parts['y'] is x_xla
    torch.testing.assert_close(parts['sum'].cpu(), expected['sum'])
  # dynamo's guards refuse the aliasing the first capture did not have: the
  # model is captured again once, and that capture's guards accept the
  # second call too. A call with no key goes first to the capture of the
  # last such call: the second call skips the first capture (which has a
  # plan, and counts a new key) for the new one (which has none).
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 1,
      fast_dispatch.COUNTER_FALLBACK_NO_PLAN: 1,
      fast_dispatch.COUNTER_CAPTURED_AGAIN: 1
  }
  # A call that passes one tensor twice has no key.
  assert call_spec.call_key((x, x), {}) == (None, [x, x])


def test_global_state_the_forward_sets_back_keeps_the_fast_path(patched_bridge):
  # dynamo replays the forward's last writes of the module-level state
  # after the graph; they write what was there, so the fast path stands in
  # for them while that state is as the learned call found it (see [Note:
  # Global state the captured code sets back] in call_plan.py).
  state = served_modules.FORWARD_STATE
  cpu, _, served = served_model(served_modules.SetsStateBack, [(TensorSpec(
      (4, WIDTH), torch.float32),)])
  assert served.calls.disabled_reason is None
  paths = Paths(served)
  for _ in range(3):
    check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {'fast': 3}
  assert (state.active, state.compiling) == (None, False)
  # State changed by someone else: the full path, whose guards see it, and
  # the forward puts back what it found.
  state.active = 'caller'
  try:
    check(served, cpu, torch.randn(4, WIDTH))
    assert state.active == 'caller'
    counted = paths.since_last()
    assert counted[fast_dispatch.COUNTER_FALLBACK_GLOBAL_STATE] == 1
    assert 'fast' not in counted
  finally:
    state.active = None
  # dynamo's guards hold the state's value: the call above made a capture
  # of its own, which its key now leads to; that capture's learned state
  # is not today's, so the full path, where the first capture's guards
  # accept the call, and from then on its fast path.
  assert len(served.captures()) == 2
  check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {fast_dispatch.COUNTER_FALLBACK_GLOBAL_STATE: 1}
  check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {'fast': 1}
  assert (state.active, state.compiling) == (None, False)


def test_global_state_the_forward_changes_keeps_the_full_path(patched_bridge):
  # A counter the forward increments is written as a constant dynamo's
  # guards chose: no fast call may skip that write.
  state = served_modules.FORWARD_STATE
  state.calls = 0
  cpu, _, served = served_model(functools.partial(served_modules.SetsStateBack,
                                                  count_calls=True),
                                [(TensorSpec((4, WIDTH), torch.float32),)],
                                first_calls=False)
  for _ in range(3):
    check(served, cpu, torch.randn(4, WIDTH))
  # Three served calls and three of the CPU copy.
  assert state.calls == 6
  assert served.fast_calls == 0


class Holder:
  """A plain object holding a tensor, as a StaticCache holds its layers'."""

  def __init__(self, scale):
    self.scale = scale


class ScalesThroughAHolder(torch.nn.Module):
  """Reads a buffer through a plain attribute, as transformers'
  TorchExportableModuleWithStaticCache reads its cache's buffers through
  `static_cache.layers[i]`."""

  def __init__(self):
    super().__init__()
    self.register_buffer('scale', torch.full((WIDTH,), 2.0))
    self.holder = Holder(self.scale)

  def _apply(self, fn, *args, **kwargs):
    # `.to()` makes new buffers: the holder follows, as the cache's layers
    # do in transformers' module.
    module = super()._apply(fn, *args, **kwargs)
    self.holder = Holder(self.scale)
    return module

  def forward(self, x):
    return x * self.holder.scale + 1


def test_a_buffer_read_through_a_plain_attribute_takes_the_fast_path(
    patched_bridge):
  # See [Note: Captured code the fast path can stand in for] in
  # call_plan.py: the plan binds the buffer the path read, and each fast
  # call checks the path still reads it.
  cpu, model, served = served_model(ScalesThroughAHolder, [(TensorSpec(
      (4, WIDTH), torch.float32),)])
  assert served.calls.disabled_reason is None
  paths = Paths(served)
  for _ in range(2):
    check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last() == {'fast': 2}
  # A plain attribute set anew, which no registration hook sees: the next
  # call takes the full path and reads the new tensor.
  scale = torch.full((WIDTH,), 3.0)
  model.holder = Holder(scale.to(torch_xla.device()))
  cpu.holder = Holder(scale)
  check(served, cpu, torch.randn(4, WIDTH))
  assert paths.since_last()[fast_dispatch.COUNTER_FALLBACK_MODULE] == 1
  check(served, cpu, torch.randn(4, WIDTH))


# -- object arguments and the results the captured code builds


class Store:
  """An object argument holding tensors (as a StaticCache holds its
  layers'): the call key walks its attributes (see [Note: Objects in a call]
  in call_spec.py)."""

  def __init__(self, rows, device='cpu'):
    self.state = torch.zeros(rows, WIDTH, device=device)
    self.rows = rows


@dataclasses.dataclass
class Stepped:
  """A result the captured code builds: a plain dataclass."""
  total: torch.Tensor
  store: Any
  step: int


class Accumulating(torch.nn.Module):
  """Adds to a store it is passed, in place, and returns a dataclass holding
  the store and a Python value of the call."""

  def __init__(self, width=WIDTH):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)

  def forward(self, x, store, step):
    store.state.add_(self.proj(x))
    return Stepped(total=store.state.sum(dim=1), store=store, step=step)


def accumulate_as_eager(served, cpu, x, store, cpu_store, step):
  result = served(xla(x), store, step)
  with torch.no_grad():
    expected = cpu(x, cpu_store, step)
  assert type(result) is Stepped
  assert result.store is store
  assert result.step == step
  torch.testing.assert_close(result.total.cpu(), expected.total)
  torch.testing.assert_close(store.state.cpu(), cpu_store.state)


def test_an_object_argument_takes_the_fast_path_from_its_own_tensors(
    patched_bridge):
  torch.manual_seed(0)
  cpu = Accumulating().eval()
  model = Accumulating().to(torch_xla.device()).eval()
  model.load_state_dict(cpu.state_dict())
  device = torch_xla.device()
  served = torch_xla_patches.serve(model, [
      call_spec.CallSpec(TensorSpec(
          (4, WIDTH), torch.float32), Store(4, device), 1)
  ])
  assert served.calls.disabled_reason is None
  paths = Paths(served)
  store, cpu_store = Store(4, device), Store(4)
  for _ in range(3):
    accumulate_as_eager(served, cpu, torch.randn(4, WIDTH), store, cpu_store, 1)
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_NO_PLAN: 1,
      'fast': 2
  }
  # Another store of the same sizes: the fast path reads and updates it, and
  # the result holds it, not the store it learned from.
  other, cpu_other = Store(4, device), Store(4)
  for _ in range(2):
    accumulate_as_eager(served, cpu, torch.randn(4, WIDTH), other, cpu_other, 1)
  assert paths.since_last() == {'fast': 2}
  accumulate_as_eager(served, cpu, torch.randn(4, WIDTH), store, cpu_store, 1)
  assert paths.since_last() == {'fast': 1}
  # A Python value of the call in the result is this call's: another value
  # is another key, served by the full path once, then fast.
  for step in (2, 2, 1):
    accumulate_as_eager(served, cpu, torch.randn(4, WIDTH), store, cpu_store,
                        step)
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_ARGUMENTS: 1,
      'fast': 2
  }
  # A store of other sizes, or with another int attribute, is not taken by
  # the fast path: the full path serves it.
  bigger, cpu_bigger = Store(6, device), Store(6)
  accumulate_as_eager(served, cpu, torch.randn(6, WIDTH), bigger, cpu_bigger, 1)
  assert 'fast' not in paths.since_last()
  store.rows, cpu_store.rows = 5, 5
  accumulate_as_eager(served, cpu, torch.randn(4, WIDTH), store, cpu_store, 1)
  assert 'fast' not in paths.since_last()


try:
  from transformers.utils import ModelOutput
except ImportError:
  ModelOutput = None

if ModelOutput is not None:

  @dataclasses.dataclass
  class Scores(ModelOutput):
    """A ModelOutput holding an object argument of the call."""
    logits: torch.Tensor = None
    store: Any = None
else:
  Scores = None


class Scoring(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(WIDTH, WIDTH)

  def forward(self, x, store):
    return Scores(logits=self.proj(x) + store.state, store=store)


def test_a_model_output_the_captured_code_builds_takes_the_fast_path(
    patched_bridge):
  # See [Note: Results the captured code builds] in captured_results.py.
  if Scores is None:
    pytest.skip('transformers is not installed')
  torch.manual_seed(0)
  cpu = Scoring().eval()
  model = Scoring().to(torch_xla.device()).eval()
  model.load_state_dict(cpu.state_dict())
  device = torch_xla.device()
  served = torch_xla_patches.serve(model, [
      call_spec.CallSpec(TensorSpec(
          (4, WIDTH), torch.float32), Store(4, device))
  ])
  assert served.calls.disabled_reason is None
  paths = Paths(served)
  for _ in range(3):
    x, store = torch.randn(4, WIDTH), Store(4)
    store.state.normal_()
    xla_store = Store(4, device)
    xla_store.state.copy_(store.state)
    result = served(xla(x), xla_store)
    with torch.no_grad():
      expected = cpu(x, store)
    assert type(result) is Scores
    assert list(result.keys()) == ['logits', 'store']
    assert result.store is xla_store and result[1] is xla_store
    torch.testing.assert_close(result.logits.cpu(), expected.logits)
  assert paths.since_last() == {
      fast_dispatch.COUNTER_FALLBACK_NO_PLAN: 1,
      'fast': 2
  }

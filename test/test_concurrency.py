"""Compiled calls from many threads (see [Note: Threads] in execution.py
and [Note: One served call] in fast_dispatch.py)."""
import collections
import os
import random
import sys
import threading
import traceback

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from torch_xla_patches import counters as bridge_counters
from torch_xla_patches import (TensorSpec, call_plan, config, execution,
                               fast_dispatch, torch_internals, tracing)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, 'tools'))

import bench_concurrency  # pylint: disable=g-import-not-at-top
import bench_decode  # pylint: disable=g-import-not-at-top

WIDTH = 8


def xla(t):
  return t.to(torch_xla.device())


def counter(name):
  return met.counter_value(name) or 0


# -- many threads at once: every result equal to eager, none raised


def eight_threads(mode, **load):
  """bench_concurrency.run on 8 threads; no call raised, every result equal
  to eager."""
  report = bench_concurrency.run(mode, threads=8, **load)
  assert report['errors'] == {}
  assert report['mismatches'] == 0
  return report


def dynamo_config_now():
  return {
      name: getattr(torch._dynamo.config, name)
      for name in ('assume_static_by_default', 'automatic_dynamic_shapes')
  }


def test_overlapping_dynamic_calls_restore_dynamo_config(patched_bridge):
  # What two threads' calls of a dynamic=True and a dynamic=False model do,
  # interleaved: each call's change is in place while it runs, and the
  # config comes back whole when the last returns, whatever the order.
  from torch._dynamo import eval_frame
  before = dynamo_config_now()
  dynamic, static = (eval_frame.make_set_enable_dynamic(True),
                     eval_frame.make_set_enable_dynamic(False))
  # Two calls of one dynamic=True model: the first to return must not put
  # back what it found while the other runs, nor the other what the first
  # had set (torch's own order leaves assume_static_by_default False).
  leave_first = dynamic()
  leave_second = dynamic()
  leave_first()
  assert not torch._dynamo.config.assume_static_by_default
  leave_second()
  assert dynamo_config_now() == before
  leave_dynamic = dynamic()
  assert not torch._dynamo.config.assume_static_by_default
  leave_static = static()
  assert dynamo_config_now() == {
      'assume_static_by_default': True,
      'automatic_dynamic_shapes': False
  }
  leave_dynamic()
  again = dynamic()
  leave_static()
  assert not torch._dynamo.config.assume_static_by_default
  again()
  assert dynamo_config_now() == before


@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('mode', ['serve', 'patched'])
def test_eight_threads_with_new_shapes_and_a_parameter_swap(
    patched_bridge, mode, seed):
  # 8 threads x 150 calls over random buckets, a share of new shapes, and a
  # Parameter swapped halfway between two barriers (no call in flight).
  dynamo_config = dynamo_config_now()
  report = eight_threads(mode,
                         requests=150,
                         new_shapes=0.05,
                         swap=True,
                         seed=seed)
  # torch.compile(dynamic=True) calls from 8 threads left dynamo's config as
  # they found it (see [Note: dynamo's config from many threads]).
  assert dynamo_config_now() == dynamo_config
  # Each new shape was traced and compiled exactly once, however many
  # threads asked for it first at once.
  assert report['new_shapes_sent'] > 0
  assert report['fallbacks'].get(bridge_counters.COUNTER_MISS,
                                 0) == report['new_shapes_sent']


# serve()'s fast path and full path need torch 2.9's aot_compile; on torch
# 2.8 serve() wraps torch.compile (tested above as it is).
needs_fast_path = pytest.mark.requires('torch_aot_compile')


@needs_fast_path
def test_eight_threads_learn_again_after_a_parameter_swap(patched_bridge):
  report = eight_threads('serve',
                         requests=150,
                         new_shapes=0.05,
                         swap=True,
                         seed=4)
  # The swap sent one call to the full path: it dropped what was learned.
  # The next full call of each key learned again; only the calls that found
  # nothing learned yet took the full path (counted as no plan or a new
  # key), the rest were fast.
  fallbacks = report['fallbacks']
  assert fallbacks[fast_dispatch.COUNTER_FALLBACK_MODULE] == 1
  full_calls = sum(count for name, count in fallbacks.items()
                   if name.startswith('ServeFallback'))
  assert full_calls < report['requests'] // 4


def test_eight_threads_over_a_signature_cap(patched_bridge, monkeypatch):
  # More signatures than the cap: entries are dropped and traced again while
  # other threads look theirs up and run bound programs.
  monkeypatch.setattr(config, 'max_signatures_per_graph', 3)
  eight_threads('serve', requests=100, new_shapes=0.2, swap=False, seed=3)
  assert counter(bridge_counters.COUNTER_DROPPED) > 0


class TwoLayers(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.first = torch.nn.Linear(WIDTH, WIDTH)
    self.second = torch.nn.Linear(WIDTH, WIDTH)

  def forward(self, x):
    return self.second(torch.relu(self.first(x)))


def test_torch_compile_calls_while_another_thread_compiles(patched_bridge):
  # 8 threads x 60 calls of one torch.compile(dynamic=True) model, warmed
  # on its usual shapes, with new shapes mixed in. A size of 1 is
  # specialized by dynamo: dynamo compiles again, through AOTAutograd's FX
  # trace, while the other threads call. dynamo's check of FX's
  # process-wide flag refuses each of their calls ("Detected that you are
  # using FX to symbolically trace a dynamo-optimized function") unless it
  # answers for the calling thread (see [Note: FX tracing seen per thread]
  # in torch_internals.py).
  usual = [(2, 8), (4, 8), (4, 16)]
  new = [(1, 8), (3, 1), (1, 1), (5, 7), (6, 3)]
  threads, calls = 8, 60
  torch.manual_seed(0)
  cpu = TwoLayers().eval()
  model = TwoLayers().eval().to(torch_xla.device())
  model.load_state_dict(cpu.state_dict())
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  with torch.no_grad():
    for shape in usual:
      compiled(xla(torch.zeros(*shape, WIDTH))).cpu()
  start = threading.Barrier(threads)
  lock = threading.Lock()
  errors = collections.Counter()
  first_traceback = []
  results = []

  def worker(index):
    rng = random.Random(index)
    mine = []
    start.wait()
    for _ in range(calls):
      shape = rng.choice(new if rng.random() < 0.1 else usual)
      x = torch.randn(*shape, WIDTH)
      try:
        with torch.no_grad():
          mine.append((x, compiled(xla(x)).cpu()))
      except Exception as e:  # pylint: disable=broad-except
        with lock:
          errors[f'{type(e).__name__}: {str(e).splitlines()[0]}'] += 1
          if not first_traceback:
            first_traceback.append(traceback.format_exc())
    with lock:
      results.extend(mine)

  workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
  for thread in workers:
    thread.start()
  for thread in workers:
    thread.join()
  assert dict(errors) == {}, ''.join(first_traceback)
  assert len(results) == threads * calls
  with torch.no_grad():
    for x, y in results:
      torch.testing.assert_close(y, cpu(x), atol=1e-4, rtol=1e-4)


@needs_fast_path
def test_four_threads_decode_on_fresh_caches(patched_bridge):
  # Issue 33: each thread makes its own caches on the device and decodes
  # through one served paged decode model. A donating run on caches the
  # caller made synced every live tensor of the device, another thread's
  # tensor on its way to the device included (`Check failed: tensor_data`,
  # and caches that lost a step's update). The bridge computes such caches
  # alone, into buffers of their own, and syncs nothing else (see [Note:
  # Donating in-place updates] in donation.py).
  device = torch_xla.device()
  torch.manual_seed(0)
  cpu = bench_decode.PagedDecoder().eval()
  model = bench_decode.PagedDecoder().eval().to(device)
  model.load_state_dict(cpu.state_dict())
  shape = (bench_decode.cache_slots(1), 2 * bench_decode.D_MODEL)
  served = bench_decode.serve_paged(model, shape)
  plan = bench_decode.make_steps(shape[0], 10)
  # One thread's steps run eagerly on the CPU: every thread's reference.
  expected_caches = [torch.zeros(shape) for _ in range(bench_decode.LAYERS)]
  expected = []
  with torch.no_grad():
    for step in plan:
      arguments = {
          name: value
          for name, value in step.items()
          if isinstance(value, torch.Tensor)
      }
      expected.append(
          cpu(arguments.pop('tokens'), caches=expected_caches, **arguments))
  barrier = threading.Barrier(4)

  def decode():
    barrier.wait()
    caches = [torch.zeros(shape, device=device) for _ in expected_caches]
    logits = []
    for step in plan:
      arguments = bench_decode.step_arguments(step, device)
      with torch.no_grad():
        logits.append(
            served(arguments.pop('tokens'), caches=caches,
                   **arguments).cpu()[:step['real']])
    return logits, [cache.cpu() for cache in caches]

  synced = counter(bridge_counters.COUNTER_DONATION_READERS_SYNCED)
  copied = counter(bridge_counters.COUNTER_DONATION_COPIED_READ)
  fast = served.calls.fast_calls
  threads = [call_in_thread(decode, name=f'decode-{i}') for i in range(4)]
  for thread, _ in threads:
    thread.join()
  for _, outcome in threads:
    assert 'error' not in outcome, outcome
    logits, caches = outcome['result']
    for got, want, step in zip(logits, expected, plan):
      torch.testing.assert_close(got, want[:step['real']], rtol=1e-4, atol=1e-4)
    # Padding tokens all write the padding slot, in no fixed order.
    real = torch.arange(shape[0]) != bench_decode.PAD_SLOT
    for got, want in zip(caches, expected_caches):
      torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
  # Each thread's first step computed its caches and took them over as they
  # were: no run synced the device's pending IR, and none copied a cache.
  assert counter(bridge_counters.COUNTER_DONATION_READERS_SYNCED) == synced
  assert counter(bridge_counters.COUNTER_DONATION_COPIED_READ) == copied
  # The warm-up compiles without running, so the first steps take the full
  # path until one of them has taught the fast path the bucket (a thread's
  # steps may come while another's first call is still learning).
  assert served.calls.fast_calls - fast >= 40 - 4 * 3


# -- each guarantee on its own


class Scaled(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(WIDTH, WIDTH)
    self.register_buffer('scale', torch.linspace(0.5, 1.5, WIDTH))

  def forward(self, x):
    return self.proj(x) * self.scale


def served_scaled(batches=(4, 6)):
  torch.manual_seed(0)
  cpu = Scaled().eval()
  model = Scaled().eval().to(torch_xla.device())
  model.load_state_dict(cpu.state_dict())
  served = torch_xla_patches.serve(
      model, [(TensorSpec((b, WIDTH), torch.float32),) for b in batches])
  # A first call of each bucket, as a server's first requests: it learns
  # the bucket's fast path (the warm-up compiles without running).
  for b in batches:
    served(xla(torch.randn(b, WIDTH)))
  return cpu, model, served


def check(served, cpu, x, **tolerances):
  with torch.no_grad():
    expected = cpu(x)
  torch.testing.assert_close(served(xla(x)).cpu(), expected, **tolerances)


def call_in_thread(fn, *args, name=None):
  """Starts fn(*args) on a thread; returns (thread, outcome dict)."""
  outcome = {}

  def target():
    try:
      outcome['result'] = fn(*args)
    except Exception as e:  # pylint: disable=broad-except
      outcome['error'] = e

  thread = threading.Thread(target=target, name=name)
  thread.start()
  return thread, outcome


class WatchedLock:
  """execution.execution_lock, keeping the state of each named thread:
  'waiting' for the lock (another thread holds it) until it has it, then
  'running'; a test sets others (`set`) and waits for a state
  (`wait_until`)."""

  def __init__(self, lock):
    self._lock = lock
    self._changed = threading.Condition()
    self.states = {}
    self._owner = None
    self._depth = 0

  def set(self, state):
    with self._changed:
      self.states[threading.current_thread().name] = state
      self._changed.notify_all()

  def wait_until(self, predicate):
    """Until predicate(states) holds."""
    with self._changed:
      # A bound, so that a lock the watch does not see fails, not hangs.
      assert self._changed.wait_for(lambda: predicate(self.states),
                                    timeout=120), self.states

  def held_here(self):
    return self._owner == threading.get_ident()

  def __enter__(self):
    if not self._lock.acquire(blocking=False):
      self.set('waiting')
      self._lock.acquire()
      self.set('running')
    self._owner = threading.get_ident()
    self._depth += 1
    return self

  def __exit__(self, *exc_info):
    self._depth -= 1
    if not self._depth:
      self._owner = None
    self._lock.release()

  # What execution.execution_lock_released calls (threading.Condition's
  # way of letting a reentrant lock go whole).
  def _release_save(self):
    mine = (self._owner, self._depth)
    self._owner, self._depth = None, 0
    return mine, self._lock._release_save()

  def _acquire_restore(self, saved):
    mine, inner = saved
    if not self._lock.acquire(blocking=False):
      self.set('waiting')
      self._lock.acquire()
      self.set('running')
    self._lock.release()
    self._lock._acquire_restore(inner)
    self._owner, self._depth = mine


def watch_execution_lock(monkeypatch):
  lock = WatchedLock(execution.execution_lock)
  monkeypatch.setattr(execution, 'execution_lock', lock)
  return lock


def ending(lock, fn):
  """fn, which sets its thread's state to 'ended' when it returns or
  raises."""

  def call(*args):
    try:
      return fn(*args)
    finally:
      lock.set('ended')

  return call


@pytest.mark.parametrize('path', [
    pytest.param('fast', marks=needs_fast_path),
    pytest.param('full', marks=needs_fast_path), 'torch.compile'
])
def test_a_call_waits_for_the_execution_lock(patched_bridge, monkeypatch, path):
  cpu, model, served = served_scaled()
  x = torch.randn(4 if path == 'fast' else 5, WIDTH)
  if path == 'torch.compile':
    served = torch.compile(model, backend='openxla', dynamic=True)
    served(xla(x))
  fast_before = served.calls.fast_calls if path != 'torch.compile' else 0
  lock = watch_execution_lock(monkeypatch)
  runs = []
  run_program = execution.run_program

  def counted_run(*args, **kwargs):
    runs.append(threading.current_thread().name)
    return run_program(*args, **kwargs)

  # Every run of a compiled program goes through it (see [Note: One run of
  # a compiled program] in program_run.py).
  monkeypatch.setattr(execution, 'run_program', counted_run)
  misses = counter(bridge_counters.COUNTER_MISS)
  with lock:
    thread, outcome = call_in_thread(ending(lock, served),
                                     xla(x),
                                     name='served call')
    lock.wait_until(lambda states: states.get('served call') in
                    ('waiting', 'ended'))
    # The call cannot look up, trace or run its program while another
    # thread holds the lock: it waits for it, having done none of that.
    assert lock.states['served call'] == 'waiting', outcome
    assert thread.is_alive() and outcome == {}
    assert runs == []
    assert counter(bridge_counters.COUNTER_MISS) == misses
  thread.join()
  assert 'error' not in outcome, outcome
  with torch.no_grad():
    torch.testing.assert_close(outcome['result'].cpu(), cpu(x))
  assert runs == ['served call']
  # Batch 5 is not a bucket: traced and compiled once the lock was free.
  assert counter(bridge_counters.COUNTER_MISS) == misses + (path == 'full')
  if path == 'fast':
    assert served.calls.fast_calls == fast_before + 1


class Doubling(torch.nn.Module):
  """Doubles its result in training mode: nothing a plan binds tells the
  two modes apart, only dynamo's guard on `training`."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(WIDTH, WIDTH)

  def forward(self, x):
    y = self.proj(x)
    return y * 2 if self.training else y


@needs_fast_path
def test_learning_ignores_a_call_during_which_a_module_changed(
    patched_bridge, monkeypatch):
  torch.manual_seed(0)
  cpu = Doubling().eval()
  model = Doubling().eval().to(torch_xla.device())
  model.load_state_dict(cpu.state_dict())
  served = torch_xla_patches.serve(
      model, [(TensorSpec((b, WIDTH), torch.float32),) for b in (4, 6)])
  compiled = served.compiled
  original = compiled.call_captured

  def train_while_running(args, kwargs):
    # Another thread switches the model to training mode while this call
    # runs the evaluation-mode program.
    result = original(args, kwargs)
    model.train()
    return result

  monkeypatch.setattr(compiled, 'call_captured', train_while_running)
  check(served, cpu, torch.randn(5, WIDTH))
  monkeypatch.setattr(compiled, 'call_captured', original)
  cpu.train()
  # Learned from that call and stamped with the module's generation after
  # it, the run of batch 5 would serve training mode with the evaluation
  # program.
  for batch in (5, 5, 4):
    check(served, cpu, torch.randn(batch, WIDTH))


@needs_fast_path
def test_two_threads_learning_at_once_both_learn(patched_bridge, monkeypatch):
  cpu, _, served = served_scaled()
  calls = served.calls
  learned = calls.learned_keys()
  make_run = calls._make_run
  lock = watch_execution_lock(monkeypatch)
  learning = []
  most_learning = [0]

  def make_run_beside_the_other(*args, **kwargs):
    # Waits until the other thread learns too, waits for the execution lock
    # this one holds, or has ended. With learning one transaction under the
    # lock, the other never learns at the same time: each learns in turn.
    # Otherwise both learn from the same learned state here, and the later
    # one drops the other's run.
    me = threading.current_thread().name
    other = 'second' if me == 'first' else 'first'
    learning.append(me)
    most_learning[0] = max(most_learning[0], len(learning))
    lock.set('learning')
    lock.wait_until(lambda states: states.get(other) in ('learning', 'ended') or
                    (states.get(other) == 'waiting' and lock.held_here()))
    try:
      return make_run(*args, **kwargs)
    finally:
      learning.remove(me)
      lock.set('running')

  monkeypatch.setattr(calls, '_make_run', make_run_beside_the_other)
  started = [
      call_in_thread(ending(lock, check),
                     served,
                     cpu,
                     torch.randn(batch, WIDTH),
                     name=name) for batch, name in ((5, 'first'), (7, 'second'))
  ]
  for thread, outcome in started:
    thread.join()
    assert outcome == {'result': None}, outcome
  assert [lock.states.get(name) for name in ('first', 'second')
         ] == ['ended', 'ended']
  assert most_learning == [1]
  assert calls.learned_keys() == learned + 2


@needs_fast_path
def test_observed_graph_calls_are_the_calling_threads(patched_bridge):
  _, _, served = served_scaled()
  backend = served.compiled.backend_callable
  with backend.observed_calls() as calls:
    thread, outcome = call_in_thread(served.compiled, xla(torch.randn(5,
                                                                      WIDTH)))
    thread.join()
  assert 'error' not in outcome, outcome
  assert calls == []


def test_a_trace_keeps_other_threads_pending_tensors(patched_bridge,
                                                     monkeypatch):
  _, _, served = served_scaled()
  # Another thread's lazy tensor, made before this one's call: a trace syncs
  # only its own arguments (a sync of every live tensor races with other
  # threads' tensors, see [Note: Threads]), so it stays pending.
  earlier = torch.ones(3, device=torch_xla.device()) * 3
  pending = []
  trace_graph = tracing.trace_graph

  def trace_while_another_thread_computes(*args, **kwargs):
    # Another thread builds a lazy tensor (pending IR, not computed yet)
    # while this one traces a new signature.
    thread, _ = call_in_thread(
        lambda: pending.append(torch.ones(3, device=torch_xla.device()) * 2))
    thread.join()
    return trace_graph(*args, **kwargs)

  monkeypatch.setattr(tracing, 'trace_graph',
                      trace_while_another_thread_computes)
  misses = counter(bridge_counters.COUNTER_MISS)
  served(xla(torch.randn(7, WIDTH)))
  assert counter(bridge_counters.COUNTER_MISS) == misses + 1
  assert torch_xla._XLAC._check_tensor_need_materialization([earlier] +
                                                            pending) == [
                                                                True, True
                                                            ]
  torch.testing.assert_close(pending[0].cpu(), torch.full((3,), 2.0))
  torch.testing.assert_close(earlier.cpu(), torch.full((3,), 3.0))


def fx_tracing_check():
  """The function dynamo's frame entry asks whether FX is tracing."""
  _, module, name = torch_internals.fx_tracing_flag_users()
  return getattr(module, name)


NESTED_FX_TRACE = ('Detected that you are using FX to symbolically trace a '
                   'dynamo-optimized function')


def test_fx_tracing_is_seen_on_the_tracing_thread_only(patched_bridge):
  from torch.fx.experimental.proxy_tensor import make_fx
  compiled = torch.compile(lambda t: t * 2 + 1, backend='eager')
  x = torch.randn(3)
  compiled(x)
  inside, release = threading.Event(), threading.Event()
  seen_inside = []

  def traced(t):
    seen_inside.append(fx_tracing_check()())
    inside.set()
    assert release.wait(timeout=60)
    return t + 1

  # Another thread traces with make_fx (AOTAutograd's FX trace) and waits
  # in the middle of its trace.
  thread, outcome = call_in_thread(make_fx(traced), torch.randn(2))
  try:
    assert inside.wait(timeout=60), outcome
    # FX's one flag is set, for the process.
    assert torch.fx._symbolic_trace._is_fx_tracing_flag
    # This thread traces nothing: its compiled call runs.
    assert not fx_tracing_check()()
    torch.testing.assert_close(compiled(x), x * 2 + 1)
  finally:
    release.set()
    thread.join()
  assert 'error' not in outcome, outcome
  assert seen_inside == [True]
  # A compiled function called inside an FX trace of its own thread is
  # still refused, whichever FX trace it is.
  with pytest.raises(RuntimeError, match=NESTED_FX_TRACE):
    make_fx(lambda t: compiled(t))(x)
  with pytest.raises(RuntimeError, match=NESTED_FX_TRACE):
    torch.fx.symbolic_trace(lambda t: compiled(t))
  # torch.cond clears the flag to compile its branches inside the trace.
  def branching(t):
    return torch.cond(t.sum() > 0, lambda u: u + 1, lambda u: u - 1, (t,))

  graph = make_fx(branching)(x).graph
  assert torch.ops.higher_order.cond in [node.target for node in graph.nodes]
  assert not torch.fx._symbolic_trace._is_fx_tracing_flag


def test_revert_restores_torchs_fx_tracing_functions():
  assert not torch_xla_patches.is_applied()
  tracer, module, name = torch_internals.fx_tracing_flag_users()
  trace, check = tracer.trace, getattr(module, name)
  torch_xla_patches.apply()
  try:
    assert tracer.trace is not trace
    assert getattr(module, name) is not check
    compiled = torch.compile(lambda t: t - 1, backend='eager')
  finally:
    torch_xla_patches.revert()
  assert tracer.trace is trace
  assert getattr(module, name) is check
  # dynamo bound the check of the function compiled under apply(); with
  # the count of traces gone, it answers as torch's.
  with pytest.raises(RuntimeError, match=NESTED_FX_TRACE):
    torch.fx.symbolic_trace(lambda t: compiled(t))


# -- what the fast path checks of bound tensors


@needs_fast_path
@pytest.mark.parametrize('change,now', [
    (lambda t: t.to(torch.bfloat16), r'bfloat16\[8\]'),
    (lambda t: t.reshape(1, WIDTH), r'float32\[1, 8\]'),
])
def test_a_bound_tensor_changed_behind_its_object(patched_bridge, change, now):
  cpu, model, served = served_scaled()
  check(served, cpu, torch.randn(4, WIDTH))
  fast = served.calls.fast_calls
  # No hook sees a `.data` assignment, and dynamo's guards accept the call:
  # the program would be handed a buffer it was not compiled for. Upstream's
  # torch.compile fails in XLA for the dtype ("Executable expected parameter
  # 0 of size 32 but got buffer with incompatible size 16") and runs the
  # reshaped buffer, of the same size, as if nothing changed.
  compiled_scale = model.scale.data
  model.scale.data = change(compiled_scale)
  modules_changed = counter(fast_dispatch.COUNTER_FALLBACK_MODULE)
  for _ in range(2):
    with pytest.raises(call_plan.BoundTensorChanged,
                       match=r'scale \(compiled as float32\[8\], now ' + now +
                       r'\) of Scaled changed behind its object'):
      served(xla(torch.randn(4, WIDTH)))
  assert counter(fast_dispatch.COUNTER_FALLBACK_MODULE) == modules_changed + 1
  assert served.calls.fast_calls == fast
  # Back as compiled: served again, and learned again.
  model.scale.data = compiled_scale
  for batch in (4, 4, 6):
    check(served, cpu, torch.randn(batch, WIDTH))
  assert served.calls.fast_calls == fast + 1


@needs_fast_path
def test_swap_tensors_is_refused_on_a_served_model(patched_bridge):
  cpu, model, served = served_scaled()
  # dynamo and aot_compile keep weak references to the module's tensors, so
  # torch refuses the swap itself, and the model stays as it was.
  with pytest.raises(RuntimeError, match='has weakref associated with it'):
    torch.utils.swap_tensors(model.scale, xla(torch.ones(WIDTH)))
  check(served, cpu, torch.randn(4, WIDTH))


@needs_fast_path
def test_learned_runs_are_bounded(patched_bridge, monkeypatch):
  monkeypatch.setattr(config, 'max_signatures_per_graph', 2)
  cpu, _, served = served_scaled(batches=(4, 6))
  assert served.calls.learned_keys() == 2
  fast = served.calls.fast_calls
  new_keys = counter(fast_dispatch.COUNTER_FALLBACK_ARGUMENTS)
  for batch in (4, 6, 5, 4, 6, 5):
    check(served, cpu, torch.randn(batch, WIDTH))
  # 4 and 6 were learned by serve(); each later full call learned its key
  # and dropped the oldest (5 drops 4, 4 drops 6, ...), so after the first
  # two calls none found its key. Unbounded, 4, 6 and 5 would all be fast
  # from their second call.
  assert served.calls.learned_keys() == 2
  assert served.calls.fast_calls == fast + 2
  assert counter(fast_dispatch.COUNTER_FALLBACK_ARGUMENTS) == new_keys + 4


@needs_fast_path
def test_the_bound_tensor_check_can_be_turned_off(patched_bridge, monkeypatch):
  monkeypatch.setattr(config, 'serve_check_bound_tensors', False)
  cpu, model, served = served_scaled()
  check(served, cpu, torch.randn(4, WIDTH))
  fast = served.calls.fast_calls
  # Unseen, as by torch.compile: the program runs the reshaped buffer, of
  # the same size in bytes, as the one it was compiled for.
  model.scale.data = model.scale.data.reshape(1, WIDTH)
  check(served, cpu, torch.randn(4, WIDTH))
  assert served.calls.fast_calls == fast + 1


def test_a_trace_restores_its_arguments_between_dynamo_compiles(
    patched_bridge, monkeypatch):
  # A new signature's trace writes the model's tensors back through
  # functionalization (tracing.ArgumentsRestore); a dynamo compile on another
  # thread that made a fake tensor of one with that write still queued
  # applied it under its fake mode and raised BackendCompilerFailed ("Please
  # convert all Tensors to FakeTensors first"; 2 of 10 cold starts of this
  # file's torch.compile load test). The restore waits for the compile (see
  # [Note: Restores and dynamo's compiles] in tracing.py). A trace on
  # placeholders restores nothing (see [Note: Traces on placeholders]): this is
  # the trace of the arguments themselves.
  monkeypatch.setattr(config, 'trace_on_placeholders', False)
  cpu, model, served = served_scaled()
  compile_lock = tracing.dynamo_compile_lock()
  watched = WatchedLock(compile_lock)
  monkeypatch.setattr(tracing, 'dynamo_compile_lock', lambda: watched)
  x = torch.randn(7, WIDTH)
  with compile_lock:
    # This thread stands for a dynamo compile in progress.
    thread, outcome = call_in_thread(lambda: served(xla(x)).cpu(),
                                     name='tracer')
    watched.wait_until(lambda states: states.get('tracer') == 'waiting')
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    for tensor in list(model.parameters()) + list(model.buffers()):
      assert fake_mode.from_tensor(tensor).shape == tensor.shape
  thread.join()
  assert 'error' not in outcome, outcome
  with torch.no_grad():
    torch.testing.assert_close(outcome['result'], cpu(x))

"""What makes a program runs off the request path: while one thread's new
shape compiles (a donating program among them) or is captured, another
thread's calls of compiled programs complete (see [Note: Traces on
placeholders] in placeholder_trace.py and [Note: Compiles outside the lock] in
signature_cache.py)."""
import concurrent.futures
import threading
import time

import pytest
import torch
import torch_xla

import torch_xla_patches
from bridge_testing import serve_fresh, serve_sizes
from torch_xla_patches import (TensorSpec, backlog, compile_window, config,
                               donation, execution, handover_sync, io_utils,
                               placeholder_trace, signature_cache,
                               signature_index, tracing)

WIDTH = 8
SLOTS = 4
# Long enough for no pass to come near it: it only bounds a failure, which
# would otherwise wait for ever on a call that never comes.
FAILURE_BOUND_S = 120


class CacheWriter(torch.nn.Module):
  """A decode step: writes its rows into the cache it is given, in place
  (a donating program), and reads the whole cache."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(WIDTH, WIDTH)

  def forward(self, x, slots, cache):
    cache.index_copy_(0, slots, self.proj(x))
    return (cache * 2).sum(0)


def xla(t):
  return t.to(torch_xla.device())


class HeldOffThread:
  """Wraps `function` so that its first call on another thread than the
  one that made this (the new shape's own thread, or the compile pool's)
  stops until `release()`: `held` is set once it is stopped there, and
  `released_in_time` says whether release() came before FAILURE_BOUND_S."""

  def __init__(self, function):
    self._function = function
    self._here = threading.current_thread()
    self._lock = threading.Lock()
    self.held = threading.Event()
    self._released = threading.Event()
    self.released_in_time = None

  def release(self):
    self._released.set()

  def __call__(self, *args, **kwargs):
    with self._lock:
      hold = (threading.current_thread() is not self._here and
              not self.held.is_set())
      if hold:
        self.held.set()
    if hold:
      self.released_in_time = self._released.wait(FAILURE_BOUND_S)
    return self._function(*args, **kwargs)


def call_in_thread(fn, name):
  outcome = {}

  def target():
    try:
      outcome['result'] = fn()
    except Exception as error:  # pylint: disable=broad-except
      outcome['error'] = error

  thread = threading.Thread(target=target, name=name)
  thread.start()
  return thread, outcome


def eager_step(cpu, x, slots, cache):
  with torch.no_grad():
    return cpu(x, slots, cache)


def compiled_writer(mode):
  torch.manual_seed(0)
  cpu = CacheWriter().eval()
  model = CacheWriter().eval().to(torch_xla.device())
  model.load_state_dict(cpu.state_dict())
  if mode == 'serve':
    step = torch_xla_patches.serve(model, [(TensorSpec(
        (SLOTS, WIDTH)), TensorSpec(
            (SLOTS,), torch.long), TensorSpec((16, WIDTH)))])
  else:
    step = torch.compile(model, backend='openxla', dynamic=True)
  return cpu, step


def decode_steps(cpu, step, rows, count, seed, as_view=False, after_step=None):
  """`count` steps on a cache of `rows` rows, on the device and on the CPU;
  the outputs of both. `as_view`: the step input is a view of a larger
  tensor (as generate() passes `input_ids[:, -1:]`). `after_step(index)`
  runs after each step on the device."""
  generator = torch.Generator().manual_seed(seed)
  cache_cpu = torch.zeros(rows, WIDTH)
  cache = torch.zeros(rows, WIDTH, device=torch_xla.device())
  got, want = [], []
  for _ in range(count):
    x = torch.randn(SLOTS, WIDTH, generator=generator)
    slots = torch.randperm(rows, generator=generator)[:SLOTS]
    step_input = (xla(torch.cat([torch.zeros(SLOTS, WIDTH), x]))[SLOTS:]
                  if as_view else xla(x))
    with torch.no_grad():
      got.append(step(step_input, xla(slots), cache).cpu())
    want.append(eager_step(cpu, x, slots, cache_cpu))
    if after_step is not None:
      after_step(len(got) - 1)
  return got, want, cache.cpu(), cache_cpu


def held_on_new_shape(monkeypatch, held):
  """Holds the trace, the XLA compile or the first sync of inputs (whichever
  module's name for it is called) made off this thread."""
  places = {
      'trace': [(tracing, 'trace_graph')],
      'compile': [(compile_window, 'compile_graph')],
      'sync': [(execution, 'sync_alone'), (donation, 'sync_alone')],
  }[held]
  hold = HeldOffThread(execution.sync_alone if held == 'sync' else getattr(
      *places[0]))
  for module, name in places:
    monkeypatch.setattr(module, name, hold)
  return hold


def check_steps(outcome):
  got, want, cache, cache_cpu = outcome
  for g, w in zip(got, want):
    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
  torch.testing.assert_close(cache, cache_cpu, rtol=1e-4, atol=1e-4)


def steps_complete_while_held(cpu, step, hold, new_shape_call):
  """Runs `new_shape_call` on a thread until `hold` holds its trace or
  compile, makes 5 steps of the compiled shape meanwhile, then lets it go:
  both give eager's results, and the hold was let go before its bound."""
  thread, outcome = call_in_thread(new_shape_call, name='new-shape')
  assert hold.held.wait(FAILURE_BOUND_S)
  steps = decode_steps(cpu, step, 16, 5, seed=2)
  hold.release()
  thread.join()
  assert hold.released_in_time
  check_steps(steps)
  assert 'error' not in outcome, outcome
  check_steps(outcome['result'])


@pytest.mark.parametrize('step_input', ['tensor', 'view'])
@pytest.mark.parametrize('held', ['trace', 'compile'])
@pytest.mark.parametrize('mode', ['serve', 'torch.compile'])
def test_calls_complete_while_a_donating_signature_is_made(
    patched_bridge, monkeypatch, mode, held, step_input):
  # A new cache size is a new signature of a program that updates its
  # cache in place and takes its buffer over. Its trace, or its XLA
  # compile, is held on the thread that asked for it; meanwhile this
  # thread's steps of the compiled size run, on their own cache, to the
  # end. The trace ran on stand-ins for the arguments, and no lock was held
  # while it traced and compiled (see [Note: Traces on placeholders] in
  # placeholder_trace.py). A step input that is a view whose base is no
  # other argument is stood for by a copy of its values ([Note: Stand-ins
  # that hold buffers]); it was traced on the arguments under the lock, and
  # this thread's steps waited.
  cpu, step = compiled_writer(mode)
  decode_steps(cpu, step, 16, 2, seed=0)  # compiled, and learned
  hold = held_on_new_shape(monkeypatch, held)
  steps_complete_while_held(
      cpu, step, hold,
      lambda: decode_steps(cpu, step, 32, 3, 1, as_view=step_input == 'view'))


@pytest.mark.parametrize('mode', ['serve', 'torch.compile'])
def test_calls_complete_while_a_view_arguments_copy_is_made(
    patched_bridge, monkeypatch, mode):
  # A new signature whose step input is a view stands for it with a copy of
  # its values, whose sync compiles a program of its own for a shape the
  # device has not copied before. Held there, on the new shape's thread, it
  # keeps no other thread's steps waiting: the copy is made with
  # execution_lock let go ([Note: View copies off the lock] in
  # placeholder_trace.py). Made under the lock, this thread's steps waited
  # for it, and the hold was let go only at its bound.
  cpu, step = compiled_writer(mode)
  decode_steps(cpu, step, 16, 2, seed=0)  # compiled, and learned
  hold = HeldOffThread(placeholder_trace.sync_alone)
  monkeypatch.setattr(placeholder_trace, 'sync_alone', hold)
  steps_complete_while_held(
      cpu, step, hold, lambda: decode_steps(cpu, step, 32, 3, 1, as_view=True))


@pytest.mark.parametrize('held', ['trace', 'compile', 'sync'])
def test_torch_compile_steps_complete_while_a_new_batch_size_compiles(
    patched_bridge, monkeypatch, held):
  # Under torch.compile (apply()'s default mode) a new batch size is a new
  # dynamo graph, whose first signature the graph's first call traces and
  # compiles. Held there, on its thread, it keeps no other thread's steps
  # of the compiled batch size waiting. So does the hand-over's sync of the
  # call's new inputs (a compile of their own), made before execution_lock
  # (see [Note: A hand-over's sync before the lock] in handover_sync.py).
  torch.manual_seed(0)
  cpu = CacheWriter().eval()
  model = CacheWriter().eval().to(torch_xla.device())
  model.load_state_dict(cpu.state_dict())
  # Static sizes: the new batch size's graph takes no call of this one's
  # (a graph with a size symbol would, and those calls would wait for its
  # hand-over under its first-call lock).
  step = torch.compile(model, backend='openxla', dynamic=False)
  decode_steps(cpu, step, 16, 2, seed=0)
  hold = held_on_new_shape(monkeypatch, held)

  def other_batch():
    generator = torch.Generator().manual_seed(3)
    cache_cpu = torch.zeros(16, WIDTH)
    cache = torch.zeros(16, WIDTH, device=torch_xla.device())
    x = torch.randn(6, WIDTH, generator=generator)
    slots = torch.randperm(16, generator=generator)[:6]
    with torch.no_grad():
      got = step(xla(x), xla(slots), cache).cpu()
    return [got], [eager_step(cpu, x, slots, cache_cpu)], cache.cpu(), cache_cpu

  steps_complete_while_held(cpu, step, hold, other_batch)


@pytest.mark.parametrize('mode', ['serve', 'torch.compile'])
def test_a_new_signature_compiles_on_its_arguments_buffers(
    patched_bridge, monkeypatch, mode):
  # torch_xla compiles a graph with an input that holds no buffer (a
  # placeholder) under its device lock, which every run of another thread
  # then waits for holding the GIL. A call's new signature is traced on
  # aliases of its arguments' buffers: every input of its compile holds
  # one. The cache it donates is donated again at its next step, not
  # copied: the aliases left it as given (see [Note: Stand-ins that hold
  # buffers] in placeholder_trace.py).
  import torch_xla.debug.metrics as met
  from torch_xla_patches.counters import COUNTER_DONATION_COPIED_READ
  monkeypatch.setattr(config, 'trace_on_buffer_aliases', True)
  cpu, step = compiled_writer(mode)
  decode_steps(cpu, step, 16, 2, seed=0)
  compile_graph = compile_window.compile_graph
  inputs_without_buffer = []

  def compile_and_look(graph_tensors):
    _, values = torch_xla._XLAC._get_tensors_xla_device_data_node(
        list(graph_tensors))
    inputs_without_buffer.append(
        sum('Data Handle: None' in torch_xla._XLAC._get_xla_tensor_debug_info(
            value) for value in values))
    return compile_graph(graph_tensors)

  monkeypatch.setattr(compile_window, 'compile_graph', compile_and_look)
  copied = met.counter_value(COUNTER_DONATION_COPIED_READ) or 0
  check_steps(decode_steps(cpu, step, 32, 3, 1))
  assert inputs_without_buffer and set(inputs_without_buffer) == {0}, (
      inputs_without_buffer)
  assert (met.counter_value(COUNTER_DONATION_COPIED_READ) or 0) == copied


@pytest.mark.parametrize('mode', ['serve', 'torch.compile'])
def test_a_sync_after_a_trace_on_aliases_leaves_the_arguments_right(
    patched_bridge, monkeypatch, mode):
  # A trace on aliases writes the alias of the cache it donates; torch_xla's
  # sync of every live tensor would hand the buffer an alias names over to
  # that alias. After the new signature is made, a sync and more steps on
  # the same cache give eager's results (see [Note: Stand-ins that hold
  # buffers] in placeholder_trace.py).
  import gc
  monkeypatch.setattr(config, 'trace_on_buffer_aliases', True)
  cpu, step = compiled_writer(mode)
  decode_steps(cpu, step, 16, 1, seed=0)

  def sync_after_the_first(index):
    if index == 0:
      gc.collect()
      torch_xla.sync()

  check_steps(decode_steps(cpu, step, 32, 4, 5,
                           after_step=sync_after_the_first))


def test_a_sync_of_every_tensor_waits_for_traces_on_placeholders(
    patched_bridge, monkeypatch):
  # A placeholder's IR reads a buffer that does not exist: torch_xla.sync(),
  # which runs every live tensor's IR, would run it (the process dies:
  # measured with torch_xla's own sync). Made while the compile of a trace
  # on placeholders is held, it waits for that compile, then syncs (see [Note:
  # Traces on placeholders] in placeholder_trace.py).
  cpu, step = compiled_writer('serve')
  decode_steps(cpu, step, 16, 1, seed=0)
  hold = held_on_new_shape(monkeypatch, 'compile')
  thread, outcome = call_in_thread(lambda: decode_steps(cpu, step, 32, 2, 1),
                                   name='new-shape')
  assert hold.held.wait(FAILURE_BOUND_S)
  pending = xla(torch.ones(3)) * 2
  syncer, synced = call_in_thread(torch_xla.sync, name='syncer')
  hold.release()
  syncer.join()
  thread.join()
  assert 'error' not in synced, synced
  assert 'error' not in outcome, outcome
  check_steps(outcome['result'])
  torch.testing.assert_close(pending.cpu(), torch.full((3,), 2.0))


def test_a_sync_after_a_trace_leaves_flight_finds_no_alias_it_wrote(
    patched_bridge, monkeypatch):
  # The aliases of a trace are released under execution_lock after the
  # trace leaves flight, and a sync of every live tensor may run in
  # between: an alias holding the trace's update of the cache would have
  # the sync hand the cache's buffer over to it. Synced right there (before
  # the release), the new signature's steps still give eager's results.
  cpu, step = compiled_writer('serve')
  decode_steps(cpu, step, 16, 1, seed=0)
  release = placeholder_trace.BufferAliases.release
  synced = []

  def sync_then_release(self, args):
    if not synced:
      synced.append(bool(self.by_position))
      torch_xla.sync()
    return release(self, args)

  monkeypatch.setattr(placeholder_trace.BufferAliases, 'release',
                      sync_then_release)
  check_steps(decode_steps(cpu, step, 32, 3, 1))
  assert synced == [False], 'the aliases were still there at the sync'


def wait_until(condition, what):
  """Polls `condition` until it holds, within FAILURE_BOUND_S (a bound, not
  a wait that decides the outcome)."""
  deadline = time.monotonic() + FAILURE_BOUND_S
  while not condition():
    assert time.monotonic() < deadline, f'timed out waiting until {what}'
    time.sleep(0.01)


def test_a_sync_waiting_for_a_warm_up_never_holds_back_the_compile_it_waits_for(
    patched_bridge, monkeypatch):
  # A warm-up's call of one cache size is in flight (its compile on the
  # pool, held), the next one's is queued behind it on the pool, and a
  # sync comes: it waits for both. The queued trace begins on the compile
  # pool while that sync waits; were it to wait for the sync, the sync
  # would wait for ever for the compile behind it (see [Note: Syncs wait
  # for placeholder graphs] in io_utils.py).
  traces = io_utils.placeholder_traces
  torch.manual_seed(0)
  cpu = CacheWriter().eval()
  model = CacheWriter().eval().to(torch_xla.device())
  model.load_state_dict(cpu.state_dict())
  step = torch.compile(model, backend='openxla', dynamic=True)
  specs = [(TensorSpec((SLOTS, WIDTH)), TensorSpec(
      (SLOTS,), torch.long), TensorSpec((rows, WIDTH))) for rows in (16, 32)]
  hold = held_on_new_shape(monkeypatch, 'compile')
  with torch.no_grad():
    warming, warmed = call_in_thread(
        lambda: torch_xla_patches.precompile(step, specs), name='warm-up')
    assert hold.held.wait(FAILURE_BOUND_S)
    # The first call and its compile, and the second call.
    wait_until(lambda: traces.in_flight() == 3, 'the second call is traced')
    pending = xla(torch.ones(3)) * 2
    syncer, synced = call_in_thread(torch_xla.sync, name='syncer')
    wait_until(lambda: traces.syncs_waiting() == 1, 'the sync waits')
    hold.release()
    syncer.join(FAILURE_BOUND_S)
    warming.join(FAILURE_BOUND_S)
  assert not syncer.is_alive() and not warming.is_alive()
  assert 'error' not in synced, synced
  assert 'error' not in warmed, warmed
  assert traces.in_flight() == 0
  torch.testing.assert_close(pending.cpu(), torch.full((3,), 2.0))
  for rows in (16, 32):
    check_steps(decode_steps(cpu, step, rows, 2, seed=rows))


def test_a_sync_that_waits_too_long_raises_and_runs_nothing(
    patched_bridge, monkeypatch):
  # A trace on placeholders that never ends (here: begun and not ended)
  # makes a sync raise after config.placeholder_wait_timeout, without
  # running the device's pending IR; once it ends, a sync runs it.
  traces = io_utils.placeholder_traces
  monkeypatch.setattr(config, 'placeholder_wait_timeout', 0.2)
  pending = xla(torch.ones(3)) * 2
  traces.begin()
  traces.traced()
  try:
    with pytest.raises(io_utils.PlaceholderWaitTimeout,
                       match='a sync of the device waited 0.2 s for 1 trace'):
      torch_xla.sync()
    assert torch_xla._XLAC._check_tensor_need_materialization([pending
                                                              ]) == [True]
  finally:
    traces.end()
  torch_xla.sync()
  assert torch_xla._XLAC._check_tensor_need_materialization([pending
                                                            ]) == [False]
  torch.testing.assert_close(pending.cpu(), torch.full((3,), 2.0))


def test_revert_takes_the_sync_guard_away(patched_bridge):
  xlac = torch_xla._XLAC
  guarded = xlac._xla_step_marker
  assert io_utils.placeholder_traces.guarded()
  torch_xla_patches.revert()
  try:
    assert xlac._xla_step_marker is not guarded
    assert not io_utils.placeholder_traces.guarded()
  finally:
    torch_xla_patches.apply()
  assert io_utils.placeholder_traces.guarded()


def test_a_donor_mark_held_by_two_traces_stays_until_both_let_go():
  """Two traces that donate one buffer at once each hold its donor mark
  until their compile is done (see [Note: Donor marks held by traces] in
  donation.py): a trace that cleared it under the other changed the other's
  program, which no entry then named."""
  marks = donation.DonorMarks()
  buffer = xla(torch.zeros(4))
  torch_xla.sync()
  alias = torch_xla._XLAC._get_tensors_xla_device_data_node([buffer])[1][0]
  first, second = marks.hold(buffer), marks.hold(alias)
  assert first.handle == second.handle and marks.held() == 1
  marks.let_go(first)
  assert torch_xla._XLAC._get_buffer_donation(buffer)
  marks.let_go(second)
  assert not torch_xla._XLAC._get_buffer_donation(buffer)
  assert marks.held() == 0


def test_donor_aliasing_stays_on_until_its_last_user_leaves():
  """torch_xla's alias-with-buffer-donor flag is process-wide: one compile
  that ends must leave it on for a compile still in flight on another
  thread (alias_with_buffer_donor_config puts back what it found)."""
  aliasing = torch_xla._XLAC._xla_get_enable_alias_with_buffer_donor_config
  assert not aliasing()
  inside, leave = threading.Event(), threading.Event()
  seen = []

  def other_compile():
    with donation.donor_aliasing():
      inside.set()
      leave.wait(FAILURE_BOUND_S)
      seen.append(aliasing())

  thread = threading.Thread(target=other_compile)
  with donation.donor_aliasing():
    thread.start()
    assert inside.wait(FAILURE_BOUND_S)
  assert aliasing()
  leave.set()
  thread.join(FAILURE_BOUND_S)
  assert seen == [True] and not aliasing()


def test_a_pending_argument_takes_its_synced_twin_unless_updated_since():
  # [Note: A hand-over's sync before the lock]: the twin is synced, not the
  # argument; the argument takes the twin's data only if its value is still
  # the one the twin was made from.
  import torch_xla.debug.metrics as met
  base = xla(torch.arange(12.).reshape(3, 4))
  torch_xla.sync()
  kept, updated = base * 2 + 1, base - 3
  twins = handover_sync.pending_twins([kept, updated])
  assert [twin.tensor is t for twin, t in zip(twins, [kept, updated])
         ] == [True, True]
  updated.mul_(10)
  execution.sync_pending([twin.twin for twin in twins])
  assert torch_xla._XLAC._check_tensor_need_materialization([kept, updated
                                                            ]) == [True, True]
  handover_sync.take_twins(twins)
  assert torch_xla._XLAC._check_tensor_need_materialization([kept, updated
                                                            ]) == [False, True]
  met.clear_all()
  torch.testing.assert_close(kept.cpu(),
                             torch.arange(12.).reshape(3, 4) * 2 + 1)
  # The twin's program computed `kept`: reading it runs nothing.
  assert met.metric_data('ExecuteTime') is None
  torch.testing.assert_close(updated.cpu(),
                             (torch.arange(12.).reshape(3, 4) - 3) * 10)


def scaled_sum(x, w):
  return torch.tanh(x @ w).sum(dim=0) + x.shape[0]


def recorded_beside_served_steps(monkeypatch, tmp_path):
  """scaled_sum's sizes 3 and 5 recorded in an index in `tmp_path`, dynamo
  reset (a restart's new graph), and a decode step served on this thread:
  (w, cpu model, step)."""
  monkeypatch.setattr(config, 'cache_dir', str(tmp_path))
  w = torch.randn(8, 4)
  serve_fresh(scaled_sum, [3, 5], w)
  signature_index.flush_all_usage()
  torch._dynamo.reset()
  cpu, step = compiled_writer('torch.compile')
  decode_steps(cpu, step, 16, 2, seed=0)
  return w, cpu, step


def test_a_graph_handed_over_beside_served_calls_replays_on_the_pool(
    patched_bridge, monkeypatch, tmp_path):
  # [Note: Replays beside served calls]: a restart's new graph (here
  # scaled_sum, its sizes 3 and 5 recorded) handed over on one thread while
  # another thread serves another graph (the decode steps) replays its
  # recorded size on the compile pool, not under execution_lock in its
  # first call: held there, the first call of size 3 returns and the other
  # thread's steps complete; once let go, size 5 is a hit.
  import torch_xla.debug.metrics as met
  w, cpu, step = recorded_beside_served_steps(monkeypatch, tmp_path)

  submit = signature_cache.SignatureCache._submit
  hold = HeldOffThread(lambda make_entry: make_entry())

  def submit_held(cache, key, signature, made, work, make_entry):
    if cache._replays_beside:  # pylint: disable=protected-access
      return submit(cache, key, signature, made, work, lambda: hold(make_entry))
    return submit(cache, key, signature, made, work, make_entry)

  monkeypatch.setattr(signature_cache.SignatureCache, '_submit', submit_held)
  met.clear_all()
  compiled = torch.compile(scaled_sum, backend='openxla', dynamic=True)
  thread, outcome = call_in_thread(
      lambda: serve_sizes(compiled, scaled_sum, [3], w), name='new-graph')
  assert hold.held.wait(FAILURE_BOUND_S)
  thread.join(FAILURE_BOUND_S)
  assert not thread.is_alive() and outcome == {'result': None}, outcome
  check_steps(decode_steps(cpu, step, 16, 5, seed=2))
  hold.release()
  compile_window.compile_pool().wait_running(FAILURE_BOUND_S)
  assert hold.released_in_time
  assert met.counter_value(backlog.COUNTER_PRECOMPILED) == 1
  misses = met.counter_value('DynamoSignatureMiss')
  serve_sizes(compiled, scaled_sum, [5], w)
  assert met.counter_value('DynamoSignatureMiss') == misses


def test_a_replay_beside_served_calls_that_raises_fails_no_call(
    patched_bridge, monkeypatch, tmp_path, caplog):
  # [Note: Replays beside served calls]: the replay of size 5 raises on the
  # compile pool while a call of size 5 waits for it; that call compiles
  # the signature itself and answers, and the failure is logged.
  import torch_xla.debug.metrics as met
  w, cpu, step = recorded_beside_served_steps(monkeypatch, tmp_path)

  def broken_replay():
    raise RuntimeError('a broken replay')

  submit = signature_cache.SignatureCache._submit
  hold = HeldOffThread(broken_replay)

  def submit_broken(cache, key, signature, made, work, make_entry):
    if cache._replays_beside:  # pylint: disable=protected-access
      return submit(cache, key, signature, made, work, hold)
    return submit(cache, key, signature, made, work, make_entry)

  monkeypatch.setattr(signature_cache.SignatureCache, '_submit', submit_broken)
  compiled = torch.compile(scaled_sum, backend='openxla', dynamic=True)
  thread, outcome = call_in_thread(
      lambda: serve_sizes(compiled, scaled_sum, [3], w), name='new-graph')
  assert hold.held.wait(FAILURE_BOUND_S)
  thread.join(FAILURE_BOUND_S)
  assert outcome == {'result': None}, outcome
  # The call of size 5 waits for the replay's future, then it raises.
  entered = threading.Event()
  real_wait = concurrent.futures.wait

  def noted_wait(futures, *args, **kwargs):
    if threading.current_thread().name == 'size-5':
      entered.set()
    return real_wait(futures, *args, **kwargs)

  monkeypatch.setattr(concurrent.futures, 'wait', noted_wait)
  met.clear_all()
  waiting, waited = call_in_thread(
      lambda: serve_sizes(compiled, scaled_sum, [5], w), name='size-5')
  assert entered.wait(FAILURE_BOUND_S)
  hold.release()
  waiting.join(FAILURE_BOUND_S)
  assert waited == {'result': None}, waited
  assert hold.released_in_time
  assert met.counter_value('DynamoSignatureMiss') == 1
  assert any('a broken replay' in r.getMessage() for r in caplog.records)

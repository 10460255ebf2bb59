"""A bucket the first capture's guards refuse gets a capture of its own,
kept in the artifact (see [Note: One capture per guard set] in
serving.py)."""
import dataclasses
import hashlib
import os
import pickle
import threading
import time

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from torch_xla_patches import (TensorSpec, artifact, config, execution,
                               fast_dispatch, serializable_backend,
                               serialization, serving, warmup)
from bridge_testing import errors_at_once, run_reports
from served_modules import PromptOrStep

pytestmark = pytest.mark.requires('torch_aot_compile')

WIDTH = 8
PROMPT, STEP = (2, 4, WIDTH), (2, 1, WIDTH)
BUCKETS = [(TensorSpec(PROMPT, torch.float32),),
           (TensorSpec(STEP, torch.float32),)]


def counter(name):
  return met.counter_value(name) or 0


def models():
  torch.manual_seed(0)
  cpu = PromptOrStep(WIDTH).eval()
  model = PromptOrStep(WIDTH).eval().to(torch_xla.device())
  model.load_state_dict(cpu.state_dict())
  return cpu, model


def check(served, cpu, shape):
  x = torch.randn(*shape)
  with torch.no_grad():
    expected = cpu(x)
  torch.testing.assert_close(served(x.to(torch_xla.device())).cpu(), expected)


def recorded_captures(monkeypatch):
  """The (first argument's shape, static) of each capture serve() makes."""
  capture = serving._capture
  shapes = []

  def recorded_capture(model, key, args, kwargs, static=False):
    shapes.append((tuple(args[0].shape), static))
    return capture(model, key, args, kwargs, static)

  monkeypatch.setattr(serving, '_capture', recorded_capture)
  return shapes


def check_served_again(served, cpu, rounds=1):
  """Both buckets, `rounds` times, equal to eager, none traced again."""
  for _ in range(rounds):
    check(served, cpu, PROMPT)
    check(served, cpu, STEP)
  assert counter(fast_dispatch.COUNTER_RETRACE) == 0


def test_a_step_bucket_is_captured_once_and_served_fast(patched_bridge):
  cpu, model = models()
  served = torch_xla_patches.serve(model, BUCKETS, wait=True)
  # The warm-up's call of the step bucket made the second capture.
  assert len(served.captures()) == 2
  assert counter(fast_dispatch.COUNTER_CAPTURED_AGAIN) == 1
  for _ in range(3):
    check(served, cpu, PROMPT)
    check(served, cpu, STEP)
  # The first call of each bucket takes the full path; the rest are fast,
  # the steps on the second capture. Nothing is traced again.
  assert served.fast_calls == 4
  assert served.calls.fast_calls == 2
  assert counter(fast_dispatch.COUNTER_CAPTURED_AGAIN) == 1
  assert counter(fast_dispatch.COUNTER_RETRACE) == 0
  # Other sizes go to the capture whose guards accept them.
  check(served, cpu, (3, 7, WIDTH))
  check(served, cpu, (5, 1, WIDTH))
  assert len(served.captures()) == 2


def test_threads_make_one_capture(patched_bridge):
  cpu, model = models()
  served = torch_xla_patches.serve(model, BUCKETS[:1], wait=True)
  assert errors_at_once(lambda: check(served, cpu, STEP), threads=4) == []
  assert len(served.captures()) == 2
  assert counter(fast_dispatch.COUNTER_CAPTURED_AGAIN) == 1


RESTART_SCRIPT = '''
import json, sys
sys.path.insert(0, {test_dir!r})
import torch, torch_xla
from torch._dynamo.utils import counters
import torch_xla_patches
import test_serve_captures as t
cpu, model = t.models()
served = torch_xla_patches.serve(model, t.BUCKETS, cache_dir={cache_dir!r},
                                 wait=True)
frames = counters['stats']['unique_graphs']
for shape in (t.PROMPT, t.STEP, t.STEP):
  t.check(served, cpu, shape)
print(json.dumps(dict(loaded=served.loaded, captures=len(served.captures()),
                      frames=frames,
                      frames_after_calls=counters['stats']['unique_graphs'],
                      fast=served.fast_calls)))
'''


def test_a_restart_loads_every_capture(tmp_path):
  code = RESTART_SCRIPT.format(test_dir=os.path.dirname(
      os.path.abspath(__file__)),
                               cache_dir=str(tmp_path))
  first, restart = run_reports(code)
  assert (first['loaded'], first['captures'], first['frames']) == (False, 2, 2)
  # Both captures come from the artifact: no dynamo frame at all.
  assert restart == dict(loaded=True,
                         captures=2,
                         frames=0,
                         frames_after_calls=0,
                         fast=1)
  (name,) = os.listdir(tmp_path / 'serve')
  path = str(tmp_path / 'serve' / name)
  header, payload = artifact.read_header(path)
  assert header.captures == 2
  # load() serves one capture; it says where the artifact belongs.
  _, model = models()
  with pytest.raises(artifact.ArtifactMismatchError,
                     match='holds 2 captures of the model.*serve\\(\\) loads '
                     'it'):
    serialization.load(path, model=model, precompile=False)
  # A header whose count disagrees with its payload is a damaged file: a
  # reason to trace, never a failure of serve().
  damaged = str(tmp_path / 'damaged.xla_aot')
  artifact.write(damaged, header.__class__(**{
      **header.__dict__, 'captures': 3
  }), payload)
  loaded = serialization.try_load(damaged, model, serve_key=None)
  assert loaded.captures == ()
  assert 'ArtifactCorruptError' in loaded.reason
  assert 'expected 3 captures' in loaded.reason


RESTART_WARM_UP_SCRIPT = '''
import json, sys
sys.path.insert(0, {test_dir!r})
import torch, torch_xla
import torch_xla_patches
from torch_xla_patches import config, warmup
import test_serve_captures as t
config.serve_capture_delay = 3600.0
# Whether the warm-up's gate was open as it began each bucket's call.
gate_open_at_starts = []
start = warmup.BackgroundWarmUp._start

def noted_start(self, *args, **kwargs):
  gate_open_at_starts.append(self.gate.is_open)
  return start(self, *args, **kwargs)

warmup.BackgroundWarmUp._start = noted_start
torch_xla_patches.apply()
cpu, model = t.models()
served = torch_xla_patches.serve(model, t.BUCKETS, cache_dir={cache_dir!r},
                                 wait=not {restart!r})
t.check(served, cpu, t.PROMPT)
assert served.wait_ready(timeout=300)
t.check(served, cpu, t.STEP)
print(json.dumps(dict(loaded=served.loaded,
                      ready=served.readiness().ready,
                      gate_open_at_starts=gate_open_at_starts)))
'''


def test_a_restarts_warm_up_waits_for_the_first_request(tmp_path):
  # See [Note: Captures after the first request] in warmup.py: a restart's
  # warm-up compiled every bucket in front of the first request, whose
  # syncs waited for those compiles.
  reports = []
  for restart in (False, True):
    reports += run_reports(RESTART_WARM_UP_SCRIPT.format(
        test_dir=os.path.dirname(os.path.abspath(__file__)),
        cache_dir=str(tmp_path),
        restart=restart),
                           processes=1)
  first, restart = reports
  assert (first['loaded'], first['ready']) == (False, 2)
  # Its gate opened when the first request was answered, before any bucket.
  assert restart == dict(loaded=True, ready=2, gate_open_at_starts=[True, True])


def test_a_first_request_waits_for_its_own_capture_alone(
    patched_bridge, monkeypatch):
  # See [Note: The first capture] in serving.py: serve() in the background
  # captures nothing before it returns, and the first request's call is the
  # first captured, not the bucket serve(wait=True) captures first (the
  # prompt, whose guards refuse a step).
  monkeypatch.setattr(config, 'serve_capture_delay', 3600.0)
  shapes = recorded_captures(monkeypatch)
  cpu, model = models()
  served = torch_xla_patches.serve(model, BUCKETS, wait=False)
  assert shapes == []
  assert served.captures() == [] and served.calls is None
  check(served, cpu, STEP)
  # Its answer opens the warm-up's gate: the prompt's capture may follow.
  # With its sizes as they are, as torch.compile's first trace.
  assert shapes[0] == (STEP, True)
  assert served.wait_ready(timeout=120)
  # The warm-up makes the captures with dynamic sizes its buckets need, as
  # if the static one were not there: the example first.
  assert shapes == [(STEP, True), (PROMPT, False), (STEP, False)]
  assert len(served.captures()) == 3
  assert counter(fast_dispatch.COUNTER_CAPTURED_AGAIN) == 2
  check_served_again(served, cpu, rounds=2)


def test_a_first_capture_that_cannot_be_made_serves_with_torch_compile(
    patched_bridge, monkeypatch):
  # Where the first request's capture fails, torch.compile serves every
  # call, as serve(wait=True) serves a model it cannot capture.
  monkeypatch.setattr(config, 'serve_capture_delay', 3600.0)
  attempts = []

  def failing_capture(model, key, args, kwargs, static=False):
    attempts.append(1)
    return None

  monkeypatch.setattr(serving, '_capture', failing_capture)
  cpu, model = models()
  served = torch_xla_patches.serve(model, BUCKETS, wait=False)
  check(served, cpu, STEP)
  assert attempts == [1]
  assert served.captures() == [] and served.calls is None
  assert served.wait_ready(timeout=120)
  for _ in range(2):
    check(served, cpu, PROMPT)
    check(served, cpu, STEP)
  # Tried once: the calls after it go to torch.compile.
  assert attempts == [1]
  assert served.readiness() == warmup.Readiness(ready=2, total=2, failed=())


def test_a_first_request_is_answered_while_another_buckets_capture_is_held(
    patched_bridge, monkeypatch):
  # See [Note: Captures after the first request] in warmup.py. The step
  # bucket's capture, once it starts, holds the bridge's lock until the test
  # lets it go: a request behind it would wait as long.
  monkeypatch.setattr(config, 'serve_capture_delay', 3600.0)
  capture = serving._capture
  captures_made = []
  held, release = threading.Event(), threading.Event()

  def held_capture(*args, **kwargs):
    captures_made.append(len(captures_made))
    if len(captures_made) > 1:
      with execution.execution_lock:
        held.set()
        release.wait()
    return capture(*args, **kwargs)

  monkeypatch.setattr(serving, '_capture', held_capture)
  cpu, model = models()
  served = torch_xla_patches.serve(model, BUCKETS, wait=False)
  request = threading.Thread(target=check, args=(served, cpu, PROMPT))
  try:
    request.start()
    # A bound, not a wait that decides: on the old order the request waits
    # until the held capture is let go, which only happens below.
    request.join(timeout=120)
    answered_first = not request.is_alive()
    assert not release.is_set()
  finally:
    release.set()
  request.join()
  assert answered_first
  assert held.wait(timeout=120)
  assert served.wait_ready(timeout=120)
  # The request's, with static sizes, and the two the buckets need.
  assert len(served.captures()) == 3
  check_served_again(served, cpu)


def test_with_no_request_the_warm_up_captures_after_its_delay(
    patched_bridge, monkeypatch):
  monkeypatch.setattr(config, 'serve_capture_delay', 0.0)
  cpu, model = models()
  served = torch_xla_patches.serve(model, BUCKETS, wait=False)
  # Polled, not waited for with wait_ready(), which would open the gate.
  deadline = time.monotonic() + 120
  while not served.readiness().done and time.monotonic() < deadline:
    time.sleep(0.05)
  assert served.readiness() == warmup.Readiness(ready=2, total=2, failed=())
  assert len(served.captures()) == 2
  check(served, cpu, STEP)


def test_a_first_request_that_needs_a_capture_makes_it_once(
    patched_bridge, monkeypatch):
  monkeypatch.setattr(config, 'serve_capture_delay', 3600.0)
  cpu, model = models()
  shapes = recorded_captures(monkeypatch)
  served = torch_xla_patches.serve(model, BUCKETS, wait=False)
  # The first request's capture (static sizes), then the step's own capture,
  # made by the second request or by the warm-up (its gate is open), once.
  check(served, cpu, PROMPT)
  check(served, cpu, STEP)
  assert served.wait_ready(timeout=120)
  assert sorted(shapes) == sorted([(PROMPT, True), (PROMPT, False),
                                   (STEP, False)])
  assert len(served.captures()) == 3
  assert counter(fast_dispatch.COUNTER_CAPTURED_AGAIN) == 2
  check(served, cpu, PROMPT)


def serve_again(model, cache_dir, monkeypatch, wait, capture_delay=3600.0):
  """(served, the shapes of the captures it makes): serve() on a cache
  directory a first start wrote."""
  monkeypatch.setattr(config, 'serve_capture_delay', capture_delay)
  shapes = recorded_captures(monkeypatch)
  served = torch_xla_patches.serve(model,
                                   BUCKETS,
                                   cache_dir=cache_dir,
                                   wait=wait)
  return served, shapes


def test_a_restart_loads_its_later_captures_as_calls_need_them(
    patched_bridge, tmp_path, monkeypatch):
  # See [Note: A restart's captures, one at a time] in serving.py.
  cpu, model = models()
  first = torch_xla_patches.serve(model, BUCKETS, cache_dir=tmp_path, wait=True)
  assert (first.loaded, len(first.captures())) == (False, 2)
  in_background = []
  flag = serializable_backend.XlaSerializableCallable.compile_in_background

  def noted_flag(callable_):
    in_background.append(callable_)
    flag(callable_)

  monkeypatch.setattr(serializable_backend.XlaSerializableCallable,
                      'compile_in_background', noted_flag)
  restart, shapes = serve_again(model, tmp_path, monkeypatch, wait=False)
  # serve() returned with the first capture (the prompt's) loaded.
  assert (restart.loaded, len(restart.captures()),
          restart.pending_captures) == (True, 1, 1)
  # A step, which the first capture's guards refuse, loads the second on its
  # own thread: nothing is captured again.
  check(restart, cpu, STEP)
  assert (len(restart.captures()), restart.pending_captures) == (2, 0)
  # The second's first call compiled in the background, as the first's did
  # (see [Note: Ready at once] in serving.py).
  assert in_background == [c.backend_callable for c in restart.captures()]
  check(restart, cpu, PROMPT)
  check(restart, cpu, STEP)
  assert restart.wait_ready(timeout=300)
  assert shapes == []
  assert counter(fast_dispatch.COUNTER_CAPTURED_AGAIN) == 1
  assert counter(fast_dispatch.COUNTER_RETRACE) == 0


def test_a_later_capture_that_does_not_load_is_captured_again(
    patched_bridge, tmp_path, monkeypatch, caplog):
  cpu, model = models()
  torch_xla_patches.serve(model, BUCKETS, cache_dir=tmp_path, wait=True)
  deserialize = serializable_backend.deserialize_aot
  loads = []

  def second_does_not_load(data):
    loads.append(len(data))
    if len(loads) == 2:
      raise pickle.UnpicklingError('a damaged capture')
    return deserialize(data)

  monkeypatch.setattr(serializable_backend, 'deserialize_aot',
                      second_does_not_load)
  restart, shapes = serve_again(model, tmp_path, monkeypatch, wait=False)
  assert (restart.loaded, restart.pending_captures) == (True, 1)
  with caplog.at_level('WARNING', logger='torch_xla_patches.serving'):
    check(restart, cpu, STEP)
  assert ('ArtifactCorruptError: torch_xla_patches: artifact '
          f'{restart.artifact} does not unpickle: capture 1: a damaged '
          'capture; 0 later captures are left too') in caplog.text
  # The step was captured again, and is served from that capture.
  assert shapes == [(STEP, False)]
  assert (len(restart.captures()), restart.pending_captures) == (2, 0)
  check(restart, cpu, STEP)
  check(restart, cpu, PROMPT)
  assert counter(fast_dispatch.COUNTER_RETRACE) == 0


@pytest.mark.parametrize('wait', [False, True])
def test_a_bucket_the_artifacts_captures_refuse_is_captured_again(
    patched_bridge, tmp_path, monkeypatch, wait):
  cpu, model = models()
  first = torch_xla_patches.serve(model, BUCKETS, cache_dir=tmp_path, wait=True)
  # The artifact with the prompt's capture alone, its key kept.
  header, payload = artifact.read_header(first.artifact)
  (prompt_capture, _) = pickle.loads(payload)
  artifact.write(
      first.artifact,
      dataclasses.replace(
          header,
          captures=1,
          payload_sha256=hashlib.sha256(prompt_capture).hexdigest(),
          payload_size=len(prompt_capture)), prompt_capture)

  def ready_restart():
    served, shapes = serve_again(model,
                                 tmp_path,
                                 monkeypatch,
                                 wait=wait,
                                 capture_delay=0.0)
    assert served.wait_ready(timeout=300)
    return served, shapes

  restart, shapes = ready_restart()
  if wait:
    # Every capture is checked against the buckets first: the artifact is
    # traced again and replaced.
    assert restart.loaded is False
    assert shapes == [(PROMPT, False), (STEP, False)]
  else:
    # The warm-up's call of the step captured it again, and the artifact
    # was written again with both captures.
    assert restart.loaded is True
    assert shapes == [(STEP, False)]
    assert restart.captures_made == 1
  assert len(restart.captures()) == 2
  check_served_again(restart, cpu)
  header, _ = artifact.read_header(first.artifact)
  assert header.captures == 2
  # The next restart captures nothing: both buckets are the artifact's.
  again, shapes = ready_restart()
  assert (again.loaded, shapes, again.captures_made,
          len(again.captures())) == (True, [], 0, 2)
  check_served_again(again, cpu)

"""What makes a program runs off the request path: while one thread's new
shape compiles (a donating program among them) or is captured, another
thread's calls of compiled programs complete (see [Note: Donors traced on
stand-ins] in tracing.py and [Note: Compiles outside the lock] in
signature_cache.py)."""
import threading

import pytest
import torch
import torch_xla

import torch_xla_patches
from torch_xla_patches import TensorSpec, compile_window, config

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


class HeldOnThread:
  """Wraps `function` so that its call on the thread named `name` stops
  until `release()`: `held` is set once it is stopped there, and
  `released_in_time` says whether release() came before FAILURE_BOUND_S."""

  def __init__(self, function, name):
    self._function = function
    self._name = name
    self.held = threading.Event()
    self._released = threading.Event()
    self.released_in_time = None

  def release(self):
    self._released.set()

  def __call__(self, *args, **kwargs):
    if threading.current_thread().name == self._name and not self.held.is_set():
      self.held.set()
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


def decode_steps(cpu, step, rows, count, seed):
  """`count` steps on a cache of `rows` rows, on the device and on the CPU;
  the outputs of both."""
  generator = torch.Generator().manual_seed(seed)
  cache_cpu = torch.zeros(rows, WIDTH)
  cache = torch.zeros(rows, WIDTH, device=torch_xla.device())
  got, want = [], []
  for _ in range(count):
    x = torch.randn(SLOTS, WIDTH, generator=generator)
    slots = torch.randperm(rows, generator=generator)[:SLOTS]
    with torch.no_grad():
      got.append(step(xla(x), xla(slots), cache).cpu())
    want.append(eager_step(cpu, x, slots, cache_cpu))
  return got, want, cache.cpu(), cache_cpu


@pytest.mark.parametrize('mode', ['serve', 'torch.compile'])
def test_calls_complete_while_a_donating_program_compiles(
    patched_bridge, monkeypatch, mode):
  # A new cache size is a new signature of a program that updates its
  # cache in place and takes its buffer over. Its XLA compile is held on
  # the thread that asked for it; meanwhile this thread's steps of the
  # compiled size run, on their own cache, to the end. The donated
  # argument was traced on a stand-in, so no lock was held while it
  # compiled (see [Note: Donors traced on stand-ins] in tracing.py).
  assert config.donor_stand_ins
  cpu, step = compiled_writer(mode)
  decode_steps(cpu, step, 16, 2, seed=0)  # compiled, and learned
  held = HeldOnThread(compile_window.compile_graph, 'new-shape')
  monkeypatch.setattr(compile_window, 'compile_graph', held)
  thread, outcome = call_in_thread(lambda: decode_steps(cpu, step, 32, 3, 1),
                                   name='new-shape')
  assert held.held.wait(FAILURE_BOUND_S)
  got, want, cache, cache_cpu = decode_steps(cpu, step, 16, 5, seed=2)
  held.release()
  thread.join()
  assert held.released_in_time
  for g, w in zip(got, want):
    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
  torch.testing.assert_close(cache, cache_cpu, rtol=1e-4, atol=1e-4)
  assert 'error' not in outcome, outcome
  got, want, cache, cache_cpu = outcome['result']
  for g, w in zip(got, want):
    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
  torch.testing.assert_close(cache, cache_cpu, rtol=1e-4, atol=1e-4)

"""Buffer donation of in-place updates (see [Note: Donating in-place
updates]): results equal eager, every case that must copy copies and is
counted, donating and copying programs are different programs, and restarts
and evictions still donate."""
import os

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from hypothesis import given, strategies as st

import torch_xla_patches
from bridge_testing import cpu_and_xla, run_counters, run_reports
from torch_xla_patches import (CallSpec, TensorSpec, bound_program, config,
                               donation, signature_cache)
from torch_xla_patches import counters as bridge_counters


@pytest.fixture(autouse=True, params=['native', 'python twins'])
def per_call_work(request, monkeypatch):
  """Every test twice: the donated buffers' bookkeeping in the native module
  and in its Python twins (here and in the processes a test starts)."""
  from torch_xla_patches import native
  if request.param == 'native' and native.loaded() is None:
    pytest.skip(f'no native module: {native.unavailable_reason}')
  if request.param == 'python twins':
    monkeypatch.setattr(config, 'native_fast_path', False)
    monkeypatch.setenv('XLA_PATCHES_NATIVE', '0')


DONATION_COUNTERS = (bridge_counters.COUNTER_DONATED,
                     bridge_counters.COUNTER_DONATION_VIEW,
                     bridge_counters.COUNTER_DONATION_ALIAS,
                     bridge_counters.COUNTER_DONATION_SMALL,
                     bridge_counters.COUNTER_DONATION_COPIED,
                     bridge_counters.COUNTER_DONATION_COPIED_READ,
                     bridge_counters.COUNTER_DONATION_EPILOGUE,
                     bridge_counters.COUNTER_DONATION_FALLBACK)


def donation_counters(since=None):
  """The donation counters that are not 0, less their values in `since`."""
  since = since or {}
  counts = {
      name: (met.counter_value(name) or 0) - since.get(name, 0)
      for name in DONATION_COUNTERS
  }
  return {name: count for name, count in counts.items() if count}


def xla(tensor):
  return tensor.to(torch_xla.device())


def write_rows(cache, slots, values):
  cache.index_copy_(0, slots, values)
  return values.sum(dim=1) * 2


def steps(compiled, rows, calls=3, width=8, seed=0, before_call=None):
  """Runs `compiled` like write_rows on an XLA cache and a CPU one; returns
  both caches and the last results."""
  generator = torch.Generator().manual_seed(seed)
  cache, expected = xla(torch.zeros(rows, width)), torch.zeros(rows, width)
  for call in range(calls):
    slots = torch.randperm(rows, generator=generator)[:2]
    values = torch.randn(2, width, generator=generator)
    if before_call is not None:
      before_call(call, cache)
    got = compiled(cache, xla(slots), xla(values))
    want = write_rows(expected, slots, values)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(cache.cpu(), expected)
  return cache, expected


def test_an_argument_updated_in_place_is_donated(patched_bridge):
  compiled = torch.compile(write_rows, backend='openxla', dynamic=True)
  synced_before = readers_synced()
  steps(compiled, rows=16)
  steps(compiled, rows=24)
  # One donated argument per traced signature. Each cache was moved to the
  # device with `to`, which reads as read: its first run takes a private
  # copy. The graph updates the cache itself (AOTAutograd keeps an inference
  # graph's updates in it), so every later run donates the buffer the last
  # one gave, with no look at the rest of the device.
  assert donation_counters() == {
      bridge_counters.COUNTER_DONATED: 2,
      bridge_counters.COUNTER_DONATION_COPIED_READ: 2
  }
  assert readers_synced() == synced_before


def test_views_aliases_and_pending_readers_see_what_eager_sees(patched_bridge):
  compiled = torch.compile(write_rows, backend='openxla', dynamic=True)
  seen = {}

  def keep_readers(call, cache):
    # A view, an alias and a lazy value read before the call.
    seen[call] = (cache[:4], cache.detach(), cache * 1, cache.cpu())

  synced_before = readers_synced()
  cache, expected = steps(compiled, rows=16, before_call=keep_readers)
  view, alias, _, _ = seen[2]
  torch.testing.assert_close(view.cpu(), expected[:4])
  torch.testing.assert_close(alias.cpu(), expected)
  # Each pending value kept the buffer it read.
  for _, _, pending, before in seen.values():
    torch.testing.assert_close(pending.cpu(), before)
  # The readers made before the second and third calls were reads: each of
  # those runs took a private copy. Before the first call, `cache.cpu()`
  # made the cache, moved to the device with `to`, hold its data without
  # IR while the first pending value read it: data the caller set, which
  # the first run copied too, syncing nothing but its own arguments.
  assert donation_counters() == {
      bridge_counters.COUNTER_DONATED: 1,
      bridge_counters.COUNTER_DONATION_COPIED_READ: 3
  }
  assert readers_synced() == synced_before


def test_a_view_argument_is_copied_and_counted(patched_bridge):
  compiled = torch.compile(write_rows, backend='openxla', dynamic=True)
  base, expected = xla(torch.zeros(16, 8)), torch.zeros(16, 8)
  view = base[:8]
  for seed in range(2):
    slots, values = torch.tensor([seed, 5]), torch.randn(2, 8)
    got = compiled(view, xla(slots), xla(values))
    want = write_rows(expected[:8], slots, values)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(base.cpu(), expected)
  counts = donation_counters()
  assert bridge_counters.COUNTER_DONATED not in counts, counts
  assert counts[bridge_counters.COUNTER_DONATION_VIEW] == 1, counts


def test_the_same_tensor_passed_twice(patched_bridge):

  def write_and_read(cache, other, slots, values):
    cache.index_copy_(0, slots, values)
    return other.sum(dim=1)

  compiled = torch.compile(write_and_read, backend='openxla', dynamic=True)
  cache, expected = xla(torch.zeros(16, 8)), torch.zeros(16, 8)
  for seed in range(2):
    slots, values = torch.tensor([seed, 9]), torch.randn(2, 8)
    got = compiled(cache, cache, xla(slots), xla(values))
    want = write_and_read(expected, expected, slots, values)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(cache.cpu(), expected)


class RunningTotal(torch.nn.Module):
  """A buffer updated in place on every call."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(8, 8)
    self.register_buffer('total', torch.zeros(8))

  def forward(self, x):
    y = self.proj(x)
    self.total.add_(y.sum(dim=0))
    return y


def test_a_buffer_updated_in_place_is_donated(patched_bridge):
  cpu, model = cpu_and_xla(RunningTotal)
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  with torch.no_grad():
    for batch in (2, 3, 2):
      x = torch.randn(batch, 8)
      torch.testing.assert_close(compiled(xla(x)).cpu(), cpu(x))
      torch.testing.assert_close(model.total.cpu(), cpu.total)
  # The buffer moved to the device with `to` read as read: the first run
  # took a private copy; every later one donated the buffer the last gave.
  assert donation_counters() == {
      bridge_counters.COUNTER_DONATED: 2,
      bridge_counters.COUNTER_DONATION_COPIED_READ: 1
  }


class StepCounter(torch.nn.Module):
  """A position advanced in place on every call (an 8-byte buffer, as a
  StaticCache's cumulative_length) beside a buffer of 32 bytes."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(8, 8)
    self.register_buffer('position', torch.tensor(0))
    self.register_buffer('total', torch.zeros(8))

  def forward(self, x):
    y = self.proj(x) + self.position
    self.position.add_(1)
    self.total.add_(y.sum(dim=0))
    return y


@pytest.mark.parametrize('min_bytes', [16, 0])
def test_a_small_update_read_between_calls_is_copied_not_donated(
    patched_bridge, monkeypatch, min_bytes):
  monkeypatch.setattr(config, 'donate_min_bytes', min_bytes)
  cpu, model = cpu_and_xla(StepCounter)
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  calls = 4
  with torch.no_grad():
    for batch in (2, 3) * (calls // 2):
      x = torch.randn(batch, 8)
      torch.testing.assert_close(compiled(xla(x)).cpu(), cpu(x))
      # The host builds on the position between calls, as generate() does on
      # a cache's length.
      assert int(model.position + 1) == int(cpu.position) + 1
  torch.testing.assert_close(model.total.cpu(), cpu.total)
  # Two signatures traced. Both buffers came to the device with `to`, read
  # as read: the first run that donates one takes a private copy of it.
  if min_bytes:
    # The position's program writes it anew: nothing to copy when read.
    assert donation_counters() == {
        bridge_counters.COUNTER_DONATED: 2,
        bridge_counters.COUNTER_DONATION_SMALL: 2,
        bridge_counters.COUNTER_DONATION_COPIED_READ: 1
    }
  else:
    # Donated, the position the host built on since the run before is
    # copied at each later run.
    assert donation_counters() == {
        bridge_counters.COUNTER_DONATED: 4,
        bridge_counters.COUNTER_DONATION_COPIED_READ: 1 + (calls - 1)
    }


def test_a_model_that_calls_the_donor_op_keeps_working(patched_bridge):

  def write_with_donor(cache, slots, values):
    torch.ops.xla.dynamo_set_buffer_donor_(cache, True)
    return write_rows(cache, slots, values)

  steps(torch.compile(write_with_donor, backend='openxla', dynamic=True),
        rows=16)


@pytest.mark.parametrize('on_placeholders', [True, False])
def test_a_buffer_the_caller_marked_is_donated_by_a_graph_that_reads_it(
    patched_bridge, monkeypatch, on_placeholders):
  """A donor mark the caller set on an input the graph only reads stays
  through the trace, whether it runs on placeholders or on the arguments:
  the program takes the buffer over, as upstream's bridge compiles it
  (upstream's test_dynamo_aliasing, rendered, failed on the arguments)."""
  monkeypatch.setattr(config, 'trace_on_placeholders', on_placeholders)
  # dynamo keeps the lambda's graph, and XLA the program, of the other
  # parametrization: a size of its own.
  torch._dynamo.reset()
  device = torch_xla.device()
  values = torch.randn(5, 5 if on_placeholders else 6)
  marked = values.to(device)
  # Read before the call, as upstream's test reads it.
  torch.testing.assert_close(marked.cpu(), values)
  assert torch_xla._XLAC._set_buffer_donation(marked, True)
  compiled = torch.compile(lambda x: x + 1, backend='openxla')
  result = compiled(marked)
  torch_xla.sync()
  torch.testing.assert_close(result.cpu(), values + 1)
  assert 'Data Handle: Deleted' in torch_xla._XLAC._get_xla_tensor_debug_info(
      marked)


def test_donating_and_copying_programs_are_different_programs(
    patched_bridge, monkeypatch):
  hashes = []
  for donate in (True, False):
    monkeypatch.setattr(config, 'donate_inplace_updates', donate)
    torch._dynamo.reset()
    compiled = torch.compile(write_rows, backend='openxla', dynamic=True)
    steps(compiled, rows=16, calls=2)
    cache = signature_cache.live_signature_caches()[-1]
    (entry,) = cache.entries.values()
    hashes.append((entry.graph_hash, entry.donated_positions))
  (donating, donated), (copying, none) = hashes
  assert donating != copying
  assert donated and none == ()
  # The index's fingerprint hashes the flag's variable (see [Note: Flags
  # that change programs]).
  assert config.FLAGS['XLA_PATCHES_DONATE'].changes_program


@given(rows=st.integers(4, 48),
       width=st.sampled_from([1, 3, 8]),
       seed=st.integers(0, 2**16))
def test_random_caches_and_positions_equal_eager(rows, width, seed):
  torch_xla_patches.apply()
  compiled = torch.compile(write_rows, backend='openxla', dynamic=True)
  steps(compiled, rows=rows, width=width, seed=seed, calls=2)


SERVED_STEP = '''
import json, sys
sys.path.insert(0, {test_dir!r})
import torch, torch_xla
import torch_xla.debug.metrics as met
from torch._dynamo.utils import counters
import torch_xla_patches
from torch_xla_patches import CallSpec, TensorSpec
from test_donation import LayerCaches
device = torch_xla.device()
torch.manual_seed(0)
cpu = LayerCaches()
model = LayerCaches()
model.load_state_dict(cpu.state_dict())
served = torch_xla_patches.serve(model.to(device), [
    CallSpec(TensorSpec((t, 8)), TensorSpec((t,), torch.long),
             [TensorSpec((32, 8))] * 2) for t in (2, 4)],
    cache_dir={cache_dir!r})
caches = [torch.zeros(32, 8).to(device) for _ in range(2)]
expected = [torch.zeros(32, 8) for _ in range(2)]
worst = 0.0
for step in range(4):
  t = (2, 4, 3, 2)[step]
  x, slots = torch.randn(t, 8), torch.randperm(32)[:t]
  with torch.no_grad():
    want = cpu(x, slots, expected)
  got = served(x.to(device), slots.to(device), caches)
  worst = max([worst, (got.cpu() - want).abs().max().item()] +
              [(c.cpu() - e).abs().max().item()
               for c, e in zip(caches, expected)])
print(json.dumps(dict(loaded=served.loaded, error=worst,
                      frames=counters['stats']['unique_graphs'],
                      donated=met.counter_value('DynamoDonatedInput'))))
'''


class LayerCaches(torch.nn.Module):
  """A decode step writing one cache per layer, the caches a nested
  argument."""

  def __init__(self):
    super().__init__()
    self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

  def forward(self, x, slots, caches):
    for layer, cache in zip(self.layers, caches):
      x = torch.tanh(layer(x))
      cache.index_copy_(0, slots, x)
    return x


@pytest.mark.requires('torch_aot_compile')
def test_a_served_step_donates_its_nested_caches_after_a_restart(tmp_path):
  script = SERVED_STEP.format(test_dir=os.path.dirname(
      os.path.abspath(__file__)),
                              cache_dir=str(tmp_path))
  reports = run_reports(script)
  first, restart = reports
  assert (first['loaded'], restart['loaded']) == (False, True)
  assert restart['frames'] == 0
  for report in reports:
    assert report['error'] < 1e-5, report
    # Two caches donated per compiled signature: 2, 4 and 3 tokens (the
    # restart replays the recorded 3 with the buckets).
    assert report['donated'] == 2 * 3, report


EVICTION_SCRIPT = r'''
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
torch_xla_patches.apply()
device = torch_xla.device()

def write_rows(cache, slots, values):
  cache.index_copy_(0, slots, values)
  return values.sum(dim=1)

compiled = torch.compile(write_rows, backend='openxla', dynamic=True)
cache, expected = torch.zeros(16, 8).to(device), torch.zeros(16, 8)
for round_ in range(2):
  for n in range(1, 7):  # 6 signatures, the cache holds 2 programs
    slots, values = torch.randperm(16)[:n], torch.randn(n, 8)
    got = compiled(cache, slots.to(device), values.to(device)).cpu()
    torch.testing.assert_close(got, write_rows(expected, slots, values))
    torch.testing.assert_close(cache.cpu(), expected)
print('retraces', met.counter_value('DynamoEvictedRetrace'))
print('donated', met.counter_value('DynamoDonatedInput'))
'''


def test_an_evicted_donating_program_is_traced_again_and_still_donates():
  values = run_counters(EVICTION_SCRIPT,
                        env={'XLA_COMPILATION_CACHE_SIZE': '2'})
  assert values['retraces'] >= 6
  # Every trace, first or after an eviction, donates the cache.
  assert values['donated'] == 6 + values['retraces']


@pytest.mark.requires('torch_aot_compile')
def test_a_served_in_place_step_runs_its_bound_program(patched_bridge):
  cpu, model = cpu_and_xla(LayerCaches)
  served = torch_xla_patches.serve(model, [
      CallSpec(TensorSpec((4, 8)), TensorSpec(
          (4,), torch.long), [TensorSpec((32, 8))] * 2)
  ])
  served_at = donation_counters()
  caches = [xla(torch.zeros(32, 8)) for _ in range(2)]
  expected = [torch.zeros(32, 8) for _ in range(2)]
  view = caches[0][:8]
  hits = fast = None
  for step in range(5):
    x, slots = torch.randn(4, 8), torch.randperm(32)[:4]
    with torch.no_grad():
      want = cpu(x, slots, expected)
    got = served(xla(x), xla(slots), caches)
    torch.testing.assert_close(got.cpu(), want)
    for cache, reference in zip(caches, expected):
      torch.testing.assert_close(cache.cpu(), reference)
    torch.testing.assert_close(view.cpu(), expected[0][:8])
    if step == 1:
      hits = met.counter_value(bridge_counters.COUNTER_HIT) or 0
      fast = served.calls.fast_calls
  # The last three calls ran the bound program, each counted as one hit of
  # its signature (see [Note: Bound programs]): nothing ran twice.
  assert served.calls.fast_calls - fast == 3
  assert (met.counter_value(bridge_counters.COUNTER_HIT) or 0) - hits == 3
  # The caches moved to the device with `to` read as read at the first step
  # (2 copies), and the view read after each step reads the first cache
  # (steps 1 to 4).
  assert served_donations(served_at) == {
      bridge_counters.COUNTER_DONATION_COPIED_READ: 2 + 4
  }


def serve_layer_caches(synced=False):
  cpu, model = cpu_and_xla(LayerCaches)
  served = torch_xla_patches.serve(model, [
      CallSpec(TensorSpec((4, 8)), TensorSpec(
          (4,), torch.long), [TensorSpec((32, 8))] * 2)
  ])
  # Made on the device (a tensor moved to the device with `to` holds its data
  # in an IR node until a sync, which reads as a read). Left pending, the
  # caches are computed by the first step's sync of its inputs, into buffers
  # of their own; `synced`, they hold data the caller set.
  caches = [torch.zeros(32, 8, device=torch_xla.device()) for _ in range(2)]
  if synced:
    torch_xla.sync()
  return cpu, served, caches, [torch.zeros(32, 8) for _ in range(2)]


def served_donations(served_at):
  """What the calls since serve() returned donated and copied; `served_at`
  are the counters then (serve()'s own compiles donated both caches)."""
  assert served_at[bridge_counters.COUNTER_DONATED] == 2
  return donation_counters(since=served_at)


def served_step(cpu, served, caches, expected, seed):
  generator = torch.Generator().manual_seed(seed)
  x, slots = torch.randn(4, 8, generator=generator), torch.randperm(
      32, generator=generator)[:4]
  with torch.no_grad():
    want = cpu(x, slots, expected)
  torch.testing.assert_close(served(xla(x), xla(slots), caches).cpu(), want)


def readers_synced():
  return met.counter_value(bridge_counters.COUNTER_DONATION_READERS_SYNCED) or 0


def buffer_pointers(tensors):
  torch_xla.sync()
  return [torch_xla._XLAC._unsafe_buffer_pointer(t) for t in tensors]


@pytest.mark.requires('torch_aot_compile')
def test_a_served_decode_loop_updates_its_caches_in_their_own_buffers(
    patched_bridge):
  cpu, served, caches, expected = serve_layer_caches()
  served_at = donation_counters()
  synced_before = readers_synced()
  # The caller made the caches and left them pending: the first step computed
  # them into buffers of their own and took those over.
  served_step(cpu, served, caches, expected, 0)
  pointers = buffer_pointers(caches)
  # An alias shares the cache's storage and reads nothing until used.
  alias = caches[1].detach()
  # Past two drops of the caches' update logs (see [Note: Taking a result]).
  steps = 2 * bound_program.UPDATE_LOG_RUNS + 3
  for seed in range(1, steps):
    served_step(cpu, served, caches, expected, seed)
  # Every later step took the buffers its previous run gave them. No step
  # looked at the rest of the device.
  assert readers_synced() == synced_before
  assert buffer_pointers(caches) == pointers
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)
  torch.testing.assert_close(alias.cpu(), expected[1])
  # Nothing read the caches between two steps: no step copied one.
  assert served_donations(served_at) == {}
  # The first step took the full path and taught the fast path the bucket
  # (serve()'s warm-up compiles without running: it learns nothing).
  assert served.calls.fast_calls == steps - 1


def compiled_layer_caches():
  """LayerCaches under torch.compile, its signature traced by a first call:
  (cpu model, compiled model)."""
  cpu, model = cpu_and_xla(LayerCaches)
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  expected = [torch.zeros(32, 8) for _ in range(2)]
  with torch.no_grad():
    served_step(
        cpu, compiled,
        [torch.zeros(32, 8, device=torch_xla.device()) for _ in range(2)],
        expected, 99)
  return cpu, compiled


def layer_caches_front_end(front_end):
  """(cpu model, LayerCaches served or compiled) ready to run a step."""
  if front_end == 'serve':
    cpu, served, _, _ = serve_layer_caches()
    return cpu, served
  return compiled_layer_caches()


FRONT_ENDS = [
    pytest.param('serve', marks=pytest.mark.requires('torch_aot_compile')),
    'torch.compile'
]


@pytest.mark.parametrize('front_end', FRONT_ENDS)
@pytest.mark.parametrize('synced', [False, True],
                         ids=['made on the device', 'made and synced'])
def test_a_donating_run_syncs_only_its_own_arguments(patched_bridge, synced,
                                                     front_end):
  # Issue 33: a donating run on caches the caller had just made synced every
  # live tensor of the device, which races with other threads' tensors (see
  # [Note: Threads] in execution.py). Another tensor with pending IR, made
  # after the caches, stays pending through the call.
  cpu, served = layer_caches_front_end(front_end)
  caches = [torch.zeros(32, 8, device=torch_xla.device()) for _ in range(2)]
  if synced:
    torch_xla.sync()
  expected = [torch.zeros(32, 8) for _ in range(2)]
  other = torch.ones(3, device=torch_xla.device()) * 2
  before = donation_counters()
  synced_before = readers_synced()
  with torch.no_grad():
    served_step(cpu, served, caches, expected, 0)
  assert torch_xla._XLAC._check_tensor_need_materialization([other]) == [True]
  assert readers_synced() == synced_before
  # Caches left pending were computed into buffers of their own, taken over
  # as they were; synced ones hold data the caller set, copied for the run.
  assert donation_counters(since=before) == ({
      bridge_counters.COUNTER_DONATION_COPIED_READ: 2
  } if synced else {})
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)
  torch.testing.assert_close(other.cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize('front_end', FRONT_ENDS)
def test_a_pending_reader_of_data_the_caller_set_keeps_its_buffer(
    patched_bridge, front_end):
  # A cache moved to the device with `to` holds its data in an IR node, which
  # a pending value reads; `cache.cpu()` then makes the cache hold that data
  # itself, with no IR left to show the read. The donating run must not take
  # the buffer the pending value still reads.
  cpu, served = layer_caches_front_end(front_end)
  values = [torch.randn(32, 8) for _ in range(2)]
  caches = [xla(value) for value in values]
  pending = [cache * 2 for cache in caches]
  for cache in caches:
    cache.cpu()
  expected = [value.clone() for value in values]
  before = donation_counters()
  with torch.no_grad():
    served_step(cpu, served, caches, expected, 0)
  for value, reader in zip(values, pending):
    torch.testing.assert_close(reader.cpu(), value * 2)
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)
  assert donation_counters(since=before) == {
      bridge_counters.COUNTER_DONATION_COPIED_READ: 2
  }


def data_handles(tensors):
  return torch_xla._XLAC._get_tensors_handle(list(tensors))


def buffer_of(tensor):
  """The device data handle `tensor` holds; None while it holds a lazy
  value (IR), not a buffer."""
  try:
    return data_handles([tensor])[0]
  except RuntimeError as error:
    assert 'does not have data handle' in str(error)
    return None


@pytest.mark.parametrize('front_end', FRONT_ENDS)
@pytest.mark.parametrize('when', ['first step', 'after the caller wrote them'])
def test_each_copied_cache_lets_its_old_buffer_go_before_its_copy_is_sent(
    patched_bridge, monkeypatch, front_end, when):
  # See [Note: Moving onto a private copy]: a run that copies several
  # donated caches used to hold every old buffer until it was done, two of
  # each cache at its start; then each old buffer until its copy was on the
  # device, one more of a cache at the peak.
  cpu, served = layer_caches_front_end(front_end)
  caches = [torch.zeros(32, 8, device=torch_xla.device()) for _ in range(2)]
  torch_xla.sync()
  expected = [torch.zeros(32, 8) for _ in range(2)]
  if when == 'after the caller wrote them':
    # Served: the third step is a fast call of a bound program.
    for seed in range(2):
      with torch.no_grad():
        served_step(cpu, served, caches, expected, seed)
    for cache, reference in zip(caches, expected):
      cache.add_(1.0)
      reference.add_(1.0)
    torch_xla.sync()
  # A tensor that took the first cache's buffer with copy_ keeps it.
  kept, kept_reference = synced_copy_of(caches[0]), expected[0].clone()
  before = data_handles(caches)
  seen = []
  copy_on_device, to_device = donation.private_copy, donation._to_device

  def watched_copy(tensor):
    seen.append(('on the device', [buffer_of(cache) for cache in caches]))
    return copy_on_device(tensor)

  def watched_to_device(host, device):
    seen.append(('through the host', [buffer_of(cache) for cache in caches]))
    return to_device(host, device)

  monkeypatch.setattr(donation, 'private_copy', watched_copy)
  monkeypatch.setattr(donation, '_to_device', watched_to_device)
  counted_at = donation_counters()
  with torch.no_grad():
    served_step(cpu, served, caches, expected, 2)
  assert donation_counters(since=counted_at) == {
      bridge_counters.COUNTER_DONATION_COPIED_READ: 2
  }
  # The first cache, read by `kept`'s copy_, is copied on the device from
  # its buffer; the second, which the caller set, through the host: it lets
  # go of its buffer before its copy is sent, once the first holds its copy.
  assert [how for how, _ in seen] == ['on the device', 'through the host']
  assert seen[0][1] == before
  assert seen[1][1][0] not in (None, before[0])
  assert seen[1][1][1] is None
  torch.testing.assert_close(kept.cpu(), kept_reference)
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)
  # The next step donates the caches as they are: nothing copied.
  counted_at = donation_counters()
  with torch.no_grad():
    served_step(cpu, served, caches, expected, 3)
  assert donation_counters(since=counted_at) == {}
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)


@pytest.mark.parametrize('front_end', FRONT_ENDS)
def test_a_copy_that_fails_to_reach_the_device_gives_the_values_back(
    patched_bridge, monkeypatch, front_end):
  # See [Note: Moving onto a private copy]: between its two halves the cache
  # holds zeros; a copy the device refuses must not leave them there.
  cpu, served = layer_caches_front_end(front_end)
  values = [torch.randn(32, 8) for _ in range(2)]
  caches = [xla(value) for value in values]
  torch_xla.sync()
  for cache in caches:
    cache.cpu()
  expected = [value.clone() for value in values]
  to_device = donation._to_device
  refusals = [RuntimeError('RESOURCE_EXHAUSTED: out of memory')]

  def refusing_once(host, device):
    if refusals:
      raise refusals.pop()
    return to_device(host, device)

  monkeypatch.setattr(donation, '_to_device', refusing_once)
  with pytest.raises(RuntimeError, match='RESOURCE_EXHAUSTED'):
    with torch.no_grad():
      served_step(cpu, served, caches, [e.clone() for e in expected], 0)
  for cache, value in zip(caches, values):
    torch.testing.assert_close(cache.cpu(), value)
  # The next call answers as if the refused one had never been made.
  monkeypatch.setattr(donation, '_to_device', to_device)
  with torch.no_grad():
    served_step(cpu, served, caches, expected, 0)
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)


def test_a_host_copy_is_a_copy_of_its_own(patched_bridge):
  # On the CPU client the values come through a DLPack view of the buffer:
  # the copy must not be that view.
  values = torch.randn(32, 8)
  cache = xla(values)
  torch_xla.sync()
  host = donation._host_copy(cache)
  assert host.device.type == 'cpu'
  assert host.data_ptr() != torch_xla._XLAC._unsafe_buffer_pointer(cache)
  cache.add_(1.0)
  torch_xla.sync()
  torch.testing.assert_close(host, values)
  torch.testing.assert_close(cache.cpu(), values + 1)


def test_a_copy_the_device_refuses_twice_says_the_values_are_lost(
    patched_bridge, monkeypatch):
  cache = xla(torch.randn(32, 8))
  torch_xla.sync()
  cache.cpu()

  def refusing(host, device):
    raise RuntimeError('RESOURCE_EXHAUSTED: out of memory')

  monkeypatch.setattr(donation, '_to_device', refusing)
  with pytest.raises(donation.PrivateCopyLost) as raised:
    donation.move_to_private_copy(cache)
  assert str(raised.value) == (
      'a donated argument (float32[32, 8]) let go of its buffer to move onto '
      'a private copy, and neither the copy nor its values could be sent to '
      'the device again (RESOURCE_EXHAUSTED: out of memory); it holds zeros '
      'now: set its values again before using it')
  assert isinstance(raised.value.__cause__, RuntimeError)
  torch.testing.assert_close(cache.cpu(), torch.zeros(32, 8))


def copy_of(cache):
  return torch.zeros_like(cache).copy_(cache)


def synced_copy_of(cache):
  copy = copy_of(cache)
  torch_xla.sync()
  return copy


# Ways to hold a cache's buffer between two steps: each is made the same way
# from the eager reference, where views follow the cache and the rest keep
# what it held. Each builds IR on the cache, so the next step copies it
# (see [Note: Donating in-place updates]), but an alias: functionalization
# gives it the cache's own lazy tensor, and it follows the cache's updates
# as a view does.
READS = {
    'pending value': (lambda cache: cache * 2, 1),
    'view': (lambda cache: cache[:4], 1),
    'alias': (lambda cache: cache.detach(), 0),
    'copy_': (copy_of, 1),
    'copy_ then sync': (synced_copy_of, 1),
}


@pytest.mark.requires('torch_aot_compile')
@pytest.mark.parametrize('read', READS)
def test_a_cache_read_between_steps_is_copied_for_the_next_run(
    patched_bridge, read):
  cpu, served, caches, expected = serve_layer_caches()
  served_at = donation_counters()
  for seed in range(2):
    served_step(cpu, served, caches, expected, seed)
  make, copies = READS[read]
  kept, kept_reference = make(caches[0]), make(expected[0]).clone()
  if read in ('view', 'alias'):
    kept_reference = make(expected[0])
  for seed in range(2, 5):
    served_step(cpu, served, caches, expected, seed)
  torch.testing.assert_close(kept.cpu(), kept_reference)
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)
  # The step after the read ran on a copy of that cache; the next ones
  # donated it again.
  want = {
      bridge_counters.COUNTER_DONATION_COPIED_READ: copies
  } if copies else {}
  assert served_donations(served_at) == want


@pytest.mark.requires('torch_aot_compile')
@pytest.mark.parametrize('moved', ['to', 'made on the device'])
def test_reads_before_a_call_that_traces_keep_their_buffer(
    patched_bridge, moved):
  # A new signature traces on the caller's caches: the sync before the trace
  # and the restore after it drop the IR a read left on a cache.
  cpu, served, caches, expected = serve_layer_caches(synced=True)
  served_at = donation_counters()
  if moved == 'to':
    caches = [xla(torch.zeros(32, 8)) for _ in range(2)]
  pending, copied = caches[0] * 2, copy_of(caches[1])
  generator = torch.Generator().manual_seed(0)
  x, slots = torch.randn(3, 8, generator=generator), torch.tensor([1, 5, 9])
  with torch.no_grad():
    want = cpu(x, slots, expected)
  torch.testing.assert_close(served(xla(x), xla(slots), caches).cpu(), want)
  for cache, reference in zip(caches, expected):
    torch.testing.assert_close(cache.cpu(), reference)
  torch.testing.assert_close(pending.cpu(), torch.zeros(32, 8))
  torch.testing.assert_close(copied.cpu(), torch.zeros(32, 8))
  # The new signature donates both caches; both were read, so its first run
  # copied them, whatever the trace did to their IR.
  assert served_donations(served_at) == {
      bridge_counters.COUNTER_DONATED: 2,
      bridge_counters.COUNTER_DONATION_COPIED_READ: 2
  }


def test_training_leaves_the_forwards_buffer_updates_to_the_epilogue(
    patched_bridge):
  # A graph that needs autograd: AOTAutograd's epilogue writes the buffer
  # after the run, and the bridge donates nothing (see [Note: Donating
  # in-place updates]). The backward, compiled under the forward's context
  # and its mutated-input metadata, counts nothing.

  class Tracked(RunningTotal):

    def forward(self, x):
      y = self.proj(x)
      self.total.add_(y.detach().sum(dim=0))
      return y

  cpu, model = cpu_and_xla(Tracked)
  compiled = torch.compile(model, backend='openxla', dynamic=True)
  for batch in (3, 3):
    x = torch.randn(batch, 8)
    cpu(x).square().sum().backward()
    compiled(xla(x)).square().sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), cpu.parameters()):
      torch.testing.assert_close(ours.grad.cpu(), theirs.grad, msg=name)
    torch.testing.assert_close(model.total.cpu(), cpu.total)
  # The buffer, once, in the forward's one signature.
  assert donation_counters() == {bridge_counters.COUNTER_DONATION_EPILOGUE: 1}
  assert 'XlaSetBufferDonation' not in met.counter_names()


def test_only_forward_and_inference_graphs_carry_mutated_inputs():
  """A backward is compiled under its forward's tracing context, with the
  forward's mutated-input metadata: it must not be read as the backward's."""

  class Metadata:
    mutated_inp_runtime_indices = [1]
    input_info = [None, type('Info', (), {'mutates_data': True})()]

  assert donation.aot_autograd_mutated_inputs() == ()
  for name, expected in [('0_forward', (1,)), ('0_inference', (1,)),
                         ('0_backward', ())]:
    context = torch._guards.TracingContext(None)
    context.fw_metadata = Metadata()
    context.aot_graph_name = [name]
    with torch._guards.tracing(context):
      assert donation.aot_autograd_mutated_inputs() == expected, name

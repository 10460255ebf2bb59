"""Parallel compiles (config.compile_workers, see [Note: Parallel compiles]
and [Note: The compile pool] in compile_window.py): a replay of recorded
signatures, or a precompile(), with 2 workers gives the programs, results,
counters and errors of the one with 1."""
import os
import shutil
import threading
import time

import pytest
import torch
import torch._dynamo
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from torch_xla_patches import (TensorSpec, backlog, compile_window, config,
                               signature_cache, warmup)
from torch_xla_patches.counters import COUNTER_MISS
from bridge_testing import REPO_ROOT, counters, run_python, serve_fresh, xla

# Records the signatures of SIZES in CACHE_DIR (first process), or replays
# them all on the first call and serves every size (later processes).
REPLAY_SCRIPT = r'''
import hashlib
import threading
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
from bridge_testing import counters
from torch_xla_patches import compile_window
torch_xla_patches.apply(cache_dir=CACHE_DIR)
device = torch_xla.device()
compile_graph = compile_window.compile_graph
compile_threads = []

def compile_noting_the_thread(graph_tensors):
  compile_threads.append(threading.current_thread().name)
  compile_graph(graph_tensors)

compile_window.compile_graph = compile_noting_the_thread

def fn(x, w1, w2):
  h = torch.nn.functional.gelu(x @ w1)
  return torch.tanh(h @ w2) * x.shape[0], h.sum(dim=0)

compiled = torch.compile(fn, backend='openxla', dynamic=True)
torch.manual_seed(0)
w1, w2 = torch.randn(16, 32), torch.randn(32, 16)
for n in SIZES:
  x = torch.randn(n, 16)
  got = compiled(x.to(device), w1.to(device), w2.to(device))
  for out, ref in zip(got, fn(x, w1, w2)):
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    print('result', n, hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest())
for name, value in counters().items():
  print(name, value)
print('CompileTime', met.metric_data('CompileTime')[0])
print('WorkerCompiles',
      sum(name.startswith('xla-compile') for name in compile_threads))
'''

SIZES = [3, 4, 5, 6, 7, 9, 10, 11, 12]


def replay(cache_dir, sizes, workers):
  """Counters and result digests of one process serving `sizes`."""
  code = REPLAY_SCRIPT.replace('CACHE_DIR', repr(str(cache_dir))).replace(
      'SIZES', repr(sizes))
  proc = run_python(
      code, {
          'PYTHONPATH': os.pathsep.join([REPO_ROOT, f'{REPO_ROOT}/test']),
          'XLA_PATCHES_COMPILE_WORKERS': str(workers),
          'XLA_PATCHES_REPLAY_SYNC_MAX': '0',
          'XLA_PATCHES_PRECOMPILE_PROGRESS': '0',
      })
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  results = [l for l in lines if l.startswith('result')]
  found = dict(l.split() for l in lines if not l.startswith('result'))
  return {k: int(v) for k, v in found.items()}, results


def test_a_replay_with_2_workers_equals_the_serial_replay(tmp_path):
  recorded = tmp_path / 'recorded'
  replay(recorded, SIZES, workers=1)
  got = {}
  for workers in (1, 2):
    # Each replay starts from the same index (serving counts its calls).
    copy = tmp_path / f'workers-{workers}'
    shutil.copytree(recorded, copy)
    got[workers] = replay(copy, list(reversed(SIZES)), workers)
  # The serial replay compiled on the calling thread, the other on the pool.
  # Either way the graph's first signature compiles on the pool, while its
  # call waits with no lock held (see [Note: Traces on placeholders] in
  # tracing.py).
  worker_compiles = {
      workers: counters.pop('WorkerCompiles')
      for workers, (counters, _) in got.items()
  }
  assert worker_compiles[1] == 1 and worker_compiles[2] > 1, worker_compiles
  serial_counters, serial_results = got[1]
  assert serial_counters == {
      'DynamoExtractCompiledGraph': 1,
      # The first call (12) traced and served; 8 replayed before it returns.
      'DynamoSignatureHit': len(SIZES),
      'DynamoSignatureMiss': 1,
      'DynamoEvictedRetrace': 0,
      'DynamoSignatureDropped': 0,
      'DynamoCpuFallbackPartition': 0,
      'DynamoSignaturePrecompiled': len(SIZES) - 1,
      'DynamoSignaturePrecompileSkipped': 0,
      'UncachedCompile': len(SIZES),
      'CompileTime': len(SIZES),
  }
  assert got[2] == (serial_counters, serial_results)


# The same, in this process, with the index in tmp_path.

# x is (n, 8) and w (8, 4): no n is 4 or 8, which dynamo would tie to w's
# sizes (duck sizing), making another graph.
SMALL_SIZES = [2, 3, 5, 6, 7, 9, 10]


def mlp(x, w):
  return torch.tanh(x @ w) * x.shape[0]


@pytest.fixture
def indexed(patched_bridge, tmp_path, monkeypatch):
  monkeypatch.setattr(config, 'cache_dir', str(tmp_path / 'recorded'))
  monkeypatch.setattr(config, 'precompile_progress', False)
  return tmp_path


def restart(tmp_path, monkeypatch, workers):
  """A copy of the recorded index (serving counts calls, which would change
  the replay order of the next restart), `workers` compile workers, a known
  RNG seed and zeroed metrics."""
  copy = tmp_path / f'workers-{workers}'
  shutil.copytree(tmp_path / 'recorded', copy)
  monkeypatch.setattr(config, 'cache_dir', str(copy))
  monkeypatch.setattr(config, 'compile_workers', workers)
  xm.set_rng_state(1234)
  met.clear_all()


def serve_here(fn, sizes, backend='openxla'):
  """A fresh dynamo trace of fn(x, w) served at `sizes`; checks results."""
  return serve_fresh(fn, sizes, backend=backend)


def bridge_counters():
  """counters() without UncachedCompile: XLA's own cache keeps the
  programs of earlier replays of this process."""
  got = counters()
  del got['UncachedCompile']
  return got


def the_cache():
  return signature_cache.live_signature_caches()[-1]


def hashes(cache):
  return {
      entry.signature.shape_values: entry.graph_hash
      for entry in cache.entries.values()
  }


class SlowCompile:
  """compile_graph, slower: compiles XLA's cache answers at once (this
  process compiled the same programs before) stay in flight for a while."""

  def __init__(self):
    self._compile = compile_window.compile_graph

  def __call__(self, graph_tensors):
    time.sleep(0.3)
    self._compile(graph_tensors)


class CompileThreads:
  """compile_graph (or a stand-in for it), noting the thread of each
  compile: the pool's ('xla-compile_N') with 2 workers, the caller's
  serially; so a comparison of the two is not of the serial path with
  itself."""

  def __init__(self, compile_graph):
    self._compile = compile_graph
    self.names = []

  def __call__(self, graph_tensors):
    self.names.append(threading.current_thread().name)
    self._compile(graph_tensors)

  def on_workers(self):
    return sum(name.startswith('xla-compile') for name in self.names)


def watch_compiles(monkeypatch, compile_graph):
  threads = CompileThreads(compile_graph)
  monkeypatch.setattr(compile_window, 'compile_graph', threads)
  return threads


class FailOnce:
  """compile_graph, raising the first time it compiles a graph whose first
  output has `rows` rows."""

  def __init__(self, rows):
    self.rows = rows
    self.failed = 0
    self._compile = compile_window.compile_graph

  def __call__(self, graph_tensors):
    if not self.failed and graph_tensors[0].shape[0] == self.rows:
      self.failed += 1
      raise RuntimeError(f'compile failed for {self.rows} rows')
    self._compile(graph_tensors)


@pytest.mark.parametrize('strict', [True, False])
def test_a_failing_compile_is_raised_or_skipped_as_serially(
    indexed, monkeypatch, strict):
  serve_here(mlp, SMALL_SIZES)
  monkeypatch.setattr(config, 'precompile_mode', 'off')
  monkeypatch.setattr(config, 'strict_replay', strict)
  seen, on_workers = {}, {}
  for workers in (1, 2):
    restart(indexed, monkeypatch, workers)
    failing = FailOnce(rows=5)
    threads = watch_compiles(monkeypatch, failing)
    compiled = serve_here(mlp, [3])
    cache = the_cache()
    if strict:
      with pytest.raises(RuntimeError, match='compile failed for 5 rows'):
        cache.drain_backlog()
    else:
      assert cache.drain_backlog() == 5
    assert failing.failed == 1
    on_workers[workers] = threads.on_workers()
    seen[workers] = (bridge_counters(), cache.backlog_size, hashes(cache))
    # Every size is served right afterwards; 5 is compiled when asked for.
    serve_here(mlp, SMALL_SIZES)
    del compiled
  # 2 workers compiled on the pool: not the serial path twice. The graph's
  # first signature compiles on the pool either way (see [Note: Traces on
  # placeholders] in placeholder_trace.py).
  assert on_workers[1] == 1 and on_workers[2] > 1, on_workers
  assert seen[2] == seen[1]
  skipped = seen[1][0][backlog.COUNTER_PRECOMPILE_SKIPPED]
  assert skipped == (0 if strict else 1)


def test_a_failing_compile_in_precompile_raises_after_the_others(
    patched_bridge, monkeypatch):
  """precompile() traces every size, compiles them on the pool, and raises
  the error of the one that failed, naming it, once the compiles before it
  are done; the other sizes are compiled, and a call of the failed size
  compiles it again."""
  for workers in (1, 2):
    monkeypatch.setattr(config, 'compile_workers', workers)
    failing = FailOnce(rows=5)
    threads = watch_compiles(monkeypatch, failing)
    torch._dynamo.reset()
    met.clear_all()
    compiled = torch.compile(mlp, backend='openxla', dynamic=True)
    w = xla(torch.randn(8, 4))
    with pytest.raises(
        signature_cache.CompileFailed,
        match=r'background (trace and )?compile of signature .*\[5, 8\].*'
        'compile failed for 5 rows'):
      warmup.precompile(compiled,
                        [(TensorSpec((n, 8)), w) for n in SMALL_SIZES],
                        progress=False)
    # The compiles after the failed one go on in the background.
    compile_window.compile_pool().wait_running()
    assert threads.on_workers() == len(SMALL_SIZES)
    cache = the_cache()
    assert sorted(values[0][1] for values in hashes(cache)) == sorted(
        n for n in SMALL_SIZES if n != 5)
    assert counters()[COUNTER_MISS] == len(SMALL_SIZES)
    serve_here_with(compiled, w, SMALL_SIZES)
    assert counters()[COUNTER_MISS] == len(SMALL_SIZES) + 1
    del compiled


def serve_here_with(compiled, w, sizes):
  for n in sizes:
    x = torch.randn(n, 8)
    torch.testing.assert_close(compiled(xla(x), w).cpu(),
                               mlp(x, w.cpu()),
                               rtol=1e-4,
                               atol=1e-4)


def sample(x, w):
  # A random op: each replayed trace must start from the seed a serial
  # trace starts from, or the program would change.
  return torch.tanh(x @ w) + torch.rand_like(x @ w) * 0


def test_traces_with_random_ops_give_the_serial_programs(indexed, monkeypatch):
  serve_here(sample, SMALL_SIZES)
  slow = SlowCompile()
  seen, on_workers = {}, {}
  for workers in (1, 2):
    restart(indexed, monkeypatch, workers)
    threads = watch_compiles(monkeypatch, slow)
    compiled = serve_here(sample, [3])
    seen[workers] = (bridge_counters(), hashes(the_cache()),
                     torch_xla._XLAC._xla_get_rng_seed())
    on_workers[workers] = threads.on_workers()
    del compiled
  # 2 workers compiled on the pool: not the serial path twice. The graph's
  # first signature compiles on the pool either way (see [Note: Traces on
  # placeholders] in placeholder_trace.py).
  assert on_workers[1] == 1 and on_workers[2] > 1, on_workers
  assert len(seen[1][1]) == len(SMALL_SIZES)
  assert seen[2] == seen[1]


def test_a_random_graph_traces_one_program_whatever_was_drawn_before(
    patched_bridge, tmp_path, monkeypatch):
  # See [Note: Random draws in a trace] in tracing.py: a draw on the device
  # that nothing synced yet (another thread's, say) is in the seed's IR
  # chain when the graph is traced.
  monkeypatch.setattr(config, 'cache_dir', str(tmp_path))
  seen = []
  for draws_before in (0, 2):
    xm.set_rng_state(1234)
    pending = [
        torch.rand(4, device=xm.xla_device()) for _ in range(draws_before)
    ]
    compiled = serve_here(sample, [3])
    seen.append(hashes(the_cache()))
    del pending, compiled
  assert len(seen[0]) == 1
  assert seen[1] == seen[0]


class Accumulate(torch.nn.Module):
  """Updates a parameter in place: parameters have static sizes, so it is a
  fixed input of every replay (which traces on zeros: the update changes it
  all the same)."""

  def __init__(self):
    super().__init__()
    self.acc = torch.nn.Parameter(torch.arange(4.), requires_grad=False)

  def forward(self, x):
    self.acc.add_(x.sum(dim=0) + 1)
    return torch.tanh(x) * 2, self.acc * 3


def serve_accumulate(sizes):
  torch._dynamo.reset()
  eager = Accumulate()
  model = Accumulate().to(torch_xla.device())
  # dynamo's graph, not functionalized: the in-place update is in the graph
  # the bridge traces.
  compiled = torch.compile(model, backend='openxla_eval', dynamic=True)
  for n in sizes:
    x = torch.randn(n, 4)
    got, ref = compiled(xla(x)), eager(x)
    torch.testing.assert_close(got[0].cpu(), ref[0])
    torch.testing.assert_close(got[1].cpu(), ref[1])
    torch.testing.assert_close(model.acc.cpu(), eager.acc)
  return compiled


def test_an_inplace_update_of_an_input_gives_eager_results(
    indexed, monkeypatch):
  serve_accumulate(SMALL_SIZES)
  slow = SlowCompile()
  seen, on_workers = {}, {}
  window_traces = [0]
  window_trace = compile_window.CompileWindow.trace

  def counted_trace(*args, **kwargs):
    window_traces[0] += 1
    return window_trace(*args, **kwargs)

  monkeypatch.setattr(compile_window.CompileWindow, 'trace', counted_trace)
  for workers in (1, 2):
    restart(indexed, monkeypatch, workers)
    threads = watch_compiles(monkeypatch, slow)
    window_traces[0] = 0
    # The replay before the first call leaves acc as it was, and every size
    # is right afterwards.
    compiled = serve_accumulate([7] + SMALL_SIZES)
    seen[workers] = (bridge_counters(), hashes(the_cache()))
    on_workers[workers] = (window_traces[0], threads.on_workers())
    del compiled
  # With 2 workers every recorded signature went through the window, which
  # compiles a trace that updates an input on the calling thread, after
  # the compiles in flight (see [Note: Parallel compiles]): none on the
  # pool but the graph's first signature, the call's own (see [Note: Traces
  # on placeholders] in placeholder_trace.py).
  assert on_workers == {1: (0, 1), 2: (len(SMALL_SIZES) - 1, 1)}
  assert seen[1][0][backlog.COUNTER_PRECOMPILED] == len(SMALL_SIZES) - 1
  assert seen[2] == seen[1]


def test_the_pool_runs_as_many_compiles_at_once_as_the_flag_says_now(
    monkeypatch):
  """A pool started with 2 workers runs one compile at a time once the flag
  says 1 (see [Note: The compile pool]): the next compile waits for the
  running one, as in a pool started with 1."""
  pool = compile_window.CompilePool()
  release = threading.Event()
  started = {name: threading.Event() for name in 'abcd'}

  def job(name):

    def held():
      started[name].set()
      assert release.wait(120)
      return name

    return held

  monkeypatch.setattr(config, 'compile_workers', 2)
  first = [pool.submit(job(name)) for name in 'ab']
  # Both run at once: each waits for the release the other cannot give.
  assert started['a'].wait(120) and started['b'].wait(120)
  release.set()
  assert [future.result(120) for future in first] == ['a', 'b']
  release.clear()
  monkeypatch.setattr(config, 'compile_workers', 1)
  second = [pool.submit(job(name)) for name in 'cd']
  assert started['c'].wait(120)
  # A bound for a failure, not a wait that decides a pass: with two workers
  # taking jobs, 'd' starts at once.
  assert not started['d'].wait(0.5)
  release.set()
  assert [future.result(120) for future in second] == ['c', 'd']


def test_the_default_is_half_the_cores_at_most_8(monkeypatch):
  monkeypatch.setattr(config.os, 'sched_getaffinity', lambda pid: range(2))
  assert config.default_compile_workers() == 1
  monkeypatch.setattr(config.os, 'sched_getaffinity', lambda pid: range(12))
  assert config.default_compile_workers() == 6
  monkeypatch.setattr(config.os, 'sched_getaffinity', lambda pid: range(96))
  assert config.default_compile_workers() == 8
  with pytest.raises(config.FlagError,
                     match=r"XLA_PATCHES_COMPILE_WORKERS \(config.compile_"
                     r"workers\) is 0; it accepts an integer >= 1"):
    config.check('compile_workers', 0)


# precompile() in a fresh process: a model whose calls update buffers
# (BatchNorm in training mode: AOTAutograd copies the new running statistics
# into them after the graph) and a function with a graph break (two graphs
# per call).
PRECOMPILE_SCRIPT = r'''
import hashlib
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
from torch_xla_patches import TensorSpec
from bridge_testing import counters
torch_xla_patches.apply()
device = torch_xla.device()


def digest(tensor):
  return hashlib.sha256(tensor.detach().cpu().numpy().tobytes()).hexdigest()[:16]


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.BatchNorm1d(24),
                            torch.nn.GELU(), torch.nn.Linear(24, 12)).to(device)
compiled = torch.compile(model, backend='openxla', dynamic=True)
print('buffers', digest(model[1].running_mean), digest(model[1].running_var))
sizes = [2, 3, 5, 6, 7, 9]
report = torch_xla_patches.precompile(
    compiled, [(TensorSpec((n, 12)),) for n in sizes], progress=False)
print('compiles', [r.xla_compiles for r in report])
print('buffers', digest(model[1].running_mean), digest(model[1].running_var))


def two_graphs(x, w):
  y = torch.tanh(x @ w)
  torch._dynamo.graph_break()
  return (y * 2).sum(dim=1) + x.shape[0]


compiled_two = torch.compile(two_graphs, backend='openxla', dynamic=True)
w = torch.randn(12, 5).to(device)
report = torch_xla_patches.precompile(
    compiled_two, [(TensorSpec((n, 12)), w) for n in sizes + [3]],
    progress=False)
print('compiles', [r.xla_compiles for r in report])

for n in sizes:
  x = torch.randn(n, 12)
  print('result', n, digest(compiled(x.to(device))),
        digest(compiled_two(x.to(device), w)))
print('buffers', digest(model[1].running_mean), digest(model[1].running_var))
for name, value in counters().items():
  print(name, value)
print('CompileTime', met.metric_data('CompileTime')[0])
'''


def precompile_in_process(workers):
  proc = run_python(
      PRECOMPILE_SCRIPT, {
          'PYTHONPATH': os.pathsep.join([REPO_ROOT, f'{REPO_ROOT}/test']),
          'XLA_PATCHES_COMPILE_WORKERS': str(workers),
      })
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.splitlines()


def test_precompile_with_2_workers_equals_the_one_with_1():
  serial = precompile_in_process(1)
  # precompile() leaves BatchNorm's running statistics as they were (a
  # training graph: AOTAutograd's epilogue would write them).
  assert serial[0].startswith('buffers ') and serial[2] == serial[0]
  assert serial[1] == 'compiles [1, 1, 1, 1, 1, 1]'
  # Only the first graph of two_graphs compiles (see [Note: Compile-only
  # calls]); the repeated size compiles nothing.
  assert serial[3] == 'compiles [1, 1, 1, 1, 1, 1, 0]'
  # 6 sizes of the model and 6 of two_graphs' first graph in precompile(),
  # then 6 of its second graph at the calls.
  assert 'DynamoSignatureMiss 18' in serial
  parallel = precompile_in_process(2)
  assert parallel == serial

"""The persistent signature index: fresh processes replay what it knows, most
served first and within the sync bounds; writers need no locks; nothing a
cache directory holds can make a call fail."""
import errno
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch_xla.debug.metrics as met

from torch_xla_patches import cache as cache_cli
from torch_xla_patches import (backlog, config, fingerprint, signature_cache,
                               record, signature_index)
from torch_xla_patches.signature import ArgKind, ArgLayout
from bridge_testing import REPO_ROOT, counters, run_python, serve_fresh

SERVE_SCRIPT = r'''
import sys
import time
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
torch_xla_patches.apply(cache_dir=CACHE_DIR)
device = torch_xla.device()

def fn(x, w):
  return torch.tanh(x @ w).sum(dim=0) + x.shape[0]

compiled = torch.compile(fn, backend='openxla', dynamic=True)
w = torch.randn(8, 4)
for n in SIZES:
  x = torch.randn(n, 8)
  start = time.perf_counter()
  got = compiled(x.to(device), w.to(device)).cpu()
  seconds = time.perf_counter() - start
  torch.testing.assert_close(got, fn(x, w), rtol=1e-4, atol=1e-4)
  compile_data = met.metric_data('CompileTime')
  print('after', n, met.counter_value('DynamoSignatureMiss') or 0,
        met.counter_value('DynamoSignaturePrecompiled') or 0,
        compile_data[0] if compile_data else 0, f'{seconds:.3f}', flush=True)
'''

# Makes every flock fail as on a shared file system without a lock daemon.
NO_FLOCK = r'''
import errno, fcntl
def _no_flock(*args, **kwargs):
  raise OSError(errno.EOPNOTSUPP, 'Operation not supported')
fcntl.flock = _no_flock
fcntl.lockf = _no_flock
'''


def serve_script(cache_dir, sizes, no_flock=False):
  code = SERVE_SCRIPT.replace('CACHE_DIR', repr(str(cache_dir))).replace(
      'SIZES', repr([int(s) for s in sizes.split(',')]))
  return (NO_FLOCK if no_flock else '') + code


def serve(cache_dir, sizes, env=None, no_flock=False):
  """Serves `sizes` in a fresh process; returns (size, misses, precompiled,
  XLA compiles, seconds) after each call, and the process."""
  proc = run_python(serve_script(cache_dir, sizes, no_flock), env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [
      line.split()
      for line in proc.stdout.splitlines()
      if line.startswith('after')
  ]
  return [(int(n), int(miss), int(pre), int(compiles), float(seconds))
          for _, n, miss, pre, compiles, seconds in rows], proc


def resized(specs, old, new):
  """`specs` with the batch size `old` replaced by `new`."""
  out = []
  for spec in specs:
    if spec is None:
      out.append(None)
    elif 'value' in spec:
      out.append({'value': new if spec['value'] == old else spec['value']})
    else:
      shape = list(spec['shape'])
      if shape[0] == old:
        shape[0] = new
      out.append({'shape': shape, 'dtype': spec['dtype']})
  return tuple(out)


def graph_dirs(cache_dir):
  return signature_index.graph_directories(str(cache_dir))


def record_files(directory):
  return sorted(f for f in os.listdir(directory)
                if f.startswith(signature_index.RECORD_PREFIX))


def test_fresh_process_precompiles_every_known_signature_first(tmp_path):
  serve(tmp_path, '3,4,5,6')
  rows, proc = serve(tmp_path, '6,5,4,3,7')
  # First call: its own signature is traced (a miss), the other three known
  # ones are compiled from the index before the call returns.
  assert rows[0][:3] == (6, 1, 3)
  # Known signatures never miss afterwards; only the new size 7 does.
  assert [r[1] for r in rows] == [1, 1, 1, 1, 2]
  assert '[precompile 3/3] graph 0' in proc.stderr
  (directory,) = graph_dirs(tmp_path)
  assert len(record_files(directory)) == 5


def test_unloadable_persisted_executables_are_reported_once(tmp_path):
  env = {'XLA_PATCHES_PERSISTENT_EXECUTABLES': '1'}
  serve(tmp_path, '3,5', env=env)
  assert os.listdir(os.path.join(tmp_path, 'xla'))
  rows, proc = serve(tmp_path, '5,3', env=env)
  # torch_xla 2.9 on CPU cannot deserialize what it wrote: the index still
  # gets signature 3 compiled before it is asked for, and the user is told
  # plainly, once, that nothing came from disk.
  assert [r[:3] for r in rows] == [(5, 1, 1), (3, 1, 1)]
  warnings_seen = [
      line for line in proc.stderr.splitlines()
      if 'could not load' in line and 'Nothing was loaded from disk' in line
  ]
  assert len(warnings_seen) == 1


def test_interleaved_mode_compiles_one_known_signature_per_call(tmp_path):
  serve(tmp_path, '3,4,5')
  rows, _ = serve(tmp_path,
                  '9,9,9,4',
                  env={'XLA_PATCHES_PRECOMPILE': 'interleaved'})
  assert [r[2] for r in rows] == [1, 2, 3, 3]
  assert [r[1] for r in rows] == [1, 1, 1, 1]


def test_four_writers_without_flock_lose_nothing(tmp_path):
  """A shared directory whose file system refuses flock (EOPNOTSUPP), four
  processes recording at once: every signature is kept, no call fails, no
  temp file is left."""
  env = dict(os.environ, PJRT_DEVICE='CPU', PYTHONPATH=REPO_ROOT)
  procs = [
      subprocess.Popen(
          [sys.executable, '-c',
           serve_script(tmp_path, sizes, no_flock=True)],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True)
      # No first size equals one of w's (8, 4): dynamo would tie them into
      # another graph (duck sizing), with a fingerprint of its own.
      for sizes in ('2,3', '5,4', '6,7', '3,9')
  ]
  for proc in procs:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert out.count('after') == 2
    assert 'could not write' not in err
  (directory,) = graph_dirs(tmp_path)
  index = signature_index.open_graph_directory(directory, max_signatures=0)
  contents = index.load()
  assert contents.problems == ()
  sizes = sorted(r.specs[0]['value'] for r in contents.records)
  assert sizes == [2, 3, 4, 5, 6, 7, 9]
  # Each process flushed its usage at exit: 8 calls served in all.
  assert sum(r.served for r in contents.records) == 8
  assert not [f for f in os.listdir(directory) if f.startswith('.tmp-')]


RESTART_SCRIPT = r'''
import time
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
torch_xla_patches.apply(cache_dir=CACHE_DIR)

def fn(x, w):
  return torch.tanh(x @ w).sum(dim=0) + x.shape[0]

compiled = torch.compile(fn, backend='openxla', dynamic=True)
w = torch.randn(8, 4)
for n in (2, 3, 2):
  x = torch.randn(n, 8)
  start = time.perf_counter()
  got = compiled(x.to(torch_xla.device()), w.to(torch_xla.device())).cpu()
  seconds = time.perf_counter() - start
  torch.testing.assert_close(got, fn(x, w), rtol=1e-4, atol=1e-4)
  print('call', n, met.metric_data('CompileTime')[0],
        met.counter_value('DynamoSignaturePrecompiled') or 0,
        f'{seconds:.2f}', flush=True)
'''


def test_restart_with_400_recorded_signatures_is_bounded(tmp_path):
  """400 recorded signatures of a one-matmul graph: the restart's first call
  returns after its own compile plus at most the sync bound (64 by default),
  with the right result; the rest follow one per served call."""
  serve(tmp_path, '2')
  (directory,) = graph_dirs(tmp_path)
  index = signature_index.open_graph_directory(directory, max_signatures=0)
  (recorded,) = index.load().records
  for n in range(10, 409):
    specs = resized(recorded.specs, 2, n)
    index.record(
        record.RecordedSignature(record_id=record.record_id_of(specs, None),
                                 specs=specs,
                                 shardings=None))
  assert len(record_files(directory)) == 400
  proc = run_python(RESTART_SCRIPT.replace('CACHE_DIR', repr(str(tmp_path))))
  assert proc.returncode == 0, proc.stderr[-3000:]
  calls = [line.split() for line in proc.stdout.splitlines()]
  # (n, XLA compiles so far, precompiled so far, seconds)
  first, second, third = [
      (int(c[1]), int(c[2]), int(c[3]), float(c[4])) for c in calls
  ]
  # Its own compile and 64 from the index.
  assert first[1:3] == (65, 64)
  assert second[1:3] == (67, 65)  # a miss (size 3), then one from the backlog
  assert third[1:3] == (68, 66)  # a hit, then one from the backlog
  print(f'\nrestart with 400 recorded: first call {first[3]:.2f} s, '
        f'{first[1]} XLA compiles')


# The bridge in this process, on a small graph, with the index in tmp_path.


def matmul_sum(x, w):
  return torch.tanh(x @ w).sum(dim=0) + x.shape[0]


@pytest.fixture
def indexed(patched_bridge, tmp_path, monkeypatch):
  monkeypatch.setattr(config, 'cache_dir', str(tmp_path))
  return tmp_path


def serve_here(sizes, w=None):
  """A fresh dynamo trace of matmul_sum served at `sizes`; checks results."""
  return serve_fresh(matmul_sum, sizes, w)


# A restart that served 3 and 5 serving 3 and 4: 3 traced on the first call,
# 5 replayed before it returns (the call is a hit), then 4 a miss.
COUNTERS_OF_3_5_THEN_3_4 = {
    'DynamoExtractCompiledGraph': 1,
    'DynamoSignatureHit': 1,
    'DynamoSignatureMiss': 2,
    'DynamoEvictedRetrace': 0,
    'DynamoSignatureDropped': 0,
    'DynamoCpuFallbackPartition': 0,
    'DynamoSignaturePrecompiled': 1,
    'DynamoSignaturePrecompileSkipped': 0,
}


def bridge_counters():
  """counters() without UncachedCompile: XLA's own cache keeps the
  programs of earlier tests of this process."""
  got = counters()
  del got['UncachedCompile']
  return got


def the_graph_dir(cache_dir):
  (directory,) = graph_dirs(cache_dir)
  return directory


def rewrite_record(directory, size, edit):
  """Replaces the record of batch `size` by edit(its JSON text)."""
  for name in record_files(directory):
    path = os.path.join(directory, name)
    with open(path) as f:
      text = f.read()
    if json.loads(text)['specs'][0] == {'value': size}:  # s0: x's batch
      os.unlink(path)
      edited = edit(text)
      if edited is not None:
        with open(path, 'w') as f:
          f.write(edited)
      return path
  raise AssertionError(f'no record of size {size}')


def set_field(field, value):
  return lambda text: json.dumps(dict(json.loads(text), **{field: value}))


def with_sizes(sizes):
  """Sets the sizes of x, the first tensor input (inputs: s0, s1, x, s2, w)."""

  def edit(text):
    data = json.loads(text)
    data['specs'][2]['shape'] = sizes
    return json.dumps(data)

  return edit


def make_directory(path):
  os.mkdir(path)
  return None


DAMAGE = {
    'updated_not_a_number': (set_field('created', 'yesterday'), 'created'),
    'size_2_to_the_40': (with_sizes([2**40, 8]), 'over the bound'),
    'negative_size': (with_sizes([-3, 8]), 'non-negative'),
    'text_as_size': (with_sizes(['five', 8]), 'non-negative'),
    'wrong_rank': (with_sizes([5, 8, 1]), 'rank 3'),
    'truncated_json': (lambda text: text[:len(text) // 2], 'unreadable'),
    'specs_not_a_list': (set_field('specs', 'abc'), 'list of 5 input specs'),
    'value_is_text': (lambda text: text.replace('"value": 5', '"value": "5"'),
                      'non-negative integer'),
    'unknown_dtype':
        (lambda text: text.replace('float32', 'float99'), 'unknown dtype'),
    'other_fingerprint': (set_field('fingerprint',
                                    'f' * 32), 'names fingerprint'),
    'format_version': (set_field('format_version', 99), 'format version 99'),
    'huge_file': (lambda text: text + ' ' * (17 << 20), 'larger than'),
    'deeply_nested': (lambda text: '[' * 200000, 'unreadable'),
}


@pytest.mark.parametrize('damage', sorted(DAMAGE) + ['directory'])
def test_damaged_record_is_skipped_and_the_call_is_right(
    indexed, caplog, damage):
  serve_here([3, 5])
  directory = the_graph_dir(indexed)
  if damage == 'directory':
    path = rewrite_record(directory, 5, lambda text: None)
    os.mkdir(path)
    reason = 'unreadable'
  else:
    edit, reason = DAMAGE[damage]
    path = rewrite_record(directory, 5, edit)
  met.clear_all()
  with caplog.at_level(logging.WARNING, logger='torch_xla_patches'):
    serve_here([3, 5, 4])
  # Size 5 is compiled when asked for: a miss, like size 4.
  assert bridge_counters() == dict(COUNTERS_OF_3_5_THEN_3_4,
                                   DynamoSignatureMiss=3,
                                   DynamoSignaturePrecompiled=0,
                                   DynamoSignaturePrecompileSkipped=1)
  (warning,) = [
      r.getMessage()
      for r in caplog.records
      if 'skipped a recorded signature' in r.getMessage()
  ]
  assert path in warning and reason in warning, warning


@pytest.mark.parametrize('name, damage, reason', [
    ('sig-fifo.json', 'fifo', 'not a regular file (a FIFO)'),
    ('sig-zero.json', 'symlink to /dev/zero',
     'not a regular file (a character device)'),
    ('usage-fifo-0.json', 'fifo', 'not a regular file (a FIFO)'),
    ('snapshot-9.json', 'symlink to /dev/zero',
     'not a regular file (a character device)'),
])
def test_a_file_that_is_not_regular_never_stalls_a_call(indexed, caplog, name,
                                                        damage, reason):
  """A FIFO (which a plain open would wait on forever) or a symlink to
  /dev/zero (which never ends) named like an index file is skipped with a
  warning; the call returns the eager result."""
  serve_here([3, 5])
  directory = the_graph_dir(indexed)
  path = os.path.join(directory, name)
  if damage == 'fifo':
    os.mkfifo(path)
  else:
    os.symlink('/dev/zero', path)

  def stalled(signum, frame):
    raise TimeoutError(f'reading {path} stalled')

  previous = signal.signal(signal.SIGALRM, stalled)
  signal.alarm(120)
  met.clear_all()
  try:
    with caplog.at_level(logging.WARNING, logger='torch_xla_patches'):
      serve_here([3, 4])
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
  (warning,) = [
      r.getMessage() for r in caplog.records if path in r.getMessage()
  ]
  assert reason in warning, warning
  record_file = name.startswith('sig-')
  assert bridge_counters() == dict(
      COUNTERS_OF_3_5_THEN_3_4,
      DynamoSignaturePrecompileSkipped=int(record_file))


def test_damaged_usage_file_is_ignored_and_records_still_replay(
    indexed, caplog):
  serve_here([3, 5])
  directory = the_graph_dir(indexed)
  signature_index.flush_all_usage()
  (usage,) = [f for f in os.listdir(directory) if f.startswith('usage-')]
  path = os.path.join(directory, usage)
  with open(path) as f:
    data = json.load(f)
  record_id = next(iter(data['served']))
  data['served'][record_id][1] = 'yesterday'
  with open(path, 'w') as f:
    json.dump(data, f)
  met.clear_all()
  with caplog.at_level(logging.WARNING, logger='torch_xla_patches'):
    serve_here([5, 3])
  assert bridge_counters() == dict(COUNTERS_OF_3_5_THEN_3_4,
                                   DynamoSignatureHit=2,
                                   DynamoSignatureMiss=1)
  assert any('ignoring usage file' in r.getMessage() and path in r.getMessage()
             for r in caplog.records)


def test_a_file_in_place_of_the_graph_directory_never_fails_a_call(
    indexed, caplog):
  serve_here([3])
  directory = the_graph_dir(indexed)
  for name in os.listdir(directory):
    os.unlink(os.path.join(directory, name))
  os.rmdir(directory)
  with open(directory, 'w') as f:
    f.write('not a directory')
  met.clear_all()
  with caplog.at_level(logging.WARNING, logger='torch_xla_patches'):
    serve_here([3, 4])
  assert met.counter_value(backlog.COUNTER_PRECOMPILE_SKIPPED) == 1
  assert any('could not write the signature index' in r.getMessage()
             for r in caplog.records)


def test_replay_order_is_most_served_first(indexed, monkeypatch):
  serve_here([2, 3, 3, 3, 4, 4, 5])
  signature_index.flush_all_usage()
  index = signature_index.open_graph_directory(the_graph_dir(indexed), 0)
  ranked = [(r.specs[0]['value'], r.served) for r in index.load().records]
  assert ranked[:2] == [(3, 3), (4, 2)]
  assert sorted(ranked[2:]) == [(2, 1), (5, 1)]
  # A restart replays at most 2 synchronously: the two most served after the
  # first call's own.
  monkeypatch.setattr(config, 'replay_sync_max_signatures', 2)
  met.clear_all()
  compiled = serve_here([5])
  cache = signature_cache.live_signature_caches()[-1]
  # Least recently used first: the replayed 3 and 4, then the served 5.
  shapes = [dict(s.shape_values)[0] for s in cache.signatures()]
  assert shapes == [3, 4, 5]
  assert cache.backlog_size == 1
  del compiled


def test_sync_replay_stops_at_its_time_budget(indexed, monkeypatch):
  serve_here([2, 3, 4, 5])
  monkeypatch.setattr(config, 'replay_sync_seconds', 1e-9)
  met.clear_all()
  compiled = serve_here([2])
  # The budget is checked before each signature: none starts, all three
  # wait for served calls.
  assert (met.counter_value(backlog.COUNTER_PRECOMPILED) or 0) == 0
  assert signature_cache.live_signature_caches()[-1].backlog_size == 3
  del compiled


def test_compaction_keeps_the_most_served_within_the_cap(indexed):
  serve_here([2, 3, 3, 4, 4, 4])
  signature_index.flush_all_usage()
  directory = the_graph_dir(indexed)
  index = signature_index.open_graph_directory(directory, max_signatures=2)
  assert index.compact()
  names = os.listdir(directory)
  assert not [n for n in names if n.startswith(signature_index.USAGE_PREFIX)]
  assert [n for n in names if n.startswith(signature_index.SNAPSHOT_PREFIX)
         ] == ['snapshot-1.json']
  assert not [n for n in names if n.startswith(signature_index.CLAIM_PREFIX)]
  ranked = [(r.specs[0]['value'], r.served) for r in index.load().records]
  assert ranked == [(4, 3), (3, 2)]
  # Usage written after the snapshot adds to it.
  index.write_usage({index.load().records[1].record_id: (5, 1e10)})
  ranked = [(r.specs[0]['value'], r.served) for r in index.load().records]
  assert ranked == [(3, 7), (4, 3)]


def test_compaction_defers_to_a_fresh_claim_and_to_no_exclusive_create(
    indexed, monkeypatch):
  serve_here([2, 3])
  signature_index.flush_all_usage()
  directory = the_graph_dir(indexed)
  index = signature_index.open_graph_directory(directory, max_signatures=0)
  open(os.path.join(directory, 'claim-1'), 'w').close()
  assert not index.compact()
  os.utime(os.path.join(directory, 'claim-1'),
           (0, 0))  # a compaction that died long ago
  real_open = os.open

  def no_exclusive_create(path, flags, *args):
    if flags & os.O_EXCL:
      raise OSError(errno.EOPNOTSUPP, 'Operation not supported')
    return real_open(path, flags, *args)

  monkeypatch.setattr(os, 'open', no_exclusive_create)
  assert not index.compact()
  monkeypatch.setattr(os, 'open', real_open)
  assert index.compact()
  assert 'snapshot-2.json' in os.listdir(directory)
  assert sum(r.served for r in index.load().records) == 2


# Unit tests of records on a synthetic layout: no XLA needed.

LAYOUT = ArgLayout(kinds=(ArgKind.SHAPE, ArgKind.DYNAMIC_TENSOR,
                          ArgKind.PARAMETER))


def make_fingerprint(code='graph code'):
  return fingerprint.GraphFingerprint(
      (fingerprint.FingerprintPart('graph_code', code),
       fingerprint.FingerprintPart('torch_version', '2.9.0')))


SPECS = ({'value': 4}, {'shape': [4, 8], 'dtype': 'float32'}, None)


def make_record(specs=SPECS):
  return record.RecordedSignature(record_id=record.record_id_of(specs, None),
                                  specs=specs,
                                  shardings=None)


def test_record_files_round_trip(tmp_path):
  index = signature_index.GraphIndex(str(tmp_path), make_fingerprint(), LAYOUT,
                                     0)
  index.record(make_record())
  index.record(make_record())  # written once
  (record,) = index.load().records
  assert record.specs == SPECS
  assert record.source.endswith(f'sig-{record.record_id}.json')
  graph = signature_index.read_graph_file(index.directory)
  assert graph.fingerprint.key == make_fingerprint().key
  assert graph.kinds == LAYOUT.kinds


def test_explain_miss_names_differing_parts(tmp_path):
  signature_index.GraphIndex(str(tmp_path), make_fingerprint(), LAYOUT,
                             0).record(make_record())
  index = signature_index.GraphIndex(str(tmp_path),
                                     make_fingerprint('new code'), LAYOUT, 0)
  assert index.explain_miss().endswith('differs in: graph_code')


def test_cache_cli_lists_verifies_prunes_and_clears(tmp_path, capsys):
  index = signature_index.GraphIndex(str(tmp_path), make_fingerprint(), LAYOUT,
                                     0)
  other = ({'value': 6}, {'shape': [6, 8], 'dtype': 'float32'}, None)
  index.record(make_record())
  index.record(make_record(other))
  index.write_usage({make_record(other).record_id: (3, 1e9)})
  assert cache_cli.main(['list', str(tmp_path)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f'{make_fingerprint().key}: 2 signatures, torch_xla ? on ?'
  assert out[1].startswith('  served      3') and out[1].endswith(
      '0:6 1:float32[6, 8]')
  assert out[2].startswith('  served      0')
  assert cache_cli.main(['stats', str(tmp_path), '--json']) == 0
  stats = json.loads(capsys.readouterr().out)
  assert (stats['graphs'], stats['signatures'], stats['calls_served'],
          stats['unusable_files']) == (1, 2, 3, 0)
  assert cache_cli.main(['verify', str(tmp_path)]) == 0
  capsys.readouterr()
  with open(os.path.join(index.directory, 'sig-bogus.json'), 'w') as f:
    f.write('{')
  assert cache_cli.main(['verify', str(tmp_path)]) == 1
  assert f'BAD {make_fingerprint().key}/sig-bogus.json: unreadable' in (
      capsys.readouterr().out)
  os.unlink(os.path.join(index.directory, 'sig-bogus.json'))
  assert cache_cli.main(['prune', str(tmp_path), '--max', '1']) == 0
  assert capsys.readouterr().out.endswith('2 -> 1 signatures\n')
  (kept,) = index.load().records
  assert kept.specs == other and kept.served == 3
  assert cache_cli.main(['clear', str(tmp_path)]) == 0
  assert not os.path.exists(index.directory)


def test_cache_cli_runs_as_a_module(tmp_path):
  signature_index.GraphIndex(str(tmp_path), make_fingerprint(), LAYOUT,
                             0).record(make_record())
  proc = subprocess.run(
      [sys.executable, '-m', 'torch_xla_patches.cache', 'stats',
       str(tmp_path)],
      capture_output=True,
      text=True,
      env=dict(os.environ, PYTHONPATH=REPO_ROOT),
      timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert 'signatures: 1' in proc.stdout


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

"""The persistent signature index: fresh processes precompile what it knows;
concurrent writers keep the union; damaged files are ignored with a warning."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from torch_xla_patches import fingerprint, persistent
from torch_xla_patches.signature import ArgKind, ArgLayout
from bridge_testing import REPO_ROOT, run_python

SERVE_SCRIPT = r'''
import sys
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
torch_xla_patches.apply(cache_dir=sys.argv[1])
device = torch_xla.device()

def fn(x, w):
  return torch.tanh(x @ w).sum(dim=0) + x.shape[0]

compiled = torch.compile(fn, backend='openxla', dynamic=True)
w = torch.randn(8, 4)
for n in [int(s) for s in sys.argv[2].split(',')]:
  x = torch.randn(n, 8)
  torch.testing.assert_close(compiled(x.to(device), w.to(device)).cpu(),
                             fn(x, w), rtol=1e-4, atol=1e-4)
  print('after', n, met.counter_value('DynamoSignatureMiss') or 0,
        met.counter_value('DynamoSignaturePrecompiled') or 0, flush=True)
'''


def serve(cache_dir, sizes, env=None):
  proc = run_python(SERVE_SCRIPT.replace('sys.argv[1]',
                                         repr(str(cache_dir))).replace(
                                             'sys.argv[2]', repr(sizes)),
                    env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [
      line.split()
      for line in proc.stdout.splitlines()
      if line.startswith('after')
  ]
  return [(int(n), int(miss), int(pre)) for _, n, miss, pre in rows], proc


def index_files(cache_dir):
  directory = os.path.join(cache_dir, 'signatures')
  return [
      os.path.join(directory, f)
      for f in sorted(os.listdir(directory))
      if f.endswith('.json')
  ]


def test_fresh_process_precompiles_every_known_signature_first(tmp_path):
  serve(tmp_path, '3,4,5,6')
  rows, proc = serve(tmp_path, '6,5,4,3,7')
  # First call: its own signature is traced (a miss), the other three known
  # ones are compiled from the index before the call returns.
  assert rows[0] == (6, 1, 3)
  # Known signatures never miss afterwards; only the new size 7 does.
  assert [r[1] for r in rows] == [1, 1, 1, 1, 2]
  assert '[precompile 3/3]' in proc.stderr
  (path,) = index_files(tmp_path)
  with open(path) as f:
    assert len(json.load(f)['signatures']) == 5


def test_unloadable_persisted_executables_are_reported_once(tmp_path):
  env = {'XLA_PATCHES_PERSISTENT_EXECUTABLES': '1'}
  serve(tmp_path, '3,5', env=env)
  assert os.listdir(os.path.join(tmp_path, 'xla'))
  rows, proc = serve(tmp_path, '5,3', env=env)
  # torch_xla 2.9 on CPU cannot deserialize what it wrote: the index still
  # gets signature 3 compiled before it is asked for, and the user is told
  # plainly, once, that nothing came from disk.
  assert rows == [(5, 1, 1), (3, 1, 1)]
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


def test_four_processes_writing_at_once_keep_the_union(tmp_path):
  code = SERVE_SCRIPT.replace('sys.argv[1]', repr(str(tmp_path)))
  env = dict(os.environ, PJRT_DEVICE='CPU', PYTHONPATH=REPO_ROOT)
  procs = [
      subprocess.Popen(
          [sys.executable, '-c',
           code.replace('sys.argv[2]', repr(sizes))],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True)
      # No first size equals one of w's (8, 4): dynamo would tie them into
      # another graph (duck sizing), with a fingerprint of its own.
      for sizes in ('2,3', '5,4', '6,7', '3,8')
  ]
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
  (path,) = index_files(tmp_path)
  entry = persistent.read_index_file(path)
  sizes = sorted(dict(sig[0].items())['value'] for sig in entry.signatures)
  assert sizes == [2, 3, 4, 5, 6, 7, 8]
  assert not [f for f in os.listdir(os.path.dirname(path)) if '.tmp-' in f]


# Unit tests of the index on a synthetic layout: no XLA needed.

LAYOUT = ArgLayout(kinds=(ArgKind.SHAPE, ArgKind.DYNAMIC_TENSOR,
                          ArgKind.PARAMETER))


def make_fingerprint(code='graph code'):
  return fingerprint.GraphFingerprint(
      (fingerprint.FingerprintPart('graph_code', code),
       fingerprint.FingerprintPart('torch_version', '2.9.0')))


SIG = ({'value': 4}, {'shape': [4, 8], 'dtype': 'float32'}, None)


def recorded(tmp_path, fp=None):
  index = persistent.SignatureIndex(str(tmp_path))
  index.record(fp or make_fingerprint(), LAYOUT, [SIG])
  return index


@pytest.mark.parametrize(
    'damage, reason',
    [(lambda text: text[:len(text) // 2], 'unreadable'),
     (lambda text: 'garbage\x00', 'unreadable'),
     (lambda text: text.replace('"format_version": 1', '"format_version": 99'),
      'format version 99'),
     (lambda text: text.replace('"signatures"', '"sigs"'), 'malformed'),
     (lambda text: json.dumps([1, 2]), 'not a JSON object')])
def test_damaged_index_file_is_ignored_with_a_warning(tmp_path, damage, reason):
  index = recorded(tmp_path)
  path = index.path_for(make_fingerprint().key)
  with open(path) as f:
    text = f.read()
  with open(path, 'w') as f:
    f.write(damage(text))
  with pytest.warns(UserWarning, match=reason):
    assert index.load(make_fingerprint(), LAYOUT) == []


def test_file_naming_another_fingerprint_is_never_used(tmp_path):
  index = recorded(tmp_path, make_fingerprint('other graph'))
  other_path = index.path_for(make_fingerprint('other graph').key)
  os.rename(other_path, index.path_for(make_fingerprint().key))
  with pytest.warns(UserWarning, match='names fingerprint'):
    assert index.load(make_fingerprint(), LAYOUT) == []


def test_recording_over_a_damaged_file_replaces_it(tmp_path):
  index = persistent.SignatureIndex(str(tmp_path))
  os.makedirs(index.directory)
  with open(index.path_for(make_fingerprint().key), 'w') as f:
    f.write('{not json')
  with pytest.warns(UserWarning, match='replacing signature index'):
    index.record(make_fingerprint(), LAYOUT, [SIG])
  assert index.load(make_fingerprint(), LAYOUT) == [SIG]


def test_record_is_a_set_union(tmp_path):
  index = recorded(tmp_path)
  other = ({'value': 6}, {'shape': [6, 8], 'dtype': 'float32'}, None)
  index.record(make_fingerprint(), LAYOUT, [SIG, other])
  assert index.load(make_fingerprint(), LAYOUT) == [SIG, other]


def test_explain_miss_names_differing_parts(tmp_path):
  index = recorded(tmp_path)
  assert index.explain_miss(
      make_fingerprint('new code')).endswith('differs in: graph_code')


def test_rebuild_args_uses_live_parameters_and_recorded_sizes():
  live = [7, torch.ones(7, 8), torch.nn.Parameter(torch.ones(3))]
  args = persistent.rebuild_args(LAYOUT, SIG, live, 'cpu')
  assert args[0] == 4
  assert args[1].shape == (4, 8) and args[1].dtype == torch.float32
  assert args[2] is live[2]


def test_cache_cli_lists_verifies_and_clears(tmp_path, capsys):
  sys.path.insert(0, os.path.join(REPO_ROOT, 'tools'))
  import xla_cache
  index = recorded(tmp_path)
  assert xla_cache.main(['list', str(tmp_path)]) == 0
  assert '0=4 1:float32[4, 8]' in capsys.readouterr().out
  assert xla_cache.main(['verify', str(tmp_path)]) == 0
  with open(index.path_for('bogus'), 'w') as f:
    f.write('{')
  assert xla_cache.main(['verify', str(tmp_path)]) == 1
  assert 'BAD bogus.json: unreadable' in capsys.readouterr().out
  assert xla_cache.main(['clear', str(tmp_path)]) == 0
  assert not os.path.exists(index.directory)


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

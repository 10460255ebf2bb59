"""Saved compiled models: a fresh process loads one with no dynamo frame
compile, serves old and new shapes equal to eager, and refuses artifacts of
other versions, other model source, or damaged files."""
import dataclasses
import hashlib
import json
import os
import pickle
import textwrap

import pytest
import torch

from torch_xla_patches import artifact as artifact_format
from torch_xla_patches import serialization
from bridge_testing import run_python

pytestmark = pytest.mark.requires('torch_aot_compile')

# The model lives in a file of its own so both processes (and the source
# digest) see the same class.
MODEL_SOURCE = '''
import torch


class TinyNet(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(8, 16)
    self.norm = torch.nn.LayerNorm(16)
    self.register_buffer('offset', torch.zeros(16))

  def forward(self, x):
    return self.norm(torch.relu(self.proj(x))) * 2 + self.offset
'''

SAVE_SCRIPT = '''
import sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla_patches
from torch._dynamo.utils import counters
from torch_xla_patches import serialization
from tiny_model import TinyNet
torch_xla_patches.apply()
device = torch_xla.device()
torch.manual_seed(0)
model = TinyNet().to(device).eval()
compiled = serialization.aot_compile(model, (torch.randn(3, 8).to(device),))
for batch in (3, 5):
  compiled(torch.randn(batch, 8).to(device)).cpu()
torch_xla_patches.save(compiled, {path!r})
print('frames', counters['stats']['unique_graphs'], flush=True)
'''

LOAD_SCRIPT = '''
import sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
from torch._dynamo.utils import counters
from tiny_model import TinyNet
torch_xla_patches.apply()
device = torch_xla.device()
# Other weights than the saving process: they must come from this model.
torch.manual_seed(1)
cpu_model = TinyNet().eval()
with torch.no_grad():
  cpu_model.offset.copy_(torch.randn(16))
model = TinyNet().to(device).eval()
model.load_state_dict(cpu_model.state_dict())
loaded = torch_xla_patches.load({path!r}, model=model)
print('precompiled', met.counter_value('DynamoSignaturePrecompiled') or 0)
for batch in (5, 3, 7, 12, 1, 2):
  x = torch.randn(batch, 8)
  with torch.no_grad():
    expected = cpu_model(x)
  torch.testing.assert_close(loaded(x.to(device)).cpu(), expected,
                             rtol=1e-4, atol=1e-4)
print('misses', met.counter_value('DynamoSignatureMiss') or 0)
# Saving again keeps the loaded signatures and adds the new ones.
print('recorded', len(loaded.backend_callable.recorded_signatures()))
# torch's saved guards still hold: a static size that differs is refused.
try:
  loaded(torch.randn(4, 9).to(device))
except RuntimeError as e:
  print('guard', int('GuardManager check failed' in str(e)))
print('frames', counters['stats']['unique_graphs'],
      sum(counters['frames'].values()), flush=True)
'''


def _write_model(directory, source=MODEL_SOURCE):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'tiny_model.py'), 'w') as f:
    f.write(source)
  return str(directory)


def _values(stdout, name):
  for line in stdout.splitlines():
    if line.startswith(name + ' '):
      return [int(v) for v in line.split()[1:]]
  raise AssertionError(f'no {name!r} line in:\n{stdout}')


@pytest.fixture(scope='module')
def artifact(tmp_path_factory):
  """(model directory, artifact path) saved by a separate process."""
  root = tmp_path_factory.mktemp('serialization')
  model_dir = _write_model(root / 'model')
  path = str(root / 'tiny.xla_aot')
  proc = run_python(SAVE_SCRIPT.format(model_dir=model_dir, path=path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The saving process did trace the frame once: the load below must not.
  assert _values(proc.stdout, 'frames') == [1]
  return model_dir, path


def test_fresh_process_loads_without_dynamo_and_matches_eager(artifact):
  model_dir, path = artifact
  proc = run_python(LOAD_SCRIPT.format(model_dir=model_dir, path=path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Two signatures were recorded (batch 3 and 5); loading warms up on the
  # first and precompiles the other.
  assert _values(proc.stdout, 'precompiled') == [1]
  # Warm-up call (3) + the new batches 7, 12, 1 and 2, compiled on demand.
  assert _values(proc.stdout, "misses") == [5]
  # Batches 3 and 5 (loaded) plus 7, 12, 1 and 2 (served here).
  assert _values(proc.stdout, 'recorded') == [6]
  assert _values(proc.stdout, 'guard') == [1]
  # No dynamo frame was captured or compiled in the loading process.
  assert _values(proc.stdout, 'frames') == [0, 0]


FUNCTION_SAVE = '''
import sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla_patches
from tiny_model import scaled_tanh
torch_xla_patches.apply()
device = torch_xla.device()
torch_xla_patches.save(scaled_tanh, {path!r},
                       example_inputs=(torch.randn(4, 6).to(device), 3))
'''

FUNCTION_LOAD = '''
import sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla_patches
from torch._dynamo.utils import counters
from tiny_model import scaled_tanh
torch_xla_patches.apply()
device = torch_xla.device()
loaded = torch_xla_patches.load({path!r}, model=scaled_tanh)
for rows, cols in ((4, 6), (9, 6), (2, 11)):
  x = torch.randn(rows, cols)
  torch.testing.assert_close(loaded(x.to(device), 3).cpu(),
                             scaled_tanh(x, 3), rtol=1e-4, atol=1e-4)
print('frames', counters['stats']['unique_graphs'], flush=True)
'''


def test_function_saved_from_example_inputs_round_trips(tmp_path):
  model_dir = _write_model(
      tmp_path / 'model', MODEL_SOURCE + textwrap.dedent('''

      def scaled_tanh(x, k):
        return torch.tanh(x) * k + x.shape[0]
      '''))
  path = str(tmp_path / 'fn.xla_aot')
  for script in (FUNCTION_SAVE, FUNCTION_LOAD):
    proc = run_python(script.format(model_dir=model_dir, path=path))
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert _values(proc.stdout, 'frames') == [0]


def _rewrite_header(path, out_path, **changes):
  with open(path, 'rb') as f:
    data = f.read()
  magic_end = data.index(b'\n') + 1
  header_end = data.index(b'\n', magic_end)
  header = json.loads(data[magic_end:header_end])
  header.update(changes)
  with open(out_path, 'wb') as f:
    f.write(data[:magic_end] + json.dumps(header).encode() + b'\n' +
            data[header_end + 1:])


def test_other_versions_are_refused_naming_both(artifact, tmp_path):
  _, path = artifact
  stale = str(tmp_path / 'stale.xla_aot')
  _rewrite_header(path, stale, torch_version='2.8.0', python_version='3.10.1')
  with pytest.raises(serialization.ArtifactMismatchError) as info:
    serialization.load(stale, model=torch.nn.Linear(2, 2))
  message = str(info.value)
  assert 'torch 2.8.0 (found ' + torch.__version__ + ')' in message
  assert 'Python 3.10.1' in message


def test_changed_model_source_is_refused(artifact, tmp_path):
  _, path = artifact
  changed_dir = _write_model(tmp_path / 'changed',
                             MODEL_SOURCE.replace('* 2', '* 3'))
  proc = run_python(
      textwrap.dedent(f'''
      import sys
      sys.path.insert(0, {changed_dir!r})
      import torch_xla_patches
      from torch_xla_patches import serialization
      from tiny_model import TinyNet
      try:
        torch_xla_patches.load({path!r}, model=TinyNet())
      except serialization.ArtifactMismatchError as e:
        print('refused', e)
      '''))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith('refused'), proc.stdout
  assert 'tiny_model.TinyNet: expected ' in proc.stdout
  # Unchanged classes are not blamed.
  assert 'LayerNorm' not in proc.stdout


def test_another_model_class_is_refused(artifact):
  _, path = artifact
  with pytest.raises(serialization.ArtifactMismatchError,
                     match='model source differs'):
    serialization.load(path, model=torch.nn.Linear(8, 16))


DAMAGED_SIGNATURES_SCRIPT = r'''
import hashlib, io, json, pickle, sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
from torch_xla_patches import artifact, serialization
from tiny_model import TinyNet
torch_xla_patches.apply()
device = torch_xla.device()


def batch5(signatures):
  """Index of the record of batch 5 and the position of its input x."""
  for index, specs in enumerate(signatures['specs']):
    for position, spec in enumerate(specs):
      if spec and spec.get('shape', [None])[0] == 5:
        return index, position
  raise AssertionError(signatures)


def set_sizes(sizes):
  def damage(signatures):
    index, position = batch5(signatures)
    signatures['specs'][index][position]['shape'] = sizes
  return damage


def specs_not_a_list(signatures):
  index, _ = batch5(signatures)
  signatures['specs'][index] = 'abc'


def list_not_a_list(signatures):
  signatures['specs'] = 12


DAMAGES = dict(size_2_to_the_40=set_sizes([2**40, 8]),
               negative_size=set_sizes([-3, 8]),
               text_as_size=set_sizes(['five', 8]),
               specs_not_a_list=specs_not_a_list,
               list_not_a_list=list_not_a_list)


def damaged_copy(path, out, damage):
  """The artifact with its recorded signatures damaged and its checksum
  made valid again: what a buggy writer could produce."""
  with open(path, 'rb') as f:
    data = f.read()
  magic_end = data.index(b'\n') + 1
  header_end = data.index(b'\n', magic_end)
  header = json.loads(data[magic_end:header_end])
  state = pickle.loads(data[header_end + 1:])
  deserializer, inner = state['compiled_fn']
  inner_state = pickle.loads(inner)
  damage(inner_state['signatures'])
  state['compiled_fn'] = (deserializer, pickle.dumps(inner_state))
  stream = io.BytesIO()
  artifact.ClosurePickler(stream).dump(state)
  payload = stream.getvalue()
  header.update(payload_sha256=hashlib.sha256(payload).hexdigest(),
                payload_size=len(payload))
  with open(out, 'wb') as f:
    f.write(data[:magic_end] + json.dumps(header).encode() + b'\n' + payload)


torch.manual_seed(1)
cpu_model = TinyNet().eval()
model = TinyNet().to(device).eval()
model.load_state_dict(cpu_model.state_dict())
for name, damage in DAMAGES.items():
  out = {out_dir!r} + '/' + name + '.xla_aot'
  damaged_copy({path!r}, out, damage)
  before = met.counter_value('DynamoSignaturePrecompileSkipped') or 0
  loaded = torch_xla_patches.load(out, model=model)
  x = torch.randn(5, 8)
  with torch.no_grad():
    expected = cpu_model(x)
  torch.testing.assert_close(loaded(x.to(device)).cpu(), expected,
                             rtol=1e-4, atol=1e-4)
  skipped = (met.counter_value('DynamoSignaturePrecompileSkipped') or 0) - before
  print('skipped', name, skipped, flush=True)
'''


def test_damaged_recorded_signatures_are_skipped(artifact, tmp_path):
  """Recorded signatures an artifact holds that fail a check are skipped:
  the call returns the eager result, a warning names the file, and
  DynamoSignaturePrecompileSkipped counts each."""
  model_dir, path = artifact
  proc = run_python(
      DAMAGED_SIGNATURES_SCRIPT.format(model_dir=model_dir,
                                       path=path,
                                       out_dir=str(tmp_path)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  skipped = {
      line.split()[1]: int(line.split()[2])
      for line in proc.stdout.splitlines()
      if line.startswith('skipped ')
  }
  assert skipped == {
      'size_2_to_the_40': 1,
      'negative_size': 1,
      'text_as_size': 1,
      'specs_not_a_list': 1,
      'list_not_a_list': 1,
  }
  reasons = {
      'size_2_to_the_40': 'over the bound',
      'negative_size': 'non-negative integers',
      'text_as_size': 'non-negative integers',
      'specs_not_a_list': "found 'abc'",
      'list_not_a_list': 'found 12',
  }
  for name, reason in reasons.items():
    (line,) = [
        line for line in proc.stderr.splitlines()
        if f'{name}.xla_aot' in line and 'skipped a recorded signature' in line
    ]
    assert reason in line, line


# Each kind of damage and the check that must catch it (artifact.read_header).
DAMAGE_MESSAGES = {
    'truncated': 'is truncated or padded: payload of ',
    'flipped': 'is corrupt: payload SHA-256 ',
    'not_artifact': 'is not a torch_xla_patches artifact (no magic line)',
    'bad_header': 'has a malformed header: ',
    'no_capture': 'has a malformed header: captures is 0, expected a count ',
}


@pytest.mark.parametrize('damage', sorted(DAMAGE_MESSAGES))
def test_damaged_file_is_refused(artifact, tmp_path, damage):
  _, path = artifact
  with open(path, 'rb') as f:
    data = f.read()
  if damage == 'truncated':
    data = data[:len(data) - 100]
  elif damage == 'flipped':
    data = data[:-50] + bytes([data[-50] ^ 0xFF]) + data[-49:]
  elif damage == 'not_artifact':
    data = b'\x80\x04hello'
  elif damage == 'bad_header':
    magic_end = data.index(b'\n') + 1
    data = data[:magic_end] + b'{"format_version": 1, "torch_v' + b'\n'
  broken = str(tmp_path / 'broken.xla_aot')
  if damage == 'no_capture':
    # A header that checks out but for its count: no capture, and an empty
    # list as the payload.
    header, _ = artifact_format.read_header(path)
    empty = pickle.dumps([])
    artifact_format.write(
        broken,
        dataclasses.replace(header,
                            captures=0,
                            payload_sha256=hashlib.sha256(empty).hexdigest(),
                            payload_size=len(empty)), empty)
  else:
    with open(broken, 'wb') as f:
      f.write(data)
  with pytest.raises(serialization.ArtifactCorruptError) as info:
    serialization.load(broken, model=torch.nn.Linear(8, 16))
  assert str(info.value).startswith('torch_xla_patches: ')
  assert broken in str(info.value)
  assert DAMAGE_MESSAGES[damage] in str(info.value)


INDEX_AND_ARTIFACT_SAVE = '''
import sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla_patches
from torch_xla_patches import serialization
from tiny_model import TinyNet
torch_xla_patches.apply(cache_dir={cache_dir!r})
device = torch_xla.device()
model = TinyNet().to(device).eval()
compiled = serialization.aot_compile(model, (torch.randn(3, 8).to(device),))
for batch in (3, 5, 7, 9, 11):
  compiled(torch.randn(batch, 8).to(device)).cpu()
torch_xla_patches.save(compiled, {path!r})
'''

INDEX_AND_ARTIFACT_LOAD = '''
import sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
from tiny_model import TinyNet
torch_xla_patches.apply(cache_dir={cache_dir!r})
device = torch_xla.device()
torch.manual_seed(1)
cpu_model = TinyNet().eval()
model = TinyNet().to(device).eval()
model.load_state_dict(cpu_model.state_dict())
loaded = torch_xla_patches.load({path!r}, model=model, precompile=False)
for batch in (4, 6):
  x = torch.randn(batch, 8)
  with torch.no_grad():
    expected = cpu_model(x)
  torch.testing.assert_close(loaded(x.to(device)).cpu(), expected,
                             rtol=1e-4, atol=1e-4)
  print('after', batch, met.counter_value('DynamoSignaturePrecompiled') or 0,
        met.counter_value('DynamoSignaturePrecompileSkipped') or 0,
        met.counter_value('DynamoSignatureMiss') or 0, flush=True)
'''


def test_index_and_artifact_share_one_first_call_budget(artifact, tmp_path):
  """A restart with both a signature index and an artifact (the same five
  signatures in each) waits for one synchronous budget, not one per
  source: with XLA_PATCHES_REPLAY_SYNC_MAX=2 the first call returns after
  its own compile and 2 replayed ones; each later call replays one more."""
  model_dir, _ = artifact
  cache_dir = str(tmp_path / 'cache')
  path = str(tmp_path / 'indexed.xla_aot')
  proc = run_python(
      INDEX_AND_ARTIFACT_SAVE.format(model_dir=model_dir,
                                     cache_dir=cache_dir,
                                     path=path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  proc = run_python(INDEX_AND_ARTIFACT_LOAD.format(model_dir=model_dir,
                                                   cache_dir=cache_dir,
                                                   path=path),
                    env={'XLA_PATCHES_REPLAY_SYNC_MAX': '2'})
  assert proc.returncode == 0, proc.stderr[-3000:]
  # (batch, precompiled, skipped, misses) after each call.
  rows = [[int(v)
           for v in line.split()[1:]]
          for line in proc.stdout.splitlines()
          if line.startswith('after ')]
  assert rows == [[4, 2, 0, 1], [6, 3, 0, 2]]


class Adds(torch.nn.Module):

  def forward(self, x, y):
    return x * 2 + y


def test_an_argument_marked_static_is_read_from_each_call(
    patched_bridge, tmp_path):
  # See [Note: Arguments marked static] in serialization.py: transformers
  # marks a StaticCache's tensors so, and a graph that kept the first
  # call's tensor would read it for every later call.
  import torch_xla
  device = torch_xla.device()
  model = Adds().to(device)
  x = torch.randn(3, 4)
  marked = torch.randn(3, 4).to(device)
  torch._dynamo.mark_static_address(marked)
  compiled = serialization.aot_compile(model, (x.to(device), marked))
  assert marked._dynamo_static_input_type == 'guarded'
  other = torch.randn(3, 4)
  torch.testing.assert_close(
      compiled(x.to(device), other.to(device)).cpu(), x * 2 + other)
  path = serialization.save(compiled, str(tmp_path / 'adds.xla_aot'))
  loaded = serialization.load(path, model=model, precompile=False)
  third = torch.randn(3, 4)
  torch.testing.assert_close(
      loaded(x.to(device), third.to(device)).cpu(), x * 2 + third)


def test_a_view_argument_is_saved(patched_bridge, tmp_path):
  # An argument sliced from a larger tensor (transformers' attention mask):
  # the graph's description of it must not hold its base's fake mode.
  import torch_xla
  device = torch_xla.device()
  model = Adds().to(device)
  x = torch.randn(3, 4)
  base = torch.randn(3, 8)
  compiled = serialization.aot_compile(model,
                                       (x.to(device), base.to(device)[:, 2:6]))
  path = serialization.save(compiled, str(tmp_path / 'adds.xla_aot'))
  loaded = serialization.load(path, model=model, precompile=False)
  torch.testing.assert_close(
      loaded(x.to(device),
             base.to(device)[:, 1:5]).cpu(), x * 2 + base[:, 1:5])

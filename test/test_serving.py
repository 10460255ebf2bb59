"""serve(): every bucket compiled before it returns, results equal eager in
and outside the buckets, restarts that skip dynamo, and a cache directory
that can never fail a call."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from torch_xla_patches import TensorSpec
from bridge_testing import REPO_ROOT, counters, run_python


class TinyLM(torch.nn.Module):

  def __init__(self, width=16):
    super().__init__()
    self.embed = torch.nn.Embedding(64, width)
    self.norm = torch.nn.LayerNorm(width)
    self.proj = torch.nn.Linear(width, width)

  def forward(self, tokens):
    x = self.norm(self.embed(tokens))
    return self.proj(torch.relu(x)).sum(dim=1)


BUCKETS = [(TensorSpec((b, s), torch.long),) for b in (2, 4) for s in (8, 16)]


def models(width):
  torch.manual_seed(0)
  cpu = TinyLM(width).eval()
  model = TinyLM(width).to(torch_xla.device()).eval()
  model.load_state_dict(cpu.state_dict())
  return cpu, model


def check_against_eager(served, cpu, shapes, dtype=torch.long):
  for batch, seq in shapes:
    tokens = torch.randint(0, 64, (batch, seq), dtype=dtype)
    with torch.no_grad():
      expected = cpu(tokens)
    torch.testing.assert_close(served(tokens.to(torch_xla.device())).cpu(),
                               expected,
                               rtol=1e-4,
                               atol=1e-4)


def test_serve_compiles_every_bucket_before_it_returns(patched_bridge):
  cpu, model = models(width=24)
  served = torch_xla_patches.serve(model, BUCKETS)
  after_serve = counters()
  assert after_serve['DynamoSignatureMiss'] == len(BUCKETS)
  assert after_serve['UncachedCompile'] == len(BUCKETS)
  check_against_eager(served, cpu, [(2, 8), (4, 16), (2, 16), (4, 8)])
  # Every bucket is a hit now.
  assert counters()['DynamoSignatureMiss'] == len(BUCKETS)
  # A shape outside the buckets is compiled on demand.
  check_against_eager(served, cpu, [(3, 5)])
  assert counters()['DynamoSignatureMiss'] == len(BUCKETS) + 1


@pytest.mark.requires('torch_aot_compile')
def test_serve_after_a_torch_compile_call_with_grad_enabled(patched_bridge):
  # torch 2.9's aot_compile reused the grad mode of the last torch.compile'd
  # frame and failed its own guard ("GLOBAL_STATE changed: grad_mode").
  double = torch.compile(lambda x: x * 2, backend='openxla', dynamic=True)
  assert torch.is_grad_enabled()
  double(torch.ones(3, device=torch_xla.device()))
  cpu, model = models(width=12)
  served = torch_xla_patches.serve(model, BUCKETS[:1])
  check_against_eager(served, cpu, [(2, 8), (3, 8)])


def test_serve_refuses_what_it_cannot_serve(patched_bridge):
  _, model = models(width=8)
  with pytest.raises(ValueError, match='signatures is empty'):
    torch_xla_patches.serve(model, [])
  with pytest.raises(TypeError,
                     match='signature 0: argument 0 is Tensor; describe '
                     'tensors with TensorSpec'):
    torch_xla_patches.serve(model, [(torch.zeros(2, 8),)])
  with pytest.raises(ValueError, match='embed.weight is on cpu'):
    torch_xla_patches.serve(TinyLM(8), BUCKETS)


MODEL_SOURCE = '''
import torch


class ServedLM(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.embed = torch.nn.Embedding(64, 16)
    self.norm = torch.nn.LayerNorm(16)
    self.proj = torch.nn.Linear(16, 16)

  def forward(self, tokens):
    return self.proj(torch.relu(self.norm(self.embed(tokens)))).sum(dim=1)
'''

SERVE_SCRIPT = '''
import json, sys
sys.path.insert(0, {model_dir!r})
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
from torch._dynamo.utils import counters
from torch_xla_patches import TensorSpec
from served_lm import ServedLM
device = torch_xla.device()
torch.manual_seed(0)
cpu = ServedLM().eval()
model = ServedLM().to(device).eval()
model.load_state_dict(cpu.state_dict())
buckets = [(TensorSpec((b, s), torch.long),) for b in (2, 4) for s in (8, 16)]
{before_serve}
served = torch_xla_patches.serve(model, buckets, cache_dir={cache_dir!r})
report = dict(loaded=served.loaded,
              frames=counters['stats']['unique_graphs'],
              compiles=met.metric_data('CompileTime')[0])
for b, s in [(2, 8), (4, 16), (3, 5)]:
  x = torch.randint(0, 64, (b, s))
  with torch.no_grad():
    expected = cpu(x)
  torch.testing.assert_close(served(x.to(device)).cpu(), expected,
                             rtol=1e-4, atol=1e-4)
report['frames_after_calls'] = counters['stats']['unique_graphs']
print(json.dumps(report), flush=True)
'''


def write_model(directory, source=MODEL_SOURCE):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'served_lm.py'), 'w') as f:
    f.write(source)
  return str(directory)


# Holds each process before serve() until `parties` processes reach it, so
# that they all look for the artifact before any of them has written it.
BARRIER = '''
import os, time
open(os.path.join({barrier_dir!r}, str(os.getpid())), 'w').close()
deadline = time.monotonic() + 300
while len(os.listdir({barrier_dir!r})) < {parties}:
  assert time.monotonic() < deadline, 'the other processes never came'
  time.sleep(0.01)
'''


def serve_script(model_dir, cache_dir, barrier_dir=None, parties=0):
  before_serve = (BARRIER.format(barrier_dir=str(barrier_dir), parties=parties)
                  if barrier_dir else '')
  return SERVE_SCRIPT.format(model_dir=model_dir,
                             cache_dir=cache_dir,
                             before_serve=before_serve)


def serve_in_process(model_dir, cache_dir):
  """(report, stderr) of a fresh process that serves the model."""
  proc = run_python(serve_script(model_dir, cache_dir))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def artifacts(cache_dir):
  return sorted(os.listdir(os.path.join(cache_dir, 'serve')))


def tracing_lines(stderr):
  return [
      line for line in stderr.splitlines()
      if line.startswith('torch_xla_patches.serve: tracing ServedLM')
  ]


@pytest.mark.requires('torch_aot_compile')
def test_a_restart_loads_the_artifact_and_makes_no_dynamo_frame(tmp_path):
  model_dir = write_model(tmp_path / 'model')
  cache_dir = str(tmp_path / 'cache')
  first, stderr = serve_in_process(model_dir, cache_dir)
  assert (first['loaded'], first['frames']) == (False, 1)
  assert first['compiles'] == 4
  (line,) = tracing_lines(stderr)
  assert line.endswith('(no artifact of this model yet)')
  (name,) = artifacts(cache_dir)
  assert name.startswith('ServedLM-') and name.endswith('.xla_aot')
  restart, stderr = serve_in_process(model_dir, cache_dir)
  # No dynamo frame, before or after the calls (3x5 was recorded by the
  # first process and compiled during serve() too).
  assert (restart['loaded'], restart['frames'],
          restart['frames_after_calls']) == (True, 0, 0)
  assert restart['compiles'] == 5
  assert not tracing_lines(stderr)


@pytest.mark.requires('torch_aot_compile')
def test_an_edited_model_or_a_damaged_artifact_traces_again_with_the_reason(
    tmp_path):
  model_dir = write_model(tmp_path / 'model')
  cache_dir = str(tmp_path / 'cache')
  serve_in_process(model_dir, cache_dir)
  (original,) = artifacts(cache_dir)
  # Edited source: another key, the old artifact named as the closest.
  write_model(model_dir, MODEL_SOURCE.replace('.sum(dim=1)', '.sum(dim=-1)'))
  edited, stderr = serve_in_process(model_dir, cache_dir)
  assert (edited['loaded'], edited['frames']) == (False, 1)
  (line,) = tracing_lines(stderr)
  assert (f'no artifact of this key; the closest, {original} differs in '
          'source: served_lm.ServedLM ') in line, line
  assert len(artifacts(cache_dir)) == 2
  # A damaged artifact: traced again, and replaced by a good one.
  write_model(model_dir)
  path = os.path.join(cache_dir, 'serve', original)
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) - 100)
  damaged, stderr = serve_in_process(model_dir, cache_dir)
  assert (damaged['loaded'], damaged['frames']) == (False, 1)
  (line,) = tracing_lines(stderr)
  assert 'is truncated or padded' in line, line
  repaired, _ = serve_in_process(model_dir, cache_dir)
  assert (repaired['loaded'], repaired['frames']) == (True, 0)


@pytest.mark.requires('torch_aot_compile')
def test_a_fifo_in_place_of_the_artifact_never_stalls_serve(tmp_path):
  model_dir = write_model(tmp_path / 'model')
  cache_dir = str(tmp_path / 'cache')
  serve_in_process(model_dir, cache_dir)
  (name,) = artifacts(cache_dir)
  path = os.path.join(cache_dir, 'serve', name)
  os.unlink(path)
  os.mkfifo(path)
  report, stderr = serve_in_process(model_dir, cache_dir)
  assert (report['loaded'], report['frames']) == (False, 1)
  (line,) = tracing_lines(stderr)
  assert 'not a regular file (a FIFO)' in line, line


@pytest.mark.requires('torch_aot_compile')
def test_two_processes_writing_one_cache_directory(tmp_path):
  model_dir = write_model(tmp_path / 'model')
  cache_dir = str(tmp_path / 'cache')
  barrier_dir = tmp_path / 'barrier'
  barrier_dir.mkdir()
  env = dict(os.environ, PJRT_DEVICE='CPU', PYTHONPATH=REPO_ROOT)
  # Without the barrier, a process slow to import torch_xla found the
  # artifact the other had already written, and loaded it.
  procs = [
      subprocess.Popen([
          sys.executable, '-c',
          serve_script(model_dir, cache_dir, barrier_dir, parties=2)
      ],
                       env=env,
                       stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE,
                       text=True) for _ in range(2)
  ]
  for proc in procs:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])['loaded'] is False
  assert len(artifacts(cache_dir)) == 1
  assert not [
      f for f in os.listdir(os.path.join(cache_dir, 'serve'))
      if f.startswith('.tmp')
  ]
  report, _ = serve_in_process(model_dir, cache_dir)
  assert (report['loaded'], report['frames']) == (True, 0)


@pytest.mark.requires('no_torch_aot_compile')
def test_without_aot_compile_serve_uses_torch_compile_and_says_so_once(
    tmp_path):
  model_dir = write_model(tmp_path / 'model')
  cache_dir = str(tmp_path / 'cache')
  script = serve_script(model_dir, cache_dir)
  # Serving twice in one process says it once.
  proc = run_python(script + script.split('device = torch_xla.device()')[1])
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if 'aot_compile' in line]
  assert len(lines) == 1 and ('has no aot_compile, so every restart traces '
                              'the model with dynamo again') in lines[0], lines
  first, second = [
      json.loads(line)
      for line in proc.stdout.splitlines()
      if line.startswith('{')
  ]
  assert (first['loaded'], second['loaded']) == (False, False)
  assert first['compiles'] == 4
  # A restart traces dynamo again, and the index compiles 3x5 (served by
  # the first process) before serve() returns.
  restart, _ = serve_in_process(model_dir, cache_dir)
  assert (restart['frames'], restart['compiles']) == (1, 5)
  assert not os.path.exists(os.path.join(cache_dir, 'serve'))


class CountsItsCalls(torch.nn.Module):
  """Updates a buffer in the middle of its forward, between two reads of it,
  around an op torch_xla runs on the CPU (logcumsumexp)."""

  def __init__(self):
    super().__init__()
    self.register_buffer('calls', torch.zeros((), dtype=torch.long))

  def forward(self, x):
    before = self.calls * 1
    self.calls.add_(1)
    return torch.logcumsumexp(x, dim=0) * before + self.calls


def test_a_fallback_graph_that_updates_its_inputs_runs_eagerly(patched_bridge):
  # See [Note: Graphs that cannot be split] in dynamo_bridge.py.
  from torch_xla_patches import versions
  cpu = CountsItsCalls()
  model = CountsItsCalls().to(torch_xla.device())
  served = torch_xla_patches.serve(model, [(TensorSpec((4, 3)),)], wait=True)
  # The warm-up compiles without running: the buffer is as it was.
  assert int(model.calls.cpu()) == 0
  torch.manual_seed(0)
  for n in [4, 4, 5, 4]:
    x = torch.randn(n, 3)
    torch.testing.assert_close(served(x.to(torch_xla.device())).cpu(), cpu(x))
  assert int(model.calls.cpu()) == int(cpu.calls) == 4
  if versions.has_torch_aot_compile():
    # serve()'s capture keeps the update where the model makes it.
    assert met.counter_value('DynamoCpuFallbackEager') == 1


class PlacesAfterALength(torch.nn.Module):
  """Positions after a length kept on the CPU, which it then advances: the
  graph moves the length to the device (a node XLA does not compile) and
  updates it in place between two reads, as a fresh StaticCache's prefill
  does with its `cumulative_length`."""

  def forward(self, x, length):
    length = length.to(x.device)
    positions = torch.arange(x.shape[1], device=x.device) + length
    length.add_(x.shape[1])
    return x * positions + length


def test_a_graph_that_updates_a_tensor_it_moved_runs_eagerly(patched_bridge):
  # See [Note: Graphs that cannot be split] in dynamo_bridge.py: split, the
  # last read of the length came before its update.
  from torch_xla_patches import versions
  model = PlacesAfterALength().to(torch_xla.device())
  served = torch_xla_patches.serve(model, [(TensorSpec(
      (2, 5)), TensorSpec((), torch.long))],
                                   wait=True)
  torch.manual_seed(0)
  for n in [5, 6]:
    x = torch.randn(2, n)
    torch.testing.assert_close(
        served(x.to(torch_xla.device()), torch.tensor(3)).cpu(),
        PlacesAfterALength()(x, torch.tensor(3)))
  if versions.has_torch_aot_compile():
    assert met.counter_value('DynamoCpuFallbackEager') == 1
    assert met.counter_value('DynamoCpuFallbackPartition') is None


class AttendsWithAMask(torch.nn.Module):
  """transformers' SDPA call: causal for more than one query and no mask;
  the mask's head dimension, of size 1, broadcasts."""

  def forward(self, q, kv, mask=None):
    causal = q.shape[2] > 1 and mask is None
    return torch.nn.functional.scaled_dot_product_attention(q,
                                                            kv * 2,
                                                            kv,
                                                            attn_mask=mask,
                                                            is_causal=causal)


@pytest.mark.requires('torch_aot_compile')
def test_buckets_of_two_layouts_and_a_size_of_one_that_broadcasts(
    patched_bridge):
  # Buckets may differ in their arguments (generate()'s prompt without a
  # mask, its steps with one); the serve key names both layouts. Captured
  # with a symbolic size of 1, `q.shape[2] > 1` is no bool for SDPA: the
  # capture takes dynamo's 0/1 specialization (see _capture in serving.py).
  from torch_xla_patches import CallSpec, serving
  device = torch_xla.device()
  model = AttendsWithAMask().to(device)
  buckets = [
      CallSpec(TensorSpec((2, 4, 3, 8)), TensorSpec((2, 4, 3, 8))),
      CallSpec(TensorSpec((2, 4, 1, 8)),
               TensorSpec((2, 4, 5, 8)),
               mask=TensorSpec((2, 1, 1, 5), torch.bool)),
  ]
  served = torch_xla_patches.serve(model, buckets, wait=True)
  assert served.calls is not None  # captured, not served by torch.compile
  assert len(served.captures()) == 2
  arguments = serving.serve_key(model, serving._buckets(buckets)).arguments
  assert arguments[0] == 'layouts' and len(arguments[1]) == 2
  torch.manual_seed(0)
  for q_len, kv_len, mask in [(3, 3, None), (1, 5, (2, 1, 1, 5)),
                              (1, 7, (2, 1, 1, 7))]:
    q, kv = torch.randn(2, 4, q_len, 8), torch.randn(2, 4, kv_len, 8)
    kwargs = {} if mask is None else {'mask': torch.rand(mask) > 0.3}
    torch.testing.assert_close(served(
        q.to(device), kv.to(device), **{
            name: m.to(device) for name, m in kwargs.items()
        }).cpu(),
                               AttendsWithAMask()(q, kv, **kwargs),
                               rtol=1e-4,
                               atol=1e-4)
  assert met.counter_value('ServeRetrace') is None
  assert met.counter_value('ServeCapturedAgain') == 1


@pytest.mark.requires('torch_aot_compile')
def test_a_served_forward_stands_in_for_the_modules_forward(patched_bridge):
  # See [Note: Serving a module's forward] in serialization.py: installed as
  # `model.forward`, the served forward is what `model(...)` calls, and
  # neither its captures nor a capture on a later call call it again.
  import inspect
  import pickle
  cpu, model = models(width=12)
  served = torch_xla_patches.serve(model.forward, BUCKETS[:1], wait=True)
  model.forward = served
  assert inspect.signature(served) == inspect.signature(cpu.forward)
  check_against_eager(model, cpu, [(2, 8), (3, 8)])
  # Another dtype: captured again, without calling the served forward.
  check_against_eager(model, cpu, [(2, 8)], dtype=torch.int32)
  assert met.counter_value('ServeCapturedAgain') == 1
  assert met.counter_value('ServeRetrace') is None
  # The module's state, which a capture's guards pickle, holds the served
  # forward: it pickles as a placeholder.
  assert pickle.loads(pickle.dumps(served)) == '<served TinyLM, not unpickled>'


@pytest.mark.requires('torch_aot_compile')
def test_a_served_module_installed_as_its_forward_says_what_to_serve(
    patched_bridge):
  _, model = models(width=8)
  model.forward = torch_xla_patches.serve(model, BUCKETS[:1], wait=True)
  with pytest.raises(TypeError,
                     match=r'serve the forward to put it in its '
                     r'place: `model.forward = torch_xla_patches.serve\('
                     r'model.forward, buckets\)`'):
    model(torch.zeros(2, 8, dtype=torch.long, device=torch_xla.device()))

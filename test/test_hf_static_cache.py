"""A Hugging Face Llama served through a wrapper module that holds a
transformers StaticCache (the decode loop of transformers' static-cache
docs, in a module so that serve() can take it): serve()'s warm-up leaves the
cache as it was (it compiles without running), and greedy decoding gives
eager's tokens."""
import os
import sys

import pytest
import torch
import torch_xla

import hf_models
import torch_xla_patches
from torch_xla_patches import CallSpec, TensorSpec, warmup

sys.path.insert(
    0,
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 'tools'))
import bench_decode  # pylint: disable=g-import-not-at-top

transformers = pytest.importorskip('transformers')

pytestmark = [
    pytest.mark.requires('torch_aot_compile'),
    pytest.mark.usefixtures('patched_bridge')
]

PROMPT = [3, 17, 5, 9]
NEW_TOKENS = 6
CACHE = 32


def llama(device):
  return hf_models.build_one('llama', device)


def cached_decoder(model, device):
  """tools/bench_decode.py's CachedDecoder (a model and its StaticCache; each
  call runs the tokens at `cache_position` against the cache, which it
  updates in place), with a cache of CACHE."""
  return bench_decode.CachedDecoder(model, CACHE, device)


def cache_tensors(decoder):
  tensors = []
  for layer in decoder.cache.layers:
    tensors.extend([layer.keys, layer.values])
  return tensors


def greedy(forward, device):
  """The prompt in one prefill, then one token at a time."""
  with torch.no_grad():
    logits = forward(torch.tensor([PROMPT], device=device),
                     torch.arange(len(PROMPT), device=device))
    tokens = [int(logits[0, -1].argmax())]
    for step in range(NEW_TOKENS - 1):
      position = len(PROMPT) + step
      logits = forward(torch.tensor([[tokens[-1]]], device=device),
                       torch.tensor([position], device=device))
      tokens.append(int(logits[0, -1].argmax()))
  return tokens


BUCKETS = [
    CallSpec(TensorSpec((1, len(PROMPT)), torch.long),
             TensorSpec((len(PROMPT),), torch.long)),
    CallSpec(TensorSpec((1, 1), torch.long), TensorSpec((1,), torch.long)),
]


def test_serve_leaves_a_static_cache_as_it_was():
  # dynamo's capture without AOTAutograd makes the cache's tensors
  # attributes of the graph (get_attr), not arguments: the warm-up's trace
  # writes them in place and must restore them too.
  device = torch_xla.device()
  decoder = cached_decoder(llama(device), device)
  before = [t.cpu().clone() for t in cache_tensors(decoder)]
  served = torch_xla_patches.serve(decoder, BUCKETS, wait=True)
  assert served.readiness() == warmup.Readiness(ready=2, total=2, failed=())
  after = [t.cpu() for t in cache_tensors(decoder)]
  assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_served_static_cache_decodes_as_eager_twice():
  # The cache is written in place by the served program (see [Note: Tensor
  # attributes of a captured graph]); the second generation reuses it
  # after a reset, as transformers' docs do.
  expected = greedy(cached_decoder(llama('cpu'), 'cpu'), 'cpu')
  device = torch_xla.device()
  decoder = cached_decoder(llama(device), device)
  served = torch_xla_patches.serve(decoder, BUCKETS, wait=True)
  assert greedy(served, device) == expected
  written = [t.cpu() for t in cache_tensors(decoder)]
  assert all(t.abs().sum() > 0 for t in written)
  decoder.cache.reset()
  assert greedy(served, device) == expected
  # Each bucket's first call takes the full path; every other call is fast,
  # past the global state transformers sets back (see [Note: Global state
  # the captured code sets back] in call_plan.py).
  assert served.fast_calls == 2 * NEW_TOKENS - 2


def test_a_static_cache_under_torch_compile_decodes_as_eager():
  expected = greedy(cached_decoder(llama('cpu'), 'cpu'), 'cpu')
  device = torch_xla.device()
  decoder = cached_decoder(llama(device), device)
  compiled = torch.compile(decoder, backend='openxla', dynamic=True)
  assert greedy(compiled, device) == expected


def test_a_decode_graph_with_a_cpu_fallback_op_decodes_as_eager(monkeypatch):
  # The one-token graph updates `cumulative_length` between the reads that
  # place the new keys: split around a CPU fallback op, a part read it
  # after another had updated it, and greedy decoding went wrong from the
  # second one-token step on. Such a graph runs eagerly (see [Note: Graphs
  # that cannot be split] in dynamo_bridge.py); a node taken for a fallback
  # op (the `arange` that places the new keys) stands in for one here.
  import torch_xla.debug.metrics as met
  from torch_xla_patches import dynamo_bridge
  look_ahead = dynamo_bridge._look_ahead
  seen = []

  def one_token_graph_falls_back(xla_model, xla_args):
    collector = look_ahead(xla_model, xla_args)
    seen.append(xla_model)
    if len(seen) == 2:
      # StaticLayer.update's `torch.arange(kv_length) + cumulative_length`.
      collector.get_unsupported_nodes().append(
          next(n for n in xla_model.graph.nodes if n.target is torch.arange))
    return collector

  monkeypatch.setattr(dynamo_bridge, '_look_ahead', one_token_graph_falls_back)
  # Every hand-over looks ahead on its arguments, where the stand-in is put.
  monkeypatch.setattr(dynamo_bridge, '_look_ahead_on_placeholders',
                      lambda *args: None)
  expected = greedy(cached_decoder(llama('cpu'), 'cpu'), 'cpu')
  device = torch_xla.device()
  decoder = cached_decoder(llama(device), device)
  served = torch_xla_patches.serve(decoder, BUCKETS, wait=True)
  assert greedy(served, device) == expected
  decoder.cache.reset()
  assert greedy(served, device) == expected
  assert len(seen) == 2
  assert met.counter_value('DynamoCpuFallbackEager') == 1


def greedy_rows(forward, device, prompts, between=None):
  """Greedy decoding of each row of `prompts` at once: the prompts in one
  prefill, then one token a row at a time; `between()` runs before each
  one-token step."""
  with torch.no_grad():
    logits = forward(prompts.to(device),
                     torch.arange(prompts.shape[1], device=device))
    tokens = [logits[:, -1].argmax(-1).cpu()]
    for step in range(NEW_TOKENS - 1):
      if between is not None:
        between()
      logits = forward(tokens[-1].view(-1, 1).to(device),
                       torch.tensor([prompts.shape[1] + step], device=device))
      tokens.append(logits[:, -1].argmax(-1).cpu())
  return torch.stack(tokens, 1).tolist()


PROMPTS = torch.tensor([PROMPT, [1, 2, 3, 4], [60, 61, 62, 63], [9, 9, 9, 9]])


@pytest.mark.parametrize('mode', ['serve', 'torch.compile'])
def test_a_batch_of_four_decodes_as_eager(mode):
  expected = greedy_rows(
      bench_decode.CachedDecoder(llama('cpu'), CACHE, 'cpu', batch=4), 'cpu',
      PROMPTS)
  device = torch_xla.device()
  decoder = bench_decode.CachedDecoder(llama(device), CACHE, device, batch=4)
  if mode == 'serve':
    forward = torch_xla_patches.serve(decoder, [
        CallSpec(TensorSpec(
            (4, len(PROMPT)), torch.long), TensorSpec(
                (len(PROMPT),), torch.long)),
        CallSpec(TensorSpec((4, 1), torch.long), TensorSpec((1,), torch.long))
    ],
                                      wait=True)
  else:
    forward = torch.compile(decoder, backend='openxla', dynamic=True)
  assert greedy_rows(forward, device, PROMPTS) == expected
  decoder.cache.reset()
  assert greedy_rows(forward, device, PROMPTS) == expected


@pytest.mark.parametrize('mode', ['serve', 'torch.compile'])
def test_a_cache_read_between_steps_decodes_as_eager(mode):
  # A read of a donated cache (transformers' get_seq_length, a layer's
  # keys) between steps sees what eager's cache holds, and the next step,
  # which takes that cache over, gives eager's tokens (see [Note: Donating
  # in-place updates] in donation.py).
  import torch_xla.debug.metrics as met

  def reads_of(decoder, into):

    def read():
      layer = decoder.cache.layers[0]
      into.append((int(decoder.cache.get_seq_length()),
                   round(float(layer.keys.abs().sum()), 3)))

    return read

  cpu = cached_decoder(llama('cpu'), 'cpu')
  cpu_reads = []
  expected = greedy_rows(cpu, 'cpu', PROMPTS[:1], reads_of(cpu, cpu_reads))
  device = torch_xla.device()
  decoder = cached_decoder(llama(device), device)
  if mode == 'serve':
    forward = torch_xla_patches.serve(decoder, BUCKETS, wait=True)
  else:
    forward = torch.compile(decoder, backend='openxla', dynamic=True)
  reads = []
  met.clear_counters()
  assert greedy_rows(forward, device, PROMPTS[:1], reads_of(decoder,
                                                            reads)) == expected
  assert [n for n, _ in reads] == [n for n, _ in cpu_reads]
  torch.testing.assert_close([k for _, k in reads], [k for _, k in cpu_reads],
                             rtol=1e-4,
                             atol=1e-3)
  # Each step after a read copies layer 0's keys, which the read may hold
  # (a read of `get_seq_length` costs no copy). Under serve() the first
  # call also copies the four cache tensors the caller made (see "Buffer
  # donation" in docs/known-limits.md; the two lengths, smaller than
  # config.donate_min_bytes, are not donated).
  first_call = {'serve': 4, 'torch.compile': 0}[mode]
  assert met.counter_value('DynamoDonationCopiedRead') == (first_call +
                                                           NEW_TOKENS - 1)


RESTART_SCRIPT = r'''
import json, sys
sys.path.insert(0, TEST_DIR)
import torch, torch_xla
from torch._dynamo.utils import counters
import torch_xla_patches
import test_hf_static_cache as t
device = torch_xla.device()
decoder = t.cached_decoder(t.llama(device), device)
served = torch_xla_patches.serve(decoder, t.BUCKETS, cache_dir=CACHE_DIR,
                                 wait=WAIT)
first = t.greedy(served, device)
served.wait_ready()
written = all(bool(x.abs().sum() > 0) for x in t.cache_tensors(decoder))
decoder.cache.reset()
second = t.greedy(served, device)
print(json.dumps(dict(loaded=served.loaded, first=first, second=second,
                      written=written,
                      frames=counters['stats']['unique_graphs'])))
'''


@pytest.mark.parametrize('wait', [True, False])
def test_a_restart_decodes_as_eager_in_the_models_own_cache(tmp_path, wait):
  # wait=False: the first requests run while the buckets compile (and the
  # one-token bucket is captured) on the warm-up thread; the donating runs
  # leave the cache without data while they run, which dynamo's guards and
  # the capture read (see [Note: What reads the model's tensors] in
  # serialization.py).
  from bridge_testing import run_reports
  expected = greedy(cached_decoder(llama('cpu'), 'cpu'), 'cpu')
  here = os.path.dirname(os.path.abspath(__file__))
  code = RESTART_SCRIPT.replace('TEST_DIR', repr(here)).replace(
      'CACHE_DIR', repr(str(tmp_path))).replace('WAIT', repr(wait))
  reports = run_reports(code)
  first, restart = reports
  assert (first['loaded'], restart['loaded']) == (False, True)
  assert restart['frames'] == 0
  for report in reports:
    # The served program wrote the decoder's own cache (rebound after the
    # load), and a reset of it starts the next generation afresh.
    assert report['written'], report
    assert report['first'] == report['second'] == expected, report


PREFILL_RESTART_SCRIPT = r'''
import json, sys
sys.path.insert(0, TEST_DIR)
import torch, torch_xla
import torch_xla_patches
from torch_xla_patches import CallSpec, TensorSpec
import test_hf_static_cache as t
device = torch_xla.device()
decoder = t.cached_decoder(t.llama(device), device)
served = torch_xla_patches.serve(decoder, [
    CallSpec(TensorSpec((1, n), torch.long), TensorSpec((n,), torch.long))
    for n in (4, 6)], cache_dir=CACHE_DIR, wait=True)
logits = served(torch.tensor([t.PROMPT], device=device),
                torch.arange(len(t.PROMPT), device=device))
print(json.dumps(dict(
    loaded=served.loaded, logits=logits[0, -1].cpu().tolist(),
    written=[float(x.abs().sum()) for x in t.cache_tensors(decoder)])))
'''


def test_a_loaded_graph_writes_the_models_own_cache(tmp_path):
  from bridge_testing import run_reports
  cpu = cached_decoder(llama('cpu'), 'cpu')
  with torch.no_grad():
    expected = cpu(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0, -1]
  here = os.path.dirname(os.path.abspath(__file__))
  code = PREFILL_RESTART_SCRIPT.replace('TEST_DIR', repr(here)).replace(
      'CACHE_DIR', repr(str(tmp_path)))
  reports = run_reports(code)
  assert [r['loaded'] for r in reports] == [False, True]
  for report in reports:
    torch.testing.assert_close(torch.tensor(report['logits']), expected)
    # The prefill wrote the decoder's own cache: after the load, the graph's
    # tensor attributes are rebound to it, not the artifact's copies.
    assert all(total > 0 for total in report['written']), report


class LazyDecoder(torch.nn.Module):
  """CachedDecoder with its StaticCache made as transformers' docs make it
  (`StaticCache(config=..., max_cache_len=...)`), initialized lazily by its
  first call: its tensors appear inside the captured code."""

  def __init__(self, model):
    super().__init__()
    self.model = model
    self.cache = transformers.StaticCache(config=model.config,
                                          max_cache_len=CACHE)

  def forward(self, input_ids, cache_position):
    return self.model(input_ids=input_ids,
                      past_key_values=self.cache,
                      cache_position=cache_position,
                      use_cache=True).logits


def test_a_lazily_initialized_cache_decodes_as_eager_on_the_fast_path():
  # The capture made after the first call initialized the cache reads its
  # tensors through `self.cache.layers[i]`: bound as parameters are, each
  # path checked per call (see [Note: Captured code the fast path can stand
  # in for] in call_plan.py).
  expected = greedy(LazyDecoder(llama('cpu')), 'cpu')
  device = torch_xla.device()
  decoder = LazyDecoder(llama(device))
  served = torch_xla_patches.serve(decoder, BUCKETS, wait=True)
  assert greedy(served, device) == expected
  decoder.cache.reset()
  assert greedy(served, device) == expected
  # The warm-up's captures initialize the cache (captured code that sets
  # attributes: the full path); the first calls on the initialized cache are
  # captured again and learned; the rest is fast: 9 of 12 calls, 4 captures
  # (an initialized cache: 10 of 12, 2 captures).
  assert (served.fast_calls, len(served.captures())) == (9, 4)

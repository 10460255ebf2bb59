"""transformers' generate() with a static cache on a served forward
(`model.forward = serve(model.forward, buckets)`, as transformers' docs do
with torch.compile): the cache is an argument of every step (see [Note:
Objects in a call] in call_spec.py), tokens equal eager's, the
buckets' example caches keep what they held, and a restart serves with no
dynamo frame."""
import os

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from torch_xla_patches import CallSpec, TensorSpec, versions
import hf_models

transformers = pytest.importorskip('transformers')

pytestmark = pytest.mark.usefixtures('patched_bridge')

CACHE = 32
NEW_TOKENS = 6
PROMPTS = torch.tensor([[3, 17, 5, 9], [1, 2, 3, 4], [60, 61, 62, 63],
                        [9, 9, 9, 9]])


def static_cache(model, batch, device):
  """A StaticCache of CACHE tokens for `batch` rows, initialized (as a
  server keeps one per batch size)."""
  config = model.config
  cache = transformers.StaticCache(config=config, max_cache_len=CACHE)
  cache.early_initialization(batch, config.num_key_value_heads,
                             config.hidden_size // config.num_attention_heads,
                             torch.float32, device)
  return cache


def buckets(example, batch):
  """generate()'s two calls for a batch, as it makes them for a forward
  with Llama's parameters: the prompt (no attention mask when every row is
  whole) and one token a row against the cache's mask."""
  common = dict(cache=example,
                logits_to_keep=1,
                use_cache=True,
                return_dict=True)
  prompt = PROMPTS.shape[1]
  return [
      CallSpec(input_ids=TensorSpec((batch, prompt), torch.long),
               position_ids=TensorSpec((batch, prompt), torch.long),
               **common),
      CallSpec(input_ids=TensorSpec((batch, 1), torch.long),
               position_ids=TensorSpec((batch, 1), torch.long),
               attention_mask=TensorSpec((batch, 1, 1, CACHE), torch.bool),
               **common),
  ]


def generate(model, prompts, cache):
  """Greedy tokens after `prompts`, with `cache` reset first."""
  cache.reset()
  with torch.no_grad():
    out = model.generate(prompts,
                         attention_mask=torch.ones_like(prompts),
                         max_new_tokens=NEW_TOKENS,
                         do_sample=False,
                         cache=cache)
  return out[:, prompts.shape[1]:].cpu().tolist()


def copies_of_donated_tensors(monkeypatch):
  """The (shape, dtype) of each donated tensor a run copies from now on."""
  from torch_xla_patches import donation
  copied = []
  private_copy = donation.private_copy

  def noting_private_copy(tensor):
    copied.append((tuple(tensor.shape), tensor.dtype))
    return private_copy(tensor)

  # Served calls' bound programs copy through donation.move_to_private_copy.
  monkeypatch.setattr(donation, 'private_copy', noting_private_copy)
  return copied


def cache_contents(cache):
  return [(float(layer.keys.abs().sum()), float(layer.values.abs().sum()),
           int(layer.cumulative_length)) for layer in cache.layers]


@pytest.mark.parametrize('batch', [1, 4])
def test_generate_on_a_served_forward_gives_eagers_tokens(batch, monkeypatch):
  cpu, model = hf_models.build('llama')
  prompts = PROMPTS[:batch]
  expected = generate(cpu, prompts, static_cache(cpu, batch, 'cpu'))
  device = torch_xla.device()
  example = static_cache(model, batch, device)
  served = torch_xla_patches.serve(model.forward,
                                   buckets(example, batch),
                                   wait=True)
  if versions.has_torch_aot_compile():
    # The decode bucket's guards (an initialized cache, one token) are not
    # the prompt's: the warm-up captured it.
    assert len(served.captures()) == 2
  assert example.layers[0].keys.device.type == 'xla'
  assert cache_contents(example) == [(0.0, 0.0, 0)] * len(example.layers)
  model.forward = served
  cache = static_cache(model, batch, device)
  copied = copies_of_donated_tensors(monkeypatch)
  met.clear_counters()
  assert generate(model, prompts.to(device), cache) == expected
  # The second generation reuses the cache, reset.
  assert generate(model, prompts.to(device), cache) == expected
  # Between steps generate() builds on the cache's length (layer 0's
  # `cumulative_length`, 0-dim). Smaller than config.donate_min_bytes, the
  # lengths are not donated (counted per capture's signature), so no step
  # copies anything for its run.
  assert met.counter_value('DynamoDonationCopiedRead') is None
  assert copied == []
  assert met.counter_value('ServeCapturedAgain') is None
  assert met.counter_value('ServeRetrace') is None
  # Every step donated the cache (two tensors and a length per layer): no
  # step copied it.
  assert met.counter_value('DynamoDonationCopiedAlias') is None
  # The examples the warm-up called copies of are as they were.
  assert cache_contents(example) == [(0.0, 0.0, 0)] * len(example.layers)


def test_generate_with_a_cache_it_makes_gives_eagers_tokens():
  # cache_implementation='static': generate() makes the cache, which its
  # prompt step initializes (under aot_compile a graph that moves the length
  # to the device and advances it: it runs eagerly, see [Note: Graphs that
  # cannot be split] in dynamo_bridge.py), and keeps it for the next
  # generation.
  cpu, model = hf_models.build('llama')
  prompts = PROMPTS[:1]

  def run(model, device):
    with torch.no_grad():
      return [
          model.generate(prompts.to(device),
                         max_new_tokens=NEW_TOKENS,
                         do_sample=False,
                         cache_implementation='static').cpu().tolist()
          for _ in range(2)
      ]

  expected = run(cpu, 'cpu')
  device = torch_xla.device()
  served = torch_xla_patches.serve(model.forward,
                                   buckets(static_cache(model, 1, device),
                                           1)[:1],
                                   wait=True)
  model.forward = served
  assert run(model, device) == expected
  if versions.has_torch_aot_compile():
    # torch.compile's graphs (torch 2.8) move the update to the end.
    assert met.counter_value('DynamoCpuFallbackEager') == 1


def test_a_cache_read_between_steps_gives_eagers_tokens_and_reads():
  # A stopping criterion reads the donated cache after every step: its
  # length (a 0-dim tensor) and layer 0's keys (see [Note: Donating
  # in-place updates] in donation.py).

  class Reads(transformers.StoppingCriteria):

    def __init__(self, cache):
      self.cache, self.seen = cache, []

    def __call__(self, input_ids, scores, **kwargs):
      self.seen.append((int(self.cache.get_seq_length()),
                        round(float(self.cache.layers[0].keys.abs().sum()), 3)))
      return torch.zeros(input_ids.shape[0],
                         dtype=torch.bool,
                         device=input_ids.device)

  def run(model, device, cache):
    reads = Reads(cache)
    with torch.no_grad():
      out = model.generate(PROMPTS[:1].to(device),
                           max_new_tokens=NEW_TOKENS,
                           do_sample=False,
                           cache=cache,
                           stopping_criteria=[reads])
    return out.cpu().tolist(), reads.seen

  cpu, model = hf_models.build('llama')
  expected, expected_reads = run(cpu, 'cpu', static_cache(cpu, 1, 'cpu'))
  device = torch_xla.device()
  served = torch_xla_patches.serve(model.forward,
                                   buckets(static_cache(model, 1, device), 1),
                                   wait=True)
  model.forward = served
  met.clear_counters()
  tokens, reads = run(model, device, static_cache(model, 1, device))
  assert tokens == expected
  assert [n for n, _ in reads] == [n for n, _ in expected_reads]
  torch.testing.assert_close([k for _, k in reads],
                             [k for _, k in expected_reads],
                             rtol=1e-4,
                             atol=1e-3)


RESTART_SCRIPT = r'''
import json, sys
sys.path.insert(0, TEST_DIR)
import torch, torch_xla
from torch._dynamo.utils import counters
import torch_xla_patches
import hf_models
import test_hf_generate as t
device = torch_xla.device()
_, model = hf_models.build('llama')
served = torch_xla_patches.serve(
    model.forward, t.buckets(t.static_cache(model, 1, device), 1),
    cache_dir=CACHE_DIR, wait=True)
model.forward = served
cache = t.static_cache(model, 1, device)
tokens = [t.generate(model, t.PROMPTS[:1].to(device), cache)]
compiles = t.xla_compiles()
tokens.append(t.generate(model, t.PROMPTS[:1].to(device), cache))
print(json.dumps(dict(loaded=served.loaded, tokens=tokens,
                      captures=len(served.captures()),
                      frames=counters['stats']['unique_graphs'],
                      second_compiles=t.xla_compiles() - compiles)))
'''


@pytest.mark.requires('torch_aot_compile')
def test_a_restart_generates_without_dynamo(tmp_path):
  from bridge_testing import run_reports
  cpu, _ = hf_models.build('llama')
  expected = generate(cpu, PROMPTS[:1], static_cache(cpu, 1, 'cpu'))
  here = os.path.dirname(os.path.abspath(__file__))
  code = RESTART_SCRIPT.replace('TEST_DIR',
                                repr(here)).replace('CACHE_DIR',
                                                    repr(str(tmp_path)))
  first, restart = run_reports(code)
  assert (first['loaded'], restart['loaded']) == (False, True)
  assert first['frames'] == 2 and restart['frames'] == 0
  assert first['captures'] == restart['captures'] == 2
  assert first['tokens'] == restart['tokens'] == [expected, expected]
  # See test_a_second_generation_compiles_nothing.
  assert first['second_compiles'] == restart['second_compiles'] == 0


def test_a_cache_in_a_bucket_is_described_and_copied():
  # See [Note: Objects in a call] in call_spec.py.
  _, model = hf_models.build('llama')
  device = torch_xla.device()
  example = static_cache(model, 2, device)
  bucket = CallSpec(TensorSpec((2, 1), torch.long), cache=example)
  assert bucket.describe() == '(int64[2, 1], cache=StaticCache(6 tensors))'
  layer = [
      'object', 'StaticLayer',
      [['batch_size', ['int']], ['cumulative_length', ['tensor', 'int64', 0]],
       ['device', ['device', 'xla:0']], ['is_initialized', ['bool', True]],
       ['k_head_dim', ['int']], ['keys', ['tensor', 'float32', 4]],
       ['max_cache_len', ['int']], ['num_heads', ['int']],
       ['v_head_dim', ['int']], ['values', ['tensor', 'float32', 4]]]
  ]
  assert bucket.layout() == [
      'call', [['tensor', 'int64', 2]],
      [[
          'cache',
          [
              'object', 'StaticCache',
              [['layer_class_to_replicate', ['NoneType', None]],
               ['layers', ['list', [layer, layer]]],
               ['offloading', ['bool', False]]]
          ]
      ]]
  ]
  empty = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
  assert CallSpec(cache=empty).describe() == '(cache=StaticCache(2 tensors))'
  # Another length is the same layout; an empty cache is another.
  assert CallSpec(TensorSpec((2, 1), torch.long),
                  cache=static_cache(model, 4,
                                     device)).layout() == (bucket.layout())
  assert CallSpec(TensorSpec((2, 1), torch.long),
                  cache=empty).layout() != bucket.layout()
  pool = {}
  _, kwargs = bucket.materialize(device, pool)
  copy = kwargs['cache']
  assert copy is not example
  assert copy.layers[0].keys is not example.layers[0].keys
  assert copy.layers[0].keys.shape == example.layers[0].keys.shape
  # A warm-up makes one copy of an example for all its buckets.
  assert bucket.materialize(device, pool)[1]['cache'] is copy
  assert bucket.materialize(device)[1]['cache'] is not copy


def test_padded_prompts_give_eagers_tokens():
  # Rows of different lengths, left-padded: the prompt's call gets a mask
  # the buckets did not name, and a capture of its own on that call.
  prompts = torch.tensor([[0, 0, 5, 9], [1, 2, 3, 4]])
  mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])

  def run(model, on, cache):
    cache.reset()
    with torch.no_grad():
      out = model.generate(prompts.to(on),
                           attention_mask=mask.to(on),
                           max_new_tokens=NEW_TOKENS,
                           do_sample=False,
                           cache=cache,
                           pad_token_id=0)
    return out[:, prompts.shape[1]:].cpu().tolist()

  cpu, model = hf_models.build('llama')
  expected = run(cpu, 'cpu', static_cache(cpu, 2, 'cpu'))
  device = torch_xla.device()
  model.forward = torch_xla_patches.serve(model.forward,
                                          buckets(
                                              static_cache(model, 2, device),
                                              2),
                                          wait=True)
  met.clear_counters()
  cache = static_cache(model, 2, device)
  assert run(model, device, cache) == expected
  assert run(model, device, cache) == expected
  if versions.has_torch_aot_compile():
    assert met.counter_value('ServeCapturedAgain') == 1


def served_llama_forward():
  """(cpu, model, prompts, expected, device, served): a tiny Llama whose
  forward serves batch 1's buckets, compiled, with eager's greedy tokens
  for one prompt."""
  cpu, model = hf_models.build('llama')
  prompts = PROMPTS[:1]
  expected = generate(cpu, prompts, static_cache(cpu, 1, 'cpu'))
  device = torch_xla.device()
  served = torch_xla_patches.serve(model.forward,
                                   buckets(static_cache(model, 1, device), 1),
                                   wait=True)
  model.forward = served
  return cpu, model, prompts, expected, device, served


@pytest.mark.requires('torch_aot_compile')
def test_generate_steps_take_the_fast_path_from_the_cache_they_are_given():
  # See [Note: Objects in a call] in call_spec.py and [Note: Results the
  # captured code builds] in captured_results.py: each step's key holds the
  # cache's layout and sizes, the plan reads its tensors from this call's
  # cache, and the CausalLMOutputWithPast is built as the captured code
  # builds it, holding this call's cache.
  cpu, model, prompts, expected, device, served = served_llama_forward()
  met.clear_counters()
  cache = static_cache(model, 1, device)
  # The first prompt and the first one-token step take the full path and
  # are learned; every other call of the two generations is fast.
  for _ in range(2):
    assert generate(model, prompts.to(device), cache) == expected
  assert served.fast_calls == 2 * NEW_TOKENS - 2
  assert met.counter_value('ServeFallbackNoPlan') == 1
  assert met.counter_value('ServeFallbackNewArguments') == 1
  # Another cache of the same sizes: every step fast, from that cache.
  other = static_cache(model, 1, device)
  assert generate(model, prompts.to(device), other) == expected
  assert served.fast_calls == 3 * NEW_TOKENS - 2
  assert cache_contents(other)[0][2] == prompts.shape[1] + NEW_TOKENS - 1
  # A cache of another length is another key: not taken by the fast path
  # until the full path served it.
  config = model.config
  longer = transformers.StaticCache(config=config, max_cache_len=2 * CACHE)
  longer.early_initialization(1, config.num_key_value_heads,
                              config.hidden_size // config.num_attention_heads,
                              torch.float32, device)
  before = served.fast_calls
  with torch.no_grad():
    out = model.generate(prompts.to(device),
                         attention_mask=torch.ones_like(prompts).to(device),
                         max_new_tokens=NEW_TOKENS,
                         do_sample=False,
                         cache=longer)
  assert out[:, prompts.shape[1]:].cpu().tolist() == expected
  assert met.counter_value('ServeFallbackNewArguments') > 1
  assert served.fast_calls - before < NEW_TOKENS


@pytest.mark.requires('torch_aot_compile')
def test_a_served_model_returns_its_model_output_from_the_fast_path():
  cpu, model = hf_models.build('llama')
  device = torch_xla.device()
  served = torch_xla_patches.serve(
      model,
      [CallSpec(input_ids=TensorSpec((2, 4), torch.long), use_cache=False)],
      wait=True)
  for _ in range(3):
    ids = torch.randint(0, 64, (2, 4))
    out = served(input_ids=ids.to(device), use_cache=False)
    with torch.no_grad():
      expected = cpu(input_ids=ids, use_cache=False)
    assert type(out) is type(expected)
    assert list(out.keys()) == list(expected.keys())
    torch.testing.assert_close(out.logits.cpu(),
                               expected.logits,
                               rtol=1e-4,
                               atol=1e-4)
  assert served.fast_calls == 2


def xla_compiles():
  """XLA compiles in this process so far."""
  data = met.metric_data('CompileTime')
  return data[0] if data else 0


@pytest.mark.requires('torch_aot_compile')
def test_a_second_generation_compiles_nothing():
  # The first generation's full calls and the fast calls that follow sync
  # a call's pending inputs in the same order (see [Note: Bound programs]
  # in bound_program.py), so the second generation, fast from its prompt
  # on, finds every sync's program compiled.
  cpu, model, prompts, expected, device, served = served_llama_forward()
  cache = static_cache(model, 1, device)
  assert generate(model, prompts.to(device), cache) == expected
  fast_before, compiles_before = served.fast_calls, xla_compiles()
  assert generate(model, prompts.to(device), cache) == expected
  assert served.fast_calls - fast_before == NEW_TOKENS
  assert xla_compiles() - compiles_before == 0


@pytest.mark.requires('torch_aot_compile')
def test_a_full_call_computes_its_signature_key_once(monkeypatch):
  # serve()'s full path: the served graph's callable computes the call's
  # signature key, to record it, and hands it to the bridge's callable,
  # which does not compute it again.
  from torch_xla_patches.signature import ArgLayout
  computed = []
  key_function = ArgLayout.key_function

  def counting_key_function(layout):
    key_of = key_function(layout)

    def counted(args):
      computed.append(len(args))
      return key_of(args)

    return counted

  monkeypatch.setattr(ArgLayout, 'key_function', counting_key_function)
  cpu, model = hf_models.build('llama')
  device = torch_xla.device()
  served = torch_xla_patches.serve(
      model,
      [CallSpec(input_ids=TensorSpec((2, 4), torch.long), use_cache=False)],
      wait=True)
  ids = torch.randint(0, 64, (2, 4))
  with torch.no_grad():
    expected = cpu(input_ids=ids, use_cache=False).logits
    # The full path: dynamo's guards, then the captured code.
    computed.clear()
    out = served.compiled(input_ids=ids.to(device), use_cache=False)
  assert len(computed) == 1
  torch.testing.assert_close(out.logits.cpu(), expected, rtol=1e-4, atol=1e-4)

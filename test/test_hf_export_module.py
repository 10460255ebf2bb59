"""transformers' own decode module with a static cache held as buffers
(TorchExportableModuleWithStaticCache: each layer's keys, values and
cumulative length registered on the module, written in place, the length
with `copy_` from an argument), fed one token at a time under torch.compile
with the patch: the tokens eager gives, and its caches donated."""
import sys

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import hf_models
from torch_xla_patches import counters as bridge_counters

transformers = pytest.importorskip('transformers')
executorch = pytest.importorskip('transformers.integrations.executorch')

PROMPT = [3, 17, 5, 9]
STEPS = 10
CACHE = 32
LAYERS = 2


def llama_config():
  return hf_models.config('llama', num_hidden_layers=LAYERS)


def decode_module(device):
  model = hf_models.build_one('llama', num_hidden_layers=LAYERS)
  model.generation_config.cache_implementation = 'static'
  model.generation_config.use_cache = True
  model = model.to(device)
  return executorch.TorchExportableModuleWithStaticCache(model,
                                                         batch_size=1,
                                                         max_cache_len=CACHE,
                                                         device=device)


def greedy_tokens(forward, device):
  """The prompt fed one token at a time, then greedy tokens, as the
  module's own generate() feeds an exported program."""
  tokens = []
  with torch.no_grad():
    for position in range(STEPS):
      token = PROMPT[position] if position < len(PROMPT) else tokens[-1]
      logits = forward(input_ids=torch.tensor([[token]], device=device),
                       cache_position=torch.tensor([position], device=device))
      tokens.append(int(logits[:, -1].argmax(-1).item()))
  return tokens


def test_the_export_module_decodes_as_eager_under_torch_compile(patched_bridge):
  expected = greedy_tokens(decode_module('cpu'), 'cpu')
  device = torch_xla.device()
  module = decode_module(device)
  got = greedy_tokens(torch.compile(module, backend='openxla'), device)
  assert got == expected
  # One signature: each layer's keys and values are donated; the
  # cumulative lengths are written without being read (no input of the
  # program, nothing to donate).
  assert met.counter_value(bridge_counters.COUNTER_DONATED) == 2 * LAYERS
  assert met.counter_value(bridge_counters.COUNTER_MISS) == 1
  for name, buffer in module.named_buffers():
    if name.startswith(('key_cache', 'value_cache')):
      assert buffer.abs().sum().item() > 0, name


def test_generate_with_a_static_cache_on_a_compiled_forward(patched_bridge):
  """transformers' generate() with a static cache, its forward under
  torch.compile (as transformers' docs show): eager's tokens. Its caches'
  scalars (a 0-dim tensor copied for a run) once made the run refuse a
  transfer in flight."""
  config = llama_config()
  torch.manual_seed(0)
  cpu = transformers.LlamaForCausalLM(config).eval()
  ids = torch.tensor([PROMPT])
  generate_args = dict(max_new_tokens=6,
                       cache_implementation='static',
                       max_cache_len=CACHE,
                       do_sample=False)
  expected = cpu.generate(ids, **generate_args)
  model = transformers.LlamaForCausalLM(config).eval()
  model.load_state_dict(cpu.state_dict())
  model = model.to(torch_xla.device())
  model.forward = torch.compile(model.forward, backend='openxla')
  for _ in range(2):
    got = model.generate(ids.to(torch_xla.device()), **generate_args)
    assert torch.equal(got.cpu(), expected)


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))

SERVE_SCRIPT = r'''
import json, sys
sys.path.insert(0, TEST_DIR)
import torch, torch_xla
from torch._dynamo.utils import counters
import torch_xla_patches
from torch_xla_patches import CallSpec, TensorSpec
import test_hf_export_module as t
device = torch_xla.device()
module = t.decode_module(device)
bucket = CallSpec(input_ids=TensorSpec((1, 1), torch.long),
                  cache_position=TensorSpec((1,), torch.long))
served = torch_xla_patches.serve(module, [bucket], cache_dir=CACHE_DIR,
                                 wait=WAIT)
tokens = t.greedy_tokens(served, device)
served.wait_ready()
print(json.dumps(dict(loaded=served.loaded, tokens=tokens,
                      frames=counters['stats']['unique_graphs'],
                      captures=len(served.captures()),
                      fast=served.fast_calls)))
'''


@pytest.mark.requires('torch_aot_compile')
@pytest.mark.parametrize('wait', [True, False])
def test_the_export_module_served_and_restarted(tmp_path, wait):
  # Its caches are buffers, written in place by each step (donated); a
  # restart loads the capture: no dynamo frame. Every step after the first
  # takes the fast path: the captured code reads the buffers through the
  # module's `static_cache` (see [Note: Captured code the fast path can
  # stand in for] in call_plan.py).
  import os
  from bridge_testing import run_reports
  expected = greedy_tokens(decode_module('cpu'), 'cpu')
  here = os.path.dirname(os.path.abspath(__file__))
  code = SERVE_SCRIPT.replace('TEST_DIR', repr(here)).replace(
      'CACHE_DIR', repr(str(tmp_path))).replace('WAIT', repr(wait))
  first, restart = run_reports(code)
  assert (first['loaded'], restart['loaded']) == (False, True)
  assert restart['frames'] == 0
  # In the background, the first request's capture (static sizes) and the
  # bucket's (dynamic sizes, see [Note: The first capture] in serving.py).
  assert first['captures'] == restart['captures'] == (1 if wait else 2)
  assert first['tokens'] == restart['tokens'] == expected
  assert first['fast'] == restart['fast'] == STEPS - 1

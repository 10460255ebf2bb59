"""Part 7 of tools/bench_decode.py: transformers'
TorchExportableModuleWithStaticCache, one token a call.

Part 7 (--hf-export), transformers' own TorchExportableModuleWithStaticCache
(its cache tensors registered as buffers), fed the prompt and then its
greedy tokens one at a time, twice (the cache reset between), in the rows
and columns of part 5 (serve: one one-token bucket).
"""
import copy
import time
from typing import Any, Dict, List, Tuple

import torch

from bench_decode_common import (HF_MODEL_WORDS, HF_PROMPT, compiled_or_served,
                                 hf_model, hf_prompt, module_row, time_call)


def hf_export_row(mode: str, cache_len: int, new_tokens: int) -> Dict[str, Any]:
  """One row of part 7, run in this process: transformers'
  TorchExportableModuleWithStaticCache fed the prompt and then its greedy
  tokens one at a time, twice (the cache reset between)."""
  import torch_xla
  from torch._dynamo.utils import counters as dynamo_counters
  from transformers.integrations import executorch
  device = torch_xla.device()
  _, cpu_model = hf_model(cache_len)
  cpu_model.generation_config.cache_implementation = 'static'
  cpu_model.generation_config.use_cache = True
  prompt = hf_prompt()[0].tolist()

  def export_module(model, on):
    return executorch.TorchExportableModuleWithStaticCache(
        model, batch_size=1, max_cache_len=cache_len, device=on)

  def greedy(forward, on, timed=None):
    tokens = []
    with torch.no_grad():
      for position in range(HF_PROMPT + new_tokens - 1):
        token = prompt[position] if position < HF_PROMPT else tokens[-1]
        args = dict(input_ids=torch.tensor([[token]], device=on),
                    cache_position=torch.tensor([position], device=on))
        if timed is None:
          logits = forward(**args)
        else:
          logits, wall, host = time_call(forward, **args)
          timed.append((wall, host))
        tokens.append(int(logits[:, -1].argmax(-1)))
    return tokens

  expected = greedy(export_module(cpu_model, 'cpu'), 'cpu')
  model = copy.deepcopy(cpu_model).to(device)
  module = export_module(model, device)
  frames_before = dynamo_counters['stats']['unique_graphs']
  start = time.perf_counter()

  def buckets():
    from torch_xla_patches import CallSpec, TensorSpec
    return [
        CallSpec(input_ids=TensorSpec((1, 1), torch.long),
                 cache_position=TensorSpec((1,), torch.long))
    ]

  forward = compiled_or_served(mode, module, buckets)
  with torch.no_grad():
    forward(input_ids=torch.tensor([[prompt[0]]], device=device),
            cache_position=torch.tensor([0], device=device)).cpu()
  first_token_s = time.perf_counter() - start
  module.static_cache.reset()
  got = greedy(forward, device)
  module.static_cache.reset()
  timed: List[Tuple[float, float]] = []
  again = greedy(forward, device, timed)
  # The generated tokens' steps.
  return module_row(forward, first_token_s, timed[HF_PROMPT:],
                    dynamo_counters['stats']['unique_graphs'] - frames_before,
                    got == expected and again == expected)


def title(args) -> str:
  """Part 7's title line."""
  return (
      f'\ntransformers\' TorchExportableModuleWithStaticCache (part 7): '
      f'{HF_MODEL_WORDS}, prompt {HF_PROMPT} fed one token at a time, then '
      f'{args.hf_tokens} greedy tokens, twice (the cache reset between); '
      'first token: from the start of torch.compile or serve() to the first '
      'call\'s end; step: median of the second pass\'s generated tokens; fast '
      'calls of both passes; one fresh process per row (serve-restart on the '
      'directory serve filled)\n')

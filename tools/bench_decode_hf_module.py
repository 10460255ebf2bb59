"""Part 5 of tools/bench_decode.py: a module holding a StaticCache.

Part 5 (--hf-module), a module holding a transformers StaticCache in an
attribute (CachedDecoder, below), as transformers' static-cache decode loop
in a module: greedy decoding (the prompt in one prefill, then one token a
call), twice, the cache reset between, tokens checked against the same run
eagerly on the CPU, at the two --hf-lengths, one fresh process per row:
  upstream       torch.compile(module, backend='openxla'), no patch
  patched        the same under torch_xla_patches.apply()
  serve          serve(module, a prefill and a one-token bucket,
                 cache_dir=...), a fresh directory
  serve-restart  the same in a fresh process on the directory serve filled
Columns: time to the first token from the start of torch.compile or
serve(), the median one-token step and its host time in the second
generation, peak RSS, dynamo frames compiled, whether serve() loaded its
artifact, its fast calls.
"""
import copy
import time
from typing import Any, Dict, List, Tuple

import torch

from bench_decode_common import (HF_MODEL_WORDS, HF_PROMPT, compiled_or_served,
                                 hf_model, hf_prompt, module_row, time_call)


class CachedDecoder(torch.nn.Module):
  """Part 5's module: a LlamaForCausalLM and a transformers StaticCache held
  in an attribute; each call runs its tokens at `cache_position` against the
  cache, which it updates in place (transformers' static-cache decode loop,
  in a module so that serve() can take it)."""

  def __init__(self,
               model: torch.nn.Module,
               cache_len: int,
               device: Any,
               batch: int = 1):
    super().__init__()
    import transformers
    self.model = model
    self.cache = transformers.StaticCache(config=model.config,
                                          max_cache_len=cache_len)
    # Allocates the cache's tensors on the device (`batch` rows), as a first
    # prefill would.
    with torch.no_grad():
      model(input_ids=torch.zeros((batch, 1), dtype=torch.long, device=device),
            past_key_values=self.cache,
            cache_position=torch.tensor([0], device=device),
            use_cache=True)
    self.cache.reset()

  def forward(self, input_ids, cache_position):
    return self.model(input_ids=input_ids,
                      past_key_values=self.cache,
                      cache_position=cache_position,
                      use_cache=True).logits


def hf_module_row(mode: str, cache_len: int, new_tokens: int) -> Dict[str, Any]:
  """One row of part 5, run in this process: greedy decoding of the
  CachedDecoder, the prompt in one prefill then one token a call."""
  import torch_xla
  from torch._dynamo.utils import counters as dynamo_counters
  device = torch_xla.device()
  _, cpu_model = hf_model(cache_len)
  prompt = hf_prompt()

  def greedy(forward, on, timed=None):
    with torch.no_grad():
      logits = forward(prompt.to(on), torch.arange(HF_PROMPT, device=on))
      tokens = [int(logits[0, -1].argmax())]
      if timed is not None:
        timed.append(time.perf_counter())
      for step in range(new_tokens - 1):
        args = (torch.tensor([[tokens[-1]]], device=on),
                torch.tensor([HF_PROMPT + step], device=on))
        if timed is None:
          logits = forward(*args)
        else:
          logits, wall, host = time_call(forward, *args)
          timed_steps.append((wall, host))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens

  timed_steps: List[Tuple[float, float]] = []
  expected = greedy(CachedDecoder(cpu_model, cache_len, 'cpu'), 'cpu')
  model = copy.deepcopy(cpu_model).to(device)
  decoder = CachedDecoder(model, cache_len, device)
  frames_before = dynamo_counters['stats']['unique_graphs']
  start = time.perf_counter()

  def buckets():
    from torch_xla_patches import CallSpec, TensorSpec
    return [
        CallSpec(TensorSpec((1, HF_PROMPT), torch.long),
                 TensorSpec((HF_PROMPT,), torch.long)),
        CallSpec(TensorSpec((1, 1), torch.long), TensorSpec((1,), torch.long))
    ]

  forward = compiled_or_served(mode, decoder, buckets)
  first_token = []
  got = greedy(forward, device, first_token)
  # A second generation on the same cache, after a reset, timed.
  decoder.cache.reset()
  timed_steps.clear()
  again = greedy(forward, device, [])
  return module_row(forward, first_token[0] - start, timed_steps,
                    dynamo_counters['stats']['unique_graphs'] - frames_before,
                    got == expected and again == expected)


def title(args) -> str:
  """Part 5's title line."""
  return (
      f'\nA module holding a StaticCache (part 5): {HF_MODEL_WORDS}, prompt '
      f'{HF_PROMPT} in one prefill, {args.hf_tokens} tokens greedy, twice '
      '(the cache reset between); first token from the start of '
      'torch.compile or serve(); step: median of the second generation\'s '
      'one-token calls; one fresh process per row (serve-restart on the '
      'directory serve filled)\n')

"""Part 6 of tools/bench_decode.py: generate() on a compiled or served
forward.

Part 6 (--hf-generate), transformers' generate() with a static cache of
each --hf-lengths, --hf-tokens new tokens, twice on one initialized StaticCache
passed as `cache=` (reset between), one fresh process per row:
  upstream       model.forward = torch.compile(model.forward), no patch
  patched        the same under torch_xla_patches.apply()
  serve          model.forward = serve(model.forward, a prompt and a
                 one-token bucket, cache_dir=...), a fresh directory
  serve-restart  the same in a fresh process on the directory serve filled
Columns as part 5's, with the XLA compiles of the second generation
(generate()'s own small graphs among them) and the donated and copied
inputs.
"""
import copy
import inspect
import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch_xla

from bench_decode_common import (HF_MODEL_WORDS, HF_PROMPT, compiled_or_served,
                                 compiles, counter, hf_model, hf_prompt,
                                 peak_rss_mib, serve_rows, time_call)


def generate_cache(config: Any, cache_len: int, on: Any) -> Any:
  """Part 6's StaticCache: one row, `cache_len` tokens, initialized (as a
  server keeps one per batch size)."""
  import transformers
  cache = transformers.StaticCache(config=config, max_cache_len=cache_len)
  cache.early_initialization(1, config.num_key_value_heads,
                             config.hidden_size // config.num_attention_heads,
                             torch.float32, on)
  return cache


def generate_tokens(model: Any, on: Any, cache: Any, ids: torch.Tensor,
                    new_tokens: int) -> torch.Tensor:
  """Greedy generate() of `new_tokens` after the prompt `ids` on `cache`
  (reset first), on the device `on`; the tokens, on the CPU."""
  cache.reset()
  with torch.no_grad():
    return model.generate(ids.to(on),
                          attention_mask=torch.ones_like(ids).to(on),
                          max_new_tokens=new_tokens,
                          do_sample=False,
                          cache=cache).cpu()


def generate_buckets(example: Any, cache_len: int) -> List[Any]:
  """generate()'s two calls of a Llama forward for one row: the prompt,
  then one token against the cache's mask (see docs/serving.md)."""
  from torch_xla_patches import CallSpec, TensorSpec
  common = dict(cache=example,
                logits_to_keep=1,
                use_cache=True,
                return_dict=True)
  return [
      CallSpec(input_ids=TensorSpec((1, HF_PROMPT), torch.long),
               position_ids=TensorSpec((1, HF_PROMPT), torch.long),
               **common),
      CallSpec(input_ids=TensorSpec((1, 1), torch.long),
               position_ids=TensorSpec((1, 1), torch.long),
               attention_mask=TensorSpec((1, 1, 1, cache_len), torch.bool),
               **common),
  ]


def hf_generate_row(mode: str, cache_len: int,
                    new_tokens: int) -> Dict[str, Any]:
  """One row of part 6, run in this process: generate() with a static cache
  of `cache_len` on a compiled or served forward, twice."""
  import torch_xla
  from torch._dynamo.utils import counters as dynamo_counters
  device = torch_xla.device()
  config, cpu_model = hf_model(cache_len)
  ids = hf_prompt()

  def generate(model, on, cache):
    return generate_tokens(model, on, cache, ids, new_tokens)

  expected = generate(cpu_model, 'cpu', generate_cache(config, cache_len,
                                                       'cpu'))
  model = copy.deepcopy(cpu_model).to(device)
  frames_before = dynamo_counters['stats']['unique_graphs']
  start = time.perf_counter()

  def buckets():
    # The buckets' example cache, materialized as a server's would be: left
    # pending, its zeros would join the first sync after the first
    # generation's prompt (time_call's), whose program the second
    # generation's sync then would not share, an XLA compile the bridge
    # did not make.
    example = generate_cache(config, cache_len, device)
    torch_xla.sync()
    return generate_buckets(example, cache_len)

  target = compiled_or_served(mode, model.forward, buckets)
  calls: List[Tuple[float, float]] = []
  first_token: List[float] = []

  def forward(*args, **kwargs):
    result, wall, host = time_call(target, *args, **kwargs)
    if not first_token:
      first_token.append(time.perf_counter())
    calls.append((wall, host))
    return result

  # generate() passes what the forward's parameters name.
  forward.__signature__ = inspect.signature(target)
  model.forward = forward
  cache = generate_cache(config, cache_len, device)
  got = generate(model, device, cache)
  calls.clear()
  before = compiles()
  again = generate(model, device, cache)
  steps = calls[1:]  # calls[0] is the prompt
  return {
      'first_token_s':
          first_token[0] - start,
      'step_ms':
          statistics.median(w for w, _ in steps) * 1e3,
      'host_us':
          statistics.median(h for _, h in steps) * 1e6,
      'peak_rss_mib':
          peak_rss_mib(),
      'compiles':
          compiles() - before,
      'loaded':
          bool(getattr(target, 'loaded', False)),
      'dynamo_frames':
          dynamo_counters['stats']['unique_graphs'] - frames_before,
      'donated':
          counter('DynamoDonatedInput'),
      'copied':
          counter('DynamoDonationCopiedRead'),
      'tokens_match':
          torch.equal(got, expected) and torch.equal(again, expected),
  }


def hf_generate_table(results: Dict[tuple, Dict[str, Any]],
                      lengths: Sequence[int]) -> List[str]:
  """Part 6's markdown table."""
  lines = [
      '| row | static cache length | first token s | step ms | host us | '
      'peak RSS MiB | compiles (second generation) | dynamo frames | '
      'artifact loaded | donated / copied | vs eager tokens (two '
      'generations) |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|',
  ]

  def cells(r: Dict[str, Any]) -> str:
    return (f'{r["compiles"]} | {r["dynamo_frames"]} | {r["loaded"]} | '
            f'{r["donated"]} / {r["copied"]}')

  return lines + serve_rows(lines, results, lengths, cells)


def title(args) -> str:
  """Part 6's title line."""
  return (
      '\ngenerate() with a static cache on a compiled or served forward '
      f'(part 6): {HF_MODEL_WORDS}, prompt {HF_PROMPT}, {args.hf_tokens} new '
      'tokens, twice on one initialized cache (reset between); first token '
      'from the start of torch.compile or serve(); step: median of the second '
      'generation\'s one-token calls; one fresh process per row '
      '(serve-restart on the directory serve filled)\n')

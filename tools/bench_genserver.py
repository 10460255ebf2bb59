"""A generation server that must not stall: one thread generates while
another starts shapes no bucket has.

  python tools/bench_genserver.py [--demo] [--tokens 24] [--rows ...]

A tiny LlamaForCausalLM (built from a LlamaConfig, nothing downloaded) on
the XLA device; transformers' greedy generate() with a StaticCache per
batch size, the forward compiled or served as docs/serving.md says
(`model.forward = serve(model.forward, buckets)`, buckets: the prompt and
the one-token step for batch 1 and 2). In each row's own process:

  * thread A generates batch 1 back to back, timing every forward call;
  * once A is warm, thread B generates batch 3 (no bucket has it), then
    batch 1 with a longer prompt (no bucket has it either);
  * A keeps generating until B is done, and one generation more.

Rows:
  upstream        torch.compile(model.forward, backend='openxla'), no patch
  torch.compile   the same under torch_xla_patches.apply()
  serve first     serve() with an empty cache directory
  serve restart   serve() again on that directory, in a new process

Columns: first token s (from the start of torch.compile or serve() to A's
first token), p50 step ms (A's forward calls before B starts), worst step
of A while B's shapes are captured and compiled (A's calls that overlap
B's generations), how much of that step an XLA compile of any thread ran
(torch_xla's CompileTime samples: a sync waits for torch_xla's device lock,
which a sync holds through its compile), how many of A's steps in that
window were over the bound, B's seconds, and whether every generation of A
and B gave eager's tokens.

--gc-freeze: once A's first token is out, move every object Python's cycle
collector tracks so far out of its reach (gc.freeze()) and make its full
collections rarer (gc.set_threshold(700, 10, 1000)), as a server may do
after its warm-up: a full collection stops every thread for as long as it
scans (docs/threads.md#the-cycle-collector).

The machine may be shared: compare rows of one run.
"""
import argparse
import copy
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# This checkout's package, not another one installed.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama  # pylint: disable=wrong-import-position

LLAMA = tiny_llama.CONFIG
CACHE_LEN = 64
PROMPT = 8
# Thread B's shapes: a batch size no bucket has, then a prompt length.
NEW_BATCH = 3
NEW_PROMPT = 13
ROWS = ('upstream', 'torch.compile', 'serve first', 'serve restart')
_CACHE_DIR_ENV = 'BENCH_GENSERVER_CACHE_DIR'


def static_cache(config: Any, batch: int, on: Any) -> Any:
  """An initialized StaticCache of CACHE_LEN tokens for `batch` rows."""
  import transformers
  cache = transformers.StaticCache(config=config, max_cache_len=CACHE_LEN)
  cache.early_initialization(batch, config.num_key_value_heads,
                             config.hidden_size // config.num_attention_heads,
                             torch.float32, on)
  return cache


def buckets(config: Any, device: Any) -> List[Any]:
  """generate()'s prompt and one-token calls for batch 1 and 2."""
  from torch_xla_patches import CallSpec, TensorSpec
  specs = []
  for batch in (1, 2):
    common = dict(cache=static_cache(config, batch, device),
                  logits_to_keep=1,
                  use_cache=True,
                  return_dict=True)
    specs.append(
        CallSpec(input_ids=TensorSpec((batch, PROMPT), torch.long),
                 position_ids=TensorSpec((batch, PROMPT), torch.long),
                 **common))
    specs.append(
        CallSpec(input_ids=TensorSpec((batch, 1), torch.long),
                 position_ids=TensorSpec((batch, 1), torch.long),
                 attention_mask=TensorSpec((batch, 1, 1, CACHE_LEN),
                                           torch.bool),
                 **common))
  return specs


def prompts(batch: int, length: int) -> torch.Tensor:
  return torch.randint(0,
                       LLAMA['vocab_size'], (batch, length),
                       generator=torch.Generator().manual_seed(batch * 100 +
                                                               length))


def generate(model: Any, ids: torch.Tensor, cache: Any, on: Any,
             tokens: int) -> List[List[int]]:
  cache.reset()
  with torch.no_grad():
    out = model.generate(ids.to(on),
                         attention_mask=torch.ones_like(ids).to(on),
                         max_new_tokens=tokens,
                         do_sample=False,
                         cache=cache)
  return out[:, ids.shape[1]:].cpu().tolist()


def compile_intervals(wall_start: float,
                      perf_start: float) -> List[Tuple[float, float]]:
  """The XLA compiles of this process (any thread) that torch_xla's
  CompileTime metric kept, as merged (start, end) on time.perf_counter()'s
  clock; its samples are (end, wall clock s; length, ns)."""
  import torch_xla.debug.metrics as met
  data = met.metric_data('CompileTime')
  intervals = sorted((end - wall_start + perf_start - length_ns / 1e9,
                      end - wall_start + perf_start)
                     for end, length_ns in data[2]) if data else []
  merged: List[Tuple[float, float]] = []
  for start, end in intervals:
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def overlap(call: Tuple[float, float],
            intervals: Sequence[Tuple[float, float]]) -> float:
  """Seconds of `call` that `intervals` (merged) cover."""
  return sum(
      max(0.0,
          min(call[1], end) - max(call[0], start)) for start, end in intervals)


class CallLog:
  """(thread id, start, end) of every forward call."""

  def __init__(self):
    self.calls: List[Tuple[int, float, float]] = []
    self.lock = threading.Lock()

  def timed(self, target: Any) -> Any:

    def forward(*args, **kwargs):
      start = time.perf_counter()
      result = target(*args, **kwargs)
      end = time.perf_counter()
      with self.lock:
        self.calls.append((threading.get_ident(), start, end))
      return result

    # generate() passes what the forward's parameters name.
    forward.__signature__ = inspect.signature(target)
    return forward


def freeze_collected_objects() -> None:
  """What --gc-freeze does: the objects so far are left out of every later
  collection, and full collections come after 1000 of the middle
  generation's instead of 10."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(700, 10, 1000)


def row(mode: str, tokens: int, gc_freeze: bool = False) -> Dict[str, Any]:
  """One row, in this process."""
  import torch_xla
  import transformers
  device = torch_xla.device()
  config = transformers.LlamaConfig(**LLAMA, max_position_embeddings=256)
  torch.manual_seed(0)
  cpu_model = transformers.LlamaForCausalLM(config).eval()
  shapes = {
      'a': (1, PROMPT),
      'b_batch': (NEW_BATCH, PROMPT),
      'b_prompt': (1, NEW_PROMPT)
  }
  expected = {
      name:
          generate(cpu_model, prompts(*shape),
                   static_cache(config, shape[0], 'cpu'), 'cpu', tokens)
      for name, shape in shapes.items()
  }
  model = copy.deepcopy(cpu_model).to(device)
  wall_start = time.time()
  start = time.perf_counter()
  if mode == 'upstream':
    target = torch.compile(model.forward, backend='openxla')
  else:
    import torch_xla_patches
    torch_xla_patches.apply()
    if mode == 'torch.compile':
      target = torch.compile(model.forward, backend='openxla')
    else:
      target = torch_xla_patches.serve(model.forward,
                                       buckets(config, device),
                                       cache_dir=os.environ[_CACHE_DIR_ENV])
  log = CallLog()
  model.forward = log.timed(target)
  cache_a = static_cache(config, 1, device)
  first = generate(model, prompts(*shapes['a']), cache_a, device, 1)
  first_token_s = time.perf_counter() - start
  if gc_freeze:
    freeze_collected_objects()
  right = {'a': first == [row[:1] for row in expected['a']], 'b': True}
  errors: List[str] = []
  b_started = threading.Event()
  b_done = threading.Event()
  window: List[float] = []

  def thread_a():
    try:
      # Warm: two generations before B starts; then until B is done, and
      # one more.
      for _ in range(2):
        right['a'] &= generate(model, prompts(*shapes['a']), cache_a, device,
                               tokens) == expected['a']
      if hasattr(target, 'wait_ready'):
        # serve()'s buckets compile in the background: B starts once they
        # are done, so that A's worst step is B's shapes' alone.
        target.wait_ready()
        right['a'] &= generate(model, prompts(*shapes['a']), cache_a, device,
                               tokens) == expected['a']
      b_started.set()
      while not b_done.is_set():
        right['a'] &= generate(model, prompts(*shapes['a']), cache_a, device,
                               tokens) == expected['a']
      right['a'] &= generate(model, prompts(*shapes['a']), cache_a, device,
                             tokens) == expected['a']
    except Exception as error:  # reported in the row
      errors.append(f'A: {type(error).__name__}: {error}'[:300])
      b_started.set()

  def thread_b():
    b_started.wait()
    window.append(time.perf_counter())
    try:
      for name in ('b_batch', 'b_prompt'):
        shape = shapes[name]
        right['b'] &= generate(model, prompts(*shape),
                               static_cache(config, shape[0], device), device,
                               tokens) == expected[name]
    except Exception as error:  # reported in the row
      errors.append(f'B: {type(error).__name__}: {error}'[:300])
      right['b'] = False
    window.append(time.perf_counter())
    b_done.set()

  a = threading.Thread(target=thread_a)
  b = threading.Thread(target=thread_b)
  a.start()
  b.start()
  a.join()
  b.join()
  a_calls = [(s, e) for t, s, e in log.calls if t == a.ident]
  before = [e - s for s, e in a_calls if e < window[0]][-4 * tokens:]
  during = [(s, e) for s, e in a_calls if s < window[1] and e > window[0]]
  p50_ms = statistics.median(before) * 1e3 if before else None
  worst = max(during, key=lambda call: call[1] - call[0]) if during else None
  bound_s = max(10 * p50_ms, 25.0) / 1e3 if p50_ms is not None else None
  return {
      'first_token_s': first_token_s,
      'p50_ms': p50_ms,
      'worst_ms': (worst[1] - worst[0]) * 1e3 if worst else None,
      'worst_compiling_ms':
          (overlap(worst, compile_intervals(wall_start, start)) *
           1e3 if worst else None),
      'a_calls_over_bound': (sum(
          e - s > bound_s for s, e in during) if bound_s is not None else None),
      'a_calls_during': len(during),
      'b_s': window[1] - window[0],
      'loaded': bool(getattr(target, 'loaded', False)),
      'tokens_a': right['a'] and not errors,
      'tokens_b': right['b'] and not errors,
      'errors': errors,
  }


def run_row(mode: str,
            tokens: int,
            cache_dir: str,
            gc_freeze: bool = False) -> Dict[str, Any]:
  """A row in a fresh process of this tool."""
  env = dict(os.environ, PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'))
  env[_CACHE_DIR_ENV] = cache_dir
  command = [
      sys.executable, __file__, '--row',
      mode.split()[0] + ('-restart' if 'restart' in mode else ''), '--tokens',
      str(tokens)
  ] + (['--gc-freeze'] if gc_freeze else [])
  done = subprocess.run(command,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=900)
  for line in reversed(done.stdout.splitlines()):
    if line.startswith('{'):
      return json.loads(line)
  tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
  return {'errors': [f'exit {done.returncode}: {" ".join(tail)}'[:300]]}


def _fmt(value: Optional[float], digits: int = 2) -> str:
  return '-' if value is None else f'{value:.{digits}f}'


def table(results: Dict[str, Dict[str, Any]]) -> List[str]:
  lines = [
      '| row | first token s | p50 step ms | worst step ms while B compiles '
      '| of which an XLA compile ran, ms | bound ms | within | A steps over '
      'the bound | B s | tokens = eager (A / B) | errors |',
      '|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|',
  ]
  for mode, r in results.items():
    p50 = r.get('p50_ms')
    worst = r.get('worst_ms')
    bound = max(10 * p50, 25.0) if p50 is not None else None
    within = ('yes' if worst is not None and bound is not None and
              worst <= bound else 'no')
    lines.append(f'| {mode} | {_fmt(r.get("first_token_s"))} | {_fmt(p50)} | '
                 f'{_fmt(worst, 1)} | {_fmt(r.get("worst_compiling_ms"), 1)} | '
                 f'{_fmt(bound, 1)} | {within} | '
                 f'{r.get("a_calls_over_bound", "-")} of '
                 f'{r.get("a_calls_during", "-")} | '
                 f'{_fmt(r.get("b_s"))} | {r.get("tokens_a", False)} / '
                 f'{r.get("tokens_b", False)} | '
                 f'{"; ".join(r.get("errors", [])) or "-"} |')
  return lines


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--demo',
                      action='store_true',
                      help='a short version: fewer tokens a generation')
  parser.add_argument('--tokens', type=int, default=24)
  parser.add_argument('--rows',
                      default=','.join(ROWS),
                      help='comma-separated, of: ' + ', '.join(ROWS))
  parser.add_argument('--gc-freeze',
                      action='store_true',
                      help='gc.freeze() and rarer full collections after the '
                      'first token (see above)')
  parser.add_argument('--row', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.row:
    mode = {
        'upstream': 'upstream',
        'torch.compile': 'torch.compile',
        'serve': 'serve',
        'serve-restart': 'serve'
    }[args.row]
    print(json.dumps(row(mode, args.tokens, args.gc_freeze)), flush=True)
    return 0
  tokens = 8 if args.demo else args.tokens
  results: Dict[str, Dict[str, Any]] = {}
  with tempfile.TemporaryDirectory() as cache_dir:
    for mode in args.rows.split(','):
      mode = mode.strip()
      if mode not in ROWS:
        parser.error(f'--rows: unknown row {mode!r}; rows are {ROWS}')
      results[mode] = run_row(mode, tokens, cache_dir, args.gc_freeze)
      print(f'{mode}: {json.dumps(results[mode])}', file=sys.stderr)
  print(f'\nA generation server (tiny LlamaForCausalLM, StaticCache of '
        f'{CACHE_LEN}, {tokens} new tokens a generation): thread A '
        f'generates batch 1 while thread B generates batch {NEW_BATCH}, then '
        f'a prompt of {NEW_PROMPT}; buckets: batch 1 and 2, prompt {PROMPT} '
        f'and one token. Bound: max(10x p50, 25 ms).' +
        (' gc.freeze() after the first token.' if args.gc_freeze else ''))
  print('\n'.join(table(results)))
  return 0


if __name__ == '__main__':
  sys.exit(main())

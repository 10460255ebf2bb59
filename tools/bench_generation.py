"""The reference generation server, measured from outside over HTTP.

  python tools/bench_generation.py [--demo] [--prompt-buckets 8,16,32]
      [--slots 4] [--max-cache-len 64] [--requests 16] [--threads 4]
      [--new-tokens 8] [--decode-tokens 48] [--rounds 5] [--cache-dir DIR]

Starts `python -m torch_xla_patches.server --port 0` (the built-in tiny
model) on an empty cache directory, then again on the same directory (a
restart), and for each start measures:
  live s        from the process's start to /live answering 200
  ready s       from the process's start to /ready answering 200 (polled
                every 0.05 s)
  burst         --requests requests of mixed prompt lengths (1 to the
                largest bucket, seeded), --new-tokens greedy tokens each,
                sent from --threads threads at once (more requests than
                slots); every answer's tokens are checked against the same
                model's unpadded transformers generate() on the CPU
  programs      the engine's programs compiled (/stats) against P + B: P
                prompt buckets, B decode programs; and the compiles after
                ready (should be 0)
  dynamo frames and loaded, from /stats (a restart: 0 and true)
On the first start only, decode throughput: one request of --decode-tokens
new tokens alone, then --slots such requests at once (every slot busy),
alternating for --rounds rounds; tokens per second of the median round of
each, and their ratio (the goal: >= 3x with 4 slots). Each figure includes
the requests' prefills and HTTP. `--demo` prints a short table; without it
every measurement is printed as JSON too. The machine may be shared: compare
ratios from one run.
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from torch_xla_patches import server  # noqa: E402
import server_process  # noqa: E402

READY_TIMEOUT = 600.0


class Server:
  """The server in a subprocess (server_process.ServerProcess), with the
  times it took to answer."""

  def __init__(self, args: argparse.Namespace, cache_dir: str, log_dir: str,
               name: str):
    self.process = server_process.ServerProcess([
        '--cache-dir', cache_dir, '--prompt-buckets', ','.join(
            map(str, args.prompt_buckets)), '--slots',
        str(args.slots), '--max-cache-len',
        str(args.max_cache_len)
    ], log_dir, name)
    self.port = self.process.port
    started = self.process.started
    self.live_seconds = self.process.wait_for_ok(
        '/live', server_process.START_TIMEOUT) - started
    self.ready_seconds = self.process.wait_for_ok('/ready',
                                                  READY_TIMEOUT) - started

  def stats(self) -> Dict[str, Any]:
    status, payload, _ = server_process.request(self.port, 'GET', '/stats')
    if status != 200:
      raise self.process.failed(f'/stats answered {status}: {payload}')
    return payload

  def stop(self) -> None:
    self.process.stop()


def mixed_prompts(count: int, longest: int, vocab: int) -> List[List[int]]:
  """`count` prompts of seeded lengths from 1 to `longest`."""
  generator = torch.Generator().manual_seed(40)
  lengths = torch.randint(1, longest + 1, (count,), generator=generator)
  return [
      torch.randint(0, vocab, (int(n),), generator=generator).tolist()
      for n in lengths
  ]


def burst(port: int, prompts: Sequence[List[int]], new_tokens: int,
          threads: int) -> Tuple[List[Tuple[int, Dict]], float]:
  """Every prompt posted from `threads` threads released together; (the
  answers in prompt order, wall seconds)."""
  barrier = threading.Barrier(threads)
  queue = list(enumerate(prompts))
  lock = threading.Lock()
  answers: List[Optional[Tuple[int, Dict]]] = [None] * len(prompts)

  def worker():
    barrier.wait(server_process.HTTP_TIMEOUT)
    while True:
      with lock:
        if not queue:
          return
        index, prompt = queue.pop(0)
      answers[index] = server_process.request(port, 'POST', '/generate', {
          'prompt_ids': prompt,
          'max_new_tokens': new_tokens
      })[:2]

  started = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for future in [pool.submit(worker) for _ in range(threads)]:
      future.result()
  return answers, time.perf_counter() - started


def check_burst(answers, tokens) -> Dict[str, int]:
  """Counts of answers equal to eager's, different, and failed."""
  equal = different = errors = 0
  for (status, payload), expected in zip(answers, tokens):
    if status != 200:
      errors += 1
    elif payload['token_ids'] == expected:
      equal += 1
    else:
      different += 1
  return dict(equal=equal, different=different, errors=errors)


def decode_throughput(port: int, args: argparse.Namespace) -> Dict[str, Any]:
  """Tokens per second of one request alone and of every slot busy, the
  median of --rounds alternating rounds."""
  prompt = [7] * args.prompt_buckets[0]
  alone, busy = [], []
  for _ in range(args.rounds):
    for rates, requests in ((alone, 1), (busy, args.slots)):
      answers, seconds = burst(port, [prompt] * requests, args.decode_tokens,
                               requests)
      generated = 0
      for status, payload in answers:
        if status != 200:
          raise RuntimeError(f'a throughput request failed: {payload}')
        generated += len(payload['token_ids'])
      rates.append(generated / seconds)
  alone_rate = statistics.median(alone)
  busy_rate = statistics.median(busy)
  return dict(alone_tokens_per_s=alone_rate,
              busy_tokens_per_s=busy_rate,
              ratio=busy_rate / alone_rate,
              alone_rounds=alone,
              busy_rounds=busy)


def run_start(args, name: str, cache_dir: str, log_dir: str, prompts,
              tokens) -> Dict[str, Any]:
  """One start of the server: its times, its burst, its stats (and on the
  first start, decode throughput)."""
  started = Server(args, cache_dir, log_dir, name.replace(' ', '_'))
  try:
    answers, seconds = burst(started.port, prompts, args.new_tokens,
                             args.threads)
    row = dict(start=name,
               live_s=started.live_seconds,
               ready_s=started.ready_seconds,
               burst_s=seconds,
               **check_burst(answers, tokens))
    if name == 'first start':
      row.update(decode_throughput(started.port, args))
    stats = started.stats()
    row.update({key: stats[key] for key in stats if key != 'ready'})
    return row
  finally:
    started.stop()


def table(rows: List[Dict[str, Any]], args: argparse.Namespace) -> str:
  buckets = len(args.prompt_buckets)
  lines = [
      f'reference server: buckets {",".join(map(str, args.prompt_buckets))}, '
      f'{args.slots} slots, cache {args.max_cache_len}; burst of '
      f'{args.requests} requests from {args.threads} threads, '
      f'{args.new_tokens} tokens each',
      '| start | live s | ready s | burst s | tokens = eager | errors | '
      'programs (P + B) | after ready | dynamo frames | loaded |',
      '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for row in rows:
    lines.append(
        f'| {row["start"]} | {row["live_s"]:.1f} | {row["ready_s"]:.1f} | '
        f'{row["burst_s"]:.2f} | {row["equal"]} of {args.requests} | '
        f'{row["errors"]} | {row["programs_compiled"]} ({buckets} + '
        f'{row["decode_programs"]}) | {row["compiles_after_ready"]} | '
        f'{row["dynamo_frames"]} | {row["loaded"]} |')
  first = rows[0]
  spread = lambda rates: f'{min(rates):.0f}-{max(rates):.0f}'
  lines.append(
      f'decode, {args.decode_tokens} tokens a request, median of '
      f'{args.rounds} rounds: one request {first["alone_tokens_per_s"]:.0f} '
      f'tokens/s ({spread(first["alone_rounds"])}), {args.slots} slots busy '
      f'{first["busy_tokens_per_s"]:.0f} tokens/s '
      f'({spread(first["busy_rounds"])}): {first["ratio"]:.2f}x (goal >= 3x '
      'with 4 slots)')
  return '\n'.join(lines)


def _buckets(text: str) -> Tuple[int, ...]:
  return tuple(int(part) for part in text.split(','))


def main() -> int:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--demo',
                      action='store_true',
                      help='print the short table only')
  parser.add_argument('--prompt-buckets',
                      type=_buckets,
                      default=server.DEFAULT_PROMPT_BUCKETS)
  parser.add_argument('--slots', type=int, default=server.DEFAULT_SLOTS)
  parser.add_argument('--max-cache-len',
                      type=int,
                      default=server.DEFAULT_MAX_CACHE_LEN)
  parser.add_argument('--requests', type=int, default=16)
  parser.add_argument('--threads', type=int, default=4)
  parser.add_argument('--new-tokens', type=int, default=8)
  parser.add_argument('--decode-tokens', type=int, default=48)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--cache-dir',
                      default=None,
                      help='an empty directory to use (default: a new '
                      'temporary one)')
  args = parser.parse_args()
  room = args.max_cache_len - args.prompt_buckets[0]
  if args.decode_tokens > room:
    parser.error(f'--decode-tokens {args.decode_tokens} does not fit the '
                 f'cache after a prompt bucket ({room} tokens)')
  vocab = server.BUILTIN_CONFIG['vocab_size']
  prompts = mixed_prompts(args.requests, args.prompt_buckets[-1], vocab)
  # Before any server starts, so that its times are its own.
  tokens = server_process.eager_tokens(prompts, args.new_tokens)
  started = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix='bench_generation_') as scratch:
    cache_dir = args.cache_dir or os.path.join(scratch, 'cache')
    rows = [
        run_start(args, name, cache_dir, scratch, prompts, tokens)
        for name in ('first start', 'restart')
    ]
  print(table(rows, args))
  if not args.demo:
    for row in rows:
      print(json.dumps(row))
  print(f'{time.perf_counter() - started:.0f} s in all')
  failed = any(row['errors'] or row['different'] or row['compiles_after_ready']
               for row in rows)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())

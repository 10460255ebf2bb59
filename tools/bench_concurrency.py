"""Load on one compiled model from N request threads.

Each thread sends requests of random serving buckets, with a few shapes
outside the buckets mixed in, to one compiled model, as a server's worker
threads would; with --swap, every thread stops at a barrier halfway, one
replaces a Parameter of the model, and all go on after a second barrier
(no call in flight during the swap). Every result is compared with eager
CPU afterwards, against the model's parameters of its phase.

Modes (one process per mode and thread count: apply() is process-wide, and
a later run would find the new shapes compiled by an earlier one):
  eager      the model called directly on the XLA device (lazy tensors)
  upstream   torch.compile(backend='openxla', dynamic=True), no patch
  patched    the same with torch_xla_patches.apply()
  serve      torch_xla_patches.serve() over the buckets

  python tools/bench_concurrency.py [--modes serve,patched,upstream,eager]
      [--threads 1,2,4,8] [--requests 120] [--new-shapes 0.05] [--swap]

Prints, per mode and thread count: requests/s, p50 and p99 latency, the
requests that raised, the results that differ from eager, and the served
calls that left the fast path, by reason.

  python tools/bench_concurrency.py --compile-while-serving
      [--modes serve,patched,upstream]

Compile while serving: one thread calls a compiled bucket back to back (the
call's host time, the device waited for every 50 calls outside the timing)
while another thread calls the NEW_SHAPES, each of which compiles. Prints,
per mode: the steady thread's p50 before the compiles, and its p50, p99
and worst call while they ran, and how long they took.
"""
import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

os.environ.setdefault('PJRT_DEVICE', 'CPU')

import torch

WIDTH = 64
DEPTH = 4
BUCKETS = [(batch, seq) for batch in (2, 4, 8) for seq in (16, 32)]
NEW_SHAPES = [(3, 16), (5, 32), (6, 24), (2, 40)]
TOLERANCE = 1e-4


class Mlp(torch.nn.Module):
  """A small MLP with an RMS norm: 2 * DEPTH + 1 parameters (upstream's
  bridge has no dynamic-shape layer_norm)."""

  def __init__(self, width: int = WIDTH, depth: int = DEPTH):
    super().__init__()
    self.layers = torch.nn.ModuleList(
        torch.nn.Linear(width, width) for _ in range(depth))
    self.scale = torch.nn.Parameter(torch.ones(width))

  def forward(self, x):
    for layer in self.layers:
      x = torch.relu(layer(x))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


def _fallback_counters() -> Dict[str, int]:
  import torch_xla.debug.metrics as met
  return {
      name: met.counter_value(name) or 0
      for name in met.counter_names()
      if name.startswith('ServeFallback') or name in ('ServeRetrace',
                                                      'ServeBridgeRecovery',
                                                      'DynamoSignatureMiss')
  }


def _compiled(mode: str, model: torch.nn.Module, device: Any):
  if mode == 'eager':
    return model
  if mode == 'serve':
    import torch_xla_patches
    from torch_xla_patches import CallSpec, TensorSpec
    return torch_xla_patches.serve(model, [
        CallSpec(TensorSpec((batch, seq, WIDTH), torch.float32))
        for batch, seq in BUCKETS
    ])
  if mode == 'patched':
    import torch_xla_patches
    torch_xla_patches.apply()
  return torch.compile(model, backend='openxla', dynamic=True)


def _requests(rng: random.Random, count: int, new_shapes: float) -> List[tuple]:
  shapes = []
  for _ in range(count):
    pool = NEW_SHAPES if rng.random() < new_shapes else BUCKETS
    shapes.append(rng.choice(pool))
  return shapes


def run(mode: str, threads: int, requests: int, new_shapes: float, swap: bool,
        seed: int) -> Dict[str, Any]:
  """One load run in this process; returns its figures."""
  import torch_xla
  device = torch_xla.device()
  torch.manual_seed(seed)
  cpu_model = Mlp().eval()
  model = Mlp().eval().to(device)
  model.load_state_dict(cpu_model.state_dict())
  with torch.no_grad():
    compiled = _compiled(mode, model, device)
    # Warm the buckets on one thread, as a server does before it listens.
    for batch, seq in BUCKETS:
      compiled(torch.zeros(batch, seq, WIDTH, device=device)).cpu()
  new_weight = torch.randn(WIDTH, WIDTH) * 0.1
  phases = [cpu_model.state_dict()]
  start_barrier = threading.Barrier(threads)
  swap_barriers = (threading.Barrier(threads), threading.Barrier(threads))
  latencies: List[float] = []
  errors: collections.Counter = collections.Counter()
  # The traceback of the first error of each kind.
  where: Dict[str, str] = {}
  records: List[tuple] = []  # (phase, input, output)
  new_shapes_sent = set()
  lock = threading.Lock()
  before = _fallback_counters()

  def worker(index: int) -> None:
    rng = random.Random(seed * 1000 + index)
    shapes = _requests(rng, requests, new_shapes)
    with lock:
      new_shapes_sent.update(shape for shape in shapes if shape in NEW_SHAPES)
    mine_latency, mine_records = [], []
    phase = 0
    start_barrier.wait()
    for number, (batch, seq) in enumerate(shapes):
      if swap and number == requests // 2:
        swap_barriers[0].wait()
        if index == 0:
          model.layers[1].weight = torch.nn.Parameter(new_weight.to(device))
        swap_barriers[1].wait()
        phase = 1
      x = torch.randn(batch,
                      seq,
                      WIDTH,
                      generator=torch.Generator().manual_seed(
                          rng.randrange(1 << 30)))
      begin = time.perf_counter()
      try:
        with torch.no_grad():
          y = compiled(x.to(device)).cpu()
      except Exception as e:  # pylint: disable=broad-except
        kind = f'{type(e).__name__}: {str(e).splitlines()[0][:90]}'
        with lock:
          errors[kind] += 1
          where.setdefault(kind, ''.join(traceback.format_tb(e.__traceback__)))
        continue
      mine_latency.append(time.perf_counter() - begin)
      mine_records.append((phase, x, y))
    with lock:
      latencies.extend(mine_latency)
      records.extend(mine_records)

  workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
  begin = time.perf_counter()
  for thread in workers:
    thread.start()
  for thread in workers:
    thread.join()
  wall = time.perf_counter() - begin
  after = _fallback_counters()
  if swap:
    swapped = Mlp().eval()
    swapped.load_state_dict(phases[0])
    swapped.layers[1].weight = torch.nn.Parameter(new_weight)
    phases.append(swapped.state_dict())
  mismatches = 0
  reference = Mlp().eval()
  with torch.no_grad():
    for phase, x, y in records:
      reference.load_state_dict(phases[phase])
      if not torch.allclose(reference(x), y, atol=TOLERANCE, rtol=TOLERANCE):
        mismatches += 1
  latencies.sort()
  total = threads * requests
  return {
      'mode': mode,
      'threads': threads,
      'requests': total,
      'requests_per_s': len(latencies) / wall,
      'p50_ms': 1e3 * statistics.median(latencies) if latencies else None,
      'p99_ms':
          (1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
           if latencies else None),
      'raised': sum(errors.values()),
      'errors': dict(errors),
      'tracebacks': where,
      'mismatches': mismatches,
      'new_shapes_sent': len(new_shapes_sent),
      'fallbacks': {
          name: after.get(name, 0) - before.get(name, 0)
          for name in after
          if after.get(name, 0) != before.get(name, 0)
      },
  }


def compile_while_serving(mode: str, seed: int) -> Dict[str, Any]:
  """One compile-while-serving run in this process; returns its figures."""
  import torch_xla
  import torch_xla.core.xla_model as xm
  device = torch_xla.device()
  torch.manual_seed(seed)
  model = Mlp().eval().to(device)
  steady_shape = BUCKETS[0]
  with torch.no_grad():
    compiled = _compiled(mode, model, device)
    if hasattr(compiled, 'wait_ready'):
      compiled.wait_ready()
    x = torch.randn(*steady_shape, WIDTH).to(device)
    for _ in range(20):
      compiled(x)
    xm.wait_device_ops()

  def steady_calls(count: Optional[int], stop: threading.Event) -> List[float]:
    times = []
    with torch.no_grad():
      while (count is None and not stop.is_set()) or (count is not None and
                                                      len(times) < count):
        begin = time.perf_counter()
        compiled(x)
        times.append(time.perf_counter() - begin)
        if len(times) % 50 == 0:
          xm.wait_device_ops()
    return times

  before = sorted(steady_calls(300, threading.Event()))
  stop = threading.Event()
  compile_seconds = []

  def compile_new_shapes() -> None:
    begin = time.perf_counter()
    with torch.no_grad():
      for batch, seq in NEW_SHAPES:
        compiled(torch.zeros(batch, seq, WIDTH, device=device)).cpu()
    compile_seconds.append(time.perf_counter() - begin)
    stop.set()

  during: List[float] = []
  steady = threading.Thread(
      target=lambda: during.extend(steady_calls(None, stop)))
  compiler = threading.Thread(target=compile_new_shapes)
  steady.start()
  compiler.start()
  compiler.join()
  steady.join()
  during.sort()
  return {
      'mode': mode,
      'p50_before_ms': 1e3 * statistics.median(before),
      'p50_ms': 1e3 * statistics.median(during),
      'p99_ms': 1e3 * during[min(len(during) - 1, int(0.99 * len(during)))],
      'worst_ms': 1e3 * during[-1],
      'calls': len(during),
      'compile_s': compile_seconds[0],
  }


def probe_table(rows: List[Dict[str, Any]]) -> str:
  lines = [
      '| mode | steady p50 before, ms | steady p50 during, ms | p99, ms | '
      'worst call, ms | worst / p50 before | calls during | 4 new shapes '
      'compiled in, s |',
      '|---|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for row in rows:
    lines.append(f"| {row['mode']} | {row['p50_before_ms']:.3f} | "
                 f"{row['p50_ms']:.3f} | {row['p99_ms']:.2f} | "
                 f"{row['worst_ms']:.1f} | "
                 f"{row['worst_ms'] / row['p50_before_ms']:.0f}x | "
                 f"{row['calls']} | {row['compile_s']:.2f} |")
  return '\n'.join(lines)


def child_main(args) -> int:
  if args.compile_while_serving:
    print('RESULTS ' +
          json.dumps([compile_while_serving(args.child, args.seed)]))
    return 0
  results = []
  for threads in args.threads:
    results.append(
        run(args.child, threads, args.requests, args.new_shapes, args.swap,
            args.seed))
  print('RESULTS ' + json.dumps(results))
  return 0


def _fmt(value: Optional[float], digits: int = 2) -> str:
  return '-' if value is None else f'{value:.{digits}f}'


def table(rows: List[Dict[str, Any]]) -> str:
  lines = [
      '| mode | threads | requests | req/s | p50 ms | p99 ms | raised | '
      'differ from eager | left the fast path |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---|',
  ]
  for row in rows:
    fallbacks = ', '.join(
        f'{name} {count}' for name, count in sorted(row['fallbacks'].items()))
    lines.append(
        f"| {row['mode']} | {row['threads']} | {row['requests']} | "
        f"{row['requests_per_s']:.0f} | {_fmt(row['p50_ms'])} | "
        f"{_fmt(row['p99_ms'])} | {row['raised']} | {row['mismatches']} | "
        f"{fallbacks or '-'} |")
  return '\n'.join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--modes', default='serve,patched,upstream,eager')
  parser.add_argument('--threads', default='1,2,4,8')
  parser.add_argument('--requests',
                      type=int,
                      default=120,
                      help='requests per thread')
  parser.add_argument('--new-shapes',
                      type=float,
                      default=0.05,
                      help='share of requests of a shape outside the buckets')
  parser.add_argument('--swap',
                      action='store_true',
                      help='replace a Parameter halfway (between barriers)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--compile-while-serving',
                      action='store_true',
                      help='one steady thread while another compiles '
                      'NEW_SHAPES (default modes serve,patched,upstream)')
  parser.add_argument('--json', help='also write the rows here')
  parser.add_argument('--child', help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.threads = [int(n) for n in args.threads.split(',')]
  if args.child:
    return child_main(args)
  if args.compile_while_serving:
    if args.modes == parser.get_default('modes'):
      args.modes = 'serve,patched,upstream'
    args.threads = [2]
  rows = []
  for mode in args.modes.split(','):
    for threads in args.threads:
      command = [
          sys.executable, __file__, '--child', mode, '--threads',
          str(threads), '--requests',
          str(args.requests), '--new-shapes',
          str(args.new_shapes), '--seed',
          str(args.seed)
      ] + (['--swap'] if args.swap else []) + (
          ['--compile-while-serving'] if args.compile_while_serving else [])
      done = subprocess.run(command, capture_output=True, text=True)
      found = [
          line for line in done.stdout.splitlines()
          if line.startswith('RESULTS ')
      ]
      if done.returncode != 0 or not found:
        print(f'{mode}, {threads} threads: the run failed (exit '
              f'{done.returncode})\n{done.stderr[-3000:]}')
        continue
      row, = json.loads(found[-1][len('RESULTS '):])
      rows.append(row)
      if row.get('errors'):
        print(f'{mode}, {threads} threads: {row["errors"]}')
  if args.compile_while_serving:
    print(probe_table(rows))
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(rows, f, indent=1)
    return 0
  print(table(rows))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)
  failed = sum(row['raised'] + row['mismatches'] for row in rows)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())

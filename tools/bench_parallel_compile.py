"""What compile workers give a replay of recorded signatures and precompile().

  python tools/bench_parallel_compile.py [--signatures 16] [--workers 1,2]
      [--rounds 1] [--modes replay,precompile] [--width 512]

A 4-block pre-norm MLP (LayerNorm, Linear, GELU, Linear, residual; d=--width)
under torch.compile(dynamic=True) and the patched bridge, served at
--signatures + 1 batch sizes. In a fresh process per mode and worker count
(XLA_PATCHES_COMPILE_WORKERS), the first call traces the last size, then the
tool times the compile of the other --signatures:
  replay       drain_backlog() of the signatures a first process recorded in
               the index (traced on the calling thread, compiled on the
               workers; see [Note: Parallel compiles] in
               torch_xla_patches/compile_window.py);
  precompile   precompile() of their sizes, without an index (traced on the
               calling thread, compiled on the compile pool; see [Note:
               The compile pool]).
Every size is then served, checked against eager CPU, and must not compile.
Side by side in one run, one row per process:
  wall s             wall time of the drain or precompile()
  XLA compile s      the CompileTime metric meanwhile (a sum over compiles:
                     above wall time when they overlap)
  CPU/wall           process CPU seconds (all threads) over wall seconds
  vs 1 worker        wall time over the 1-worker row's of its round and mode
--rounds alternates the order of the worker counts between rounds: numbers
vary by about 30% between runs on a small shared machine.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVE = r'''
import copy, json, sys, time
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_patches
from torch_xla_patches import signature_cache

cache_dir, sizes, width, mode = (sys.argv[1], json.loads(sys.argv[2]),
                                 int(sys.argv[3]), sys.argv[4])
if mode == 'precompile':
  torch_xla_patches.apply()
else:
  torch_xla_patches.apply(cache_dir=cache_dir, precompile_mode='off')


class Block(torch.nn.Module):

  def __init__(self, d):
    super().__init__()
    self.norm = torch.nn.LayerNorm(d)
    self.up = torch.nn.Linear(d, 2 * d)
    self.down = torch.nn.Linear(2 * d, d)

  def forward(self, x):
    return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


torch.manual_seed(0)
cpu_model = torch.nn.Sequential(*[Block(width) for _ in range(4)]).eval()
model = copy.deepcopy(cpu_model).to(torch_xla.device())
compiled = torch.compile(model, backend='openxla', dynamic=True)


def call(batch):
  x = torch.randn(batch, width)
  with torch.no_grad():
    got = compiled(x.to(torch_xla.device())).cpu()
    torch.testing.assert_close(got, cpu_model(x), rtol=1e-3, atol=1e-3)


def compile_stats():
  data = met.metric_data('CompileTime')
  return (data[0], data[1] / 1e9) if data else (0, 0.0)




def timed(work):
  count, seconds = compile_stats()
  start, cpu = time.perf_counter(), time.process_time()
  done = work()
  wall, cpu = time.perf_counter() - start, time.process_time() - cpu
  count_after, seconds_after = compile_stats()
  return {
      'signatures': done,
      'wall_s': wall,
      'cpu_s': cpu,
      'compiles': count_after - count,
      'compile_s': seconds_after - seconds,
  }


report = {}
if mode == 'precompile':
  # The first size is dynamo's first call (one frame, its own signature
  # compiled before the call returns); the others are timed.
  call(sizes[0])
  with torch.no_grad():
    report = timed(lambda: len(
        torch_xla_patches.precompile(compiled, [(torch_xla_patches.TensorSpec(
            (n, width)),) for n in sizes[1:]],
                                     progress=False)))
else:
  call(sizes[0])
  if mode == 'replay':
    (cache,) = signature_cache.live_signature_caches()
    report = timed(cache.drain_backlog)
compiles = compile_stats()[0]
for batch in sizes[1:]:
  call(batch)
if mode != 'record':
  # Every size was compiled before: nothing compiles after.
  assert compile_stats()[0] == compiles, 'a served size compiled'
print(json.dumps(report))
'''


def run(cache_dir, sizes, width, mode, workers):
  env = dict(os.environ,
             PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'),
             PYTHONPATH=REPO_ROOT,
             XLA_PATCHES_COMPILE_WORKERS=str(workers),
             XLA_PATCHES_PRECOMPILE_PROGRESS='0')
  proc = subprocess.run([
      sys.executable, '-c', SERVE, cache_dir,
      json.dumps(sizes),
      str(width), mode
  ],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=3600)
  if proc.returncode != 0:
    raise SystemExit(f'workers={workers} failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--signatures', type=int, default=16)
  parser.add_argument('--workers', default='1,2')
  parser.add_argument('--width', type=int, default=512)
  parser.add_argument('--rounds', type=int, default=1)
  parser.add_argument('--modes', default='replay,precompile')
  options = parser.parse_args()
  workers = [int(w) for w in options.workers.split(',')]
  # Batch 1 is specialized by dynamo; the others share one dynamic graph.
  # No size equals the width (dynamo's duck sizing would give both one
  # symbol).
  sizes = [s for s in range(2, options.signatures + 3) if s != options.width]
  modes = options.modes.split(',')
  with tempfile.TemporaryDirectory() as tmp:
    recorded = os.path.join(tmp, 'recorded')
    if 'replay' in modes:
      run(recorded, sizes, options.width, 'record', workers=1)
    rows = []
    for round_number in range(options.rounds):
      order = workers if round_number % 2 == 0 else workers[::-1]
      for mode in modes:
        for count in order:
          copy = os.path.join(tmp, f'{mode}-{round_number}-{count}')
          if mode == 'replay':
            shutil.copytree(recorded, copy)
          # The last size first: the first call traces it, the drain (or
          # precompile) compiles the others.
          got = run(copy, sizes[::-1], options.width, mode, workers=count)
          rows.append((round_number, mode, count, got))
  print(f'{options.signatures} signatures of a 4-block MLP (d={options.width}) '
        f'after the first call, os.cpu_count()={os.cpu_count()}')
  print('| round | what | workers | signatures | wall s | XLA compiles | '
        'XLA compile s | CPU/wall | vs 1 worker |')
  print('|---|---|---|---|---|---|---|---|---|')
  serial = {
      (r, mode): got['wall_s'] for r, mode, count, got in rows if count == 1
  }
  for round_number, mode, count, got in rows:
    ratio = got['wall_s'] / serial.get((round_number, mode), float('nan'))
    what = 'drain_backlog()' if mode == 'replay' else 'precompile()'
    print(f'| {round_number + 1} | {what} | {count} | {got["signatures"]} | '
          f'{got["wall_s"]:.2f} | {got["compiles"]} | {got["compile_s"]:.2f} '
          f'| {got["cpu_s"] / got["wall_s"]:.2f} | {ratio:.2f}x |')


if __name__ == '__main__':
  main()

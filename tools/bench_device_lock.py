"""What another thread's XLA compile costs a thread running compiled programs,
by what the compiled graph's inputs are: placeholders (device data with a
shape and no buffer, `_xla_create_placeholder_tensor`, what a warm-up traces
on), tensors that hold buffers, or aliases of a tensor's buffer (what a
call's new signature is traced on, see [Note: Stand-ins that hold buffers]
in placeholder_trace.py).

  python tools/bench_device_lock.py [--layers 600] [--rounds 3]

Thread B lazily traces a chain of `layers` matmuls on one input and compiles
it with `_xla_warm_up_cache` (what the bridge's compiles call), running
nothing. Meanwhile thread A runs a program compiled ahead (`x + 1`, with
`_run_cached_graph`, as the bridge does) back to back, and thread C, pure
Python, wakes every millisecond. Rows: B's input a placeholder, a tensor
with a buffer, or an alias of one (updated in place by the graph). Columns:
B's compile in seconds, A's steps while it ran, A's p50 and worst step in
ms, and C's longest wait in ms (the GIL: `_run_cached_graph` waits for the
device lock holding it). Each mode runs in a process of its own,
interleaved.

The machine may be shared: compare rows of one run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

MODES = ('placeholder', 'buffer', 'alias')


def one(mode: str, layers: int) -> dict:
  """One measurement, in this process."""
  import torch
  import torch_xla
  import torch_xla.core.xla_builder as xb
  device = torch_xla.device()
  x = torch.ones(4, device=device)
  torch_xla._XLAC._xla_sync_multi([x], [], True, True)
  y = x + 1  # compiled ahead: A's steps only run it
  graph_hash = torch_xla._XLAC._get_graph_hash([y])
  torch_xla._XLAC._xla_warm_up_cache([y], [])
  del y
  held = torch.randn(64, 64, device=device)
  torch_xla._XLAC._xla_sync_multi([held], [], True, True)
  traced = threading.Event()
  compile_s = []

  def thread_b():
    if mode == 'placeholder':
      a = xb.create_placeholder_tensor((64, 64), torch.float32)
    elif mode == 'buffer':
      a = held
    else:
      _, (a,) = torch_xla._XLAC._get_tensors_xla_device_data_node([held], [])
    out = a
    for i in range(layers):
      out = torch.tanh(out @ out + i)
    if mode == 'alias':
      a.add_(out)  # the alias is written; `held` is not
      out = a
    traced.set()
    start = time.perf_counter()
    torch_xla._XLAC._xla_warm_up_cache([out], [])
    compile_s.append(time.perf_counter() - start)

  gaps = []
  done = threading.Event()

  def thread_c():
    last = time.perf_counter()
    while not done.is_set():
      time.sleep(0.001)
      now = time.perf_counter()
      gaps.append(now - last)
      last = now

  b = threading.Thread(target=thread_b)
  b.start()
  traced.wait()
  c = threading.Thread(target=thread_c)
  c.start()
  steps = []
  while b.is_alive():
    start = time.perf_counter()
    torch_xla._XLAC._run_cached_graph(graph_hash, [x])
    steps.append(time.perf_counter() - start)
  b.join()
  done.set()
  c.join()
  return {
      'compile_s': compile_s[0],
      'steps': len(steps),
      'p50_ms': statistics.median(steps) * 1e3 if steps else None,
      'worst_ms': max(steps) * 1e3 if steps else None,
      'gil_wait_ms': max(gaps) * 1e3 if gaps else None,
  }


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=600)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--mode', choices=MODES, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.mode:
    print(json.dumps(one(args.mode, args.layers)))
    return 0
  env = dict(os.environ, PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'))
  results = {mode: [] for mode in MODES}
  for _ in range(args.rounds):
    for mode in MODES:
      done = subprocess.run([
          sys.executable, __file__, '--mode', mode, '--layers',
          str(args.layers)
      ],
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=600)
      lines = [l for l in done.stdout.splitlines() if l.startswith('{')]
      if not lines:
        print(f'{mode}: exit {done.returncode}: {done.stderr[-300:]}')
        return 1
      results[mode].append(json.loads(lines[-1]))
  print(f'Thread A runs a compiled program while thread B compiles a chain of '
        f'{args.layers} matmuls ({args.rounds} rounds, medians).')
  print('| B\'s input | B\'s compile s | A\'s steps meanwhile | A p50 ms '
        '| A worst ms | C\'s longest wait ms |')
  print('|---|---:|---:|---:|---:|---:|')
  for mode, runs in results.items():

    def median(name):
      return statistics.median(r[name] for r in runs)

    print(f'| {mode} | {median("compile_s"):.2f} | {median("steps"):.0f} | '
          f'{median("p50_ms"):.2f} | {median("worst_ms"):.1f} | '
          f'{median("gil_wait_ms"):.1f} |')
  return 0


if __name__ == '__main__':
  sys.exit(main())

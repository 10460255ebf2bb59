"""A compiled training step (forward, backward and optimizer step in one
torch.compile'd function, BatchNorm in the model) upstream, patched with
donation and patched without it: steady step time and XLA compiles.

  python tools/bench_training.py [--rounds 3] [--steps 40]

Each row is one process per round and mode, the modes alternating within a
round (this machine is noisy: compare the ratios of one run). The step is
the one test/test_training_donation.py checks for equal results.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, sys, time
sys.path.insert(0, {test_dir!r})
import torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
if {patched!r}:
  import torch_xla_patches
  torch_xla_patches.apply()
from test_training_donation import compiled_step
device = torch_xla.device()
_, _, compiled = compiled_step({optimizer!r}, False, device)
x = torch.randn(4, 3, 6, 6).to(device)
target = torch.randint(0, 5, (4,)).to(device)
met.clear_all()
times = []
for index in range({steps!r}):
  start = time.perf_counter()
  compiled(x, target)
  torch_xla.sync()
  xm.wait_device_ops()
  times.append(time.perf_counter() - start)
steady = sorted(times[5:])
print(json.dumps({{'ms': 1000 * steady[len(steady) // 2],
                  'compiles': met.metric_data('CompileTime')[0]}}))
'''

MODES = {
    'upstream': (False, '1'),
    'patched': (True, '1'),
    'patched, no donation': (True, '0'),
}


def run(mode, optimizer, steps):
  patched, donate = MODES[mode]
  code = CHILD.format(test_dir=os.path.join(REPO_ROOT, 'test'),
                      patched=patched,
                      optimizer=optimizer,
                      steps=steps)
  env = dict(os.environ, PJRT_DEVICE='CPU', XLA_PATCHES_DONATE=donate)
  proc = subprocess.run([sys.executable, '-c', code],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=False)
  if proc.returncode:
    raise RuntimeError(f'{mode} {optimizer}: {proc.stderr[-2000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--optimizers', default='sgd-momentum,adam,adamw')
  args = parser.parse_args(argv)
  print('| optimizer | mode | steady step ms (median of rounds) | '
        'x upstream | XLA compiles |')
  print('|---|---|---|---|---|')
  for optimizer in args.optimizers.split(','):
    results = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
      for mode in MODES:
        results[mode].append(run(mode, optimizer, args.steps))
    upstream = statistics.median(r['ms'] for r in results['upstream'])
    for mode, rounds in results.items():
      ms = statistics.median(r['ms'] for r in rounds)
      compiles = sorted({r['compiles'] for r in rounds})
      print(
          f'| {optimizer} | {mode} | {ms:.2f} | {ms / upstream:.2f}x | '
          f'{"/".join(str(c) for c in compiles)} |',
          flush=True)


if __name__ == '__main__':
  main()

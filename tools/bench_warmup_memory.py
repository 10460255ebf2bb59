"""Peak memory of a warm-up, for a model that holds a large KV cache.

  python tools/bench_warmup_memory.py [--cache-mib 1024] [--modes serve,precompile]

The model (HeldCache below) holds its KV cache as a buffer and writes rows
of it in place on every call (`index_copy_`), as a decode module whose cache
is module state does. Each mode runs in a fresh process:
  serve       torch_xla_patches.serve(model, 3 buckets, wait=True)
  precompile  torch_xla_patches.precompile(torch.compile(model), 3 buckets)
and reports the peak RSS (ru_maxrss) before the model is made, before the
warm-up (the cache made on the device) and after it, and the peak over
(cache + weights): 1.0 means the warm-up added nothing to what the model
needs, 2.0 a second cache. It also checks that the cache keeps its buffer
and every value (a warm-up compiles without running).
"""
import argparse
import inspect
import json
import os
import resource
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = (2, 4, 8)
WIDTH = 64


def peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mode(mode: str, cache_mib: int) -> dict:
  os.environ.setdefault('PJRT_DEVICE', 'CPU')
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla_patches
  from torch_xla_patches import TensorSpec

  rows = cache_mib * 1024 * 1024 // (4 * WIDTH)

  class HeldCache(torch.nn.Module):

    def __init__(self, device):
      super().__init__()
      self.proj = torch.nn.Linear(WIDTH, WIDTH).to(device)
      # Made on the device: no host copy of the cache in the peak.
      self.register_buffer('cache', torch.full((rows, WIDTH),
                                               0.5,
                                               device=device))

    def forward(self, x):
      slots = torch.arange(x.shape[0], device=x.device)
      self.cache.index_copy_(0, slots, self.proj(x))
      return self.cache[:x.shape[0]].sum(-1)

  device = torch_xla.device()
  torch_xla.sync()
  base = peak_rss_mib()
  torch.manual_seed(0)
  model = HeldCache(device).eval()
  torch_xla.sync()
  xm.wait_device_ops()
  weights_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
  pointer = torch_xla._XLAC._unsafe_buffer_pointer(model.cache)
  before = peak_rss_mib()
  buckets = [(TensorSpec((batch, WIDTH)),) for batch in BATCHES]
  if mode == 'serve':
    if 'wait' in inspect.signature(torch_xla_patches.serve).parameters:
      torch_xla_patches.serve(model, buckets, wait=True)
    else:  # a release of the package from before serve(wait=)
      torch_xla_patches.serve(model, buckets)
  else:
    torch_xla_patches.apply()
    compiled = torch.compile(model, backend='openxla', dynamic=True)
    with torch.no_grad():
      torch_xla_patches.precompile(compiled, buckets, progress=False)
  after = peak_rss_mib()
  xm.wait_device_ops()
  # The same buffer, every element still 0.5 (a warm-up runs nothing).
  unchanged = (torch_xla._XLAC._unsafe_buffer_pointer(model.cache) == pointer
               and bool((model.cache == 0.5).all().cpu()))
  return dict(mode=mode,
              cache_mib=cache_mib,
              weights_mib=weights_mib,
              base_mib=base,
              peak_before_mib=before,
              peak_after_mib=after,
              unchanged=unchanged)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cache-mib', type=int, default=1024)
  parser.add_argument('--modes', default='serve,precompile')
  parser.add_argument('--row', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.row:
    print('RESULT ' + json.dumps(run_mode(args.row, args.cache_mib)))
    return 0
  lines = [
      '| mode | cache MiB | peak RSS before the model, MiB | before the '
      'warm-up | after it | (peak - before the model) / (cache + weights) | '
      'cache unchanged |',
      '|---|---:|---:|---:|---:|---:|---|',
  ]
  failed = False
  for mode in args.modes.split(','):
    # A PYTHONPATH given first: another checkout of the package, to compare.
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join(
                   [os.environ.get('PYTHONPATH', ''), REPO_ROOT]))
    env.setdefault('PJRT_DEVICE', 'CPU')
    env.setdefault('XLA_PATCHES_PRECOMPILE_PROGRESS', '0')
    done = subprocess.run([
        sys.executable, __file__, '--row', mode, '--cache-mib',
        str(args.cache_mib)
    ],
                          capture_output=True,
                          text=True,
                          env=env)
    found = [l for l in done.stdout.splitlines() if l.startswith('RESULT ')]
    if done.returncode or not found:
      print(f'{mode}: failed\n{done.stderr[-2000:]}')
      failed = True
      continue
    r = json.loads(found[-1][len('RESULT '):])
    growth = (r['peak_after_mib'] - r['base_mib']) / (r['cache_mib'] +
                                                      r['weights_mib'])
    lines.append(f"| {mode} | {r['cache_mib']} | {r['base_mib']:.0f} | "
                 f"{r['peak_before_mib']:.0f} | "
                 f"{r['peak_after_mib']:.0f} | {growth:.2f} | "
                 f"{r['unchanged']} |")
    failed |= not r['unchanged']
  print('\n'.join(lines))
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())

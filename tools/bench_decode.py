"""Decode loops with a KV cache updated in place: step time and peak memory.

  python tools/bench_decode.py [--demo] [--steps 60] [--large-mib 256]
                               [--huge] [--skip-hf] [--floor] [--mesh]
  python tools/bench_decode.py --floor --skip-paged --skip-hf   # part 3 only
  python tools/bench_decode.py --mesh --skip-paged --skip-hf    # part 4 only
  python tools/bench_decode.py --hf-module --skip-paged --skip-hf  # part 5
  python tools/bench_decode.py --hf-generate --skip-paged --skip-hf  # part 6
  python tools/bench_decode.py --hf-export --skip-paged --skip-hf  # part 7

Each part is a module of its own beside this one, its module docstring
saying what it measures and its columns; bench_decode_common.py holds what
they share (the paged decoder, the tiny Llama, the measurements, the rows and
tables of parts 5 to 7):
  part 1, 4  bench_decode_paged.py        a paged decode step (vLLM's), and
                                          the same on a mesh (--mesh)
  part 2     bench_decode_static_cache.py generate() with a StaticCache
  part 3     bench_decode_floor.py        the served step against the floor
                                          of its program (--floor)
  part 5     bench_decode_hf_module.py    a module holding a StaticCache
                                          (--hf-module)
  part 6     bench_decode_hf_generate.py  generate() on a compiled or served
                                          forward (--hf-generate)
  part 7     bench_decode_hf_export.py    transformers'
                                          TorchExportableModuleWithStaticCache
                                          (--hf-export)
Each row runs in a fresh process of this tool (hidden `--row`).

All rows of one run are measured side by side; compare them as ratios (the
machine may be shared).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict

import bench_decode_floor as floor
import bench_decode_hf_export as hf_export
import bench_decode_hf_generate as hf_generate
import bench_decode_hf_module as hf_module
import bench_decode_paged as paged
import bench_decode_static_cache as static_cache
from bench_decode_common import (HF_MODULE_CACHE_ENV, HF_MODULE_MODES,
                                 MESH_DEVICES, MODES, hf_module_table)
# Kept under this tool's name for the tests that use its decoders
# (test_concurrency.py, test_hf_static_cache.py).
from bench_decode_common import (  # pylint: disable=unused-import
    D_MODEL, LAYERS, PAD_SLOT, PagedDecoder, cache_slots, make_steps,
    serve_paged, step_arguments)
from bench_decode_hf_module import (  # pylint: disable=unused-import
    CachedDecoder)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_row(kind: str, mode: str, size: float, args) -> Dict[str, Any]:
  """A row in a fresh process of this tool; its JSON line, or
  {'error': ...}."""
  command = [
      sys.executable,
      os.path.abspath(__file__), '--row', kind, mode,
      str(size), '--steps',
      str(args.steps), '--warmup',
      str(args.warmup), '--hf-tokens',
      str(args.hf_tokens), '--hf-runs',
      str(args.hf_runs), '--floor-rounds',
      str(args.floor_rounds)
  ]
  env = dict(os.environ, PJRT_DEVICE='CPU')
  if kind == 'paged-mesh':
    env['CPU_NUM_DEVICES'] = str(MESH_DEVICES)
  env['PYTHONPATH'] = os.pathsep.join(
      filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  env.setdefault('XLA_PATCHES_PRECOMPILE_PROGRESS', '0')
  start = time.perf_counter()
  proc = subprocess.run(command,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=3600)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode != 0 or not lines:
    tail = (proc.stderr.strip().splitlines() or ['no output'])[-1]
    result = {'error': f'exit {proc.returncode}: {tail}'.replace('|', '/')}
  else:
    result = json.loads(lines[-1])
  result['process_s'] = time.perf_counter() - start
  print(f'  {kind} {mode} {size:g}: {json.dumps(result)}',
        file=sys.stderr,
        flush=True)
  return result


def hf_serve_rows(kind: str, args) -> Dict[tuple, Dict[str, Any]]:
  """Parts 5 to 7: each of HF_MODULE_MODES at each --hf-lengths, a fresh
  cache directory per length (serve-restart runs on the one serve
  filled)."""
  results = {}
  for length in args.hf_lengths:
    with tempfile.TemporaryDirectory(prefix='xla_patches_hf_') as cache_dir:
      os.environ[HF_MODULE_CACHE_ENV] = cache_dir
      for mode in HF_MODULE_MODES:
        results[(mode, length)] = run_row(kind, mode, length, args)
  return results


def row_main(kind: str, mode: str, size: float, args) -> int:
  """The hidden `--row` entry: one row, printed as one JSON line; an error
  is a row too."""
  try:
    if kind in ('paged', 'paged-mesh'):
      result = paged.paged_row(mode,
                               size,
                               args.warmup,
                               args.steps,
                               on_mesh=kind == 'paged-mesh')
    elif kind == 'hf-module':
      result = hf_module.hf_module_row(mode, int(size), args.hf_tokens)
    elif kind == 'hf-generate':
      result = hf_generate.hf_generate_row(mode, int(size), args.hf_tokens)
    elif kind == 'hf-export':
      result = hf_export.hf_export_row(mode, int(size), args.hf_tokens)
    elif kind == 'floor':
      # A floor row's mode is its count of other live tensors.
      result = floor.floor_row(size, int(mode), args.warmup, args.steps,
                               args.floor_rounds)
    else:
      result = static_cache.hf_row(mode, int(size), args.hf_tokens,
                                   args.hf_runs)
  except Exception as e:  # pylint: disable=broad-except
    # The whole story on stderr, for a rerun of the row; its first line in
    # the table.
    traceback.print_exc()
    first = (str(e).strip().splitlines() or [''])[0]
    result = {'error': f'{type(e).__name__}: {first}'[:300].replace('|', '/')}
  print(json.dumps(result), flush=True)
  return 0


def main() -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--demo',
                      action='store_true',
                      help='a quick run: 24 steps per row, one timed '
                      'generate of 16 tokens')
  parser.add_argument('--steps',
                      type=int,
                      default=None,
                      help='timed decode steps per row (default 60, demo 24)')
  parser.add_argument('--warmup',
                      type=int,
                      default=6,
                      help='untimed steps first (they compile each bucket)')
  parser.add_argument('--small-mib', type=float, default=1.0)
  parser.add_argument('--large-mib', type=float, default=256.0)
  parser.add_argument('--huge',
                      action='store_true',
                      help='also a 1 GiB cache per row (peak RSS check)')
  parser.add_argument('--hf-lengths',
                      type=int,
                      nargs=2,
                      default=(64, 4096),
                      help='the two static cache lengths of part 2')
  parser.add_argument('--hf-tokens',
                      type=int,
                      default=None,
                      help='new tokens per generate (default 32, demo 16)')
  parser.add_argument('--hf-runs',
                      type=int,
                      default=None,
                      help='timed generate calls after 2 warm-up ones '
                      '(default 3, demo 1)')
  parser.add_argument('--floor',
                      action='store_true',
                      help='also part 3: the serve row\'s step against the '
                      'floor of its program')
  parser.add_argument('--floor-rounds',
                      type=int,
                      default=5,
                      help='interleaved rounds of --steps steps per row '
                      '(part 3)')
  parser.add_argument('--floor-live',
                      type=int,
                      nargs='+',
                      default=(0, 400),
                      help='other live XLA tensors during part 3, one row '
                      'each (400: about a 7B Llama\'s parameters and KV '
                      'caches)')
  parser.add_argument('--mesh',
                      action='store_true',
                      help='also part 4: part 1 with the caches sharded over '
                      f'a mesh of {MESH_DEVICES} virtual devices')
  parser.add_argument('--hf-module',
                      action='store_true',
                      help='also part 5: a module holding a StaticCache, '
                      'through torch.compile and serve() (first start and '
                      'restart)')
  parser.add_argument('--hf-generate',
                      action='store_true',
                      help='part 6: generate() on a compiled or served '
                      'forward')
  parser.add_argument('--hf-export',
                      action='store_true',
                      help='part 7: transformers\' '
                      'TorchExportableModuleWithStaticCache, one token a call')
  parser.add_argument('--skip-hf', action='store_true')
  parser.add_argument('--skip-paged', action='store_true')
  parser.add_argument('--row', nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.steps is None:
    args.steps = 24 if args.demo else 60
  if args.hf_tokens is None:
    args.hf_tokens = 16 if args.demo else 32
  if args.hf_runs is None:
    args.hf_runs = 1 if args.demo else 3
  if args.row:
    kind, mode, size = args.row
    return row_main(kind, mode, float(size), args)

  started = time.perf_counter()
  output = []
  if not args.skip_paged:
    sizes = [args.small_mib, args.large_mib] + ([1024.0] if args.huge else [])
    results = {
        (mode, size): run_row('paged', mode, size, args) for mode in MODES
        for size in sizes
    }
    output += [paged.title(args)] + paged.paged_table(results, sizes)
  if not args.skip_hf:
    lengths = list(args.hf_lengths)
    results = {
        (mode, length): run_row('hf', mode, length, args)
        for mode in ('upstream', 'patched') for length in lengths
    }
    output += [static_cache.title(args)] + static_cache.hf_table(
        results, lengths)
  if args.mesh:
    sizes = [args.small_mib, args.large_mib]
    results = {
        (mode, size): run_row('paged-mesh', mode, size, args) for mode in MODES
        for size in sizes
    }
    output += [paged.mesh_title(args)] + paged.paged_table(results, sizes)
  if args.hf_module:
    lengths = list(args.hf_lengths)
    results = hf_serve_rows('hf-module', args)
    output += [hf_module.title(args)] + hf_module_table(results, lengths)
  if args.hf_generate:
    lengths = list(args.hf_lengths)
    results = hf_serve_rows('hf-generate', args)
    output += [hf_generate.title(args)] + hf_generate.hf_generate_table(
        results, lengths)
  if args.hf_export:
    lengths = list(args.hf_lengths)
    results = hf_serve_rows('hf-export', args)
    output += [hf_export.title(args)] + hf_module_table(results, lengths)
  if args.floor:
    sizes = [args.small_mib, args.large_mib]
    results = {
        (size, live): run_row('floor', str(live), size, args)
        for live in args.floor_live for size in sizes
    }
    output += [floor.title(args)] + floor.floor_table(results)
  print('\n'.join(output))
  print(f'\n{time.perf_counter() - started:.0f} s in all')
  return 0


if __name__ == '__main__':
  sys.exit(main())

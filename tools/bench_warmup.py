"""Warm-up benchmark: how long a server takes to serve every shape once.

A built-in decoder LM (token embedding, N pre-norm blocks with causal SDPA and
a GELU MLP, tied output head) is served over a grid of (batch, seq) shapes.
Each mode runs in a fresh process, one after another in this run:

  upstream-static    the installed torch_xla's bridge, dynamic=False (a trace
                     per shape)
  upstream-dynamic   the installed torch_xla's bridge, dynamic=True
  patched-cold       torch_xla_patches.apply(), dynamic=True, empty index
  patched-precompile patched, torch_xla_patches.precompile(grid) then serve
  patched-index      patched, fresh process whose index the cold run filled
  patched-artifact   patched, fresh process that loads a saved artifact
                     (torch_xla_patches.save after a separate process served
                     the grid): no dynamo trace; first result, then the
                     recorded signatures precompiled, then the grid served;
                     needs torch 2.9 (on 2.8 its row reports that)
  serve-wait         torch_xla_patches.serve(model, grid, cache_dir=...,
                     wait=True) in a fresh process with an empty cache
                     directory: returns once every bucket is compiled; then
                     the grid served
  serve-wait-restart the same call in a fresh process on the cache
                     directory serve-wait filled: the artifact is loaded, no
                     dynamo frame on torch 2.9 (torch 2.8 traces again)
  serve              serve() as its default: it returns once the model is
                     captured, the buckets compile in the background, and
                     each call of the grid is served when its bucket is
                     ready (a call moves its bucket to the front); empty
                     cache directory
  serve-restart      the same on the cache directory serve filled

For each: wall seconds to serve the grid once (after model set-up), time to
the first result, time until every bucket is ready (serve modes), dynamo
frame compiles, lazy traces, XLA compiles and seconds spent in XLA compile.
Prints a markdown table, writes JSON and a PNG chart (a mark on each bar at
its first result).

  python tools/bench_warmup.py            # the full 30-shape grid
  python tools/bench_warmup.py --demo     # a 12-shape grid, for make demo
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL_GRID = [
    (b, s) for b in (1, 2, 4, 8, 16) for s in (16, 32, 64, 128, 256, 512)
]
DEMO_GRID = [(b, s) for b in (1, 2, 4, 8) for s in (16, 32, 64)]

MODES = ('upstream-static', 'upstream-dynamic', 'patched-cold',
         'patched-precompile', 'patched-index', 'patched-artifact',
         'serve-wait', 'serve-wait-restart', 'serve', 'serve-restart')
# Set in the child process that saves the patched-artifact mode's artifact.
_SAVE_ARTIFACT_ENV = 'XLA_PATCHES_BENCH_SAVE_ARTIFACT'


def build_model(norm: str, layers: int, width: int, vocab: int = 256):
  import torch
  import torch.nn.functional as F

  class RMSNorm(torch.nn.Module):

    def __init__(self, dim, eps=1e-6):
      super().__init__()
      self.eps = eps
      self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
      scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
      return x * scale * self.weight

  def make_norm():
    return torch.nn.LayerNorm(width) if norm == 'layernorm' else RMSNorm(width)

  class Block(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.heads = 4
      self.norm1 = make_norm()
      self.qkv = torch.nn.Linear(width, 3 * width)
      self.proj = torch.nn.Linear(width, width)
      self.norm2 = make_norm()
      self.up = torch.nn.Linear(width, 4 * width)
      self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
      batch, seq, _ = x.shape
      q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
      q, k, v = (t.reshape(batch, seq, self.heads, -1).transpose(1, 2)
                 for t in (q, k, v))
      attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
      return x + self.down(F.gelu(self.up(self.norm2(x))))

  class DecoderLM(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.embed = torch.nn.Embedding(vocab, width)
      self.pos = torch.nn.Embedding(1024, width)
      self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
      self.norm = make_norm()

    def forward(self, tokens):
      positions = torch.arange(tokens.shape[1], device=tokens.device)
      x = self.embed(tokens) + self.pos(positions)
      for block in self.blocks:
        x = block(x)
      return self.norm(x) @ self.embed.weight.t()

  torch.manual_seed(0)
  return DecoderLM()


def _hoist_local_classes(model) -> None:
  """torch 2.9's aot_compile cannot save a type guard on a class defined in
  a function ("defined in local scope"), and build_model's are. Name them at
  this module's top level so the guard pickles them by reference; the saving
  and the loading process both run this file and do the same."""
  module = sys.modules[__name__]
  for cls in {type(m) for m in model.modules()}:
    if '<locals>' in cls.__qualname__:
      cls.__qualname__ = cls.__name__
      setattr(module, cls.__name__, cls)


def _artifact_model(grid, norm, layers, width):
  import torch
  import torch_xla
  device = torch_xla.device()
  model = build_model(norm, layers, width).to(device).eval()
  _hoist_local_classes(model)
  torch.manual_seed(1)
  token_batches = [torch.randint(0, 256, (b, s)) for b, s in grid]
  return model, token_batches, device


def _served_lm(grid, norm, layers, width):
  """For the modes that load or serve the LM in this process, after apply():
  the model on the device, the grid's token batches on the device, eager CPU
  results, and a one-item list counting the bridge's lazy traces; metrics
  cleared, grad off."""
  import torch
  import torch_xla
  import torch_xla.debug.metrics as met
  from torch_xla_patches import dynamo_bridge as patched_bridge
  traces = [0]
  original_helper = patched_bridge.extract_graph_helper

  def counting_helper(*args, **kwargs):
    traces[0] += 1
    return original_helper(*args, **kwargs)

  patched_bridge.extract_graph_helper = counting_helper
  model, token_batches, device = _artifact_model(grid, norm, layers, width)
  with torch.no_grad():
    cpu_model = build_model(norm, layers, width).eval()
    expected = [cpu_model(tokens) for tokens in token_batches]
  device_batches = [tokens.to(device) for tokens in token_batches]
  torch_xla.sync()
  met.clear_all()
  torch.set_grad_enabled(False)
  return model, device_batches, expected, traces


def save_artifact(grid, norm, layers, width, path) -> dict:
  """The patched-artifact mode's first step (its own process): capture
  with aot_compile, serve the grid so every signature is recorded, save."""
  import torch_xla_patches
  from torch_xla_patches import serialization
  torch_xla_patches.apply()
  model, token_batches, device = _artifact_model(grid, norm, layers, width)
  start = time.perf_counter()
  # A size of 1 would be captured as a constant: capture with sizes >= 2.
  example = next(t for t in token_batches if min(t.shape) > 1)
  compiled = serialization.aot_compile(model, (example.to(device),))
  for tokens in token_batches:
    compiled(tokens.to(device)).cpu()
  torch_xla_patches.save(compiled, path)
  return {'saved': path, 'save_s': time.perf_counter() - start}


def run_artifact_mode(grid, norm, layers, width, cache_dir) -> dict:
  """patched-artifact: load the artifact in this fresh process and serve."""
  path = os.path.join(cache_dir, f'decoder_{norm}.xla_aot')
  save_report = {}
  if not os.path.exists(path):
    env = dict(os.environ, **{_SAVE_ARTIFACT_ENV: path})
    env['PYTHONPATH'] = os.pathsep.join([REPO_ROOT, env.get('PYTHONPATH', '')])
    command = [
        sys.executable,
        os.path.abspath(__file__), '--run-mode=patched-artifact',
        f'--norm={norm}', f'--layers={layers}', f'--width={width}',
        f'--cache-dir={cache_dir}'
    ] + (['--demo'] if grid == DEMO_GRID else [])
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith('{')]
    if proc.returncode != 0 or not lines:
      raise RuntimeError('saving the artifact failed: ' + proc.stderr[-500:])
    save_report = json.loads(lines[-1])
  import torch_xla.debug.metrics as met
  import torch_xla_patches
  from torch._dynamo.utils import counters
  # 'off': the first request is served first; the rest are compiled by
  # precompile_pending() right after, and timed on their own.
  torch_xla_patches.apply(precompile_mode='off')
  model, device_batches, expected, traces = _served_lm(grid, norm, layers,
                                                       width)

  start = time.perf_counter()
  loaded = torch_xla_patches.load(path, model=model, precompile=False)
  load_seconds = time.perf_counter() - start
  outputs = [loaded(device_batches[0]).cpu()]
  first_result = time.perf_counter() - start
  loaded.precompile_pending()
  all_ready = time.perf_counter() - start
  for tokens in device_batches[1:]:
    outputs.append(loaded(tokens).cpu())
  wall = time.perf_counter() - start
  max_diff = max(
      float((out - ref).abs().max()) for out, ref in zip(outputs, expected))
  compile_data = met.metric_data('CompileTime')
  precompiled = met.counter_value('DynamoSignaturePrecompiled') or 0
  return dict(mode='patched-artifact',
              shapes=len(grid),
              wall_s=wall,
              first_result_s=first_result,
              precompile_s=all_ready - first_result,
              load_s=load_seconds,
              all_ready_s=all_ready,
              save_s=save_report.get('save_s', 0.0),
              dynamo_frames=counters['stats']['unique_graphs'],
              dynamo_frames_seen=sum(counters['frames'].values()),
              lazy_traces=traces[0],
              xla_compiles=compile_data[0] if compile_data else 0,
              xla_compile_s=compile_data[1] / 1e9 if compile_data else 0.0,
              served_misses=met.counter_value('DynamoSignatureMiss') or 0,
              precompiled_from_index=precompiled,
              max_abs_diff_vs_eager=max_diff)


def run_serve_mode(mode, grid, norm, layers, width, cache_dir) -> dict:
  """serve, serve-wait and their restarts: torch_xla_patches.serve over the
  grid, then the grid served."""
  import torch_xla.debug.metrics as met
  import torch_xla_patches
  from torch._dynamo.utils import counters
  torch_xla_patches.apply()
  model, device_batches, expected, traces = _served_lm(grid, norm, layers,
                                                       width)

  start = time.perf_counter()
  served = torch_xla_patches.serve(
      model, [(torch_xla_patches.TensorSpec(tuple(t.shape), t.dtype),)
              for t in device_batches],
      cache_dir=cache_dir,
      wait=mode.startswith('serve-wait'))
  serve_seconds = time.perf_counter() - start
  outputs = []
  first_result = None
  for tokens in device_batches:
    outputs.append(served(tokens).cpu())
    if first_result is None:
      first_result = time.perf_counter() - start
  wall = time.perf_counter() - start
  served.wait_ready()
  all_ready = time.perf_counter() - start
  max_diff = max(
      float((out - ref).abs().max()) for out, ref in zip(outputs, expected))
  compile_data = met.metric_data('CompileTime')
  return dict(
      mode=mode,
      shapes=len(grid),
      wall_s=wall,
      first_result_s=first_result,
      all_ready_s=all_ready,
      serve_s=serve_seconds,
      loaded_artifact=served.loaded,
      dynamo_frames=counters['stats']['unique_graphs'],
      lazy_traces=traces[0],
      xla_compiles=compile_data[0] if compile_data else 0,
      xla_compile_s=compile_data[1] / 1e9 if compile_data else 0.0,
      served_misses=met.counter_value('DynamoSignatureMiss') or 0,
      precompiled_from_index=met.counter_value('DynamoSignaturePrecompiled') or
      0,
      max_abs_diff_vs_eager=max_diff)


def run_mode(mode: str, grid, norm: str, layers: int, width: int,
             cache_dir: str) -> dict:
  """Runs one mode in this process; returns its measurements."""
  os.environ.setdefault('PJRT_DEVICE', 'CPU')
  if mode == 'patched-artifact':
    if os.environ.get(_SAVE_ARTIFACT_ENV):
      return save_artifact(grid, norm, layers, width,
                           os.environ[_SAVE_ARTIFACT_ENV])
    return run_artifact_mode(grid, norm, layers, width, cache_dir)
  if mode.startswith('serve'):
    return run_serve_mode(mode, grid, norm, layers, width, cache_dir)
  import torch
  import torch._dynamo
  import torch_xla
  import torch_xla.debug.metrics as met
  import torch_xla._dynamo.dynamo_bridge as upstream_bridge
  import torch_xla_patches
  from torch_xla_patches import dynamo_bridge as patched_bridge

  patched = mode.startswith('patched')
  if patched:
    torch_xla_patches.apply(cache_dir=cache_dir)
  if mode == 'upstream-static':
    # 30 shapes need 30 dynamo cache entries; the default limit is 8.
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512

  traces = [0]
  bridge_module = patched_bridge if patched else upstream_bridge
  original_helper = bridge_module.extract_graph_helper

  def counting_helper(*args, **kwargs):
    traces[0] += 1
    return original_helper(*args, **kwargs)

  bridge_module.extract_graph_helper = counting_helper
  frames = [0]
  openxla = torch._dynamo.lookup_backend('openxla')

  def counting_backend(gm, example_inputs):
    frames[0] += 1
    return openxla(gm, example_inputs)

  device = torch_xla.device()
  model = build_model(norm, layers, width).to(device).eval()
  token_batches = [torch.randint(0, 256, (b, s)).to(device) for b, s in grid]
  torch_xla.sync()
  met.clear_all()
  torch.set_grad_enabled(False)
  compiled = torch.compile(model,
                           backend=counting_backend,
                           dynamic=(mode != 'upstream-static'))

  start = time.perf_counter()
  first_result = None
  precompile_seconds = 0.0
  if mode == 'patched-precompile':
    torch_xla_patches.precompile(compiled,
                                 [(tokens,) for tokens in token_batches],
                                 progress=False)
    precompile_seconds = time.perf_counter() - start
  for tokens in token_batches:
    compiled(tokens).cpu()
    if first_result is None:
      first_result = time.perf_counter() - start
  wall = time.perf_counter() - start

  compile_data = met.metric_data('CompileTime')
  result = {
      'mode': mode,
      'shapes': len(grid),
      'wall_s': wall,
      'first_result_s': first_result,
      'precompile_s': precompile_seconds,
      'dynamo_frames': frames[0],
      'lazy_traces': traces[0],
      'xla_compiles': compile_data[0] if compile_data else 0,
      'xla_compile_s': compile_data[1] / 1e9 if compile_data else 0.0,
  }
  if patched:
    result['served_misses'] = met.counter_value('DynamoSignatureMiss') or 0
    result['precompiled_from_index'] = met.counter_value(
        'DynamoSignaturePrecompiled') or 0
  return result


def run_in_subprocess(mode, args, cache_dir) -> dict:
  command = [
      sys.executable,
      os.path.abspath(__file__), '--run-mode', mode, '--norm', args.norm,
      '--layers',
      str(args.layers), '--width',
      str(args.width), '--cache-dir', cache_dir
  ]
  if args.demo:
    command.append('--demo')
  env = dict(os.environ, PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'))
  env['PYTHONPATH'] = os.pathsep.join([REPO_ROOT, env.get('PYTHONPATH', '')])
  env.setdefault('XLA_PATCHES_PRECOMPILE_PROGRESS', '0')
  print(f'running {mode} ...', file=sys.stderr, flush=True)
  proc = subprocess.run(command, env=env, capture_output=True, text=True)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('{')]
  if proc.returncode != 0 or not lines:
    lines = proc.stderr.strip().splitlines() or ['no output']
    reason = lines[-1].replace('|', '/')
    return {
        'mode': mode,
        'error': f'exit status {proc.returncode}: {reason[:90]}'
    }
  return json.loads(lines[-1])


def short_reason(error: BaseException) -> str:
  """`Type: first line` of the innermost cause, short enough for a table."""
  while error.__cause__ is not None:
    error = error.__cause__
  kind = type(error).__name__
  message = (str(error).strip().splitlines() or [''])[0]
  # dynamo wraps the real error: "... failed to run FX node ...: got
  # RuntimeError('the message\nmore')": keep the inner type and first line.
  if ': got ' in message:
    message = message.rsplit(': got ', 1)[1]
    inner = re.match(r"(\w+)\(['\"](.*)", message)
    if inner:
      kind, message = inner.group(1), inner.group(2)
    message = re.split(r"\\n|['\"]\)$", message)[0]
  message = message.replace('|', '/')
  if len(message) > 90:
    message = message[:87] + '...'
  return f'{kind}: {message}'


def format_table(results, grid_name: str) -> str:
  by_mode = {r['mode']: r for r in results}
  reference = {
      name: by_mode[name]['wall_s']
      for name in ('upstream-static', 'upstream-dynamic')
      if name in by_mode and 'error' not in by_mode[name]
  }
  rows = [
      f'Warm-up over the {grid_name} grid ({results[0].get("shapes", "?")} '
      'shapes), one fresh process per mode', '',
      '| mode | wall s | first result s | all buckets ready s | dynamo frames '
      '| lazy traces | XLA compiles | XLA compile s | vs upstream static | '
      'vs upstream dynamic |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|'
  ]
  for r in results:
    if 'error' in r:
      rows.append(f'| {r["mode"]} | failed: {r["error"]} | | | | | | | | |')
      continue
    ready = (f'{r["all_ready_s"]:.1f}'
             if r.get('all_ready_s') is not None else '-')
    ratios = [
        f'{r["wall_s"] / reference[name]:.2f}x' if name in reference else '-'
        for name in ('upstream-static', 'upstream-dynamic')
    ]
    rows.append(f'| {r["mode"]} | {r["wall_s"]:.1f} | '
                f'{r["first_result_s"]:.1f} | {ready} | {r["dynamo_frames"]} | '
                f'{r["lazy_traces"]} | {r["xla_compiles"]} | '
                f'{r["xla_compile_s"]:.1f} | {ratios[0]} | {ratios[1]} |')
  cold = by_mode.get('patched-cold')
  if cold and 'error' not in cold and cold['xla_compile_s']:
    rows.append('')
    rows.append(f'patched-cold wall / its own XLA compile seconds: '
                f'{cold["wall_s"] / cold["xla_compile_s"]:.2f}')
  for name in ('serve-wait', 'serve-wait-restart', 'serve', 'serve-restart'):
    served = by_mode.get(name)
    if served and 'error' not in served and served['xla_compile_s']:
      rows.append(f'{name}: wall / its own XLA compile seconds '
                  f'{served["wall_s"] / served["xla_compile_s"]:.2f}; '
                  f'serve() returned after {served["serve_s"]:.1f} s; '
                  f'artifact loaded: {served["loaded_artifact"]}; largest '
                  'difference from eager '
                  f'{served["max_abs_diff_vs_eager"]:.1e}')
  index = by_mode.get('patched-index')
  if index and 'error' not in index:
    rows.append(f'patched-index: {index["precompiled_from_index"]} signatures '
                f'compiled from the index, {index["served_misses"]} requests '
                'traced on arrival (the first request of each graph)')
  return '\n'.join(rows)


def write_chart(results, path: str) -> bool:
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    print('matplotlib is not installed; no chart written', file=sys.stderr)
    return False
  ok = [r for r in results if 'error' not in r]
  names = [r['mode'] for r in ok]
  walls = [r['wall_s'] for r in ok]
  compiles = [r['xla_compile_s'] for r in ok]
  fig, ax = plt.subplots(figsize=(8, 3.8))
  positions = range(len(ok))
  ax.barh(positions, walls, color='#4c72b0', label='wall seconds')
  ax.barh(positions,
          compiles,
          color='#dd8452',
          height=0.4,
          label='of which XLA compile')
  ax.set_yticks(list(positions), names)
  ax.invert_yaxis()
  ax.set_xlabel('seconds to serve every shape once')
  ax.legend(loc='lower right')
  firsts = [r['first_result_s'] for r in ok]
  ax.scatter(firsts,
             list(positions),
             marker='|',
             s=400,
             color='black',
             zorder=3,
             label='first result')
  for pos, wall in zip(positions, walls):
    ax.text(wall, pos, f' {wall:.1f}s', va='center')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--demo',
                      action='store_true',
                      help='the 12-shape grid (batch 1-8 x seq 16-64)')
  parser.add_argument('--norm',
                      choices=('layernorm', 'rmsnorm'),
                      default='layernorm')
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--width', type=int, default=128)
  parser.add_argument('--modes', default=','.join(MODES))
  parser.add_argument('--out', default=os.path.join(REPO_ROOT, 'bench_out'))
  parser.add_argument('--run-mode', help=argparse.SUPPRESS)
  parser.add_argument('--cache-dir', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  grid = DEMO_GRID if args.demo else FULL_GRID

  if args.run_mode:
    try:
      result = run_mode(args.run_mode, grid, args.norm, args.layers, args.width,
                        args.cache_dir)
    except Exception as error:  # pylint: disable=broad-except
      # A mode that cannot run (upstream dynamic=True on LayerNorm) is a
      # result of the benchmark: report it in one line, the full error on
      # stderr.
      import traceback
      traceback.print_exc()
      result = {'mode': args.run_mode, 'error': short_reason(error)}
    print(json.dumps(result))
    return 0

  modes = [m.strip() for m in args.modes.split(',') if m.strip()]
  results = []
  with tempfile.TemporaryDirectory(prefix='xla_patches_bench_') as root:
    for mode in modes:
      # patched-index reads the index patched-cold wrote, serve-restart the
      # directory serve filled; every other mode starts from an empty cache
      # directory of its own.
      if mode in ('patched-cold', 'patched-index'):
        cache_dir = os.path.join(root, 'shared')
      elif mode in ('serve', 'serve-restart'):
        cache_dir = os.path.join(root, 'serve')
      elif mode in ('serve-wait', 'serve-wait-restart'):
        cache_dir = os.path.join(root, 'serve-wait')
      else:
        cache_dir = os.path.join(root, mode)
      os.makedirs(cache_dir, exist_ok=True)
      results.append(run_in_subprocess(mode, args, cache_dir))
  grid_name = 'demo' if args.demo else 'full'
  table = format_table(results, f'{grid_name} ({args.norm})')
  print(table)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f'warmup_{grid_name}_{args.norm}')
  with open(stem + '.json', 'w') as f:
    json.dump(results, f, indent=2)
  with open(stem + '.md', 'w') as f:
    f.write(table + '\n')
  if write_chart(results, stem + '.png'):
    print(f'\nwrote {stem}.json, {stem}.md and {stem}.png')
  return 1 if any('error' in r and not r['mode'].startswith('upstream')
                  for r in results) else 0


if __name__ == '__main__':
  sys.exit(main())

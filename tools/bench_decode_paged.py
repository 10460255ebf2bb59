"""Parts 1 and 4 of tools/bench_decode.py: a paged decode step, alone and
with its caches sharded over a mesh.

Part 1, a paged decode step as vLLM runs it (PagedDecoder, in
bench_decode_common.py): the decode tokens of up to 24 sequences flattened
and padded to a bucket of 8, 16 or 32 tokens, one paged KV cache per layer
passed as an argument (a list of [num_slots, 2 * d_model] tensors), written
in place each step with `index_copy_` at `slot_mapping`, and attention of
each token over the cache rows of its sequence's block table
(`context_slots`, [tokens, context]), masked past its length. The model is
small (2 layers, d_model 64), so with a large cache a step costs what
writing the cache costs. Each row runs in a fresh process of this tool
(hidden `--row`), once per cache size:
  upstream   torch.compile(model, backend='openxla', dynamic=True)
  patched    torch_xla_patches.apply(), then the same torch.compile
  serve      torch_xla_patches.serve(model, one CallSpec per bucket)
The buckets rotate step by step (8, 16, 32 tokens). After warm-up steps (the
first calls compile), each of --steps steps is timed:
  step ms        median wall time from the call to after torch_xla.sync()
                 and xm.wait_device_ops()
  host us        median CPU time of the calling thread around the call alone
                 (time.thread_time)
  large/small    the row's large-cache step ms over its small-cache step ms
  base RSS       peak RSS (ru_maxrss) after imports, weights and inputs,
                 before the caches are made
  RSS after setup  peak RSS once serve() or torch.compile returned, before
                 the first step (serve() compiles its buckets there)
  peak RSS       peak RSS after the timed steps (read before the eager check)
  peak - base    what the caches, the compiles and the steps added, to set
                 against the cache MiB (+ 0.45 MiB of weights)
  peak growth / cache growth
                 (large peak - small peak) / (large cache - small cache) of
                 the row: about 1 where the cache is updated in its own
                 buffer, about 2 where each step writes a new copy of it
  compiles       XLA compiles during the timed steps (should be 0)
  donated        the bridge's donated-input counter (DynamoDonatedInput),
                 where the patch has one
  vs eager       logits of every real token of every step, and the caches
                 after the last step (the padding slot left out), against
                 the same steps run eagerly on the CPU with the same weights

Part 4 (--mesh), part 1 on a mesh: the same rows and table with each cache
sharded by slot over 4 virtual CPU devices (CPU_NUM_DEVICES=4, SPMD), the
step's inputs and the weights replicated, serve()'s buckets saying the
caches' sharding. Under SPMD every read of a cache is pending IR until a
sync, so a donating step syncs the device's pending IR before it runs.
"""
import copy
import statistics
from typing import Any, Dict, List, Sequence

import torch

from bench_decode_common import (BUCKETS, CONTEXT, D_MODEL, LAYERS,
                                 MESH_DEVICES, MIB, MODES, PAD_SLOT,
                                 PagedDecoder, REAL_TOKENS, ROW_BYTES,
                                 TOLERANCE, cache_slots, compiles, counter,
                                 failed_row, fmt, make_steps, peak_rss_mib,
                                 serve_paged, step_arguments, time_call)


def paged_row(mode: str,
              mib: float,
              warmup: int,
              steps: int,
              on_mesh: bool = False) -> Dict[str, Any]:
  """One paged-decode row, run in this process (see the module docstring);
  with `on_mesh`, the caches sharded by slot over every device (SPMD)."""
  import torch_xla
  import torch_xla.core.xla_model as xm
  cache_sharding = None
  if on_mesh:
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    cache_sharding = (xs.Mesh(np.arange(devices), (devices,),
                              ('slots',)), ('slots', None))
  if mode in ('patched', 'serve'):
    import torch_xla_patches
  if mode == 'patched':
    torch_xla_patches.apply()
  device = torch_xla.device()
  torch.manual_seed(0)
  cpu_model = PagedDecoder().eval()
  model = copy.deepcopy(cpu_model).to(device)
  num_slots = cache_slots(mib)
  cache_shape = (num_slots, 2 * D_MODEL)
  plan = make_steps(num_slots, warmup + steps)
  inputs = [step_arguments(step, device) for step in plan]
  torch_xla.sync()
  xm.wait_device_ops()
  base_rss = peak_rss_mib()
  caches = [torch.zeros(cache_shape, device=device) for _ in range(LAYERS)]
  if cache_sharding is not None:
    for cache in caches:
      xs.mark_sharding(cache, *cache_sharding)
  torch_xla.sync()
  if mode == 'serve':
    run = serve_paged(model, cache_shape, cache_sharding)
  else:
    run = torch.compile(model, backend='openxla', dynamic=True)
  setup_rss = peak_rss_mib()
  outputs, walls, hosts = [], [], []
  compiles_before = compiles()
  with torch.no_grad():
    for index, arguments in enumerate(inputs):
      if index == warmup:
        compiles_before = compiles()
      arguments = dict(arguments)
      logits, wall, host = time_call(run,
                                     arguments.pop('tokens'),
                                     caches=caches,
                                     **arguments)
      outputs.append(logits)
      if index >= warmup:
        walls.append(wall)
        hosts.append(host)
  timed_compiles = compiles() - compiles_before
  peak_rss = peak_rss_mib()
  # The eager reference, after the peak was read.
  with torch.no_grad():
    ref_caches = [torch.zeros(cache_shape) for _ in range(LAYERS)]
    diff = 0.0
    for step, logits in zip(plan, outputs):
      arguments = step_arguments(step, 'cpu')
      expected = cpu_model(arguments.pop('tokens'),
                           caches=ref_caches,
                           **arguments)
      real = step['real']
      diff = max(diff,
                 (logits.cpu()[:real] - expected[:real]).abs().max().item())
    for cache, expected in zip(caches, ref_caches):
      got = cache.cpu()
      keep = torch.ones(num_slots, dtype=torch.bool)
      keep[PAD_SLOT] = False
      diff = max(diff, (got[keep] - expected[keep]).abs().max().item())
      del got
  model_bytes = sum(
      p.numel() * p.element_size() for p in cpu_model.parameters())
  return {
      'step_ms': statistics.median(walls) * 1e3,
      'host_us': statistics.median(hosts) * 1e6,
      'base_rss_mib': base_rss,
      'setup_rss_mib': setup_rss,
      'peak_rss_mib': peak_rss,
      'cache_mib': LAYERS * num_slots * ROW_BYTES / MIB,
      'model_mib': model_bytes / MIB,
      'compiles': timed_compiles,
      'donated': counter('DynamoDonatedInput'),
      'max_diff': diff,
  }


def paged_table(results: Dict[tuple, Dict[str, Any]],
                sizes: Sequence[float]) -> List[str]:
  """Part 1's markdown table."""
  lines = [
      '| row | cache MiB | step ms | host us | large/small step | '
      'base RSS MiB | RSS after setup MiB | peak RSS MiB | peak - base MiB | '
      'peak growth / cache growth | compiles | donated | vs eager |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|',
  ]
  for mode in MODES:
    small = results[(mode, sizes[0])]
    for size in sizes:
      r = results[(mode, size)]
      if 'error' in r:
        lines.append(failed_row(lines, (mode, f'{size:g}'), r['error']))
        continue
      ratio, growth = '-', '-'
      if size != sizes[0] and 'error' not in small:
        ratio = fmt(r['step_ms'] / small['step_ms']) + 'x'
        growth = fmt((r['peak_rss_mib'] - small['peak_rss_mib']) /
                     (r['cache_mib'] - small['cache_mib']))
      check = 'ok' if r['max_diff'] <= TOLERANCE else 'MISMATCH'
      lines.append(
          f'| {mode} | {r["cache_mib"]:g} | {fmt(r["step_ms"])} | '
          f'{fmt(r["host_us"], 1)} | {ratio} | {r["base_rss_mib"]:.0f} | '
          f'{r["setup_rss_mib"]:.0f} | {r["peak_rss_mib"]:.0f} | '
          f'{r["peak_rss_mib"] - r["base_rss_mib"]:.0f} | {growth} | '
          f'{r["compiles"]} | {r["donated"]} | '
          f'{check} ({r["max_diff"]:.1e}) |')
  return lines


def title(args) -> str:
  """Part 1's title line."""
  buckets = '/'.join(map(str, BUCKETS))
  real = '/'.join(map(str, REAL_TOKENS))
  return (
      f'\nPaged decode: {LAYERS} layers, d_model {D_MODEL}, buckets '
      f'{buckets} tokens ({real} real), context {CONTEXT}, weights '
      f'{sum(p.numel() for p in PagedDecoder().parameters()) * 4 / MIB:.2f} '
      f'MiB; median of {args.steps} steps after '
      f'{args.warmup}; one fresh process per row\n')


def mesh_title(args) -> str:
  """Part 4's title line."""
  del args  # the same for every run
  return (
      f'\nPaged decode on a mesh: part 1\'s rows with each cache sharded by '
      f'slot over {MESH_DEVICES} virtual CPU devices (SPMD), the step\'s '
      'inputs and the weights replicated; one fresh process per row\n')

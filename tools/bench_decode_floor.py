"""Part 3 of tools/bench_decode.py: the served decode step against the floor
of its own program.

Part 3 (--floor), the served decode step against the floor of its own
program: in one fresh process per cache size (--small-mib, --large-mib) and
count of other live tensors (--floor-live), serve() as in part 1, with two
sets of caches updated in lockstep, the same steps in the same order:
  served     the serve row's step: served(...) on its caches (the fast path,
             the bucket's bound program)
  floor      the same compiled program (the bridge's entry of that bucket,
             so the same graph hash), run by `_run_cached_graph` from an
             input list prepared before the step (outside the timing): the
             floor step puts the current caches into their slots, runs, and
             keeps the updated caches the run returns for the next step
             (list assignments). The program donates its caches, so an input
             list cannot be run twice (the second run finds its cache
             buffers gone); taking the results over is what any runner of a
             donating program must do. No wait is needed: a result still
             being computed can be donated to the next run (XLA orders the
             two); after the timed rounds, each row runs --steps more steps
             back to back, with no sync or wait between them.
Both are timed as part 1 does (host CPU of the calling thread around the
call alone, then torch_xla.sync() and xm.wait_device_ops() untimed), each
step's inputs made just before it, in --floor-rounds rounds of --steps
steps per row, which row goes first alternating; a row's figure is the
median over rounds of each round's median, served / floor the median of the
rounds' ratios. A donating run syncs the device's live tensors when a
cache holds data it cannot vouch for (any of them may read it), at a cost
that grows with their number, so rows also run with --floor-live other
small tensors alive (400: a 7B Llama's 291 parameters, its 64 per-layer KV
caches and a few more): in the loop the caches hold the last step's
results, and no step should pay it. Every served and floor logit (timed
and back-to-back steps), and the caches at the end, are compared: the same
program gives the same bits.
"""
import dataclasses
import statistics
from typing import Any, Callable, Dict, List, Tuple

import torch

from bench_decode_common import (BUCKETS, D_MODEL, LAYERS, MIB, PagedDecoder,
                                 ROW_BYTES, cache_slots, compiles, failed_row,
                                 fmt, make_steps, serve_paged, step_arguments,
                                 time_call)


@dataclasses.dataclass
class FloorProgram:
  """The compiled program of one bucket, run without the served path.

  Its runner does only what any runner of a donating program must: it puts
  the current caches into their input slots, runs the program, and keeps the
  updated caches it returns for the next run.
  """
  # Key of the program in XLA's computation cache.
  graph_hash: bytes
  # A step's tensors (keyed as the model's forward names them) -> the XLA
  # input list of the program, the caches' slots left None.
  prepare: Callable[[Dict[str, torch.Tensor]], List[Any]]
  # (input slot, layer, result index) of each cache the program donates.
  cache_slots: Tuple[Tuple[int, int, int], ...]
  # Index of the logits among the program's results.
  logits_index: int


@dataclasses.dataclass
class BridgeView:
  """What part 3 reads of the patch's internals (see bridge_view)."""
  # (a step's tensors, caches) -> FloorProgram of the step's bucket: the
  # step runs once on the caches through the served model's full path.
  floor_program: Callable[[Dict[str, torch.Tensor], List[torch.Tensor]],
                          FloorProgram]
  # Calls the served model's fast path has served so far.
  fast_calls: Callable[[], int]


def bridge_view(served: Any) -> BridgeView:
  """Every use of the patch's internals by this tool, in one place, so that
  it follows the bridge and the served path when they change.

  A floor program is the bridge's signature-cache entry of the program a
  full call ran: the same entry, so the same graph hash, as the fast path's
  bound program of that bucket.
  """
  # The warm-up has made the first capture once it is done (see [Note: The
  # first capture] in serving.py).
  served.wait_ready()
  backend = served.compiled.backend_callable
  # The served path's calls, before and after their refactor into `calls`.
  served_calls = getattr(served, 'fast_path', None) or served.calls

  def floor_program(arguments: Dict[str, torch.Tensor],
                    caches: List[torch.Tensor]) -> FloorProgram:
    call_args = dict(arguments)
    with backend.observed_calls() as calls:
      served.compiled(call_args.pop('tokens'), caches=caches, **call_args)
    graph_args = calls[0][0]
    signature_cache = backend.signature_cache
    entry = signature_cache.entries[signature_cache.key_of(graph_args)]
    matcher, plan = entry.graph_input_matcher, entry.output_plan
    if not entry.donated_positions or matcher.draws_seed:
      raise RuntimeError('the decode program does not donate its caches, or '
                         'draws a random seed: its floor would not be fair')
    if len(plan.sources) != 1 or plan.sources[0] >= plan.num_results:
      raise RuntimeError('the decode program\'s one output is not a result')
    layer_of = {id(cache): layer for layer, cache in enumerate(caches)}
    cache_slots = []
    for position, result_index in plan.inplace_updates:
      if id(graph_args[position]) not in layer_of:
        raise RuntimeError(f'graph argument {position}, updated in place, is '
                           'not a cache')
      cache_slots.append((matcher.arg_idxs.index(position),
                          layer_of[id(graph_args[position])], result_index))
    # The graph's arguments with the step's tensors and the caches left out
    # (kept, they would be live tensors the served row does not have).
    names = {id(value): name for name, value in arguments.items()}
    step_positions = [(position, names[id(value)])
                      for position, value in enumerate(graph_args)
                      if id(value) in names]
    template = [
        None if id(value) in names or id(value) in layer_of else value
        for value in graph_args
    ]

    def prepare(step: Dict[str, torch.Tensor]) -> List[Any]:
      args = list(template)
      for position, name in step_positions:
        args[position] = step[name]
      return list(matcher(args))

    return FloorProgram(graph_hash=entry.graph_hash,
                        prepare=prepare,
                        cache_slots=tuple(cache_slots),
                        logits_index=plan.sources[0])

  return BridgeView(floor_program=floor_program,
                    fast_calls=lambda: served_calls.fast_calls)


def floor_row(mib: float, other_live: int, warmup: int, steps: int,
              rounds: int) -> Dict[str, Any]:
  """The serve row's decode step against the floor of its own program, in
  this process, in interleaved rounds (see the module docstring), with
  `other_live` more XLA tensors alive on the device."""
  import torch_xla
  import torch_xla.core.xla_model as xm
  if warmup < len(BUCKETS):
    raise ValueError(f'--warmup must be at least {len(BUCKETS)} (one full '
                     'call per bucket makes the floor)')
  device = torch_xla.device()
  torch.manual_seed(0)
  model = PagedDecoder().eval().to(device)
  num_slots = cache_slots(mib)
  cache_shape = (num_slots, 2 * D_MODEL)
  # The timed rounds, then one round of each row back to back.
  plan = make_steps(num_slots, warmup + (rounds + 1) * steps)
  # Tensors a server holds besides this model's (a larger model's
  # parameters, other requests' inputs): a donating run that syncs the
  # device's live tensors pays a cost that grows with their number.
  others = [torch.zeros(1, device=device) for _ in range(other_live)]
  # The served row and the floor each update caches of their own, in
  # lockstep: the same steps in the same order.
  served_caches = [
      torch.zeros(cache_shape, device=device) for _ in range(LAYERS)
  ]
  floor_caches = [
      torch.zeros(cache_shape, device=device) for _ in range(LAYERS)
  ]
  torch_xla.sync()
  served = serve_paged(model, cache_shape)
  bridge = bridge_view(served)
  run_cached_graph = torch_xla._XLAC._run_cached_graph

  def floor_step(program: FloorProgram, xla_inputs: List[Any]):
    for slot, layer, _ in program.cache_slots:
      xla_inputs[slot] = floor_caches[layer]
    results = run_cached_graph(program.graph_hash, xla_inputs)
    # The donated caches are gone; the program's updated ones replace them.
    for _, layer, result_index in program.cache_slots:
      floor_caches[layer] = results[result_index]
    return results[program.logits_index]

  # Each step's inputs are made just before it (outside the timing), as a
  # server makes them, so that only one step's are alive.
  programs: Dict[int, FloorProgram] = {}
  with torch.no_grad():
    for index in range(warmup):
      arguments = step_arguments(plan[index], device)
      served(arguments.pop('tokens'), caches=served_caches, **arguments)
      bucket = index % len(BUCKETS)
      arguments = step_arguments(plan[index], device)
      if bucket not in programs:
        programs[bucket] = bridge.floor_program(arguments, floor_caches)
      else:
        floor_step(programs[bucket], programs[bucket].prepare(arguments))
      torch_xla.sync()
    del arguments
    xm.wait_device_ops()
    fast_before = bridge.fast_calls()
    compiles_before = compiles()
    samples = {'served': [], 'floor': []}
    logits = {'served': [], 'floor': []}
    for round_index in range(rounds):
      first = warmup + round_index * steps
      order = ('served', 'floor') if round_index % 2 == 0 else ('floor',
                                                                'served')
      for row in order:
        walls, hosts = [], []
        for index in range(first, first + steps):
          arguments = step_arguments(plan[index], device)
          if row == 'served':
            # As part 1 calls it.
            out, wall, host = time_call(served,
                                        arguments.pop('tokens'),
                                        caches=served_caches,
                                        **arguments)
          else:
            program = programs[index % len(BUCKETS)]
            out, wall, host = time_call(floor_step, program,
                                        program.prepare(arguments))
          # On the host: kept on the device, they would be live tensors.
          logits[row].append(out.cpu())
          walls.append(wall)
          hosts.append(host)
        samples[row].append(
            (statistics.median(hosts), statistics.median(walls)))
    timed_compiles = compiles() - compiles_before
    fast_calls = bridge.fast_calls() - fast_before
    # Back to back, with no sync or wait between steps: the floor donates
    # results whose run may not have finished.
    burst = range(warmup + rounds * steps, len(plan))
    arguments = [step_arguments(plan[index], device) for index in burst]
    for step in arguments:
      logits['served'].append(
          served(step.pop('tokens'), caches=served_caches, **step))
    arguments = [(programs[index % len(BUCKETS)],
                  programs[index % len(BUCKETS)].prepare(
                      step_arguments(plan[index], device))) for index in burst]
    for program, xla_inputs in arguments:
      logits['floor'].append(floor_step(program, xla_inputs))
    del arguments
    xm.wait_device_ops()
    logits = {row: [out.cpu() for out in outs] for row, outs in logits.items()}
    # Both rows ran the same steps in the same order: the same program gives
    # the same logits and caches, bit for bit.
    assert len(logits['served']) == len(logits['floor']) == len(plan) - warmup
    diff = max((a - b).abs().max().item()
               for a, b in zip(logits['served'], logits['floor']))
    for a, b in zip(served_caches, floor_caches):
      diff = max(diff, (a.cpu() - b.cpu()).abs().max().item())
  del others
  ratios = [s[0] / f[0] for s, f in zip(samples['served'], samples['floor'])]
  return {
      'cache_mib':
          LAYERS * num_slots * ROW_BYTES / MIB,
      'other_live':
          other_live,
      'served_host_us':
          statistics.median(s[0] for s in samples['served']) * 1e6,
      'floor_host_us':
          statistics.median(s[0] for s in samples['floor']) * 1e6,
      'ratio':
          statistics.median(ratios),
      'ratio_min':
          min(ratios),
      'ratio_max':
          max(ratios),
      'served_step_ms':
          statistics.median(s[1] for s in samples['served']) * 1e3,
      'floor_step_ms':
          statistics.median(s[1] for s in samples['floor']) * 1e3,
      'fast_calls':
          fast_calls,
      'served_steps':
          rounds * steps,
      'compiles':
          timed_compiles,
      'max_diff':
          diff,
  }


def floor_table(results: Dict[tuple, Dict[str, Any]]) -> List[str]:
  """Part 3's markdown table."""
  lines = [
      '| cache MiB | other live tensors | served host us | floor host us | '
      'served / floor | per-round ratios | served step ms | floor step ms | '
      'fast calls | compiles | served vs floor |',
      '|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|',
  ]
  for (size, other_live), r in results.items():
    if 'error' in r:
      lines.append(failed_row(lines, (f'{size:g}', other_live), r['error']))
      continue
    check = 'same' if r['max_diff'] == 0 else f'DIFFER ({r["max_diff"]:.1e})'
    lines.append(f'| {r["cache_mib"]:g} | {other_live} | '
                 f'{fmt(r["served_host_us"], 1)} | '
                 f'{fmt(r["floor_host_us"], 1)} | {fmt(r["ratio"])}x | '
                 f'{fmt(r["ratio_min"])}-{fmt(r["ratio_max"])} | '
                 f'{fmt(r["served_step_ms"], 3)} | '
                 f'{fmt(r["floor_step_ms"], 3)} | '
                 f'{r["fast_calls"]}/{r["served_steps"]} | {r["compiles"]} | '
                 f'{check} |')
  return lines


def title(args) -> str:
  """Part 3's title line."""
  return (f'\nServed decode step vs the floor of its program: host CPU us per '
          f'step (time.thread_time around the call), median over '
          f'{args.floor_rounds} interleaved rounds of each round\'s median of '
          f'{args.steps} steps per row, after {args.warmup}; one fresh process '
          'per table row; other live tensors: XLA tensors alive besides the '
          f'model\'s {len(list(PagedDecoder().parameters()))} parameters, its '
          f'{LAYERS} caches per row and one step\'s inputs\n')

"""Decode loops with a KV cache updated in place: step time and peak memory.

  python tools/bench_decode.py [--demo] [--steps 60] [--large-mib 256]
                               [--huge] [--skip-hf] [--floor] [--mesh]
  python tools/bench_decode.py --floor --skip-paged --skip-hf   # part 3 only
  python tools/bench_decode.py --mesh --skip-paged --skip-hf    # part 4 only
  python tools/bench_decode.py --hf-module --skip-paged --skip-hf  # part 5
  python tools/bench_decode.py --hf-generate --skip-paged --skip-hf  # part 6
  python tools/bench_decode.py --hf-export --skip-paged --skip-hf  # part 7

Part 1, a paged decode step as vLLM runs it (PagedDecoder below): the decode
tokens of up to 24 sequences flattened and padded to a bucket of 8, 16 or 32
tokens, one paged KV cache per layer passed as an argument (a list of
[num_slots, 2 * d_model] tensors), written in place each step with
`index_copy_` at `slot_mapping`, and attention of each token over the cache
rows of its sequence's block table (`context_slots`, [tokens, context]),
masked past its length. The model is small (2 layers, d_model 64), so with a
large cache a step costs what writing the cache costs. Each row runs in a
fresh process of this tool (hidden `--row`), once per cache size:
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
Part 2, Hugging Face generate with a StaticCache: a tiny LlamaForCausalLM
built from a LlamaConfig (nothing downloaded) on the XLA device, with
`model.forward = torch.compile(model.forward, backend='openxla')` as the
transformers docs show, and `model.generate(ids,
cache_implementation='static', max_cache_len=L, do_sample=False)` at two
static cache lengths, upstream and patched, each in a fresh process. The
forward is timed the same way per call (prefill left out); tokens are
compared with the same generate run eagerly on the CPU. Two untimed
generate calls come first: the first compiles two XLA programs per decode
step (about 0.1 s each here; its inputs arrive with pending IR, synced
first), the second none. A row that fails prints its error instead of a
number.

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
results, and no step should pay it. Every served and floor logit (timed and back-to-back steps), and
the caches at the end, are compared: the same program gives the same bits.

Part 4 (--mesh), part 1 on a mesh: the same rows and table with each cache
sharded by slot over 4 virtual CPU devices (CPU_NUM_DEVICES=4, SPMD), the
step's inputs and the weights replicated, serve()'s buckets saying the
caches' sharding. Under SPMD every read of a cache is pending IR until a
sync, so a donating step syncs the device's pending IR before it runs.

Part 5 (--hf-module), a module holding a transformers StaticCache in an
attribute (CachedDecoder below), as transformers' static-cache decode loop
in a module: greedy decoding (the prompt in one prefill, then one token a
call), twice, the cache reset between, tokens checked against the same run
eagerly on the CPU, at the two --hf-lengths, one fresh process per row:
  upstream       torch.compile(module, backend='openxla'), no patch
  patched        the same under torch_xla_patches.apply()
  serve          serve(module, a prefill and a one-token bucket,
                 cache_dir=...), a fresh directory
  serve-restart  the same in a fresh process on the directory serve filled
Columns: time to the first token from the start of torch.compile or
serve(), the median one-token step and its host time in the second
generation, peak RSS, dynamo frames compiled, whether serve() loaded its
artifact, its fast calls.

Part 6 (--hf-generate), transformers' generate() with a static cache of
each --hf-lengths, --hf-tokens new tokens, twice on one initialized StaticCache
passed as `cache=` (reset between), one fresh process per row:
  upstream       model.forward = torch.compile(model.forward), no patch
  patched        the same under torch_xla_patches.apply()
  serve          model.forward = serve(model.forward, a prompt and a
                 one-token bucket, cache_dir=...), a fresh directory
  serve-restart  the same in a fresh process on the directory serve filled
Columns as part 5's, with the XLA compiles of the second generation
(generate()'s own small graphs among them) and the donated and copied
inputs.

Part 7 (--hf-export), transformers' own TorchExportableModuleWithStaticCache
(its cache tensors registered as buffers), fed the prompt and then its
greedy tokens one at a time, twice (the cache reset between), in the rows
and columns of part 5 (serve: one one-token bucket).

All rows of one run are measured side by side; compare them as ratios (the
machine may be shared).
"""
import argparse
import copy
import dataclasses
import json
import math
import inspect
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = ('upstream', 'patched', 'serve')
# Virtual CPU devices of the --mesh rows' SPMD mesh.
MESH_DEVICES = 4
BUCKETS = (8, 16, 32)
# Real decode tokens per step, padded to the bucket at the same index.
REAL_TOKENS = (6, 12, 24)
LAYERS = 2
D_MODEL = 64
HEADS = 4
VOCAB = 128
BLOCK_SIZE = 8
CONTEXT = 32  # positions per sequence: CONTEXT // BLOCK_SIZE blocks each
PAD_SLOT = 0  # padding tokens write here; no sequence's block holds it
ROW_BYTES = 2 * D_MODEL * 4  # one cache slot: key and value, float32
MIB = 1 << 20
# Largest difference from the eager CPU reference taken as equal.
TOLERANCE = 1e-4

HF_CONFIG = dict(vocab_size=96,
                 hidden_size=32,
                 intermediate_size=64,
                 num_hidden_layers=2,
                 num_attention_heads=4,
                 num_key_value_heads=2,
                 eos_token_id=None)
HF_PROMPT = 8


class RMSNorm(torch.nn.Module):
  """Root-mean-square norm with a learned scale."""

  def __init__(self, dim: int, eps: float = 1e-6):
    super().__init__()
    self.eps = eps
    self.weight = torch.nn.Parameter(torch.ones(dim))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                           self.eps) * self.weight


class PagedLayer(torch.nn.Module):
  """One decoder layer whose keys and values live in a paged cache.

  Args:
    dim: model width.
    heads: attention heads (dim // heads per head).
  """

  def __init__(self, dim: int, heads: int):
    super().__init__()
    self.heads = heads
    self.attn_norm = RMSNorm(dim)
    self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
    self.out = torch.nn.Linear(dim, dim, bias=False)
    self.mlp_norm = RMSNorm(dim)
    self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
    self.down = torch.nn.Linear(4 * dim, dim, bias=False)

  def forward(self, x: torch.Tensor, slot_mapping: torch.Tensor,
              context_slots: torch.Tensor, mask: torch.Tensor,
              cache: torch.Tensor) -> torch.Tensor:
    dim = x.shape[-1]
    q, k, v = self.qkv(self.attn_norm(x)).split(dim, dim=-1)
    # The new key and value of every token go to its slot, in place.
    cache.index_copy_(0, slot_mapping, torch.cat([k, v], dim=-1))
    rows = cache[context_slots]  # [tokens, context, 2 * dim]
    keys = rows[..., :dim].unflatten(-1, (self.heads, -1))
    values = rows[..., dim:].unflatten(-1, (self.heads, -1))
    q = q.unflatten(-1, (self.heads, -1))
    scores = torch.einsum('thd,tchd->thc', q, keys) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask.unsqueeze(1), float('-inf'))
    attended = torch.einsum('thc,tchd->thd', scores.softmax(-1), values)
    x = x + self.out(attended.flatten(1))
    return x + self.down(torch.nn.functional.silu(self.up(self.mlp_norm(x))))


class PagedDecoder(torch.nn.Module):
  """A decoder LM run one decode step at a time over a paged KV cache.

  forward(tokens, positions, slot_mapping, context_slots, context_lens,
  caches) -> logits [tokens, vocab]; caches (one [num_slots, 2 * dim]
  tensor per layer) are updated in place.
  """

  def __init__(self,
               vocab: int = VOCAB,
               dim: int = D_MODEL,
               heads: int = HEADS,
               layers: int = LAYERS,
               context: int = CONTEXT):
    super().__init__()
    self.embed = torch.nn.Embedding(vocab, dim)
    self.position = torch.nn.Embedding(context, dim)
    self.layers = torch.nn.ModuleList(
        PagedLayer(dim, heads) for _ in range(layers))
    self.norm = RMSNorm(dim)
    self.head = torch.nn.Linear(dim, vocab, bias=False)

  def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
              slot_mapping: torch.Tensor, context_slots: torch.Tensor,
              context_lens: torch.Tensor,
              caches: List[torch.Tensor]) -> torch.Tensor:
    x = self.embed(tokens) + self.position(positions)
    columns = torch.arange(context_slots.shape[1], device=tokens.device)
    mask = columns.unsqueeze(0) < context_lens.unsqueeze(1)
    for layer, cache in zip(self.layers, caches):
      x = layer(x, slot_mapping, context_slots, mask, cache)
    return self.head(self.norm(x))


def cache_slots(mib: float) -> int:
  """Slots per layer of a cache of `mib` MiB in all (every layer)."""
  return int(mib * MIB) // (LAYERS * ROW_BYTES)


def make_steps(num_slots: int, count: int) -> List[Dict[str, Any]]:
  """`count` decode steps' inputs (CPU), the buckets in rotation.

  Each of max(REAL_TOKENS) sequences owns CONTEXT // BLOCK_SIZE blocks spread
  at random over the cache; a step decodes one token of each of the first
  REAL_TOKENS[i] sequences, and a sequence that fills its context starts
  again (a new request in the same blocks). Padding tokens write PAD_SLOT and
  attend to it alone. Each step also carries `real`, its real token count.
  """
  sequences = max(REAL_TOKENS)
  blocks_per_sequence = CONTEXT // BLOCK_SIZE
  num_blocks = num_slots // BLOCK_SIZE
  needed = sequences * blocks_per_sequence
  if num_blocks - 1 < needed:
    raise SystemExit(f'a cache of {num_slots} slots per layer holds '
                     f'{num_blocks} blocks; the sequences need {needed} + 1')
  generator = torch.Generator().manual_seed(0)
  blocks = torch.randperm(num_blocks - 1, generator=generator)[:needed] + 1
  offsets = torch.arange(BLOCK_SIZE)
  slot_table = (blocks.view(sequences, blocks_per_sequence, 1) * BLOCK_SIZE +
                offsets).view(sequences, CONTEXT)
  lengths = [0] * sequences
  steps = []
  for index in range(count):
    bucket, real = BUCKETS[index % 3], REAL_TOKENS[index % 3]
    tokens = torch.zeros(bucket, dtype=torch.long)
    tokens[:real] = torch.randint(0, VOCAB, (real,), generator=generator)
    positions = torch.zeros(bucket, dtype=torch.long)
    slot_mapping = torch.full((bucket,), PAD_SLOT, dtype=torch.long)
    context_slots = torch.full((bucket, CONTEXT), PAD_SLOT, dtype=torch.long)
    context_lens = torch.ones(bucket, dtype=torch.long)
    for sequence in range(real):
      position = lengths[sequence] % CONTEXT
      lengths[sequence] = position + 1
      positions[sequence] = position
      slot_mapping[sequence] = slot_table[sequence, position]
      context_slots[sequence] = slot_table[sequence]
      context_lens[sequence] = position + 1
    steps.append(
        dict(tokens=tokens,
             positions=positions,
             slot_mapping=slot_mapping,
             context_slots=context_slots,
             context_lens=context_lens,
             real=real))
  return steps


def step_arguments(step: Dict[str, Any], device: Any) -> Dict[str, Any]:
  """A step's tensors on `device`, keyed as the model's forward names
  them."""
  return {
      name: value.to(device)
      for name, value in step.items()
      if isinstance(value, torch.Tensor)
  }


def peak_rss_mib() -> float:
  """This process's peak resident set so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def counter(name: str) -> int:
  """An XLA counter's value (0 where it never counted)."""
  import torch_xla.debug.metrics as met
  return met.counter_value(name) or 0


def compiles() -> int:
  """XLA compiles in this process so far."""
  import torch_xla.debug.metrics as met
  data = met.metric_data('CompileTime')
  return data[0] if data else 0


def time_call(fn, *args, **kwargs):
  """fn(*args, **kwargs) as (result, wall s to the device's end, thread CPU s
  of the call alone)."""
  import torch_xla
  import torch_xla.core.xla_model as xm
  start, start_cpu = time.perf_counter(), time.thread_time()
  result = fn(*args, **kwargs)
  host = time.thread_time() - start_cpu
  torch_xla.sync()
  xm.wait_device_ops()
  return result, time.perf_counter() - start, host


def serve_paged(model: torch.nn.Module,
                cache_shape: Sequence[int],
                cache_sharding: Any = None) -> Any:
  """torch_xla_patches.serve(model) with one CallSpec per bucket; the caches
  sharded as `cache_sharding` says ((mesh, partition spec) or None)."""
  import torch_xla_patches
  from torch_xla_patches import CallSpec, TensorSpec
  buckets = []
  for bucket in BUCKETS:
    index = TensorSpec((bucket,), torch.long)
    buckets.append(
        CallSpec(index,
                 positions=index,
                 slot_mapping=index,
                 context_slots=TensorSpec((bucket, CONTEXT), torch.long),
                 context_lens=index,
                 caches=[TensorSpec(cache_shape, sharding=cache_sharding)] *
                 LAYERS))
  return torch_xla_patches.serve(model, buckets)


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


def hf_row(mode: str, cache_len: int, new_tokens: int,
           runs: int) -> Dict[str, Any]:
  """One StaticCache generate row, run in this process (see the module
  docstring)."""
  import torch_xla
  import transformers
  if mode == 'patched':
    import torch_xla_patches
    torch_xla_patches.apply()
  device = torch_xla.device()
  positions = max(cache_len, 2048)
  config = transformers.LlamaConfig(**HF_CONFIG,
                                    max_position_embeddings=positions)
  torch.manual_seed(0)
  cpu_model = transformers.LlamaForCausalLM(config).eval()
  ids = torch.randint(0,
                      config.vocab_size, (1, HF_PROMPT),
                      generator=torch.Generator().manual_seed(1))
  generate_args = dict(max_new_tokens=new_tokens,
                       cache_implementation='static',
                       max_cache_len=cache_len,
                       do_sample=False)
  expected = cpu_model.generate(ids, **generate_args)
  model = copy.deepcopy(cpu_model).to(device)
  compiled = torch.compile(model.forward, backend='openxla')
  walls, hosts = [], []

  def forward(*args, **kwargs):
    logits, wall, host = time_call(compiled, *args, **kwargs)
    walls.append(wall)
    hosts.append(host)
    return logits

  model.forward = forward
  step_walls, step_hosts = [], []
  timed_compiles = 0
  matches = True
  # Two generate calls warm up: the first compiles every step's program.
  for index in range(2 + runs):
    walls.clear()
    hosts.clear()
    before = compiles()
    got = model.generate(ids.to(device), **generate_args).cpu()
    matches = matches and torch.equal(got, expected)
    if index >= 2:
      timed_compiles += compiles() - before
      step_walls += walls[1:]  # walls[0] is the prefill
      step_hosts += hosts[1:]
  return {
      'step_ms': statistics.median(step_walls) * 1e3,
      'host_us': statistics.median(step_hosts) * 1e6,
      'peak_rss_mib': peak_rss_mib(),
      'compiles': timed_compiles,
      'steps': len(step_walls),
      'donated': counter('DynamoDonatedInput'),
      'tokens_match': matches,
  }


class CachedDecoder(torch.nn.Module):
  """Part 5's module: a LlamaForCausalLM and a transformers StaticCache held
  in an attribute; each call runs its tokens at `cache_position` against the
  cache, which it updates in place (transformers' static-cache decode loop,
  in a module so that serve() can take it)."""

  def __init__(self,
               model: torch.nn.Module,
               cache_len: int,
               device: Any,
               batch: int = 1):
    super().__init__()
    import transformers
    self.model = model
    self.cache = transformers.StaticCache(config=model.config,
                                          max_cache_len=cache_len)
    # Allocates the cache's tensors on the device (`batch` rows), as a first
    # prefill would.
    with torch.no_grad():
      model(input_ids=torch.zeros((batch, 1), dtype=torch.long, device=device),
            past_key_values=self.cache,
            cache_position=torch.tensor([0], device=device),
            use_cache=True)
    self.cache.reset()

  def forward(self, input_ids, cache_position):
    return self.model(input_ids=input_ids,
                      past_key_values=self.cache,
                      cache_position=cache_position,
                      use_cache=True).logits


# Where the serve row leaves its artifact for the serve-restart row.
_HF_MODULE_CACHE_ENV = 'XLA_PATCHES_BENCH_HF_MODULE_CACHE'


def hf_module_row(mode: str, cache_len: int, new_tokens: int) -> Dict[str, Any]:
  """One row of part 5, run in this process: greedy decoding of the
  CachedDecoder, the prompt in one prefill then one token a call."""
  import torch_xla
  import transformers
  from torch._dynamo.utils import counters as dynamo_counters
  device = torch_xla.device()
  config = transformers.LlamaConfig(**HF_CONFIG,
                                    max_position_embeddings=max(
                                        cache_len, 2048))
  torch.manual_seed(0)
  cpu_model = transformers.LlamaForCausalLM(config).eval()
  prompt = torch.randint(0,
                         config.vocab_size, (1, HF_PROMPT),
                         generator=torch.Generator().manual_seed(1))

  def greedy(forward, on, timed=None):
    with torch.no_grad():
      logits = forward(prompt.to(on), torch.arange(HF_PROMPT, device=on))
      tokens = [int(logits[0, -1].argmax())]
      if timed is not None:
        timed.append(time.perf_counter())
      for step in range(new_tokens - 1):
        args = (torch.tensor([[tokens[-1]]], device=on),
                torch.tensor([HF_PROMPT + step], device=on))
        if timed is None:
          logits = forward(*args)
        else:
          logits, wall, host = time_call(forward, *args)
          timed_steps.append((wall, host))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens

  timed_steps: List[Tuple[float, float]] = []
  expected = greedy(CachedDecoder(cpu_model, cache_len, 'cpu'), 'cpu')
  model = copy.deepcopy(cpu_model).to(device)
  decoder = CachedDecoder(model, cache_len, device)
  frames_before = dynamo_counters['stats']['unique_graphs']
  start = time.perf_counter()

  def buckets():
    from torch_xla_patches import CallSpec, TensorSpec
    return [
        CallSpec(TensorSpec((1, HF_PROMPT), torch.long),
                 TensorSpec((HF_PROMPT,), torch.long)),
        CallSpec(TensorSpec((1, 1), torch.long), TensorSpec((1,), torch.long))
    ]

  forward = compiled_or_served(mode, decoder, buckets)
  first_token = []
  got = greedy(forward, device, first_token)
  # A second generation on the same cache, after a reset, timed.
  decoder.cache.reset()
  timed_steps.clear()
  again = greedy(forward, device, [])
  return module_row(forward, first_token[0] - start, timed_steps,
                    dynamo_counters['stats']['unique_graphs'] - frames_before,
                    got == expected and again == expected)


def compiled_or_served(mode: str, target: Any,
                       buckets: Callable[[], List[Any]]) -> Any:
  """`target` under upstream torch.compile, under the patch's, or served
  with `buckets()` in the row's cache directory (parts 5 to 7)."""
  if mode == 'upstream':
    return torch.compile(target, backend='openxla')
  import torch_xla_patches
  if mode == 'patched':
    torch_xla_patches.apply()
    return torch.compile(target, backend='openxla')
  return torch_xla_patches.serve(target,
                                 buckets(),
                                 cache_dir=os.environ[_HF_MODULE_CACHE_ENV])


def module_row(forward: Any, first_token_s: float,
               steps: Sequence[Tuple[float, float]], dynamo_frames: int,
               tokens_match: bool) -> Dict[str, Any]:
  """A row of part 5 or 7: `steps` are the timed steps' (wall, host)."""
  return {
      'first_token_s': first_token_s,
      'step_ms': statistics.median(w for w, _ in steps) * 1e3,
      'host_us': statistics.median(h for _, h in steps) * 1e6,
      'peak_rss_mib': peak_rss_mib(),
      'loaded': bool(getattr(forward, 'loaded', False)),
      'dynamo_frames': dynamo_frames,
      # Of every capture (a one-token bucket has one of its own).
      'fast_calls': (forward.fast_calls
                     if getattr(forward, 'calls', None) is not None else None),
      'tokens_match': tokens_match,
  }


def hf_module_table(results: Dict[tuple, Dict[str, Any]],
                    lengths: Sequence[int]) -> List[str]:
  """Part 5's markdown table."""
  lines = [
      '| row | static cache length | first token s | step ms | host us | '
      'peak RSS MiB | dynamo frames | artifact loaded | fast calls | '
      'vs eager tokens (two generations) |',
      '|---|---:|---:|---:|---:|---:|---:|---|---:|---|',
  ]

  def cells(r: Dict[str, Any]) -> str:
    fast = '-' if r['fast_calls'] is None else r['fast_calls']
    return f'{r["dynamo_frames"]} | {r["loaded"]} | {fast}'

  return lines + _serve_rows(lines, results, lengths, cells)


def _serve_rows(table: Sequence[str], results: Dict[tuple, Dict[str, Any]],
                lengths: Sequence[int], cells: Callable[[Dict[str, Any]],
                                                        str]) -> List[str]:
  """The rows of parts 5 to 7 under `table`'s header: each mode and length,
  its first token, step and host time, peak RSS, `cells(row)` and whether
  its tokens match eager's."""
  rows = []
  for mode in HF_MODULE_MODES:
    for length in lengths:
      r = results[(mode, length)]
      if 'error' in r:
        rows.append(_failed_row(table, (mode, length), r['error']))
        continue
      check = 'ok' if r['tokens_match'] else 'MISMATCH'
      rows.append(f'| {mode} | {length} | {_fmt(r["first_token_s"])} | '
                  f'{_fmt(r["step_ms"])} | {_fmt(r["host_us"], 1)} | '
                  f'{r["peak_rss_mib"]:.0f} | {cells(r)} | {check} |')
  return rows


HF_MODULE_MODES = ('upstream', 'patched', 'serve', 'serve-restart')


def hf_export_row(mode: str, cache_len: int, new_tokens: int) -> Dict[str, Any]:
  """One row of part 7, run in this process: transformers'
  TorchExportableModuleWithStaticCache fed the prompt and then its greedy
  tokens one at a time, twice (the cache reset between)."""
  import torch_xla
  import transformers
  from torch._dynamo.utils import counters as dynamo_counters
  from transformers.integrations import executorch
  device = torch_xla.device()
  config = transformers.LlamaConfig(**HF_CONFIG,
                                    max_position_embeddings=max(
                                        cache_len, 2048))
  torch.manual_seed(0)
  cpu_model = transformers.LlamaForCausalLM(config).eval()
  cpu_model.generation_config.cache_implementation = 'static'
  cpu_model.generation_config.use_cache = True
  prompt = torch.randint(0,
                         config.vocab_size, (HF_PROMPT,),
                         generator=torch.Generator().manual_seed(1)).tolist()

  def export_module(model, on):
    return executorch.TorchExportableModuleWithStaticCache(
        model, batch_size=1, max_cache_len=cache_len, device=on)

  def greedy(forward, on, timed=None):
    tokens = []
    with torch.no_grad():
      for position in range(HF_PROMPT + new_tokens - 1):
        token = prompt[position] if position < HF_PROMPT else tokens[-1]
        args = dict(input_ids=torch.tensor([[token]], device=on),
                    cache_position=torch.tensor([position], device=on))
        if timed is None:
          logits = forward(**args)
        else:
          logits, wall, host = time_call(forward, **args)
          timed.append((wall, host))
        tokens.append(int(logits[:, -1].argmax(-1)))
    return tokens

  expected = greedy(export_module(cpu_model, 'cpu'), 'cpu')
  model = copy.deepcopy(cpu_model).to(device)
  module = export_module(model, device)
  frames_before = dynamo_counters['stats']['unique_graphs']
  start = time.perf_counter()

  def buckets():
    from torch_xla_patches import CallSpec, TensorSpec
    return [
        CallSpec(input_ids=TensorSpec((1, 1), torch.long),
                 cache_position=TensorSpec((1,), torch.long))
    ]

  forward = compiled_or_served(mode, module, buckets)
  with torch.no_grad():
    forward(input_ids=torch.tensor([[prompt[0]]], device=device),
            cache_position=torch.tensor([0], device=device)).cpu()
  first_token_s = time.perf_counter() - start
  module.static_cache.reset()
  got = greedy(forward, device)
  module.static_cache.reset()
  timed: List[Tuple[float, float]] = []
  again = greedy(forward, device, timed)
  # The generated tokens' steps.
  return module_row(forward, first_token_s, timed[HF_PROMPT:],
                    dynamo_counters['stats']['unique_graphs'] - frames_before,
                    got == expected and again == expected)


def generate_cache(config: Any, cache_len: int, on: Any) -> Any:
  """Part 6's StaticCache: one row, `cache_len` tokens, initialized (as a
  server keeps one per batch size)."""
  import transformers
  cache = transformers.StaticCache(config=config, max_cache_len=cache_len)
  cache.early_initialization(1, config.num_key_value_heads,
                             config.hidden_size // config.num_attention_heads,
                             torch.float32, on)
  return cache


def generate_buckets(example: Any, cache_len: int) -> List[Any]:
  """generate()'s two calls of a Llama forward for one row: the prompt,
  then one token against the cache's mask (see docs/serving.md)."""
  from torch_xla_patches import CallSpec, TensorSpec
  common = dict(cache=example,
                logits_to_keep=1,
                use_cache=True,
                return_dict=True)
  return [
      CallSpec(input_ids=TensorSpec((1, HF_PROMPT), torch.long),
               position_ids=TensorSpec((1, HF_PROMPT), torch.long),
               **common),
      CallSpec(input_ids=TensorSpec((1, 1), torch.long),
               position_ids=TensorSpec((1, 1), torch.long),
               attention_mask=TensorSpec((1, 1, 1, cache_len), torch.bool),
               **common),
  ]


def hf_generate_row(mode: str, cache_len: int,
                    new_tokens: int) -> Dict[str, Any]:
  """One row of part 6, run in this process: generate() with a static cache
  of `cache_len` on a compiled or served forward, twice."""
  import torch_xla
  import transformers
  from torch._dynamo.utils import counters as dynamo_counters
  device = torch_xla.device()
  config = transformers.LlamaConfig(**HF_CONFIG,
                                    max_position_embeddings=max(
                                        cache_len, 2048))
  torch.manual_seed(0)
  cpu_model = transformers.LlamaForCausalLM(config).eval()
  ids = torch.randint(0,
                      config.vocab_size, (1, HF_PROMPT),
                      generator=torch.Generator().manual_seed(1))

  def generate(model, on, cache):
    cache.reset()
    with torch.no_grad():
      return model.generate(ids.to(on),
                            attention_mask=torch.ones_like(ids).to(on),
                            max_new_tokens=new_tokens,
                            do_sample=False,
                            cache=cache).cpu()

  expected = generate(cpu_model, 'cpu', generate_cache(config, cache_len,
                                                       'cpu'))
  model = copy.deepcopy(cpu_model).to(device)
  frames_before = dynamo_counters['stats']['unique_graphs']
  start = time.perf_counter()

  def buckets():
    # The buckets' example cache, materialized as a server's would be: left
    # pending, its zeros would join the first sync after the first
    # generation's prompt (time_call's), whose program the second
    # generation's sync then would not share, an XLA compile the bridge
    # did not make.
    example = generate_cache(config, cache_len, device)
    torch_xla.sync()
    return generate_buckets(example, cache_len)

  target = compiled_or_served(mode, model.forward, buckets)
  calls: List[Tuple[float, float]] = []
  first_token: List[float] = []

  def forward(*args, **kwargs):
    result, wall, host = time_call(target, *args, **kwargs)
    if not first_token:
      first_token.append(time.perf_counter())
    calls.append((wall, host))
    return result

  # generate() passes what the forward's parameters name.
  forward.__signature__ = inspect.signature(target)
  model.forward = forward
  cache = generate_cache(config, cache_len, device)
  got = generate(model, device, cache)
  calls.clear()
  before = compiles()
  again = generate(model, device, cache)
  steps = calls[1:]  # calls[0] is the prompt
  return {
      'first_token_s':
          first_token[0] - start,
      'step_ms':
          statistics.median(w for w, _ in steps) * 1e3,
      'host_us':
          statistics.median(h for _, h in steps) * 1e6,
      'peak_rss_mib':
          peak_rss_mib(),
      'compiles':
          compiles() - before,
      'loaded':
          bool(getattr(target, 'loaded', False)),
      'dynamo_frames':
          dynamo_counters['stats']['unique_graphs'] - frames_before,
      'donated':
          counter('DynamoDonatedInput'),
      'copied':
          counter('DynamoDonationCopiedRead'),
      'tokens_match':
          torch.equal(got, expected) and torch.equal(again, expected),
  }


def hf_generate_table(results: Dict[tuple, Dict[str, Any]],
                      lengths: Sequence[int]) -> List[str]:
  """Part 6's markdown table."""
  lines = [
      '| row | static cache length | first token s | step ms | host us | '
      'peak RSS MiB | compiles (second generation) | dynamo frames | '
      'artifact loaded | donated / copied | vs eager tokens (two '
      'generations) |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|',
  ]

  def cells(r: Dict[str, Any]) -> str:
    return (f'{r["compiles"]} | {r["dynamo_frames"]} | {r["loaded"]} | '
            f'{r["donated"]} / {r["copied"]}')

  return lines + _serve_rows(lines, results, lengths, cells)


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
      os.environ[_HF_MODULE_CACHE_ENV] = cache_dir
      for mode in HF_MODULE_MODES:
        results[(mode, length)] = run_row(kind, mode, length, args)
  return results


def row_main(kind: str, mode: str, size: float, args) -> int:
  """The hidden `--row` entry: one row, printed as one JSON line; an error
  is a row too."""
  try:
    if kind in ('paged', 'paged-mesh'):
      result = paged_row(mode,
                         size,
                         args.warmup,
                         args.steps,
                         on_mesh=kind == 'paged-mesh')
    elif kind == 'hf-module':
      result = hf_module_row(mode, int(size), args.hf_tokens)
    elif kind == 'hf-generate':
      result = hf_generate_row(mode, int(size), args.hf_tokens)
    elif kind == 'hf-export':
      result = hf_export_row(mode, int(size), args.hf_tokens)
    elif kind == 'floor':
      # A floor row's mode is its count of other live tensors.
      result = floor_row(size, int(mode), args.warmup, args.steps,
                         args.floor_rounds)
    else:
      result = hf_row(mode, int(size), args.hf_tokens, args.hf_runs)
  except Exception as e:  # pylint: disable=broad-except
    # The whole story on stderr, for a rerun of the row; its first line in
    # the table.
    traceback.print_exc()
    first = (str(e).strip().splitlines() or [''])[0]
    result = {'error': f'{type(e).__name__}: {first}'[:300].replace('|', '/')}
  print(json.dumps(result), flush=True)
  return 0


def _failed_row(table: Sequence[str], cells: Sequence[Any], error: str) -> str:
  """A row of `table` (its header and separator lines) for a failed run:
  its first `cells`, the error, and the rest of the columns empty."""
  columns = table[1].count('|') - 1
  return ('| ' + ' | '.join(str(c) for c in cells) + f' | failed: {error} ' +
          '| ' * (columns - len(cells) - 1) + '|')


def _fmt(value: Optional[float], digits: int = 2) -> str:
  """A number for the tables; '-' for None."""
  return '-' if value is None else f'{value:.{digits}f}'


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
        lines.append(_failed_row(lines, (mode, f'{size:g}'), r['error']))
        continue
      ratio, growth = '-', '-'
      if size != sizes[0] and 'error' not in small:
        ratio = _fmt(r['step_ms'] / small['step_ms']) + 'x'
        growth = _fmt((r['peak_rss_mib'] - small['peak_rss_mib']) /
                      (r['cache_mib'] - small['cache_mib']))
      check = 'ok' if r['max_diff'] <= TOLERANCE else 'MISMATCH'
      lines.append(
          f'| {mode} | {r["cache_mib"]:g} | {_fmt(r["step_ms"])} | '
          f'{_fmt(r["host_us"], 1)} | {ratio} | {r["base_rss_mib"]:.0f} | '
          f'{r["setup_rss_mib"]:.0f} | {r["peak_rss_mib"]:.0f} | '
          f'{r["peak_rss_mib"] - r["base_rss_mib"]:.0f} | {growth} | '
          f'{r["compiles"]} | {r["donated"]} | '
          f'{check} ({r["max_diff"]:.1e}) |')
  return lines


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
      lines.append(_failed_row(lines, (f'{size:g}', other_live), r['error']))
      continue
    check = 'same' if r['max_diff'] == 0 else f'DIFFER ({r["max_diff"]:.1e})'
    lines.append(f'| {r["cache_mib"]:g} | {other_live} | '
                 f'{_fmt(r["served_host_us"], 1)} | '
                 f'{_fmt(r["floor_host_us"], 1)} | {_fmt(r["ratio"])}x | '
                 f'{_fmt(r["ratio_min"])}-{_fmt(r["ratio_max"])} | '
                 f'{_fmt(r["served_step_ms"], 3)} | '
                 f'{_fmt(r["floor_step_ms"], 3)} | '
                 f'{r["fast_calls"]}/{r["served_steps"]} | {r["compiles"]} | '
                 f'{check} |')
  return lines


def hf_table(results: Dict[tuple, Dict[str, Any]],
             lengths: Sequence[int]) -> List[str]:
  """Part 2's markdown table."""
  lines = [
      '| row | static cache length | step ms | host us | long/short step | '
      'peak RSS MiB | compiles | donated | decode steps timed | '
      'vs eager tokens |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---:|---|',
  ]
  for mode in ('upstream', 'patched'):
    short = results[(mode, lengths[0])]
    for length in lengths:
      r = results[(mode, length)]
      if 'error' in r:
        lines.append(_failed_row(lines, (mode, length), r['error']))
        continue
      ratio = '-'
      if length != lengths[0] and 'error' not in short:
        ratio = _fmt(r['step_ms'] / short['step_ms']) + 'x'
      check = 'ok' if r['tokens_match'] else 'MISMATCH'
      lines.append(f'| {mode} | {length} | {_fmt(r["step_ms"])} | '
                   f'{_fmt(r["host_us"], 1)} | {ratio} | '
                   f'{r["peak_rss_mib"]:.0f} | {r["compiles"]} | '
                   f'{r["donated"]} | {r["steps"]} | {check} |')
  return lines


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
    buckets = '/'.join(map(str, BUCKETS))
    real = '/'.join(map(str, REAL_TOKENS))
    output += [
        f'\nPaged decode: {LAYERS} layers, d_model {D_MODEL}, buckets '
        f'{buckets} tokens ({real} real), context {CONTEXT}, weights '
        f'{sum(p.numel() for p in PagedDecoder().parameters()) * 4 / MIB:.2f} '
        f'MiB; median of {args.steps} steps after '
        f'{args.warmup}; one fresh process per row\n'
    ] + paged_table(results, sizes)
  if not args.skip_hf:
    lengths = list(args.hf_lengths)
    results = {
        (mode, length): run_row('hf', mode, length, args)
        for mode in ('upstream', 'patched') for length in lengths
    }
    output += [
        f'\nHugging Face StaticCache generate: LlamaForCausalLM '
        f'{HF_CONFIG["num_hidden_layers"]} layers, hidden '
        f'{HF_CONFIG["hidden_size"]}, vocab {HF_CONFIG["vocab_size"]}, prompt '
        f'{HF_PROMPT}, {args.hf_tokens} new tokens; median decode step of '
        f'{args.hf_runs} generate call(s) after 2; one fresh process per row\n'
    ] + hf_table(results, lengths)
  if args.mesh:
    sizes = [args.small_mib, args.large_mib]
    results = {
        (mode, size): run_row('paged-mesh', mode, size, args) for mode in MODES
        for size in sizes
    }
    output += [
        f'\nPaged decode on a mesh: part 1\'s rows with each cache sharded by '
        f'slot over {MESH_DEVICES} virtual CPU devices (SPMD), the step\'s '
        'inputs and the weights replicated; one fresh process per row\n'
    ] + paged_table(results, sizes)
  if args.hf_module:
    lengths = list(args.hf_lengths)
    results = hf_serve_rows('hf-module', args)
    output += [
        f'\nA module holding a StaticCache (part 5): LlamaForCausalLM '
        f'{HF_CONFIG["num_hidden_layers"]} layers, hidden '
        f'{HF_CONFIG["hidden_size"]}, prompt {HF_PROMPT} in one prefill, '
        f'{args.hf_tokens} tokens greedy, twice (the cache reset between); '
        'first token from the start of torch.compile or serve(); step: median '
        'of the second generation\'s one-token calls; one fresh process per '
        'row (serve-restart on the directory serve filled)\n'
    ] + hf_module_table(results, lengths)
  if args.hf_generate:
    lengths = list(args.hf_lengths)
    results = hf_serve_rows('hf-generate', args)
    output += [
        f'\ngenerate() with a static cache on a compiled or served forward '
        f'(part 6): LlamaForCausalLM {HF_CONFIG["num_hidden_layers"]} layers, '
        f'hidden {HF_CONFIG["hidden_size"]}, prompt {HF_PROMPT}, '
        f'{args.hf_tokens} new tokens, twice on one initialized cache (reset '
        'between); first token from the start of torch.compile or serve(); '
        'step: median of the second generation\'s one-token calls; one fresh '
        'process per row (serve-restart on the directory serve filled)\n'
    ] + hf_generate_table(results, lengths)
  if args.hf_export:
    lengths = list(args.hf_lengths)
    results = hf_serve_rows('hf-export', args)
    output += [
        f'\ntransformers\' TorchExportableModuleWithStaticCache (part 7): '
        f'LlamaForCausalLM {HF_CONFIG["num_hidden_layers"]} layers, hidden '
        f'{HF_CONFIG["hidden_size"]}, prompt {HF_PROMPT} fed one token at a '
        f'time, then {args.hf_tokens} greedy tokens, twice (the cache reset '
        'between); first token: from the start of torch.compile or serve() '
        'to the first call\'s end; step: median of the second pass\'s '
        'generated tokens; fast calls of both passes; one fresh process per '
        'row (serve-restart on the directory serve filled)\n'
    ] + hf_module_table(results, lengths)
  if args.floor:
    sizes = [args.small_mib, args.large_mib]
    results = {
        (size, live): run_row('floor', str(live), size, args)
        for live in args.floor_live for size in sizes
    }
    output += [
        f'\nServed decode step vs the floor of its program: host CPU us per '
        f'step (time.thread_time around the call), median over '
        f'{args.floor_rounds} interleaved rounds of each round\'s median of '
        f'{args.steps} steps per row, after {args.warmup}; one fresh process '
        'per table row; other live tensors: XLA tensors alive besides the '
        f'model\'s {len(list(PagedDecoder().parameters()))} parameters, its '
        f'{LAYERS} caches per row and one step\'s inputs\n'
    ] + floor_table(results)
  print('\n'.join(output))
  print(f'\n{time.perf_counter() - started:.0f} s in all')
  return 0


if __name__ == '__main__':
  sys.exit(main())

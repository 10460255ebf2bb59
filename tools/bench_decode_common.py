"""What the parts of tools/bench_decode.py share: the paged decoder of parts
1, 3 and 4 and its steps, the tiny Llama of parts 2 and 5 to 7, the
measurements every row takes, and the rows and tables of parts 5 to 7.
"""
import math
import os
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import tiny_llama

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

HF_CONFIG = tiny_llama.CONFIG
HF_PROMPT = 8
# The tiny Llama, as the tables' titles name it.
HF_MODEL_WORDS = (f'LlamaForCausalLM {HF_CONFIG["num_hidden_layers"]} layers, '
                  f'hidden {HF_CONFIG["hidden_size"]}')


def hf_model(cache_len: int) -> Tuple[Any, torch.nn.Module]:
  """(config, CPU model) of parts 2 and 5 to 7: the tiny Llama of HF_CONFIG
  with room for `cache_len` positions, its weights from seed 0."""
  model = tiny_llama.build(**HF_CONFIG,
                           max_position_embeddings=max(cache_len, 2048))
  return model.config, model


def hf_prompt() -> torch.Tensor:
  """The (1, HF_PROMPT) prompt ids of parts 2 and 5 to 7, seeded."""
  return torch.randint(0,
                       HF_CONFIG['vocab_size'], (1, HF_PROMPT),
                       generator=torch.Generator().manual_seed(1))


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


# Where the serve row leaves its artifact for the serve-restart row.
HF_MODULE_CACHE_ENV = 'XLA_PATCHES_BENCH_HF_MODULE_CACHE'

HF_MODULE_MODES = ('upstream', 'patched', 'serve', 'serve-restart')


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
                                 cache_dir=os.environ[HF_MODULE_CACHE_ENV])


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
  """The markdown table of parts 5 and 7."""
  lines = [
      '| row | static cache length | first token s | step ms | host us | '
      'peak RSS MiB | dynamo frames | artifact loaded | fast calls | '
      'vs eager tokens (two generations) |',
      '|---|---:|---:|---:|---:|---:|---:|---|---:|---|',
  ]

  def cells(r: Dict[str, Any]) -> str:
    fast = '-' if r['fast_calls'] is None else r['fast_calls']
    return f'{r["dynamo_frames"]} | {r["loaded"]} | {fast}'

  return lines + serve_rows(lines, results, lengths, cells)


def serve_rows(table: Sequence[str], results: Dict[tuple, Dict[str, Any]],
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
        rows.append(failed_row(table, (mode, length), r['error']))
        continue
      check = 'ok' if r['tokens_match'] else 'MISMATCH'
      rows.append(f'| {mode} | {length} | {fmt(r["first_token_s"])} | '
                  f'{fmt(r["step_ms"])} | {fmt(r["host_us"], 1)} | '
                  f'{r["peak_rss_mib"]:.0f} | {cells(r)} | {check} |')
  return rows


def failed_row(table: Sequence[str], cells: Sequence[Any], error: str) -> str:
  """A row of `table` (its header and separator lines) for a failed run:
  its first `cells`, the error, and the rest of the columns empty."""
  columns = table[1].count('|') - 1
  return ('| ' + ' | '.join(str(c) for c in cells) + f' | failed: {error} ' +
          '| ' * (columns - len(cells) - 1) + '|')


def fmt(value: Optional[float], digits: int = 2) -> str:
  """A number for the tables; '-' for None."""
  return '-' if value is None else f'{value:.{digits}f}'

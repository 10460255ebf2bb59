"""The slot KV cache and the served module of the generation engine: one
cache for every slot, written row by row, prompts left-padded to buckets and
the masks built inside the programs (generation.py's GenerationEngine serves
it).

transformers itself is never imported here: the decoder reads the model's
config and forward signature, and hands the forward a cache object of its own
(see [Note: Slot cache]).

[Note: Slot cache]
The engine holds ONE KV cache for every slot: per layer, keys and values of
shape (slots, max_cache_len, kv_heads, head_dim), allocated once on the
device. They are plain attributes of plain objects (`SlotCache`, its
`layers`) held by the served module (`SlotDecoder`), marked static
addresses, so serve() lifts them to arguments of every program, donated and
written in place (see "State held outside parameters and buffers" in
docs/serving.md): no second cache exists, for any bucket. Each call hands
the model a fresh `SlotWrites` made inside the captured forward;
transformers' attention calls its `update(key_states, value_states,
layer_idx, ...)`, which writes row r of the batch into cache row rows[r] at
the indices positions[r] (index_put_) and returns the keys and values that
row attends to: for a prefill the prompt's own (the slot's older entries
are never read), for a decode step the whole cache. So one object serves
every model family whose attention calls `update`, with no per-model code.

[Note: Slot layout and masks]
A prompt of n tokens in bucket P is left-padded with P - n pad tokens (id
0: any id would do, no real token attends to them) and written at cache
indices [0, P) of its slot: its real tokens sit at [P - n, P)
(`first_index` = P - n) and its t-th new token's keys at P + t.
Positions count real tokens only (cache index - first_index), so RoPE sees
what it sees without padding, and every mask is built inside the program
from first_index and the write index, 4-D, which transformers' masking
returns as it is:
  * prefill, query i, key j: (first <= j <= i) or j == i;
  * decode, slot b, key j: first[b] <= j <= write[b].
Every mask row lets through at least one key (a pad query its own key; an
idle slot, first = write = 0, its index 0) and every written key or value
comes from finite inputs, so every softmax is finite and the cache stays
NaN-free: a masked stale entry of an earlier request in a reused slot has
weight exactly 0 and a finite value, and cannot reach another request.
"""
import dataclasses
import inspect
from typing import Any, Optional, Sequence, Tuple

import torch

from torch_xla_patches import torch_internals


@dataclasses.dataclass(frozen=True)
class PaddedPrompt:
  # The prompt left-padded to its bucket.
  token_ids: Tuple[int, ...]
  # Real tokens in it (the last `length` of token_ids).
  length: int

  @property
  def first_index(self) -> int:
    """Cache index of the first real token (see [Note: Slot layout and
    masks])."""
    return len(self.token_ids) - self.length


def bucket_for(length: int, buckets: Sequence[int]) -> Optional[int]:
  """The smallest bucket >= length, None if there is none."""
  return next((b for b in buckets if b >= length), None)


def pad_prompt(prompt_ids: Sequence[int], buckets: Sequence[int],
               pad_id: int) -> PaddedPrompt:
  """`prompt_ids` left-padded with `pad_id` to the smallest bucket that
  holds it; the caller checked that one does."""
  bucket = bucket_for(len(prompt_ids), buckets)
  padding = (pad_id,) * (bucket - len(prompt_ids))
  return PaddedPrompt(padding + tuple(prompt_ids), len(prompt_ids))


@dataclasses.dataclass(frozen=True)
class CacheShape:
  """The KV cache's sizes, read from the model's config.

  Args:
    layers: attention layers (one keys and one values tensor each).
    kv_heads: key/value heads per layer.
    head_dim: size of one head.
    vocab_size: the vocabulary, for the check of token ids.
  """
  layers: int
  kv_heads: int
  head_dim: int
  vocab_size: int

  @staticmethod
  def of(model: torch.nn.Module) -> 'CacheShape':
    model_config = getattr(model, 'config', None)
    if model_config is None:
      raise TypeError('GenerationEngine: model has no `config`; give a '
                      f'transformers causal LM, got {type(model).__name__}')
    if hasattr(model_config, 'get_text_config'):
      model_config = model_config.get_text_config()
    layer_types = getattr(model_config, 'layer_types', None) or ()
    other = sorted(set(layer_types) - {'full_attention'})
    if other:
      raise ValueError('GenerationEngine: the engine serves full attention '
                       f'layers only; this model has {other} layers')
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, 'num_key_value_heads', None) or heads
    head_dim = (getattr(model_config, 'head_dim', None) or
                model_config.hidden_size // heads)
    return CacheShape(layers=model_config.num_hidden_layers,
                      kv_heads=kv_heads,
                      head_dim=head_dim,
                      vocab_size=model_config.vocab_size)


class _SlotLayer:
  """One layer's keys and values for every slot."""

  def __init__(self, keys: torch.Tensor, values: torch.Tensor):
    self.keys = keys
    self.values = values


class SlotCache:
  """Every slot's keys and values, per layer (see [Note: Slot cache])."""

  def __init__(self, shape: CacheShape, slots: int, max_cache_len: int,
               dtype: torch.dtype, device: Any):
    size = (slots, max_cache_len, shape.kv_heads, shape.head_dim)
    # Made on the host and moved: no XLA program runs to fill them.
    zeros = lambda: torch.zeros(size, dtype=dtype).to(device)
    self.layers = [_SlotLayer(zeros(), zeros()) for _ in range(shape.layers)]
    # Marked as transformers marks a StaticCache's tensors: dynamo then makes
    # them attributes of the graph, which serve() lifts to donated arguments
    # of every call (see [Note: Tensor attributes of a captured graph]) and
    # the fast path binds through their attribute path.
    for layer in self.layers:
      torch_internals.mark_static_address(layer.keys)
      torch_internals.mark_static_address(layer.values)
    self.max_cache_len = max_cache_len
    self.dtype = dtype


class SlotWrites:
  """What one call's attention layers see as their cache: `update` writes
  batch row r into cache row rows[r] at indices positions[r] and returns
  what the row attends to (see [Note: Slot cache]).

  Args:
    cache: the engine's SlotCache.
    rows: (batch,) cache rows the batch writes.
    positions: (batch, q_len) cache indices of each row's tokens.
    whole_cache: return every cache index (a decode step), or the call's
      own keys and values only (a prefill).
  """

  def __init__(self, cache: SlotCache, rows: torch.Tensor,
               positions: torch.Tensor, whole_cache: bool):
    self.cache = cache
    self.rows = rows
    self.positions = positions
    self.whole_cache = whole_cache

  def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
             layer_idx: int, *args, **kwargs):
    del args, kwargs  # what a transformers release adds: nothing we need
    layer = self.cache.layers[layer_idx]
    keys, values = layer.keys, layer.values
    index = (self.rows[:, None], self.positions)
    # (batch, heads, q_len, dim) -> (batch, q_len, heads, dim), the cache's.
    keys.index_put_(index, key_states.transpose(1, 2).to(keys.dtype))
    values.index_put_(index, value_states.transpose(1, 2).to(values.dtype))
    if not self.whole_cache:
      return key_states, value_states
    return (keys.transpose(1, 2).to(key_states.dtype),
            values.transpose(1, 2).to(value_states.dtype))


class SlotDecoder(torch.nn.Module):
  """The served module: a causal LM and the slot cache it writes.

  prefill: forward(input_ids (1, P), first_index (1,), slot=(1,))
  decode:  forward(input_ids (slots, 1), first_index (slots,),
                   write_index=(slots,))
  Each returns (next token ids (batch,), last logits (batch, vocab)).

  Args:
    model: the causal LM.
    cache: the slot cache.
    calls: how the model's forward is called (see ModelCalls).
  """

  def __init__(self, model: torch.nn.Module, cache: SlotCache,
               calls: 'ModelCalls'):
    super().__init__()
    self.model = model
    self.cache = cache
    # Plain values: serve()'s key holds them (see [Note: Serve key]).
    self.cache_keyword = calls.cache_keyword
    self.logits_to_keep = calls.logits_to_keep
    self.additive_mask_dtype = calls.additive_mask_dtype

  def forward(self,
              input_ids: torch.Tensor,
              first_index: torch.Tensor,
              write_index: Optional[torch.Tensor] = None,
              slot: Optional[torch.Tensor] = None):
    # See [Note: Slot layout and masks].
    device = input_ids.device
    if slot is not None:
      # A prompt, written at [0, P) of its slot.
      length = input_ids.shape[1]
      indices = torch.arange(length, device=device)
      position_ids = (indices - first_index[:, None]).clamp(min=0)
      query, key = indices[:, None], indices[None, :]
      real = (key <= query) & (key >= first_index[:, None, None])
      mask = (real | (key == query))[:, None]
      writes = SlotWrites(self.cache, slot, key.expand(1, length), False)
    else:
      # One token per slot, at each slot's own write index.
      key = torch.arange(self.cache.max_cache_len, device=device)[None, :]
      position_ids = (write_index - first_index)[:, None]
      real = (key >= first_index[:, None]) & (key <= write_index[:, None])
      mask = real[:, None, None, :]
      rows = torch.arange(input_ids.shape[0], device=device)
      writes = SlotWrites(self.cache, rows, write_index[:, None], True)
    if self.additive_mask_dtype is not None:
      dtype = self.additive_mask_dtype
      mask = torch.zeros(mask.shape, dtype=dtype,
                         device=device).masked_fill(~mask,
                                                    torch.finfo(dtype).min)
    kwargs = {self.cache_keyword: writes}
    if self.logits_to_keep:
      kwargs['logits_to_keep'] = 1
    out = self.model(input_ids=input_ids,
                     attention_mask=mask,
                     position_ids=position_ids,
                     use_cache=True,
                     **kwargs)
    logits = out.logits[:, -1]
    return logits.argmax(-1), logits


@dataclasses.dataclass(frozen=True)
class ModelCalls:
  """How the engine calls the model's forward, read from the model.

  Args:
    cache_keyword: the forward's name for the cache: `cache`
      (transformers 5.2x) or `past_key_values` (earlier releases).
    logits_to_keep: whether the forward takes `logits_to_keep` (then only
      the last position's logits are computed).
    additive_mask_dtype: None for a bool mask (sdpa attention); the dtype of
      an additive mask (eager attention adds it to the scores).
  """
  cache_keyword: str
  logits_to_keep: bool
  additive_mask_dtype: Optional[torch.dtype]

  @staticmethod
  def of(model: torch.nn.Module) -> 'ModelCalls':
    parameters = inspect.signature(model.forward).parameters
    keyword = next(
        (name for name in ('cache', 'past_key_values') if name in parameters),
        None)
    if keyword is None:
      raise TypeError(f'GenerationEngine: {type(model).__name__}.forward '
                      'takes neither `cache` nor `past_key_values`; give a '
                      'transformers causal LM')
    attention = getattr(model.config, '_attn_implementation', None) or 'sdpa'
    if attention not in ('sdpa', 'eager'):
      raise ValueError('GenerationEngine: attention implementation '
                       f"{attention!r}; the engine's 4-D masks need 'sdpa' or "
                       "'eager'")
    dtype = next(model.parameters()).dtype
    return ModelCalls(
        cache_keyword=keyword,
        logits_to_keep='logits_to_keep' in parameters,
        additive_mask_dtype=dtype if attention == 'eager' else None)

"""A generation engine over serve(): prompts padded to buckets, requests
decoded together in the slots of one KV cache, P + 1 programs.

  engine = GenerationEngine(model, prompt_buckets=(8, 16, 32), slots=4,
                            max_cache_len=128, cache_dir='/var/cache/xla')
  engine.generate([5, 17, 3], max_new_tokens=16).token_ids

`model` is a transformers causal LM on the XLA device. transformers itself
is never imported here: slot_cache.py's SlotDecoder, the module serve() is
handed, calls its forward with a cache object of its own (see [Note: Slot
cache] and [Note: Slot layout and masks] in slot_cache.py).

[Note: Programs of the engine]
serve() is handed P + 1 buckets: one prefill per prompt bucket (batch 1,
the slot an argument, so one program serves every slot) and one decode step
for all slots (idle slots are computed and ignored). The warm-up compiles
them; the engine loop, the only thread that runs them, serves only after
it, and counts an XLA compile during any step after ready
(stats().compiles_after_ready), with a warning; under
XLA_PATCHES_GENERATION_STRICT=1 the requests of that step also fail with
CompiledAfterReady. The count is the process's: another thread compiling
during a step is counted too.

[Note: The engine loop]
One daemon thread owns all device work. submit() validates a request on the
caller's thread, puts it in the queue under `_condition` and returns its
Future. The loop, once the programs are ready: fails queued requests past
their slot timeout (SlotsBusy), admits queued requests into free slots (one
prefill each, first token delivered at once), runs one decode step for all
busy slots, delivers each slot's token and frees the slots whose request
ended. `_condition` guards the queue, `_closed` and the counts of stats();
slots are the loop's alone.
"""
import collections
import concurrent.futures
import dataclasses
import logging
import operator
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from torch_xla_patches import config, torch_internals
from torch_xla_patches.call_spec import CallSpec
from torch_xla_patches.io_utils import TensorSpec
from torch_xla_patches.slot_cache import (CacheShape, ModelCalls, PaddedPrompt,
                                          SlotCache, SlotDecoder, pad_prompt)

logger = logging.getLogger('torch_xla_patches.generation')

FINISH_LENGTH = 'length'
FINISH_EOS = 'eos'
FINISH_STOP = 'stop'


class GenerationRequestError(ValueError):
  """A request the engine cannot serve; the message names the bound."""


class SlotsBusy(TimeoutError):
  """Every slot stayed busy past the request's timeout."""


class EngineClosed(RuntimeError):
  """The engine was closed before the request finished."""


class CompiledAfterReady(RuntimeError):
  """An XLA compile happened in an engine step after ready, under
  XLA_PATCHES_GENERATION_STRICT=1."""


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  # The generated tokens only, not the prompt.
  token_ids: Tuple[int, ...]
  # 'length' (max_new_tokens), 'eos' or 'stop' (the last token ended it).
  finish_reason: str


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  # XLA compiles from the engine's start until ready (P + 1 expected).
  programs_compiled: int
  # XLA compiles during engine steps after ready (0 expected).
  compiles_after_ready: int
  # Programs of each kind the engine serves.
  prefill_programs: int
  decode_programs: int
  # Requests finished with a result.
  requests_done: int
  # dynamo frames compiled from the engine's start until ready (0 when the
  # captures came from the artifact).
  dynamo_frames: int
  # Whether the captures came from the artifact in cache_dir.
  loaded: bool


@dataclasses.dataclass(frozen=True)
class _Options:
  """A request's decoding options, checked by submit()."""
  max_new_tokens: int
  eos_token_ids: Tuple[int, ...]
  stop_token_ids: Tuple[int, ...]
  do_sample: bool
  temperature: float
  top_k: Optional[int]


class _Request:
  """A request from submit() to its result; the loop's once queued."""

  def __init__(self, prompt: PaddedPrompt, options: _Options,
               generator: Optional[torch.Generator], timeout: Optional[float],
               submitted: float):
    self.prompt = prompt
    self.options = options
    self.generator = generator
    self.timeout = timeout
    self.submitted = submitted
    self.future: 'concurrent.futures.Future[GenerationResult]' = (
        concurrent.futures.Future())
    self.tokens: List[int] = []

  def finish_reason(self) -> Optional[str]:
    """Why the request ends after its last token, None if it goes on."""
    last = self.tokens[-1]
    if last in self.options.eos_token_ids:
      return FINISH_EOS
    if last in self.options.stop_token_ids:
      return FINISH_STOP
    if len(self.tokens) >= self.options.max_new_tokens:
      return FINISH_LENGTH
    return None


@dataclasses.dataclass
class _Slot:
  """A busy slot: its request and where its next token goes."""
  request: _Request
  first_index: int
  write_index: int


def _number(name: str, value: Any) -> float:
  try:
    return float(value)
  except (TypeError, ValueError):
    raise GenerationRequestError(
        f'{name} must be a number, got {value!r}') from None


# How often the loop looks at close() while the programs compile.
_POLL_SECONDS = 0.1


def _compile_count() -> int:
  """XLA compiles of this process so far (torch_xla's CompileTime)."""
  import torch_xla.debug.metrics as met
  data = met.metric_data('CompileTime')
  return int(data[0]) if data else 0


def _dynamo_frames() -> int:
  return torch_internals.dynamo_unique_graphs()


class GenerationEngine:
  """Generates tokens for requests from any thread, decoding up to `slots`
  requests together (see [Note: The engine loop]).

  Args:
    model: a transformers causal LM on the XLA device, in eval mode.
    prompt_buckets: prompt lengths; a prompt is left-padded to the smallest
      bucket that holds it.
    slots: sequences decoded together in one step.
    max_cache_len: cache indices per slot: a request's padded prompt plus
      its max_new_tokens must fit.
    dtype: the cache's dtype; default the model's.
    cache_dir: where serve() keeps its artifact across restarts.
    wait: return only once every program is compiled.
  """

  def __init__(self,
               model: torch.nn.Module,
               *,
               prompt_buckets: Sequence[int],
               slots: int,
               max_cache_len: int,
               dtype: Optional[torch.dtype] = None,
               cache_dir: Optional[str] = None,
               wait: bool = False):
    import torch_xla
    buckets = tuple(prompt_buckets)
    if (not buckets or any(not isinstance(b, int) or b < 1 for b in buckets) or
        list(buckets) != sorted(set(buckets))):
      raise ValueError('GenerationEngine: prompt_buckets must be increasing '
                       f'lengths >= 1, got {prompt_buckets!r}')
    if not isinstance(slots, int) or slots < 1:
      raise ValueError(f'GenerationEngine: slots must be >= 1, got {slots!r}')
    if not isinstance(max_cache_len, int) or max_cache_len <= buckets[-1]:
      raise ValueError('GenerationEngine: max_cache_len must be larger than '
                       f'the largest prompt bucket ({buckets[-1]}), got '
                       f'{max_cache_len!r}')
    self.shape = CacheShape.of(model)
    self.prompt_buckets = buckets
    self.slots = slots
    self.max_cache_len = max_cache_len
    parameter = next(model.parameters())
    if parameter.device.type != 'xla':
      raise ValueError(f'GenerationEngine: the model is on {parameter.device}; '
                       'move it to torch_xla.device() first')
    if model.training:
      raise ValueError('GenerationEngine: the model is in training mode; '
                       'call model.eval() first')
    calls = ModelCalls.of(model)
    self._frames_at_start = _dynamo_frames()
    self._compiles_at_start = _compile_count()
    device = torch_xla.device()
    self._device = device
    cache = SlotCache(self.shape, slots, max_cache_len, dtype or
                      parameter.dtype, device)
    self._decoder = SlotDecoder(model, cache, calls)
    import torch_xla_patches
    self._served = torch_xla_patches.serve(self._decoder,
                                           self._buckets(),
                                           cache_dir=cache_dir,
                                           wait=wait)
    self._loaded = bool(self._served.loaded)
    self._condition = threading.Condition()
    self._queue: 'collections.deque[_Request]' = collections.deque()
    self._closed = False
    self._requests_done = 0
    self._compiles_after_ready = 0
    # Set by the loop once the warm-up is over.
    self._ready_stats: Optional[Tuple[int, int]] = None
    self._ready_at: Optional[float] = None
    self._thread = threading.Thread(target=self._run,
                                    name='xla-generation-engine',
                                    daemon=True)
    self._thread.start()
    if wait:
      self.wait_ready()

  def _buckets(self) -> List[CallSpec]:
    """The P prefill calls and the decode call (see [Note: Programs of the
    engine])."""
    index = lambda n: TensorSpec((n,), torch.long)
    prefills = [
        CallSpec(TensorSpec((1, p), torch.long), index(1), slot=index(1))
        for p in self.prompt_buckets
    ]
    decode = CallSpec(TensorSpec((self.slots, 1), torch.long),
                      index(self.slots),
                      write_index=index(self.slots))
    return prefills + [decode]

  # Requests.

  def submit(
      self,
      prompt_ids: Sequence[int],
      *,
      max_new_tokens: int,
      eos_token_id: Any = None,
      stop_token_ids: Sequence[int] = (),
      do_sample: bool = False,
      temperature: float = 1.0,
      top_k: Optional[int] = None,
      seed: Optional[int] = None,
      timeout: Optional[float] = None
  ) -> 'concurrent.futures.Future[GenerationResult]':
    """Queues a request; its Future gives a GenerationResult. Raises
    GenerationRequestError at once for a request the engine cannot serve.
    `timeout`: seconds the request may wait for a free slot (SlotsBusy)."""
    prompt = self._check_prompt(prompt_ids)
    padded = pad_prompt(prompt, self.prompt_buckets, 0)
    if (not isinstance(max_new_tokens, int) or
        isinstance(max_new_tokens, bool) or max_new_tokens < 1):
      raise GenerationRequestError(
          f'max_new_tokens must be an integer >= 1, got {max_new_tokens!r}')
    needed = len(padded.token_ids) + max_new_tokens
    if needed > self.max_cache_len:
      raise GenerationRequestError(
          f'the prompt padded to {len(padded.token_ids)} plus max_new_tokens '
          f'{max_new_tokens} is {needed}, over max_cache_len '
          f'{self.max_cache_len}')
    options = _Options(max_new_tokens=max_new_tokens,
                       eos_token_ids=self._token_set('eos_token_id',
                                                     eos_token_id),
                       stop_token_ids=self._token_set('stop_token_ids',
                                                      stop_token_ids),
                       do_sample=bool(do_sample),
                       temperature=_number('temperature', temperature),
                       top_k=top_k)
    if do_sample and not options.temperature > 0:
      raise GenerationRequestError(
          f'temperature must be > 0 to sample, got {temperature!r}')
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
      raise GenerationRequestError(f'top_k must be >= 1, got {top_k!r}')
    if timeout is not None and not _number('timeout', timeout) >= 0:
      raise GenerationRequestError(f'timeout must be >= 0, got {timeout!r}')
    if seed is not None and (not isinstance(seed, int) or
                             isinstance(seed, bool)):
      raise GenerationRequestError(f'seed must be an integer, got {seed!r}')
    generator = None
    if do_sample:
      generator = torch.Generator()
      if seed is None:
        generator.seed()
      else:
        generator.manual_seed(seed)
    request = _Request(padded, options, generator, timeout, time.monotonic())
    with self._condition:
      if self._closed:
        raise EngineClosed('the GenerationEngine is closed')
      self._queue.append(request)
      self._condition.notify_all()
    return request.future

  def generate(self, prompt_ids: Sequence[int], **kwargs) -> GenerationResult:
    """submit(prompt_ids, **kwargs).result()."""
    return self.submit(prompt_ids, **kwargs).result()

  def _check_prompt(self, prompt_ids: Sequence[int]) -> Tuple[int, ...]:
    if isinstance(prompt_ids, torch.Tensor):
      if prompt_ids.dim() != 1:
        raise GenerationRequestError(
            'prompt_ids must be one sequence of token ids, got a tensor of '
            f'shape {tuple(prompt_ids.shape)}')
      prompt_ids = prompt_ids.tolist()
    try:
      prompt = tuple(prompt_ids)
    except TypeError:
      raise GenerationRequestError(
          'prompt_ids must be a sequence of token ids, got '
          f'{type(prompt_ids).__name__}') from None
    if not prompt:
      raise GenerationRequestError('the prompt is empty; give at least one '
                                   'token id')
    largest = self.prompt_buckets[-1]
    if len(prompt) > largest:
      raise GenerationRequestError(
          f'the prompt has {len(prompt)} tokens, over the largest prompt '
          f'bucket {largest}')
    vocab = self.shape.vocab_size
    ids = []
    for token in prompt:
      try:
        if isinstance(token, bool):
          raise TypeError
        ids.append(operator.index(token))
      except TypeError:
        raise GenerationRequestError(
            f'the prompt holds {token!r}; token ids are integers') from None
      if not 0 <= ids[-1] < vocab:
        raise GenerationRequestError(
            f'token id {ids[-1]} of the prompt is outside the vocabulary '
            f'[0, {vocab})')
    return tuple(ids)

  @staticmethod
  def _token_set(name: str, tokens: Any) -> Tuple[int, ...]:
    if tokens is None:
      return ()
    if isinstance(tokens, int) and not isinstance(tokens, bool):
      return (tokens,)
    tokens = tuple(tokens)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
      raise GenerationRequestError(
          f'{name} must be token ids (ints), got {tokens!r}')
    return tokens

  # State.

  def ready(self) -> bool:
    """Whether every prefill bucket and the decode step are compiled;
    answers at once, starts no work."""
    readiness = self._served.readiness()
    return readiness.ready == readiness.total

  def wait_ready(self, timeout: Optional[float] = None) -> bool:
    """Waits until every program is compiled (or one failed), at most
    `timeout` seconds; returns ready()."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not self._served.wait_ready(timeout):
      return False
    # The loop takes its counts once the warm-up is over.
    with self._condition:
      self._condition.wait_for(
          lambda: self._ready_stats is not None or self._closed,
          None if deadline is None else max(0.0, deadline - time.monotonic()))
    return self.ready()

  def stats(self) -> GenerationStats:
    with self._condition:
      frames, compiles = self._ready_stats or (_dynamo_frames(),
                                               _compile_count())
      return GenerationStats(programs_compiled=compiles -
                             self._compiles_at_start,
                             compiles_after_ready=self._compiles_after_ready,
                             prefill_programs=len(self.prompt_buckets),
                             decode_programs=1,
                             requests_done=self._requests_done,
                             dynamo_frames=frames - self._frames_at_start,
                             loaded=self._loaded)

  def close(self) -> None:
    """Stops the loop; requests not finished fail with EngineClosed."""
    with self._condition:
      self._closed = True
      self._condition.notify_all()
    if threading.current_thread() is not self._thread:
      self._thread.join()

  def __enter__(self) -> 'GenerationEngine':
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  # The loop (see [Note: The engine loop]).

  def _run(self) -> None:
    slots: List[Optional[_Slot]] = [None] * self.slots
    try:
      if self._wait_for_programs():
        while True:
          admitted = self._next_requests(slots)
          if admitted is None:
            break
          for request in admitted:
            self._step(self._prefill, slots, request)
          if any(slots):
            self._step(self._decode, slots)
    except BaseException as error:  # pylint: disable=broad-except
      logger.exception('torch_xla_patches.generation: the engine loop stopped')
      self._fail_all(slots, EngineClosed(f'the engine loop stopped: {error!r}'))
      return
    self._fail_all(slots, EngineClosed('the GenerationEngine was closed'))

  def _wait_for_programs(self) -> bool:
    """Waits until the warm-up is over (every program compiled, or failed:
    steps then compile what they need, counted after ready) and takes the
    counts of stats(); False if closed first."""
    # Polled, so that close() during the warm-up returns at once.
    while not self._served.readiness().done:
      with self._condition:
        if self._closed:
          return False
      self._served.wait_ready(_POLL_SECONDS)
    self._served.wait_ready()  # the artifact's write, after the compiles
    with self._condition:
      self._ready_stats = (_dynamo_frames(), _compile_count())
      self._ready_at = time.monotonic()
      self._condition.notify_all()
    return True

  def _next_requests(self,
                     slots: List[Optional[_Slot]]) -> Optional[List[_Request]]:
    """The queued requests to admit now, one per free slot; waits while
    there is nothing to do; None once closed."""
    with self._condition:
      while True:
        if self._closed:
          return None
        self._expire_waiting(sum(s is None for s in slots))
        free = sum(s is None for s in slots)
        if self._queue and free or any(slots):
          admitted = []
          while self._queue and len(admitted) < free:
            request = self._queue.popleft()
            # A caller may have cancelled its future while it was queued;
            # from here on it cannot.
            if request.future.set_running_or_notify_cancel():
              admitted.append(request)
          return admitted
        self._condition.wait(self._next_deadline())

  def _expire_waiting(self, free: int) -> None:
    """Fails the queued requests past their timeout that no free slot
    takes now (SlotsBusy)."""
    now = time.monotonic()
    kept = collections.deque()
    for position, request in enumerate(self._queue):
      deadline = self._deadline(request)
      if request.future.cancelled():
        continue
      if position >= free and deadline is not None and now >= deadline:
        request.future.set_exception(
            SlotsBusy(f'all {self.slots} slots stayed busy for the request\'s '
                      f'timeout of {request.timeout} s'))
      else:
        kept.append(request)
    self._queue = kept

  def _deadline(self, request: _Request) -> Optional[float]:
    if request.timeout is None:
      return None
    # Waiting for the programs to compile is not waiting for a slot.
    return max(request.submitted, self._ready_at) + request.timeout

  def _next_deadline(self) -> Optional[float]:
    deadlines = [d for d in map(self._deadline, self._queue) if d is not None]
    if not deadlines:
      return None
    return max(0.0, min(deadlines) - time.monotonic())

  def _step(self, run, slots: List[Optional[_Slot]], *args) -> None:
    """Runs one prefill or decode step, counting the XLA compiles it
    caused (see [Note: Programs of the engine]); under
    XLA_PATCHES_GENERATION_STRICT the requests of such a step fail with
    CompiledAfterReady and free their slots, as do the requests of a step
    that raised, with its error."""
    requests = list(args) or [s.request for s in slots if s is not None]
    before = _compile_count()
    try:
      run(slots, *args)
    except Exception as error:  # pylint: disable=broad-except
      logger.exception(
          'torch_xla_patches.generation: a %s step raised; its %d request(s) '
          'fail with its error', run.__name__.lstrip('_'), len(requests))
      self._fail_step(slots, requests, error)
      return
    compiled = _compile_count() - before
    if not compiled:
      return
    with self._condition:
      self._compiles_after_ready += compiled
    # Imports torch_xla: not at the package's import.
    from torch_xla_patches import counters
    counters.increment_counter(counters.COUNTER_GENERATION_COMPILED_AFTER_READY,
                               compiled)
    message = (f'torch_xla_patches.generation: {compiled} XLA compile(s) '
               f'after ready, in a {run.__name__.lstrip("_")} step; the '
               'engine compiles P + 1 programs before ready and none after')
    logger.warning(message)
    if config.generation_strict:
      self._fail_step(slots, requests, CompiledAfterReady(message))

  @staticmethod
  def _fail_step(slots: List[Optional[_Slot]], requests: List[_Request],
                 error: Exception) -> None:
    """The step's requests not finished fail with `error`; their slots are
    freed."""
    for index, slot in enumerate(slots):
      if slot is not None and slot.request in requests:
        slots[index] = None
    for request in requests:
      if not request.future.done():
        request.future.set_exception(error)

  def _prefill(self, slots: List[Optional[_Slot]], request: _Request) -> None:
    index = slots.index(None)
    prompt = request.prompt
    to_device = lambda values: torch.tensor(values).to(self._device)
    ids, logits = self._served(to_device([prompt.token_ids]),
                               to_device([prompt.first_index]),
                               slot=to_device([index]))
    slots[index] = _Slot(request, prompt.first_index, len(prompt.token_ids))
    self._deliver(slots, {index: 0}, ids, logits)

  def _decode(self, slots: List[Optional[_Slot]]) -> None:
    busy = [i for i, s in enumerate(slots) if s is not None]
    tokens = [s.request.tokens[-1] if s else 0 for s in slots]
    first = [s.first_index if s else 0 for s in slots]
    write = [s.write_index if s else 0 for s in slots]
    to_device = lambda values: torch.tensor(values).to(self._device)
    ids, logits = self._served(to_device([[t] for t in tokens]),
                               to_device(first),
                               write_index=to_device(write))
    for i in busy:
      slots[i].write_index += 1
    self._deliver(slots, {i: i for i in busy}, ids, logits)

  def _deliver(self, slots: List[Optional[_Slot]], rows: Dict[int, int],
               ids: torch.Tensor, logits: torch.Tensor) -> None:
    """Each busy slot's next token (greedy, or sampled from its logits),
    and the slots of requests that ended freed. `rows`: slot -> its row of
    the step's batch (a prefill's batch is its one slot)."""
    greedy = ids.cpu().tolist()
    host_logits = None
    for index, row in rows.items():
      request = slots[index].request
      if request.options.do_sample:
        if host_logits is None:
          host_logits = logits.cpu().float()
        token = self._sample(host_logits[row], request)
      else:
        token = greedy[row]
      request.tokens.append(token)
      reason = request.finish_reason()
      if reason is not None:
        slots[index] = None
        with self._condition:
          self._requests_done += 1
        request.future.set_result(
            GenerationResult(tuple(request.tokens), reason))

  @staticmethod
  def _sample(logits: torch.Tensor, request: _Request) -> int:
    options = request.options
    logits = logits / options.temperature
    if options.top_k is not None and options.top_k < logits.numel():
      kth = torch.topk(logits, options.top_k).values[-1]
      logits = logits.masked_fill(logits < kth, float('-inf'))
    probabilities = torch.softmax(logits, -1)
    return int(torch.multinomial(probabilities, 1, generator=request.generator))

  def _fail_all(self, slots: List[Optional[_Slot]], error: Exception) -> None:
    with self._condition:
      self._closed = True
      waiting = list(self._queue)
      self._queue.clear()
    for request in waiting + [s.request for s in slots if s is not None]:
      if not request.future.done():
        request.future.set_exception(error)

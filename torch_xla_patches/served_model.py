"""What serve() returns: the captures of one served model and the routing
of each call to the capture whose guards accept it (see [Note: One capture
per guard set] in serving.py), the first capture included (see [Note: The
first capture] in serving.py). Each capture's calls, fast path and full
path, are a fast_dispatch.ServedCalls.
"""
import logging
import threading
from typing import (Any, Callable, Dict, Hashable, List, Optional, Sequence,
                    Tuple)

import torch

from torch_xla_patches import call_spec
from torch_xla_patches import execution
from torch_xla_patches import serialization
from torch_xla_patches.counters import increment_counter
from torch_xla_patches.fast_dispatch import (COUNTER_CAPTURED_AGAIN,
                                             ServedCalls)

logger = logging.getLogger('torch_xla_patches.serving')


class ServedModel:
  """What serve() returns: call it like the model.

  A call takes the fast path (see [Note: Served fast path]) when it can, and
  otherwise the full path: the captured code with dynamo's guards. A call
  those guards refuse goes to the capture whose guards accept it, made on
  the first such call (see [Note: One capture per guard set] in
  serving.py), or, where the model cannot be captured again, to a re-trace
  with torch.compile (see [Note: One served call]). Calls run without
  autograd whatever the grad mode, from any number of threads.

  Args:
    captures: the captures made or loaded so far (aot_compile'd
      CompiledModels), or a single torch.compile'd module (torch 2.8, or
      where aot_compile could not capture the model), which has no fast path;
      none on a first start that captures on the first call (see [Note:
      The first capture] in serving.py), which then needs `capture` and
      `fallback`.
    model: the served module.
    artifact: the artifact path this process loaded or wrote, or None.
    loaded: whether the artifact was loaded and serves the buckets (no
      dynamo frame).
    capture: captures the model on a call's (args, kwargs), with static
      sizes where `static=True` is passed; returns None where it cannot.
      None: calls no capture accepts are traced again.
    fallback: with no capture, makes what serves every call where the
      first capture cannot be made (the model compiled with torch.compile).
    pending: the loaded artifact's later captures, not loaded yet: each
      function loads one (see [Note: A restart's captures, one at a time]
      in serving.py).
  """

  # More captures than this: the model's guards depend on something that
  # keeps changing; calls none accepts are traced again instead.
  MAX_CAPTURES = 8

  def __init__(self,
               captures: Sequence[Any],
               model: torch.nn.Module,
               artifact: Optional[str],
               loaded: bool,
               capture: Optional[Callable[..., Optional[Any]]] = None,
               fallback: Optional[Callable[[], Any]] = None,
               pending: Sequence[Callable[[], Any]] = ()):
    self.model = model
    self.artifact = artifact
    self.loaded = loaded
    # The first capture, or the torch.compile'd module; None until the
    # first capture is made (see [Note: The first capture] in serving.py).
    self.compiled = captures[0] if captures else None
    if captures and not isinstance(self.compiled, serialization.CompiledModel):
      self._served: Tuple[ServedCalls, ...] = ()
    else:
      self._served = tuple(
          ServedCalls(compiled, model, self._refused) for compiled in captures)
    if not captures and (capture is None or fallback is None):
      raise ValueError('torch_xla_patches: a served model with no capture '
                       'needs a capture and a fallback')
    self._fallback = fallback
    # A first request's capture, with static sizes (see [Note: The first
    # capture] in serving.py); the warm-up makes the captures its buckets
    # need as if it were not there.
    self._static: Optional[ServedCalls] = None
    self._capture = capture
    self._capture_lock = threading.Lock()
    # Call key -> the ServedCalls whose guards accepted it, for keys the
    # first capture's guards refused; None for keys no capture serves
    # (traced again).
    self._route: Dict[Hashable, Optional[ServedCalls]] = {}
    # The capture that served the last call without a key (a tensor
    # passed twice, an argument the key does not know), which the next one
    # tries first: such calls tend to come in runs of one capture's, and
    # the first capture's guards would otherwise refuse each of them first.
    self._keyless: Optional[ServedCalls] = None
    # The compile of the buckets, once serve() starts it (see [Note: Ready
    # at once] in serving.py).
    self.warm_up: Optional[Any] = None
    # Told of the first request's start and answer, then None (see [Note:
    # Captures after the first request] in warmup.py).
    self.first_request: Optional[Any] = None
    # The artifact's captures still to load, in order. _pending_lock is held
    # while one loads; no other lock is held when it is taken.
    self._pending: List[Callable[[], Any]] = list(pending)
    self._pending_lock = threading.Lock()
    # How many of the captures this process made (the others, if any, came
    # from the artifact); counted under _capture_lock.
    self._captures_made = 0

  def __reduce__(self):
    # Installed as the module's forward (see [Note: Serving a module's
    # forward] in serialization.py), this object is in the module's state,
    # which torch 2.9's aot_compile pickles with a later capture's guards.
    # What unpickles is a placeholder: a served model is made by serve().
    return (_served_model_placeholder, (type(self.model).__name__,))

  def captures(self) -> List[Any]:
    """The CompiledModels serving calls, in the order they were made (of
    the artifact's, those loaded so far: see load_pending)."""
    return [calls.compiled for calls in self._served]

  @property
  def captures_made(self) -> int:
    """How many of the captures were made by this process, not loaded."""
    return self._captures_made

  @property
  def pending_captures(self) -> int:
    """How many of the artifact's captures are not loaded yet."""
    return len(self._pending)

  def load_pending(self) -> None:
    """Loads every capture of the artifact not loaded yet (see [Note: A
    restart's captures, one at a time] in serving.py)."""
    while self._load_next() is not None:
      pass

  def _load_next(self) -> Optional['ServedCalls']:
    """Loads the artifact's next capture and serves calls with it; None when
    none is left. A capture that does not load is said in the log, and the
    ones after it are left too: calls that none of the others accepts are
    captured again."""
    with self._pending_lock:
      if not self._pending:
        return None
      load = self._pending.pop(0)
      try:
        compiled = load()
      except Exception as e:  # pylint: disable=broad-except
        logger.warning(
            'torch_xla_patches.serve: %s: %s; %d later captures are left '
            'too: calls that none of the others accepts are captured again',
            type(e).__name__, e, len(self._pending))
        self._pending.clear()
        return None
      calls = ServedCalls(compiled, self.model, self._refused)
      with execution.execution_lock:
        self._served = self._served + (calls,)
      return calls

  @property
  def calls(self) -> Optional['ServedCalls']:
    """Every call of the first capture (the others' are in _served); None
    before it is made, or with no capture (torch.compile)."""
    served = self._served
    return served[0] if served else None

  @property
  def can_capture(self) -> bool:
    """Whether calls no capture accepts are captured (else traced again)."""
    return self._capture is not None

  @property
  def fast_calls(self) -> int:
    """Calls served by the fast path, of every capture."""
    return sum(calls.fast_calls for calls in self._served)

  def readiness(self) -> Any:
    """How many buckets are compiled, of how many, and which failed (a
    warmup.Readiness); for a health probe."""
    return self.warm_up.readiness()

  def wait_ready(self, timeout: Optional[float] = None) -> bool:
    """Waits until every bucket is compiled (or failed), at most `timeout`
    seconds; returns whether every bucket is compiled."""
    return self.warm_up.wait(timeout)

  def __call__(self, *args, **kwargs):
    first = self.first_request
    if first is not None and not execution.compiling_only():
      self.first_request = None
      first.request_started()
      try:
        return self(*args, **kwargs)
      finally:
        first.request_answered()
    served = self._served
    if not served:
      served = self._first_capture(args, kwargs, static=True)
      if not served:
        with torch.no_grad():
          return self.compiled(*args, **kwargs)
    key, leaves = call_spec.call_key(args, kwargs, served[0].sharding_of)
    calls = served[0]
    if key is None:
      calls = self._keyless or calls
    elif self._route:
      calls = self._route.get(key, calls)
      if calls is None:
        return served[0].retrace(args, kwargs)
    return calls.call(args, kwargs, key, leaves)

  def capture_for(self, args: tuple, kwargs: Dict[str, Any]) -> None:
    """Makes the capture whose guards accept the call (args, kwargs), if
    none made so far does (see [Note: One capture per guard set] in
    serving.py); a warm-up makes it before its compile-only call of the
    bucket, so that the capture is not part of that call."""
    if not self._served:
      self._first_capture(args, kwargs)
    elif self._accepting(args, kwargs, self._static) is None:
      self._captured_for(args, kwargs, self._static)

  def needs_capture(self, args: tuple, kwargs: Dict[str, Any]) -> bool:
    """Whether the warm-up's call (args, kwargs) of a bucket needs a capture:
    no capture made so far accepts it, a request's first capture with
    static sizes aside (see [Note: The first capture] in serving.py). The
    guards read the model's tensors under the lock (see [Note: What reads
    the model's tensors] in serialization.py)."""
    self.load_pending()
    with execution.execution_lock:
      return self._accepting(args, kwargs, self._static) is None

  def _first_capture(self,
                     args: tuple,
                     kwargs: Dict[str, Any],
                     static: bool = False) -> Tuple['ServedCalls', ...]:
    """The captures, once the first is made on this call (see [Note: The
    first capture] in serving.py), with static sizes for a request's; ()
    if the model is served by torch.compile, which then serves every
    call."""
    if self._served or self._fallback is None:
      return self._served
    with self._capture_lock:
      if not self._served and self._fallback is not None:
        calls = self._new_capture(args, kwargs, static,
                                  'serving it with torch.compile')
        if calls is None:
          self.compiled = self._fallback()
          self._capture = None
        else:
          self.compiled = calls.compiled
          if static:
            self._static = calls
          self._captures_made += 1
          with execution.execution_lock:
            self._served = (calls,)
        self._fallback = None
    return self._served

  def _new_capture(self, args: tuple, kwargs: Dict[str, Any], static: bool,
                   if_refused: str) -> Optional['ServedCalls']:
    """A capture made on the call (args, kwargs), if its guards accept that
    call; None, said in the log (`if_refused`: what happens to such calls),
    where they do not or it cannot be made. The caller holds
    _capture_lock."""
    compiled = self._capture(args, kwargs, static=static)
    if compiled is None:
      return None  # `capture` said why in the log.
    if not compiled.guard_check(*args, **kwargs):
      logger.warning(
          'torch_xla_patches.serve: a capture of %s refuses the call it was '
          'made on (%s); %s',
          type(self.model).__name__, compiled.guard_failure(*args, **kwargs),
          if_refused)
      return None
    return ServedCalls(compiled, self.model, self._refused)

  def compile_only_call(self, *args, **kwargs):
    """A warm-up's call (see [Note: Compile-only calls] in execution.py):
    the full path, whose bridge compiles and stops, never the fast path,
    whose learned run of a key a request taught would run its program."""
    served = self._served or self._first_capture(args, kwargs)
    if not served:
      return self(*args, **kwargs)
    key, leaves = call_spec.call_key(args, kwargs, served[0].sharding_of)
    return served[0].full_call(args, kwargs, key, leaves)

  def _refused(self, refused_by: 'ServedCalls', args: tuple, kwargs: Dict[str,
                                                                          Any],
               key: Optional[Hashable], leaves: Sequence[Any]) -> Any:
    """Serves a call whose capture's guards refused it (see [Note: One
    capture per guard set] in serving.py)."""
    if (self.model.__dict__.get('forward') is self and
        not refused_by.compiled.forward_call):
      # Every capture of the module's call would call this object again.
      raise TypeError(
          'torch_xla_patches.serve: a served module is installed as its own '
          'forward; serve the forward to put it in its place: '
          '`model.forward = torch_xla_patches.serve(model.forward, buckets)`')
    calls = self._accepting(args, kwargs, refused_by)
    while calls is None and self._pending:
      # The artifact's next capture, loaded by this call if the background
      # has not loaded it yet.
      loaded = self._load_next()
      if loaded is not None and loaded.compiled.guard_check(*args, **kwargs):
        calls = loaded
    if calls is None:
      calls = self._captured_for(args, kwargs)
    if key is None:
      self._keyless = calls
    else:
      # None: calls of this key are traced again, without trying to
      # capture them each time.
      with execution.execution_lock:
        self._route = {**self._route, key: calls}
    if calls is None:
      return self._served[0].retrace(args, kwargs)
    return calls.full_call(args, kwargs, key, leaves)

  def _accepting(
      self, args: tuple, kwargs: Dict[str, Any],
      refused_by: Optional['ServedCalls']) -> Optional['ServedCalls']:
    for calls in self._served:
      if calls is not refused_by and calls.compiled.guard_check(
          *args, **kwargs):
        return calls
    return None

  def _captured_for(
      self,
      args: tuple,
      kwargs: Dict[str, Any],
      ignoring: Optional['ServedCalls'] = None) -> Optional['ServedCalls']:
    """A capture of the model on this call, made once: another thread may
    have made it meanwhile (one that `ignoring` accepts does not count).
    None where the model cannot be captured again."""
    self.load_pending()
    with self._capture_lock:
      calls = self._accepting(args, kwargs, ignoring)
      if calls is not None:
        return calls
      if self._capture is None or len(self._served) >= self.MAX_CAPTURES:
        return None
      calls = self._new_capture(args, kwargs, False,
                                'such calls are traced again')
      if calls is None:
        return None
      increment_counter(COUNTER_CAPTURED_AGAIN, 1)
      self._captures_made += 1
      with execution.execution_lock:
        self._served = self._served + (calls,)
      logger.info(
          'torch_xla_patches.serve: %s captured again (capture %d) for a call '
          'the other captures\' guards refuse',
          type(self.model).__name__, len(self._served))
      return calls


def _served_model_placeholder(model_name: str) -> str:
  """What a pickled ServedModel unpickles as (see ServedModel.__reduce__)."""
  return f'<served {model_name}, not unpickled>'

"""A reference HTTP server over the generation engine, with a built-in model.

  python -m torch_xla_patches.server --port 8000 --cache-dir DIR
      [--host 127.0.0.1] [--prompt-buckets 8,16,32] [--slots 4]
      [--max-cache-len 64] [--slot-timeout 30] [--dtype float32] [--seed 0]

Endpoints (JSON in and out):
  POST /generate  {"prompt_ids": [...], "max_new_tokens": N, and optionally
                  "eos_token_id", "stop_token_ids", "do_sample",
                  "temperature", "top_k", "seed"}
                  -> 200 {"token_ids": [...], "finish_reason": ...}
                  -> 400 {"error": ...} for a request the engine refuses (the
                     message names the bound), 503 before ready or when no
                     slot frees within --slot-timeout (with Retry-After)
  GET  /ready     503 until the engine's programs are compiled, 200 after
  GET  /live      200 whenever the process answers
  GET  /stats     the engine's GenerationStats, and its readiness

The server is built on the standard library's `http.server`
(ThreadingHTTPServer, a thread per connection): nothing to install beyond the
package, and enough for a reference whose work happens in the engine. A
production deployment puts its own front end (batching proxy, TLS, auth) in
front of `GenerationEngine` instead.

The built-in model is a tiny Llama-shaped causal LM whose weights come from a
fixed seed, built in code: one command starts the server on a fresh clone with
nothing downloaded. The process prints `listening on http://HOST:PORT` on one
line of stdout once its socket is bound (so `--port 0` works), answers /live
at once, and builds the engine (capture, then compiles in the background)
while /ready answers 503.
"""
import argparse
import dataclasses
import http.server
import json
import logging
import math
import signal
import sys
import threading
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from torch_xla_patches import generation

logger = logging.getLogger('torch_xla_patches.server')

# The built-in model: a Llama-shaped decoder small enough to compile in
# seconds on a CPU. Its configuration and seed are part of the server's
# contract with the tests and tools that compute its eager tokens.
BUILTIN_MODEL_TYPE = 'llama'
BUILTIN_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Peaked enough logits that greedy tokens do not hang on rounding.
    initializer_range=0.1,
    # No special tokens: a request names its own EOS and stops.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
BUILTIN_SEED = 0

DEFAULT_PROMPT_BUCKETS = (8, 16, 32)
DEFAULT_SLOTS = 4
DEFAULT_MAX_CACHE_LEN = 64
DEFAULT_SLOT_TIMEOUT = 30.0
# A /generate body larger than this is refused before it is read.
MAX_BODY_BYTES = 1 << 20
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16}


def builtin_model(seed: int = BUILTIN_SEED) -> torch.nn.Module:
  """The built-in causal LM on the CPU, in eval mode: the same weights for
  the same seed in every process (the server moves it to the XLA device; a
  test or tool computes eager tokens with its own copy)."""
  try:
    import transformers
  except ImportError as e:
    raise RuntimeError('the built-in model needs transformers: pip install '
                       "'torch_xla_patches[server]'") from e
  config = transformers.AutoConfig.for_model(BUILTIN_MODEL_TYPE,
                                             **BUILTIN_CONFIG)
  torch.manual_seed(seed)
  return transformers.AutoModelForCausalLM.from_config(config).eval()


class BadRequest(ValueError):
  """A /generate body that is not a valid request; the message names the
  field and what it accepts."""


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  """One parsed /generate body: the engine's `submit` arguments."""
  # The prompt's token ids.
  prompt_ids: Tuple[int, ...]
  # Every keyword of `GenerationEngine.submit` the body gave, by name.
  options: Dict[str, Any]


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> int:
  if not _is_int(value):
    raise BadRequest(f'{name} must be an integer, got {value!r}')
  return value


def _check_ids(name: str, value: Any) -> Tuple[int, ...]:
  if not isinstance(value, list) or not all(_is_int(v) for v in value):
    raise BadRequest(f'{name} must be a list of integers, got '
                     f'{_short(value)}')
  return tuple(value)


def _short(value: Any) -> str:
  text = json.dumps(value)
  return text if len(text) <= 80 else text[:77] + '...'


def _check_temperature(name: str, value: Any) -> float:
  if (not isinstance(value, (int, float)) or isinstance(value, bool) or
      not math.isfinite(value) or value <= 0):
    raise BadRequest(f'{name} must be a number > 0, got {value!r}')
  return float(value)


def _check_top_k(name: str, value: Any) -> int:
  if not _is_int(value) or value < 1:
    raise BadRequest(f'{name} must be an integer >= 1, got {value!r}')
  return value


def _check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise BadRequest(f'{name} must be true or false, got {value!r}')
  return value


# Optional fields of a /generate body: name -> check (null means "not
# given": the engine's default).
_OPTIONAL_FIELDS = {
    'eos_token_id': _check_int,
    'stop_token_ids': _check_ids,
    'do_sample': _check_bool,
    'temperature': _check_temperature,
    'top_k': _check_top_k,
    'seed': _check_int,
}
_REQUIRED_FIELDS = ('prompt_ids', 'max_new_tokens')


def parse_generate_request(body: bytes) -> GenerateRequest:
  """A /generate body -> its request; raises BadRequest naming the field.

  Only types are checked here; the engine checks the bounds (prompt length,
  cache length, vocabulary) when the request is submitted."""
  try:
    fields = json.loads(body)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise BadRequest(f'the body is not JSON: {e}') from None
  if not isinstance(fields, dict):
    raise BadRequest(f'the body must be a JSON object, got {_short(fields)}')
  unknown = sorted(set(fields) - set(_REQUIRED_FIELDS) - set(_OPTIONAL_FIELDS))
  if unknown:
    raise BadRequest(f'unknown field(s) {", ".join(unknown)}; accepted: '
                     f'{", ".join(_REQUIRED_FIELDS + tuple(_OPTIONAL_FIELDS))}')
  missing = [name for name in _REQUIRED_FIELDS if name not in fields]
  if missing:
    raise BadRequest(f'missing field(s) {", ".join(missing)}')
  options = {
      'max_new_tokens': _check_int('max_new_tokens', fields['max_new_tokens'])
  }
  for name, check in _OPTIONAL_FIELDS.items():
    if fields.get(name) is not None:
      options[name] = check(name, fields[name])
  return GenerateRequest(_check_ids('prompt_ids', fields['prompt_ids']),
                         options)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """What the server builds its engine with."""
  # Prompt lengths, sorted; a prompt is left-padded to the next one.
  prompt_buckets: Tuple[int, ...]
  # Sequences decoded together in one step.
  slots: int
  # Tokens of KV cache per slot (prompt bucket + new tokens).
  max_cache_len: int
  # The KV cache's and the weights' dtype.
  dtype: torch.dtype
  # The serve() cache directory (artifact and signature index), or None.
  cache_dir: Optional[str]
  # Seconds a request may wait for a free slot before a 503.
  slot_timeout: float
  # The built-in model's weights seed.
  seed: int


def build_engine(options: EngineOptions) -> 'generation.GenerationEngine':
  """The built-in model on the XLA device, served by a GenerationEngine that
  compiles its programs in the background."""
  import torch_xla
  model = builtin_model(options.seed).to(options.dtype)
  model = model.to(torch_xla.device())
  return generation.GenerationEngine(model,
                                     prompt_buckets=options.prompt_buckets,
                                     slots=options.slots,
                                     max_cache_len=options.max_cache_len,
                                     dtype=options.dtype,
                                     cache_dir=options.cache_dir,
                                     wait=False)


@dataclasses.dataclass(frozen=True)
class EngineState:
  """What a request finds: the engine, and why it cannot serve yet."""
  # The engine, once built (None before, after a failure, once closed).
  engine: Optional['generation.GenerationEngine']
  # Why requests get 503 now, or None when the engine is ready.
  not_ready: Optional[str]


class EngineHolder:
  """The engine once it is built, or why it could not be.

  [Note: Server readiness]
  The HTTP server answers from its first moment, before the engine exists:
  /live is 200 at once; /ready and /generate answer 503 until the engine is
  built and `engine.ready()` (every program compiled) is true. Probes read
  the state held here and `ready()`, which answer at once: no probe starts
  work. `_lock` guards `_engine`, `_failure` and `_closed`; the engine
  itself is thread-safe and is called outside the lock.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._engine = None
    self._failure: Optional[str] = None
    self._closed = False

  def build(self, make):
    """Builds the engine with `make()` on this thread and returns it, or
    None when it failed (the reason is kept for /ready) or the server closed
    meanwhile."""
    try:
      engine = make()
    except Exception as e:  # reported by /ready and the log, then exit
      logger.exception('the engine could not be built')
      with self._lock:
        self._failure = f'the engine could not be built: {e}'
      return None
    with self._lock:
      closed = self._closed
      if not closed:
        self._engine = engine
    if closed:
      engine.close()
      return None
    return engine

  def state(self) -> EngineState:
    """The engine and its readiness, at once (see [Note: Server
    readiness])."""
    with self._lock:
      engine, failure, closed = self._engine, self._failure, self._closed
    if closed:
      return EngineState(None, 'the server is shutting down')
    if failure is not None:
      return EngineState(None, failure)
    if engine is None:
      return EngineState(None, 'the engine is being built')
    if not engine.ready():
      return EngineState(engine, 'the engine is compiling its programs')
    return EngineState(engine, None)

  @property
  def failure(self) -> Optional[str]:
    with self._lock:
      return self._failure

  def close(self) -> None:
    with self._lock:
      engine, self._engine, self._closed = self._engine, None, True
    if engine is not None:
      engine.close()


class GenerationHandler(http.server.BaseHTTPRequestHandler):
  """The endpoints; `self.server` is a GenerationServer."""
  server_version = 'torch_xla_patches'
  # Seconds a connection may stall while its request is read or answered.
  timeout = 60

  def log_message(self, format, *args):
    logger.debug('%s %s', self.address_string(), format % args)

  def _reply(
      self,
      status: int,
      payload: Dict[str, Any],
      headers: Sequence[Tuple[str, str]] = ()) -> None:
    body = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header('Content-Type', 'application/json')
    self.send_header('Content-Length', str(len(body)))
    for name, value in headers:
      self.send_header(name, value)
    self.end_headers()
    self.wfile.write(body)

  def _not_ready(self, reason: str) -> None:
    self._reply(503, {'ready': False, 'error': reason}, [('Retry-After', '1')])

  def do_GET(self):
    path = self.path.split('?', 1)[0]
    if path == '/live':
      self._reply(200, {'live': True})
    elif path == '/ready':
      state = self.server.holder.state()
      if state.not_ready is None:
        self._reply(200, {'ready': True})
      else:
        self._not_ready(state.not_ready)
    elif path == '/stats':
      state = self.server.holder.state()
      if state.engine is None:
        self._not_ready(state.not_ready)
      else:
        self._reply(
            200,
            dict(dataclasses.asdict(state.engine.stats()),
                 ready=state.not_ready is None))
    elif path == '/generate':
      self._reply(405, {'error': 'use POST for /generate'}, [('Allow', 'POST')])
    else:
      self._reply(404, {'error': f'no endpoint {path}'})

  def do_POST(self):
    path = self.path.split('?', 1)[0]
    if path != '/generate':
      if path in ('/live', '/ready', '/stats'):
        self._reply(405, {'error': f'use GET for {path}'}, [('Allow', 'GET')])
      else:
        self._reply(404, {'error': f'no endpoint {path}'})
      return
    length = self.headers.get('Content-Length')
    if length is None or not length.isdigit():
      self._reply(411, {'error': 'a Content-Length header is required'})
      return
    if int(length) > MAX_BODY_BYTES:
      self._reply(
          413, {
              'error': f'the body has {length} bytes, more than the '
                       f'{MAX_BODY_BYTES} accepted'
          })
      return
    body = self.rfile.read(int(length))
    try:
      request = parse_generate_request(body)
    except BadRequest as e:
      self._reply(400, {'error': str(e)})
      return
    state = self.server.holder.state()
    if state.not_ready is not None:
      self._not_ready(state.not_ready)
      return
    self._generate(state.engine, request)

  def _generate(self, engine, request: GenerateRequest) -> None:
    try:
      future = engine.submit(request.prompt_ids,
                             timeout=self.server.slot_timeout,
                             **request.options)
      result = future.result()
    except generation.GenerationRequestError as e:
      self._reply(400, {'error': str(e)})
    except generation.SlotsBusy as e:
      self._reply(503, {'error': str(e)}, [('Retry-After', '1')])
    except generation.EngineClosed as e:
      self._reply(503, {'error': str(e)})
    except Exception as e:  # a bug: say so, keep serving the others
      logger.exception('a /generate request failed')
      self._reply(500, {'error': f'{type(e).__name__}: {e}'})
    else:
      self._reply(
          200, {
              'token_ids': list(result.token_ids),
              'finish_reason': result.finish_reason
          })


class GenerationServer(http.server.ThreadingHTTPServer):
  """A ThreadingHTTPServer whose handlers read `holder` (the engine) and
  `slot_timeout` (seconds a request waits for a slot).

  Handler threads are joined by `server_close()`: close the holder first,
  so that requests still waiting get their 503 (EngineClosed) and end."""
  daemon_threads = False
  block_on_close = True

  def __init__(self, address: Tuple[str, int], holder: EngineHolder,
               slot_timeout: float):
    super().__init__(address, GenerationHandler)
    self.holder = holder
    self.slot_timeout = slot_timeout


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text} is not an integer >= 1')
  return value


def _buckets(text: str) -> Tuple[int, ...]:
  try:
    values = tuple(int(part) for part in text.split(','))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a comma-separated list of integers') from None
  if any(v < 1 for v in values) or list(values) != sorted(set(values)):
    raise argparse.ArgumentTypeError(
        f'{text!r}: prompt buckets must be increasing integers >= 1')
  return values


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='python -m torch_xla_patches.server',
      description='A reference HTTP server generating tokens with a '
      'built-in tiny causal LM.')
  parser.add_argument('--host', default='127.0.0.1')
  parser.add_argument('--port',
                      type=int,
                      default=8000,
                      help='0 picks a free port (printed on stdout)')
  parser.add_argument('--cache-dir',
                      default=None,
                      help='serve() cache directory: a restart on the same '
                      'directory loads its captures')
  parser.add_argument('--prompt-buckets',
                      type=_buckets,
                      default=DEFAULT_PROMPT_BUCKETS,
                      help='comma-separated prompt lengths (default '
                      f'{",".join(map(str, DEFAULT_PROMPT_BUCKETS))})')
  parser.add_argument('--slots', type=_positive_int, default=DEFAULT_SLOTS)
  parser.add_argument('--max-cache-len',
                      type=_positive_int,
                      default=DEFAULT_MAX_CACHE_LEN)
  parser.add_argument('--slot-timeout',
                      type=float,
                      default=DEFAULT_SLOT_TIMEOUT,
                      help='seconds a request may wait for a free slot '
                      'before a 503')
  parser.add_argument('--dtype', choices=sorted(DTYPES), default='float32')
  parser.add_argument('--seed',
                      type=int,
                      default=BUILTIN_SEED,
                      help='the built-in model\'s weights seed')
  args = parser.parse_args(argv)
  positions = BUILTIN_CONFIG['max_position_embeddings']
  if args.max_cache_len > positions:
    parser.error(f'--max-cache-len {args.max_cache_len} is over the built-in '
                 f'model\'s {positions} positions')
  if args.prompt_buckets[-1] >= args.max_cache_len:
    parser.error(f'the largest prompt bucket ({args.prompt_buckets[-1]}) '
                 f'leaves no room for a new token in --max-cache-len '
                 f'{args.max_cache_len}')
  if not (math.isfinite(args.slot_timeout) and args.slot_timeout > 0):
    parser.error(f'--slot-timeout must be a number of seconds > 0, got '
                 f'{args.slot_timeout}')
  return args


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  logging.basicConfig(level=logging.INFO,
                      format='%(asctime)s %(name)s %(levelname)s %(message)s')
  options = EngineOptions(prompt_buckets=args.prompt_buckets,
                          slots=args.slots,
                          max_cache_len=args.max_cache_len,
                          dtype=DTYPES[args.dtype],
                          cache_dir=args.cache_dir,
                          slot_timeout=args.slot_timeout,
                          seed=args.seed)
  holder = EngineHolder()
  try:
    httpd = GenerationServer((args.host, args.port), holder, args.slot_timeout)
  except OSError as e:
    print(
        f'python -m torch_xla_patches.server: cannot listen on '
        f'{args.host}:{args.port}: {e.strerror or e}',
        file=sys.stderr)
    return 2
  host, port = httpd.server_address[:2]
  print(f'listening on http://{host}:{port}', flush=True)

  started = time.monotonic()

  def build_then_report():
    engine = holder.build(lambda: build_engine(options))
    if engine is None:
      # Nothing to serve: stop, so that a supervisor sees the exit.
      httpd.shutdown()
      return
    logger.info('engine built after %.1f s; compiling its programs',
                time.monotonic() - started)
    if engine.wait_ready():
      logger.info('ready after %.1f s', time.monotonic() - started)

  def stop(signum, frame):
    logger.info('signal %d: shutting down', signum)
    # shutdown() waits for serve_forever() to return: not from its thread.
    threading.Thread(target=httpd.shutdown, daemon=True).start()

  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  builder = threading.Thread(target=build_then_report,
                             name='engine-builder',
                             daemon=True)
  builder.start()
  try:
    httpd.serve_forever(poll_interval=0.1)
  finally:
    # Requests still waiting end with 503 (EngineClosed), then their
    # threads are joined.
    holder.close()
    httpd.server_close()
  return 1 if holder.failure is not None else 0


if __name__ == '__main__':
  sys.exit(main())

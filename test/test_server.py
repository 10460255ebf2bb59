"""The reference HTTP server (torch_xla_patches/server.py), through a real
HTTP client over loopback.

First, in this process, the endpoints over a small fake engine that follows
the engine's API (readiness, bad bodies, the engine's errors and their
statuses). Then the real server in a subprocess with the built-in model:
/live at once, /ready 503 then 200, 8 concurrent requests of mixed lengths
give eager's greedy tokens while bad requests fail alone with the reason, and
a restart on the same cache directory serves with no dynamo frame and no
compile after ready."""
import concurrent.futures
import http.client
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch

from torch_xla_patches import generation
from torch_xla_patches import server

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, 'tools'))
import server_process  # pylint: disable=g-import-not-at-top

# Bounds of every wait in this file.
HTTP_TIMEOUT = 120.0
READY_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0
POLL_SECONDS = 0.1


def request(port: int,
            method: str,
            path: str,
            body: Any = None,
            **kwargs) -> Tuple[int, Dict, Dict]:
  """server_process.request within this file's HTTP_TIMEOUT."""
  return server_process.request(port,
                                method,
                                path,
                                body,
                                timeout=HTTP_TIMEOUT,
                                **kwargs)


def get(port: int, path: str) -> Tuple[int, Dict]:
  status, payload, _ = request(port, 'GET', path)
  return status, payload


def post(port: int, body: Any) -> Tuple[int, Dict]:
  status, payload, _ = request(port, 'POST', '/generate', body)
  return status, payload


# -- The endpoints over a fake engine, in this process ----------------------


class FakeEngine:
  """GenerationEngine's API without a model: a request's token i is
  (sum(prompt) + i) % VOCAB. `ready_event` decides ready(); `slot_free`
  unset makes every request wait for a slot (then SlotsBusy); `hold` keeps
  every request pending until close() (then EngineClosed)."""
  VOCAB = 16
  BUCKETS = (4, 8)
  MAX_CACHE_LEN = 12

  def __init__(self):
    self.ready_event = threading.Event()
    self.slot_free = threading.Event()
    self.slot_free.set()
    self.hold = False
    self.held: List[concurrent.futures.Future] = []
    self.submitted: List[Tuple[Tuple[int, ...], Dict[str, Any]]] = []
    self.closed = False

  def submit(self, prompt_ids, *, max_new_tokens, timeout=None, **options):
    prompt = tuple(prompt_ids)
    if not prompt:
      raise generation.GenerationRequestError('the prompt is empty')
    if len(prompt) > self.BUCKETS[-1]:
      raise generation.GenerationRequestError(
          f'a prompt of {len(prompt)} tokens is longer than the largest '
          f'bucket, {self.BUCKETS[-1]}')
    outside = [t for t in prompt if not 0 <= t < self.VOCAB]
    if outside:
      raise generation.GenerationRequestError(
          f'token id {outside[0]} is outside the vocabulary [0, '
          f'{self.VOCAB})')
    self.submitted.append((prompt, dict(options,
                                        max_new_tokens=max_new_tokens)))
    future = concurrent.futures.Future()
    if self.hold:
      self.held.append(future)
    elif not self.slot_free.wait(timeout):
      future.set_exception(
          generation.SlotsBusy(f'all 1 slots stayed busy for {timeout} s'))
    else:
      future.set_result(
          generation.GenerationResult(token_ids=tuple(
              (sum(prompt) + i) % self.VOCAB for i in range(max_new_tokens)),
                                      finish_reason='length'))
    return future

  def ready(self):
    return self.ready_event.is_set()

  def stats(self):
    return generation.GenerationStats(programs_compiled=3,
                                      compiles_after_ready=0,
                                      prefill_programs=2,
                                      decode_programs=1,
                                      requests_done=len(self.submitted),
                                      dynamo_frames=0,
                                      loaded=True)

  def close(self):
    self.closed = True
    for future in self.held:
      future.set_exception(
          generation.EngineClosed('the GenerationEngine was closed'))


@pytest.fixture
def fake_server():
  """(port, holder, engine): a server in this process whose engine is not
  built yet; `holder.build(lambda: engine)` builds it."""
  holder = server.EngineHolder()
  httpd = server.GenerationServer(('127.0.0.1', 0), holder, slot_timeout=0.5)
  thread = threading.Thread(target=httpd.serve_forever,
                            kwargs=dict(poll_interval=POLL_SECONDS),
                            daemon=True)
  thread.start()
  try:
    yield httpd.server_address[1], holder, FakeEngine()
  finally:
    httpd.shutdown()
    holder.close()
    httpd.server_close()
    thread.join(STOP_TIMEOUT)


def test_probes_follow_the_engine(fake_server):
  port, holder, engine = fake_server
  good = {'prompt_ids': [1, 2, 3], 'max_new_tokens': 2}
  # Not built yet: alive, not ready, no generation, no stats.
  assert get(port, '/live') == (200, {'live': True})
  status, payload = get(port, '/ready')
  assert (status, payload['error']) == (503, 'the engine is being built')
  assert post(port, good)[0] == 503
  assert get(port, '/stats')[0] == 503
  # Built, compiling.
  assert holder.build(lambda: engine) is engine
  status, payload = get(port, '/ready')
  assert (status, payload['error']) == (503,
                                        'the engine is compiling its programs')
  assert post(port, good) == (503, {
      'ready': False,
      'error': 'the engine is compiling its programs'
  })
  assert get(port, '/stats')[1]['ready'] is False
  assert engine.submitted == []
  # Ready.
  engine.ready_event.set()
  assert get(port, '/ready') == (200, {'ready': True})
  assert post(port, good) == (200, {
      'token_ids': [6, 7],
      'finish_reason': 'length'
  })
  assert get(port, '/stats') == (200, {
      'programs_compiled': 3,
      'compiles_after_ready': 0,
      'prefill_programs': 2,
      'decode_programs': 1,
      'requests_done': 1,
      'dynamo_frames': 0,
      'loaded': True,
      'ready': True
  })
  assert get(port, '/live') == (200, {'live': True})
  # Closing: not ready, the engine closed.
  holder.close()
  assert engine.closed
  assert get(port, '/ready') == (503, {
      'ready': False,
      'error': 'the server is shutting down'
  })


def test_a_failed_build_is_the_readiness_reason(fake_server):
  port, holder, _ = fake_server

  def fail():
    raise RuntimeError('no device')

  assert holder.build(fail) is None
  assert get(port, '/ready') == (503, {
      'ready': False,
      'error': 'the engine could not be built: no device'
  })
  assert get(port, '/live')[0] == 200


def test_the_request_reaches_the_engine_as_submitted(fake_server):
  port, holder, engine = fake_server
  holder.build(lambda: engine)
  engine.ready_event.set()
  body = {
      'prompt_ids': [3, 4],
      'max_new_tokens': 3,
      'eos_token_id': 5,
      'stop_token_ids': [7, 8],
      'do_sample': True,
      'temperature': 0.5,
      'top_k': 4,
      'seed': 11,
  }
  assert post(port, body)[0] == 200
  # null means "the engine's default": not passed.
  assert post(port, dict(prompt_ids=[3],
                         max_new_tokens=1,
                         seed=None,
                         top_k=None))[0] == 200
  assert engine.submitted == [
      ((3, 4),
       dict(max_new_tokens=3,
            eos_token_id=5,
            stop_token_ids=(7, 8),
            do_sample=True,
            temperature=0.5,
            top_k=4,
            seed=11)),
      ((3,), dict(max_new_tokens=1)),
  ]


@pytest.mark.parametrize('body,reason', [
    (b'{"prompt_ids": [1', 'the body is not JSON'),
    (b'[1, 2]', 'the body must be a JSON object, got [1, 2]'),
    ({
        'prompt_ids': [1],
        'max_new_tokens': 1,
        'max_tokens': 3
    }, 'unknown field(s) max_tokens; accepted: prompt_ids, max_new_tokens, '
     'eos_token_id, stop_token_ids, do_sample, temperature, top_k, seed'),
    ({
        'prompt_ids': [1]
    }, 'missing field(s) max_new_tokens'),
    ({
        'prompt_ids': '1 2',
        'max_new_tokens': 1
    }, 'prompt_ids must be a list of integers, got "1 2"'),
    ({
        'prompt_ids': [1, 2.0],
        'max_new_tokens': 1
    }, 'prompt_ids must be a list of integers, got [1, 2.0]'),
    ({
        'prompt_ids': [1, True],
        'max_new_tokens': 1
    }, 'prompt_ids must be a list of integers, got [1, true]'),
    ({
        'prompt_ids': [1],
        'max_new_tokens': 1.5
    }, 'max_new_tokens must be an integer, got 1.5'),
    ({
        'prompt_ids': [1],
        'max_new_tokens': 1,
        'temperature': 0
    }, 'temperature must be a number > 0, got 0'),
    ({
        'prompt_ids': [1],
        'max_new_tokens': 1,
        'top_k': 0
    }, 'top_k must be an integer >= 1, got 0'),
    ({
        'prompt_ids': [1],
        'max_new_tokens': 1,
        'do_sample': 1
    }, 'do_sample must be true or false, got 1'),
    ({
        'prompt_ids': [],
        'max_new_tokens': 1
    }, 'the prompt is empty'),
    ({
        'prompt_ids': list(range(9)),
        'max_new_tokens': 1
    }, 'a prompt of 9 tokens is longer than the largest bucket, 8'),
    ({
        'prompt_ids': [1, 16],
        'max_new_tokens': 1
    }, 'token id 16 is outside the vocabulary [0, 16)'),
])
def test_a_bad_request_gets_400_with_the_reason(fake_server, body, reason):
  port, holder, engine = fake_server
  holder.build(lambda: engine)
  engine.ready_event.set()
  raw = body if isinstance(body, bytes) else json.dumps(body).encode()
  status, payload, _ = request(port, 'POST', '/generate', raw=raw)
  assert status == 400
  assert payload['error'].startswith(reason), payload
  # The next request is served.
  assert post(port, {'prompt_ids': [1], 'max_new_tokens': 1})[0] == 200


def test_slots_busy_past_the_timeout_is_503(fake_server):
  port, holder, engine = fake_server
  holder.build(lambda: engine)
  engine.ready_event.set()
  engine.slot_free.clear()
  status, payload, headers = request(port, 'POST', '/generate', {
      'prompt_ids': [1],
      'max_new_tokens': 1
  })
  assert (status, payload) == (503, {
      'error': 'all 1 slots stayed busy for 0.5 s'
  })
  assert headers['Retry-After'] == '1'


def test_closing_answers_the_waiting_requests(fake_server):
  port, holder, engine = fake_server
  holder.build(lambda: engine)
  engine.ready_event.set()
  engine.hold = True
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    answer = pool.submit(post, port, {'prompt_ids': [1], 'max_new_tokens': 1})
    deadline = time.monotonic() + HTTP_TIMEOUT
    while not engine.held and time.monotonic() < deadline:
      time.sleep(POLL_SECONDS)
    assert len(engine.held) == 1
    holder.close()
    assert answer.result(HTTP_TIMEOUT) == (503, {
        'error': 'the GenerationEngine was closed'
    })


def test_wrong_paths_methods_and_lengths(fake_server):
  port, holder, engine = fake_server
  holder.build(lambda: engine)
  engine.ready_event.set()
  assert get(port, '/nothing') == (404, {'error': 'no endpoint /nothing'})
  assert get(port, '/generate') == (405, {'error': 'use POST for /generate'})
  assert request(port, 'POST', '/ready', {})[:2] == (405, {
      'error': 'use GET for /ready'
  })
  # A POST without Content-Length (http.client's request() always sends one).
  connection = http.client.HTTPConnection('127.0.0.1',
                                          port,
                                          timeout=HTTP_TIMEOUT)
  try:
    connection.putrequest('POST', '/generate')
    connection.endheaders()
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())) == (411, {
        'error': 'a Content-Length header is required'
    })
  finally:
    connection.close()
  too_long = str(server.MAX_BODY_BYTES + 1)
  status, payload, _ = request(port,
                               'POST',
                               '/generate',
                               raw=b'',
                               headers={'Content-Length': too_long})
  assert (status, payload) == (413, {
      'error': f'the body has {too_long} bytes, more than the '
               f'{server.MAX_BODY_BYTES} accepted'
  })
  assert engine.submitted == []


def test_command_line_bounds():
  args = server.parse_args(['--port', '0', '--prompt-buckets', '4,8'])
  assert (args.port, args.prompt_buckets) == (0, (4, 8))
  for argv in (['--prompt-buckets',
                '8,4'], ['--prompt-buckets',
                         'a'], ['--slots',
                                '0'], ['--max-cache-len',
                                       '8'], ['--max-cache-len',
                                              '1000'], ['--slot-timeout', '0']):
    with pytest.raises(SystemExit):
      server.parse_args(argv)


def test_a_port_in_use_is_a_clear_error(capsys):
  with socket.socket() as taken:
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    port = taken.getsockname()[1]
    assert server.main(['--port', str(port)]) == 2
  assert capsys.readouterr().err == (
      f'python -m torch_xla_patches.server: cannot listen on '
      f'127.0.0.1:{port}: Address already in use\n')


# -- The real server in a subprocess ----------------------------------------
# A restart loads its captures on torch 2.9 only (torch 2.8 has no
# aot_compile: a restart traces dynamo again).

BUCKETS = (8, 16)
SLOTS = 4
MAX_CACHE_LEN = 32
NEW_TOKENS = 8
# Mixed lengths: both buckets, each bucket's edge, more requests than slots.
PROMPT_LENGTHS = (1, 3, 5, 8, 9, 12, 16, 2)


def prompts() -> List[List[int]]:
  generator = torch.Generator().manual_seed(40)
  vocab = server.BUILTIN_CONFIG['vocab_size']
  return [
      torch.randint(0, vocab, (n,), generator=generator).tolist()
      for n in PROMPT_LENGTHS
  ]


class ServerProcess(server_process.ServerProcess):
  """The server with this file's buckets, slots and cache length, strict
  (a compile after ready fails its requests: CompiledAfterReady, 500).
  `first_live` and `first_ready` are the answers of /live and /ready right
  after the port appeared."""

  def __init__(self, cache_dir: str, log_dir: str, name: str):
    super().__init__([
        '--cache-dir', cache_dir, '--prompt-buckets', ','.join(map(
            str, BUCKETS)), '--slots',
        str(SLOTS), '--max-cache-len',
        str(MAX_CACHE_LEN)
    ],
                     log_dir,
                     name,
                     env=dict(PJRT_DEVICE='CPU',
                              XLA_PATCHES_GENERATION_STRICT='1'))
    assert self.host == '127.0.0.1', self.host
    self.first_live = get(self.port, '/live')
    self.first_ready = get(self.port, '/ready')

  def wait_ready(self) -> float:
    """Seconds until /ready answered 200; every other answer is 503."""
    started = time.monotonic()
    return self.wait_for_ok('/ready', READY_TIMEOUT, other_status=503) - started


@pytest.fixture(scope='module')
def expected():
  """(prompts, eager tokens)."""
  prompt_list = prompts()
  return prompt_list, server_process.eager_tokens(prompt_list, NEW_TOKENS)


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('server_cache'))


@pytest.fixture(scope='module')
def first_server(cache_dir, tmp_path_factory):
  """The first server on an empty cache directory, stopped at the end."""
  started = None
  try:
    started = ServerProcess(cache_dir, str(tmp_path_factory.mktemp('logs')),
                            'first')
    yield started
  finally:
    if started is not None:
      started.stop()


def burst(port: int, bodies: List[Any]) -> List[Tuple[int, Dict]]:
  """Every body posted at once, each from its own thread."""
  barrier = threading.Barrier(len(bodies))

  def one(body):
    barrier.wait(HTTP_TIMEOUT)
    return post(port, body)

  with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
    return list(pool.map(one, bodies))


def test_live_at_once_ready_503_then_200(first_server):
  assert first_server.first_live == (200, {'live': True})
  assert first_server.first_ready[0] == 503
  first_server.wait_ready()
  assert get(first_server.port, '/live') == (200, {'live': True})


def test_concurrent_requests_give_eagers_tokens_and_bad_ones_fail_alone(
    first_server, expected):
  prompt_list, tokens = expected
  first_server.wait_ready()
  vocab = server.BUILTIN_CONFIG['vocab_size']
  good = [{'prompt_ids': p, 'max_new_tokens': NEW_TOKENS} for p in prompt_list]
  bad = [
      # Longer than the largest bucket.
      {
          'prompt_ids': [1] * (BUCKETS[-1] + 1),
          'max_new_tokens': 1
      },
      # A token outside the vocabulary.
      {
          'prompt_ids': [1, vocab],
          'max_new_tokens': 1
      },
      # The padded prompt and the new tokens over the cache.
      {
          'prompt_ids': [1] * 9,
          'max_new_tokens': MAX_CACHE_LEN
      },
      # Not a request.
      {
          'prompt': [1]
      },
  ]
  answers = burst(first_server.port, good + bad)
  assert answers[:len(good)] == [(200, {
      'token_ids': t,
      'finish_reason': 'length'
  }) for t in tokens], first_server.log()
  statuses = [status for status, _ in answers[len(good):]]
  reasons = [payload['error'] for _, payload in answers[len(good):]]
  assert statuses == [400] * len(bad)
  assert str(BUCKETS[-1]) in reasons[0]
  assert str(vocab) in reasons[1]
  assert str(MAX_CACHE_LEN) in reasons[2]
  assert reasons[3].startswith('unknown field(s) prompt')
  status, stats = get(first_server.port, '/stats')
  assert status == 200
  assert stats['prefill_programs'] == len(BUCKETS)
  assert stats['programs_compiled'] == (len(BUCKETS) + stats['decode_programs'])
  assert stats['compiles_after_ready'] == 0
  assert stats['requests_done'] == len(good)
  assert stats['loaded'] is False
  assert stats['ready'] is True


@pytest.mark.requires('torch_aot_compile')
def test_a_restart_serves_with_no_dynamo_frame(first_server, cache_dir,
                                               expected, tmp_path):
  prompt_list, tokens = expected
  first_server.wait_ready()
  assert first_server.stop() == 0, first_server.log()
  restarted = None
  try:
    restarted = ServerProcess(cache_dir, str(tmp_path), 'restart')
    assert restarted.first_live == (200, {'live': True})
    restarted.wait_ready()
    answers = burst(restarted.port, [{
        'prompt_ids': p,
        'max_new_tokens': NEW_TOKENS
    } for p in prompt_list[:SLOTS + 1]])
    assert answers == [(200, {
        'token_ids': t,
        'finish_reason': 'length'
    }) for t in tokens[:SLOTS + 1]], restarted.log()
    status, stats = get(restarted.port, '/stats')
    assert status == 200
    assert stats['loaded'] is True
    assert stats['dynamo_frames'] == 0
    assert stats['compiles_after_ready'] == 0
    assert stats['programs_compiled'] == (len(BUCKETS) +
                                          stats['decode_programs'])
  finally:
    if restarted is not None:
      restarted.stop()

"""GenerationEngine (generation.py): greedy tokens equal eager's unpadded
generate() for prompts of different lengths decoding together in slots,
P + 1 programs and none after ready, requests from many threads, bad
requests failing alone, sampling, and a restart with no dynamo frame."""
import functools
import json
import os
import threading

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import hf_models
import torch_xla_patches
from torch_xla_patches import (CompiledAfterReady, EngineClosed,
                               GenerationEngine, GenerationRequestError,
                               GenerationResult, SlotsBusy, config)

transformers = pytest.importorskip('transformers')

BUCKETS = (4, 8)
SLOTS = 2
CACHE = 32
VOCAB = 128


def llama(device):
  model = hf_models.build_one('llama', vocab_size=VOCAB)
  # Greedy references run to max_new_tokens; EOS is the engine's argument.
  model.generation_config.eos_token_id = None
  return model.to(device)


@functools.lru_cache(maxsize=None)
def _cpu_model():
  return llama('cpu')


@functools.lru_cache(maxsize=None)
def eager(prompt, new_tokens):
  """Eager CPU generate() of the unpadded prompt, greedy."""
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = _cpu_model().generate(ids,
                                attention_mask=torch.ones_like(ids),
                                max_new_tokens=new_tokens,
                                do_sample=False,
                                pad_token_id=0)
  return tuple(out[0, len(prompt):].tolist())


def prompt_of(length, seed):
  generator = torch.Generator().manual_seed(seed)
  return tuple(torch.randint(1, VOCAB, (length,), generator=generator).tolist())


def compiles():
  data = met.metric_data('CompileTime')
  return int(data[0]) if data else 0


@pytest.fixture(scope='module')
def engine():
  from bridge_testing import fresh
  torch_xla_patches.apply()
  fresh()
  strict = config.generation_strict
  config.generation_strict = True
  engine = GenerationEngine(llama(torch_xla.device()),
                            prompt_buckets=BUCKETS,
                            slots=SLOTS,
                            max_cache_len=CACHE)
  # The programs compile in the background (seconds each).
  assert not engine.ready()
  assert engine.wait_ready()
  yield engine
  engine.close()
  config.generation_strict = strict
  torch_xla_patches.revert()


FAMILIES = {
    'qwen2': ('Qwen2ForCausalLM', 'Qwen2Config', {}),
    'mistral':
        ('MistralForCausalLM', 'MistralConfig', dict(sliding_window=None)),
    'gpt2': ('GPT2LMHeadModel', 'GPT2Config', dict(n_positions=64)),
    'llama, eager attention': ('LlamaForCausalLM', 'LlamaConfig',
                               dict(attn_implementation='eager')),
}


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_the_slot_layout_gives_eagers_tokens_across_families(family):
  # The served module itself, eagerly on CPU: one cache object for every
  # family whose attention calls the cache's update (see [Note: Slot
  # cache]); three prompts in three slots of four, decoding together.
  from torch_xla_patches import slot_cache
  model_class, config_class, extra = FAMILIES[family]
  sizes = (hf_models.FAMILIES['gpt2'][2]
           if family == 'gpt2' else hf_models.DECODER_SIZES)
  sizes = dict(sizes, vocab_size=VOCAB, **extra)
  torch.manual_seed(0)
  model = getattr(transformers,
                  model_class)(getattr(transformers,
                                       config_class)(**sizes)).eval()
  prompts = [prompt_of(3, 1), prompt_of(6, 2), prompt_of(1, 3)]
  expected = []
  for prompt in prompts:
    ids = torch.tensor([prompt])
    with torch.no_grad():
      out = model.generate(ids,
                           attention_mask=torch.ones_like(ids),
                           max_new_tokens=5,
                           do_sample=False,
                           eos_token_id=None,
                           pad_token_id=0)
    expected.append(out[0, len(prompt):].tolist())
  cache = slot_cache.SlotCache(slot_cache.CacheShape.of(model), 4, CACHE,
                               torch.float32, 'cpu')
  decoder = slot_cache.SlotDecoder(model, cache,
                                   slot_cache.ModelCalls.of(model))
  slots = []
  got = [[] for _ in prompts]
  with torch.no_grad():
    for index, prompt in enumerate(prompts):
      padded = slot_cache.pad_prompt(prompt, BUCKETS, 0)
      ids, _ = decoder(torch.tensor([padded.token_ids]),
                       torch.tensor([padded.first_index]),
                       slot=torch.tensor([index]))
      got[index].append(int(ids[0]))
      slots.append([padded.first_index, len(padded.token_ids)])
    slots.append([0, 0])  # idle
    for _ in range(4):
      ids, _ = decoder(torch.tensor([[g[-1]] for g in got] + [[0]]),
                       torch.tensor([s[0] for s in slots]),
                       write_index=torch.tensor([s[1] for s in slots]))
      for index in range(len(prompts)):
        got[index].append(int(ids[index]))
        slots[index][1] += 1
  assert got == expected
  for layer in cache.layers:
    assert torch.isfinite(layer.keys).all() and torch.isfinite(
        layer.values).all()


def test_ready_after_p_plus_one_programs(engine):
  stats = engine.stats()
  assert engine.ready()
  assert (stats.prefill_programs, stats.decode_programs) == (2, 1)
  assert stats.programs_compiled == len(BUCKETS) + 1
  # One capture for the prompts, one for the one-token step.
  assert stats.dynamo_frames == 2
  assert not stats.loaded
  assert stats.compiles_after_ready == 0


def test_slots_decode_different_lengths_as_eager(engine):
  # Four requests in two slots: lengths 1 to 8 (both buckets), ending at
  # different steps, so two slots are reused while the other decodes, over
  # the stale entries of the request that held them.
  requests = [(prompt_of(3, 1), 9), (prompt_of(8, 2), 4), (prompt_of(1, 3), 6),
              (prompt_of(5, 4), 12)]
  futures = [engine.submit(p, max_new_tokens=n) for p, n in requests]
  for (prompt, new_tokens), future in zip(requests, futures):
    assert future.result() == GenerationResult(eager(prompt, new_tokens),
                                               'length')
  # A prompt that fills its bucket, then one padded in it, in the same slot.
  for length in (4, 2):
    prompt = prompt_of(length, 10 + length)
    assert engine.generate(prompt,
                           max_new_tokens=5).token_ids == eager(prompt, 5)
  assert engine.stats().compiles_after_ready == 0


def test_threads_get_their_own_tokens_and_nothing_compiles(engine):
  before = compiles()
  done = engine.stats().requests_done
  threads, per_thread = 4, 3
  work = [[(prompt_of(1 + (7 * t + 3 * i) % 8, 100 + 10 * t + i), 3 + i + t)
           for i in range(per_thread)]
          for t in range(threads)]
  expected = [[eager(p, n) for p, n in requests] for requests in work]
  got = [None] * threads
  barrier = threading.Barrier(threads)

  def caller(index):
    barrier.wait()
    futures = [engine.submit(p, max_new_tokens=n) for p, n in work[index]]
    got[index] = [f.result().token_ids for f in futures]

  started = [threading.Thread(target=caller, args=(t,)) for t in range(threads)]
  for thread in started:
    thread.start()
  for thread in started:
    thread.join()
  assert got == expected
  assert compiles() == before
  stats = engine.stats()
  assert stats.compiles_after_ready == 0
  assert stats.programs_compiled == len(BUCKETS) + 1
  assert stats.requests_done == done + threads * per_thread


@pytest.mark.parametrize('prompt, kwargs, message', [
    (list(range(1, 10)), {}, 'the prompt has 9 tokens, over the largest '
     'prompt bucket 8'),
    ([1, 2, 3, 4, 5], dict(max_new_tokens=25), 'the prompt padded to 8 plus '
     'max_new_tokens 25 is 33, over max_cache_len 32'),
    ([], {}, 'the prompt is empty'),
    ([1, VOCAB], {}, f'token id {VOCAB} of the prompt is outside the '
     f'vocabulary [0, {VOCAB})'),
    ([1, -1], {}, 'token id -1 of the prompt is outside'),
    ([1, 2], dict(max_new_tokens=0), 'max_new_tokens must be an integer >= 1'),
    ([1, 2], dict(do_sample=True, temperature=0.0), 'temperature must be > 0'),
    ([1, 2], dict(do_sample=True, temperature='hot'),
     "temperature must be a number, got 'hot'"),
    ([1, 2], dict(do_sample=True, seed=1.5), 'seed must be an integer'),
    (None, {}, 'prompt_ids must be a sequence of token ids, got NoneType'),
    (torch.tensor([[1, 2]]), {}, 'one sequence of token ids, got a tensor of '
     'shape (1, 2)'),
    ([1, 2.5], {}, 'the prompt holds 2.5; token ids are integers'),
])
def test_a_bad_request_fails_alone(engine, prompt, kwargs, message):
  good = prompt_of(6, 7)
  before = compiles()
  future = engine.submit(good, max_new_tokens=6)
  with pytest.raises(GenerationRequestError) as error:
    engine.submit(prompt, **dict(dict(max_new_tokens=3), **kwargs))
  assert message in str(error.value)
  assert isinstance(error.value, ValueError)
  assert future.result().token_ids == eager(good, 6)
  assert compiles() == before


def test_all_slots_busy_past_a_timeout(engine):
  long = [prompt_of(2, 20 + i) for i in range(SLOTS)]
  busy = [engine.submit(p, max_new_tokens=24) for p in long]
  waiting = engine.submit(prompt_of(3, 30), max_new_tokens=2, timeout=0.0)
  with pytest.raises(SlotsBusy) as error:
    waiting.result()
  assert isinstance(error.value, TimeoutError)
  assert str(error.value) == (f'all {SLOTS} slots stayed busy for the '
                              "request's timeout of 0.0 s")
  # The busy ones are unaffected, and a timeout long enough is served.
  patient = engine.submit(prompt_of(3, 30), max_new_tokens=2, timeout=600)
  for prompt, future in zip(long, busy):
    assert future.result().token_ids == eager(prompt, 24)
  assert patient.result().token_ids == eager(prompt_of(3, 30), 2)


def test_eos_and_stop_tokens_end_a_request(engine):
  prompt = prompt_of(5, 40)
  tokens = eager(prompt, 10)
  # The first token at index >= 2 that did not come before it.
  at = next(i for i in range(2, 10) if tokens[i] not in tokens[:i])
  eos = engine.generate(prompt, max_new_tokens=10, eos_token_id=tokens[at])
  assert eos == GenerationResult(tokens[:at + 1], 'eos')
  stop = engine.generate(prompt,
                         max_new_tokens=10,
                         stop_token_ids=[VOCAB - 1, tokens[at]])
  assert stop == GenerationResult(tokens[:at + 1], 'stop')


def test_sampling_with_a_seed_is_reproducible(engine):
  prompt = prompt_of(6, 50)
  sample = lambda seed, **kw: engine.submit(
      prompt, max_new_tokens=8, do_sample=True, seed=seed, **kw)
  first = [sample(s) for s in (1, 2, 1)]
  tokens = [f.result().token_ids for f in first]
  assert tokens[0] == tokens[2]
  assert all(0 <= t < VOCAB for t in tokens[1])
  # top_k=1 keeps the greedy token only.
  assert sample(3, top_k=1,
                temperature=0.5).result().token_ids == eager(prompt, 8)
  assert engine.stats().compiles_after_ready == 0


def test_a_compile_after_ready_is_counted_and_fails_under_strict(
    engine, monkeypatch):
  # A served call that also compiles a program of its own stands in for a
  # bucket that was not compiled before ready.
  served = engine._served
  sizes = iter(range(1000, 1100))

  def compiling(*args, **kwargs):
    result = served(*args, **kwargs)
    torch.arange(next(sizes), device=torch_xla.device()).sum().item()
    return result

  monkeypatch.setattr(engine, '_served', compiling)
  prompt = prompt_of(3, 70)
  with pytest.raises(CompiledAfterReady) as error:
    engine.generate(prompt, max_new_tokens=2)
  assert 'XLA compile(s) after ready, in a prefill step' in str(error.value)
  assert engine.stats().compiles_after_ready == 1
  monkeypatch.setattr(config, 'generation_strict', False)
  assert engine.generate(prompt, max_new_tokens=2).token_ids == eager(prompt, 2)
  # The prefill and one decode step each compiled.
  assert engine.stats().compiles_after_ready == 3
  assert met.counter_value('GenerationCompiledAfterReady') == 3
  monkeypatch.undo()
  assert engine.generate(prompt, max_new_tokens=2).token_ids == eager(prompt, 2)
  assert engine.stats().compiles_after_ready == 3


def test_a_step_that_raises_fails_its_requests_alone(engine, monkeypatch):
  served = engine._served
  calls = iter(range(100))

  def failing_once(*args, **kwargs):
    if next(calls) == 0:
      raise RuntimeError('a device error')
    return served(*args, **kwargs)

  monkeypatch.setattr(engine, '_served', failing_once)
  prompt = prompt_of(5, 80)
  with pytest.raises(RuntimeError, match='a device error'):
    engine.generate(prompt, max_new_tokens=3)
  assert engine.generate(prompt, max_new_tokens=3).token_ids == eager(prompt, 3)


def test_a_cancelled_request_is_dropped(engine):
  long = [prompt_of(2, 90 + i) for i in range(SLOTS)]
  busy = [engine.submit(p, max_new_tokens=24) for p in long]
  queued = engine.submit(prompt_of(3, 95), max_new_tokens=2)
  assert queued.cancel()
  for prompt, future in zip(long, busy):
    assert future.result().token_ids == eager(prompt, 24)
  assert engine.generate(prompt_of(3, 95), max_new_tokens=2).token_ids == eager(
      prompt_of(3, 95), 2)


def test_close_fails_what_is_pending(engine):
  futures = [
      engine.submit(prompt_of(2, 60 + i), max_new_tokens=24)
      for i in range(SLOTS + 2)
  ]
  engine.close()
  for future in futures:
    if not future.done() or future.exception() is not None:
      with pytest.raises(EngineClosed):
        future.result()
  assert any(isinstance(f.exception(), EngineClosed) for f in futures)
  with pytest.raises(EngineClosed):
    engine.submit([1, 2], max_new_tokens=2)


RESTART_SCRIPT = r'''
import json, sys
sys.path.insert(0, TEST_DIR)
import torch_xla
import torch_xla_patches
from torch_xla_patches import config
import test_generation as t
config.generation_strict = True
engine = torch_xla_patches.GenerationEngine(
    t.llama(torch_xla.device()), prompt_buckets=t.BUCKETS, slots=t.SLOTS,
    max_cache_len=t.CACHE, cache_dir=CACHE_DIR, wait=True)
futures = [engine.submit(t.prompt_of(n, n), max_new_tokens=5)
           for n in (1, 4, 7)]
tokens = [list(f.result().token_ids) for f in futures]
stats = engine.stats()
engine.close()
print(json.dumps(dict(tokens=tokens, loaded=stats.loaded,
                      frames=stats.dynamo_frames,
                      programs=stats.programs_compiled,
                      after_ready=stats.compiles_after_ready)))
'''


@pytest.mark.requires('torch_aot_compile')
def test_a_restart_loads_its_captures(tmp_path):
  # On torch 2.8 (no aot_compile) a restart traces dynamo again; the rest of
  # the engine works there as here.
  from bridge_testing import run_reports
  here = os.path.dirname(os.path.abspath(__file__))
  code = RESTART_SCRIPT.replace('TEST_DIR',
                                repr(here)).replace('CACHE_DIR',
                                                    repr(str(tmp_path)))
  first, restart = run_reports(code)
  expected = [list(eager(prompt_of(n, n), 5)) for n in (1, 4, 7)]
  assert (first['loaded'], restart['loaded']) == (False, True)
  assert (first['frames'], restart['frames']) == (2, 0)
  for report in (first, restart):
    assert report['tokens'] == expected
    assert report['programs'] == len(BUCKETS) + 1
    assert report['after_ready'] == 0


def test_close_during_the_warm_up_returns_at_once():
  engine = GenerationEngine(llama(torch_xla.device()),
                            prompt_buckets=(6,),
                            slots=1,
                            max_cache_len=CACHE)
  future = engine.submit([1, 2, 3], max_new_tokens=2)
  engine.close()
  assert not engine.ready()
  with pytest.raises(EngineClosed):
    future.result()
  # The programs go on compiling in the background (serve()'s warm-up):
  # waited for, so that no trace of it runs past the test.
  assert engine.wait_ready()

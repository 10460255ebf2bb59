"""GenerationEngine: time to ready, programs compiled, and decode throughput
of one request against `slots` requests at once, in one process (the
engine alone; tools/bench_generation.py measures the HTTP server).

  PJRT_DEVICE=CPU .venv/bin/python tools/bench_engine.py \
      [--cache-dir DIR] [--slots 4] [--new-tokens 64]

Run it twice with the same --cache-dir for a restart's row (the second run
loads the captures: 0 dynamo frames). Each throughput row is the best of
--repeats runs; compare the rows of one run only (the machine is shared).
On 2 shared cores (load ~8) at the commit adding it: first start ready in
39 s, restart 18 s (loaded, 0 dynamo frames), 4 programs = P + 1 both times,
0 compiles after ready, 4 slots 3.3x to 5.5x one request's tokens per
second (three runs; absolute tokens per second varied 4x with the load).
"""
import argparse
import json
import os
import sys
import time

import torch

import tiny_llama

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_model(device):
  return tiny_llama.build(vocab_size=256,
                          hidden_size=64,
                          intermediate_size=128,
                          num_hidden_layers=2,
                          num_attention_heads=4,
                          num_key_value_heads=2,
                          max_position_embeddings=256).to(device)


def tokens_per_second(engine, prompts, new_tokens, repeats):
  """Best generated tokens per second over `repeats` runs of `prompts`
  submitted at once (each runs to new_tokens: no EOS)."""
  # Untimed: each bucket's first call takes the full path, then learns the
  # fast one.
  for future in [engine.submit(p, max_new_tokens=new_tokens) for p in prompts]:
    future.result()
  best = 0.0
  for _ in range(repeats):
    start = time.perf_counter()
    futures = [engine.submit(p, max_new_tokens=new_tokens) for p in prompts]
    done = sum(len(f.result().token_ids) for f in futures)
    best = max(best, done / (time.perf_counter() - start))
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cache-dir', default=None)
  parser.add_argument('--slots', type=int, default=4)
  parser.add_argument('--new-tokens', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()
  # This checkout's package, wherever the tool is run from.
  sys.path.insert(0, REPO_ROOT)
  import torch_xla
  import torch_xla_patches
  model = build_model(torch_xla.device())
  buckets = (8, 16, 32)
  start = time.perf_counter()
  engine = torch_xla_patches.GenerationEngine(model,
                                              prompt_buckets=buckets,
                                              slots=args.slots,
                                              max_cache_len=32 +
                                              args.new_tokens,
                                              cache_dir=args.cache_dir,
                                              wait=True)
  ready_seconds = time.perf_counter() - start
  generator = torch.Generator().manual_seed(1)
  prompts = [
      torch.randint(0, 256, (length,), generator=generator).tolist()
      for length in (5, 12, 20, 30, 7, 16, 3, 25)[:args.slots]
  ]
  one = tokens_per_second(engine, prompts[:1], args.new_tokens, args.repeats)
  many = tokens_per_second(engine, prompts, args.new_tokens, args.repeats)
  stats = engine.stats()
  engine.close()
  print(
      json.dumps(
          dict(ready_seconds=round(ready_seconds, 1),
               loaded=stats.loaded,
               dynamo_frames=stats.dynamo_frames,
               programs_compiled=stats.programs_compiled,
               expected_programs=len(buckets) + 1,
               compiles_after_ready=stats.compiles_after_ready,
               tokens_per_second_one=round(one, 1),
               tokens_per_second_slots=round(many, 1),
               slots=args.slots,
               ratio=round(many / one, 2))))


if __name__ == '__main__':
  main()

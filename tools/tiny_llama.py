"""Tiny Llama causal LMs built in code for the tools (nothing downloaded):
one way to build them, so that a tool's eager reference and its compiled
copy start from the same weights."""
import torch

# The tools' tiny Llama: 2 layers, hidden 32, grouped-query attention
# (4 heads, 2 key/value heads), no end-of-sequence token (generations run
# their full length).
CONFIG = dict(vocab_size=96,
              hidden_size=32,
              intermediate_size=64,
              num_hidden_layers=2,
              num_attention_heads=4,
              num_key_value_heads=2,
              eos_token_id=None)


def build(seed: int = 0, **config) -> torch.nn.Module:
  """A LlamaForCausalLM of `config` (LlamaConfig's arguments) on the CPU,
  in eval mode, its weights drawn after torch.manual_seed(seed)."""
  import transformers
  llama_config = transformers.LlamaConfig(**config)
  torch.manual_seed(seed)
  return transformers.LlamaForCausalLM(llama_config).eval()

"""Tiny Llama causal LMs built in code for the tools (nothing downloaded):
one way to build them, so that a tool's eager reference and its compiled
copy start from the same weights."""
import torch


def build(seed: int = 0, **config) -> torch.nn.Module:
  """A LlamaForCausalLM of `config` (LlamaConfig's arguments) on the CPU,
  in eval mode, its weights drawn after torch.manual_seed(seed)."""
  import transformers
  llama_config = transformers.LlamaConfig(**config)
  torch.manual_seed(seed)
  return transformers.LlamaForCausalLM(llama_config).eval()

"""Tiny Hugging Face models built in code (nothing downloaded), with the CPU
copy each test compares against."""
import torch
import torch_xla

# name -> (model class, config class, config kwargs, takes use_cache)
FAMILIES = {
    'gpt2': ('GPT2LMHeadModel', 'GPT2Config',
             dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                  n_positions=64), True),
    'llama': ('LlamaForCausalLM', 'LlamaConfig',
              dict(vocab_size=64,
                   hidden_size=32,
                   intermediate_size=64,
                   num_hidden_layers=2,
                   num_attention_heads=4,
                   num_key_value_heads=2,
                   max_position_embeddings=64), True),
    'qwen2': ('Qwen2ForCausalLM', 'Qwen2Config',
              dict(vocab_size=64,
                   hidden_size=32,
                   intermediate_size=64,
                   num_hidden_layers=2,
                   num_attention_heads=4,
                   num_key_value_heads=2,
                   max_position_embeddings=64), True),
    'bert': ('BertModel', 'BertConfig',
             dict(vocab_size=64,
                  hidden_size=32,
                  num_hidden_layers=2,
                  num_attention_heads=2,
                  intermediate_size=64,
                  max_position_embeddings=64), False),
    't5_encoder': ('T5EncoderModel', 'T5Config',
                   dict(vocab_size=64,
                        d_model=32,
                        d_kv=8,
                        d_ff=64,
                        num_layers=2,
                        num_heads=4), False),
}


def build(family: str, seed: int = 0, **overrides):
  """(cpu model, XLA model) of one family, equal weights, eval mode."""
  import transformers
  model_class, config_class, config_kwargs, _ = FAMILIES[family]
  config = getattr(transformers,
                   config_class)(**dict(config_kwargs, **overrides))
  torch.manual_seed(seed)
  cpu = getattr(transformers, model_class)(config).eval()
  model = getattr(transformers, model_class)(config).eval()
  model.load_state_dict(cpu.state_dict())
  return cpu, model.to(torch_xla.device())


def extra_kwargs(family: str):
  """Constant keyword arguments of every call: no KV cache object."""
  return {'use_cache': False} if FAMILIES[family][3] else {}


def first_output(output):
  """The logits or last hidden state of a ModelOutput."""
  return output[0]

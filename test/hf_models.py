"""Tiny Hugging Face models built in code (nothing downloaded), with the CPU
copy each test compares against."""
import torch
import torch_xla

# The sizes of the tiny decoders (Llama, Qwen2, Mistral, ...): every test
# that compares tokens or logits with eager builds them from these.
DECODER_SIZES = dict(vocab_size=64,
                     hidden_size=32,
                     intermediate_size=64,
                     num_hidden_layers=2,
                     num_attention_heads=4,
                     num_key_value_heads=2,
                     max_position_embeddings=64)

# name -> (model class, config class, config kwargs, takes use_cache)
FAMILIES = {
    'gpt2': ('GPT2LMHeadModel', 'GPT2Config',
             dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                  n_positions=64), True),
    'llama': ('LlamaForCausalLM', 'LlamaConfig', DECODER_SIZES, True),
    'qwen2': ('Qwen2ForCausalLM', 'Qwen2Config', DECODER_SIZES, True),
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


def config(family: str, **overrides):
  """The family's tiny config, with `overrides`."""
  import transformers
  _, config_class, config_kwargs, _ = FAMILIES[family]
  return getattr(transformers, config_class)(**dict(config_kwargs, **overrides))


def build_one(family: str, device='cpu', seed: int = 0, **overrides):
  """One model of the family, weights from `seed`, eval mode, on
  `device`."""
  import transformers
  model_config = config(family, **overrides)
  torch.manual_seed(seed)
  model_class = FAMILIES[family][0]
  return getattr(transformers, model_class)(model_config).eval().to(device)


def build(family: str, seed: int = 0, **overrides):
  """(cpu model, XLA model) of one family, equal weights, eval mode."""
  import transformers
  model_config = config(family, **overrides)
  model_class = getattr(transformers, FAMILIES[family][0])
  torch.manual_seed(seed)
  cpu = model_class(model_config).eval()
  model = model_class(model_config).eval()
  model.load_state_dict(cpu.state_dict())
  return cpu, model.to(torch_xla.device())


def extra_kwargs(family: str):
  """Constant keyword arguments of every call: no KV cache object."""
  return {'use_cache': False} if FAMILIES[family][3] else {}


def first_output(output):
  """The logits or last hidden state of a ModelOutput."""
  return output[0]

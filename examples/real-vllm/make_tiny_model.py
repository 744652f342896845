"""A tiny random-weight Llama (2 layers, 256 wide, head size 64: the smallest vLLM's CPU
attention takes) with a byte-level BPE tokenizer trained here on the chain client's words and a
chat template: a model vLLM serves without downloading anything. Its answers are noise; the
timings and the wire are vLLM's own.

    make_tiny_model.py OUT_DIR      (transformers, tokenizers and torch: vLLM's venv has them)
"""
import json, pathlib, random, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import torch

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
words = ("service request latency queue token cache prefix block engine scheduler batch decode prefill kernel stream "
         "socket buffer memory thread process worker client server response header chunk payload protocol message "
         "plan write review refactor test code file bug edge case the a of to and in is you are careful senior "
         "software engineer working as an autonomous coding agent task build small tool that handles").split()
corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(2000)]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
specials = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(corpus, trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>")
fast.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
fast.save_pretrained(out)
cfg = LlamaConfig(vocab_size=len(fast), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                  bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, torch_dtype="float32")
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
print("tiny model in", out, "vocab", len(fast))

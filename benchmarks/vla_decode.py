"""Action-chunk latency: OFT parallel decoding vs autoregressive decoding of the same tokens.

Both decode one chunk of 8 x 7 = 56 action tokens from the same model and inputs (vision
encoding and prompt included): parallel decoding in one forward pass over 56 zero slots
(OpenVLA-OFT), autoregressive decoding as one prefill plus 55 KV-cached steps that feed back
each chosen token (original OpenVLA). Greedy choice in both; medians over repeated runs.

Runs a tiny model on the CPU (the checkpoint layout of policies.openvla_oft.tiny, 224px images,
fused DINOv2 + SigLIP backbones), and a 7B-shaped model (random bf16 weights, real OpenVLA
sizes) when CUDA is available.

    flock /tmp/bench.lock python benchmarks/vla_decode.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies.openvla_oft.checkpoint import default_dtype, from_pretrained  # noqa: E402
from policies.openvla_oft.config import VLAConfig  # noqa: E402
from policies.openvla_oft.decoding import ActionSampler, parallel_decode, sequential_decode  # noqa: E402
from policies.openvla_oft.model import OpenVLAOFT, PromptInputs  # noqa: E402
from policies.openvla_oft.preprocess import normalize_images  # noqa: E402
from policies.openvla_oft.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402

CHUNKS, ACTION_DIM = 8, 7
PROMPT_TOKENS = 24  # a typical task prompt ("In: What action ... Out:" + "▁")


def inputs_for(model: OpenVLAOFT, batch: int, device: torch.device) -> PromptInputs:
    gen = torch.Generator().manual_seed(0)
    size = model.config.image_size
    images = torch.randint(0, 256, (batch, 1, 3, size, size), generator=gen, dtype=torch.uint8)
    ids = torch.randint(3, model.action_tokenizer.first_token_id, (batch, 1 + PROMPT_TOKENS), generator=gen)
    ids[:, 0] = 1
    mask = torch.ones_like(ids, dtype=torch.bool)
    pixels = normalize_images(images, model.config.vit_specs)
    return PromptInputs(ids.to(device), mask.to(device), pixels.to(device))


def median_ms(fn, repeats: int, sync) -> float:
    fn()  # warm-up (kernels, allocator)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.no_grad()
def measure(model: OpenVLAOFT, batch: int, repeats: int, device: torch.device) -> dict:
    inputs = inputs_for(model, batch, device)
    greedy = ActionSampler(do_sample=False)
    n = CHUNKS * ACTION_DIM
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    par = median_ms(lambda: parallel_decode(model, inputs, n, greedy), repeats, sync)
    ar = median_ms(lambda: sequential_decode(model, inputs, n, greedy, feed_tokens=True), repeats, sync)
    return {
        "batch": batch, "parallel_ms": round(par, 2), "autoregressive_ms": round(ar, 2), "ratio": round(ar / par, 2)
    }


def seven_b_model(device: torch.device) -> OpenVLAOFT:
    """OpenVLA-7B's shapes (DINOv2 ViT-L + SigLIP SO400M at 224px, Llama-2 7B) with random bf16 weights."""
    raw = tiny_config()
    raw.pop("timm_arch_overrides")
    raw["image_sizes"] = [224, 224]
    raw["pad_token_id"] = 32000
    raw["text_config"] = {"model_type": "llama", "pad_token_id": 32000, "vocab_size": 32064}
    with torch.device(device), default_dtype(torch.bfloat16):
        return OpenVLAOFT(VLAConfig.from_dict(raw, "7B-shaped config")).eval()


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'batch':>5} | {'parallel (ms)':>13} | {'autoregressive (ms)':>19} | {'AR / parallel':>13}")
    for r in rows:
        print(f"{r['batch']:>5} | {r['parallel_ms']:>13.2f} | {r['autoregressive_ms']:>19.2f} | {r['ratio']:>12.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    config = tiny_config(image_size=224, vit_dims=(64, 96), vit_depth=4, llm_hidden=128, llm_layers=4)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = from_pretrained(write_tiny_checkpoint(tmp, config=config)).eval()
    print(f"tiny model: {sum(p.numel() for p in tiny.parameters()) / 1e6:.2f}M parameters, "
          f"{tiny.vision_backbone.num_patches} patches/image, {torch.get_num_threads()} CPU threads")
    cpu_rows = [measure(tiny, b, args.repeats, cpu) for b in (1, 8)]
    print_table("CPU, tiny model: one action chunk of 8 x 7 tokens (median)", cpu_rows)

    gpu = None
    if torch.cuda.is_available():
        del tiny
        cuda = torch.device("cuda")
        model = seven_b_model(cuda)
        gpu_rows = [measure(model, b, args.repeats, cuda) for b in (1, 8)]
        print_table(f"GPU ({torch.cuda.get_device_name()}), 7B-shaped bf16 model (median)", gpu_rows)
        gpu = {
            "device": torch.cuda.get_device_name(),
            "rows": gpu_rows,
            "parallel_vs_autoregressive": gpu_rows[0]["ratio"],
        }
    else:
        print("\nGPU, 7B-shaped model: skipped (no CUDA device)")

    print(json.dumps({
        "benchmark": "vla_decode",
        "tokens": CHUNKS * ACTION_DIM,
        "cpu_tiny": cpu_rows,
        "gpu_7b": gpu,
        "parallel_vs_autoregressive": cpu_rows[0]["ratio"],
    }))


if __name__ == "__main__":
    main()

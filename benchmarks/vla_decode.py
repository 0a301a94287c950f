"""Action-chunk latency: OFT parallel decoding vs autoregressive decoding of the same tokens,
and OFT's L1-regression head vs discrete parallel decoding.

Both decoders produce one chunk of 8 x 7 = 56 action tokens from the same model and inputs
(vision encoding and prompt included): parallel decoding in one forward pass over 56 zero slots
(OpenVLA-OFT), autoregressive decoding as one prefill plus 55 KV-cached steps that feed back
each chosen token (original OpenVLA). Greedy choice in both; medians over repeated runs.
The L1 head reads the same 56 hidden states of one forward pass and maps them to the chunk's
continuous actions with its MLP (no sampling), instead of logits over the 256 action rows.

Runs a tiny model on the CPU (the checkpoint layout of policies.openvla_oft.tiny, 224px images,
fused DINOv2 + SigLIP backbones), and a 7B-shaped model (random bf16 weights, real OpenVLA
sizes) when CUDA is available.

    flock /tmp/cpu.lock python benchmarks/vla_decode.py [--repeats 10]

With CUDA it also reports, for the 7B-shaped model, each head's peak memory and the peak memory
of one LoRA (rank 32) training step through the L1 head.
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


def paired_median_ms(fns, repeats: int, sync) -> list[float]:
    """Median ms of each function, timed in turn within every repeat."""
    for fn in fns:
        fn()  # warm-up
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            out.append(1000 * (time.perf_counter() - start))
    return [statistics.median(t) for t in times]


@torch.no_grad()
def measure_heads(model: OpenVLAOFT, batch: int, repeats: int, device: torch.device) -> dict:
    """Discrete parallel decoding (argmax over the action rows) vs the L1 head, same forward pass."""
    inputs = inputs_for(model, batch, device)
    n = CHUNKS * ACTION_DIM
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    head, greedy = model.action_head, ActionSampler(do_sample=False)

    def discrete_decode():
        model.action_head = None  # the same network without its head decodes tokens
        try:
            return parallel_decode(model, inputs, n, greedy)
        finally:
            model.action_head = head

    def l1_decode():
        return model(inputs, n).actions

    # alternate the two, so that load from other processes weighs on both alike
    discrete, l1 = paired_median_ms([discrete_decode, l1_decode], repeats, sync)
    discrete_mem, l1_mem = peak_memory(discrete_decode, device), peak_memory(l1_decode, device)
    row = {"batch": batch, "discrete_ms": round(discrete, 2), "l1_ms": round(l1, 2), "ratio": round(discrete / l1, 2)}
    if device.type == "cuda":
        row |= {"discrete_peak_gib": discrete_mem, "l1_peak_gib": l1_mem}
    return row


def peak_memory(fn, device: torch.device) -> float | None:
    """Peak GiB allocated while ``fn`` runs (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def lora_step_peak(model: OpenVLAOFT, batch: int, device: torch.device) -> float:
    """Peak GiB of one LoRA training step (forward, L1 loss on the head's actions, backward, Adam)."""
    from policies.lora import apply_lora
    from policies.openvla_oft.policy import lora_targets

    peft_model = apply_lora(model, lora_targets(model), rank=32, alpha=16)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    inputs = inputs_for(model, batch, device)
    torch.cuda.reset_peak_memory_stats()
    actions = model(inputs, CHUNKS * ACTION_DIM).actions
    actions.abs().mean().backward()
    optimizer.step()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


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
    """OpenVLA-7B's shapes (DINOv2 ViT-L + SigLIP SO400M at 224px, Llama-2 7B) with random bf16
    weights, and OFT's L1-regression head."""
    raw = tiny_config()
    raw.pop("timm_arch_overrides")
    raw["image_sizes"] = [224, 224]
    raw["pad_token_id"] = 32000
    raw["text_config"] = {"model_type": "llama", "pad_token_id": 32000, "vocab_size": 32064}
    with torch.device(device), default_dtype(torch.bfloat16):
        return OpenVLAOFT(VLAConfig.from_dict(raw, "7B-shaped config"), l1_action_dim=ACTION_DIM).eval()


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'batch':>5} | {'parallel (ms)':>13} | {'autoregressive (ms)':>19} | {'AR / parallel':>13}")
    for r in rows:
        print(f"{r['batch']:>5} | {r['parallel_ms']:>13.2f} | {r['autoregressive_ms']:>19.2f} | {r['ratio']:>12.2f}x")


def print_heads(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'batch':>5} | {'discrete (ms)':>13} | {'L1 head (ms)':>12} | {'discrete / L1':>13}")
    for r in rows:
        print(f"{r['batch']:>5} | {r['discrete_ms']:>13.2f} | {r['l1_ms']:>12.2f} | {r['ratio']:>12.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    config = tiny_config(image_size=224, vit_dims=(64, 96), vit_depth=4, llm_hidden=128, llm_layers=4)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = from_pretrained(write_tiny_checkpoint(tmp, config=config, l1_head=True),
                               action_head="l1_regression").eval()
    head = tiny.action_head
    print(f"tiny model: {sum(p.numel() for p in tiny.parameters()) / 1e6:.2f}M parameters "
          f"(L1 head {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M), "
          f"{tiny.vision_backbone.num_patches} patches/image, {torch.get_num_threads()} CPU threads")
    tiny.action_head = None
    cpu_rows = [measure(tiny, b, args.repeats, cpu) for b in (1, 8)]
    tiny.action_head = head
    print_table("CPU, tiny model: one action chunk of 8 x 7 tokens (median)", cpu_rows)
    cpu_heads = [measure_heads(tiny, b, args.repeats, cpu) for b in (1, 8)]
    print_heads("CPU, tiny model: L1-regression head vs discrete parallel decoding (median)", cpu_heads)

    gpu = None
    if torch.cuda.is_available():
        del tiny
        cuda = torch.device("cuda")
        model = seven_b_model(cuda)
        head, model.action_head = model.action_head, None
        gpu_rows = [measure(model, b, args.repeats, cuda) for b in (1, 8)]
        model.action_head = head
        print_table(f"GPU ({torch.cuda.get_device_name()}), 7B-shaped bf16 model (median)", gpu_rows)
        gpu_heads = [measure_heads(model, b, args.repeats, cuda) for b in (1, 8)]
        print_heads(f"GPU ({torch.cuda.get_device_name()}), 7B-shaped bf16: L1 head vs discrete", gpu_heads)
        lora_peak = lora_step_peak(model, 1, cuda)
        print(f"one LoRA (rank 32) training step at batch 1: peak {lora_peak} GiB")
        gpu = {
            "device": torch.cuda.get_device_name(),
            "rows": gpu_rows,
            "heads": gpu_heads,
            "lora_step_peak_gib": lora_peak,
            "parallel_vs_autoregressive": gpu_rows[0]["ratio"],
        }
    else:
        print("\nGPU, 7B-shaped model: skipped (no CUDA device)")

    print(json.dumps({
        "benchmark": "vla_decode",
        "tokens": CHUNKS * ACTION_DIM,
        "cpu_tiny": cpu_rows,
        "cpu_tiny_heads": cpu_heads,
        "gpu_7b": gpu,
        "parallel_vs_autoregressive": cpu_rows[0]["ratio"],
        "discrete_vs_l1": cpu_heads[0]["ratio"],
    }))


if __name__ == "__main__":
    main()

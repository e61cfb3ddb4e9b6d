"""Bytes a sharded executor moves per decode and training step on GPUs, projected from model shapes.

No measurement here: arithmetic on the shapes of Llama-2-13B, Llama-2-70B (and Gemma2-27B, for the
paper's Figure 17), in bf16, for N = 2, 4, 8 ranks, under both strategies (``symbiosis/sharding``):

* ``layers``: weights never move; the rows of a call for a layer another rank owns travel there
  and back. A client talks to one rank, so with layers spread evenly (N-1)/N of its calls are
  relayed: per token, per call, ``in + out`` elements (forward), the same again in backward.
* ``fsdp``: every rank keeps 1/N of each layer's rows; to run a layer, the rank gathers the other
  (N-1)/N (an all-gather: every rank receives that much). A decode step runs every layer once, a
  training step twice (the executor is stateless, so backward gathers again); rows of all the
  clients that reach a layer together share one gather.

Times are lower bounds from bandwidth alone (``--link-gbps``: NVLink-class all-gather and p2p
bandwidth; ``--pcie-gbps``: PCIe-class), plus, for ``layers``, the relayed calls times the
per-call relay cost measured on this CPU host (``benchmarks/sharded.py``'s JSON, if given).

    python -m benchmarks.sharded_projection --measured docs/benchmarks/sharded/sharded.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

BF16 = 2


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    q_out: int  # heads x head_dim
    kv_out: int  # kv_heads x head_dim, for k and for v each
    intermediate: int
    vocab: int

    def layer_params(self) -> int:
        h = self.hidden
        return h * self.q_out + 2 * h * self.kv_out + self.q_out * h + 3 * h * self.intermediate

    def base_params(self) -> int:
        """Every base layer (the executor's weights): decoder layers and lm_head."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def calls_per_token(self) -> int:
        """Base-layer requests per token with sibling fusion (q/k/v and gate/up fused): 4 per layer + lm_head."""
        return 4 * self.layers + 1

    def activation_elements_per_token(self) -> int:
        """``in + out`` elements of every base-layer call of one token's forward pass."""
        h, i = self.hidden, self.intermediate
        per_layer = (h + self.q_out + 2 * self.kv_out) + (self.q_out + h) + (h + 2 * i) + (i + h)
        return self.layers * per_layer + h + self.vocab


MODELS = {
    "Llama-2-13B": Shape(hidden=5120, layers=40, q_out=5120, kv_out=5120, intermediate=13824, vocab=32000),
    "Llama-2-70B": Shape(hidden=8192, layers=80, q_out=8192, kv_out=1024, intermediate=28672, vocab=32000),
    "Gemma2-27B": Shape(hidden=4608, layers=46, q_out=4096, kv_out=2048, intermediate=36864, vocab=256000),
}


def project(shape: Shape, ranks: int, decode_batch: int, train_tokens: int) -> dict:
    """Bytes per step, per rank, under each strategy (see module doc)."""
    weights = shape.base_params() * BF16
    remote = (ranks - 1) / ranks
    per_token = shape.activation_elements_per_token() * BF16
    return {
        "weights_per_rank_bytes": weights / ranks,
        "layers": {
            "decode_bytes": remote * decode_batch * per_token,
            "decode_relayed_calls": remote * shape.calls_per_token(),
            "train_bytes": remote * train_tokens * 2 * per_token,
            "train_relayed_calls": remote * 2 * shape.calls_per_token(),
        },
        "fsdp": {"decode_bytes": remote * weights, "train_bytes": 2 * remote * weights},
    }


def table(args: argparse.Namespace) -> str:
    relay_us = _measured_relay_us(args.measured)
    link, pcie = args.link_gbps * 1e9, args.pcie_gbps * 1e9
    rows = [
        f"Decode step: {args.decode_batch} sequences, one token each. Training step: {args.train_tokens} tokens "
        f"(batch 2 x 512, as Figures 15-16). bf16. Times: bytes / {args.link_gbps:g} GB/s (NVLink-class) and / "
        f"{args.pcie_gbps:g} GB/s (PCIe-class)"
        + (f"; relayed calls x {relay_us:.0f} µs (the relay cost measured here, CPU, ZeroMQ)." if relay_us else "."),
        "",
        "| model | N | weights/rank | layers: decode bytes (relayed calls) | fsdp: decode bytes/rank | "
        "layers: train bytes | fsdp: train bytes/rank | decode time layers / fsdp (NVLink) | "
        "train time layers / fsdp (NVLink; PCIe) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("Llama-2-13B", "Llama-2-70B"):
        for ranks in (2, 4, 8):
            p = project(MODELS[name], ranks, args.decode_batch, args.train_tokens)
            lay, fs = p["layers"], p["fsdp"]
            lay_decode_s = lay["decode_bytes"] / link + lay["decode_relayed_calls"] * (relay_us or 0) * 1e-6
            lay_train_s = lay["train_bytes"] / link + lay["train_relayed_calls"] * (relay_us or 0) * 1e-6
            rows.append(
                f"| {name} | {ranks} | {_gb(p['weights_per_rank_bytes'])} | {_mb(lay['decode_bytes'])} "
                f"({lay['decode_relayed_calls']:.0f}) | {_gb(fs['decode_bytes'])} | {_gb(lay['train_bytes'])} | "
                f"{_gb(fs['train_bytes'])} | {_ms(lay_decode_s)} / {_ms(fs['decode_bytes'] / link)} | "
                f"{_ms(lay_train_s)} / {_ms(fs['train_bytes'] / link)}; {_ms(lay['train_bytes'] / pcie)} / "
                f"{_ms(fs['train_bytes'] / pcie)} |"
            )
    gemma = project(MODELS["Gemma2-27B"], 8, 1, 128)
    rows += [
        "",
        f"Figure 17's baseline (FSDP over 8 GPUs, Gemma2-27B, batch 2 x 64): each rank gathers "
        f"{_gb(gemma['fsdp']['train_bytes'])} per iteration (forward and backward); at 32 tokens/s (4 s per "
        f"128-token iteration) that is {gemma['fsdp']['train_bytes'] / 4.0 / 1e9:.0f} GB/s, a PCIe-class link.",
    ]
    return "\n".join(rows)


def _measured_relay_us(path: Path | None) -> float | None:
    """Extra µs of a call relayed to another rank (``layers``, N=2) over one rank 0 runs itself."""
    if path is None or not path.is_file():
        return None
    costs = json.loads(path.read_text())["call_costs"]["median_us"]
    return costs["N=2 layers | another rank's layer"] - costs["N=2 layers | rank 0's layer"]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--measured", type=Path, default=None, help="benchmarks/sharded.py's JSON: per-call relay cost."
    )
    parser.add_argument(
        "--decode-batch", type=int, default=8, help="Sequences decoding together (one token each per step)."
    )
    parser.add_argument(
        "--train-tokens", type=int, default=1024, help="Tokens of one training step (default: 2 x 512)."
    )
    parser.add_argument("--link-gbps", type=float, default=200.0, help="NVLink-class bandwidth, GB/s.")
    parser.add_argument("--pcie-gbps", type=float, default=20.0, help="PCIe-class bandwidth, GB/s.")
    text = table(parser.parse_args(argv))
    print(text)
    return text


if __name__ == "__main__":
    main()

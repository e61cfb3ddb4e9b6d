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
    """Bytes per step under each way of running (see module doc): ``client`` is what clients and
    executor exchange whatever the sharding (as with one executor); the rest is what sharding adds."""
    weights = shape.base_params() * BF16
    remote = (ranks - 1) / ranks
    per_token = shape.activation_elements_per_token() * BF16
    return {
        "weights_per_rank_bytes": weights / ranks,
        "client": {"decode_bytes": decode_batch * per_token, "train_bytes": train_tokens * 2 * per_token},
        "routed": {"decode_bytes": 0.0, "train_bytes": 0.0},  # each call goes to its owner directly
        "relayed": {
            "decode_bytes": remote * decode_batch * per_token,
            "decode_calls": remote * shape.calls_per_token(),
            "train_bytes": remote * train_tokens * 2 * per_token,
            "train_calls": remote * 2 * shape.calls_per_token(),
        },
        "fsdp": {"decode_bytes": remote * weights, "train_bytes": 2 * remote * weights},
    }


def table(args: argparse.Namespace) -> str:
    relay_us = _measured_relay_us(args.measured) or 0.0
    link, hbm = args.link_gbps * 1e9, args.hbm_gbps * 1e9
    rows = [
        f"Decode step: {args.decode_batch} sequences, one token each; training step: {args.train_tokens} tokens "
        f"(batch 2 x 512, as Figures 15-16); bf16. Added time = bytes / {args.link_gbps:g} GB/s (NVLink-class), "
        f"plus, for relayed calls, {relay_us:.0f} µs each (the relay cost measured here: CPU, ZeroMQ). "
        f"For scale, a rank streams its weights from HBM once per decode step: weights / {args.hbm_gbps:g} GB/s.",
        "",
        "| model | N | weights/rank (HBM read per decode step) | client<->executor per decode step | "
        "added per decode step: layers routed / relayed / fsdp | "
        "added per training step: layers routed / relayed / fsdp |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("Llama-2-13B", "Llama-2-70B"):
        for ranks in (2, 4, 8):
            p = project(MODELS[name], ranks, args.decode_batch, args.train_tokens)
            rel, fs = p["relayed"], p["fsdp"]
            rel_decode_s = rel["decode_bytes"] / link + rel["decode_calls"] * relay_us * 1e-6
            rel_train_s = rel["train_bytes"] / link + rel["train_calls"] * relay_us * 1e-6
            rows.append(
                f"| {name} | {ranks} | {_gb(p['weights_per_rank_bytes'])} ({_ms(p['weights_per_rank_bytes'] / hbm)}) "
                f"| {_mb(p['client']['decode_bytes'])} "
                f"| 0 / {_mb(rel['decode_bytes'])} in {rel['decode_calls']:.0f} calls, {_ms(rel_decode_s)} "
                f"/ {_gb(fs['decode_bytes'])}, {_ms(fs['decode_bytes'] / link)} "
                f"| 0 / {_gb(rel['train_bytes'])}, {_ms(rel_train_s)} / {_gb(fs['train_bytes'])}, "
                f"{_ms(fs['train_bytes'] / link)} |"
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
    """Extra µs of a call relayed to another rank (``layers``, N=2) over one sent to it directly."""
    if path is None or not path.is_file():
        return None
    costs = json.loads(path.read_text())["call_costs"]["median_us"]
    return costs["N=2 layers | another rank's layer, relayed"] - costs["N=2 layers | another rank's layer, routed"]


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
    parser.add_argument("--hbm-gbps", type=float, default=2000.0, help="GPU memory bandwidth, GB/s (A100-80GB class).")
    text = table(parser.parse_args(argv))
    print(text)
    return text


if __name__ == "__main__":
    main()

"""The model check after each round: a fixed probe through the producer's model and the consumer's, compared.

The producer runs ``probe_token_ids`` through its model and sends its logits (every ``stride``-th vocabulary column)
and greedy next tokens with :func:`encode_probe`; the consumer runs the same ids through its own model and compares
(``refit_app.models.hf.ModelSink.check``), within :data:`LOGIT_TOLERANCE`.
"""

from __future__ import annotations

import json
import math
import struct

import torch

from refit_app.common.errors import VerificationError
from refit_app.models.defaults import DEFAULT_PROBE_TOKENS  # noqa: F401 - re-exported for the sinks

PROBE_SEED = 20240601
"""Seed of the probe's token ids; the ids also travel in the probe, so the two sides never depend on agreeing RNGs."""
MAX_PROBE_COLUMNS = 4096
"""The probe carries every ``stride``-th vocabulary column of the logits, at most this many per position.

All columns of a tiny model (vocab <= 4096) travel, so ``max_abs_logit_diff`` is exact there. A real vocabulary
(128k) would make the probe 8 MiB per 16 positions; a strided sample of 4096 columns still sees any wrong weight
upstream of the LM head (it moves every logit), and the greedy tokens are compared over the full vocabulary on
each side, which covers the head's own rows where it matters.
"""

LOGIT_TOLERANCE: dict[torch.dtype, float] = {
    # Relative to the probe's largest |logit| (floored at 1.0): the check passes when
    #   max_abs_logit_diff <= LOGIT_TOLERANCE[dtype] * max(1.0, max |producer logit|).
    # Same weights, same build, same host and thread count give bit-identical logits (the tests assert 0.0).
    # Not zero because producer and consumer need not run the same kernels: another thread count, CPU ISA
    # (AVX2 vs AVX-512), attention implementation or a GPU reorders every matmul's reductions, and each order
    # rounds differently, a few units in the last place of the compute dtype compounded over the layers.
    # Measured on a random 6-layer Llama (hidden 512, vocab 8192, 64 probe tokens), sdpa vs eager attention,
    # 1 vs 2 threads, as a fraction of the largest logit: float32 2e-6, float16 3.4e-3, bfloat16 2.7e-2
    # (bfloat16 keeps 8 significant bits: one intermediate rounding the other way moves a logit by ~0.4%).
    # Each bound is about 3x (16-bit) to 50x (float32) above that, and below what a wrong load does there:
    # a transposed q_proj moved the logits by 20%, a zeroed v_proj 29%, swapped down_proj 91%, a norm
    # scaled by 1.1 10%. A flipped low-order bit is below any logit tolerance: bit-exactness is what the
    # per-tensor checksums (sink=verify) are for.
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 8e-2,
}
"""Unknown dtypes (float8 weights, computed in a wider type) get bfloat16's bound."""
_PROBE_HEADER = struct.Struct("<Q")


def forward_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float32 logits on CPU, in eval mode without autograd (``no_grad``, not
    ``inference_mode``: a model sharded under FSDP2 gathers its weights into buffers that its training steps write
    in place later, which an inference-mode forward would leave as inference tensors)."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0]
    finally:
        model.train(was_training)
    return logits.float().cpu()


def probe_token_ids(vocab: int, probe_tokens: int) -> list[int]:
    """The fixed probe input: ``probe_tokens`` ids drawn with ``PROBE_SEED``."""
    if probe_tokens < 1:
        raise ValueError(f"probe_tokens={probe_tokens} must be at least 1")
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab, (probe_tokens,), generator=g).tolist()


def logit_tolerance(dtype: torch.dtype, max_abs_logit: float) -> float:
    """The largest ``max_abs_logit_diff`` accepted for a model computing in ``dtype`` (see ``LOGIT_TOLERANCE``)."""
    relative = LOGIT_TOLERANCE.get(dtype, LOGIT_TOLERANCE[torch.bfloat16])
    return relative * max(1.0, max_abs_logit)


def encode_probe(probe: dict) -> bytes:
    """A probe as bytes for the wire: an 8-byte little-endian header length, a JSON header, float32 logits."""
    logits = probe["logits"].to(torch.float32).contiguous().cpu()
    header = {k: v for k, v in probe.items() if k != "logits"}
    header["logits_shape"] = list(logits.shape)
    head = json.dumps(header, separators=(",", ":")).encode()
    return _PROBE_HEADER.pack(len(head)) + head + logits.numpy().tobytes()


def decode_probe(data: bytes) -> dict:
    """The inverse of :func:`encode_probe`."""
    try:
        (n,) = _PROBE_HEADER.unpack_from(data)
        header = json.loads(data[_PROBE_HEADER.size : _PROBE_HEADER.size + n].decode())
        shape = tuple(int(d) for d in header.pop("logits_shape"))
        raw = data[_PROBE_HEADER.size + n :]
        if len(raw) != 4 * math.prod(shape):
            raise ValueError(f"{len(raw)} bytes of logits for shape {list(shape)}")
        logits = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
    except (struct.error, UnicodeDecodeError, ValueError, KeyError) as e:
        raise VerificationError(f"the producer's model probe is malformed ({e})") from e
    header["logits"] = logits
    return header


def decisive_token_mismatch(
    mine: list[int], expected: list[int], margins: list[float], min_margin: float, who: str
) -> str | None:
    """Where ``mine`` (the consumer's greedy tokens) differs from the producer's at a position the producer decided
    by more than ``min_margin`` (top-1 minus top-2 logit): a near-tie may round either way, a clear win may not.
    Returns the problem as a phrase naming ``who``, or None."""
    decisive = [i for i, (a, b, m) in enumerate(zip(mine, expected, margins)) if a != b and m > min_margin]
    if not decisive:
        return None
    i = decisive[0]
    return (
        f"greedy tokens differ at {len(decisive)} of {len(expected)} position(s) (first: position {i}, "
        f"producer {expected[i]}, {who} {mine[i]}, producer margin {margins[i]:.3g})"
    )

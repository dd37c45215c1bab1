"""How the aggregator runs rounds: deadlines, quorum, the scheme of the mean it returns."""

from __future__ import annotations

from dataclasses import dataclass

from gradq.qcore import QuantConfig, Scheme, codec_for
from gradq.qcore.codecs.uniform import UniformCodec

__all__ = ["AUTO_FEEDBACK_BITS", "RoundPolicy", "PushedGrid", "feeds_back", "return_config_for"]

# Return grids of at most this many bits get server error feedback by default (RoundPolicy).
AUTO_FEEDBACK_BITS = 4


@dataclass(frozen=True, slots=True)
class RoundPolicy:
    """Operator's choices for every round on this aggregator.

    Args:
        world_size: ranks per job (a Join's ``job_ranks``: the launcher's world
            size, not its members); 0 lets each job's first Join decide.
        round_timeout_s: a round not complete this long after its first
            contribution fails for every waiter, naming the missing ranks.
        partial_quorum: 0 for strict rounds; else a round at its deadline with at
            least this many ranks completes over them and says so. It counts
            ranks, as world_size does: a member standing for a host's L ranks
            (two-level aggregation) counts L; a job with fewer ranks is refused
            at Join, since none of its rounds could close short.
        return_scheme: None returns the mean on the pushers' own grid
            (scheme, bits, channel size); else this scheme (e.g. FLOAT16).
        return_bits: bits for a quantized ``return_scheme`` (ignored otherwise).
        server_error_feedback: carry the re-quantization error of the mean
            into the next round of the same bucket. None (the default) does so
            where the mean goes back on a uniform grid of at most
            ``AUTO_FEEDBACK_BITS`` bits (not the scaled sign's), and always
            where it goes back sparse (sparse_topk): re-rounding
            it the same way every step, with nothing carrying the error,
            biases it (at 2 bits the parameters' sum moved 80x as far as
            with the push leg alone under AdamW: bench/low_bit_bias.py), while at 8 bits a step is 1/255 of the
            range. True: on any quantized return grid; False: never. Costs a
            fp32 residual per round key, charged to the job's memory budget.
        retain_steps: finished rounds of this many steps behind the newest are
            kept so retried pushes get their answer; older ones are stale.
        max_bucket_elements: largest bucket accepted. A 1-bit payload is 32x
            smaller than its fp32 accumulator, so the message-size limit alone
            would let one push allocate 32 GiB.
        non_finite: when a rank reports NaN/Inf gradients: "reject" fails the
            round for every rank with INVALID_ARGUMENT; "skip" completes it with
            a zero mean marked skipped, so every rank skips the step together.
    """

    world_size: int = 0
    round_timeout_s: float = 30.0
    partial_quorum: int = 0
    return_scheme: Scheme | None = None
    return_bits: int = 8
    server_error_feedback: bool | None = None
    retain_steps: int = 2
    max_bucket_elements: int = 1 << 28
    non_finite: str = "reject"

    def __post_init__(self) -> None:
        if self.world_size < 0:
            raise ValueError(f"world_size={self.world_size} is invalid; expected 0 (set by Join) or >= 1")
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s={self.round_timeout_s} is invalid; expected > 0 seconds")
        if self.partial_quorum < 0 or (self.world_size and self.partial_quorum > self.world_size):
            raise ValueError(f"partial_quorum={self.partial_quorum} is invalid; expected 0 (strict) or 1..world_size")
        if self.non_finite not in ("reject", "skip"):
            raise ValueError(f"non_finite={self.non_finite!r} is invalid; expected 'reject' or 'skip'")
        if self.max_bucket_elements < 1:
            raise ValueError(f"max_bucket_elements={self.max_bucket_elements} is invalid; expected >= 1")
        if self.retain_steps < 1:
            raise ValueError(f"retain_steps={self.retain_steps} is invalid; expected >= 1")
        if self.return_scheme is not None:
            QuantConfig(scheme=self.return_scheme, bits=self.return_bits)


@dataclass(frozen=True, slots=True)
class PushedGrid:
    """What a round remembers of its first contribution: enough to validate and answer."""

    scheme: Scheme
    bits: int
    channel_size: int
    numel: int
    dtype: str
    topk: int = 0  # the sparse scheme's entries per chunk


def feeds_back(policy: RoundPolicy, pushed: PushedGrid) -> bool:
    """Whether a round's mean is encoded with server error feedback (see ``RoundPolicy.server_error_feedback``).

    A float return (fp32, fp16) keeps what a residual would carry, or nearly,
    so it holds no residual and is charged none.
    """
    config = return_config_for(policy, pushed)
    if policy.server_error_feedback is False or not config.scheme.is_quantized:
        return False
    codec = codec_for(config.scheme)
    # Not the scaled sign by default: its residual holds every magnitude the mean lost, and fed back under
    # SGD with momentum it grew until the digits MLP diverged (bench/convergence.py, twice). Always a
    # re-sparsified mean: without its residual the entries outside the mean's top-k would never reach a host.
    uniform = isinstance(codec, UniformCodec)
    low_bits = uniform and codec.wire_bits(config) <= AUTO_FEEDBACK_BITS
    return bool(policy.server_error_feedback) or codec.sparse or low_bits


def return_config_for(policy: RoundPolicy, pushed: PushedGrid) -> QuantConfig:
    """The grid the round's mean goes back on: the policy's, or the one the pushers' codec returns.

    A policy's scheme keeps the pushers' channel size (their codec's choice for the mean).
    """
    own = codec_for(pushed.scheme).mean_config(pushed.bits, pushed.channel_size, pushed.topk)
    if policy.return_scheme is None:
        return own
    return QuantConfig(scheme=policy.return_scheme, bits=policy.return_bits, channel_size=own.channel_size)
